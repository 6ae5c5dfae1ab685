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
    #: valid instances rejected, by cause: "strict" (undeclared keys or extra tuple items that a
    #: strict grammar refuses by design), "order" (accepted once its keys follow the schema's
    #: declared order: every backend generates in that order), "other"
    rejected_by: Counter = field(default_factory=Counter)
    #: the same fills on a second matcher of the same grammar over the same instance (CPU time):
    #: the grammar's lazily built caches are warm, as for every request of a schema after its first
    mask_warm_cpu_times: list[float] = field(default_factory=list)
    accept_cpu_times: list[float] = field(default_factory=list)  # accept_token per token (CPU time)
    narrowed: int = 0  # schemas whose grammar is strict-mode narrowed

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
            f"(rejected: strict {self.rejected_by['strict']}, order {self.rejected_by['order']}, "
            f"other {self.rejected_by['other']})  "
            f"approximated {self.approximated}  narrowed {self.narrowed}  exact leaks {self.exact_leaks}  "
            f"invalid specs {self.invalid_specs}  "
            f"compile {self.compile_seconds:6.1f}s p50 {_pct(self.compile_times, 50) * 1e3:.1f}ms "
            f"p99 {_pct(self.compile_times, 99) * 1e3:.1f}ms  mask/token wall p50 {_pct(self.mask_times, 50) * 1e6:.0f}us "
            f"p99 {_pct(self.mask_times, 99) * 1e6:.0f}us cpu p50 {_pct(self.mask_cpu_times, 50) * 1e6:.0f}us "
            f"p99 {_pct(self.mask_cpu_times, 99) * 1e6:.0f}us (warm cpu p50 {_pct(self.mask_warm_cpu_times, 50) * 1e6:.0f}us "
            f"p99 {_pct(self.mask_warm_cpu_times, 99) * 1e6:.0f}us; accept cpu p99 "
            f"{_pct(self.accept_cpu_times, 99) * 1e6:.0f}us)  served {dict(self.served_by)}"
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
                  "compile_seconds", "approximated", "exact_leaks", "invalid_specs", "narrowed"):
            setattr(tot, f, getattr(tot, f) + getattr(p, f))
        tot.served_by.update(p.served_by)
        tot.rejected_by.update(p.rejected_by)
        tot.compile_times += p.compile_times
        tot.mask_times += p.mask_times
        tot.mask_cpu_times += p.mask_cpu_times
        tot.mask_warm_cpu_times += p.mask_warm_cpu_times
        tot.accept_cpu_times += p.accept_cpu_times
    return tot


def load_bench_file(path: str | Path) -> list[dict[str, Any]]:
    """The records of one JSONSchemaBench .jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def text_accepted(compiled: CompiledGrammar, token_ids: Iterable[int], mask=None,
                  mask_times: list[float] | None = None, mask_cpu_times: list[float] | None = None,
                  accept_cpu_times: list[float] | None = None) -> bool:
    """Whether a fresh matcher accepts every token and can terminate afterwards. With a bitmask
    row (mask, [1, words]) each step's fill_bitmask is timed into mask_times (wall, when given) and
    mask_cpu_times (this thread's CPU time), and accept_token into accept_cpu_times."""
    m = compiled.new_matcher()
    for t in token_ids:
        if mask is not None:
            c0, t0 = time.thread_time(), time.perf_counter()
            m.fill_bitmask(mask, 0)
            if mask_times is not None:
                mask_times.append(time.perf_counter() - t0)
            if mask_cpu_times is not None:
                mask_cpu_times.append(time.thread_time() - c0)
        c0 = time.thread_time()
        ok = m.accept_token(t)
        if mask is not None and accept_cpu_times is not None:
            accept_cpu_times.append(time.thread_time() - c0)
        if not ok:
            return False
    return m.can_terminate()


def _local_ref(root: Any, ref: str) -> Any:
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def declared_order(value: Any, schema: Any, root: Any = None, depth: int = 0) -> tuple[Any, bool]:
    """(value with every object's keys in its schema's declared order, whether some object holds a
    key its schema does not declare or some tuple an item past its prefix), following
    properties, items/prefixItems, local $refs and the first anyOf/oneOf/allOf branch that
    declares the object's keys."""
    root = schema if root is None else root
    if depth > 64 or not isinstance(schema, dict):
        return value, False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = _local_ref(root, ref)
        if isinstance(target, dict):
            return declared_order(value, target, root, depth + 1)
    if isinstance(value, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else None
        if props is None:
            for k in ("allOf", "anyOf", "oneOf"):
                for b in schema.get(k) or []:
                    if isinstance(b, dict) and isinstance(b.get("properties"), dict) and set(value) <= set(b["properties"]):
                        return declared_order(value, b, root, depth + 1)
            if schema.get("type") != "object" and "additionalProperties" not in schema:
                return value, False
            props = {}  # an object schema declaring no properties
        pats = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
        extra_schema = schema.get("additionalProperties")
        extra = "additionalProperties" not in schema and any(k not in props and not pats for k in value)
        out = {}
        for k in [k for k in props if k in value] + [k for k in value if k not in props]:
            sub = props.get(k, extra_schema if isinstance(extra_schema, dict) else {})
            out[k], e = declared_order(value[k], sub, root, depth + 1)
            extra |= e
        return out, extra
    if isinstance(value, list):
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        items = schema.get("items")
        if isinstance(items, list):
            prefix, items = items, schema.get("additionalItems")
        extra = len(value) > len(prefix) and bool(prefix) and items is None and "additionalItems" not in schema
        out_l = []
        for i, v in enumerate(value):
            sub = prefix[i] if i < len(prefix) else (items if isinstance(items, dict) else {})
            v2, e = declared_order(v, sub, root, depth + 1)
            out_l.append(v2)
            extra |= e
        return out_l, extra
    return value, False


def rejection_cause(compiler: GrammarCompiler, compiled: CompiledGrammar, schema: Any, value: Any) -> str:
    """Why a valid instance was rejected: "order" when its declared-order spelling is accepted,
    "strict" when a strict grammar meets a key (or tuple item) the schema does not declare,
    otherwise "other"."""
    reordered, extra = declared_order(value, schema)
    if json.dumps(reordered) != json.dumps(value):
        ids = compiler.tokenizer.encode(json.dumps(reordered), add_special_tokens=False).ids
        if text_accepted(compiled, ids):
            return "order"
    if extra and compiled.narrowed:
        return "strict"
    return "other"


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
        cov.narrowed += bool(compiled.narrowed)
        for i, test in enumerate(rec.get("tests", [])):
            ids = compiler.tokenizer.encode(json.dumps(test["data"]), add_special_tokens=False).ids
            timed = mask is not None and i == 0  # one instance per schema is enough for the percentiles
            ok = text_accepted(compiled, ids, mask if timed else None, cov.mask_times, cov.mask_cpu_times,
                               cov.accept_cpu_times)
            if timed:  # again on a second matcher: the grammar's lazy caches are now warm
                text_accepted(compiled, ids, mask, None, cov.mask_warm_cpu_times)
            if test["valid"]:
                cov.valid_total += 1
                cov.valid_accepted += ok
                if not ok:
                    cov.rejected_by[rejection_cause(compiler, compiled, rec["schema"], test["data"])] += 1
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
