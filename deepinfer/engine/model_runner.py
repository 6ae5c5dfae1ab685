"""Owns the model weights and the KV-cache tensors; turns a ForwardBatch (plain tensors) into logits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deepinfer.engine.attention import ForwardContext, PrefillChunk, TokenAttentionInputs, group_prefills, sdpa_scope
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.model_config import ModelConfig
from deepinfer.engine.models.registry import build_model


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
# runs of this many query tokens or fewer (decodes with draft tokens to verify) always go native, so
# a verified row computes its attention exactly as a single decode at that position would
NATIVE_MAX_QUERY = 16


def _context_slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[n, length] cache slot of each position 0..length-1 of each row's sequence (positions past a
    sequence's end point at its last table entry: callers bound them by the context length)."""
    p = torch.arange(length)
    blocks = (p // block_size).expand(block_tables.shape[0], length).clamp(max=block_tables.shape[1] - 1)
    return block_tables.gather(1, blocks) * block_size + p % block_size


def expert_storage_dtype(setting: str, weights: dict) -> torch.dtype:
    """How the native expert kernel stores the routed experts' packed weights (EngineConfig.moe_expert_dtype):
    "auto" keeps bf16 where every routed expert tensor in `weights` is bf16 as stored (the loader keeps
    16-bit tensors under dtype="auto"; widening a bf16 value to fp32 is exact, so the kernel computes the
    fp32 path's bits from half the bytes), fp32 otherwise (fp16 does not round-trip through bf16)."""
    if setting != "auto":
        return getattr(torch, setting)
    routed = [t for n, t in weights.items() if ".mlp.experts." in n]
    return torch.bfloat16 if routed and all(t.dtype == torch.bfloat16 for t in routed) else torch.float32


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights: dict, device: torch.device, dtype: torch.dtype,
                 quantized: dict | None = None, quant_mode: str | None = None, model_hook=None,
                 num_blocks: int | None = None, keep_16bit: bool = False, bf16_dot: bool = False):
        """model_hook(model): called between building the model and loading its weights (expert
        parallelism: a worker keeps only its own experts, deepinfer/distributed/ep_model.py).
        keep_16bit: a bf16 / fp16 checkpoint's projections (given as stored in `weights`) stay in 16-bit
        panels on CPU fp32 where it qualifies (weights16.py); otherwise they load converted to `dtype`.
        bf16_dot: every projection rounded to bf16 panels and run as bf16 dot products with fp32
        accumulation (Engine(dtype="bfloat16") on CPU, `dtype` fp32: weights16.py); ModelLoadError where
        the model does not qualify (the engine checks that first).
        num_blocks: the KV pool's size in blocks (a draft model's runner mirrors the target's block
        ids); None sizes it from the config's memory budget."""
        self.config = config
        self.precision = "float32" if dtype == torch.float32 else str(dtype).removeprefix("torch.")
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.model = build_model(model_config)
        if model_hook is not None:
            model_hook(self.model)
        self.kept_16bit = None  # {HF name: 16-bit tensor} until _select_linear packs them
        # bf16 tensors as stored (under auto the loader keeps them): then values that are all bf16 pack as
        # bf16 (CpuLinear bf16_exact, the embedding); an fp32 checkpoint skips those checks at load
        self.bf16_checkpoint = keep_16bit and any(t.dtype == torch.bfloat16 for t in weights.values())
        self.bf16_dot = bf16_dot
        if (keep_16bit or bf16_dot) and device.type == "cpu" and dtype == torch.float32 and not (quantized and quant_mode):
            from deepinfer.engine.weights16 import split_16bit

            split = split_16bit(self.model, weights, model_config, config.cpu_prepack, bf16_dot=bf16_dot)
            if split is not None:
                weights, self.kept_16bit = split
        # an MoE model's bf16 dot products: its gated MLPs on the grouped expert kernel's bf16-dot build,
        # the other projections on CpuLinear's bf16-dot panels (the routers in fp32)
        self.moe_bf16_dot = bf16_dot and self.kept_16bit is None and model_config.moe is not None
        if bf16_dot and self.kept_16bit is None and not self.moe_bf16_dot:
            from deepinfer.errors import ModelLoadError

            raise ModelLoadError("bf16 dot products need a dense or MoE model on CPU with native kernels, "
                                 "cpu_prepack=True and float32 activations")
        expert_storage = expert_storage_dtype(config.moe_expert_dtype, weights)  # before loading converts them
        self.model.load_weights(weights, dtype, device)
        self.model.eval()
        # block-FP8 weights kept as stored (fp8_linear.py): they run through the fp8 linear, the experts too
        self.fp8_kept = bool(getattr(self.model, "fp8_weights", None))
        # MoE experts as one grouped GEMM per layer (expert_kernels.py); before the linear, which then skips them
        self.expert_kernel_blocks = 0
        if self.fp8_kept:
            from deepinfer.engine.expert_kernels import install_fp8_experts

            self.expert_kernel_blocks = install_fp8_experts(self.model, device, dtype, config.kernels)
        elif not (quantized and quant_mode):
            from deepinfer.engine.expert_kernels import install_expert_kernels

            self.expert_kernel_blocks = install_expert_kernels(
                self.model, device, dtype, config.kernels, config.cpu_prepack, expert_storage, bf16_dot=self.moe_bf16_dot)
        if self.moe_bf16_dot and not self.expert_kernel_blocks:
            from deepinfer.errors import ModelLoadError

            raise ModelLoadError("bf16 dot products on an MoE model need the native grouped expert kernel")
        if config.moe_expert_dtype == "bfloat16" and device.type == "cpu" and not self.expert_kernel_blocks \
                and getattr(model_config, "moe", None) is not None:
            from deepinfer.errors import InvalidRequestError

            raise InvalidRequestError(f"moe_expert_dtype={config.moe_expert_dtype!r} needs the native grouped expert "
                                      "kernel: CPU, dtype float32, kernels='auto', cpu_prepack=True and a C compiler")
        self.block_size = config.block_size
        mc = model_config
        # (tensors per layer, heads, dim): K and V per head, or one latent entry per token (MLA)
        self.kv_parts, kv_heads, kv_dim = self.model.kv_cache_spec()
        # speculative="mtp": the MTP layers' caches are more layers of the same paged cache
        self.num_mtp_layers = getattr(self.model, "num_mtp_layers", 0) if config.speculative == "mtp" else 0
        n_layers = mc.num_hidden_layers + self.num_mtp_layers
        self.kv_dtype = self.kv_cache_dtype(quant_mode if quantized else None)
        self.kv_bytes_per_token = n_layers * self.kv_parts * kv_heads * kv_dim * torch.finfo(self.kv_dtype).bits // 8
        self.bytes_per_block = config.block_size * self.kv_bytes_per_token
        self.num_blocks = num_blocks if num_blocks is not None else self._num_blocks()
        self.use_graphs = config.cuda_graphs and device.type == "cuda"
        # one scratch block past the allocator's pool for the padding rows of captured decode steps
        slots = (self.num_blocks + self.use_graphs) * self.block_size
        self.kv_cache = torch.zeros(n_layers, self.kv_parts, slots, kv_heads, kv_dim, dtype=self.kv_dtype, device=device)
        self.kv_caches = [tuple(self.kv_cache[i].unbind(0)) for i in range(mc.num_hidden_layers)]
        self.mtp_caches = [tuple(self.kv_cache[i].unbind(0)) for i in range(mc.num_hidden_layers, n_layers)]
        self.linear = self._select_linear(quantized, quant_mode)
        self.attention_fn = None
        self.kernels = config.kernels
        self.decode_kernel = None
        # prefill chunks batched into single SDPA calls (attention.group_prefills): on CUDA, where a call's
        # host cost dominates; on CPU prefill chunks go through the native token attention or alone
        self.group_prefills = device.type == "cuda"
        self.token_attention = None  # deepinfer_kernels.native.token_attention when selected
        self.token_attention_all = False  # every token through it (batch-invariant mode), not only short ones
        self.rope_store_kv = None  # deepinfer_kernels.native.rope_store_kv when selected
        self._select_kernels()
        if config.batch_invariant:
            self._use_batch_invariant_ops()
        # decode-only steps of few rows through one native call (native_decode.py), when it binds: GGUF
        # blocks, or the native panel GEMM (fp32 / 16-bit checkpoints, dense, Qwen-style MoE, DeepSeek)
        self.decode_stack = None
        self.mtp_stacks: list = [None] * self.num_mtp_layers  # speculative="mtp": a stack per MTP layer, or None
        # a step that needs logits for only some rows (a prefill) runs its last layer's attention output
        # projection and MLP on those rows alone (ForwardContext.keep_rows); off: on every row
        self.prune_last_layer = True
        native_panels = getattr(self.linear, "backend", None) == "native"
        if native_panels:
            from deepinfer.engine.models.mla import MlaAttention

            # latent attention's absorbed projections one panel GEMM a head at every row count: row-invariant
            # (torch.bmm's bits depend on the rows) and the decode stack's way, so a token's bits do not
            # depend on which path computed it or whether the stack bound
            for m in self.model.modules():
                if isinstance(m, MlaAttention):
                    m.absorb_per_head = True
        # (with speculative="mtp" too: the target's steps on it, its MTP layers on stacks of their own)
        if self.token_attention is not None and (quant_mode or native_panels) and not self.use_graphs:
            from deepinfer.engine.native_decode import bind_decode_stack

            self.decode_stack = bind_decode_stack(self.model, self.linear, self.kv_caches, self.block_size,
                                                  self.config.max_num_seqs)
            # and one per MTP layer, over its block and head norm (the drafter's rows, once eh_proj mixed them)
            self.mtp_stacks = [bind_decode_stack(self.model, self.linear, [kv], self.block_size, self.config.max_num_seqs,
                                                 mtp_depth=d) if self.decode_stack is not None else None
                               for d, kv in enumerate(self.mtp_caches)]
        self.graphs = self._capture_graphs() if self.use_graphs else None

    def kv_cache_dtype(self, quant_mode: str | None) -> torch.dtype:
        """The KV cache's element type (EngineConfig.kv_cache_dtype; quant_mode: the GGUF blocks' kernel
        mode, or None).

        auto: bf16 on CPU where the native attention runs over per-head K/V caches (not MLA's latent
        cache, nor expert parallelism's worker caches) and the precision is already approximate: the
        int8 mode ("quantized") and bf16 dot products ("bfloat16"). Its kernels widen each bf16 value
        exactly as they read it (csrc/token_attention.c), so the only change is the rounding of k and v
        as they are stored. Measured on this 2-core Zen 4 host: a batch-128 decode's attention over
        30-84 keys, SmolLM2's 30 layers, 11.4-11.6 ms against 20.9-23.2 ms with an fp32 cache; the
        throughput and accuracy figures are in ARCHITECTURE.md. float32 modes keep an fp32 cache."""
        from deepinfer.errors import InvalidRequestError

        setting = self.config.kv_cache_dtype
        native_cpu = (self.device.type == "cpu" and self.dtype == torch.float32 and self.kv_parts == 2
                      and self.config.expert_parallel_size == 1)
        if setting == "auto":
            approximate = quant_mode in ("int8", "bf16") or self.bf16_dot
            return torch.bfloat16 if approximate and native_cpu and self._native_attention() else self.dtype
        want = getattr(torch, setting)
        if want != self.dtype and not native_cpu:
            raise InvalidRequestError(
                f"kv_cache_dtype={setting!r} differs from the compute dtype {self.precision}: that runs only on CPU "
                f"with fp32 compute, per-head K/V caches (not MLA's latent cache) and expert_parallel_size=1")
        return want

    def _native_attention(self) -> bool:
        """Whether attention runs on the native CPU kernels (csrc/token_attention.c, rope_store_kv.c):
        CPU, fp32 compute, kernels="auto" and the library built."""
        from deepinfer_kernels import native

        return self.device.type == "cpu" and self.dtype == torch.float32 and self.config.kernels == "auto" \
            and native.available()

    def _capture_graphs(self):
        """Decode graphs per batch bucket (cuda_graphs.py); needs the paged decode kernel."""
        import warnings

        import deepinfer_kernels as K
        from deepinfer.engine.cuda_graphs import DecodeGraphs

        if self.decode_kernel is None:
            warnings.warn("cuda_graphs: the paged decode kernel is not in use (kernels='torch' or TileLang "
                          "unavailable); decode steps run eagerly", RuntimeWarning, stacklevel=3)
            return None
        mlen = self.config.max_model_len or self.model_config.max_position_embeddings
        bs = self.block_size

        def make_ctx(slots, nd, bt, cl):
            return ForwardContext(slot_mapping=slots, linear=self.linear, silu_mul=getattr(self.linear, "silu_mul", None),
                                  num_decode=nd, decode_block_tables=bt, decode_context_lens=cl, block_size=bs,
                                  decode_kernel=self.decode_kernel)

        def run_model(ids, positions, ctx):
            return self.model.compute_logits(self.model(ids, positions, ctx, self.kv_caches), ctx)

        graphs = DecodeGraphs(run_model, make_ctx, self.device, self.config.max_num_seqs, -(-mlen // bs), bs,
                              scratch_block=self.num_blocks)
        with K.use_backend(self.kernels):
            graphs.capture()
        return graphs

    def _select_linear(self, quantized: dict | None = None, quant_mode: str | None = None):
        """The projection op: on a GGUF's block-quantised weights kept as stored where given
        (quant_linear.py, invariant by construction); GEMMs on weights packed at load on CPU fp32
        (native panels, else oneDNN: see cpu_linear.py); in the batch-invariant mode the same, once
        verified invariant on this machine, else fixed tiles. Block-FP8 weights kept as stored: fp8_linear.py."""
        from deepinfer.engine.cpu_linear import CpuLinear, packed_gemm_available

        invariant = self.config.batch_invariant
        on_cpu_fp32 = self.device.type == "cpu" and self.dtype == torch.float32
        if self.fp8_kept:  # the kept FP8 weights through their kernel, the rest unpacked (fp8_linear.py)
            from deepinfer.engine.fp8_linear import install_fp8

            lin = install_fp8(self.model, self._plain_linear(invariant), self.device, self.dtype, self.config.kernels,
                              invariant)
            self.precision = f"{self.precision}+fp8-weights"
            return lin
        if self.kept_16bit is not None:
            from deepinfer.engine.weights16 import install_16bit

            dtype = next(iter(self.kept_16bit.values())).dtype
            lin = install_16bit(self.model, self.kept_16bit, invariant=invariant, bf16_dot=self.bf16_dot)
            self.kept_16bit = None  # the panels are the only copy now
            # bfloat16- / float16-weights (fp32 arithmetic), or bfloat16-dot (bf16 products)
            self.precision = "bfloat16-dot" if self.bf16_dot else f"{str(dtype).removeprefix('torch.')}-weights"
            return lin
        if on_cpu_fp32 and quantized and quant_mode:
            from deepinfer.engine.quant_linear import install_quantized

            lin = install_quantized(self.model, quantized, mode=quant_mode, invariant=invariant)
            if lin is not None:
                self.precision = f"quantized-{quant_mode}"
                return lin
        if on_cpu_fp32 and self.config.cpu_prepack and self.moe_bf16_dot:
            from deepinfer.engine.models.moe import MoeBlock

            # the routers (and Qwen2-MoE's shared-expert gates) stay fp32: routing is chosen on them
            routers = [w.data for m in self.model.modules() if isinstance(m, MoeBlock)
                       for w in (m.gate_weight, m.shared_gate_weight) if w is not None]
            weights, gated = self.model.linear_weights(), self.model.gated_weights()
            lin = CpuLinear(weights, invariant=invariant, gated=gated, backend="native", bf16_dot=True, keep_fp32=routers)
            self.precision = "bfloat16-dot"
            if not invariant or lin.verify_invariance(weights + gated):
                return self._release_packed(lin)
            raise RuntimeError("the native bf16-dot projections were not batch-invariant on this machine")
        if on_cpu_fp32 and self.config.cpu_prepack and packed_gemm_available():
            weights, gated = self.model.linear_weights(), self.model.gated_weights()
            # auto: a bf16 checkpoint's projections (loaded as fp32) packed as the bf16 they are
            lin = CpuLinear(weights, invariant=invariant, gated=gated, bf16_exact=self.bf16_checkpoint)
            if not invariant or lin.verify_invariance(weights + gated):
                return self._release_packed(lin)
            del lin  # not invariant with this oneDNN build / thread count: fall through
        return self._plain_linear(invariant)

    @staticmethod
    def _plain_linear(invariant: bool):
        """F.linear on the weights as they are; in the batch-invariant mode fixed tiles (bi_matmul)."""
        import torch.nn.functional as F

        from deepinfer.engine import batch_invariant as bi

        if not invariant:
            return F.linear

        def tiled(x, w, b=None):
            y = bi.bi_matmul(x, w)
            return y + b if b is not None else y

        return tiled

    def _release_packed(self, lin):
        """With the native backend the panels are a packed weight's only use (CpuLinear never falls back to
        its values), so each such parameter becomes a placeholder (4 bytes, NaN: a stray read is loud, not
        silently wrong) and the panels its one copy: a float32 model directory was held twice (2.0x its
        bytes), an MoE model's attention, dense and LM head weights too. An untied token embedding keeps
        its values (lookups read them); a tied one is looked up in the LM head's panels. Returns lin,
        re-keyed to the placeholders' addresses."""
        from deepinfer.engine.placeholder import placeholder

        if getattr(lin, "backend", None) != "native":
            return lin  # oneDNN: small batches run F.linear on the weights themselves
        embed = getattr(self.model, "embed_tokens", None)
        keep = {embed.data_ptr()} if embed is not None else set()
        # tied: the model has an lm_head slot and it is empty (the embedding is the head)
        is_tied = embed is not None and hasattr(self.model, "lm_head") and self.model.lm_head is None
        tied = lin.packed.get(embed.data_ptr()) if is_tied else None
        if tied is not None and not tied.bf16_dot:
            from deepinfer_kernels import native

            # a tied embedding: the LM head's panels hold its values (fp32, or bf16 widening exactly) and
            # serve the lookups, so the matrix is not kept twice (SmolLM2-135M as an fp32 directory: 1.22x
            # its bytes resident, the embedding being the 0.2x)
            self.model.set_embedding_impl(lambda ids, pw=tied: native.packed_rows(pw, ids))
            keep = set()
        if self.bf16_checkpoint and embed is not None and getattr(self.model, "lm_head", None) is not None:
            from deepinfer.engine.cpu_linear import as_stored_bf16

            # an untied bf16 checkpoint's embedding (loaded as fp32): looked up in bf16 and widened, exactly
            e16 = as_stored_bf16(embed.data)
            if e16 is not None:
                self.model.register_buffer("embed_tokens_16", e16, persistent=False)  # (counted in weight_bytes)
                self.model.set_embedding_impl(lambda ids, e16=e16: torch.nn.functional.embedding(ids, e16).float())
                embed.data = placeholder(tuple(embed.shape))
        for mod in self.model.modules():
            for p in mod.parameters(recurse=False):
                ptr = p.data_ptr()
                if p.dim() != 2 or ptr in keep:
                    continue
                for table in (lin.packed, lin.packed_gated):
                    if ptr in table:
                        ph = placeholder(tuple(p.shape))
                        table[ph.data_ptr()] = table.pop(ptr)
                        p.data = ph
                        break
        return lin

    def weight_bytes(self) -> int:
        """Bytes of weights held: the model's tensors (each storage once) plus packed/quantised copies."""
        seen: dict[int, int] = {}
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        from deepinfer.engine.loader.fp8_blocks import Fp8Weight

        extra = 0
        for table in (getattr(self.linear, "table", {}), getattr(self.linear, "packed", {}),
                      getattr(self.linear, "packed_gated", {})):
            for v in table.values():
                if isinstance(v, Fp8Weight):
                    extra += v.nbytes
                    continue
                for t in (v if isinstance(v, tuple) else (v,)):
                    t = getattr(t, "panels", getattr(t, "data", t))
                    try:
                        extra += t.untyped_storage().nbytes()
                    except (AttributeError, RuntimeError):  # an opaque (oneDNN) tensor
                        extra += t.numel() * t.element_size()
        return sum(seen.values()) + extra

    def _select_kernels(self) -> None:
        """Route ops to deepinfer_kernels where its dispatch picks TileLang for this device."""
        import deepinfer_kernels as K
        from deepinfer_kernels import native

        # native CPU attention (fp32): 4-8x faster than gathering for SDPA at decode (benchmarks/kernels.py),
        # and batch-invariant by construction, so that mode runs every token through it
        if self._native_attention():
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
            attn = K.selected_backend("paged_decode_attention", self.device) == "tilelang" and self.kv_parts == 2
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

    def measure_forward_cost(self, sizes: list[int], repeats: int = 1,
                             num_layers: int | None = None) -> list[tuple[int, float]]:
        """(T, seconds) of a decode-shaped forward pass over T query tokens with logits for every row,
        best of `repeats`: the cost model of speculative verification. Call before any request runs:
        the scratch tokens write their KV into the first blocks, which are free then."""
        import time

        bs = self.block_size
        table = list(range(-(-2 // bs)))  # room for positions 0 and 1
        if len(table) > self.num_blocks:
            raise ValueError("KV cache too small to measure the forward cost")
        points = []
        for T in sizes:
            batch = ForwardBatch.build([[0]] * T, [1] * T, [table] * T, list(range(T)), bs)
            prepared = self.prepare(batch)
            best = float("inf")
            for _ in range(1 + repeats):  # the first run includes first-use costs of this shape
                t0 = time.perf_counter()
                self.forward(prepared, num_layers=num_layers)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                best = min(best, time.perf_counter() - t0)
            points.append((T, best))
        return points

    def prepare(self, batch: ForwardBatch, mtp_depth: int | None = None) -> "PreparedBatch":
        """The attention metadata of a batch (gather indices, prefill chunks, native-kernel inputs),
        built on the host; `forward` then only runs the model. mtp_depth: a batch for that MTP layer
        (`forward_mtp`), in its stack's form where it has one."""
        bs = batch.block_size
        dev = self.device
        bt = batch.block_tables
        nd = batch.num_decodes
        st = self.decode_stack if mtp_depth is None else self.mtp_stacks[mtp_depth]
        stack = st is not None and batch.num_tokens <= st.max_rows
        if stack and nd == batch.num_seqs:  # decodes only (the common step: no lists built)
            return self._prepare_stack(batch)
        lens = batch.query_lens.tolist()
        ctx_lens_l = batch.context_lens.tolist()
        if stack and self._all_native(lens, ctx_lens_l):
            return self._prepare_stack(batch)
        ctx = ForwardContext(slot_mapping=batch.slot_mapping.to(dev), linear=self.linear, attention_fn=self.attention_fn,
                             silu_mul=getattr(self.linear, "silu_mul", None))
        if self.token_attention is not None:
            row_seq = torch.repeat_interleave(torch.arange(batch.num_seqs), batch.query_lens)
            L = max(ctx_lens_l)
            ctx.token_attention = self.token_attention
            ctx.rope_store_kv = self.rope_store_kv
            ctx.tokens = TokenAttentionInputs(_context_slots(bt, L, bs), row_seq, batch.positions + 1, L)
        if nd and self.token_attention is None:
            ctx_lens = batch.context_lens[:nd]
            L = max(ctx_lens_l[:nd])
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
        for i in range(nd, batch.num_seqs):
            n, total = lens[i], ctx_lens_l[i]
            nc = total - n
            native = ctx.tokens is not None and self._native_chunk(n, total)
            gidx = None
            if nc > 0 and not native:
                p = torch.arange(total)
                gidx = (bt[i, p // bs] * bs + p % bs).to(dev)
            if ctx.tokens is not None and not native:
                ctx.tokens.lens[q_start : q_start + n] = 0  # left to SDPA
            ctx.prefills.append(PrefillChunk(q_start, n, total, gidx, native))
            q_start += n
        if self.group_prefills and ctx.tokens is None and self.attention_fn is None and len(ctx.prefills) > 1:
            kc = self.kv_caches[0][0]  # [slots, kv heads, head dim]: the dims attention sees, MLA's latent ones too
            ctx.prefill_groups = group_prefills(ctx.prefills, bt[nd:], bs, dev, self.model_config.num_attention_heads,
                                                kc.shape[-1])
        return PreparedBatch(batch.input_ids, batch.positions, ctx, batch.logit_rows)

    def _prepare_stack(self, batch: ForwardBatch) -> "PreparedBatch":
        """A batch for the native stack, which reads the block tables itself (one row per token: a
        prefill chunk's or a verified draft's tokens each attend to their own position's prefix, as
        token_attention does them on the per-op path): no attention metadata to build."""
        bt = batch.block_tables
        if batch.num_tokens != batch.num_seqs:
            bt = bt.repeat_interleave(batch.query_lens, dim=0)
        ctx = ForwardContext(slot_mapping=batch.slot_mapping, linear=self.linear, attention_fn=self.attention_fn,
                             silu_mul=self.linear.silu_mul)
        return PreparedBatch(batch.input_ids, batch.positions, ctx, batch.logit_rows, stack_block_tables=bt)

    def _native_chunk(self, n: int, total: int) -> bool:
        """Whether a run of n query tokens ending a context of `total` goes through token_attention
        (with the decodes) rather than SDPA."""
        return self.token_attention_all or n <= NATIVE_MAX_QUERY or n * total <= NATIVE_CHUNK_WORK

    def _all_native(self, lens: list[int], ctx_lens: list[int]) -> bool:
        return self.token_attention is not None and all(self._native_chunk(n, t) for n, t in zip(lens, ctx_lens))

    @torch.inference_mode()
    def forward(self, batch: "PreparedBatch", prev_tokens: torch.Tensor | None = None,
                num_layers: int | None = None) -> torch.Tensor:
        """Run the model over a prepared batch; returns the logits [R, V] of its logit rows.
        Placeholder ids are filled from prev_tokens first. num_layers: run only the first that many
        decoder layers, then the final norm and head (an early exit: self-drafting)."""
        import deepinfer_kernels as K

        with K.use_backend(self.kernels), sdpa_scope(self.device):  # (K's is a context variable: set in this thread)
            return self._forward(batch, prev_tokens, num_layers)

    @torch.inference_mode()
    def forward_with_hidden(self, batch: "PreparedBatch", prev_tokens: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of the logit rows, final hidden state [T, hidden] of every query row): for MTP
        drafting, whose rows read the target's hidden states."""
        import deepinfer_kernels as K

        with K.use_backend(self.kernels), sdpa_scope(self.device):
            return self._forward(batch, prev_tokens, with_hidden=True)

    @torch.inference_mode()
    def forward_mtp(self, batch: "PreparedBatch", hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Logits of MTP layer `depth` at the batch's logit rows; batch.input_ids[i] is the token after
        the one whose target hidden state is hidden[i] (mtp_drafter.py), its KV goes to the MTP cache."""
        import deepinfer_kernels as K

        dev = self.device
        with K.use_backend(self.kernels), sdpa_scope(dev):
            rows = batch.logit_rows.to(dev)
            ids = batch.input_ids.to(dev)
            if batch.stack_block_tables is not None:  # prepare(mtp_depth=...) chose the MTP layer's stack
                x = self.model.mtp[depth].mix(ids, hidden, self.linear, self.model.embed)
                h = self.mtp_stacks[depth](x, batch.positions, batch.ctx.slot_mapping, batch.stack_block_tables)
                return self.model.mtp_head(h.index_select(0, rows), depth, self.linear)
            logits = self.model.mtp_logits(ids, batch.positions.to(dev), hidden, batch.ctx, self.mtp_caches[depth], depth,
                                           rows=rows)
        return logits

    def _forward(self, batch: "PreparedBatch", prev_tokens: torch.Tensor | None,
                 num_layers: int | None = None, with_hidden: bool = False):
        dev = self.device
        ids = batch.input_ids.to(dev, non_blocking=True)
        if prev_tokens is not None:
            ph = ids < 0
            ids = torch.where(ph, prev_tokens.to(dev)[(-ids - 1).clamp(min=0, max=max(prev_tokens.numel() - 1, 0))], ids)
        c = batch.ctx
        if (num_layers is None and not with_hidden and self.graphs is not None and c.num_decode == ids.shape[0] and not c.prefills
                and c.decode_block_tables is not None and self.graphs.fits(c.num_decode, c.decode_block_tables.shape[1])
                and torch.equal(batch.logit_rows, torch.arange(c.num_decode))):
            return self.graphs.replay(ids, batch.positions.to(dev, non_blocking=True), c.slot_mapping,
                                      c.decode_block_tables, c.decode_context_lens)
        R = batch.logit_rows.numel()
        pruned = False
        if batch.stack_block_tables is not None:
            hidden = self.decode_stack(self.model.embed(ids), batch.positions, c.slot_mapping, batch.stack_block_tables,
                                       num_layers)
        else:
            # the model runs one layer per KV cache it is given (zip): fewer caches, fewer layers
            kv = self.kv_caches if num_layers is None else self.kv_caches[:num_layers]
            # the last layer only for the logit rows, unless every row's final state is wanted
            pruned = self.prune_last_layer and not with_hidden and 0 < R < ids.shape[0]
            ctx = dataclasses.replace(c, keep_rows=batch.logit_rows.to(dev)) if pruned else c
            hidden = self.model(ids, batch.positions.to(dev), ctx, kv)
        if R:
            sel = hidden if pruned else hidden.index_select(0, batch.logit_rows.to(dev))
            logits = self.model.compute_logits(sel, batch.ctx)
        else:
            logits = torch.empty(0, self.model_config.vocab_size, device=dev)
        return (logits, hidden) if with_hidden else logits


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # [T] (may hold placeholders < 0)
    positions: torch.Tensor  # [T]
    ctx: ForwardContext
    logit_rows: torch.Tensor  # [R] hidden rows whose logits are computed
    # [T, max_blocks] int64 (each token's sequence's table) when the batch runs through the native stack
    stack_block_tables: torch.Tensor | None = None
