"""GrammarCompiler: one per (tokenizer, model vocab); compiles specs once, with fallback.

The tokenizer's vocabulary is processed once per instance; backends are created on first use.
`compile(spec)` is cached by spec (kind, text), failures included, so a batch of 10,000
requests sharing one schema compiles it once. It is thread-safe: concurrent calls for the same
spec wait for a single compilation; different specs compile in parallel.
"""

from __future__ import annotations

import json

import threading
from collections import Counter
from typing import Callable, Mapping

import tokenizers

from deepinfer.errors import GrammarBudgetError, GrammarError, InvalidSpecError
from deepinfer.grammar.backend import CompiledGrammar, GrammarBackend
from deepinfer.grammar.bitmask import allocate_token_bitmask
from deepinfer.grammar.emptiness import ebnf_is_empty, regex_is_empty, schema_is_empty
from deepinfer.grammar.exactness import (
    check_spec,
    diagnostics_keywords,
    schema_of,
    strict_narrowing,
    table_approximated,
)
from deepinfer.grammar.formats import lower_formats
from deepinfer.grammar.lowering import lower_schema
from deepinfer.grammar.orders import any_order
from deepinfer.grammar.patterns import lower_patterns
from deepinfer.grammar.spec import GrammarSpec, spec_of
from deepinfer.grammar.vocab import TokenizerVocab

BACKEND_NAMES = ("xgrammar", "llguidance", "outlines")
#: the default backend: the chain below, per spec kind
AUTO = "auto"
# What "auto" tries first, per kind (benchmarks/grammar_ttfm.py: cold compile to first mask, one
# thread, SmolLM2 tokenizer, 2-core AMD EPYC). JSON schemas on llguidance, which builds its masks
# lazily: the 747 shared JSONSchemaBench schemas reach a first mask at p50 2.7 ms, max 11 ms on it
# alone, against xgrammar's full compile p50 6.7 ms, p99 284 ms, max 4.0 s; the chain with
# llguidance first p50 3.0 / p99 17 ms (xgrammar first: 6.5 / 281 ms), as many grammars exact
# (561), no exact leak. xgrammar next, where llguidance refuses a keyword (169 of 747) or only
# approximates. Regex, EBNF and choices on xgrammar, as fast there (0.4-4 ms; llguidance 1.3-3.4 ms)
# and the documented EBNF dialect.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "json_schema": ("llguidance", "xgrammar", "outlines"),
    "json_object": ("llguidance", "xgrammar", "outlines"),
    "regex": ("xgrammar", "llguidance", "outlines"),
    "ebnf": ("xgrammar", "llguidance", "outlines"),
    "choices": ("xgrammar", "llguidance", "outlines"),
}
# Budgets (issue 51: one request's schema never slows or breaks another's). A spec's text past
# MAX_SPEC_BYTES is refused at once (GrammarBudgetError). Past ISOLATE_BYTES the backends that cannot
# be interrupted compile in a worker process (isolated.py) with COMPILE_MEMORY bytes of address
# space, killed at compile_timeout, and such a spec compiles in its own thread pool, so smaller
# constraints never queue behind it. The JSONSchemaBench subsets' largest schema is 72 KB (compiles
# in-process as before); the 1.17 MB schema (9,000 optional properties) made xgrammar grow
# 1.4 -> 4.6 GB in 540 s and outlines-core ~290 MB/s, its 2.3 MB twin OOM-killed the engine at 24 GB.
MAX_SPEC_BYTES = 2 * 2**20
ISOLATE_BYTES = 256 * 2**10
COMPILE_MEMORY = 2 * 2**30
_ALIASES = {"outlines-core": "outlines", "outlines_core": "outlines"}
BackendFactory = Callable[[TokenizerVocab], GrammarBackend]


def _default_factories(strict_json: bool) -> dict[str, BackendFactory]:
    def xgrammar(vocab: TokenizerVocab) -> GrammarBackend:
        from deepinfer.grammar.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(vocab, strict_json=strict_json)

    def outlines(vocab: TokenizerVocab) -> GrammarBackend:
        from deepinfer.grammar.outlines_backend import OutlinesBackend

        return OutlinesBackend(vocab)

    def llguidance(vocab: TokenizerVocab) -> GrammarBackend:
        from deepinfer.grammar.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(vocab, strict_json=strict_json)

    return {"xgrammar": xgrammar, "llguidance": llguidance, "outlines": outlines}


#: first-mask tokens check_nonempty walks one step on a fresh matcher each
PROBE_TOKENS = 4


def check_nonempty(compiled: CompiledGrammar, vocab_size: int, probe: bool = False) -> None:
    """InvalidSpecError when the grammar allows nothing at all from its start (e.g. the regex
    `[^\\s\\S]`): a spec with an empty language is invalid whichever backend compiled it.
    probe: also accept each of the first PROBE_TOKENS tokens the first mask allows, on a fresh
    matcher each, so a backend that cannot take its own first step (llguidance past a parser limit
    on the issue-51 schema: every token after `{` refused) fails here, where the next backend is
    tried, not at the request's first sampled token. A probe that refuses a masked-in token raises
    GrammarError."""
    m = compiled.new_matcher()
    if m.can_terminate() and not probe:
        return
    mask = allocate_token_bitmask(1, vocab_size)
    m.fill_bitmask(mask, 0)
    if not bool(mask.any()):
        raise InvalidSpecError(
            f"{compiled.spec.kind} spec admits no output: no token can start it (its language is empty)"
        )
    if not probe:
        return
    words = mask[0].nonzero().flatten().tolist()
    tried = 0
    for w in words:
        bits = int(mask[0, w]) & 0xFFFFFFFF
        while bits and tried < PROBE_TOKENS:
            b = (bits & -bits).bit_length() - 1
            bits &= bits - 1
            t = 32 * w + b
            if t >= vocab_size:
                break
            tried += 1
            if not compiled.new_matcher().accept_token(t):
                raise GrammarError(f"{compiled.backend_name}: its first mask allows token {t}, which its matcher refuses")
        if tried >= PROBE_TOKENS:
            break


class _Pending:
    """A compilation in flight: other threads wait on `done`."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: tuple[CompiledGrammar, str] | None = None
        self.error: GrammarError | None = None


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer.

    hf_tokenizer: a tokenizers.Tokenizer; vocab_size: the model's logits width (may exceed the
    tokenizer's length; extra ids are never allowed); stop_token_ids: tokens allowed exactly when
    the grammar can terminate. backend: "auto" (default: per spec kind, the order of AUTO_ORDER:
    llguidance first for JSON schemas, xgrammar first for the rest), "xgrammar", "llguidance" or
    "outlines" (that one first, then the others in AUTO_ORDER's order); with fallback=True a spec
    the first backend rejects or only approximates is tried on the others, the most exact result
    is kept (an exact grammar is never replaced by an approximated one, whichever was faster),
    and `compile` reports which served. `backends` maps names to factories (TokenizerVocab ->
    GrammarBackend) to add or replace them (new names are tried after the built-in ones).
    strict_json: schemas forbid undeclared properties and tuple items (xgrammar's strict mode;
    for llguidance written into the schema where that only narrows, see strict.py).
    compile_timeout: seconds one backend may spend on one spec; past it that backend counts as
    unable to compile it (the next one is tried), so a pathological schema becomes a
    GrammarBudgetError, not a stall. An in-process compilation cannot be interrupted: it finishes
    in a daemon thread and is dropped; a spec past isolate_bytes compiles xgrammar in a worker
    process instead (isolated.py: compile_memory bytes of address space, killed at the deadline),
    and outlines (whose index cannot leave its process) does not serve it. max_spec_bytes: a spec
    text past it is refused at once (GrammarBudgetError; None: no limit). compile_async runs
    compile in a pool of compile_threads threads, specs past isolate_bytes in a pool of their own.
    """

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        backend: str = AUTO,
        fallback: bool = True,
        backends: Mapping[str, BackendFactory] | None = None,
        strict_json: bool = True,
        compile_timeout: float | None = 120.0,
        compile_threads: int = 2,
        max_spec_bytes: int | None = MAX_SPEC_BYTES,
        isolate_bytes: int | None = ISOLATE_BYTES,
        compile_memory: int = COMPILE_MEMORY,
    ):
        self._factories = _default_factories(strict_json)
        if compile_timeout is not None and not compile_timeout > 0:
            raise GrammarError(f"compile_timeout must be > 0 seconds or None, got {compile_timeout!r}")
        for name, v in (("max_spec_bytes", max_spec_bytes), ("isolate_bytes", isolate_bytes)):
            if v is not None and not (isinstance(v, int) and v > 0):
                raise GrammarError(f"{name} must be a number of bytes > 0 or None, got {v!r}")
        if not (isinstance(compile_memory, int) and compile_memory > 0):
            raise GrammarError(f"compile_memory must be a number of bytes > 0, got {compile_memory!r}")
        self.compile_timeout = compile_timeout
        self.max_spec_bytes = max_spec_bytes
        self.isolate_bytes = isolate_bytes
        self.compile_memory = compile_memory
        self._strict_json = strict_json
        self._compile_threads = compile_threads
        self._executor = None  # made on the first compile_async
        self._large_executor = None  # specs past isolate_bytes: made on the first such compile_async
        self._factories.update(backends or {})
        backend = _ALIASES.get(backend, backend)
        if backend != AUTO and backend not in self._factories:
            raise GrammarError(f"unknown grammar backend {backend!r}; expected {AUTO!r} or one of "
                               f"{sorted(self._factories)}")
        self.backend_name = backend
        self.fallback = fallback
        self.vocab = TokenizerVocab.from_tokenizer(hf_tokenizer, vocab_size, list(stop_token_ids))
        self.tokenizer = hf_tokenizer
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_errors: dict[str, GrammarError] = {}
        self._cache: dict[GrammarSpec, _Pending] = {}
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._backend_locks: dict[str, threading.Lock] = {}
        #: counters: compiles (backend compile calls), cache_hits, fallbacks, failures, and
        #: served_<backend> per backend that served a compiled spec
        self.stats: Counter[str] = Counter()

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    @property
    def token_bytes(self) -> list[bytes | None]:
        """Bytes of every token id (None for special and padding ids)."""
        return self.vocab.token_bytes

    def backend_order(self, kind: str) -> list[str]:
        """The backends compile tries for a spec of this kind, in order."""
        chain = [n for n in AUTO_ORDER.get(kind, BACKEND_NAMES) if n in self._factories]
        chain += [n for n in self._factories if n not in chain]  # backends added by name
        if self.backend_name != AUTO:
            chain = [self.backend_name] + [n for n in chain if n != self.backend_name]
        return chain if self.fallback else chain[:1]

    def get_backend(self, name: str) -> GrammarBackend:
        """The named backend for this vocabulary, created once (one lock per backend: creating
        xgrammar's, 2.6 s with its import, never holds up a compile on llguidance)."""
        with self._backend_lock:
            lock = self._backend_locks.setdefault(name, threading.Lock())
        with lock:
            if name in self._backend_errors:
                raise self._backend_errors[name]
            be = self._backends.get(name)
            if be is None:
                try:
                    be = self._factories[name](self.vocab)
                except GrammarError as e:
                    self._backend_errors[name] = e
                    raise
                except Exception as e:  # a backend that cannot start is a grammar failure
                    err = GrammarError(f"grammar backend {name} unavailable: {e}")
                    self._backend_errors[name] = err
                    raise err from e
                self._backends[name] = be
            return be

    def compile(self, spec: GrammarSpec | object) -> tuple[CompiledGrammar, str]:
        """(compiled grammar, name of the backend that compiled it); cached by spec.

        Accepts a GrammarSpec or an object with constraint attributes (SamplingParams).
        Raises GrammarError naming each backend's reason when none can compile the spec.
        """
        spec = spec_of(spec)
        if spec is None:
            raise GrammarError("no constraint given: nothing to compile")
        with self._lock:
            pending = self._cache.get(spec)
            owner = pending is None
            if owner:
                pending = self._cache[spec] = _Pending()
            else:
                self.stats["cache_hits"] += 1
        if owner:
            try:
                pending.result = self._compile_uncached(spec)
            except GrammarError as e:
                pending.error = e
            except BaseException as e:  # interrupted: wake waiters, do not cache the crash
                with self._lock:
                    self._cache.pop(spec, None)
                pending.error = GrammarError(f"grammar compilation interrupted: {e!r}")
                pending.done.set()
                raise
            pending.done.set()
        else:
            pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def _compile_uncached(self, spec: GrammarSpec) -> tuple[CompiledGrammar, str]:
        """Compile on the backends in order and keep the most exact result: the first exact
        grammar wins; an approximated one is kept only while no later backend does better
        (ties go to the earlier backend). An invalid spec is refused before any backend and a
        backend's InvalidSpecError ends the search: no weaker backend may serve it."""
        size = len(spec.text.encode("utf-8"))
        if self.max_spec_bytes is not None and size > self.max_spec_bytes:
            with self._lock:
                self.stats["failures"] += 1
                self.stats["over_budget"] += 1
            raise GrammarBudgetError(
                f"{spec.kind} spec is {size} bytes, past the {self.max_spec_bytes}-byte budget: refused without "
                f"compiling; raise grammar_max_spec_bytes (GrammarCompiler max_spec_bytes) to allow it",
                budget="size", option="grammar_max_spec_bytes")
        try:
            if spec.kind == "regex" and regex_is_empty(spec.text):
                raise InvalidSpecError(
                    f"regex {spec.text!r} matches no string: its language is empty (e.g. a class like [^\\s\\S])"
                )
            if spec.kind == "ebnf" and ebnf_is_empty(spec.text):
                raise InvalidSpecError(
                    "ebnf spec admits no output: its root rule derives no finite string (every alternative "
                    "recurses without end, e.g. a ::= \"x\" a)"
                )
            check_spec(spec)
            if spec.kind == "json_schema" and schema_is_empty(schema_of(spec)):
                raise InvalidSpecError(
                    "json_schema spec admits no output: no finite instance exists (a required property or "
                    "item refers back to a schema it is inside, with no way out)"
                )
        except InvalidSpecError:
            with self._lock:
                self.stats["failures"] += 1
                self.stats["invalid_specs"] += 1
            raise
        schema = schema_of(spec)
        # what the backends compile: exact rewrites (lowering.py), formats lowered to exact
        # patterns (formats.py), patterns that take their length bounds (patterns.py) and small
        # objects in any key order (orders.py; larger ones keep the declared order)
        target = spec
        if schema is not None and spec.kind == "json_schema":
            try:
                lowered = any_order(lower_patterns(lower_formats(lower_schema(schema))))
            except InvalidSpecError:
                with self._lock:
                    self.stats["failures"] += 1
                    self.stats["invalid_specs"] += 1
                raise
            if lowered is not schema:
                schema = lowered
                target = GrammarSpec(spec.kind, json.dumps(lowered, ensure_ascii=False))
        errors: list[str] = []
        budget_errors: list[GrammarBudgetError] = []
        best: tuple[CompiledGrammar, str, int] | None = None
        large = self.is_large(spec)
        for i, name in enumerate(self.backend_order(spec.kind)):
            floor = table_approximated(name, schema) if schema is not None else []
            if best is not None and len(floor) >= len(best[0].approximated):
                continue  # its table alone says it cannot beat what we have
            try:
                be = self.get_backend(name)
                with self._lock:
                    self.stats["compiles"] += 1
                compiled = self._limited(be, target, name, large)
                compiled.spec = spec  # the user's spec: validation at finish checks against it
                compiled.approximated = tuple(sorted(set(floor) | set(diagnostics_keywords(compiled.warnings))))
                if compiled.strict and not compiled.narrowed and schema is not None and spec.kind == "json_schema":
                    # xgrammar's own strict mode: what it narrows is read off the schema (llguidance's
                    # rewrite reports what it narrowed itself)
                    compiled.narrowed = tuple(strict_narrowing(schema))
                if spec.narrowed:  # what spec_from_params narrowed itself (the integer digit cap)
                    compiled.narrowed = tuple(sorted({*compiled.narrowed, *spec.narrowed}))
                check_nonempty(compiled, self.vocab.vocab_size, probe=large)
            except InvalidSpecError:
                with self._lock:
                    self.stats["failures"] += 1
                    self.stats["invalid_specs"] += 1
                raise
            except GrammarError as e:
                if isinstance(e, GrammarBudgetError):
                    budget_errors.append(e)
                # most backend errors name their backend already ("invalid regex (xgrammar): ..."):
                # a second "xgrammar: " in front would say it twice
                msg = str(e)
                errors.append(msg if f"({name})" in msg or msg.startswith(f"{name}:") else f"{name}: {msg}")
                continue
            except Exception as e:  # a backend bug must not hide behind another backend silently
                errors.append(f"{name}: unexpected {type(e).__name__}: {e}")
                continue
            if best is None or len(compiled.approximated) < len(best[0].approximated):
                best = (compiled, name, i)
            if compiled.exact:
                break
        if best is not None:
            compiled, name, i = best
            with self._lock:
                self.stats[f"served_{name}"] += 1
                if i > 0:
                    self.stats["fallbacks"] += 1
                if not compiled.exact:
                    self.stats["approximated"] += 1
            return compiled, name
        with self._lock:
            self.stats["failures"] += 1
        if budget_errors:  # a budget stopped it: the error names the budget and its option
            first = budget_errors[0]
            msg = errors[0] if len(errors) == 1 else f"no grammar backend compiled this {spec.kind} spec within its budgets: " + "; ".join(errors)
            raise GrammarBudgetError(msg, budget=first.budget, option=first.option)
        if len(errors) == 1:
            raise GrammarError(errors[0])
        raise GrammarError(f"no grammar backend can compile this {spec.kind} spec: " + "; ".join(errors))

    def is_large(self, spec: GrammarSpec | object) -> bool:
        """Whether spec is past isolate_bytes (and within max_spec_bytes, past which it is refused at
        once): its uninterruptible compiles run in a worker process, and compile_async runs it in the
        pool for large specs."""
        spec = spec_of(spec)
        if spec is None or self.isolate_bytes is None:
            return False
        size = len(spec.text.encode("utf-8"))
        return self.isolate_bytes < size and (self.max_spec_bytes is None or size <= self.max_spec_bytes)

    def _limited(self, be: GrammarBackend, spec: GrammarSpec, name: str = "", large: bool = False) -> CompiledGrammar:
        """be.compile(spec) within compile_timeout (in a daemon thread: a C++ compile cannot be
        cancelled, so one that overruns is left to finish and its result dropped). A large spec
        (is_large) compiles xgrammar in a worker process killed at the deadline (isolated.py);
        outlines refuses it (its compiled index cannot come back from a worker, and in-process it
        grew ~290 MB/s on the issue's 9,000-property schema); llguidance compiles in-process, bounded
        by its own parser limits (lexer fuel, grammar size, items per row)."""
        if large and name == "xgrammar" and be.__class__.__name__ == "XGrammarBackend":
            from deepinfer.grammar.isolated import compile_isolated

            try:
                return compile_isolated(be, self.tokenizer.to_str(), self.vocab.vocab_size, self.vocab.stop_token_ids,
                                        self._strict_json, spec, self.compile_timeout, self.compile_memory)
            except GrammarBudgetError:
                with self._lock:
                    self.stats["timeouts"] += 1
                raise
        if large and name == "outlines":
            raise GrammarError(f"outlines: a spec past isolate_bytes ({self.isolate_bytes}) compiles only in a worker "
                               "process, and outlines-core's index cannot be shipped back from one")
        if self.compile_timeout is None:
            return be.compile(spec)
        box: dict[str, object] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["result"] = be.compile(spec)
            except BaseException as e:  # handed to the waiting caller
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name=f"grammar-compile-{be.name}", daemon=True).start()
        if not done.wait(self.compile_timeout):
            with self._lock:
                self.stats["timeouts"] += 1
            raise GrammarBudgetError(
                f"compiling took longer than {self.compile_timeout:g}s; raise grammar_compile_timeout "
                "(GrammarCompiler compile_timeout) to allow more", budget="time", option="grammar_compile_timeout")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["result"]  # type: ignore[return-value]

    def is_cached(self, spec: GrammarSpec | object) -> bool:
        """Whether compile(spec) would return (or raise) at once: its compilation has finished."""
        spec = spec_of(spec)
        with self._lock:
            pending = self._cache.get(spec)
        return pending is not None and pending.done.is_set()

    def warm_async(self):
        """A Future of creating, in the compile pool, the first backend of every kind's chain, so a
        later constraint does not pay it (xgrammar's: 2.6 s, 5.4 s beside a large compile on the
        2-core host, which kept a `choices` request submitted after issue 51's schema waiting)."""
        names = list(dict.fromkeys(self.backend_order(k)[0] for k in AUTO_ORDER))

        def warm() -> None:
            for n in names:
                try:
                    self.get_backend(n)
                except GrammarError:
                    pass  # cached: the first compile on it reports it

        return self._pool(large=False).submit(warm)

    def _pool(self, large: bool):
        from concurrent.futures import ThreadPoolExecutor

        with self._lock:
            if large:  # never in front of the small ones: a large compile takes seconds to minutes
                if self._large_executor is None:
                    self._large_executor = ThreadPoolExecutor(self._compile_threads,
                                                              thread_name_prefix="grammar-compile-large")
                return self._large_executor
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._compile_threads, thread_name_prefix="grammar-compile")
            return self._executor

    def compile_async(self, spec: GrammarSpec | object):
        """A concurrent.futures.Future of compile(spec), run in this compiler's thread pool, so a
        caller (the engine's step loop) can keep going while distinct specs compile."""
        return self._pool(self.is_large(spec)).submit(self.compile, spec)

    def budget_guard(self):
        """The BudgetGuard (complete_within_budget) for this vocabulary, made once."""
        guard = getattr(self, "_budget_guard", None)
        if guard is None:
            from deepinfer.grammar.budget import BudgetGuard

            guard = self._budget_guard = BudgetGuard(self.vocab.token_bytes, self.vocab.stop_token_ids,
                                                     self.vocab.vocab_size)
        return guard

    def new_matcher(self, spec: GrammarSpec | object):
        """Shortcut: a fresh matcher for spec (compiled through the cache)."""
        return self.compile(spec)[0].new_matcher()
