"""JSONSchemaBench coverage: declared coverage, valid acceptance, invalid rejection per file.

The fast test measures a seeded sample of each file; the full run is marked slow. Floors sit a
little below the measured figures (see benchmarks/grammar_coverage.py for the full numbers).
"""

from __future__ import annotations

import pathlib

import pytest

from deepinfer.grammar.coverage import BENCH_FILES, measure_file, text_accepted

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "jsonschemabench"

pytestmark = pytest.mark.skipif(
    not BENCH_DIR.exists(), reason=f"JSONSchemaBench data not found at ../shared/jsonschemabench ({BENCH_DIR})"
)

# file -> (declared coverage, valid acceptance, invalid rejection) floors
SAMPLE_FLOORS = {
    "Glaiveai2K.jsonl": (0.95, 0.85, 0.85),
    "Github_easy.jsonl": (0.90, 0.80, 0.90),
    "Handwritten.jsonl": (0.80, 0.50, 0.30),
}
FULL_FLOORS = {
    "Glaiveai2K.jsonl": (0.98, 0.92, 0.93),
    "Github_easy.jsonl": (0.97, 0.88, 0.96),
    "Handwritten.jsonl": (0.88, 0.60, 0.45),
}


def _check(cov, floors):
    declared, valid, invalid = floors
    assert cov.schemas > 0 and cov.valid_total > 0
    assert cov.declared_coverage >= declared, cov.row()
    assert cov.valid_acceptance >= valid, cov.row()
    if cov.invalid_total:
        assert cov.invalid_rejection >= invalid, cov.row()


@pytest.mark.parametrize("name", BENCH_FILES)
def test_sampled_coverage(compiler, name):
    path = BENCH_DIR / name
    if not path.exists():
        pytest.skip(f"{name} missing from {BENCH_DIR}")
    cov = measure_file(compiler, path, limit=25, seed=0)
    print(cov.row())
    _check(cov, SAMPLE_FLOORS[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", BENCH_FILES)
def test_full_coverage(compiler, name):
    path = BENCH_DIR / name
    if not path.exists():
        pytest.skip(f"{name} missing from {BENCH_DIR}")
    cov = measure_file(compiler, path)
    print(cov.row())
    _check(cov, FULL_FLOORS[name])


def test_acceptance_measure_discriminates(compiler):
    """The measure itself: a valid text is accepted, a truncated or wrong one is not."""
    from deepinfer.grammar import spec_from_params

    compiled, _ = compiler.compile(spec_from_params(json_schema={"type": "array", "items": {"type": "integer"}}))
    enc = lambda s: compiler.tokenizer.encode(s, add_special_tokens=False).ids  # noqa: E731
    assert text_accepted(compiled, enc("[1, 2, 3]"))
    assert not text_accepted(compiled, enc("[1, 2"))  # every token fine, but cannot terminate
    assert not text_accepted(compiled, enc('[1, "2"]'))


def test_rejections_are_classified_by_cause(smol):
    from deepinfer.grammar import GrammarCompiler
    from deepinfer.grammar.coverage import declared_order, measure_records

    tok, stops = smol
    # four properties: more than orders.py spells out in every order, so the declared order holds
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                               "c": {"type": "null"}, "d": {"type": "null"}}}
    assert declared_order({"b": "x", "a": 1}, schema) == ({"a": 1, "b": "x"}, False)
    assert declared_order({"a": 1, "z": 2}, schema)[1] is True
    recs = [{"schema": schema, "tests": [
        {"data": {"a": 1, "b": "x"}, "valid": True},
        {"data": {"b": "x", "a": 1}, "valid": True},   # property order
        {"data": {"a": 1, "z": 2}, "valid": True},     # an undeclared key: strict mode refuses it
        {"data": {"a": "no"}, "valid": False},
    ]}]
    strict = measure_records(GrammarCompiler(tok, tok.get_vocab_size(), stops, fallback=False), recs)
    assert strict.valid_accepted == 1 and strict.narrowed == 1
    assert strict.rejected_by == {"order": 1, "strict": 1}
    lenient = measure_records(GrammarCompiler(tok, tok.get_vocab_size(), stops, fallback=False, strict_json=False), recs)
    assert lenient.valid_accepted == 2 and lenient.narrowed == 0 and lenient.rejected_by == {"order": 1}
    assert strict.invalid_rejected == lenient.invalid_rejected == 1
