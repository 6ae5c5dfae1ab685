"""Sampler time per step, this tree's batched sampler vs a baseline revision's, side by side.

The baseline's engine/sampler.py is read from git (`--baseline`, default main) and loaded as a
module next to this tree's; both sample the same logits with the same rows, alternating, and the
figure is the best-of-reps time of each and their ratio (baseline / ours, > 1 = ours faster). The
time includes building the per-row parameters (the host work a step pays), on the CPU here.

    python benchmarks/sampler.py [--batches 32 128] [--vocab 49152] [--baseline main] [--reps 20]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

import torch

from common import best_ms
from deepinfer import SamplingParams
from deepinfer.engine import sampler as ours

MIXES = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "temp": lambda i: SamplingParams(temperature=0.8, seed=i),
    "top_p/k": lambda i: SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i),
    "penalties": lambda i: SamplingParams(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2, seed=i),
    "mixed": lambda i: [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=i),
                        SamplingParams(temperature=0.7, top_p=0.95, seed=i),
                        SamplingParams(temperature=1.0, presence_penalty=0.5, seed=i)][i % 4],
}


def load_baseline(rev: str):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "-C", root, "show", f"{rev}:deepinfer/engine/sampler.py"],
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "baseline_sampler.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["baseline_sampler"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--baseline", default="main")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--mixes", nargs="+", default=list(MIXES))
    a = ap.parse_args()
    base = load_baseline(a.baseline)
    rnd = random.Random(0)
    print(f"sampler ms/step, vocab {a.vocab}, CPU, {torch.get_num_threads()} threads (shared machine: best of {a.reps})")
    for B in a.batches:
        logits = torch.randn(B, a.vocab, generator=torch.Generator().manual_seed(B)) * 3
        for mix in a.mixes:
            params = [MIXES[mix](i) for i in range(B)]
            out_ids = [[rnd.randrange(a.vocab) for _ in range(64)] for _ in range(B)]
            prompt = [[rnd.randrange(a.vocab) for _ in range(200)] for _ in range(B)]
            rows_b = [base.SamplingRow(p, 7 + i, 300, prompt[i], out_ids[i], []) for i, p in enumerate(params)]
            rows_o = [ours.SamplingRow(p, 7 + i, 300, prompt[i], out_ids[i], []) for i, p in enumerate(params)]
            sb, so = base.Sampler(), ours.Sampler(fused="never")
            tb = best_ms(lambda: sb.sample(logits.clone(), rows_b), 1)
            to = best_ms(lambda: so.sample(logits.clone(), so.prepare(rows_o, a.vocab, logits.device)), 1)
            for _ in range(a.reps - 1):  # alternate so both see the same load
                tb = min(tb, best_ms(lambda: sb.sample(logits.clone(), rows_b), 1))
                to = min(to, best_ms(lambda: so.sample(logits.clone(), so.prepare(rows_o, a.vocab, logits.device)), 1))
            same = torch.equal(sb.sample(logits.clone(), rows_b),
                               so.sample(logits.clone(), so.prepare(rows_o, a.vocab, logits.device)))
            print(f"B={B:4d} {mix:10s} baseline {tb:8.3f} ms  ours {to:8.3f} ms  ratio {tb / to:5.2f}x  tokens identical: {same}")


if __name__ == "__main__":
    main()
