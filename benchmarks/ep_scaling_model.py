"""The step-time model of docs/SCALING.md: one DeepSeek-V3 MoE layer's decode time per GPU at
expert-parallel sizes 8-64 on H200-class GPUs (8 per NVLink node, one 400 Gb/s InfiniBand NIC per
GPU), with attention data-parallel. Every input is printed with its source; the byte formula is
the one benchmarks/expert_parallel.py checks against measured all-to-all traffic on CPU.

    python benchmarks/ep_scaling_model.py [--tokens 128] [--context 4096]
"""

from __future__ import annotations

import argparse
import itertools
import math

# DeepSeek-V3 config.json (public checkpoint): hidden, routed experts, top-k, groups, groups per token
H, E, K, GROUPS, TOPK_GROUP, I_MOE = 7168, 256, 8, 8, 4, 2048
KV_LATENT = 512 + 64  # MLA cache entry per token per layer (kv_lora_rank + rope dim)
ATTN_PARAMS = 187e6  # MLA projections per layer (q_a, q_b, kv_a, kv_b, o), from the same config
SHARED_PARAMS = 3 * H * I_MOE
# NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 1979 TFLOP/s dense FP8; NVLink 4 900 GB/s per GPU (450 each way)
HBM, FP8_FLOPS, NVLINK = 4.8e12, 1979e12, 450e9
EFF_HBM, EFF_FLOPS, EFF_NVL = 0.8, 0.6, 0.7  # assumed achievable fractions (not measured here)
# DeepEP README (H800 + ConnectX-7 400 Gb/s): RDMA 43-58 GB/s achieved in normal kernels, low-latency
# kernels 77-194 us dispatch and 114-369 us combine for 128 tokens at EP 8-256
IB = 45e9
GPUS_PER_NODE = 8


def expected_spread(N: int) -> tuple[float, float, float]:
    """(remote GPUs a token's dispatch reaches, its slots on remote GPUs, remote nodes it reaches)
    under uniform group-limited routing: TOPK_GROUP of GROUPS groups, K experts uniform over them."""
    nodes = max(1, N // GPUS_PER_NODE)
    per_group = E // GROUPS
    gpus_per_group = max(1, N // GROUPS)  # a group spans this many GPUs (N >= GROUPS here)
    exp_gpus = exp_nodes = 0.0
    combos = list(itertools.combinations(range(GROUPS), TOPK_GROUP))
    for groups in combos:  # the token's own GPU is GPU 0 (in group 0's first GPU)
        node_of = [g * nodes // GROUPS for g in groups]
        exp_nodes += len({n for n in node_of if n != 0})
        # experts: K uniform over TOPK_GROUP * per_group; the chance a GPU of a chosen group gets one
        pool = TOPK_GROUP * per_group
        per_gpu = per_group // gpus_per_group
        p_hit = 1 - math.comb(pool - per_gpu, K) / math.comb(pool, K)
        hit_gpus = len(groups) * gpus_per_group * p_hit
        own = (0 in groups) * p_hit
        exp_gpus += hit_gpus - own
    n = len(combos)
    remote_slots = K * (N - 1) / N
    return exp_gpus / n, remote_slots, exp_nodes / n


def model(N: int, tokens: int, context: int) -> dict:
    D, P, nodes = expected_spread(N)
    # expert GEMMs on this GPU: tokens * K pairs arrive on average (uniform load), over E / N experts
    pairs = tokens * K
    local = E // N
    active = local * (1 - (1 - 1 / E) ** (tokens * N * K))
    t_exp = max(active * 3 * H * I_MOE / (HBM * EFF_HBM), 2 * pairs * 3 * H * I_MOE / (FP8_FLOPS * EFF_FLOPS))
    t_attn = (tokens * context * KV_LATENT * 2 + ATTN_PARAMS + SHARED_PARAMS) / (HBM * EFF_HBM)
    # bytes: dispatch FP8 (1 B) + 4 B of expert ids per destination; combine BF16 per remote slot
    if N <= GPUS_PER_NODE:
        b = tokens * (D * (H + 4 * K) + P * H * 2)
        t_comm = b / (NVLINK * EFF_NVL)
        link = "NVLink"
    else:  # across nodes each token crosses InfiniBand once per remote node; slots come back one by one
        remote_node_slots = K * (1 - 1 / (N // GPUS_PER_NODE))
        b = tokens * (nodes * (H + 4 * K) + remote_node_slots * H * 2)
        t_comm = b / IB
        link = "IB"
    return dict(N=N, D=D, P=P, nodes=nodes, t_attn=t_attn, t_exp=t_exp, t_comm=t_comm, bytes=b, link=link)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens per GPU per step")
    ap.add_argument("--context", type=int, default=4096)
    a = ap.parse_args()
    print(f"DeepSeek-V3 MoE layer, {a.tokens} decode tokens per GPU, context {a.context}; per GPU, per layer (us)")
    print(f"{'EP':>3} {'link':>6} {'D':>5} {'P':>5} {'nodes':>5} {'MB sent':>8} {'attn':>6} {'experts':>8} "
          f"{'comm':>6} {'serial':>7} {'overlap':>8} {'comm share':>10}")
    for N in (8, 16, 32, 64):
        r = model(N, a.tokens, a.context)
        serial = r["t_attn"] + r["t_exp"] + r["t_comm"]
        overlap = max(r["t_attn"] + r["t_exp"], r["t_comm"])  # two micro-batches: comm hidden under compute
        print(f"{N:>3} {r['link']:>6} {r['D']:>5.2f} {r['P']:>5.2f} {r['nodes']:>5.2f} {r['bytes'] / 1e6:>8.2f} "
              f"{r['t_attn'] * 1e6:>6.0f} {r['t_exp'] * 1e6:>8.0f} {r['t_comm'] * 1e6:>6.0f} {serial * 1e6:>7.0f} "
              f"{overlap * 1e6:>8.0f} {r['t_comm'] / serial:>9.0%}")


if __name__ == "__main__":
    main()
