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


# ---- MaskBench: the whole public benchmark, one schema at a time, its own columns ------------------

#: MaskBench's schema statuses (maskbench/scripts/maskbench_results.py), plus ours for specs we refuse
#: as invalid: a schema is "passing" when it compiles, every valid instance is accepted and every
#: invalid one rejected
STATUSES = ("passing", "compile_error", "timeout", "validation_error", "invalidation_error")


def bench_subset(name: str) -> str:
    """The MaskBench subset of a record id / file name: "Github_easy---o1.json" -> "Github_easy",
    "BFCL_java_3.json" -> "BFCL", "JME_7.json" -> "JME"."""
    stem = Path(name).name
    if "---" in stem:
        return stem.split("---", 1)[0]
    stem = stem[:-5] if stem.endswith(".json") else stem
    return stem.split("_", 1)[0] if "_" in stem else stem


def load_bench_dir(bench_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of a bench directory, each with "id" and "subset": JSONSchemaBench .jsonl files
    (one record a line; the subset is the file's name) or MaskBench's data/ layout (one record a
    .json file; the subset from its name, see bench_subset)."""
    bench_dir = Path(bench_dir)
    out: list[dict[str, Any]] = []
    for p in sorted(bench_dir.glob("*.jsonl")):
        for i, rec in enumerate(load_bench_file(p)):
            rec.setdefault("id", f"{p.stem}/{i}")
            rec["subset"] = p.stem
            out.append(rec)
    for p in sorted(bench_dir.glob("*.json")):
        with open(p, encoding="utf-8") as f:
            rec = json.load(f)
        rec["id"], rec["subset"] = p.name, bench_subset(p.name)
        out.append(rec)
    return out


def measure_schema(compiler: GrammarCompiler, rec: dict[str, Any], ensure_ascii: bool = False) -> dict[str, Any]:
    """One bench record measured as MaskBench does, as a JSON-able row: status (STATUSES), the
    serving backend and its exactness, instance counts, the invalid instances an exact grammar
    accepted (`exact_leaks`: test indexes), TTFM (compile + first mask of a fresh matcher, cold:
    nothing of this schema cached) and TBM (fill_bitmask + accept_token per token, wall and this
    thread's CPU time, in us). Instances are written as MaskBench writes them (json.dumps,
    ensure_ascii=False) and tokenised with the compiler's tokenizer; an instance counts as accepted
    when every token is accepted and the matcher can then end (MaskBench does not ask the end: a
    proper prefix of a valid document, e.g. 12 for minimum 100, counts as accepted there)."""
    row: dict[str, Any] = {"id": rec.get("id"), "subset": rec.get("subset"), "status": "compile_error",
                           "backend": None, "exact": False, "approximated": [], "narrowed": [],
                           "invalid_spec": False, "error": None, "valid_total": 0, "valid_accepted": 0,
                           "invalid_total": 0, "invalid_rejected": 0, "exact_leaks": [], "rejected_valid": [],
                           "ttfm_s": None, "ttfm_cpu_s": None, "tbm_us": [], "tbm_cpu_us": []}
    mask = allocate_token_bitmask(1, compiler.vocab_size)
    c0, t0 = time.thread_time(), time.perf_counter()
    try:
        compiled, served = compiler.compile(schema_spec(rec["schema"]))
        compiled.new_matcher().fill_bitmask(mask, 0)
    except GrammarError as e:
        row["invalid_spec"] = isinstance(e, InvalidSpecError)
        row["error"] = str(e)[:300]
        return row
    row["ttfm_s"], row["ttfm_cpu_s"] = time.perf_counter() - t0, time.thread_time() - c0
    row.update(backend=served, exact=compiled.exact, approximated=list(compiled.approximated),
               narrowed=list(compiled.narrowed))
    tbm, tbm_cpu = row["tbm_us"], row["tbm_cpu_us"]
    for i, test in enumerate(rec.get("tests") or []):
        text = json.dumps(test["data"], ensure_ascii=ensure_ascii)
        ids = compiler.tokenizer.encode(text, add_special_tokens=False).ids
        m = compiled.new_matcher()
        ok = True
        for t in ids:
            c0, t0 = time.thread_time(), time.perf_counter()
            m.fill_bitmask(mask, 0)
            ok = m.accept_token(t)
            tbm.append(round((time.perf_counter() - t0) * 1e6, 1))
            tbm_cpu.append(round((time.thread_time() - c0) * 1e6, 1))
            if not ok:
                break
        ok = ok and m.can_terminate()
        if test["valid"]:
            row["valid_total"] += 1
            row["valid_accepted"] += ok
            if not ok:
                row["rejected_valid"].append(i)
        else:
            row["invalid_total"] += 1
            row["invalid_rejected"] += not ok
            if ok and compiled.exact:
                row["exact_leaks"].append(i)
    # as MaskBench: a schema with an accepted invalid instance is an invalidation error, one with
    # only rejected valid instances a validation error
    if row["invalid_rejected"] < row["invalid_total"]:
        row["status"] = "invalidation_error"
    elif row["valid_accepted"] < row["valid_total"]:
        row["status"] = "validation_error"
    else:
        row["status"] = "passing"
    return row


def _serve(conn, records: list[dict[str, Any]], compiler: GrammarCompiler, ensure_ascii: bool) -> None:
    """Worker process (forked with the parent's compiler, its backends made: a fresh start took ~60 s
    on the loaded 2-core machine): measure the records the parent names by index, dropping the
    compiler's cache after each schema (every TTFM is cold, and memory stays flat)."""
    conn.send("ready")
    while True:
        i = conn.recv()
        if i is None:
            return
        timeouts = compiler.stats["timeouts"]
        row = measure_schema(compiler, records[i], ensure_ascii)
        compiler._cache.clear()  # noqa: SLF001 (a benchmark's cold start per schema)
        # a compile that overran compile_timeout still runs in a daemon thread: start afresh
        row["restart"] = compiler.stats["timeouts"] > timeouts
        conn.send(row)


def _lost_row(rec: dict[str, Any], status: str) -> dict[str, Any]:
    return {"id": rec["id"], "subset": rec.get("subset"), "status": status, "backend": None, "exact": False,
            "valid_total": 0, "valid_accepted": 0, "invalid_total": 0, "invalid_rejected": 0, "exact_leaks": [],
            "tbm_us": [], "tbm_cpu_us": [], "ttfm_s": None}


def run_bench(records: list[dict[str, Any]], make_compiler, out_path: str | Path, timeout: float = 30.0,
              ensure_ascii: bool = False, workers: int = 1, progress_every: int = 500) -> list[dict[str, Any]]:
    """Measure every record (measure_schema) in `workers` worker processes, each single-threaded,
    appending one JSON row a line to out_path (rows already there are kept: a run can resume). A
    schema whose compile and instances take longer than `timeout` seconds is a "timeout" row: its
    worker is killed and another forked, so a runaway compile cannot hold the run (nor its memory).
    make_compiler: a no-argument callable; the compiler is made once here, its backends created, and
    handed to the workers by fork."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    out_path = Path(out_path)
    done: dict[str, dict[str, Any]] = {}
    if out_path.exists():
        for line in out_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["id"]] = r
    compiler = make_compiler()
    for name in compiler.backend_order("json_schema"):
        try:
            compiler.get_backend(name)
        except GrammarError:
            pass  # a backend that cannot start fails each compile the same way in the workers
    ctx = mp.get_context("fork")
    todo = [i for i, r in enumerate(records) if r["id"] not in done]
    todo.reverse()  # pop() from the end: records in order
    idle: list[tuple[Any, Any]] = []
    busy: dict[Any, tuple[Any, int, float]] = {}  # conn -> (process, record index, deadline)

    def start() -> tuple[Any, Any]:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_serve, args=(child, records, compiler, ensure_ascii), daemon=True)
        p.start()
        if not parent.poll(600) or parent.recv() != "ready":
            raise RuntimeError("bench worker did not start")
        return p, parent

    def stop(p, conn, graceful: bool) -> None:
        if graceful:
            try:
                conn.send(None)
            except OSError:
                pass
            p.join(5)
        p.kill()
        p.join()

    t_start = time.perf_counter()
    n_new = 0
    with open(out_path, "a", encoding="utf-8") as out:
        while todo or busy:
            while todo and len(busy) < workers:
                p, conn = idle.pop() if idle else start()
                i = todo.pop()
                conn.send(i)
                busy[conn] = (p, i, time.monotonic() + timeout)
            ready = wait(list(busy), timeout=max(0.0, min(d for _, _, d in busy.values()) - time.monotonic()))
            now = time.monotonic()
            for conn in list(busy):
                p, i, deadline = busy[conn]
                row = None
                if conn in ready:
                    try:
                        row = conn.recv()
                    except EOFError:  # the worker died (e.g. out of memory)
                        row = _lost_row(records[i], "crash")
                        stop(p, conn, False)
                    else:
                        if row.pop("restart", False):
                            stop(p, conn, True)
                        else:
                            idle.append((p, conn))
                elif now >= deadline:
                    row = _lost_row(records[i], "timeout")
                    stop(p, conn, False)
                if row is None:
                    continue
                del busy[conn]
                out.write(json.dumps(row) + "\n")
                out.flush()
                done[records[i]["id"]] = row
                n_new += 1
                if progress_every and n_new % progress_every == 0:
                    print(f"  {len(done)}/{len(records)} schemas, {time.perf_counter() - t_start:.0f}s", flush=True)
    for p, conn in idle:
        stop(p, conn, True)
    return [done[r["id"]] for r in records if r["id"] in done]


def _q(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank; q=100 is the maximum), 0 for no data."""
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q / 100 * (len(ys) - 1))))]


def bench_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """MaskBench's columns for a set of rows (measure_schema / run_bench) beside ours: schema counts
    by status, invalidation errors by grammars reported exact (schemas; must be 0), declared
    coverage, valid-accepted and invalid-rejected shares per instance, TTFM (ms) and TBM (us) percentiles
    (wall; TBM on CPU time too), and which backend served how many."""
    st = Counter(r["status"] for r in rows)
    compiled = [r for r in rows if r.get("backend")]
    vt = sum(r["valid_total"] for r in rows)
    va = sum(r["valid_accepted"] for r in rows)
    it = sum(r["invalid_total"] for r in rows)
    ir = sum(r["invalid_rejected"] for r in rows)
    ttfm = [r["ttfm_s"] * 1e3 for r in compiled if r.get("ttfm_s") is not None]
    tbm = [x for r in rows for x in r.get("tbm_us") or []]
    tbm_cpu = [x for r in rows for x in r.get("tbm_cpu_us") or []]
    return {
        "schemas": len(rows), **{s: st[s] for s in STATUSES}, "crash": st["crash"],
        "invalid_spec": sum(bool(r.get("invalid_spec")) for r in rows),
        "exact_invalidation": sum(bool(r.get("exact_leaks")) for r in rows),
        "exact_leak_instances": sum(len(r.get("exact_leaks") or []) for r in rows),
        "exact": sum(bool(r.get("exact")) for r in compiled),
        "declared": len(compiled) / len(rows) if rows else 0.0,
        "valid_accepted": va / vt if vt else 0.0, "valid_total": vt,
        "invalid_rejected": ir / it if it else 0.0, "invalid_total": it,
        "ttfm_ms": {q: _q(ttfm, q) for q in (50, 75, 90, 99, 100)},
        "tbm_us": {q: _q(tbm, q) for q in (50, 75, 90, 99, 99.9, 100)},
        "tbm_cpu_us": {q: _q(tbm_cpu, q) for q in (50, 99)},
        "tokens": len(tbm),
        "served": dict(Counter(r["backend"] for r in compiled)),
    }


def summary_line(name: str, s: dict[str, Any]) -> str:
    """One printed row of bench_summary."""
    t, b = s["ttfm_ms"], s["tbm_us"]
    return (f"{name:<16} schemas {s['schemas']:5d}  passing {s['passing']:5d}  compile err {s['compile_error']:4d} "
            f"(invalid spec {s['invalid_spec']})  timeout {s['timeout']:3d}  crash {s['crash']}  "
            f"validation err {s['validation_error']:4d}  invalidation err {s['invalidation_error']:4d} "
            f"(by exact grammars {s['exact_invalidation']}: {s['exact_leak_instances']} instances)  "
            f"exact {s['exact']}  declared {s['declared']:.1%}  valid accepted {s['valid_accepted']:.2%} "
            f"of {s['valid_total']}  invalid rejected {s['invalid_rejected']:.2%} of {s['invalid_total']}  "
            f"TTFM ms p50 {t[50]:.2f} p75 {t[75]:.2f} p90 {t[90]:.2f} p99 {t[99]:.1f} max {t[100]:.0f}  "
            f"TBM us p50 {b[50]:.0f} p75 {b[75]:.0f} p90 {b[90]:.0f} p99 {b[99]:.0f} p99.9 {b[99.9]:.0f} "
            f"max {b[100]:.0f} (cpu p50 {s['tbm_cpu_us'][50]:.0f} p99 {s['tbm_cpu_us'][99]:.0f})  "
            f"tokens {s['tokens']}  served {s['served']}")
