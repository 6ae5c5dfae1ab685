"""Structured generation on the default model, side by side in one run, at batch 32:

- tokens/s of JSON-schema-constrained generation vs unconstrained generation of the same lengths
  (target >= 0.9);
- grammar time per constrained token (mask fill + apply, per step; median and p99);
- forward passes saved by jump-forward (the same constrained run with jump-forward off);
- coverage on ../shared/jsonschemabench: declared coverage, valid-instance acceptance and
  invalid-instance rejection of the grammar layer, and empirical coverage (share of schemas whose
  constrained generation on the default model validates) on a sample;
- a structured extraction job (64 product reviews -> one JSON object each, one schema, greedy, at most
  96 tokens) against vLLM CPU bf16 with the same schema as its structured output, where the peer's
  environment exists (`--peers DIR`, see vllm_peer.py): records/s and outputs that validate against the
  schema, ours in each of --dtypes (Engine(dtype=...)) with jump-forward on and
  off (--jump-forward picks one), every arm in turn (order reversed every other repeat), best of --repeats, paired median of each
  ratio; and where our time goes (engine stats).

    python benchmarks/structured.py [--batch 32] [--coverage-sample 30] [--peers DIR]
        [--sections constrained extraction coverage] [--records 64] [--repeats 3]
        [--dtypes auto bfloat16] [--jump-forward both|on|off]
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

from vllm_peer import start_vllm

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


REVIEWS = pathlib.Path(__file__).resolve().parents[1] / "examples" / "data" / "reviews.jsonl"
# examples/extract.py's Review as a JSON schema
REVIEW = {
    "type": "object",
    "properties": {
        "product": {"type": "string", "minLength": 1, "maxLength": 30},
        "sentiment": {"enum": ["positive", "negative", "mixed"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "minLength": 1, "maxLength": 60},
    },
    "required": ["product", "sentiment", "rating", "summary"],
    "additionalProperties": False,
}


def extraction_prompts(engine: Engine, n: int) -> list[list[int]]:
    """n chats (the bundled reviews, cycled, each numbered so no two prompts are the same) as token ids,
    which both engines get."""
    texts = [json.loads(line)["text"] for line in REVIEWS.read_text().splitlines() if line.strip()]
    return [engine.encode_prompt([
        {"role": "system", "content": "You extract facts from product reviews and answer with JSON only."},
        {"role": "user", "content": f"Review {i + 1}: {texts[i % len(texts)]}\n\nGive the product, the sentiment "
                                    "(positive, negative or mixed), a rating from 1 to 5 and a one-line summary."},
    ]) for i in range(n)]


def count_valid(texts: list[str], finish: list[str], schema: dict) -> int:
    """Outputs that ended by themselves (not cut at max_tokens) and validate against the schema."""
    import jsonschema

    ok = 0
    for text, why in zip(texts, finish):
        try:
            jsonschema.validate(json.loads(text), schema)
            ok += why == "stop"
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok


SPLIT_KEYS = ("num_steps", "num_forward_tokens", "computed_prompt_tokens", "generated_tokens", "jump_forward_tokens",
              "schedule_time", "forward_time", "sample_time", "grammar_time", "postprocess_time")


def time_split(wall: float, d: dict) -> str:
    """Where one run's time went: d holds the run's differences of the engine's SPLIT_KEYS stats."""
    parts = ", ".join(f"{k.removesuffix('_time')} {d[k]:.2f} s ({d[k] / wall:.0%})"
                      for k in ("forward_time", "grammar_time", "sample_time", "postprocess_time", "schedule_time"))
    return (f"wall {wall:.2f} s: {parts} (grammar: masks, token accepts and jump-forward, counted inside the "
            f"other phases too); {d['num_steps']} steps, {d['num_forward_tokens']} forward tokens "
            f"({d['computed_prompt_tokens']} prompt), {d['generated_tokens']} sampled + "
            f"{d['jump_forward_tokens']} jump-forward tokens")


def extraction(args) -> None:
    """The extraction job: ours (per dtype, jump-forward on / off) vs vLLM CPU bf16, side by side."""
    arms_ours = {f"ours {d} jf {'on' if jf else 'off'}": Engine(kv_cache_memory=1 << 30, dtype=d, jump_forward=jf)
                 for d in args.dtypes for jf in {"both": (True, False), "on": (True,), "off": (False,)}[args.jump_forward]}
    first = next(iter(arms_ours.values()))
    prompts = extraction_prompts(first, args.records)
    sp = SamplingParams(temperature=0, max_tokens=args.extract_max_tokens, json_schema=REVIEW)
    vllm, why = start_vllm(args.peers, ["bfloat16"])
    print(f"extraction: {args.records} reviews, max_tokens {args.extract_max_tokens}, greedy; vLLM CPU peer: "
          f"{'bfloat16 (enforce_eager)' if vllm else 'skipped: ' + why}", flush=True)
    runs: dict[str, list[tuple[float, int]]] = {}
    splits: dict[str, tuple[float, str]] = {}  # our fastest run's time split per arm

    def ours(name, e):
        def go():
            e.reset_prefix_cache()
            before = {k: getattr(e.stats, k) for k in SPLIT_KEYS}
            t = time.perf_counter()
            outs = e.generate(prompts, sp)
            dt = time.perf_counter() - t
            if dt < splits.get(name, (float("inf"),))[0]:
                splits[name] = (dt, time_split(dt, {k: getattr(e.stats, k) - before[k] for k in SPLIT_KEYS}))
            return dt, count_valid([o.text for o in outs], [o.finish_reason for o in outs], REVIEW)
        return go

    def theirs(v):
        def go():
            r = v.generate(prompts, args.extract_max_tokens, ignore_eos=False, json_schema=REVIEW)
            return r.seconds, count_valid(r.texts, r.finish, REVIEW)
        return go

    arms = [(name, ours(name, e)) for name, e in arms_ours.items()] + [("vLLM bf16", theirs(v)) for v in vllm.values()]
    try:
        for _, go in arms:  # warm-up: compiles the schema on every side
            go()
        splits.clear()
        for rep in range(args.repeats):
            for name, go in (arms if rep % 2 == 0 else arms[::-1]):
                runs.setdefault(name, []).append(go())
                print(f"  repeat {rep}: {name} {runs[name][-1][0]:.1f} s, {runs[name][-1][1]} valid", flush=True)
    finally:
        for v in vllm.values():
            v.close()
    best = {name: args.records / min(t for t, _ in r) for name, r in runs.items()}
    print(f"{'arm':>24} {'records/s':>10} {'valid (worst run)':>18}")
    for name, r in runs.items():
        print(f"{name:>24} {best[name]:>10.2f} {min(v for _, v in r):>15}/{args.records}")
    names = list(arms_ours)
    for name in names[1:]:  # against our first arm, paired by repeat
        paired = [runs[names[0]][i][0] / runs[name][i][0] for i in range(args.repeats)]
        print(f"{name} / {names[0]}: {best[name] / best[names[0]]:.2f}x (paired median {statistics.median(paired):.2f}x)")
    if "vLLM bf16" in runs:
        for name in arms_ours:
            paired = [runs["vLLM bf16"][i][0] / runs[name][i][0] for i in range(args.repeats)]
            print(f"{name} / vLLM bf16: {best[name] / best['vLLM bf16']:.2f}x (paired median "
                  f"{statistics.median(paired):.2f}x; target >= 1.5 with every output valid)")
    for name, (_, split) in splits.items():
        print(f"  {name}, fastest run: {split}")


def constrained_vs_free(args) -> Engine:
    engine = Engine(kv_cache_memory=1 << 30, jump_forward=True)
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
    return engine


def coverage(args, engine: Engine) -> None:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", nargs="+", choices=["constrained", "extraction", "coverage"],
                    default=["constrained", "extraction", "coverage"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--coverage-sample", type=int, default=30, help="schemas per bench file for empirical coverage")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--records", type=int, default=64, help="extraction: review records")
    ap.add_argument("--extract-max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="extraction: runs per arm")
    ap.add_argument("--peers", default=os.environ.get("DEEPINFER_PEERS"),
                    help="directory built by ../shared/peers/setup.sh (vLLM from DIR/vllm)")
    ap.add_argument("--dtypes", nargs="+", default=["auto"],
                    help="extraction: our engine's Engine(dtype=...) arms, e.g. auto bfloat16")
    ap.add_argument("--jump-forward", choices=("both", "on", "off"), default="both",
                    help="extraction: our arms with jump-forward on, off (the engine's default) or both")
    args = ap.parse_args()
    engine = None
    if "constrained" in args.sections:
        engine = constrained_vs_free(args)
    if "extraction" in args.sections:
        extraction(args)
    if "coverage" in args.sections:
        coverage(args, engine or Engine(kv_cache_memory=1 << 30))


if __name__ == "__main__":
    main()
