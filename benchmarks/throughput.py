"""Output tokens/s of DeepInfer in each precision (fp32 vs GGUF blocks as stored) vs HF transformers
`generate` and, where its environment exists, llama.cpp, side by side, on the default model.

Greedy, EOS ignored, the same ~20-token prompts for all; HF runs the same weights in fp32. Also batch-1
decode speed against the memory roofline (bytes of weights read per token / measured bandwidth).

This VM's speed drifts by 10-20% within minutes (HF's included), so every figure is the best of
`--repeats` runs, ours and HF's alternating, and the roofline's bandwidth probe alternates with the
batch-1 decode runs in the same way: both sides of every ratio see the same conditions.

    python benchmarks/throughput.py [--batches 1 8 32 128] [--new-tokens 64] [--repeats 2] [--no-hf]
        [--precisions float32 auto quantized_exact] [--peers DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch

from common import hf_reference_model, make_prompts, read_bandwidth_gbs, timed
from deepinfer import Engine, SamplingParams


def hf_generate(hf, tokenizer, prompts, new_tokens):
    ids = [tokenizer.encode(p) for p in prompts]
    L = max(map(len, ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (L - len(x)) + x for x in ids])  # left padding
    mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in ids])
    with torch.inference_mode():
        out = hf.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=pad,
        )
    return out.shape[0] * new_tokens


PEER_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
gguf, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=gguf, n_ctx=512, n_batch=512, verbose=False, seed=0)
llm("warm up", max_tokens=2, temperature=0)
t = time.perf_counter()
for p in prompts:  # llama-cpp-python serves one sequence at a time; EOS banned so every run is n tokens
    llm(p, max_tokens=n, temperature=0, logit_bias={llm.token_eos(): -1e9})
print(json.dumps({"tokens": len(prompts) * n, "seconds": time.perf_counter() - t}))
"""


def llamacpp_peer(peers_dir: str | None):
    """The llama.cpp peer's python (DIR/llamacpp, built by ../shared/peers/setup.sh) or None, with why."""
    if not peers_dir:
        return None, "no --peers directory given (DEEPINFER_PEERS unset)"
    py = os.path.join(peers_dir, "llamacpp", "bin", "python")
    if not os.path.exists(py):
        return None, f"{py} not found (build with ../shared/peers/setup.sh {peers_dir} llamacpp: ~40 min on 2 cores)"
    import subprocess

    if subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode != 0:
        return None, f"{py} cannot import llama_cpp (its build did not finish)"
    return py, ""


def run_llamacpp(py: str, gguf: str, prompts: list[str], n: int) -> float:
    import json
    import subprocess

    r = subprocess.run([py, "-c", PEER_SCRIPT, gguf, json.dumps(prompts), str(n)], capture_output=True, text=True,
                       check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["tokens"] / out["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    # engine precisions run side by side (one engine each, alternating): the first is the baseline
    ap.add_argument("--precisions", nargs="+", default=["float32", "auto"],
                    help="Engine(dtype=...) values: float32, auto, quantized, quantized_exact")
    ap.add_argument("--peers", default=os.environ.get("DEEPINFER_PEERS"),
                    help="directory built by ../shared/peers/setup.sh (llama.cpp is run from DIR/llamacpp)")
    args = ap.parse_args()
    n = args.new_tokens

    engines = {p: Engine(kv_cache_memory=1 << 30, dtype=p) for p in args.precisions}
    engine = engines[args.precisions[-1]]
    hf = tok = None
    if not args.no_hf:
        hf, tok = hf_reference_model()
    peer_py, why = llamacpp_peer(args.peers)
    print(f"llama.cpp peer: {'found at ' + peer_py if peer_py else 'skipped: ' + why}")
    print("vLLM CPU peer: not run by this script (see benchmarks/structured.py and ../shared/peers/setup.sh)")
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for e in engines.values():  # warm-up
        e.generate(make_prompts(2, seed=99), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    print(f"threads={torch.get_num_threads()}  new_tokens={n}  best of {args.repeats}  model={os.path.basename(engine.model_source)}")
    for p, e in engines.items():
        print(f"  dtype={p!r}: precision {e.precision}, resident weights {e.stats.weight_bytes / 1e6:.1f} MB "
              f"= {e.stats.weight_bytes / max(e.stats.checkpoint_bytes, 1):.2f}x the checkpoint's {e.stats.checkpoint_bytes / 1e6:.1f} MB")
    base = args.precisions[0]
    cols = "".join(f" {p + ' tok/s':>22}" for p in args.precisions)
    ratios = "".join(f" {p + '/' + base:>24}" for p in args.precisions[1:])
    print(f"{'batch':>6}{cols}{ratios} {'hf tok/s':>10} {'llama.cpp tok/s':>16}")
    best_hf, ours_at = 0.0, {}
    for b in args.batches:
        prompts = make_prompts(b, seed=b)
        ours = {p: 0.0 for p in args.precisions}
        theirs = peer = 0.0
        for _ in range(args.repeats):
            for p, e in engines.items():  # alternating, so each ratio's sides see the same conditions
                e.reset_prefix_cache()
                _, t = timed(e.generate, prompts, sp)
                ours[p] = max(ours[p], b * n / t)
            if hf is not None:
                toks, t_hf = timed(hf_generate, hf, tok, prompts, n)
                theirs = max(theirs, toks / t_hf)
            if peer_py:
                peer = max(peer, run_llamacpp(peer_py, engine.model_source, prompts, n))
        ours_at[b] = ours[args.precisions[-1]]
        best_hf = max(best_hf, theirs)
        vals = "".join(f" {ours[p]:>22.1f}" for p in args.precisions)
        rs = "".join(f" {ours[p] / ours[base]:>24.2f}" for p in args.precisions[1:])
        print(f"{b:>6}{vals}{rs} {theirs if hf is not None else '-':>10} {peer if peer_py else '-':>16}")
    if hf is not None:
        print(f"best deepinfer / best hf: {max(ours_at.values()) / best_hf:.2f}  (target >= 1.5)")

    # batch-1 decode vs the memory roofline
    # a decode step reads every weight once (the resident weights: quantised blocks as stored, or
    # fp32 packed panels), except the embedding table of an untied model (one row); with packed
    # copies only the packed one is read, so count the weights once
    mc = engine.model_config
    weight_bytes = engine.stats.weight_bytes
    if engine.precision == "float32":
        weight_bytes = sum(p.numel() for p in engine.runner.model.parameters()) * 4
    if not mc.tie_word_embeddings:
        weight_bytes -= mc.vocab_size * mc.hidden_size * (4 if engine.precision == "float32" else 1)
    prompt = make_prompts(1, seed=7)
    bw = decode = 0.0
    for _ in range(max(args.repeats, 3)):
        bw = max(bw, read_bandwidth_gbs())
        engine.reset_prefix_cache()
        _, t1 = timed(engine.generate, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        engine.reset_prefix_cache()
        _, t2 = timed(engine.generate, prompt, SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
        decode = max(decode, n / max(t2 - t1, 1e-9))
    roofline = bw * 1e9 / weight_bytes
    print(
        f"batch-1 decode: {decode:.1f} tok/s; roofline {roofline:.1f} tok/s "
        f"({weight_bytes / 1e6:.0f} MB weights at {bw:.1f} GB/s) -> {decode / roofline:.0%} of roofline (target >= 60%)"
    )


if __name__ == "__main__":
    main()
