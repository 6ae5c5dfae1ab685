#!/usr/bin/env bash
# The block-FP8 GPU path in one device call (about 4.5 minutes on a fresh H200, all parts): needs .whl/ and .gpu/
# carried, as scripts/gpu_bundle.sh builds them.
#   1. pytest -m gpu tests/kernels/test_fp8_gemm.py: the W8A16 kernels against their torch definition,
#      and bf16 engines keeping FP8 against the same checkpoints dequantised (in the background, -n 4:
#      TileLang compiles each kernel with nvcc, one core each; about 95 s);
#   2. gpu_engine_check.py section 4: benchmarks/moe.py's models as FP8 checkpoints, kept vs dequantised
#      (weight bytes, greedy agreement, tokens/s at batch 1, 32, 128);
#   3. benchmarks/kernels.py --ops fp8: the kernels alone against cuBLAS on the dequantised weights,
#      run last, with the GPU otherwise idle (its kernels compiled into TileLang's disk cache by a
#      background run during 2).
# Arguments: the parts to run, of "tests engine bench" (all by default).
# Logs go to $OUT (or ./gpu_check_out): pytest.log, engine.log, bench.log, bench.json.
set -uo pipefail
PARTS=" ${*:-tests engine bench} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-gpu_check_out}
mkdir -p "$OUTDIR"
source scripts/gpu_site.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)" || exit 1

rc_test=0 rc_engine=0 rc_bench=0
if want tests; then
    echo "== 1. pytest -m gpu tests/kernels/test_fp8_gemm.py (background)"
    timeout ${PYTEST_S:-300} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/kernels/test_fp8_gemm.py \
        >"$OUTDIR/pytest.log" 2>&1 &
    pytest_pid=$!
fi
if want bench; then  # its kernels compiled into TileLang's disk cache meanwhile
    timeout ${WARM_S:-240} python3 benchmarks/kernels.py --device cuda --ops fp8 --iters 1 >/tmp/bench_warm.log 2>&1 &
fi
if want engine; then
    echo "== 2. engine: block-FP8 checkpoints kept vs dequantised"
    timeout ${ENGINE_S:-330} python3 scripts/gpu_engine_check.py --skip 0 1 2 3 5 6 7 8 9 2>&1 | tee "$OUTDIR/engine.log"
    rc_engine=${PIPESTATUS[0]}
fi
if want tests; then
    wait $pytest_pid
    rc_test=$?
    cat "$OUTDIR/pytest.log"
fi
wait
if want bench; then
    echo "== 3. benchmarks/kernels.py --ops fp8"
    timeout ${BENCH_S:-120} python3 benchmarks/kernels.py --device cuda --ops fp8 --json "$OUTDIR/bench.json" 2>&1 \
        | tee "$OUTDIR/bench.log"
    rc_bench=${PIPESTATUS[0]}
fi
echo "pytest rc=$rc_test engine rc=$rc_engine bench rc=$rc_bench"
[ "$rc_test" -eq 0 ] && [ "$rc_engine" -eq 0 ] && [ "$rc_bench" -eq 0 ]
