"""MoE models: DeepInfer vs transformers `generate`, the grouped expert GEMM vs a dense GEMM, and the
KV bytes per token of latent attention (MLA) vs an equivalent per-head cache. Side by side in one run.

Two random-weight models sized for a small CPU: a DeepSeek-V3-shaped one (hidden 1024, 8 layers, 32
routed experts top-4 + 1 shared, MLA ranks scaled down) and a Qwen3-MoE-shaped one (hidden 1024, 8
layers, 32 experts top-4). Greedy, EOS ignored, 16-token prompts and 64 new tokens (the workload shape
of benchmarks/throughput.py); every figure is the best of
`--repeats` runs, ours and HF's alternating (the machine is shared and noisy). Every timed run gets
prompts never used before in this process (a fresh random draw per batch, repeat and arm, all of
the same length) and our prefix cache is emptied before it: with the same prompts on every repeat
our radix cache skipped the prefill from the second repeat on, which inflated our ratio.

`paired` is the median over repeats of ours / transformers' run right after it, beside `hf runs`, the
range of transformers' runs: the machine's speed drifts between repeats, and best-of ratios move with it.

New tokens: the default was 8, which made "output tokens/s" mostly a prefill figure (at batch 32, 512
prompt tokens against 256 generated), where both systems run fp32 GEMMs near this CPU's FMA peak.
Measured in one session (fp32 checkpoint, best of 2), ours / transformers at batch 1 / 8 / 32 / 128:
8 new tokens, V3 2.75 / 2.84 / 2.27 / 1.82x, Qwen3 3.20 / 2.85 / 2.36 / 1.85x; 64 new tokens, V3
3.31 / 4.30 / 3.97 / 3.18x, Qwen3 2.38 / 3.92 / 3.65 / 2.64x. `--new-tokens 8` gives the old figure.
2026-12-03, after Qwen3's q/k norms moved into rope_store_kv and the expert / panel GEMM changes of that
day (best of 3): V3 2.76 / 4.04 / 4.46 / 3.35x, Qwen3 3.09 / 3.97 / 3.93 / 2.73x (same day before them,
Qwen3 at batch 128: 2.45-2.54x). After the native decode stack took Qwen3-MoE's decode steps (and the
expert kernel its two-ended item order): V3 3.20 / 3.90 / 4.26 / 3.24x, Qwen3 3.89 / 4.56 / 3.99 / 2.42x
(best of 3; transformers 618 tok/s at batch 128 in that run), and Qwen3 alone, best of 5, 3.01 / 4.13 /
4.02 / 2.72x, paired 2.95 / 4.04 / 3.68 / 2.78x (transformers' batch-128 runs 432-521 tok/s).
2026-12-04, after DeepSeek-V3's decode steps moved onto the native decode stack (latent attention and
the fused shared expert in one C call, engine/native_decode.py), best of 3: V3 3.73 / 4.75 / 4.67 / 3.50x
(the same morning before it: 2.58 / 3.33 / 4.10 / 3.20x; ours 97 -> 136 tok/s at batch 1, 338 -> 460 at 8);
with the latent entries' attention on vectors too (token_attention.c's heads_wide): 3.65 / 4.83 / 4.99 /
3.63x, paired 3.65 / 4.70 / 4.99 / 4.01x (ours 1440 tok/s at batch 128, 1294 that morning); Qwen3 in that
session's last run 3.35x at batch 32, 2.70x at 128 (paired 2.71x; transformers 487-537 tok/s).

Model FLOPs: each run's work (`run_flops`: 2 FLOPs per multiply-add of the weights every token
uses, plus its attention over its context) over its wall time, for ours and transformers, against the
engine's packed linear on a well-shaped dense GEMM measured in the same run: how close each system
runs to what this CPU's GEMMs reach, and the ratio to transformers if every FLOP ran at that rate.
2026-12-03, Qwen3-MoE-shaped at batch 128 (--repeats 3): 952 GFLOP a run, ours at 77% of the dense
rate (219 GFLOP/s), transformers at 31%; every FLOP at the dense rate would have been 3.27x
transformers' best run (576 tok/s; its runs 429-576), so 3x needed ~92% of it end to end (attention
over the KV cache, norms, routing, sampling and the step's Python included), ~80% against its
usual ~500 tok/s. DeepSeek-V3-shaped: ours 61%, transformers 19%. Ratios in that run (best of 3 /
paired), batch 1 / 8 / 32 / 128: V3 3.09 / 3.89 / 3.92 / 3.25x and 3.13 / 3.90 / 3.93 / 3.31x;
Qwen3 4.25 / 4.77 / 4.69 / 2.51x and 4.25 / 4.50 / 4.66 / 2.99x.
The fp32 FMA peak (`native.fma_peak`: register-only FMA chains on the same threads, measured in the
same run) shows how far any kernel could go: 2026-12-04, the dense GEMM ran at 95-96% of it (219-223
of 230-234 GFLOP/s) and the grouped experts at 82-88%; at batch 128 every model FLOP at that peak would
have been 3.41x (transformers' best run 580 tok/s), 3.78x (524) and 4.01x (501) transformers for the
Qwen3-MoE-shaped model, where ours ran at 71-74% of the peak end to end (2.53x, 2.77x and 2.84x
best-of, paired 2.53x, 3.07x and 2.92x): 3x needed 75-88% of the peak, a run 6-19% faster end to end,
with the GEMMs already near it. (In the last run `--bf16-dot` ran 4.79x transformers' fp32.) A decode step at batch 128 there (~70 ms): qkv / o / router GEMMs ~28 ms, experts ~32
ms (each expert's ~16 rows stream 100 MB of fp32 weights a layer), attention ~7 ms (an fp32 KV cache
read back from DRAM each layer: 0.5 ms warm, 0.7-0.9 ms cold for 128 tokens over ~48 keys), norms,
rope and routing ~2 ms.

Grouped GEMM: one MoE layer's routed experts (the kernel the engine runs them with) on
`--gemm-tokens` routed tokens, in GFLOP/s, against dense GEMMs of the same K and N (one expert's
gate/up + down) over all T * top-k rows, with the same threads: the same native kernel on a
one-expert stack (the like-for-like figure: grouped loses only the weight reuse) and the engine's
packed linear (oneDNN on AVX2 CPUs). grouped/dense is given against each.

`--per-expert` also runs the engine as it was before the grouped expert kernel (MoE experts as one
oneDNN GEMM pair per active expert, expert_kernels not installed) in the same run, for before/after.
`--checkpoint bfloat16` saves both models in bf16, as real DeepSeek / Qwen MoE checkpoints ship, and runs
each system its default way on it: transformers computes in bf16 (`from_pretrained`'s dtype "auto"),
DeepInfer keeps the routed experts in bf16 as stored (moe_expert_dtype "auto", exactly the fp32 path's
bits) and computes in fp32. The default (`float32`) is the like-for-like fp32 comparison.

`--bf16-dot` also runs the engine with `dtype="bfloat16"` (bf16 dot products, fp32 accumulation; its
grouped-kernel GFLOP/s against a dense GEMM in the same arithmetic): also its own column. With
`--checkpoint bfloat16` that column is the bf16-vs-bf16 comparison (transformers computes in bf16).
2026-12-04, after the bf16-dot experts moved to 16-column panels, a tall tile and ~1 MiB items (best
of 3, batch 1 / 8 / 32 / 128, --checkpoint bfloat16 --bf16-dot): Qwen3 6.42 / 3.91 / 3.59 / 2.83x
transformers' bf16 (its batch-128 runs 650-880 tok/s), V3 3.41 / 3.14 / 3.14 / 3.39x; the grouped
bf16-dot kernel 0.92 (Qwen3) and 0.82 (V3) of the dense engine linear. Before that change, Qwen3 at
batch 32 / 128: 3.11 / 2.70x. (One earlier run of this script printed the grouped bf16-dot rate at
0.63 of dense, against 0.80-0.83 in a separate process at the time; not seen again.)
`--bf16-experts` also runs the engine with `moe_expert_dtype="bfloat16"` (the routed experts' packed
weights in bf16, widened exactly, fp32 accumulation; everything else fp32) against the same fp32
transformers: a precision choice, so it is its own column, never the headline ratio.

    python benchmarks/moe.py [--batches 1 8 32 128] [--new-tokens 64] [--repeats 2] [--models v3 qwen3] [--per-expert]
                             [--bf16-experts] [--bf16-dot] [--checkpoint float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch

from common import save_random_moe, run_on_compute_thread
from deepinfer import Engine, SamplingParams
from deepinfer_kernels import native

PROMPT_LEN = 16


def build(kind: str, root: str, dtype: torch.dtype = torch.float32) -> str:
    import transformers
    from model_factory import make_tokenizer_files

    path = os.path.join(root, kind)
    os.makedirs(path, exist_ok=True)
    vocab = make_tokenizer_files(__import__("pathlib").Path(path))
    common = dict(vocab_size=vocab, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=8, max_position_embeddings=1024, num_experts_per_tok=4,
                  moe_intermediate_size=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if kind == "v3":
        cfg = transformers.DeepseekV3Config(**common, num_key_value_heads=8, n_routed_experts=32, n_shared_experts=1,
                                            first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                                            routed_scaling_factor=2.5, q_lora_rank=384, kv_lora_rank=128,
                                            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
        cls = transformers.DeepseekV3ForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=128, num_experts=32,
                                          norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    return save_random_moe(model, path, dtype)


_draws = 0


def prompts(n: int, vocab: int) -> list[list[int]]:
    """n random prompts of PROMPT_LEN tokens, a fresh draw on every call (never a repeat of an earlier
    call's prompts in this process, so no run finds another's prefix in a cache)."""
    global _draws
    _draws += 1
    g = torch.Generator().manual_seed(1_000_003 * _draws + n)
    return torch.randint(3, vocab, (n, PROMPT_LEN), generator=g).tolist()


def ours(engine: Engine, ids: list[list[int]], new: int) -> float:
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    engine.reset_prefix_cache()  # (and the prompts are fresh): every run pays its full prefill
    t = time.perf_counter()
    engine.generate(ids, sp)
    return len(ids) * new / (time.perf_counter() - t)


def theirs(hf, ids: list[list[int]], new: int) -> float:
    x = torch.tensor(ids)
    t = time.perf_counter()
    with torch.inference_mode():
        hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, pad_token_id=0)
    return len(ids) * new / (time.perf_counter() - t)


def token_flops(mc, ctx: int) -> float:
    """Model FLOPs of one token at context length ctx (2 per multiply-add of the weights it uses: attention
    projections, the dense MLP or the router + top-k routed experts + shared expert; plus its attention
    over ctx keys, counted per head as the unabsorbed q.k and p.v; the LM head not counted: a 381-token
    vocabulary here). The work both systems must do whatever their kernels, so tokens/s x this is a rate comparable
    to a GEMM's GFLOP/s."""
    h, heads = mc.hidden_size, mc.num_attention_heads
    if mc.mla is None:
        d = mc.head_dim
        attn = h * (heads + 2 * mc.num_key_value_heads) * d + heads * d * h
        qk, pv = d, d
    else:
        a = mc.mla
        qk, pv = a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
        q = (h * a.q_lora_rank + a.q_lora_rank * heads * qk) if a.q_lora_rank else h * heads * qk
        attn = q + h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * heads * (a.qk_nope_head_dim + pv) \
            + heads * pv * h
    total, m = 0.0, mc.moe
    for layer in range(mc.num_hidden_layers):
        if m is not None and layer in m.sparse_layers:
            mlp = h * m.num_experts + m.top_k * 3 * h * m.expert_intermediate_size + 3 * h * m.shared_intermediate_size
        else:
            mlp = 3 * h * mc.intermediate_size
        total += 2.0 * (attn + mlp) + 2.0 * heads * (qk + pv) * ctx
    return total


def run_flops(mc, batch: int, new: int) -> float:
    """Model FLOPs of one timed run: the prefill of `batch` PROMPT_LEN-token prompts, then new - 1 decode steps."""
    per_seq = sum(token_flops(mc, c) for c in range(1, PROMPT_LEN + 1)) + \
        sum(token_flops(mc, PROMPT_LEN + i) for i in range(1, new))
    return batch * per_seq


def engine_linear(engine: Engine, weights: list[torch.Tensor], gated: list[torch.Tensor] = ()):
    """A linear over these weights in the engine's own arithmetic (its backend; fp32, or bf16 dot products
    under dtype="bfloat16"): the dense references the grouped kernel and the model-FLOP rates are set against."""
    from deepinfer.engine.cpu_linear import CpuLinear

    lin = engine.runner.linear
    if not hasattr(lin, "backend"):
        return lin
    return CpuLinear(weights, gated=gated, backend=lin.backend, bf16_dot=engine.precision == "bfloat16-dot")


def gemm_rates(engine: Engine, tokens: int, repeats: int) -> tuple[float, float, float | None]:
    """GFLOP/s on one MoE layer's shapes, same threads: (grouped experts as the engine runs them, dense
    GEMM pair through the engine's packed linear, dense GEMM pair on the native expert kernel as a
    one-expert stack (None where that kernel is not available))."""
    from deepinfer.engine.attention import ForwardContext
    from deepinfer.engine.models.moe import MoeBlock

    runner = engine.runner
    block = next(layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, MoeBlock))
    lin = runner.linear
    meta = ForwardContext(slot_mapping=torch.empty(0, dtype=torch.long), linear=lin, silu_mul=getattr(lin, "silu_mul", None))
    x = torch.randn(tokens, block.hidden) * 0.5
    _, idx = block.route(x, meta)
    rows = idx.numel()
    flops = 2.0 * rows * (2 * block.inter * block.hidden + block.hidden * block.inter)
    # the dense reference: one expert-shaped GEMM pair over all top-k rows, packed the same way
    gu = torch.randn(2 * block.inter, block.hidden) * 0.03
    down = torch.randn(block.hidden, block.inter) * 0.03
    bf16_dot = engine.precision == "bfloat16-dot"
    dense_lin = engine_linear(engine, [down], gated=[gu])
    dmeta = ForwardContext(slot_mapping=meta.slot_mapping, linear=dense_lin, silu_mul=getattr(dense_lin, "silu_mul", None))
    xr = torch.randn(rows, block.hidden) * 0.5

    def dense():
        if dmeta.silu_mul is not None:
            h = dmeta.silu_mul(xr, gu)
        else:
            g, u = dense_lin(xr, gu).chunk(2, -1)
            h = torch.nn.functional.silu(g) * u
        return dense_lin(h, down)

    native = None
    try:
        from deepinfer.engine.expert_kernels import NativeGatedMlp, native_experts_available

        if native_experts_available():
            native = NativeGatedMlp(gu, down, bf16_dot=bf16_dot)
    except (ImportError, RuntimeError):
        native = None
    arms = [lambda: block.grouped_experts(x, idx, meta), dense] + ([lambda: native(xr)] if native else [])
    best = [float("inf")] * len(arms)
    with torch.inference_mode():
        for fn in arms:
            fn()
        for _ in range(max(3, repeats * 3)):  # alternating, best of
            for i, fn in enumerate(arms):
                t = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - t)
    rates = [flops / b / 1e9 for b in best]
    return rates[0], rates[1], (rates[2] if native else None)


def dense_rate(engine: Engine, repeats: int) -> float:
    """GFLOP/s of the engine's packed linear on a well-shaped GEMM, [512, hidden] x [hidden, 2 * hidden]
    (best of several, weights warm, same threads): what this CPU's GEMMs reach in this run, the yardstick
    for the model-FLOP rates."""
    h = engine.model_config.hidden_size
    w = torch.randn(2 * h, h) * 0.03
    dense = engine_linear(engine, [w])
    x = torch.randn(512, h)
    best = float("inf")
    with torch.inference_mode():
        dense(x, w)
        for _ in range(max(5, repeats * 5)):
            t = time.perf_counter()
            dense(x, w)
            best = min(best, time.perf_counter() - t)
    return 2.0 * 512 * h * 2 * h / best / 1e9


def per_expert_engine(path: str) -> Engine:
    """An engine whose MoE blocks keep the per-expert GEMMs (the grouped expert kernel not installed)."""
    from deepinfer.engine import expert_kernels

    real = expert_kernels.install_expert_kernels
    expert_kernels.install_expert_kernels = lambda *a, **k: 0
    try:
        return Engine(path, kv_cache_memory=256 << 20)
    finally:
        expert_kernels.install_expert_kernels = real


def kv_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes per token of this engine's cache, of a per-head K/V cache of the same attention)."""
    mc = engine.model_config
    if mc.mla is None:
        return engine.runner.kv_bytes_per_token, engine.runner.kv_bytes_per_token
    a = mc.mla
    per_head = mc.num_hidden_layers * mc.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * 4
    return engine.runner.kv_bytes_per_token, per_head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gemm-tokens", type=int, default=128)
    ap.add_argument("--models", nargs="+", default=["v3", "qwen3"])
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--per-expert", action="store_true", help="also run the per-expert GEMM path (before/after)")
    ap.add_argument("--bf16-experts", action="store_true", help="also run with moe_expert_dtype='bfloat16'")
    ap.add_argument("--bf16-dot", action="store_true", help="also run with dtype='bfloat16' (bf16 dot products)")
    ap.add_argument("--checkpoint", choices=["float32", "bfloat16"], default="float32",
                    help="the dtype the random models are saved in (bfloat16: as real MoE checkpoints ship)")
    args = ap.parse_args()
    import transformers

    ckpt = getattr(torch, args.checkpoint)
    print(f"threads={torch.get_num_threads()} new_tokens={args.new_tokens} prompt={PROMPT_LEN} best of {args.repeats} "
          f"checkpoint={args.checkpoint} (transformers computes in {args.checkpoint}, DeepInfer in fp32 with the "
          "checkpoint's weights as stored; shared, loaded machine: compare the ratios, not the absolute figures)")
    with tempfile.TemporaryDirectory() as root:
        for kind in args.models:
            path = build(kind, root, ckpt)
            engine = Engine(path, kv_cache_memory=256 << 20)
            old = per_expert_engine(path) if args.per_expert else None
            half = Engine(path, kv_cache_memory=256 << 20, moe_expert_dtype="bfloat16") if args.bf16_experts else None
            dot = Engine(path, kv_cache_memory=256 << 20, dtype="bfloat16") if args.bf16_dot else None
            hf = None if args.no_hf else transformers.AutoModelForCausalLM.from_pretrained(path, dtype=ckpt).eval()
            vocab = engine.model_config.vocab_size
            for e in (engine, old, half, dot):
                if e is not None:
                    e.generate(prompts(2, vocab), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            name = {"v3": "DeepSeek-V3-shaped", "qwen3": "Qwen3-MoE-shaped"}[kind]
            print(f"\n{name}: {engine.model_config.num_hidden_layers} layers, hidden {engine.model_config.hidden_size}, "
                  f"{engine.model_config.moe.num_experts} experts top-{engine.model_config.moe.top_k}, "
                  f"linear={getattr(engine.runner.linear, 'backend', 'torch')}; resident weights "
                  f"{engine.stats.weight_bytes / 2**20:.0f} MiB = {engine.stats.weight_bytes / engine.stats.checkpoint_bytes:.2f}x "
                  f"the checkpoint's {engine.stats.checkpoint_bytes / 2**20:.0f} MiB")
            extra = f" {'per-expert tok/s':>17} {'ratio':>7} {'grouped/per-expert':>19}" if old is not None else ""
            if half is not None:
                extra += f" {'bf16-experts tok/s':>18} {'vs hf':>6} {'vs fp32':>7}"
            if dot is not None:
                extra += f" {'bf16-dot tok/s':>14} {'vs hf':>6} {'vs fp32':>7}"
            print(f"{'batch':>6} {'deepinfer tok/s':>16} {'hf tok/s':>10} {'ratio':>7} {'paired':>7} {'hf runs':>13}{extra}",
                  flush=True)
            rates = []  # (batch, our model GFLOP/s, transformers', the run's GFLOP) for the roofline lines
            for b in args.batches:
                best_o = best_h = best_p = best_b = best_d = 0.0
                runs_o, runs_h = [], []
                for _ in range(args.repeats):  # fresh prompts (same length) for every arm and repeat
                    runs_o.append(ours(engine, prompts(b, vocab), args.new_tokens))
                    best_o = max(best_o, runs_o[-1])
                    if old is not None:
                        best_p = max(best_p, ours(old, prompts(b, vocab), args.new_tokens))
                    if half is not None:
                        best_b = max(best_b, ours(half, prompts(b, vocab), args.new_tokens))
                    if dot is not None:
                        best_d = max(best_d, ours(dot, prompts(b, vocab), args.new_tokens))
                    if hf is not None:
                        runs_h.append(theirs(hf, prompts(b, vocab), args.new_tokens))
                        best_h = max(best_h, runs_h[-1])
                ratio = f"{best_o / best_h:7.2f}" if best_h else "      -"
                # paired: the median over repeats of ours / transformers run just after it (the machine's
                # speed drifts between repeats; transformers' batch-128 runs moved 458-618 tok/s in a day)
                paired = f"{statistics.median(o / h for o, h in zip(runs_o, runs_h)):7.2f}" if runs_h else "      -"
                spread = f"{min(runs_h):.0f}-{max(runs_h):.0f}" if runs_h else "-"
                line = f"{b:>6} {best_o:>16.1f} {best_h:>10.1f} {ratio} {paired} {spread:>13}"
                if old is not None:
                    r_old = f"{best_p / best_h:7.2f}" if best_h else "      -"
                    line += f" {best_p:>17.1f} {r_old} {best_o / best_p:>19.2f}"
                if half is not None:
                    r_half = f"{best_b / best_h:6.2f}" if best_h else "     -"
                    line += f" {best_b:>18.1f} {r_half} {best_b / best_o:>7.2f}"
                if dot is not None:
                    r_dot = f"{best_d / best_h:6.2f}" if best_h else "     -"
                    line += f" {best_d:>14.1f} {r_dot} {best_d / best_o:>7.2f}"
                print(line, flush=True)
                gflop = run_flops(engine.model_config, b, args.new_tokens) / 1e9
                rates.append((b, gflop * best_o / (b * args.new_tokens), gflop * best_h / (b * args.new_tokens), gflop))
            for label, e in (("grouped expert kernel", engine), ("per-expert GEMMs", old),
                             ("grouped expert kernel, bf16 weights", half), ("grouped expert kernel, bf16 dot", dot)):
                if e is None:
                    continue
                g, d, dn = gemm_rates(e, args.gemm_tokens, args.repeats)
                line = (f"{label} at {args.gemm_tokens} tokens ({torch.get_num_threads()} threads): {g:.1f} GFLOP/s; "
                        f"dense same K/N, engine linear: {d:.1f} (grouped/dense {g / d:.2f})")
                if dn is not None:
                    line += f"; dense same K/N, same native kernel: {dn:.1f} (grouped/dense {g / dn:.2f})"
                print(line, flush=True)
            # Model FLOPs per second (run_flops / wall time) against the dense GEMM rate just measured: how
            # close each system runs to what this CPU's GEMMs reach, and what a ratio to transformers could
            # be at most if every FLOP ran at that rate.
            peak = dense_rate(engine, args.repeats)
            fma = native.fma_peak() if native.available() else None
            print(f"dense GEMM, engine linear, [512, {engine.model_config.hidden_size}] x "
                  f"[{engine.model_config.hidden_size}, {2 * engine.model_config.hidden_size}]: {peak:.1f} GFLOP/s"
                  + (f"; this CPU's fp32 FMA peak (register-only FMA chains, same threads): {fma:.1f} GFLOP/s, "
                     f"the dense GEMM at {peak / fma:.0%} of it" if fma else ""), flush=True)
            for b, r_o, r_h, gflop in rates:
                line = (f"model FLOPs at batch {b}: {gflop:.0f} GFLOP a run; ours {r_o:.0f} GFLOP/s = "
                        f"{r_o / peak:.0%} of the dense GEMM rate")
                if r_h:
                    line += (f", transformers {r_h:.0f} = {r_h / peak:.0%}; every FLOP at the dense rate would be "
                             f"{peak / r_h:.2f}x transformers' best run")
                    if fma and engine.precision in ("float32", "bfloat16-weights", "float16-weights"):  # fp32 arithmetic
                        line += f", at the fp32 FMA peak {fma / r_h:.2f}x"
                print(line, flush=True)
            ours_b, per_head = kv_bytes(engine)
            if engine.model_config.mla is not None:
                print(f"KV bytes/token: MLA latent {ours_b} vs per-head K/V {per_head} ({per_head / ours_b:.1f}x smaller)")
            else:
                print(f"KV bytes/token: GQA {ours_b}")
            del engine, hf, old, half, dot


if __name__ == "__main__":
    run_on_compute_thread(main)  # (common.py: one OpenMP thread for engine and reference)
