"""Memory of loading the default GGUF per precision: resident weight bytes (engine stats) and the peak
RSS growth while the Engine is built, each against the checkpoint's bytes. Each dtype loads in its own
subprocess (a fresh peak); the peak is measured from after the imports (the process's VmHWM reset
through /proc/self/clear_refs where the kernel allows, else the growth of VmHWM).

    python benchmarks/load_memory.py [--dtypes quantized_exact quantized float32] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys
import torch
from deepinfer import Engine

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0

torch.zeros(1).add_(1)
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
except OSError:
    pass
base_rss, base_hwm = status("VmRSS"), status("VmHWM")
eng = Engine(sys.argv[2] if len(sys.argv) > 2 else None, dtype=sys.argv[1], kv_cache_memory=16 << 20)
out = {"precision": eng.precision, "weight_bytes": eng.stats.weight_bytes,
       "checkpoint_bytes": eng.stats.checkpoint_bytes, "peak_growth": status("VmHWM") - max(base_rss, 0),
       "rss_growth": status("VmRSS") - base_rss}
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["quantized_exact", "quantized", "float32"])
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    print(f"{'dtype':>16} {'precision':>16} {'ckpt MB':>8} {'resident MB':>11} {'x ckpt':>6} "
          f"{'peak growth MB':>14} {'x ckpt':>6} {'RSS growth MB':>13}")
    for dt in args.dtypes:
        cmd = [sys.executable, "-c", CHILD, dt] + ([args.model] if args.model else [])
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        ck = r["checkpoint_bytes"]
        print(f"{dt:>16} {r['precision']:>16} {ck / 1e6:>8.1f} {r['weight_bytes'] / 1e6:>11.1f} "
              f"{r['weight_bytes'] / ck:>6.2f} {r['peak_growth'] / 1e6:>14.1f} {r['peak_growth'] / ck:>6.2f} "
              f"{r['rss_growth'] / 1e6:>13.1f}")


if __name__ == "__main__":
    main()
