"""Engine checks and timings on a CUDA device, in one run (python scripts/gpu_engine_check.py).

1. tiny random Llama, fp32: greedy tokens and logprobs vs transformers on the same device;
2. the same with deepinfer_kernels forced to TileLang vs torch (greedy equal);
3. MoE: tiny Qwen3-MoE, Qwen2-MoE, DeepSeek-V3 and DeepSeek-V2 models (fp32) against transformers on
   the same device; in bf16, their experts through the TileLang grouped GEMM against kernels="torch";
4. benchmarks/moe.py's Qwen3-MoE- and DeepSeek-V3-shaped models (bf16): ours vs transformers
   `generate` on the device at batch 1 / 32 / 128, output tokens/s;
   and the same models as block-FP8 checkpoints: projections kept FP8 (the W8A16 TileLang kernels)
   against the checkpoint dequantised at load: weight bytes, greedy agreement, tokens/s;
5. batch-invariant mode: one prompt alone vs inside random batches (fp32, bf16);
6. a Qwen3-shaped model of ~0.5B parameters (random weights, bf16; the default model's tokenizer):
   a. JSON-schema and regex requests at batch 64, every output validated; constrained /
      unconstrained output tokens/s at batch 64;
   b. penalties (repetition / frequency / presence) through the engine, and the sampler's device
      path against its CPU path on the same logits;
   c. CUDA graphs on/off x overlap on/off: output tokens/s at batch 1/32/128/256, the idle gap
      between forward passes, greedy outputs equal across the four;
   d. achieved memory bandwidth of batch-1 decode (weight + KV bytes per step / step time)
      against the H200's ~4.3 TB/s.
Targets (printed PASS/FAIL): batch-1 decode >= 60% of bandwidth; overlap >= 1.0x sync at every
batch with idle gap < 5%; constrained / unconstrained >= 0.9 at batch 64.

    python scripts/gpu_engine_check.py [--device cuda] [--tiny] [--skip N ...]

`--device cpu --tiny` runs every part that can run without a GPU on small shapes (a smoke test in
tests/engine/test_gpu_engine_check.py); CUDA-only parts print "skipped (needs CUDA)". The exit
status is 1 when any section raised, so a crash is never mistaken for a result.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch

from deepinfer import Engine, SamplingParams

H200_TBPS = 4.3
QWEN3_05B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072)
QWEN3_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128)


def section(name):
    print(f"\n== {name}", flush=True)


def verdict(ok: bool, what: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)


def tiny_vs_hf(dev, root):
    from model_factory import make_tiny_model

    path = make_tiny_model(root / "tiny", "llama")
    same, n = parity_with_hf(dev, path, Engine(str(path), device=dev, dtype="float32", kv_cache_memory=64 << 20))
    verdict(same == n, "greedy parity with transformers on the tiny model")
    return path


def parity_with_hf(dev, path, eng) -> tuple[int, int]:
    """Greedy tokens and per-token logprobs of `eng` against transformers (fp32, same device)."""
    import transformers

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
    return same, len(prompts)


def moe_vs_hf(dev, root):
    """Tiny MoE models of each family, fp32: greedy tokens and logprobs against transformers on the same
    device, and the routed experts through the TileLang grouped GEMM against kernels="torch"."""
    from moe_factory import MOE_ARCHS, make_moe_model

    from deepinfer_kernels import _tilelang

    for arch in MOE_ARCHS:
        path = make_moe_model(root / arch, arch, seed=2)
        eng = Engine(str(path), device=dev, dtype="float32", kv_cache_memory=64 << 20)
        print(f"{arch}: experts on the grouped kernel in {eng.runner.expert_kernel_blocks} layers; ", end="")
        same, n = parity_with_hf(dev, path, eng)
        verdict(same == n, f"{arch}: greedy parity with transformers")
        if _tilelang.available() and dev.startswith("cuda"):  # the kernel serves 16-bit engines (expert_kernels.py)
            prompts = [[5 + (7 * i + j) % 300 for j in range(3 + 9 * i)] for i in range(4)]
            sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
            k16 = Engine(str(path), device=dev, dtype="bfloat16", kv_cache_memory=64 << 20)
            t16 = Engine(str(path), device=dev, dtype="bfloat16", kv_cache_memory=64 << 20, kernels="torch")
            a, b = k16.generate(prompts, sp), t16.generate(prompts, sp)
            first = sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b))
            whole = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
            d = max(abs(x.logprobs[0].logprob - y.logprobs[0].logprob) for x, y in zip(a, b))
            print(f"{arch} bf16: grouped kernel in {k16.runner.expert_kernel_blocks} layers against torch's per-expert "
                  f"GEMMs: first tokens equal {first}/{len(prompts)}, whole greedy runs {whole}/{len(prompts)}, "
                  f"first-token logprob diff {d:.1e}")
            verdict(first == len(prompts) and d < 0.05, f"{arch}: bf16 grouped kernel agrees with torch")


def moe_throughput(dev, root, batches, new_tokens, tiny):
    """benchmarks/moe.py's Qwen3-MoE- and DeepSeek-V3-shaped models (bf16 checkpoints; --tiny: the
    test factory's tiny ones), ours vs transformers `generate` on this device, output tokens/s."""
    import transformers

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import moe as bench
    from moe_factory import make_moe_model

    for kind in ("qwen3", "v3"):
        if tiny:
            path = make_moe_model(root / f"bench_{kind}", {"qwen3": "qwen3_moe", "v3": "deepseek_v3"}[kind], seed=2)
        else:
            path = bench.build(kind, str(root / "bench"), torch.bfloat16)
        vocab = json.loads((pathlib.Path(path) / "config.json").read_text())["vocab_size"]
        dtype = "float32" if tiny else "bfloat16"
        eng = Engine(str(path), device=dev, dtype=dtype, kv_cache_memory=(4 << 30) if dev != "cpu" else 64 << 20,
                     max_num_seqs=max(batches))
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(dev).eval()
        eng.generate(bench.prompts(2, vocab), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        row = []
        for b in batches:
            # an untimed run of each first, so both are timed warm: cuDNN's SDPA backend, which transformers
            # uses as torch picks it, plans per shape (our own first engine on 2026-12-04, before
            # sdpa_scope, ran 2.7-4.0x slower than the same steps later in the process)
            bench.ours(eng, bench.prompts(b, vocab), new_tokens)
            _hf_rate(hf, bench.prompts(b, vocab), new_tokens, dev)
            o = bench.ours(eng, bench.prompts(b, vocab), new_tokens)
            h = _hf_rate(hf, bench.prompts(b, vocab), new_tokens, dev)
            row.append(f"b{b}: ours {o:.0f} / transformers {h:.0f} tok/s = {o / h:.2f}x")
        print(f"{kind} ({dtype}): " + "; ".join(row), flush=True)
        del eng, hf


def fp8_kept_vs_dequantised(dev, root, batches, new_tokens, tiny):
    """benchmarks/moe.py's DeepSeek-V3- and Qwen3-MoE-shaped models saved as block-FP8 checkpoints
    (128 x 128 blocks; --tiny: the factory's tiny models in 16 x 16): the projections kept FP8 (the
    W8A16 kernels on CUDA bf16; on CPU fp32 dequantised per call) against the same checkpoint
    dequantised at load: weight bytes, greedy agreement, every prompt position's logprob against the
    dequantised checkpoint run in fp32 (on CUDA: is FP8 as close to it as cuBLAS bf16 is?), output tokens/s."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import moe as bench
    from fp8_factory import fp8_checkpoint
    from moe_factory import make_moe_model

    cuda = dev.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    for kind in ("v3", "qwen3"):
        if tiny:
            src = make_moe_model(root / f"fp8src_{kind}", {"qwen3": "qwen3_moe", "v3": "deepseek_v3"}[kind], seed=2)
        else:
            src = pathlib.Path(bench.build(kind, str(root / "fp8src"), torch.bfloat16))
        path = root / f"fp8_{kind}"
        fp8_checkpoint(src, path, (16, 16) if tiny else (128, 128))
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        kw = dict(device=dev, dtype=dtype, kv_cache_memory=(4 << 30) if cuda else 64 << 20, max_num_seqs=max(batches))
        t0 = time.perf_counter()
        kept = Engine(str(path), fp8_weights="keep", **kw)
        t1 = time.perf_counter()
        deq = Engine(str(path), fp8_weights="dequantize", **kw)
        t2 = time.perf_counter()
        lin = kept.runner.linear
        print(f"{kind}: engines built in {t1 - t0:.1f} s kept (kernels compiled and checked) and {t2 - t1:.1f} s "
              f"dequantised")
        print(f"{kind}: kept {kept.precision}, kernel {lin.use_kernel}, grouped experts in "
              f"{kept.runner.expert_kernel_blocks} layers; weights held {kept.stats.weight_bytes / 1e6:.1f} MB kept "
              f"(FP8 codes + scales {lin.nbytes / 1e6:.1f} MB) vs {deq.stats.weight_bytes / 1e6:.1f} MB dequantised")
        ids = bench.prompts(8, vocab)
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
        a, b = kept.generate(ids, sp), deq.generate(ids, sp)
        print(f"{kind}: greedy runs of 8 tokens equal {sum(x.token_ids == y.token_ids for x, y in zip(a, b))}/"
              f"{len(ids)}, first tokens {sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b))}/{len(ids)}")
        # Teacher-forced: every prompt position's logprob against the checkpoint dequantised and run in
        # fp32. On CUDA both bf16 engines round differently (GEMM order, then bf16), so the question is
        # whether the FP8 kernels are as close to fp32 as cuBLAS on the dequantised weights is.
        ids = bench.prompts(8, vocab)
        ref = Engine(str(path), fp8_weights="dequantize", **{**kw, "dtype": "float32"}) if cuda else deq
        want = _prompt_logprobs(ref, ids)
        err_k, err_d = (_prompt_logprobs(e, ids).sub(want).abs() for e in (kept, deq))
        print(f"{kind}: prompt logprobs vs fp32 over {want.numel()} positions: kept mean |d| {err_k.mean():.2e} "
              f"(max {err_k.max():.2e}), dequantised {dtype} mean |d| {err_d.mean():.2e} (max {err_d.max():.2e})")
        if cuda:
            del ref
            verdict(err_k.mean() <= 1.5 * err_d.mean() + 1e-3, f"{kind}: kept FP8 as close to fp32 as the dequantised bf16")
        else:
            verdict(err_k.max() < 1e-4, f"{kind}: kept FP8 agrees with the dequantised weights")
        row = []
        for bsz in batches:
            bench.ours(kept, bench.prompts(bsz, vocab), new_tokens)  # untimed first runs
            bench.ours(deq, bench.prompts(bsz, vocab), new_tokens)
            k = bench.ours(kept, bench.prompts(bsz, vocab), new_tokens)
            q = bench.ours(deq, bench.prompts(bsz, vocab), new_tokens)
            row.append(f"b{bsz}: kept {k:.0f} / dequantised {q:.0f} tok/s = {k / q:.2f}x")
        print(f"{kind} ({dtype}): " + "; ".join(row), flush=True)
        del kept, deq


def _prompt_logprobs(eng, ids) -> torch.Tensor:
    """[prompts, positions - 1]: each prompt token's logprob given the tokens before it."""
    outs = eng.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    return torch.tensor([[p.logprob for p in o.prompt_logprobs[1:]] for o in outs])


def _hf_rate(hf, ids, new, dev) -> float:
    x = torch.tensor(ids, device=dev)
    with torch.inference_mode():
        hf.generate(input_ids=x[:, :4], attention_mask=torch.ones_like(x[:, :4]), max_new_tokens=2, do_sample=False,
                    pad_token_id=0)  # warm-up: allocator and kernels at this batch
        if dev != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, pad_token_id=0)
        if dev != "cpu":
            torch.cuda.synchronize()
    return len(ids) * new / (time.perf_counter() - t)


def kernels_vs_torch(dev, path):
    prompts = [" ".join(["hello world how are you"] * k) for k in (1, 3, 7, 20)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    a = Engine(str(path), device=dev, dtype="float32", kv_cache_memory=64 << 20, kernels="torch").generate(prompts, sp)
    e = Engine(str(path), device=dev, dtype="float32", kv_cache_memory=64 << 20, kernels="tilelang")
    b = e.generate(prompts, sp)
    print(f"kernels=tilelang (decode kernel {'on' if e.runner.decode_kernel else 'off'}) greedy equal to torch: "
          f"{[x.token_ids for x in a] == [y.token_ids for y in b]}")


def batch_invariance(dev, path, dtype, rounds=8):
    eng = Engine(str(path), device=dev, dtype=dtype, kv_cache_memory=64 << 20, batch_invariant=True, max_num_batched_tokens=96)
    r = random.Random(0)
    words = "the quick brown fox jumps over lazy dog hello world".split()
    needle = "the quick brown fox jumps over the lazy dog " * 3
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=0)
    ref = eng.generate([needle], sp)[0]
    bad = 0
    for _ in range(rounds):
        n = r.randint(2, 48)
        others = [" ".join(r.choice(words) for _ in range(r.randint(1, 50))) for _ in range(n - 1)]
        pos = r.randint(0, n - 1)
        out = eng.generate(others[:pos] + [needle] + others[pos:], [SamplingParams(max_tokens=r.randint(1, 12))] * pos + [sp]
                           + [SamplingParams(max_tokens=5)] * (n - 1 - pos))[pos]
        bad += out.token_ids != ref.token_ids or [x.logprob for x in out.logprobs] != [x.logprob for x in ref.logprobs]
    print(f"batch-invariant ({dtype}): {rounds - bad}/{rounds} random batches bitwise equal to the prompt alone")
    verdict(bad == 0, f"batch invariance ({dtype})")


def default_tokenizer_dir(root: pathlib.Path) -> pathlib.Path:
    """The default model's tokenizer as HF files: .gpu/smollm2_tok when carried, else exported from
    the default GGUF's metadata (no weights are read)."""
    carried = ROOT / ".gpu" / "smollm2_tok"
    if (carried / "tokenizer.json").is_file():
        return carried
    import gguf

    from deepinfer.engine.loader.gguf_tokenizer import tokenizer_parts_from_gguf
    from deepinfer.engine.loader.model_loader import default_model_path

    hf, meta = tokenizer_parts_from_gguf(gguf.GGUFReader(str(default_model_path())))
    out = root / "default_tok"
    out.mkdir(exist_ok=True)
    hf.save(str(out / "tokenizer.json"))
    cfg = {k: meta[k] for k in ("bos_token", "eos_token", "pad_token") if meta.get(k)}
    if meta.get("chat_template"):
        cfg["chat_template"] = meta["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def qwen3_shaped(root: pathlib.Path, tiny: bool) -> pathlib.Path:
    """A Qwen3-architecture model with random bf16 weights (~0.5B parameters; --tiny: ~3M) and the
    default model's tokenizer."""
    import transformers

    tok_dir = default_tokenizer_dir(root)
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + sum(1 for t in tok.get("added_tokens", []) if t["content"] not in tok["model"]["vocab"])
    shape = QWEN3_TINY if tiny else QWEN3_05B
    cfg = transformers.Qwen3Config(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=True,
                                   rope_theta=1e6, rms_norm_eps=1e-6, **shape)
    out = root / ("qwen3_tiny" if tiny else "qwen3_05b")
    out.mkdir(exist_ok=True)
    torch.manual_seed(0)
    init_dev = "cuda" if torch.cuda.is_available() else "cpu"  # random init of 0.5B params: seconds on a GPU
    with torch.device(init_dev):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out))
    n = sum(p.numel() for p in model.parameters())
    del model
    for f in tok_dir.iterdir():
        if f.name not in ("config.json",) and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    print(f"Qwen3-shaped model: {n / 1e6:.0f}M parameters, vocab {vocab}, bf16 random weights")
    return out


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{3,8}-[0-9]{2,4}"


def structured(dev, path, batch, new_tokens):
    eng = Engine(str(path), device=dev, kv_cache_memory=2 << 30)
    prompts = [f"Record {i}: give the person's name, age and status as JSON." for i in range(batch)]
    eng.generate(prompts[:2], SamplingParams(max_tokens=2, json_schema=SCHEMA))  # compile the grammar
    half = batch // 2
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=new_tokens, json_schema=SCHEMA) for i in range(half)]
    params += [SamplingParams(temperature=0.7, seed=i, max_tokens=new_tokens, regex=REGEX) for i in range(half, batch)]
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    dt_c = time.perf_counter() - t
    n_c = sum(len(o.token_ids) for o in outs)
    ok_json = sum(o.valid is True for o in outs[:half])
    ok_re = sum(re.fullmatch(REGEX, o.text) is not None for o in outs[half:])
    done = sum(o.finish_reason == "stop" for o in outs)
    bad = [o.error for o in outs if o.finish_reason == "error"]
    print(f"constrained batch {batch}: json valid {ok_json}/{half}, regex match {ok_re}/{batch - half}, "
          f"finished by the grammar {done}/{batch}, errors {len(bad)} {bad[:2]}")
    free = [SamplingParams(temperature=0.7, seed=i, max_tokens=max(1, n_c // batch), ignore_eos=True) for i in range(batch)]
    t = time.perf_counter()
    outs_u = eng.generate(prompts, free)
    dt_u = time.perf_counter() - t
    n_u = sum(len(o.token_ids) for o in outs_u)
    ratio = (n_c / dt_c) / (n_u / dt_u)
    print(f"constrained {n_c / dt_c:.0f} tok/s vs unconstrained {n_u / dt_u:.0f} tok/s: {ratio:.2f}x")
    truncated = sum(o.finish_reason == "length" for o in outs)
    verdict(ok_json + ok_re + truncated >= batch and not bad, "every constrained output that finished is valid")
    verdict(ratio >= 0.9, f"constrained / unconstrained throughput >= 0.9 at batch {batch} ({ratio:.2f})")


def penalties(dev, path):
    from deepinfer.engine.sampler import Sampler, SamplingRow, prepare

    eng = Engine(str(path), device=dev, kv_cache_memory=1 << 30)
    prompts = ["the the the the the", "one two one two one two"]
    base = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    pen = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8,
                                               frequency_penalty=1.0, presence_penalty=1.0))
    rep = [len(o.token_ids) - len(set(o.token_ids)) for o in base]
    rep_p = [len(o.token_ids) - len(set(o.token_ids)) for o in pen]
    print(f"repeated tokens in 24: greedy {rep}, with penalties {rep_p}")
    verdict(sum(rep_p) <= sum(rep), "penalties run on the device and do not raise repetition")
    r = random.Random(0)
    V = 49152
    rows = [SamplingRow(SamplingParams(temperature=0 if i % 4 == 0 else 0.8, repetition_penalty=1.3,
                                       frequency_penalty=0.5, presence_penalty=0.25, top_p=0.95),
                        r.randrange(2**32), r.randrange(4096), [r.randrange(V) for _ in range(50)],
                        [r.randrange(V) for _ in range(30)], [2]) for i in range(64)]
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(0)) * 3
    s = Sampler(fused="never")
    cpu = s.sample(logits.clone(), prepare(rows, V, "cpu"))
    on_dev = s.sample(logits.to(dev), prepare(rows, V, dev)).cpu()
    same = int((cpu == on_dev).sum())
    print(f"sampler with penalties/top-p: device draws equal to CPU draws {same}/64 (differences only from softmax rounding)")
    verdict(same >= 62, "device sampler agrees with the CPU sampler")


def weight_bytes(eng) -> int:
    return sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())


def throughput(dev, path, batches, new_tokens, cuda):
    prompts = [f"Question {i}: please explain topic number {i} to a curious student in simple words." for i in range(max(batches))]
    configs = [(g, o) for g in ((False, True) if cuda else (False,)) for o in (False, True)]
    if not cuda:
        print("cuda_graphs=True: skipped (needs CUDA)")
    results, texts, wb = {}, {}, None
    for graphs, overlap in configs:
        eng = Engine(str(path), device=dev, kv_cache_memory=8 << 30 if cuda else 256 << 20, overlap_schedule=overlap,
                     max_num_seqs=max(batches), **({"cuda_graphs": True} if graphs else {}))
        eng.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))
        if not results:  # the process's first engine also pays one-time costs per shape (on 2026-12-04, before
            # sdpa_scope, cuDNN's plans made the first configuration 2.7-4.0x slower than the same eager
            # steps later in the run): one untimed pass over every shape first
            eng.generate(prompts[:max(batches)], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        wb = wb or weight_bytes(eng)
        row = []
        for b in batches:
            sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
            eng.reset_prefix_cache()
            s = eng.stats
            s.last_forward_end = 0.0  # the gap before this run's first forward is not this run's
            g0 = s.idle_gap_time
            t = time.perf_counter()
            outs = eng.generate(prompts[:b], sp)
            dt = time.perf_counter() - t
            idle = (s.idle_gap_time - g0) / dt
            results[(graphs, overlap, b)] = (b * new_tokens / dt, idle, dt)
            texts[(graphs, overlap, b)] = [o.token_ids for o in outs]
            row.append(f"b{b}: {b * new_tokens / dt:.0f} tok/s idle {idle:.0%}")
        if graphs and eng.runner.graphs is not None:
            row.append(f"graph replays {eng.runner.graphs.replays}")
        print(f"graphs {'on ' if graphs else 'off'} overlap {'on ' if overlap else 'off'}: " + "; ".join(row), flush=True)
    differ = sorted(k for k in texts if texts[k] != texts[(False, False, k[2])])
    if differ:
        print("greedy outputs that differ from graphs off / overlap off, (graphs, overlap, batch): "
              + ", ".join(f"{k}: {sum(a != b for a, b in zip(texts[k], texts[(False, False, k[2])]))} of {k[2]} rows"
                          for k in differ))
    verdict(not differ, "greedy outputs equal with graphs and overlap on/off")
    for g in {c[0] for c in configs}:
        ok = all(results[(g, True, b)][0] >= results[(g, False, b)][0] and results[(g, True, b)][1] < 0.05 for b in batches)
        ratios = ", ".join(f"b{b} {results[(g, True, b)][0] / results[(g, False, b)][0]:.2f}x" for b in batches)
        verdict(ok, f"graphs {'on' if g else 'off'}: overlap >= 1.0x sync with idle < 5% ({ratios})")
    if batches[0] == 1:
        g = cuda
        tok_s = max(results[(g, o, 1)][0] for o in (False, True))
        mc = json.loads((pathlib.Path(path) / "config.json").read_text())
        kv_per_tok = 2 * mc["num_hidden_layers"] * mc["num_key_value_heads"] * mc["head_dim"] * 2
        ctx = 20 + new_tokens // 2  # mean context of the batch-1 run
        bw = tok_s * (wb + kv_per_tok * ctx) / 1e12
        print(f"batch-1 decode: {tok_s:.0f} tok/s x {(wb + kv_per_tok * ctx) / 1e9:.2f} GB/step = {bw:.2f} TB/s "
              f"({bw / H200_TBPS:.0%} of {H200_TBPS} TB/s)")
        if cuda:
            verdict(bw / H200_TBPS >= 0.6, "batch-1 decode >= 60% of memory bandwidth")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small model and batches (the CPU smoke test)")
    ap.add_argument("--skip", nargs="*", default=[])
    args = ap.parse_args(argv)
    dev = args.device
    cuda = dev.startswith("cuda")
    if cuda:
        print(torch.cuda.get_device_name(0), torch.__version__)
    root = pathlib.Path(tempfile.mkdtemp())
    tiny = args.tiny
    batches = [1, 4, 8] if tiny else [1, 32, 128, 256]
    state: dict = {}

    def big():
        if "big" not in state:
            state["big"] = qwen3_shaped(root, tiny)
        return state["big"]

    steps = [
        ("tiny llama vs transformers (fp32)", lambda: state.setdefault("tiny", tiny_vs_hf(dev, root))),
        ("kernels on vs off", lambda: kernels_vs_torch(dev, state["tiny"])),
        ("MoE families vs transformers (fp32), grouped kernel vs torch", lambda: moe_vs_hf(dev, root)),
        ("MoE-shaped models: ours vs transformers", lambda: moe_throughput(dev, root, [1, 8] if tiny else [1, 32, 128],
                                                                           4 if tiny else 32, tiny)),
        ("block-FP8 checkpoints: kept vs dequantised", lambda: fp8_kept_vs_dequantised(
            dev, root, [1, 8] if tiny else [1, 32, 128], 4 if tiny else 32, tiny)),
        ("batch invariance fp32", lambda: batch_invariance(dev, state["tiny"], "float32", 2 if tiny else 8)),
        ("batch invariance bf16", lambda: batch_invariance(dev, state["tiny"], "bfloat16", 2 if tiny else 8)),
        ("Qwen3-shaped: JSON schema + regex at batch 64", lambda: structured(dev, big(), 8 if tiny else 64, 16 if tiny else 64)),
        ("Qwen3-shaped: penalties", lambda: penalties(dev, big())),
        ("Qwen3-shaped: graphs x overlap throughput, bandwidth", lambda: throughput(dev, big(), batches, 8 if tiny else 64, cuda)),
    ]
    failed = []
    for i, (name, fn) in enumerate(steps):
        if str(i) in args.skip:
            continue
        section(f"{i}. {name}")
        t = time.perf_counter()
        try:
            fn()
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"({time.perf_counter() - t:.1f} s)", flush=True)
    print(f"\nsections raising: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
