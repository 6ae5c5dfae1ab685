"""The grammar side of the engine: compile each request's constraint once, give its sequence a
matcher, and mask the logits of every row a step samples.

A sequence that verifies draft tokens samples several rows in one step: row j is drawn after drafts
1..j, so its mask is the matcher's state after accepting them. The matcher is walked through the
drafts and rolled back, so it ends the step where it began; the output processor then advances it
through the tokens actually accepted. A draft the grammar rejects ends the walk: rows after it have
no valid mask and are never accepted.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.stats import EngineStats


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], backend: str, fallback: bool,
                 stats: EngineStats, compile_timeout: float | None = 60.0, budgets: dict | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.backend = backend
        self.fallback = fallback
        self.compile_timeout = compile_timeout
        # GrammarCompiler max_spec_bytes / isolate_bytes / compile_memory (EngineConfig grammar_*)
        self.budgets = dict(budgets or {})
        # compiles of large specs (GrammarCompiler.is_large) a request waits for off the step loop,
        # never adopted into a step (see attach)
        self._deferred: weakref.WeakSet = weakref.WeakSet()
        self.stats = stats
        self._compiler = None  # built at the first constrained request (compiling the vocab costs time)
        self._uploader = None  # pinned host -> device copy of each step's mask (non-CPU logits)
        self._compiler_lock = threading.Lock()
        self._precompiling: dict = {}  # spec -> Future of its precompile, while it runs
        # sequences given a running precompile by attach(adopt_precompile=True) and not yet bound:
        # while 0 (nearly always), a step's sampling skips looking for them (StepSampler.sample)
        self.adopted = 0

    @property
    def token_bytes(self) -> list[bytes | None]:
        return self._compiler.token_bytes

    def _spec(self, p: SamplingParams):
        from deepinfer.grammar import GrammarCompiler, spec_from_params

        spec = spec_from_params(
            regex=p.regex, json_schema=p.json_schema, grammar=p.grammar, choices=p.choices, dtype=p.dtype,
            json_object=p.json_object, max_integer_digits=getattr(p, "max_integer_digits", None),
        )
        with self._compiler_lock:  # precompile() may come from another thread than the step loop
            if spec is not None and self._compiler is None:
                self._compiler = GrammarCompiler(
                    self.tokenizer.hf, self.vocab_size, self.eos_token_ids, backend=self.backend,
                    fallback=self.fallback, compile_timeout=self.compile_timeout, **self.budgets,
                )
                self._compiler.warm_async()  # the other kinds' backends, off the step loop
        return spec

    def precompile(self, params: SamplingParams):
        """A Future of compiling params' constraint in the compiler's threads (None: nothing to compile,
        or a malformed spec, which add_request reports). attach() then waits on / reuses it."""
        try:
            spec = self._spec(params)
        except Exception:
            return None
        if spec is None:
            return None
        future = self._compiler.compile_async(spec)
        with self._compiler_lock:
            self._precompiling[spec] = future
        future.add_done_callback(lambda f, spec=spec: self._forget_precompile(spec, f))
        return future

    def _forget_precompile(self, spec, future) -> None:
        with self._compiler_lock:
            if self._precompiling.get(spec) is future:
                del self._precompiling[spec]

    def attach(self, seq: Sequence, params: SamplingParams, wait: float | None = None,
               adopt_precompile: bool = False) -> None:
        """Give seq a matcher for its constraint (if any). Raises GrammarError for an invalid spec.

        A spec compiled before attaches at once. Otherwise it compiles in the compiler's thread
        pool and this waits up to `wait` seconds (None: until done); a compile still running then
        leaves `seq.grammar_pending` set, and the engine holds the sequence back until
        `finish_attach` (so a slow schema never stalls the other requests' steps).

        adopt_precompile: if a `precompile` of the spec is still running, leave seq.grammar_pending
        set to it at once, whatever `wait` (the engine then prefills the sequence while it compiles
        and `bind_pending` waits for it before the sequence's first sample).

        A large spec (GrammarCompiler.is_large: seconds to minutes of compile) never compiles here
        nor is adopted, whatever `wait`: it compiles in the compiler's pool for large specs and
        seq.grammar_pending is left set (`deferred(seq)` is then true), so the engine holds seq
        back until it is ready instead of blocking add_request or a step on it (issue 51)."""
        from concurrent.futures import TimeoutError as FutureTimeout

        spec = self._spec(params)
        if spec is None:
            return
        large = self._compiler.is_large(spec) and not self._compiler.is_cached(spec)
        if adopt_precompile and not large:
            with self._compiler_lock:
                running = self._precompiling.get(spec)
            if running is not None and not running.done():
                seq.grammar_pending = running
                self.adopted += 1
                return
        if (wait is None and not large) or self._compiler.is_cached(spec):
            self._bind(seq, *self._compiler.compile(spec))
            return
        future = self._compiler.compile_async(spec)
        if large:
            self._deferred.add(future)
            wait = 0.0
        try:
            result = future.result(timeout=wait)
        except FutureTimeout:
            seq.grammar_pending = future
            return
        self._bind(seq, *result)

    def deferred(self, seq: Sequence) -> bool:
        """Whether seq waits for a large spec's compile (attach): the engine must hold it back, even
        on an idle engine, rather than queue it and wait in a step."""
        return seq.grammar_pending is not None and seq.grammar_pending in self._deferred

    def finish_attach(self, seq: Sequence) -> None:
        """Bind the grammar a sequence waited for (its compile is done). Raises its GrammarError."""
        future, seq.grammar_pending = seq.grammar_pending, None
        self._bind(seq, *future.result())

    def bind_pending(self, seqs: list[Sequence]) -> None:
        """Before a step samples: bind the grammar of every sequence admitted while its constraint
        still compiled (Engine.add_request), waiting for the compiles still running. A failed
        compile sets seq.error: the sequence then finishes with that error and no token, as one
        held back until its compile was done would."""
        t = time.perf_counter()
        waited = False
        for seq in seqs:
            if seq.grammar_pending is None:
                continue
            waited = waited or not seq.grammar_pending.done()
            self.adopted = max(0, self.adopted - 1)  # (one aborted before its sample keeps the count up: scans go on)
            try:
                self.finish_attach(seq)
            except Exception as e:  # GrammarError (or a timeout past compile_timeout): this request's error
                seq.error = f"{type(e).__name__}: {e}"
        if waited:
            self.stats.grammar_wait_time += time.perf_counter() - t

    @staticmethod
    def _bind(seq: Sequence, compiled, backend: str) -> None:
        seq.matcher = compiled.new_matcher()
        seq.grammar_backend = backend
        seq.grammar = compiled

    def apply_masks(self, logits: torch.Tensor, rows: list[tuple[Sequence, int, list[int]]], step_id: int) -> list[int]:
        """Mask logits in place. rows: (sequence, its first row in logits, its drafts); the sequence's
        rows are first_row .. first_row + len(drafts). Returns per entry how many of its rows have a
        valid mask (1 + the drafts its grammar accepts; all of them when unconstrained)."""
        return self._masks(logits, rows, step_id, apply=True)[0]

    def device_masks(self, logits: torch.Tensor, rows: list[tuple[Sequence, int, list[int]]],
                     step_id: int) -> tuple[list[int], torch.Tensor | None]:
        """apply_masks without applying: (valid, the step's int32 bitmask on logits' device with
        every row that is not masked all-allowed, or None when nothing is constrained), for a
        sampler that applies it itself (the fused kernel)."""
        return self._masks(logits, rows, step_id, apply=False)

    def _masks(self, logits, rows, step_id, apply: bool):
        valid = [1 + len(d) for _, _, d in rows]
        constrained = [i for i, (s, _, _) in enumerate(rows) if s.matcher is not None]
        if not constrained:
            return valid, None
        from deepinfer.grammar import allocate_token_bitmask, apply_token_bitmask_

        t = time.perf_counter()
        bitmask = allocate_token_bitmask(logits.shape[0], logits.shape[1])  # row r belongs to logits row r
        masked: list[int] = []
        for i in constrained:
            seq, r0, drafts = rows[i]
            try:
                guard = self._budget_guard(seq, logits)
                if not drafts and seq.next_mask is not None and seq.next_mask_step == step_id:
                    bitmask[r0] = seq.next_mask[0]  # filled while this step's forward ran
                    if guard is not None:
                        guard(bitmask, r0, 0)
                    masked.append(r0)
                else:
                    valid[i] = self._walk_drafts(seq, bitmask, r0, drafts, guard)
                    masked.extend(range(r0, r0 + valid[i]))
            except Exception as e:  # a grammar library failing on one request fails only that one
                seq.error = f"grammar failed while masking: {type(e).__name__}: {e}"
                valid[i] = 1
            seq.next_mask = None
        if not apply:  # rows left unmasked (a failed matcher may have half-filled one) allow everything
            unmasked = sorted(set(range(logits.shape[0])) - set(masked))
            if unmasked:
                bitmask[unmasked] = -1
        if logits.device.type != "cpu":  # one non-blocking copy of the step's mask, applied on the device
            from deepinfer.grammar.bitmask_device import BitmaskUploader

            self._uploader = self._uploader or BitmaskUploader()
            bitmask = self._uploader.upload(bitmask, logits.device)
        if apply:
            apply_token_bitmask_(logits, bitmask, rows=masked)
        self.stats.record_grammar(time.perf_counter() - t, len(masked))
        return valid, bitmask

    def _budget_guard(self, seq: Sequence, logits: torch.Tensor):
        """complete_within_budget: fn(bitmask, row, j) narrowing the mask of the draw j tokens
        after the sequence's output so far (grammar/budget.py); None when not asked for."""
        p = seq.params
        if not getattr(p, "complete_within_budget", False):
            return None
        guard = self._compiler.budget_guard()
        n_out = len(seq.output_token_ids) - len(seq.placeholders)
        spec = getattr(seq.grammar, "spec", None)
        is_json = spec is not None and (spec.kind in ("json_schema", "json_object") or spec.dtype == "str")

        def restrict(bitmask: torch.Tensor, row: int, j: int, drafts=()) -> None:
            lex = (lambda: self._json_lex(seq, guard, n_out, drafts[:j])) if is_json else None
            guard.restrict(seq.matcher, bitmask, row, logits[row], p.max_tokens - (n_out + j), lex)

        return restrict

    @staticmethod
    def _json_lex(seq: Sequence, guard, n_out: int, drafts) -> tuple[bool, bool]:
        """The JSON lexer state (grammar/budget.py lex_json) after the first n_out output tokens and
        drafts: kept on the matcher up to the output's end, so each token is lexed once."""
        from deepinfer.grammar.budget import JSON_START

        n, state = getattr(seq.matcher, "_budget_lex", (0, JSON_START))
        if n > n_out:  # the output got shorter (never in practice): lex it again
            n, state = 0, JSON_START
        for t in seq.output_token_ids[n:n_out]:
            state = guard._advance(state, t)
        seq.matcher._budget_lex = (n_out, state)
        for t in drafts:
            state = guard._advance(state, t)
        return state

    @staticmethod
    def _walk_drafts(seq: Sequence, bitmask: torch.Tensor, r0: int, drafts: list[int], guard=None) -> int:
        m = seq.matcher
        m.fill_bitmask(bitmask, r0)
        if guard is not None:
            guard(bitmask, r0, 0)
        walked = valid = 0
        for d in drafts:
            if not m.accept_token(d):
                break
            walked += 1
            if m.is_terminated():  # the draft ends the output: nothing after it is sampled
                break
            m.fill_bitmask(bitmask, r0 + walked)
            if guard is not None:
                guard(bitmask, r0 + walked, walked, drafts)
            valid = walked
        if walked:
            m.rollback(walked)
        return 1 + valid

    def forced_drafts(self, seq: Sequence, max_tokens: int) -> list[int]:
        """The grammar's forced continuation from seq's state, tokenised canonically (each token
        checked against the forced bytes and the mask; grammar/jump_forward.py), as draft tokens:
        the model verifies them like any draft, so what it writes never depends on them. The
        matcher is left where it was."""
        from deepinfer.grammar.jump_forward import MAX_JUMP_FORWARD_BYTES, jump_forward

        if max_tokens < 1 or seq.matcher.is_terminated():
            return []
        t = time.perf_counter()
        try:
            # bounded: a grammar can force an endless string; a token rarely spans more than 16 bytes
            jf = jump_forward(seq.matcher, self.tokenizer.hf, self.token_bytes,
                              max_bytes=min(MAX_JUMP_FORWARD_BYTES, 16 * max_tokens), truncate=True)
            if jf.token_ids:
                seq.matcher.rollback(len(jf.token_ids))
        except Exception as e:  # drafts are optional; the request's next mask reports the failure
            seq.error = f"grammar failed: {type(e).__name__}: {e}"
            return []
        finally:
            self.stats.grammar_time += time.perf_counter() - t
        return jf.token_ids[:max_tokens]

    def prefill_mask(self, seq: Sequence) -> None:
        """Overlap mode: fill the bitmask for the sample in flight now, while its forward runs."""
        from deepinfer.grammar import allocate_token_bitmask

        t = time.perf_counter()
        if seq.next_mask is None:
            seq.next_mask = allocate_token_bitmask(1, self.vocab_size)
        seq.matcher.fill_bitmask(seq.next_mask, 0)
        seq.next_mask_step = seq.placeholders[-1]
        dt = time.perf_counter() - t
        self.stats.grammar_time += dt
        self.stats.mask_prefill_time += dt
