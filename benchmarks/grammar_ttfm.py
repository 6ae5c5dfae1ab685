"""Time to first mask (TTFM), cold, per grammar backend and for the default chain, on JSONSchemaBench.

    .venv/bin/python benchmarks/grammar_ttfm.py [--bench DIR] [--limit N] [--timeout S] [--runs xgrammar,llguidance,outlines,chain]
        [--instances] [--xgrammar-threads T] [--json OUT]

For each schema of the bench files (every *.jsonl of --bench, ../shared/jsonschemabench by default; a
seeded sample of N per file with --limit): the wall time from `GrammarCompiler.compile(spec)` on a spec the compiler has not seen to
the first `fill_bitmask` of a fresh matcher, as a new schema's first request pays it (spec checks,
lowerings, every backend the chain tries, the emptiness probe, the first mask). Each backend's
vocabulary set-up is paid once before timing. One schema at a time (MaskBench's single-thread
setting; xgrammar's compile threads are --xgrammar-threads, 1 by default); its grammar is dropped
from the cache afterwards, so each timing is cold and memory stays flat.

Runs: each backend alone, "chain" (the default chain, as Engine() builds it) and "xgrammar-chain"
(xgrammar first, then llguidance without strict mode, then outlines: the default before llguidance
went first for schemas), so before and after compare on one machine in one process.
Per run: p50 / p99 / max TTFM over the schemas that compiled, how many compiled, how many the
compiler reports exact (deepinfer/grammar/exactness.py: CompiledGrammar.exact), timeouts
(--timeout is the compiler's compile_timeout per backend) and other failures, and which backend
served. With --instances, every test instance runs through the compiled grammar too: valid
accepted, invalid rejected, and exact leaks (invalid instances accepted by a grammar reported
exact; must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(__file__))

from grammar_coverage import BENCH_DIR, load_smollm2_tokenizer  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q / 100 * (len(ys) - 1))))]


def _records(bench: pathlib.Path, limit: int | None, seed: int) -> list[tuple[str, dict]]:
    from deepinfer.grammar.coverage import load_bench_file

    out = []
    for path in sorted(bench.glob("*.jsonl")):
        f = path.name
        recs = load_bench_file(path)
        if limit is not None and limit < len(recs):
            recs = random.Random(seed).sample(recs, limit)
        out += [(f.removesuffix(".jsonl"), r) for r in recs]
    return out


def _compiler(run: str, tok, stops, timeout: float, xgr_threads: int):
    from deepinfer.grammar import GrammarCompiler
    from deepinfer.grammar.xgrammar_backend import XGrammarBackend

    def xgrammar(vocab):
        return XGrammarBackend(vocab, max_threads=xgr_threads, strict_json=True)

    kw = dict(backends={"xgrammar": xgrammar}, compile_timeout=timeout)
    if run == "chain":  # the default backend and fallback, exactly as an Engine() builds it
        return GrammarCompiler(tok, tok.get_vocab_size(), stops, **kw)
    if run == "xgrammar-chain":  # the default chain before llguidance went first: xgrammar, then
        # llguidance (spec-faithful then: no strict rewrite), then outlines
        from deepinfer.grammar.llguidance_backend import LLGuidanceBackend

        kw["backends"]["llguidance"] = lambda vocab: LLGuidanceBackend(vocab, strict_json=False)
        return GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="xgrammar", **kw)
    return GrammarCompiler(tok, tok.get_vocab_size(), stops, backend=run, fallback=False, **kw)


def measure(run: str, records, tok, stops, args) -> dict:
    from deepinfer.errors import GrammarError, InvalidSpecError
    from deepinfer.grammar import allocate_token_bitmask
    from deepinfer.grammar.coverage import schema_spec, text_accepted

    c = _compiler(run, tok, stops, args.timeout, args.xgrammar_threads)
    for name in c.backend_order("json_schema"):
        try:
            c.get_backend(name)  # vocabulary set-up, once per backend: not part of a schema's TTFM
        except GrammarError:
            pass
    mask = allocate_token_bitmask(1, c.vocab_size)
    res = Counter()
    served: Counter = Counter()
    times: list[float] = []
    slowest: list[tuple[float, str]] = []
    for sub, rec in records:
        res["schemas"] += 1
        try:
            spec = schema_spec(rec["schema"])
        except GrammarError:
            res["bad_spec"] += 1
            continue
        timeouts = c.stats["timeouts"]
        t0 = time.perf_counter()
        try:
            compiled, by = c.compile(spec)
            compiled.new_matcher().fill_bitmask(mask, 0)
        except GrammarError as e:
            res["invalid_spec" if isinstance(e, InvalidSpecError) else
                "timeout" if c.stats["timeouts"] > timeouts else "error"] += 1
            c._cache.pop(spec, None)  # benchmark only: keep memory flat
            continue
        dt = time.perf_counter() - t0
        times.append(dt)
        slowest.append((dt, f"{sub}/{rec.get('id', '?')}"))
        res["compiled"] += 1
        res["exact"] += compiled.exact
        served[by] += 1
        if args.instances:
            for test in rec.get("tests", []):
                ids = tok.encode(json.dumps(test["data"]), add_special_tokens=False).ids
                ok = text_accepted(compiled, ids)
                if test["valid"]:
                    res["valid"] += 1
                    res["valid_accepted"] += ok
                else:
                    res["invalid"] += 1
                    res["invalid_rejected"] += not ok
                    res["exact_leaks"] += ok and compiled.exact
        del compiled
        c._cache.pop(spec, None)  # benchmark only: every timing cold, memory flat
    slowest.sort(reverse=True)
    return {"run": run, **res, "served": dict(served), "p50_ms": _pct(times, 50) * 1e3,
            "p99_ms": _pct(times, 99) * 1e3, "max_ms": (max(times) if times else float("nan")) * 1e3,
            "total_s": sum(times), "slowest": slowest[:5]}


def row(r: dict) -> str:
    s = (f"{r['run']:<14} schemas {r['schemas']:4d}  compiled {r.get('compiled', 0):4d}  exact {r.get('exact', 0):4d}  "
         f"timeout {r.get('timeout', 0):3d}  invalid {r.get('invalid_spec', 0):3d}  error {r.get('error', 0):3d}  "
         f"TTFM p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.1f} ms  max {r['max_ms']:8.1f} ms  "
         f"sum {r['total_s']:6.1f} s")
    if "valid" in r:
        s += (f"  valid accepted {r.get('valid_accepted', 0)}/{r['valid']}  invalid rejected "
              f"{r.get('invalid_rejected', 0)}/{r.get('invalid', 0)}  exact leaks {r.get('exact_leaks', 0)}")
    return s + f"  served {r['served']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", type=pathlib.Path, default=BENCH_DIR,
                    help="a directory of JSONSchemaBench .jsonl files (default: ../shared/jsonschemabench)")
    ap.add_argument("--limit", type=int, default=None, help="schemas per bench file (seeded sample)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="compile_timeout per backend and schema (s)")
    ap.add_argument("--runs", default="xgrammar,llguidance,outlines,xgrammar-chain,chain",
                    help="comma-separated: backend names (each alone), 'chain' (the default chain) and/or "
                         "'xgrammar-chain' (xgrammar first, as the default chain was before)")
    ap.add_argument("--instances", action="store_true", help="also run every test instance (exact leaks)")
    ap.add_argument("--xgrammar-threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    if not args.bench.is_dir():
        print(f"JSONSchemaBench not found at {args.bench}")
        return
    torch.set_num_threads(1)
    tok, stops = load_smollm2_tokenizer()
    records = _records(args.bench, args.limit, args.seed)
    print(f"{len(records)} schemas from {args.bench}" + (f" ({args.limit} a file at most, seed {args.seed})" if args.limit else "")
          + f"; compile_timeout {args.timeout:g}s; "
          f"xgrammar threads {args.xgrammar_threads}", flush=True)
    out = []
    for run in args.runs.split(","):
        r = measure(run, records, tok, stops, args)
        out.append(r)
        print(row(r), flush=True)
        print("    slowest:", ", ".join(f"{n} {t * 1e3:.0f}ms" for t, n in r["slowest"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
