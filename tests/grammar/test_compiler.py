"""GrammarCompiler: caching, thread safety, fallback between backends, typed failures."""

from __future__ import annotations

import json
import threading

import pytest
import xgrammar as xgr

from deepinfer.errors import GrammarError
from deepinfer.grammar import GrammarBackend, GrammarCompiler, spec_from_params
from deepinfer.grammar.vocab import TokenizerVocab

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name"]}


def test_batch_of_one_schema_compiles_once(smol):
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops)
    served = {c.compile(spec_from_params(json_schema=dict(SCHEMA)))[1] for _ in range(10_000)}
    assert served == {"llguidance"}  # the default chain's first backend for schemas, exact here
    assert c.stats["compiles"] == 1 and c.stats["cache_hits"] == 9_999
    # an equal schema given as a JSON string is the same cache entry
    c.compile(spec_from_params(json_schema=json.dumps(SCHEMA)))
    assert c.stats["compiles"] == 1
    c.compile(spec_from_params(regex="x+"))
    assert c.stats["compiles"] == 2


def test_concurrent_compiles_of_one_spec_compile_once(smol):
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops)
    results, errors = [], []
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            barrier.wait()
            spec = spec_from_params(json_schema=SCHEMA) if i % 2 else spec_from_params(regex=r"[a-c]{1,4}")
            results.append(c.compile(spec))
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert c.stats["compiles"] == 2 and c.stats["cache_hits"] == 6
    assert len({id(r[0]) for r in results}) == 2  # every thread got one of the two shared grammars


def test_fallback_from_an_injected_failing_backend(smol):
    """With a failing backend first, the next one serves and stats say so; without fallback the
    failing backend's error is raised."""
    tok, stops = smol

    class Broken(GrammarBackend):
        name = "broken"

        def compile(self, spec):
            raise GrammarError("broken backend: refuses everything")

    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="broken", backends={"broken": lambda v: Broken()})
    compiled, served = c.compile(spec_from_params(regex=r"[0-9]{2}"))
    assert served == "xgrammar"
    assert c.stats["fallbacks"] == 1 and c.stats["served_xgrammar"] == 1
    m = compiled.new_matcher()
    for t in tok.encode("42", add_special_tokens=False).ids:
        assert m.accept_token(t)
    assert m.can_terminate()

    strict = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="broken", fallback=False,
                             backends={"broken": lambda v: Broken()})
    with pytest.raises(GrammarError, match="refuses everything"):
        strict.compile(spec_from_params(regex=r"[0-9]{2}"))


def test_regex_xgrammar_rejects_falls_back(smol):
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops)
    pattern = r"\p{Greek}{2}"  # a Unicode class: Rust regex (outlines) has it, xgrammar does not
    compiled, served = c.compile(spec_from_params(regex=pattern))
    assert served == "llguidance" and c.stats["fallbacks"] == 1  # next in BACKEND_NAMES order
    m = compiled.new_matcher()
    for t in tok.encode("αβ", add_special_tokens=False).ids:
        assert m.accept_token(t)
    assert m.can_terminate()


def test_none_can_compile_names_every_backend(compiler):
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec_from_params(regex="(unclosed"))
    msg = str(e.value)
    assert "xgrammar" in msg and "outlines" in msg and "invalid regex" in msg
    assert compiler.stats["failures"] >= 1


def test_ebnf_falls_back_from_outlines_to_xgrammar(smol):
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="outlines-core")
    _, served = c.compile(spec_from_params(grammar='root ::= "a" | "b"'))
    assert served == "xgrammar"


def test_bad_constructor_arguments(smol):
    tok, stops = smol
    with pytest.raises(GrammarError, match="unknown grammar backend"):
        GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="nope")
    with pytest.raises(GrammarError, match="smaller than the tokenizer"):
        GrammarCompiler(tok, 100, stops)
    with pytest.raises(GrammarError, match="stop_token_ids"):
        GrammarCompiler(tok, tok.get_vocab_size(), [10**7])
    with pytest.raises(GrammarError, match="tokenizers.Tokenizer"):
        GrammarCompiler("not a tokenizer", 10, [])
    with pytest.raises(GrammarError, match="nothing to compile"):
        GrammarCompiler(tok, tok.get_vocab_size(), stops).compile(None)


@pytest.mark.parametrize("which", ["smol_tok", "deepseek_tok"])
def test_token_bytes_agree_with_xgrammar(request, which):
    """Our byte decoding of the vocabulary equals xgrammar's own for both tokenizers."""
    tok = request.getfixturevalue(which)
    v = TokenizerVocab.from_tokenizer(tok, tok.get_vocab_size() + 3, [])
    info = xgr.TokenizerInfo(v.encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=v.vocab_size)
    decoded = info.decoded_vocab
    mismatches = [i for i, b in enumerate(v.token_bytes) if b is not None and decoded[i] != b]
    assert not mismatches[:5]
    assert v.token_bytes[-1] is None  # padding ids are not tokens


def test_129k_vocab_compiles_and_walks(deepseek_tok):
    tok = deepseek_tok
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    assert eos is not None
    c = GrammarCompiler(tok, tok.get_vocab_size() + 64, [eos])
    compiled, _ = c.compile(spec_from_params(regex=r"(red|green|blue)-[0-9]{2}"))
    m = compiled.new_matcher()
    for t in tok.encode("green-42", add_special_tokens=False).ids:
        assert m.accept_token(t)
    assert m.can_terminate() and m.accept_token(eos) and m.is_terminated()
    m2 = compiled.new_matcher()
    assert not m2.accept_token(tok.encode("purple", add_special_tokens=False).ids[0])


def test_compile_timeout_turns_a_stall_into_an_error_or_a_fallback(smol):
    import time

    tok, stops = smol

    class Slow(GrammarBackend):
        name = "slow"

        def compile(self, spec):
            time.sleep(3)
            raise AssertionError("never reached in time")

    alone = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="slow", fallback=False,
                            backends={"slow": lambda v: Slow()}, compile_timeout=0.3)
    t0 = time.perf_counter()
    with pytest.raises(GrammarError, match="longer than 0.3s"):
        alone.compile(spec_from_params(regex="[0-9]+"))
    assert time.perf_counter() - t0 < 2 and alone.stats["timeouts"] == 1
    chained = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="slow", backends={"slow": lambda v: Slow()},
                              compile_timeout=0.3)
    _, served = chained.compile(spec_from_params(regex="[0-9]+"))
    assert served == "xgrammar"
    with pytest.raises(GrammarError, match="compile_timeout"):
        GrammarCompiler(tok, tok.get_vocab_size(), stops, compile_timeout=0)


def test_compile_async_compiles_distinct_specs_while_the_caller_works(smol):
    """50 distinct schemas compile in the pool while the calling thread keeps filling masks."""
    from deepinfer.grammar import allocate_token_bitmask

    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops)
    m = c.new_matcher(spec_from_params(regex="[a-z]+"))
    mask = allocate_token_bitmask(1, c.vocab_size)
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer", "maximum": i + 1}},
                "required": [f"k{i}"]} for i in range(50)]
    futures = [c.compile_async(spec_from_params(json_schema=s)) for s in schemas]
    steps = 0
    while not all(f.done() for f in futures):
        m.fill_bitmask(mask, 0)  # the "decode loop" is never blocked by the compiles
        steps += 1
    assert steps > 1
    served = [f.result()[1] for f in futures]
    # schemas on llguidance (exact: nothing else is tried), the regex above on xgrammar
    assert served == ["llguidance"] * 50 and c.stats["compiles"] == 51
    assert c.stats["served_xgrammar"] == 1


def test_a_schema_in_another_keyword_order_compiles_once(smol):
    """The cache keys on the schema's canonical form: keywords in any order, any whitespace, one
    compile; another property order is another grammar (properties are generated in declared order)."""
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops)
    a = {"type": "object", "required": ["name"],
         "properties": {"name": {"type": "string", "maxLength": 8}, "tags": {"type": "array", "items": {"type": "integer"}}}}
    b = {"properties": {"name": {"maxLength": 8, "type": "string"}, "tags": {"items": {"type": "integer"}, "type": "array"}},
         "required": ["name"], "type": "object"}
    first, _ = c.compile(spec_from_params(json_schema=a))
    assert c.compile(spec_from_params(json_schema=b))[0] is first
    assert c.compile(spec_from_params(json_schema=json.dumps(b, indent=4)))[0] is first
    assert c.stats["compiles"] == 1 and c.stats["cache_hits"] == 2
    swapped = {**a, "properties": {"tags": a["properties"]["tags"], "name": a["properties"]["name"]}}
    other, _ = c.compile(spec_from_params(json_schema=swapped))
    assert other is not first and c.stats["compiles"] == 2
    # each grammar generates its own declared order
    for compiled, text in ((first, '{"name": "x", "tags": [1]}'), (other, '{"tags": [1], "name": "x"}')):
        m = compiled.new_matcher()
        assert all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False).ids) and m.can_terminate()


def _counting(factories: dict, calls: list):
    """Factories that record which backends compile (wrapping the real ones)."""
    from deepinfer.grammar.compiler import _default_factories

    real = _default_factories(True)

    def wrap(name):
        def make(vocab):
            be = real[name](vocab)
            inner = be.compile

            def compile(spec):
                calls.append(name)
                return inner(spec)

            be.compile = compile
            return be
        return make

    return {n: wrap(n) for n in real} | factories


def test_default_chain_serves_schemas_from_llguidance_and_tries_nothing_else(smol):
    """An exact llguidance grammar is the first mask: xgrammar's full compile never starts."""
    tok, stops = smol
    calls: list[str] = []
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backends=_counting({}, calls))
    assert c.backend_order("json_schema") == ["llguidance", "xgrammar", "outlines"]
    assert c.backend_order("regex") == ["xgrammar", "llguidance", "outlines"]
    compiled, served = c.compile(spec_from_params(json_schema=SCHEMA))
    assert served == "llguidance" and compiled.exact and calls == ["llguidance"]
    assert compiled.narrowed == ("additionalProperties (strict)",)  # strict mode, as xgrammar's
    m = compiled.new_matcher()
    ids = tok.encode('{"name": "x", "other": 1}', add_special_tokens=False).ids
    assert not all(m.accept_token(t) for t in ids)  # the undeclared key is refused
    _, served = c.compile(spec_from_params(regex="[0-9]{3}"))
    assert served == "xgrammar" and calls == ["llguidance", "xgrammar"]
    # an explicit backend goes first, the others follow in the kind's order
    x = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="outlines")
    assert x.backend_order("json_schema") == ["outlines", "llguidance", "xgrammar"]
    assert GrammarCompiler(tok, tok.get_vocab_size(), stops, fallback=False).backend_order("json_schema") == ["llguidance"]


def test_an_approximate_llguidance_grammar_never_replaces_an_exact_xgrammar_one(smol):
    """llguidance first, but where it only approximates (here: a warning we cannot read as exact)
    and xgrammar is exact, xgrammar serves; where llguidance refuses, xgrammar serves as before."""
    from deepinfer.grammar.llguidance_backend import LLGuidanceBackend

    tok, stops = smol

    class Warns(LLGuidanceBackend):
        def compile(self, spec):
            out = super().compile(spec)
            out.warnings = [*out.warnings, "something was approximated"]
            return out

    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backends={"llguidance": lambda v: Warns(v)})
    compiled, served = c.compile(spec_from_params(json_schema=SCHEMA))
    assert served == "xgrammar" and compiled.exact and c.stats["fallbacks"] == 1
    # a real case: llguidance compiles this oneOf, but its table does not list oneOf as exact, and
    # xgrammar's grammar is exact: xgrammar serves
    calls: list[str] = []
    e = GrammarCompiler(tok, tok.get_vocab_size(), stops, backends=_counting({}, calls))
    compiled, served = e.compile(spec_from_params(json_schema={"oneOf": [{"type": "integer"}, {"type": "string"}]}))
    assert served == "xgrammar" and compiled.exact and calls == ["llguidance", "xgrammar"]
    # uniqueItems: llguidance refuses it, xgrammar approximates it (and says so): xgrammar serves
    d = GrammarCompiler(tok, tok.get_vocab_size(), stops)
    compiled, served = d.compile(spec_from_params(json_schema={"type": "array", "items": {"type": "integer"},
                                                               "uniqueItems": True}))
    assert served == "xgrammar" and compiled.approximated == ("uniqueItems",)
