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

from deepinfer.errors import GrammarError, InvalidSpecError
from deepinfer.grammar.backend import CompiledGrammar, GrammarBackend
from deepinfer.grammar.bitmask import allocate_token_bitmask
from deepinfer.grammar.emptiness import regex_is_empty
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


def check_nonempty(compiled: CompiledGrammar, vocab_size: int) -> None:
    """InvalidSpecError when the grammar allows nothing at all from its start (e.g. the regex
    `[^\\s\\S]`): a spec with an empty language is invalid whichever backend compiled it."""
    m = compiled.new_matcher()
    if m.can_terminate():
        return
    mask = allocate_token_bitmask(1, vocab_size)
    m.fill_bitmask(mask, 0)
    if not bool(mask.any()):
        raise InvalidSpecError(
            f"{compiled.spec.kind} spec admits no output: no token can start it (its language is empty)"
        )


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
    unable to compile it (the next one is tried), so a pathological schema becomes a GrammarError,
    not a stall. Its compilation cannot be interrupted: it finishes in a daemon thread and is
    dropped. compile_async runs compile in a pool of compile_threads threads.
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
    ):
        self._factories = _default_factories(strict_json)
        if compile_timeout is not None and not compile_timeout > 0:
            raise GrammarError(f"compile_timeout must be > 0 seconds or None, got {compile_timeout!r}")
        self.compile_timeout = compile_timeout
        self._compile_threads = compile_threads
        self._executor = None  # made on the first compile_async
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
        """The named backend for this vocabulary, created once."""
        with self._backend_lock:
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
        try:
            if spec.kind == "regex" and regex_is_empty(spec.text):
                raise InvalidSpecError(
                    f"regex {spec.text!r} matches no string: its language is empty (e.g. a class like [^\\s\\S])"
                )
            check_spec(spec)
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
        best: tuple[CompiledGrammar, str, int] | None = None
        for i, name in enumerate(self.backend_order(spec.kind)):
            floor = table_approximated(name, schema) if schema is not None else []
            if best is not None and len(floor) >= len(best[0].approximated):
                continue  # its table alone says it cannot beat what we have
            try:
                be = self.get_backend(name)
                with self._lock:
                    self.stats["compiles"] += 1
                compiled = self._limited(be, target)
                compiled.spec = spec  # the user's spec: validation at finish checks against it
                compiled.approximated = tuple(sorted(set(floor) | set(diagnostics_keywords(compiled.warnings))))
                if compiled.strict and not compiled.narrowed and schema is not None and spec.kind == "json_schema":
                    # xgrammar's own strict mode: what it narrows is read off the schema (llguidance's
                    # rewrite reports what it narrowed itself)
                    compiled.narrowed = tuple(strict_narrowing(schema))
                check_nonempty(compiled, self.vocab.vocab_size)
            except InvalidSpecError:
                with self._lock:
                    self.stats["failures"] += 1
                    self.stats["invalid_specs"] += 1
                raise
            except GrammarError as e:
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
        if len(errors) == 1:
            raise GrammarError(errors[0])
        raise GrammarError(f"no grammar backend can compile this {spec.kind} spec: " + "; ".join(errors))

    def _limited(self, be: GrammarBackend, spec: GrammarSpec) -> CompiledGrammar:
        """be.compile(spec) within compile_timeout (in a daemon thread: a C++ compile cannot be
        cancelled, so one that overruns is left to finish and its result dropped)."""
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
            raise GrammarError(f"compiling took longer than {self.compile_timeout:g}s (limit compile_timeout)")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["result"]  # type: ignore[return-value]

    def is_cached(self, spec: GrammarSpec | object) -> bool:
        """Whether compile(spec) would return (or raise) at once: its compilation has finished."""
        spec = spec_of(spec)
        with self._lock:
            pending = self._cache.get(spec)
        return pending is not None and pending.done.is_set()

    def compile_async(self, spec: GrammarSpec | object):
        """A concurrent.futures.Future of compile(spec), run in this compiler's thread pool, so a
        caller (the engine's step loop) can keep going while distinct specs compile."""
        with self._lock:
            if self._executor is None:
                from concurrent.futures import ThreadPoolExecutor

                self._executor = ThreadPoolExecutor(self._compile_threads, thread_name_prefix="grammar-compile")
        return self._executor.submit(self.compile, spec)

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
