#!/usr/bin/env bash
# GPU check of the custom kernels, for a fresh CUDA box (H200) with the repo copied to it.
# Runs `pytest -m gpu tests/kernels` and the kernel benchmark; about 4-6 minutes in all.
#
# TileLang: used if it imports. Otherwise installed into /tmp/dk_site, offline, from .whl/:
# any *.whl there (pip --no-index --no-deps) plus any *.tar.xz bundles, which are unpacked
# site-packages trees (a slimmed tilelang + libz3, to stay under a 64 MiB carry limit).
# deepinfer_kernels is put on the path through a symlink, so no pip install -e is needed.
# Results: stdout, and $OUT (or ./gpu_check_out) gets pytest.log, bench.log and bench.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-gpu_check_out}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/dk_tilelang_cache}

SITE=/tmp/dk_site
mkdir -p "$SITE"
ln -sfn "$PWD/kernels" "$SITE/deepinfer_kernels"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

if ! $PY -c "import tilelang" >/dev/null 2>&1; then
    echo "tilelang not importable: installing from .whl/"
    shopt -s nullglob
    whls=(.whl/*.whl)
    if [ ${#whls[@]} -gt 0 ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${whls[@]}" || exit 1
    fi
    for t in .whl/*.tar.xz; do tar -xJf "$t" -C "$SITE" || exit 1; done
    if ! $PY -c "import tilelang" ; then
        [ -n "$(ls .whl 2>/dev/null)" ] || $PY -m pip install -q "tilelang==0.1.15" || true
    fi
fi
$PY -c "import tilelang, deepinfer_kernels; print('tilelang', tilelang.__version__)" || exit 1

echo "== pytest -m gpu tests/kernels"
timeout 330 $PY -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tee "$OUTDIR/pytest.log"
rc_test=${PIPESTATUS[0]}

echo "== benchmarks/kernels.py --device cuda"
timeout 240 $PY benchmarks/kernels.py --device cuda --json "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/bench.log"
rc_bench=${PIPESTATUS[0]}

echo "pytest rc=$rc_test bench rc=$rc_bench"
[ "$rc_test" -eq 0 ] && [ "$rc_bench" -eq 0 ]
