"""Grammar-masked sampling: greedy argmax or Gumbel-max over the allowed tokens, in one pass.

Inputs, per row b of a batch:
  logits [B, V] float32; bitmask [B, ceil(V/32)] int32 where bit j of word w allows token
  32*w + j (set = allowed, xgrammar's layout; bits past V are ignored); temperature [B] float32
  (0 = greedy, > 0 = sample); keys [B] int64 (rng.row_key(seed, position), in [0, 2**32)).
Output: token ids [B] int64, the first index of the maximum of
  greedy rows:   where(allowed, logits, -inf)
  sampled rows:  where(allowed, logits / T + rng.gumbel_portable_from_keys(keys), -inf)
which is torch.argmax's tie rule; a row whose every score is -inf (nothing allowed) gets 0,
again like torch.argmax. NaN logits are not supported (the result is unspecified).

Three implementations, bit-identical: the torch reference (the runtime fallback), a GPU-style
TileLang kernel (thread blocks over (row, chunk of 4096 tokens), per-thread running argmax,
block reductions, then an in-order merge of the chunks) and its CPU twin (target "c", one
program per row, serial scan). Both TileLang kernels take the per-token maths from tl_math,
the twin of rng's portable section.
"""

# No "from __future__ import annotations": TileLang evaluates the kernel signatures at build time.

import torch

from . import _checks, _tilelang
from .errors import KernelInputError
from .rng import gumbel_portable_from_keys

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
    allowed = bitmask_to_bool(bitmask, v)
    greedy = temperature == 0
    scores = logits
    if not bool(greedy.all()):
        # Noise only for the sampled rows (it is the expensive part); same values either way.
        rows = (~greedy).nonzero().squeeze(1)
        scores = logits.clone()
        scores[rows] = logits[rows] / temperature[rows, None] + gumbel_portable_from_keys(keys[rows], v)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.argmax(dim=1)


def build_cpu():
    """CPU twin (target "c"): one program per row, a serial scan keeping the first maximum."""
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
                        score[0] = M.sample_score(logits[b, j], temp, key, j)
                    if score[0] > best[0]:
                        best[0] = score[0]
                        arg[0] = j
            out[b] = arg[0]

    return masked_sample_cpu


def build_gpu(threads: int = GPU_THREADS, chunk: int = GPU_CHUNK):
    """GPU partial kernel: grid (chunks of CHUNK tokens, rows). Each thread scans a strided
    slice of its chunk (coalesced loads) keeping its first maximum; a block max-reduce and a
    min-reduce over the indices that reach it give the chunk's (max, first index)."""
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
        keys: T.Tensor((B,), "int64"),
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
            key = T.Cast("uint32", keys[b])
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
                                score[t] = M.sample_score(logits[b, j], temp, key, j)
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


def build_gpu_merge():
    """GPU merge kernel: one block per row walks its chunks in ascending order with a strict >,
    so the first maximum wins; a row whose every score is -inf gets 0 (torch.argmax's answer)."""
    import tilelang.language as T  # noqa: PLC0415 - optional dependency

    B, NC = T.dynamic("B"), T.dynamic("NC")

    @T.prim_func
    def masked_sample_merge(
        part_score: T.Tensor((B, NC), "float32"),
        part_index: T.Tensor((B, NC), "int32"),
        out: T.Tensor((B,), "int32"),
    ):
        with T.Kernel(B, threads=32) as b:
            best = T.alloc_var("float32")
            arg = T.alloc_var("int32")
            best = -T.infinity("float32")
            arg = 0
            for c in T.serial(NC):
                if part_score[b, c] > best:
                    best = part_score[b, c]
                    arg = part_index[b, c]
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
    args = (logits.contiguous(), bitmask.contiguous(), temperature.contiguous(), keys.contiguous())
    if not logits.is_cuda:
        kern = _tilelang.compile_cached(("masked_sample", "c"), build_cpu, "c")
        kern(*args, out)
        return out.to(torch.int64)
    part = _tilelang.compile_cached(("masked_sample", "cuda"), build_gpu, "cuda")
    merge = _tilelang.compile_cached(("masked_sample_merge", "cuda"), build_gpu_merge, "cuda")
    nc = (v + GPU_CHUNK - 1) // GPU_CHUNK
    part_score = torch.empty(b, nc, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(b, nc, dtype=torch.int32, device=logits.device)
    part(*args, part_score, part_index)
    merge(part_score, part_index, out)
    return out.to(torch.int64)
