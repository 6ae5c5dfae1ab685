"""Output tokens/s of DeepInfer vs HF transformers `generate`, side by side, on the default model.

Greedy, EOS ignored, the same ~20-token prompts and the same fp32 weights for both. Also batch-1
decode speed against the memory roofline (bytes of weights read per token / measured bandwidth).

This VM's speed drifts by 10-20% within minutes (HF's included), so every figure is the best of
`--repeats` runs, ours and HF's alternating, and the roofline's bandwidth probe alternates with the
batch-1 decode runs in the same way: both sides of every ratio see the same conditions.

    python benchmarks/throughput.py [--batches 1 8 32 128] [--new-tokens 64] [--repeats 2] [--no-hf]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    n = args.new_tokens

    engine = Engine(kv_cache_memory=1 << 30)
    hf = tok = None
    if not args.no_hf:
        hf, tok = hf_reference_model()
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    engine.generate(make_prompts(2, seed=99), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up

    print(f"threads={torch.get_num_threads()}  new_tokens={n}  best of {args.repeats}  model={os.path.basename(engine.model_source)}")
    print(f"{'batch':>6} {'deepinfer tok/s':>16} {'hf tok/s':>10} {'ratio':>7}")
    best_hf, ours_at = 0.0, {}
    for b in args.batches:
        prompts = make_prompts(b, seed=b)
        ours = theirs = 0.0
        for _ in range(args.repeats):
            engine.reset_prefix_cache()
            _, t_ours = timed(engine.generate, prompts, sp)
            ours = max(ours, b * n / t_ours)
            if hf is not None:
                toks, t_hf = timed(hf_generate, hf, tok, prompts, n)
                theirs = max(theirs, toks / t_hf)
        ours_at[b] = ours
        if hf is not None:
            best_hf = max(best_hf, theirs)
            print(f"{b:>6} {ours:>16.1f} {theirs:>10.1f} {ours / theirs:>7.2f}")
        else:
            print(f"{b:>6} {ours:>16.1f} {'-':>10} {'-':>7}")
    if hf is not None:
        print(f"best deepinfer / best hf: {max(ours_at.values()) / best_hf:.2f}  (target >= 1.5)")

    # batch-1 decode vs the memory roofline
    mc = engine.model_config
    params = sum(p.numel() for p in engine.runner.model.parameters())
    emb = mc.vocab_size * mc.hidden_size
    # a decode step reads every weight once, except the embedding table (one row), which a tied
    # model still reads whole as the lm_head
    read_params = params - (0 if mc.tie_word_embeddings else emb)
    weight_bytes = read_params * engine.runner.model.embed_tokens.element_size()
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
