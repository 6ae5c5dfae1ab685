"""Engine checks and timings on a CUDA device, in one run (python scripts/gpu_engine_check.py).

1. tiny random Llama, fp32 on the device: greedy tokens and logprobs vs transformers on the device;
2. the same with deepinfer_kernels forced to TileLang vs torch (greedy equal);
3. batch-invariant mode: one prompt alone vs inside random batches;
4. a SmolLM2-135M-shaped model (random weights, bf16; the real GGUF is too big to carry): output
   tokens/s at batch 1/32/128, and the overlapped vs synchronous loop at batch 64 (idle share).
Pass --device cpu to dry-run the script here.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch

from deepinfer import Engine, SamplingParams


def section(name):
    print(f"\n== {name}", flush=True)


def tiny_vs_hf(dev, root):
    import transformers
    from model_factory import make_tiny_model

    path = make_tiny_model(root / "tiny", "llama")
    eng = Engine(str(path), device=dev, dtype="float32", kv_cache_memory=64 << 20)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(dev).eval()
    prompts = ["The quick brown fox", "Hello world! How are", "def add(a, b):"]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outs = eng.generate(prompts, sp)
    worst, same = 0.0, 0
    for p, o in zip(prompts, outs):
        ids = eng.tokenizer.encode(p)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids], device=dev), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
            lp = torch.log_softmax(hf(torch.tensor([ids + o.token_ids], device=dev)).logits[0].float(), -1)
        same += ref == o.token_ids
        for i, t in enumerate(o.logprobs):
            worst = max(worst, abs(t.logprob - lp[len(ids) - 1 + i, t.token_id].item()))
    print(f"greedy equal to transformers: {same}/{len(prompts)}; max logprob diff {worst:.2e}")
    return path


def kernels_vs_torch(dev, path):
    prompts = [" ".join(["hello world how are you"] * k) for k in (1, 3, 7, 20)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    a = Engine(str(path), device=dev, dtype="float32", kv_cache_memory=64 << 20, kernels="torch").generate(prompts, sp)
    e = Engine(str(path), device=dev, dtype="float32", kv_cache_memory=64 << 20, kernels="tilelang")
    b = e.generate(prompts, sp)
    print(f"kernels=tilelang (decode kernel {'on' if e.runner.decode_kernel else 'off'}) greedy equal to torch: "
          f"{[x.token_ids for x in a] == [y.token_ids for y in b]}")


def batch_invariance(dev, path, dtype):
    eng = Engine(str(path), device=dev, dtype=dtype, kv_cache_memory=64 << 20, batch_invariant=True, max_num_batched_tokens=96)
    r = random.Random(0)
    words = "the quick brown fox jumps over lazy dog hello world".split()
    needle = "the quick brown fox jumps over the lazy dog " * 3
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=0)
    ref = eng.generate([needle], sp)[0]
    bad = 0
    for _ in range(8):
        n = r.randint(2, 48)
        others = [" ".join(r.choice(words) for _ in range(r.randint(1, 50))) for _ in range(n - 1)]
        pos = r.randint(0, n - 1)
        out = eng.generate(others[:pos] + [needle] + others[pos:], [SamplingParams(max_tokens=r.randint(1, 12))] * pos + [sp]
                           + [SamplingParams(max_tokens=5)] * (n - 1 - pos))[pos]
        bad += out.token_ids != ref.token_ids or [x.logprob for x in out.logprobs] != [x.logprob for x in ref.logprobs]
    print(f"batch-invariant ({dtype}): {8 - bad}/8 random batches bitwise equal to the prompt alone")


def smollm_shaped(dev, root):
    """A random-weight model with SmolLM2-135M's config and tokenizer (carried in .gpu/smollm2_tok)."""
    import transformers

    tok_dir = ROOT / ".gpu" / "smollm2_tok"
    cfg = json.loads((tok_dir / "config.json").read_text())
    out = root / "smollm_random"
    out.mkdir(exist_ok=True)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16)
    model.save_pretrained(str(out))
    for f in tok_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def throughput(dev, path):
    prompts = [f"Question {i}: please explain topic number {i} to a curious student in simple words." for i in range(128)]
    for overlap in (False, True):
        eng = Engine(str(path), device=dev, kv_cache_memory=4 << 30, overlap_schedule=overlap)
        eng.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))
        row = []
        for b in (1, 32, 64, 128):
            sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            eng.reset_prefix_cache()
            g0, t = eng.stats.idle_gap_time, time.perf_counter()
            eng.generate(prompts[:b], sp)
            dt = time.perf_counter() - t
            row.append(f"b{b}: {b * 64 / dt:.0f} tok/s idle {(eng.stats.idle_gap_time - g0) / dt:.0%}")
        print(("overlap " if overlap else "sync    ") + "; ".join(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip", nargs="*", default=[])
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda":
        print(torch.cuda.get_device_name(0), torch.__version__)
    root = pathlib.Path(tempfile.mkdtemp())
    path = None
    steps = [
        ("tiny llama vs transformers (fp32)", lambda: tiny_vs_hf(dev, root)),
        ("kernels on vs off", lambda: kernels_vs_torch(dev, path)),
        ("batch invariance fp32", lambda: batch_invariance(dev, path, "float32")),
        ("batch invariance bf16", lambda: batch_invariance(dev, path, "bfloat16")),
        ("SmolLM2-shaped throughput, overlap vs sync", lambda: throughput(dev, smollm_shaped(dev, root))),
    ]
    for i, (name, fn) in enumerate(steps):
        if str(i) in args.skip:
            continue
        section(name)
        try:
            r = fn()
            if i == 0:
                path = r
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
