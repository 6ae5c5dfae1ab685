"""Output tokens/s of a bf16 (or fp16) checkpoint of the default model on CPU in each precision, side
by side: dtype="auto" (projections kept in 16-bit native panels, engine/weights16.py), "float32" (the
checkpoint widened to fp32 panels) and "bfloat16" (torch's bf16 ops, no native kernels), plus each
engine's resident weight bytes against the checkpoint's.

The checkpoint is made from the default model (its GGUF dequantised by the loader, rounded to the
16-bit type, saved with its config and tokenizer as a model directory), unless --model-dir is given.
Greedy, EOS ignored, the ~20-token prompts of common.make_prompts; output tok/s = batch x new tokens
/ generate() wall time (prefill included). Every arm runs in turn in one process, the order reversed
every other repeat; the table gives each arm's median and best over the repeats and the ratio of
medians to float32.

    python benchmarks/weights16.py [--batches 1 8 32 128] [--new-tokens 32] [--repeats 3]
        [--dtypes auto float32 bfloat16] [--checkpoint-dtype bfloat16] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import torch

from common import make_prompts, timed, run_on_compute_thread

from deepinfer import Engine, SamplingParams


def make_16bit_checkpoint(out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, model: str | None = None) -> Path:
    """A model directory at out_dir (which must not exist) holding `model` (default: the default
    model) with every floating-point tensor stored as `dtype`."""
    from deepinfer.engine.loader import load_model
    from deepinfer.engine.loader.cache import write_entry

    loaded = load_model(model)
    weights = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in loaded.weights.items()}
    write_entry(Path(out_dir), loaded.config, weights, loaded.tokenizer)
    return Path(out_dir)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["auto", "float32", "bfloat16"])
    ap.add_argument("--checkpoint-dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--model-dir", default=None, help="a 16-bit model directory (default: made from the default model)")
    args = ap.parse_args()

    tmp = None
    path = args.model_dir
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="deepinfer-w16-")
        path = str(make_16bit_checkpoint(Path(tmp.name) / "model", getattr(torch, args.checkpoint_dtype)))
    n = args.new_tokens
    top = max(args.batches)
    engines = {d: Engine(path, dtype=d, kv_cache_memory=1 << 30, max_num_seqs=max(top, 8)) for d in args.dtypes}
    print(f"checkpoint {path}: {args.checkpoint_dtype}, torch threads {torch.get_num_threads()}")
    for d, e in engines.items():
        ws, cs = e.stats.weight_bytes, e.stats.checkpoint_bytes
        print(f"  dtype={d:9s} precision {e.precision:17s} resident weights {ws / 1e6:8.1f} MB = {ws / cs:.2f}x the "
              f"checkpoint's {cs / 1e6:.1f} MB")
    prompts = make_prompts(top)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for e in engines.values():  # first-use costs (kernel builds, allocator) outside the timing
        e.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    rates: dict[tuple[int, str], list[float]] = {}
    for b in args.batches:
        for r in range(args.repeats):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for d in order:
                _, t = timed(engines[d].generate, prompts[:b], sp)
                rates.setdefault((b, d), []).append(b * n / t)
        row = [f"batch {b:4d}:"]
        ref = statistics.median(rates[(b, "float32")]) if "float32" in engines else None
        for d in engines:
            med, best = statistics.median(rates[(b, d)]), max(rates[(b, d)])
            ratio = f" ({med / ref:.2f}x fp32)" if ref and d != "float32" else ""
            row.append(f"{d} {med:7.1f} tok/s (best {best:7.1f}){ratio}")
        print("  ".join(row), flush=True)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    run_on_compute_thread(main)  # (common.py: one OpenMP thread for engine and reference)
