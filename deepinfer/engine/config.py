"""Engine configuration: every knob in one place, validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from deepinfer.errors import InvalidRequestError


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the default SmolLM2-135M-Instruct
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    # "auto" (CPU: fp32, as the quantized kernels lose at batch 128 here; CUDA: bf16) |
    # "float32" | "bfloat16" | "float16" | "quantized" (int8 dot products) | "quantized_exact" (fp32 dequant)
    dtype: str = "auto"
    # tokens per KV block = the radix cache's page size. 1 shares every reusable token (measured:
    # 100% of the ideal reuse on multi-turn chat vs 86% at 16) and was not slower here.
    block_size: int = 1
    kv_cache_memory: int | None = None  # bytes for the KV cache; None -> kv_cache_fraction of free memory
    kv_cache_fraction: float = 0.2
    max_kv_cache_memory_cpu: int = 4 << 30  # cap on CPU, where "free memory" is all of RAM
    # the KV cache's element type: "auto" | "float32" | "bfloat16". auto: bf16 on CPU in the two
    # approximate precisions (dtype "quantized" and "bfloat16") where the native attention runs (half
    # the bytes a decode step's attention reads, twice the tokens a budget holds; ModelRunner
    # .kv_cache_dtype has the measurements), else the compute dtype (fp32 modes stay exact)
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # None -> the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    schedule_policy: str = "lpm"  # "lpm": longest cached prefix first (bounded window) | "fcfs"
    lpm_window: int = 64  # how many waiting requests lpm reorders; older ones are never starved
    seed: int = 0  # engine-level seed: makes unseeded sampling reproducible run to run
    batch_invariant: bool = False
    # plan step N+1 on this thread while step N runs in a worker. Off by default: on the 2-core CPU
    # the planning thread takes a core from the forward (0.80x at batch 64), and on an H200 with a
    # small model the forward itself is CPU-bound launch work that the GIL serialises (see README)
    overlap_schedule: bool = False
    # "auto": per spec kind, the fastest backend to a first mask that serves it exactly (JSON
    # schemas: llguidance, then xgrammar; regex / EBNF / choices: xgrammar; grammar.compiler.AUTO_ORDER);
    # or "xgrammar" | "llguidance" | "outlines" first, then the others
    grammar_backend: str = "auto"
    grammar_fallback: bool = True
    # seconds one grammar backend may spend compiling one spec; past it the request fails with a
    # GrammarBudgetError instead of waiting (compiles run off the step loop, see Engine.add_request)
    grammar_compile_timeout: float | None = 60.0
    # grammar budgets (grammar/compiler.py, issue 51): a spec text past grammar_max_spec_bytes is
    # refused at once (None: no limit); past grammar_isolate_bytes it compiles beside the others
    # (a pool of its own) and xgrammar compiles it in a worker process with grammar_compile_memory
    # bytes of address space, killed at grammar_compile_timeout (GrammarBudgetError either way)
    grammar_max_spec_bytes: int | None = 2 * 2**20
    grammar_isolate_bytes: int | None = 256 * 2**10
    grammar_compile_memory: int = 2 * 2**30
    # verify the grammar's forced continuation (e.g. a JSON key) as draft tokens: one forward pass
    # for the whole run instead of one per token, and the output is what it would be without it
    # (in the synchronous loop, or the overlapped one while speculation drafts; otherwise the
    # overlapped loop decodes forced text token by token). Off by default: on the extraction job of
    # benchmarks/structured.py (64 records, batch 64, 2-core CPU) it measured 0.94x records/s (4.07 vs
    # 4.31, quiet, best of 3; 0.92x the stop before): 10% fewer steps (55 vs 61), but 45% of the forced
    # drafts were cut by the model's own tokenisation (317 forward tokens computed for nothing), and
    # at this batch a forward's cost follows its tokens, not its count
    jump_forward: bool = False
    # speculative decoding: "ngram" (prompt lookup: drafts copied from earlier in the sequence) or
    # None. Drafts are verified exactly (outputs identical with it on or off); sequences under a
    # grammar with jump_forward on get the grammar's drafts. With overlap_schedule, a step that
    # verifies drafts is planned after the step before it (drafts need its tokens); while drafting
    # is paused (it does not pay, speculation.py) the loop overlaps as without speculation.
    # "draft": a draft model: `draft_model` (a smaller checkpoint sharing the tokenizer), or else
    # self-drafting with the model's first `draft_layers` layers + its head (draft_model.py);
    # "mtp": the checkpoint's multi-token-prediction layer, one draft per step (mtp_drafter.py)
    speculative: str | None = None
    num_speculative_tokens: int = 4  # most draft tokens verified per sequence per step
    draft_layers: int | None = None  # speculative="draft": early-exit depth (None: a quarter of the layers)
    draft_model: str | None = None  # speculative="draft": a separate draft checkpoint (HF dir or .gguf)
    # size each step's verification by the drafts' learned confidence and the forward cost measured
    # at start (speculation.py); False verifies every draft the drafter proposes
    speculative_budget: bool = True
    # CUDA: replay decode-only steps from graphs captured per padded batch-size bucket
    # (engine/cuda_graphs.py); prefill and mixed steps run eagerly
    cuda_graphs: bool = False
    kernels: str = "auto"  # custom kernels: "auto" (per op and device, as measured) | "torch" | "tilelang"
    # CPU fp32: pack every projection weight for the native panel GEMM (oneDNN's layout where no C
    # compiler is found): 1.1-2.2x faster than F.linear at every batch size (benchmarks/kernels.py);
    # the native panels replace the weights (ModelRunner._release_packed), oneDNN's sit beside them
    cpu_prepack: bool = True
    # CPU, the native grouped expert kernel: how the routed experts' packed weights are stored.
    # "bfloat16" halves the bytes a decode step streams (the kernel widens them to fp32 exactly and
    # accumulates in fp32): the expert GEMMs of a batch-32 decode are bound by that stream here.
    # "auto": as the checkpoint stores them: bf16 where every routed expert tensor is bf16 (then
    # exactly the fp32 path's bits, since widening a bf16 value is exact), else fp32.
    moe_expert_dtype: str = "auto"
    # a block-FP8 checkpoint (DeepSeek-V3's): "auto" keeps its projections FP8 where the FP8 kernel runs
    # them (CUDA, bf16 / fp16 activations, TileLang: a byte per weight) and dequantises them at load
    # elsewhere; "keep" keeps them FP8 everywhere: without the kernel each weight is dequantised per
    # call, a memory-for-time trade (benchmarks/moe.py's V3-shaped model as an FP8 checkpoint, CPU fp32:
    # 216 MB held instead of 856, but 23 instead of 265 tok/s at batch 8); "dequantize" always
    # dequantises at load (fp8_linear.py)
    fp8_weights: str = "auto"
    num_threads: int | None = None  # torch intra-op threads on CPU; None -> all cores
    cache_dir: str | None = None  # where converted models are cached
    # expert parallelism (deepinfer/distributed): N worker processes hold the weights, each only
    # n_routed_experts / N of every MoE layer's experts; attention is data-parallel (each rank runs its
    # own sequences)
    expert_parallel_size: int = 1
    expert_parallel_dispatch: str = "normal"  # "normal" (count exchange, uneven all-to-all) | "low_latency"
    expert_parallel_timeout: float = 60.0  # seconds a collective (or a worker's step) may wait on a peer
    # redundant experts (EPLB): this many extra expert copies per MoE layer (a multiple of the size),
    # re-placed onto the hottest experts from measured load every `rebalance_interval` forward steps
    # (0: only when Engine.rebalance_experts() is called)
    expert_parallel_redundant: int = 0
    expert_parallel_rebalance_interval: int = 0

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"EngineConfig: {msg}")

        if self.block_size < 1:
            raise bad(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise bad(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise bad(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise bad(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise bad(f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise bad(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if not (0 < self.kv_cache_fraction <= 0.95):
            raise bad(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise bad(f"kv_cache_dtype must be 'auto', 'float32' or 'bfloat16', got {self.kv_cache_dtype!r}")
        if self.moe_expert_dtype not in ("auto", "float32", "bfloat16"):
            raise bad(f"moe_expert_dtype must be 'auto', 'float32' or 'bfloat16', got {self.moe_expert_dtype!r}")
        if self.fp8_weights not in ("auto", "keep", "dequantize"):
            raise bad(f"fp8_weights must be 'auto', 'keep' or 'dequantize', got {self.fp8_weights!r}")
        if self.kernels not in ("auto", "torch", "tilelang"):
            raise bad(f"kernels must be 'auto', 'torch' or 'tilelang', got {self.kernels!r}")
        if self.speculative not in (None, "ngram", "draft", "mtp"):
            raise bad(f"speculative must be 'ngram', 'draft', 'mtp' or None, got {self.speculative!r}")
        if self.draft_model is not None:
            if not isinstance(self.draft_model, (str, os.PathLike)):
                raise bad(f"draft_model must be a path to a checkpoint, got {self.draft_model!r}")
            if self.speculative != "draft":
                raise bad(f"draft_model is used by speculative='draft', got speculative={self.speculative!r}")
            if self.draft_layers is not None:
                raise bad("draft_layers (self-drafting depth) and draft_model (a separate checkpoint) "
                          "exclude each other")
            if self.expert_parallel_size != 1:
                raise bad("draft_model with expert_parallel_size > 1 is not supported (the draft would run in the engine process)")
        if self.draft_layers is not None and (isinstance(self.draft_layers, bool)
                                              or not isinstance(self.draft_layers, int) or self.draft_layers < 1):
            raise bad(f"draft_layers must be an int >= 1 or None, got {self.draft_layers!r}")
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int) \
                or self.num_speculative_tokens < 1:
            raise bad(f"num_speculative_tokens must be an int >= 1, got {self.num_speculative_tokens!r}")
        if self.grammar_compile_timeout is not None and not (
            isinstance(self.grammar_compile_timeout, (int, float)) and not isinstance(self.grammar_compile_timeout, bool)
            and self.grammar_compile_timeout > 0
        ):
            raise bad(f"grammar_compile_timeout must be a number of seconds > 0 or None, got {self.grammar_compile_timeout!r}")
        for name in ("grammar_max_spec_bytes", "grammar_isolate_bytes", "grammar_compile_memory"):
            v = getattr(self, name)
            if (v is not None or name == "grammar_compile_memory") and (
                    isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise bad(f"{name} must be a number of bytes > 0{'' if name == 'grammar_compile_memory' else ' or None'}, "
                          f"got {v!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise bad(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.cuda_graphs and self.device == "cpu":
            raise bad("cuda_graphs needs a CUDA device (device='cuda' or 'auto' on a GPU machine)")
        if self.cuda_graphs and self.batch_invariant:
            raise bad("cuda_graphs and batch_invariant cannot be combined (the invariant attention is not capturable)")
        if isinstance(self.expert_parallel_size, bool) or not isinstance(self.expert_parallel_size, int) \
                or self.expert_parallel_size < 1:
            raise bad(f"expert_parallel_size must be an int >= 1, got {self.expert_parallel_size!r}")
        if self.kv_cache_dtype != "auto" and self.expert_parallel_size > 1:
            raise bad(f"kv_cache_dtype={self.kv_cache_dtype!r} with expert_parallel_size > 1: the workers' KV caches "
                      "keep the compute dtype (leave it 'auto')")
        if self.expert_parallel_dispatch not in ("normal", "low_latency"):
            raise bad(f"expert_parallel_dispatch must be 'normal' or 'low_latency', got {self.expert_parallel_dispatch!r}")
        if not (isinstance(self.expert_parallel_timeout, (int, float)) and not isinstance(self.expert_parallel_timeout, bool)
                and self.expert_parallel_timeout > 0):
            raise bad(f"expert_parallel_timeout must be a number of seconds > 0, got {self.expert_parallel_timeout!r}")
        for name in ("expert_parallel_redundant", "expert_parallel_rebalance_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(f"{name} must be an int >= 0, got {v!r}")
        if self.grammar_backend not in ("auto", "xgrammar", "llguidance", "outlines"):
            raise bad(f"grammar_backend must be 'auto', 'xgrammar', 'llguidance' or 'outlines', "
                      f"got {self.grammar_backend!r}")

    def grammar_budgets(self) -> dict[str, Any]:
        """The GrammarCompiler budget arguments these options give."""
        return {"max_spec_bytes": self.grammar_max_spec_bytes, "isolate_bytes": self.grammar_isolate_bytes,
                "compile_memory": self.grammar_compile_memory}

    @classmethod
    def from_kwargs(cls, model: str | None, kwargs: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(f"unknown Engine option(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)
