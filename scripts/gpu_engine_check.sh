#!/usr/bin/env bash
# Engine checks on a fresh CUDA box (H200): one run, a few minutes. Needs .whl/ and .gpu/ carried, as
# scripts/gpu_bundle.sh builds them (wheels for Python 3.12, the TileLang bundle, SmolLM2's tokenizer).
# Arguments go to gpu_engine_check.py (--skip N ... to leave sections out).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_site.sh || exit 1
python3 scripts/gpu_engine_check.py "$@" 2>&1 | tee "${OUT:-/tmp}/engine_check.log"
