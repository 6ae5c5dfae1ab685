"""Measure how much of JSONSchemaBench the grammar layer covers.

Per file: declared coverage (share of schemas that compile), valid-instance acceptance (share
of the valid test instances whose json.dumps text the compiled grammar accepts: every token
accepted and the matcher can terminate afterwards) and invalid-instance rejection (the share of
invalid instances it does not accept), how many grammars are approximated, and "exact leaks":
invalid instances accepted by a grammar reported exact (each would be an output reported valid
that fails validation). Instances are tokenised with the compiler's tokenizer, so
the measure covers tokenisation effects too.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from deepinfer.errors import GrammarError, InvalidSpecError
from deepinfer.grammar.backend import CompiledGrammar
from deepinfer.grammar.bitmask import allocate_token_bitmask
from deepinfer.grammar.compiler import GrammarCompiler
from deepinfer.grammar.spec import GrammarSpec, spec_from_params

BENCH_FILES = ("Glaiveai2K.jsonl", "Github_easy.jsonl", "Handwritten.jsonl")


@dataclass
class FileCoverage:
    """Coverage figures for one JSONSchemaBench file (or a sample of it)."""

    name: str
    schemas: int = 0
    compiled: int = 0
    valid_total: int = 0
    valid_accepted: int = 0
    invalid_total: int = 0
    invalid_rejected: int = 0
    compile_seconds: float = 0.0
    served_by: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    #: schemas whose grammar is approximated, and invalid instances an *exact* grammar accepted
    #: (each one would be an output reported valid that fails validation: must stay 0)
    approximated: int = 0
    exact_leaks: int = 0
    invalid_specs: int = 0
    compile_times: list[float] = field(default_factory=list)
    mask_times: list[float] = field(default_factory=list)  # seconds per fill_bitmask (wall), sampled
    #: the same fills in this thread's CPU time: on a shared machine the wall p99 is mostly other
    #: processes preempting us (load 7 on 2 cores moved it 200 -> 700 us), the CPU time is our cost
    mask_cpu_times: list[float] = field(default_factory=list)

    @property
    def declared_coverage(self) -> float:
        return self.compiled / self.schemas if self.schemas else 0.0

    @property
    def valid_acceptance(self) -> float:
        return self.valid_accepted / self.valid_total if self.valid_total else 0.0

    @property
    def invalid_rejection(self) -> float:
        return self.invalid_rejected / self.invalid_total if self.invalid_total else 0.0

    def row(self) -> str:
        return (
            f"{self.name:<20} schemas {self.schemas:4d}  declared {self.declared_coverage:6.1%}  "
            f"valid accepted {self.valid_accepted:4d}/{self.valid_total:<4d} {self.valid_acceptance:6.1%}  "
            f"invalid rejected {self.invalid_rejected:4d}/{self.invalid_total:<4d} {self.invalid_rejection:6.1%}  "
            f"approximated {self.approximated}  exact leaks {self.exact_leaks}  invalid specs {self.invalid_specs}  "
            f"compile {self.compile_seconds:6.1f}s p50 {_pct(self.compile_times, 50) * 1e3:.1f}ms "
            f"p99 {_pct(self.compile_times, 99) * 1e3:.1f}ms  mask/token wall p50 {_pct(self.mask_times, 50) * 1e6:.0f}us "
            f"p99 {_pct(self.mask_times, 99) * 1e6:.0f}us cpu p50 {_pct(self.mask_cpu_times, 50) * 1e6:.0f}us "
            f"p99 {_pct(self.mask_cpu_times, 99) * 1e6:.0f}us  served {dict(self.served_by)}"
        )


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q / 100 * (len(ys) - 1))))]


def merge(name: str, parts: list["FileCoverage"]) -> "FileCoverage":
    """The figures of several files together."""
    tot = FileCoverage(name)
    for p in parts:
        for f in ("schemas", "compiled", "valid_total", "valid_accepted", "invalid_total", "invalid_rejected",
                  "compile_seconds", "approximated", "exact_leaks", "invalid_specs"):
            setattr(tot, f, getattr(tot, f) + getattr(p, f))
        tot.served_by.update(p.served_by)
        tot.compile_times += p.compile_times
        tot.mask_times += p.mask_times
        tot.mask_cpu_times += p.mask_cpu_times
    return tot


def load_bench_file(path: str | Path) -> list[dict[str, Any]]:
    """The records of one JSONSchemaBench .jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def text_accepted(compiled: CompiledGrammar, token_ids: Iterable[int], mask=None,
                  mask_times: list[float] | None = None, mask_cpu_times: list[float] | None = None) -> bool:
    """Whether a fresh matcher accepts every token and can terminate afterwards. With a bitmask
    row (mask, [1, words]) each step's fill_bitmask is timed into mask_times (wall) and
    mask_cpu_times (this thread's CPU time)."""
    m = compiled.new_matcher()
    for t in token_ids:
        if mask is not None:
            c0, t0 = time.thread_time(), time.perf_counter()
            m.fill_bitmask(mask, 0)
            mask_times.append(time.perf_counter() - t0)
            if mask_cpu_times is not None:
                mask_cpu_times.append(time.thread_time() - c0)
        if not m.accept_token(t):
            return False
    return m.can_terminate()


def schema_spec(schema: Any) -> GrammarSpec:
    """The spec of a bench schema (GrammarError if it is not a usable schema at all)."""
    return spec_from_params(json_schema=schema)


def measure_records(
    compiler: GrammarCompiler, records: list[dict[str, Any]], name: str = "records", time_masks: bool = False
) -> FileCoverage:
    """Coverage of a list of bench records with one compiler."""
    cov = FileCoverage(name)
    mask = allocate_token_bitmask(1, compiler.vocab_size) if time_masks else None
    for rec in records:
        cov.schemas += 1
        t0 = time.perf_counter()
        try:
            compiled, served = compiler.compile(schema_spec(rec["schema"]))
        except GrammarError as e:
            cov.invalid_specs += isinstance(e, InvalidSpecError)
            cov.failures.append(f"{rec.get('id', cov.schemas)}: {str(e)[:160]}")
            continue
        finally:
            cov.compile_seconds += time.perf_counter() - t0
            cov.compile_times.append(time.perf_counter() - t0)
        cov.compiled += 1
        cov.served_by[served] += 1
        cov.approximated += not compiled.exact
        for i, test in enumerate(rec.get("tests", [])):
            ids = compiler.tokenizer.encode(json.dumps(test["data"]), add_special_tokens=False).ids
            timed = mask is not None and i == 0  # one instance per schema is enough for the percentiles
            ok = text_accepted(compiled, ids, mask if timed else None, cov.mask_times, cov.mask_cpu_times)
            if test["valid"]:
                cov.valid_total += 1
                cov.valid_accepted += ok
            else:
                cov.invalid_total += 1
                cov.invalid_rejected += not ok
                cov.exact_leaks += ok and compiled.exact
    return cov


def measure_file(
    compiler: GrammarCompiler, path: str | Path, limit: int | None = None, seed: int = 0, time_masks: bool = False
) -> FileCoverage:
    """Coverage of one bench file; with limit, of a seeded random sample of `limit` schemas."""
    records = load_bench_file(path)
    if limit is not None and limit < len(records):
        records = random.Random(seed).sample(records, limit)
    return measure_records(compiler, records, Path(path).name, time_masks)


def measure_bench(
    compiler: GrammarCompiler, bench_dir: str | Path, limit: int | None = None, seed: int = 0,
    time_masks: bool = False,
) -> list[FileCoverage]:
    """Coverage of every bench file present in bench_dir."""
    bench_dir = Path(bench_dir)
    return [measure_file(compiler, bench_dir / f, limit, seed, time_masks)
            for f in BENCH_FILES if (bench_dir / f).exists()]
