"""Grammar-masked sampling: greedy argmax or the engine's seeded inverse-CDF draw over the
allowed tokens, mask + temperature + draw fused.

Inputs, per row b of a batch:
  logits [B, V] float32; bitmask [B, ceil(V/32)] int32 where bit j of word w allows token
  32*w + j (set = allowed, xgrammar's layout; bits past V are ignored); temperature [B] float32
  (0 = greedy, > 0 = sample); keys [B] int64 (rng.row_key(seed, position), in [0, 2**32)).
Output: token ids [B] int64. With x = where(allowed, logits, -inf):
  greedy rows:   the first index of the maximum of x (torch.argmax's tie rule; 0 when all -inf)
  sampled rows:  inverse_cdf.inverse_cdf_sample(x / T, inverse_cdf.row_uniforms(keys)), the
                 engine sampler's draw; a row whose max of x / T is not finite (+inf, or nothing
                 allowed) takes the greedy answer instead (softmax is undefined there).
NaN logits are not supported (the result is unspecified).

The torch reference computes softmax in fp32 and then a float64 running sum; the kernels sum
float64(exp(x/T - max)) and compare against u times that total (the same draw, normalised after
the sum rather than before): their tokens equal the reference's except where u lands within
float rounding of a CDF step (tests bound how often).

Implementations: the torch reference (the runtime fallback), the CPU twin (target "c", one
program per row, three serial passes: max, total mass, walk to the target) and the GPU kernels
(thread blocks over (row, chunk of 4096 tokens): per-chunk first maximum, then per-chunk mass
against the row's maximum, then one block per row merges the chunks in order, finds the chunk
where the running mass passes the target and walks that chunk serially).
"""

# No "from __future__ import annotations": TileLang evaluates the kernel signatures at build time.

import torch

from . import _checks, _tilelang
from .errors import KernelInputError
from .inverse_cdf import inverse_cdf_sample, row_uniforms

GPU_THREADS = 256
GPU_CHUNK = 4096  # tokens per thread block: V=129280 gives 32 blocks per row
INT32_MAX = 2**31 - 1


def check_args(logits, bitmask, temperature, keys) -> None:
    """Validate shapes, dtypes, devices and (CPU tensors only) values; raises KernelInputError."""
    _checks.tensor("logits", logits, 2, (torch.float32,))
    _checks.tensor("bitmask", bitmask, 2, (torch.int32,))
    _checks.tensor("temperature", temperature, 1, (torch.float32,))
    _checks.tensor("keys", keys, 1, (torch.int64,))
    _checks.same_device(logits=logits, bitmask=bitmask, temperature=temperature, keys=keys)
    b, v = logits.shape
    if v == 0:
        raise KernelInputError("logits must have at least one column (vocab size 0)")
    _checks.dim("bitmask", bitmask, 0, b, "batch size of logits")
    _checks.dim("bitmask", bitmask, 1, (v + 31) // 32, f"ceil(vocab {v} / 32) words")
    _checks.dim("temperature", temperature, 0, b, "batch size of logits")
    _checks.dim("keys", keys, 0, b, "batch size of logits")
    # Value checks only where they cost no device synchronisation (CPU tensors).
    if b and temperature.device.type == "cpu":
        if not bool(((temperature >= 0) & torch.isfinite(temperature)).all()):
            raise KernelInputError("temperature must be finite and >= 0 (0 means greedy)")
        if not bool(((keys >= 0) & (keys < 2**32)).all()):
            raise KernelInputError("keys must be in [0, 2**32) (use deepinfer_kernels.rng.row_key)")


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack an int32 bitmask [B, W] into a bool mask [B, vocab_size] (True = allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def masked_sample_reference(logits, bitmask, temperature, keys) -> torch.Tensor:
    """The torch definition of masked sampling (see the module docstring); returns int64 [B]."""
    v = logits.shape[1]
    x = logits.masked_fill(~bitmask_to_bool(bitmask, v), float("-inf"))
    out = x.argmax(dim=1)
    rows = (temperature != 0).nonzero().squeeze(1)
    if rows.numel():
        scaled = x.index_select(0, rows) / temperature.index_select(0, rows)[:, None]
        finite = torch.isfinite(scaled.max(dim=1).values)
        drawn = inverse_cdf_sample(scaled, row_uniforms(keys.index_select(0, rows), logits.device))
        out[rows] = torch.where(finite, drawn, out.index_select(0, rows))
    return out


def build_cpu():
    """CPU twin (target "c"): one program per row; pass 1 keeps the first maximum of the scores
    (logits, or logits / T), pass 2 sums float64(exp(score - max)) over the allowed tokens, pass 3
    walks the same sum until it passes u * total."""
    import tilelang.cpu.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import C_PRELUDE, make_math  # noqa: PLC0415

    M = make_math(cuda=False)
    B, V, W = T.dynamic("B"), T.dynamic("V"), T.dynamic("W")

    @T.prim_func
    def masked_sample_cpu(
        logits: T.Tensor((B, V), "float32"),
        bitmask: T.Tensor((B, W), "int32"),
        temperature: T.Tensor((B,), "float32"),
        keys: T.Tensor((B,), "int64"),
        out: T.Tensor((B,), "int32"),
    ):
        with T.Kernel(B, prelude=C_PRELUDE) as b:
            best = T.alloc_local((1,), "float32")
            arg = T.alloc_local((1,), "int32")
            score = T.alloc_local((1,), "float32")
            total = T.alloc_local((1,), "float64")
            target = T.alloc_local((1,), "float64")
            mass = T.alloc_local((1,), "float64")
            found = T.alloc_local((1,), "int32")
            best[0] = -T.infinity("float32")
            arg[0] = 0
            key = T.Cast("uint32", keys[b])
            temp = temperature[b]
            for j in T.serial(V):
                word = T.Cast("uint32", bitmask[b, j >> 5])
                if ((word >> T.Cast("uint32", j & 31)) & T.uint32(1)) != T.uint32(0):
                    if temp == T.float32(0):
                        score[0] = logits[b, j]
                    else:
                        score[0] = M.fdiv(logits[b, j], temp)
                    if score[0] > best[0]:
                        best[0] = score[0]
                        arg[0] = j
            if temp != T.float32(0):
                if best[0] > -T.infinity("float32"):
                    if best[0] < T.infinity("float32"):
                        total[0] = T.Cast("float64", T.int32(0))
                        for j in T.serial(V):
                            word = T.Cast("uint32", bitmask[b, j >> 5])
                            if ((word >> T.Cast("uint32", j & 31)) & T.uint32(1)) != T.uint32(0):
                                total[0] = total[0] + T.Cast(
                                    "float64", T.exp(M.fsub(M.fdiv(logits[b, j], temp), best[0])))
                        target[0] = M.uniform64(key) * total[0]
                        mass[0] = T.Cast("float64", T.int32(0))
                        found[0] = 0
                        for j in T.serial(V):
                            if found[0] == 0:
                                word = T.Cast("uint32", bitmask[b, j >> 5])
                                if ((word >> T.Cast("uint32", j & 31)) & T.uint32(1)) != T.uint32(0):
                                    mass[0] = mass[0] + T.Cast(
                                        "float64", T.exp(M.fsub(M.fdiv(logits[b, j], temp), best[0])))
                                    if mass[0] > target[0]:
                                        arg[0] = j
                                        found[0] = 1
            out[b] = arg[0]

    return masked_sample_cpu


def build_gpu(threads: int = GPU_THREADS, chunk: int = GPU_CHUNK):
    """GPU pass 1, grid (chunks of CHUNK tokens, rows): each thread scans a strided slice of its
    chunk (coalesced loads) keeping its first maximum of the scores (logits, or logits / T); a
    block max-reduce and a min-reduce over the indices that reach it give the chunk's (max,
    first index)."""
    import tilelang.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import make_math  # noqa: PLC0415

    M = make_math(cuda=True)
    B, V, W, NC = T.dynamic("B"), T.dynamic("V"), T.dynamic("W"), T.dynamic("NC")
    NT = threads

    @T.prim_func
    def masked_sample_gpu(
        logits: T.Tensor((B, V), "float32"),
        bitmask: T.Tensor((B, W), "int32"),
        temperature: T.Tensor((B,), "float32"),
        part_score: T.Tensor((B, NC), "float32"),
        part_index: T.Tensor((B, NC), "int32"),
    ):
        with T.Kernel(NC, B, threads=NT) as (c, b):
            best = T.alloc_fragment((NT,), "float32")
            arg = T.alloc_fragment((NT,), "int32")
            score = T.alloc_fragment((NT,), "float32")
            cand = T.alloc_fragment((NT,), "int32")
            mx = T.alloc_fragment((1,), "float32")
            mi = T.alloc_fragment((1,), "int32")
            temp = temperature[b]
            for t in T.Parallel(NT):
                best[t] = -T.infinity("float32")
                arg[t] = INT32_MAX
                for i in T.serial(chunk // NT):
                    j = c * chunk + i * NT + t
                    if j < V:
                        word = T.Cast("uint32", bitmask[b, j >> 5])
                        if ((word >> T.Cast("uint32", j & 31)) & T.uint32(1)) != T.uint32(0):
                            if temp == T.float32(0):
                                score[t] = logits[b, j]
                            else:
                                score[t] = M.fdiv(logits[b, j], temp)
                            if score[t] > best[t]:
                                best[t] = score[t]
                                arg[t] = j
            T.reduce_max(best, mx, dim=0)
            for t in T.Parallel(NT):
                cand[t] = T.if_then_else(best[t] == mx[0], arg[t], INT32_MAX)
            T.reduce_min(cand, mi, dim=0)
            part_score[b, c] = mx[0]
            part_index[b, c] = mi[0]

    return masked_sample_gpu


def build_gpu_mass(threads: int = GPU_THREADS, chunk: int = GPU_CHUNK):
    """GPU pass 2, grid (chunks, rows): the chunk's mass, the float64 sum of exp(score - row max)
    over its allowed tokens (row max from pass 1's partials; 0 for greedy rows and rows whose max
    is not finite, which pass 3 answers from pass 1)."""
    import tilelang.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import make_math  # noqa: PLC0415

    M = make_math(cuda=True)
    B, V, W, NC = T.dynamic("B"), T.dynamic("V"), T.dynamic("W"), T.dynamic("NC")
    NT = threads

    @T.prim_func
    def masked_sample_mass(
        logits: T.Tensor((B, V), "float32"),
        bitmask: T.Tensor((B, W), "int32"),
        temperature: T.Tensor((B,), "float32"),
        part_score: T.Tensor((B, NC), "float32"),
        part_mass: T.Tensor((B, NC), "float64"),
    ):
        with T.Kernel(NC, B, threads=NT) as (c, b):
            acc = T.alloc_fragment((NT,), "float64")
            tot = T.alloc_fragment((1,), "float64")
            rmax = T.alloc_fragment((NT,), "float32")
            temp = temperature[b]
            for t in T.Parallel(NT):
                rmax[t] = -T.infinity("float32")
                for k in T.serial(NC):
                    rmax[t] = T.max(rmax[t], part_score[b, k])
                acc[t] = T.Cast("float64", T.int32(0))
                if temp != T.float32(0):
                    if rmax[t] > -T.infinity("float32"):
                        if rmax[t] < T.infinity("float32"):
                            for i in T.serial(chunk // NT):
                                j = c * chunk + i * NT + t
                                if j < V:
                                    word = T.Cast("uint32", bitmask[b, j >> 5])
                                    if ((word >> T.Cast("uint32", j & 31)) & T.uint32(1)) != T.uint32(0):
                                        acc[t] = acc[t] + T.Cast(
                                            "float64", T.exp(M.fsub(M.fdiv(logits[b, j], temp), rmax[t])))
            T.reduce_sum(acc, tot, dim=0)
            part_mass[b, c] = tot[0]

    return masked_sample_mass


def build_gpu_merge(chunk: int = GPU_CHUNK):
    """GPU pass 3, one block per row: merge pass 1's chunks in ascending order with a strict >
    (the first maximum wins; 0 when every score is -inf). A sampled row with a finite maximum then
    walks the chunk masses to the chunk where the running mass passes u * total and that chunk's
    tokens one by one (the last allowed token of the chunk if rounding never passes it)."""
    import tilelang.language as T  # noqa: PLC0415 - optional dependency

    from .tl_math import make_math  # noqa: PLC0415

    M = make_math(cuda=True)
    B, V, W, NC = T.dynamic("B"), T.dynamic("V"), T.dynamic("W"), T.dynamic("NC")

    @T.prim_func
    def masked_sample_merge(
        logits: T.Tensor((B, V), "float32"),
        bitmask: T.Tensor((B, W), "int32"),
        temperature: T.Tensor((B,), "float32"),
        keys: T.Tensor((B,), "int64"),
        part_score: T.Tensor((B, NC), "float32"),
        part_index: T.Tensor((B, NC), "int32"),
        part_mass: T.Tensor((B, NC), "float64"),
        out: T.Tensor((B,), "int32"),
    ):
        with T.Kernel(B, threads=32) as b:
            best = T.alloc_var("float32")
            arg = T.alloc_var("int32")
            total = T.alloc_var("float64")
            target = T.alloc_var("float64")
            mass = T.alloc_var("float64")
            cstar = T.alloc_var("int32")
            found = T.alloc_var("int32")
            best = -T.infinity("float32")
            arg = 0
            for c in T.serial(NC):
                if part_score[b, c] > best:
                    best = part_score[b, c]
                    arg = part_index[b, c]
            temp = temperature[b]
            if temp != T.float32(0):
                if best > -T.infinity("float32"):
                    if best < T.infinity("float32"):
                        total = T.Cast("float64", T.int32(0))
                        for c in T.serial(NC):
                            total = total + part_mass[b, c]
                        target = M.uniform64(T.Cast("uint32", keys[b])) * total
                        mass = T.Cast("float64", T.int32(0))
                        cstar = -1
                        for c in T.serial(NC):
                            if cstar < 0:
                                if mass + part_mass[b, c] > target:
                                    cstar = c
                                else:
                                    mass = mass + part_mass[b, c]
                        if cstar >= 0:
                            found = 0
                            for i in T.serial(chunk):
                                j = cstar * chunk + i
                                if found == 0:
                                    if j < V:
                                        word = T.Cast("uint32", bitmask[b, j >> 5])
                                        if ((word >> T.Cast("uint32", j & 31)) & T.uint32(1)) != T.uint32(0):
                                            mass = mass + T.Cast(
                                                "float64", T.exp(M.fsub(M.fdiv(logits[b, j], temp), best)))
                                            arg = j
                                            if mass > target:
                                                found = 1
            out[b] = arg

    return masked_sample_merge


def masked_sample_tilelang(logits, bitmask, temperature, keys) -> torch.Tensor:
    """Run the TileLang kernel for the tensors' device (CPU twin or GPU); returns int64 [B].

    Compiles on first use per device kind (sizes are dynamic); raises if TileLang fails.
    """
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int32, device=logits.device)
    if b == 0:
        return out.to(torch.int64)
    logits, bitmask, temperature, keys = (t.contiguous() for t in (logits, bitmask, temperature, keys))
    if not logits.is_cuda:
        kern = _tilelang.compile_cached(("masked_sample", "c"), build_cpu, "c")
        kern(logits, bitmask, temperature, keys, out)
        return out.to(torch.int64)
    part = _tilelang.compile_cached(("masked_sample", "cuda"), build_gpu, "cuda")
    mass = _tilelang.compile_cached(("masked_sample_mass", "cuda"), build_gpu_mass, "cuda")
    merge = _tilelang.compile_cached(("masked_sample_merge", "cuda"), build_gpu_merge, "cuda")
    nc = (v + GPU_CHUNK - 1) // GPU_CHUNK
    part_score = torch.empty(b, nc, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(b, nc, dtype=torch.int32, device=logits.device)
    part_mass = torch.empty(b, nc, dtype=torch.float64, device=logits.device)
    part(logits, bitmask, temperature, part_score, part_index)
    mass(logits, bitmask, temperature, part_score, part_mass)
    merge(logits, bitmask, temperature, keys, part_score, part_index, part_mass, out)
    return out.to(torch.int64)
