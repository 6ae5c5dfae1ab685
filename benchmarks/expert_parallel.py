"""Expert parallelism on CPU: EP 1 / 2 / 4 side by side in one run, on benchmarks/moe.py's
DeepSeek-V3-shaped model (hidden 1024, 32 routed experts top-4 in 4 groups (2 per token), 1 shared,
MoE intermediate 256; `--layers` decoder layers, 4 by default to fit a shared 24 GiB machine).

For each configuration: a batch of `--batch` prompts of 16 tokens is prefilled in one step, then
`--new-tokens` decode steps are timed. Per decode step: wall time seen by the engine, and the
forward split into attention + dense parts (forward minus MoE layers), the local expert GEMMs, and
communication (dispatch and combine all-to-alls), averaged over ranks (attention is data-parallel:
each rank runs its own sequences). Bytes sent per token per MoE layer are measured from the split sizes
and checked against the formula:

    normal:      D * (H + k) * s + P * H * s          (D: other ranks a token goes to, P: its slots
                                                       there; k expert ids ride along as int32)
    low_latency: (N-1)/N * E * ((cap + 1) + cap) * H * s / cap_tokens   (fixed buffers)

with D and P counted by the dispatcher (exact) and, for reference, their expectation under uniform
routing (D = (N-1) * (1 - C(E - E/N, k) / C(E, k)), P = k (N-1)/N). On this 2-core machine EP=2
gives each worker one core (EP=1 uses both) and EP=4 puts 4 single-thread processes on 2 cores,
so wall times compare process layouts, not a cluster; the byte counts and the split are what
docs/SCALING.md builds on.

    python benchmarks/expert_parallel.py [--eps 1 2 4] [--batch 16] [--new-tokens 8] [--layers 4]
        [--eplb N]

--eplb N: redundant experts on a router skewed onto 4 hot experts (choice bias +0.3 on experts
E-4..E-1, all on the last rank), at EP = N with R = 0, N and 2N copies: after one batch measures
the load and `rebalance_experts()` re-places the copies, a second batch is timed. Printed: the
busiest rank's share of the (token, slot) pairs over the mean (1.00 = balanced), decode step time,
and the busiest rank's expert GEMM time per step.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch

from common import save_random_moe
from deepinfer import Engine, SamplingParams

H, E, K, GROUPS, TOPK_GROUP = 1024, 32, 4, 4, 2


def build(root: str, layers: int) -> str:
    import pathlib

    import transformers
    from model_factory import make_tokenizer_files

    path = os.path.join(root, "v3")
    os.makedirs(path, exist_ok=True)
    vocab = make_tokenizer_files(pathlib.Path(path))
    cfg = transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=H, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=8,
        max_position_embeddings=1024, num_experts_per_tok=K, moe_intermediate_size=256, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, num_key_value_heads=8, n_routed_experts=E, n_shared_experts=1,
        first_k_dense_replace=1, n_group=GROUPS, topk_group=TOPK_GROUP, norm_topk_prob=True, routed_scaling_factor=2.5,
        q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    return save_random_moe(model, path)


class _LocalTimers:
    """EP=1 has no worker stats: time its MoE layers and expert GEMMs with wrappers."""

    def __init__(self, engine: Engine):
        from deepinfer.engine.models.moe import MoeBlock

        self.moe_s = self.expert_s = 0.0
        for m in engine.runner.model.modules():
            if isinstance(m, MoeBlock):
                self._wrap(m)

    def _wrap(self, block) -> None:
        fwd, grouped = block.forward, block.grouped_experts

        def timed_forward(*a, **k):
            t0 = time.perf_counter()
            out = fwd(*a, **k)
            self.moe_s += time.perf_counter() - t0
            return out

        def timed_grouped(*a, **k):
            t0 = time.perf_counter()
            out = grouped(*a, **k)
            self.expert_s += time.perf_counter() - t0
            return out

        block.forward, block.grouped_experts = timed_forward, timed_grouped


def run(path: str, ep: int, mode: str, batch: int, new: int, vocab: int) -> dict:
    kw = dict(kv_cache_memory=64 << 20, block_size=16, max_num_batched_tokens=max(256, batch * 16))
    eng = Engine(path, expert_parallel_size=ep, expert_parallel_dispatch=mode, **kw) if ep > 1 else Engine(path, **kw)
    try:
        timers = _LocalTimers(eng) if ep == 1 else None
        kv_blocks = eng.kv.num_free_blocks()  # kv_cache_memory is per rank: EP=N holds N pools
        g = torch.Generator().manual_seed(1)
        sp = SamplingParams(temperature=0, max_tokens=new + 1, ignore_eos=True)
        for _ in range(batch):
            eng.add_request(torch.randint(3, vocab, (16,), generator=g).tolist(), sp)
        eng.step()  # the prefill (and first token)
        per_rank = list(eng.kv.live) if ep > 1 else [batch]  # sequences whose KV each rank holds
        if ep > 1:
            eng.runner.comm_stats(reset=True)
        else:
            timers.moe_s = timers.expert_s = 0.0
        steps, t0 = 0, time.perf_counter()
        tokens = []
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    tokens.append(o.token_ids)
            steps += 1
        wall = (time.perf_counter() - t0) / steps
        out = dict(ep=ep, mode=mode, steps=steps, wall=wall, tokens=tokens, kv_blocks=kv_blocks, per_rank=per_rank)
        if ep > 1:
            st = eng.runner.comm_stats()
            avg = {k: sum(s[k] for s in st) / ep for k in ("forward_s", "moe_s", "expert_s", "dispatch_s", "combine_s")}
            out.update(forward=avg["forward_s"] / steps, expert=avg["expert_s"] / steps,
                       comm=(avg["dispatch_s"] + avg["combine_s"]) / steps)
            out["attn"] = out["forward"] - avg["moe_s"] / steps
            tok = sum(s["tokens"] for s in st)  # (token, MoE layer) pairs dispatched
            a2a = sum(s["dispatch_bytes"] + s["combine_bytes"] + s["count_bytes"] for s in st)
            out.update(bytes_per_token=a2a / tok,
                       D=sum(s["remote_token_ranks"] for s in st) / tok, P=sum(s["remote_slots"] for s in st) / tok,
                       layer_calls=sum(s["moe_layers"] for s in st) / ep, tok=tok,
                       data_bytes=sum(s["dispatch_bytes"] + s["combine_bytes"] for s in st))
        else:
            out.update(forward=wall, expert=timers.expert_s / steps, comm=0.0,
                       attn=wall - timers.moe_s / steps)
        return out
    finally:
        eng.close()


def skewed(path: str, root: str) -> str:
    """A copy of the model whose router prefers experts E-4..E-1 (choice bias +0.3)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = os.path.join(root, "v3_skewed")
    shutil.copytree(path, out)
    w = load_file(os.path.join(out, "model.safetensors"))
    for n in w:
        if n.endswith("e_score_correction_bias"):
            w[n][E - 4 :] += 0.3
    save_file(w, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def run_eplb(path: str, ep: int, redundant: int, batch: int, new: int, vocab: int) -> dict:
    kw = dict(kv_cache_memory=64 << 20, block_size=16, max_num_batched_tokens=max(256, batch * 16))
    g = torch.Generator().manual_seed(2)
    sp = SamplingParams(temperature=0, max_tokens=new + 1, ignore_eos=True)
    with Engine(path, expert_parallel_size=ep, expert_parallel_redundant=redundant, **kw) as eng:
        eng.generate([torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(batch)], sp)  # the load
        if redundant:
            eng.rebalance_experts()
        for _ in range(batch):
            eng.add_request(torch.randint(3, vocab, (16,), generator=g).tolist(), sp)
        eng.step()  # the prefill
        eng.runner.comm_stats(reset=True)
        steps, t0 = 0, time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            steps += 1
        wall = (time.perf_counter() - t0) / steps
        st = eng.runner.comm_stats()
    pairs = [s["expert_pairs"] for s in st]
    return dict(R=redundant, imbalance=max(pairs) / (sum(pairs) / ep), wall=wall,
                expert=max(s["expert_s"] for s in st) / steps, pairs=pairs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--eplb", type=int, default=0, metavar="N", help="also: redundant experts at EP=N (skewed router)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        path = build(root, args.layers)
        import json

        vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
        moe_layers = args.layers - 1
        print(f"DeepSeek-V3-shaped, {args.layers} layers ({moe_layers} MoE), H={H}, E={E}, top-{K}, "
              f"{GROUPS} groups / {TOPK_GROUP} per token; batch {args.batch}, {args.new_tokens} decode steps timed; "
              f"fp32 CPU, {os.cpu_count()} cores, shared machine (noisy); EP=1 runs {torch.get_num_threads()} thread(s), "
              f"EP=N N processes of {max(1, (os.cpu_count() or 1) // max(args.eps))}+ thread(s)")
        rows = []
        for ep in args.eps:
            for mode in (["normal"] if ep == 1 else ["normal", "low_latency"]):
                rows.append(run(path, ep, mode, args.batch, args.new_tokens, vocab))
        base = rows[0]
        print(f"{'EP':>3} {'mode':<12} {'step ms':>8} {'vs EP1':>7} {'attn+dense':>10} {'experts':>8} {'comm':>7} "
              f"{'B/tok/layer':>11} {'formula':>9} {'uniform':>9} {'same tokens':>11} {'KV blocks':>9}  seqs per rank")
        for r in rows:
            bpt = r.get("bytes_per_token", 0.0)
            formula = uniform = 0.0
            if r["ep"] > 1:
                N, s = r["ep"], 4
                if r["mode"] == "normal":
                    formula = r["D"] * (H + K) * s + r["P"] * H * s + (N - 1) * 8 * r["layer_calls"] * N / r["tok"]
                    d_uni = (N - 1) * (1 - math.comb(E - E // N, K) / math.comb(E, K))
                    uniform = d_uni * (H + K) * s + K * (N - 1) / N * H * s
                else:
                    cap_tokens = math.ceil(args.batch / N)  # rows per rank per decode step
                    formula = (N - 1) * (E // N) * ((cap_tokens + 1) + cap_tokens) * H * s * N * r["layer_calls"] / r["tok"]
                    uniform = formula
                ok = abs(formula - bpt) <= 1e-6 * max(1.0, bpt)
                assert ok, f"measured {bpt} B/token/layer != formula {formula}"
            print(f"{r['ep']:>3} {r['mode']:<12} {r['wall'] * 1e3:>8.1f} {base['wall'] / r['wall']:>6.2f}x "
                  f"{r['attn'] * 1e3:>10.1f} {r['expert'] * 1e3:>8.1f} {r['comm'] * 1e3:>7.1f} "
                  f"{bpt:>11.0f} {formula:>9.0f} {uniform:>9.0f} {str(r['tokens'] == base['tokens']):>11} "
                  f"{r['kv_blocks']:>9}  {r['per_rank']}")
        for r in rows:
            if r["ep"] > 1 and r["mode"] == "normal":
                print(f"EP={r['ep']} normal: each token goes to D={r['D']:.2f} other ranks with P={r['P']:.2f} of its "
                      f"{K} slots (uniform routing: D={(r['ep'] - 1) * (1 - math.comb(E - E // r['ep'], K) / math.comb(E, K)):.2f}, "
                      f"P={K * (r['ep'] - 1) / r['ep']:.2f})")
        if args.eplb:
            sk = skewed(path, root)
            N = args.eplb
            print(f"redundant experts, EP={N}, router skewed onto experts {E - 4}..{E - 1} (rank {N - 1}'s): "
                  f"copies re-placed after one batch, the next timed")
            print(f"{'R':>3} {'busiest/mean pairs':>18} {'step ms':>8} {'busiest expert ms':>17}  pairs per rank")
            for R in (0, N, 2 * N):
                r = run_eplb(sk, N, R, args.batch, args.new_tokens, vocab)
                print(f"{R:>3} {r['imbalance']:>18.2f} {r['wall'] * 1e3:>8.1f} {r['expert'] * 1e3:>17.2f}  {r['pairs']}")


if __name__ == "__main__":
    main()
