"""Structured generation on the default model, side by side in one run, at batch 32:

- tokens/s of JSON-schema-constrained generation vs unconstrained generation of the same lengths
  (target >= 0.9);
- grammar time per constrained token (mask fill + apply, per step; median and p99);
- forward passes saved by jump-forward (the same constrained run with jump-forward off);
- coverage on ../shared/jsonschemabench: declared coverage, valid-instance acceptance and
  invalid-instance rejection of the grammar layer, and empirical coverage (share of schemas whose
  constrained generation on the default model validates) on a sample.

    python benchmarks/structured.py [--batch 32] [--coverage-sample 30]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from deepinfer import Engine, SamplingParams

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "jsonschemabench"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lu", "Max", "Ned", "Oz", "Pia"]


def chats(n: int):
    return [[{"role": "user", "content": f"Invent a person called {NAMES[i % 16]} #{i} and describe them as JSON."}]
            for i in range(n)]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def timed_generate(engine, prompts, params):
    engine.reset_prefix_cache()
    steps0 = engine.stats.num_steps
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t, engine.stats.num_steps - steps0


def empirical_coverage(engine, path: pathlib.Path, sample: int, max_tokens: int) -> tuple[int, int, int]:
    """(schemas tried, compiled, outputs that validate) on a seeded sample of one bench file."""
    import jsonschema

    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = random.Random(0).sample(recs, min(sample, len(recs)))
    prompts, params, schemas = [], [], []
    for r in recs:
        prompts.append([{"role": "user", "content": "Produce one JSON value that follows this JSON schema:\n"
                         + json.dumps(r["schema"])[:1500]}])
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, json_schema=r["schema"]))
        schemas.append(r["schema"])
    outs = engine.generate(prompts, params)
    compiled = ok = 0
    for o, schema in zip(outs, schemas):
        if o.finish_reason == "error" and "GrammarError" in (o.error or ""):
            continue
        compiled += 1
        try:
            jsonschema.validate(json.loads(o.text), schema)
            ok += 1
        except Exception:
            pass
    return len(recs), compiled, ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--coverage-sample", type=int, default=30, help="schemas per bench file for empirical coverage")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    engine = Engine(kv_cache_memory=1 << 30)
    no_jf = Engine(kv_cache_memory=1 << 30, jump_forward=False)
    prompts = chats(args.batch)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, json_schema=PERSON)
    engine.generate(prompts[:2], sp)  # warm-up: compiles the schema once
    no_jf.generate(prompts[:2], sp)

    engine.stats.grammar_step_samples.clear()
    outs, t_con, steps_con = timed_generate(engine, prompts, sp)
    samples = sorted(engine.stats.grammar_step_samples)
    lens = [len(o.token_ids) for o in outs]
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    _, t_free, _ = timed_generate(engine, prompts, free)
    valid = sum(1 for o in outs if o.finish_reason == "stop" and _parses(o.text))
    print(f"batch {args.batch}: constrained {sum(lens) / t_con:.1f} tok/s vs unconstrained {sum(lens) / t_free:.1f} tok/s "
          f"(same lengths): ratio {t_free / t_con:.2f} (target >= 0.9); {valid}/{len(outs)} complete JSON outputs")
    if samples:
        p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
        print(f"grammar time per constrained token: median {statistics.median(samples) * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us")
    jf = engine.stats.jump_forward_tokens
    _, _, steps_nojf = timed_generate(no_jf, prompts, sp)
    print(f"jump-forward: {jf} tokens appended without a decode step; forward passes {steps_con} with it vs "
          f"{steps_nojf} without ({steps_nojf - steps_con} saved)")

    if not SHARED.exists():
        print(f"coverage: {SHARED} not found, skipped")
        return
    from deepinfer.grammar import GrammarCompiler
    from deepinfer.grammar.coverage import measure_bench

    compiler = GrammarCompiler(engine.tokenizer.hf, engine.vocab_size, engine.eos_token_ids)
    for cov in measure_bench(compiler, SHARED):
        print(f"  {cov.name}: declared {cov.declared_coverage:.1%}, valid accepted {cov.valid_acceptance:.1%}, "
              f"invalid rejected {cov.invalid_rejection:.1%}")
    for f in sorted(SHARED.glob("*.jsonl")):
        n, c, ok = empirical_coverage(engine, f, args.coverage_sample, 256)
        print(f"  {f.name}: empirical coverage {ok}/{n} = {ok / n:.1%} (compiled {c})")


if __name__ == "__main__":
    main()
