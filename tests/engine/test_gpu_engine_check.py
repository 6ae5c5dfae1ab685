"""scripts/gpu_engine_check.py runs end to end on the CPU (--device cpu --tiny), so the script a GPU
machine runs is known not to crash before it gets there: every section that can run without CUDA
runs, none raises, and each prints its figures."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~3 min on the loaded 2-core CPU (TileLang compiles, xgrammar on a 49k vocab)
def test_gpu_engine_check_smoke_on_cpu():
    from deepinfer_kernels import _tilelang

    skip = [] if _tilelang.available() else ["--skip", "1"]  # kernels=tilelang needs TileLang
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_engine_check.py"), "--device", "cpu", "--tiny", *skip],
                       capture_output=True, text=True, timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "sections raising: none" in out
    for line in ("greedy equal to transformers: 3/3", "json valid", "regex match", "device draws equal to CPU draws",
                 "graphs off overlap off: b1:", "graphs off overlap on : b1:", "cuda_graphs=True: skipped (needs CUDA)",
                 "batch-1 decode:", "PASS: greedy outputs equal with graphs and overlap on/off",
                 "PASS: v3: kept FP8 agrees with the dequantised weights"):
        assert line in out, line
