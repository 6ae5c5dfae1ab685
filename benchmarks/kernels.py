"""Benchmark each custom kernel against its torch reference.

    python benchmarks/kernels.py                 # CPU (CUDA instead when available)
    python benchmarks/kernels.py --device cpu --quick
    python benchmarks/kernels.py --json out.json

Prints, per op and size, the median time of the torch reference and of the TileLang kernel
(the C twin on CPU, the GPU kernel on CUDA) and their ratio (torch / tilelang: > 1 means the
kernel is faster). On CUDA the memory-bound kernels also report achieved bandwidth as a share
of the H200's 4.3 TB/s. Compile time (or disk-cache load time) per kernel is printed last.
On CPU the "native" rows compare the C kernels of deepinfer_kernels.native with the torch code the
engine runs without them. On CUDA the "fp8" rows compare the W8A16 block-FP8 GEMMs (fp8_gemm.py, dense
and grouped experts) with torch's bf16 GEMMs on the same weights dequantised, what an engine that
dequantises the checkpoint at load runs; their bandwidth counts the bytes each kernel reads.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer_kernels import _tilelang, fp8_gemm, grouped_gemm, rng  # noqa: E402
from deepinfer_kernels.paged_attention import (  # noqa: E402
    paged_decode_attention_reference,
    paged_decode_attention_tilelang,
)
from deepinfer_kernels.rmsnorm import fused_add_rmsnorm_reference, fused_add_rmsnorm_tilelang  # noqa: E402
from deepinfer_kernels.sampling import masked_sample_reference, masked_sample_tilelang  # noqa: E402

PEAK_BW = 4.3e12  # H200 HBM3e, bytes/s


def timeit(fn, device, iters: int, warmup: int = 2) -> float:
    """Median seconds per call (CUDA: event-timed after synchronising)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def report(rows, name, size, t_ref, t_tl, nbytes, device, impl="tilelang"):
    row = dict(op=name, size=size, torch_ms=t_ref * 1e3, impl=impl, kernel_ms=t_tl * 1e3, speedup=t_ref / t_tl)
    line = f"{name:<24} {size:<34} torch {t_ref * 1e3:9.3f} ms  {impl} {t_tl * 1e3:9.3f} ms  x{t_ref / t_tl:7.2f}"
    if device.type == "cuda" and nbytes:
        bw = nbytes / t_tl
        row["bandwidth_share"] = bw / PEAK_BW
        line += f"  {bw / 1e9:7.1f} GB/s = {100 * bw / PEAK_BW:5.1f}% of 4.3 TB/s"
    print(line, flush=True)
    rows.append(row)


def bench_sampling(rows, device, iters, quick):
    g = torch.Generator().manual_seed(0)
    vocabs = [49152] if quick else [49152, 129280]
    for v in vocabs:
        for b in (1, 8, 64):
            logits = (torch.randn(b, v, generator=g) * 3).to(device)
            w = (v + 31) // 32
            mask = torch.randint(-(2**31), 2**31 - 1, (b, w), generator=g, dtype=torch.int64).to(torch.int32).to(device)
            keys = torch.tensor([rng.row_key(i, 1) for i in range(b)], dtype=torch.int64, device=device)
            for mode, t in (("greedy", 0.0), ("sample", 0.8)):
                temp = torch.full((b,), t, device=device)
                args = (logits, mask, temp, keys)
                # sampled rows may differ where u lies within rounding of a CDF step (sampling.py)
                assert int((masked_sample_reference(*args) != masked_sample_tilelang(*args)).sum()) <= 1
                t_ref = timeit(lambda: masked_sample_reference(*args), device, iters)
                t_tl = timeit(lambda: masked_sample_tilelang(*args), device, iters)
                report(rows, "masked_sample", f"{mode} B={b} V={v}", t_ref, t_tl, b * v * 4 + b * w * 4, device)


def bench_rmsnorm(rows, device, iters, quick, dtype):
    g = torch.Generator().manual_seed(1)
    for d in (576, 4096):
        for b in (1, 8, 64):
            x, r = (torch.randn(b, d, generator=g).to(device, dtype) for _ in range(2))
            w = torch.rand(d, generator=g).to(device, dtype)
            args = (x, r, w, 1e-5)
            t_ref = timeit(lambda: fused_add_rmsnorm_reference(*args), device, iters)
            t_tl = timeit(lambda: fused_add_rmsnorm_tilelang(*args), device, iters)
            es = x.element_size()
            report(rows, "fused_add_rmsnorm", f"{str(dtype)[6:]} B={b} D={d}", t_ref, t_tl, 4 * b * d * es + d * es, device)


def bench_attention(rows, device, iters, quick, dtype):
    g = torch.Generator().manual_seed(2)
    shapes = [(9, 3, 64, 16)] if quick else [(9, 3, 64, 16), (32, 8, 128, 16)]
    ctx = 512 if device.type == "cpu" else 4096
    for h, hkv, d, bs in shapes:
        for b in (1, 8, 64):
            if device.type == "cpu" and (b == 64 and h == 32):
                continue  # minutes on a 2-core box; adds nothing the smaller rows do not show
            mb = (ctx + bs - 1) // bs
            nb = b * mb + 1
            q = torch.randn(b, h, d, generator=g).to(device, dtype)
            kc = torch.randn(nb, bs, hkv, d, generator=g).to(device, dtype)
            vc = torch.randn(nb, bs, hkv, d, generator=g).to(device, dtype)
            bt = torch.randperm(nb - 1, generator=g)[: b * mb].view(b, mb).to(torch.int32).to(device)
            cl = torch.full((b,), ctx, dtype=torch.int32, device=device)
            args = (q, kc, vc, bt, cl, 1 / math.sqrt(d))
            t_ref = timeit(lambda: paged_decode_attention_reference(*args), device, iters)
            t_tl = timeit(lambda: paged_decode_attention_tilelang(*args), device, iters)
            nbytes = 2 * b * ctx * hkv * d * kc.element_size()
            report(rows, "paged_decode_attention", f"{str(dtype)[6:]} H={h}/{hkv} D={d} B={b} L={ctx}", t_ref, t_tl, nbytes, device)


def bench_fp8(rows, device, iters, quick):
    """DeepSeek-V3's projection shapes (N x K) at decode and prefill row counts, 128 x 128 blocks, and the
    routed experts of a V3 layer as one expert-parallel rank holds them (32 of 256, top-8 over all 256).
    --quick: small shapes (on CPU the kernels' fp32 twins against torch's fp32 GEMMs)."""
    torch.manual_seed(3)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32

    def fp8(*shape):
        codes = (torch.randn(*shape, device=device) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        return codes, torch.rand(*shape[:-1], -(-shape[-1] // 128), device=device) * 1e-3

    shapes = [(512, 256)] if quick else [(7168, 2048), (4096, 7168)]
    for n, k in shapes:
        codes, scale = fp8(n, k)
        w16 = fp8_gemm.dequantize(codes, scale, 128, dt)
        for m in (1, 16, 128) if quick else (1, 16, 128, 256, 512, 1024):
            x = torch.randn(m, k, device=device).to(dt)
            t_ref = timeit(lambda: F.linear(x, w16), device, iters)
            t_k = timeit(lambda: fp8_gemm.fp8_gemm_tilelang(x, codes, scale, 128), device, iters)
            nbytes = n * k + scale.numel() * 4 + x.element_size() * m * (k + n)
            report(rows, "fp8_gemm", f"M={m} N={n} K={k}", t_ref, t_k, nbytes, device)
            # the other way to run a kept weight (fp8_linear.Fp8Linear from KERNEL_MAX_ROWS rows):
            # dequantise it for the call, then torch's GEMM
            t_d = timeit(lambda: F.linear(x, fp8_gemm.dequantize(codes, scale, 128, dt)), device, iters)
            report(rows, "fp8 dequantise + torch", f"M={m} N={n} K={k}", t_ref, t_d, nbytes, device,
                   impl="dequantised+torch")
            if device.type == "cuda" and fp8_gemm.split_for(m, n, k, device) > 1:  # the k split against none
                t_1 = timeit(lambda: fp8_gemm.fp8_gemm_tilelang(x, codes, scale, 128, split=1), device, iters)
                report(rows, "fp8_gemm unsplit", f"M={m} N={n} K={k}", t_ref, t_1, nbytes, device)
    e, hid, inter = (8, 256, 128) if quick else (32, 7168, 2048)
    gu, dn = fp8_gemm.ExpertStack(*fp8(e, 2 * inter, hid), 128), fp8_gemm.ExpertStack(*fp8(e, hid, inter), 128)
    gu16 = torch.stack([fp8_gemm.dequantize(gu.codes[i], gu.scale[i], 128, dt) for i in range(e)])
    dn16 = torch.stack([fp8_gemm.dequantize(dn.codes[i], dn.scale[i], 128, dt) for i in range(e)])
    for t in (1, 16, 128) if quick else (1, 16, 128, 1024):
        x = torch.randn(t, hid, device=device).to(dt)
        # top-8 of 256 experts: a rank's 32 get 1 of 8 slots on average (ids past 31 are other ranks')
        idx = torch.stack([torch.randperm(e, device=device)[:1] for _ in range(t)])
        t_ref = timeit(lambda: grouped_gemm.moe_experts(x, idx, gu16, dn16), device, iters)
        t_k = timeit(lambda: fp8_gemm.moe_experts(x, idx, gu, dn), device, iters)
        nbytes = min(e, t) * 3 * inter * hid + 2 * t * hid * x.element_size()
        report(rows, "fp8 grouped experts", f"T={t} E={e} H={hid} I={inter}", t_ref, t_k, nbytes, device,
               impl="fp8 vs bf16 kernel")


def bench_native(rows, iters, quick):
    """CPU only: the native C kernels (deepinfer_kernels.native) against the torch code the engine runs
    without them (index_select + SDPA decode attention, per-chunk SDPA prefill, torch add + rms_norm)."""
    from deepinfer.engine.attention import decode_attention, prefill_attention
    from deepinfer_kernels import native

    if not native.available():
        print("native kernels unavailable (no C compiler); skipped", flush=True)
        return
    dev = torch.device("cpu")
    g = torch.Generator().manual_seed(3)
    H, Hkv, D, S = 9, 3, 64, 70000  # room for B x L distinct slots
    kc, vc = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    for L in (128,) if quick else (128, 512):
        for b in (1, 8, 32, 128):
            q = torch.randn(b, H, D, generator=g)
            idx = torch.randperm(S, generator=g)[: b * L].view(b, L)
            valid = torch.ones(b, L, dtype=torch.bool)
            lens, row = torch.full((b,), L), torch.arange(b)
            t_ref = timeit(lambda: decode_attention(q, kc, vc, idx, valid, D**-0.5), dev, iters)
            t_n = timeit(lambda: native.token_attention(q, kc, vc, idx, row, lens, D**-0.5, L), dev, iters)
            report(rows, "decode_attention", f"H={H}/{Hkv} D={D} B={b} L={L}", t_ref, t_n, 0, dev, "native")
    for n in (20, 64, 256) if quick else (20, 64, 256, 2048):
        q = torch.randn(n, H, D, generator=g)
        idx = torch.arange(n).view(1, n)
        args = (q, kc[:n], vc[:n], idx, torch.zeros(n, dtype=torch.long), torch.arange(1, n + 1), D**-0.5, n)
        t_ref = timeit(lambda: prefill_attention(q, kc[:n], vc[:n], D**-0.5), dev, iters)
        t_n = timeit(lambda: native.token_attention(*args), dev, iters)
        report(rows, "prefill_attention", f"H={H}/{Hkv} D={D} one chunk of {n}", t_ref, t_n, 0, dev, "native")
    for b in (1, 32, 128, 2048):
        x, r, w = torch.randn(b, 576, generator=g), torch.randn(b, 576, generator=g), torch.rand(576, generator=g)
        t_ref = timeit(lambda: F.rms_norm(x + r, (576,), w, 1e-5), dev, iters)
        t_n = timeit(lambda: native.add_rmsnorm(x, r, w, 1e-5), dev, iters)
        report(rows, "add_rmsnorm", f"float32 B={b} D=576", t_ref, t_n, 0, dev, "native")
    bench_native_linear(rows, iters, quick)
    from deepinfer.engine.models.layers import RotaryEmbedding

    rot = RotaryEmbedding(D, 4096, 10000.0, None)
    for b in (1, 32, 128):
        qkv, slots = torch.randn(b, (H + 2 * Hkv) * D, generator=g), torch.randperm(S, generator=g)[:b]
        tables = rot.tables(torch.randint(0, 4096, (b,), generator=g), torch.float32)

        def torch_rope():
            qk = rot.apply(qkv[:, : (H + Hkv) * D].view(b, H + Hkv, D), tables)
            kc.index_copy_(0, slots, qk[:, H:])
            vc.index_copy_(0, slots, qkv[:, (H + Hkv) * D :].view(b, Hkv, D))
            return qk[:, :H]

        t_ref = timeit(torch_rope, dev, iters)
        t_n = timeit(lambda: native.rope_store_kv(qkv, H, Hkv, tables[0], tables[1], slots, kc, vc), dev, iters)
        report(rows, "rope_store_kv", f"H={H}/{Hkv} D={D} B={b}", t_ref, t_n, 0, dev, "native")


def bench_native_linear(rows, iters, quick):
    """The projections at SmolLM2's shapes, weights coming from memory as in a decode step (each call
    takes the next of several copies, > 64 MB in all): F.linear (MKL) against the native panel GEMM
    and oneDNN's prepacked GEMM (the engine's path where no C compiler is found)."""
    from deepinfer.engine.cpu_linear import PACK_HINT_M, onednn_available
    from deepinfer_kernels import native

    dev = torch.device("cpu")
    g = torch.Generator().manual_seed(4)
    for n, k in ((960, 576), (1536, 576), (576, 1536)):
        copies = max(2, (64 << 20) // (n * k * 4) + 1)
        ws = [torch.randn(n, k, generator=g) for _ in range(copies)]
        packed = [native.pack_weight(w) for w in ws]
        dnnl = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_M) for w in ws] if onednn_available() else None
        for m in (1, 32) if quick else (1, 4, 32, 128, 1024):
            x = torch.randn(m, k, generator=g)
            it = {"i": 0}

            def cycling(fn):
                def call():
                    it["i"] = (it["i"] + 1) % copies
                    return fn(it["i"])
                return call

            t_ref = timeit(cycling(lambda i: F.linear(x, ws[i])), dev, iters)
            t_n = timeit(cycling(lambda i: native.linear(x, packed[i])), dev, iters)
            report(rows, "linear", f"N={n} K={k} M={m} (cold weights)", t_ref, t_n, 0, dev, "native")
            if dnnl is not None:
                t_d = timeit(cycling(lambda i: torch.ops.mkldnn._linear_pointwise(x, dnnl[i], None, "none", [], "")), dev, iters)
                report(rows, "linear", f"N={n} K={k} M={m} (cold weights)", t_ref, t_d, 0, dev, "onednn")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    p.add_argument("--ops", default="sampling,rmsnorm,attention,native,fp8",
                   help="native: CPU C kernels; fp8: the block-FP8 GEMMs (CUDA, or --quick)")
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    iters = a.iters or (50 if device.type == "cuda" else 5)
    if not _tilelang.available():
        print("tilelang is not importable; nothing to compare", file=sys.stderr)
        return 1
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, iters {iters}", flush=True)
    rows: list[dict] = []
    ops = a.ops.split(",")
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    if "native" in ops and device.type == "cpu":
        bench_native(rows, max(iters, 20), a.quick)
    if "sampling" in ops:
        bench_sampling(rows, device, iters, a.quick)
    for dt in dtypes:
        if "rmsnorm" in ops:
            bench_rmsnorm(rows, device, iters, a.quick, dt)
        if "attention" in ops:
            bench_attention(rows, device, iters, a.quick, dt)
    if "fp8" in ops and (device.type == "cuda" or a.quick):  # last: its kernels compile per shape
        bench_fp8(rows, device, iters, a.quick)
    print("compile / cache-load seconds per kernel:")
    for k, s in _tilelang.COMPILE_SECONDS.items():
        print(f"  {k}: {s:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(device=str(device), rows=rows, compile_s={str(k): v for k, v in _tilelang.COMPILE_SECONDS.items()}), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
