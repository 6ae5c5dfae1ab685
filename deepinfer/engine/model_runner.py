"""Owns the model weights and the KV-cache tensors; turns a scheduled batch into logits."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from deepinfer.engine.attention import ForwardContext, PrefillChunk, TokenAttentionInputs
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.models.registry import build_model
from deepinfer.engine.scheduler import ScheduledSeq


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


# a prefill chunk with q_len * ctx_len up to this goes through the native kernel with the decodes
# (one call instead of one SDPA per chunk); above it SDPA is faster (measured: equal at 20 x 20,
# SDPA 1.9x at 64 x 64, 8x at 2048 x 2048)
NATIVE_CHUNK_WORK = 4096


def _context_slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[n, length] cache slot of each position 0..length-1 of each row's sequence (positions past a
    sequence's end point at its last table entry: callers bound them by the context length)."""
    p = torch.arange(length)
    blocks = (p // block_size).expand(block_tables.shape[0], length).clamp(max=block_tables.shape[1] - 1)
    return block_tables.gather(1, blocks) * block_size + p % block_size


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [R, V] fp32 for the requested rows
    sample_rows: list[int]  # for each scheduled seq that completes: its row in `logits`, else -1
    prompt_rows: list[tuple[int, int] | None]  # per scheduled seq: (first row, count) of prompt-logprob rows


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights: dict, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.model = build_model(model_config)
        self.model.load_weights(weights, dtype, device)
        self.model.eval()
        self.block_size = config.block_size
        mc = model_config
        self.bytes_per_block = mc.num_hidden_layers * 2 * config.block_size * mc.num_key_value_heads * mc.head_dim * torch.finfo(dtype).bits // 8
        self.num_blocks = self._num_blocks()
        slots = self.num_blocks * self.block_size
        self.kv_cache = torch.zeros(
            mc.num_hidden_layers, 2, slots, mc.num_key_value_heads, mc.head_dim, dtype=dtype, device=device
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(mc.num_hidden_layers)]
        self.linear = self._select_linear()
        self.attention_fn = None
        self.kernels = config.kernels
        self.decode_kernel = None
        self.token_attention = None  # deepinfer_kernels.native.token_attention when selected
        self.token_attention_all = False  # every token through it (batch-invariant mode), not only short ones
        self.rope_store_kv = None  # deepinfer_kernels.native.rope_store_kv when selected
        self._select_kernels()
        if config.batch_invariant:
            self._use_batch_invariant_ops()

    def _select_linear(self):
        """The projection op: GEMMs on weights packed at load on CPU fp32 (native panels, else oneDNN:
        see cpu_linear.py); in the batch-invariant mode the same, once verified invariant on this
        machine, else fixed tiles."""
        import torch.nn.functional as F

        from deepinfer.engine import batch_invariant as bi
        from deepinfer.engine.cpu_linear import CpuLinear, packed_gemm_available

        invariant = self.config.batch_invariant
        on_cpu_fp32 = self.device.type == "cpu" and self.dtype == torch.float32
        if on_cpu_fp32 and self.config.cpu_prepack and packed_gemm_available():
            weights, gated = self.model.linear_weights(), self.model.gated_weights()
            lin = CpuLinear(weights, invariant=invariant, gated=gated)
            if not invariant or lin.verify_invariance(weights + gated):
                return lin
            del lin  # not invariant with this oneDNN build / thread count: fall through
        if not invariant:
            return F.linear

        def tiled(x, w, b=None):
            y = bi.bi_matmul(x, w)
            return y + b if b is not None else y

        return tiled

    def _select_kernels(self) -> None:
        """Route ops to deepinfer_kernels where its dispatch picks TileLang for this device."""
        import deepinfer_kernels as K
        from deepinfer_kernels import native

        # native CPU attention (fp32): 4-8x faster than gathering for SDPA at decode (benchmarks/kernels.py),
        # and batch-invariant by construction, so that mode runs every token through it
        if (self.device.type == "cpu" and self.dtype == torch.float32 and self.kernels == "auto"
                and native.available()):
            self.token_attention = native.token_attention
            self.token_attention_all = self.config.batch_invariant
            self.rope_store_kv = native.rope_store_kv
            # row-at-a-time norms in C: one call instead of ~7 torch ops, and invariant by construction
            self.model.set_norm_impl(lambda x, w, eps: native.add_rmsnorm(x, None, w, eps)[0])
            self.model.set_fused_add_norm(native.add_rmsnorm)
        if self.config.batch_invariant:
            return  # that mode uses its own invariant ops
        mc = self.model_config
        with K.use_backend(self.kernels):
            rms = K.selected_backend("fused_add_rmsnorm", self.device) == "tilelang"
            attn = K.selected_backend("paged_decode_attention", self.device) == "tilelang"
            if not (rms or attn):
                return
            # compile (or load from the disk cache) now, never on the per-step path
            K.warmup(
                self.device, hidden=mc.hidden_size if rms else None, eps=mc.rms_norm_eps if rms else None,
                attention=dict(num_heads=mc.num_attention_heads, num_kv_heads=mc.num_key_value_heads,
                               head_dim=mc.head_dim, block_size=self.block_size, scale=mc.head_dim**-0.5) if attn else None,
                dtype=self.dtype,
            )
        if rms:
            self.model.set_fused_add_norm(K.fused_add_rmsnorm)
        if attn:
            self.decode_kernel = K.paged_decode_attention

    def _use_batch_invariant_ops(self) -> None:
        """Batch-invariant mode: every op whose reduction order could depend on the batch is swapped
        for an invariant one. The linear (`_select_linear`) and, where native, the attention and norms
        (`_select_kernels`) were chosen invariant already; attention goes through the invariant
        dispatcher, and without native norms RMSNorm takes the row-wise torch version."""
        from deepinfer.engine import batch_invariant as bi
        from deepinfer.engine.attention import paged_attention_batch_invariant

        self.attention_fn = paged_attention_batch_invariant
        if self.token_attention is None:
            self.model.set_norm_impl(bi.bi_rmsnorm)

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        else:
            budget = int(available_memory(self.device) * cfg.kv_cache_fraction)
            if self.device.type == "cpu":
                budget = min(budget, cfg.max_kv_cache_memory_cpu)
        n = budget // self.bytes_per_block
        if n < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {self.bytes_per_block} bytes")
        return int(n)

    def copy_kv_tokens(self, src_block: int, dst_block: int, n: int) -> None:
        """Copy the first n token slots of one KV block to another, in every layer (fork)."""
        bs = self.block_size
        self.kv_cache[:, :, dst_block * bs : dst_block * bs + n] = self.kv_cache[:, :, src_block * bs : src_block * bs + n]

    def prepare(self, scheduled: list[ScheduledSeq], want_prompt_logprobs: list[bool], completes: list[bool]) -> "PreparedBatch":
        """Host-side batch layout (token ids, positions, slots, gather indices, logit rows).

        `scheduled` must list decodes (1 token after a computed prefix) before multi-token chunks.
        Token ids < 0 are placeholders for tokens the previous step is still sampling: -(r + 1)
        is row r of that step's sampled tokens, resolved on the device in `forward`.
        """
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        pos_starts: list[int] = []
        lens: list[int] = []
        for s in scheduled:
            nc = s.seq.num_computed_tokens
            ids.extend(s.seq.all_token_ids[nc : nc + s.num_tokens])
            pos_starts.append(nc)
            lens.append(s.num_tokens)
        nd = 0
        while nd < len(scheduled) and lens[nd] == 1 and pos_starts[nd] > 0:
            nd += 1
        assert all(not (lens[i] == 1 and pos_starts[i] > 0) for i in range(nd, len(scheduled))), "decodes must come first"
        input_ids = torch.tensor(ids, dtype=torch.long)
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        bt = torch.zeros(len(scheduled), max_blocks, dtype=torch.long)
        for i, s in enumerate(scheduled):
            bt[i, : len(s.seq.block_table)] = torch.tensor(s.seq.block_table, dtype=torch.long)
        lens_t = torch.tensor(lens, dtype=torch.long)
        starts_t = torch.tensor(pos_starts, dtype=torch.long)
        row_seq = torch.repeat_interleave(torch.arange(len(scheduled)), lens_t)
        offs = torch.arange(len(ids)) - torch.repeat_interleave(torch.cumsum(lens_t, 0) - lens_t, lens_t)
        positions = starts_t[row_seq] + offs
        slot_mapping = bt[row_seq, positions // bs] * bs + positions % bs

        ctx = ForwardContext(slot_mapping=slot_mapping.to(dev), linear=self.linear, attention_fn=self.attention_fn,
                             silu_mul=getattr(self.linear, "silu_mul", None))
        if self.token_attention is not None:
            ctx_lens = starts_t + lens_t
            L = int(ctx_lens.max())
            ctx_idx = _context_slots(bt, L, bs)
            ctx.token_attention = self.token_attention
            ctx.rope_store_kv = self.rope_store_kv
            ctx.tokens = TokenAttentionInputs(ctx_idx, row_seq, positions + 1, L)
        if nd and self.token_attention is None:
            ctx_lens = starts_t[:nd] + 1
            L = int(ctx_lens.max())
            gather = _context_slots(bt[:nd], L, bs)
            valid = torch.arange(L)[None, :] < ctx_lens[:, None]
            ctx.num_decode = nd
            ctx.decode_gather_idx = torch.where(valid, gather, 0).to(dev)
            ctx.decode_valid = valid.to(dev)
            if self.decode_kernel is not None:
                ctx.decode_kernel = self.decode_kernel
                ctx.block_size = bs
                ctx.decode_block_tables = bt[:nd].to(torch.int32).to(dev)
                ctx.decode_context_lens = ctx_lens.to(torch.int32).to(dev)
        q_start = nd
        for i in range(nd, len(scheduled)):
            nc, n = pos_starts[i], lens[i]
            native = ctx.tokens is not None and (self.token_attention_all or n * (nc + n) <= NATIVE_CHUNK_WORK)
            gidx = None
            if nc > 0 and not native:
                p = torch.arange(nc + n)
                gidx = (bt[i, p // bs] * bs + p % bs).to(dev)
            if ctx.tokens is not None and not native:
                ctx.tokens.lens[q_start : q_start + n] = 0  # left to SDPA
            ctx.prefills.append(PrefillChunk(q_start, n, nc + n, gidx, native))
            q_start += n

        # rows whose logits are needed: the last row of every completing seq, all rows for prompt logprobs
        rows: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[int, int] | None] = []
        start = 0
        for n, want, done in zip(lens, want_prompt_logprobs, completes):
            if want:
                prompt_rows.append((len(rows), n))
                rows.extend(range(start, start + n))
                sample_rows.append(len(rows) - 1 if done else -1)
            else:
                prompt_rows.append(None)
                if done:
                    sample_rows.append(len(rows))
                    rows.append(start + n - 1)
                else:
                    sample_rows.append(-1)
            start += n
        return PreparedBatch(input_ids, positions, ctx, rows, sample_rows, prompt_rows)

    @torch.inference_mode()
    def forward(self, batch: "PreparedBatch", prev_tokens: torch.Tensor | None = None) -> ForwardResult:
        """Run the model over a prepared batch; placeholders are filled from prev_tokens first."""
        import deepinfer_kernels as K

        with K.use_backend(self.kernels):  # (a context variable: set in the thread that runs this)
            return self._forward(batch, prev_tokens)

    def _forward(self, batch: "PreparedBatch", prev_tokens: torch.Tensor | None) -> ForwardResult:
        dev = self.device
        ids = batch.input_ids.to(dev, non_blocking=True)
        if prev_tokens is not None:
            ph = ids < 0
            ids = torch.where(ph, prev_tokens.to(dev)[(-ids - 1).clamp(min=0, max=max(prev_tokens.numel() - 1, 0))], ids)
        hidden = self.model(ids, batch.positions.to(dev), batch.ctx, self.kv_caches)
        if batch.rows:
            sel = hidden.index_select(0, torch.tensor(batch.rows, dtype=torch.long, device=dev))
            logits = self.model.compute_logits(sel, batch.ctx)
        else:
            logits = torch.empty(0, self.model_config.vocab_size, device=dev)
        return ForwardResult(logits, batch.sample_rows, batch.prompt_rows)


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # [T] (may hold placeholders < 0)
    positions: torch.Tensor  # [T]
    ctx: ForwardContext
    rows: list[int]  # hidden rows whose logits are computed
    sample_rows: list[int]
    prompt_rows: list[tuple[int, int] | None]
