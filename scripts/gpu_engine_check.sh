#!/usr/bin/env bash
# Engine checks on a fresh CUDA box (H200): one run, a few minutes. Needs .whl/ and .gpu/ carried, as
# scripts/gpu_bundle.sh builds them (wheels for Python 3.12, the TileLang bundle, SmolLM2's tokenizer).
# Arguments go to gpu_engine_check.py (--skip N ... to leave sections out).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=/tmp/dk_tilelang_cache
SITE=/tmp/dk_site
mkdir -p "$SITE"
ln -sfn "$PWD/kernels" "$SITE/deepinfer_kernels"
shopt -s nullglob
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
for t in .whl/*.tar.xz; do tar -xJf "$t" -C "$SITE" || exit 1; done
export PYTHONPATH="$SITE:$PWD"
python3 scripts/gpu_engine_check.py "$@" 2>&1 | tee "${OUT:-/tmp}/engine_check.log"
