"""DSL programs vs the raw engine, and prefix sharing on vs off, side by side on the default model.

1. batch:   `run_batch` of N programs with two `gen` calls each vs the same requests submitted to
            `engine.generate` directly (round 1, then round 2 on round 1's output). Ratio =
            program throughput / direct throughput (target >= 0.95).
2. select:  a shared 5-shot prefix, Q questions, a 4-way `select` each.
3. fork:    a shared prompt, `fork(4)` and a short `gen` per branch, Q programs.
   For 2 and 3, "sharing on" = run_batch(share_prefix=True) on an engine with its radix prefix
   cache; "off" = run_batch(share_prefix=False) on an engine built with
   enable_prefix_caching=False, i.e. every request prefills its whole prompt. Ratio = off / on
   wall time (target >= 2).
4. frontend overhead per gen call on the instant FakeEngine (deepinfer.lang.bench).

    python benchmarks/programs.py [--programs 256] [--questions 128] [--tokens 16] [--skip-off]
Smoke run: python benchmarks/programs.py --programs 16 --questions 8 --tokens 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import deepinfer as di
from deepinfer import Engine, SamplingParams
from deepinfer.lang.bench import frontend_overhead_us

SHOTS = [
    ("Which animal is known as the king of the jungle?", ["lion", "tiger", "bear", "wolf"], "lion"),
    ("Which planet is closest to the sun?", ["Venus", "Mercury", "Earth", "Mars"], "Mercury"),
    ("What do bees make?", ["milk", "silk", "honey", "wax"], "honey"),
    ("Which is the largest ocean?", ["Atlantic", "Indian", "Arctic", "Pacific"], "Pacific"),
    ("What color is a ripe banana?", ["blue", "yellow", "red", "green"], "yellow"),
]
SUBJECTS = ["water", "the moon", "a cat", "a car", "rice", "paper", "the sun", "a tree", "iron", "salt",
            "a river", "snow", "glass", "bread", "a bird", "coffee"]
CHOICES = ["yes", "no", "sometimes", "never"]


def few_shot_prefix() -> str:
    head = ("You are a careful quiz solver. For each question, read all four options, think about which one "
            "is correct, and answer with exactly one of the options.\n\n")
    return head + "".join(f"Question: {q}\nOptions: {', '.join(o)}\nAnswer: {a}\n\n" for q, o, a in SHOTS)


@di.function
def two_gens(s, prompt, tokens):
    s += prompt + di.gen("a", max_tokens=tokens, ignore_eos=True)
    s += "\nIn short:" + di.gen("b", max_tokens=tokens, ignore_eos=True)


@di.function
def quiz(s, prefix, question):
    s += prefix + "Question: " + question + "\nOptions: " + ", ".join(CHOICES) + "\nAnswer: "
    s += di.select("answer", CHOICES)


@di.function
def brainstorm(s, context, topic, tokens):
    s += context + f"Topic: {topic}\nIdea:"
    f = s.fork(4)
    for i, b in enumerate(f):
        b += di.gen("idea", max_tokens=tokens, temperature=0.8, seed=i, ignore_eos=True)
    f.join()


FORK_CONTEXT = (
    "You help a small team brainstorm. Good ideas are concrete, cheap to try, and can be tested within a "
    "week. Avoid vague advice; name the first step. Keep each idea to one sentence.\n" * 3
)


def bench_batch(engine: Engine, n: int, tokens: int) -> dict:
    prompts = [f"Question {i}: explain why {SUBJECTS[i % len(SUBJECTS)]} matters, briefly." for i in range(n)]
    two_gens.run_batch([{"prompt": prompts[0], "tokens": 2}], backend=engine)  # warm-up
    t = time.perf_counter()
    states = two_gens.run_batch([{"prompt": p, "tokens": tokens} for p in prompts], backend=engine,
                                temperature=0.0, share_prefix=False)
    dsl_s = time.perf_counter() - t
    assert all(st.ok for st in states), next(st.error() for st in states if not st.ok)
    dsl_tok = sum(st.get_meta_info(k)["completion_tokens"] for st in states for k in ("a", "b"))

    # the same requests, straight to the engine: round 2 continues round 1's tokens exactly
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t = time.perf_counter()
    first_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    if getattr(tok, "add_bos", False) and tok.bos_token_id is not None:
        first_ids = [[tok.bos_token_id] + ids for ids in first_ids]
    outs1 = engine.generate(first_ids, params)
    tail = tok.encode("\nIn short:", add_special_tokens=False)
    outs2 = engine.generate([ids + list(o.token_ids) + tail for ids, o in zip(first_ids, outs1)], params)
    direct_s = time.perf_counter() - t
    direct_tok = sum(len(o.token_ids) for o in outs1 + outs2)
    return {"programs": n, "dsl_s": dsl_s, "direct_s": direct_s, "dsl_tok_s": dsl_tok / dsl_s,
            "direct_tok_s": direct_tok / direct_s, "ratio": (dsl_tok / dsl_s) / (direct_tok / direct_s)}


def bench_sharing(on: Engine, off: Engine | None, q: int, tokens: int) -> dict:
    prefix = few_shot_prefix()
    qs = [f"Is {SUBJECTS[i % len(SUBJECTS)]} ever found in space? (#{i})" for i in range(q)]
    res = {}
    for label, engine, share in (("on", on, True), ("off", off, False)):
        if engine is None:
            continue
        reset = getattr(engine, "reset_prefix_cache", None)
        if reset:
            reset()
        t = time.perf_counter()
        states = quiz.run_batch([{"prefix": prefix, "question": x} for x in qs], backend=engine, share_prefix=share)
        res[f"select_{label}_s"] = time.perf_counter() - t
        assert all(st.ok for st in states), next(st.error() for st in states if not st.ok)
        if reset:
            reset()
        t = time.perf_counter()
        states = brainstorm.run_batch(
            [{"context": FORK_CONTEXT, "topic": f"{SUBJECTS[i % len(SUBJECTS)]} #{i}", "tokens": tokens}
             for i in range(q)], backend=engine, share_prefix=share)
        res[f"fork_{label}_s"] = time.perf_counter() - t
        assert all(st.ok for st in states), next(st.error() for st in states if not st.ok)
    if off is not None:
        res["select_ratio"] = res["select_off_s"] / res["select_on_s"]
        res["fork_ratio"] = res["fork_off_s"] / res["fork_on_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", type=int, default=256, help="programs of the run_batch vs generate workload")
    ap.add_argument("--questions", type=int, default=128, help="questions of the select and fork workloads")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per gen")
    ap.add_argument("--kv-cache-mib", type=int, default=512)
    ap.add_argument("--skip-off", action="store_true", help="do not build the prefix-caching-off engine")
    args = ap.parse_args()

    t = time.perf_counter()
    on = Engine(kv_cache_memory=args.kv_cache_mib << 20)
    off = None if args.skip_off else Engine(kv_cache_memory=args.kv_cache_mib << 20, enable_prefix_caching=False)
    print(f"engines loaded in {time.perf_counter() - t:.1f}s")

    b = bench_batch(on, args.programs, args.tokens)
    print(f"[batch]  {b['programs']} programs x 2 gens x {args.tokens} tokens: run_batch {b['dsl_s']:.2f}s "
          f"({b['dsl_tok_s']:.0f} tok/s) vs engine.generate {b['direct_s']:.2f}s ({b['direct_tok_s']:.0f} tok/s)"
          f" -> ratio {b['ratio']:.3f} (target >= 0.95)")
    s = bench_sharing(on, off, args.questions, args.tokens)
    print(f"[select] {args.questions} questions, 5-shot prefix, 4 choices: sharing on {s['select_on_s']:.2f}s", end="")
    print(f", off {s['select_off_s']:.2f}s -> ratio {s['select_ratio']:.2f}x (target >= 2)" if off else "")
    print(f"[fork]   {args.questions} programs, fork(4) x {args.tokens} tokens: sharing on {s['fork_on_s']:.2f}s",
          end="")
    print(f", off {s['fork_off_s']:.2f}s -> ratio {s['fork_ratio']:.2f}x (target >= 2)" if off else "")
    f = frontend_overhead_us(n_programs=200, gens_per_program=4)
    print(f"[frontend] {f['us_per_gen_frontend']:.0f} us per gen call on the FakeEngine "
          f"({f['us_per_gen_total']:.0f} us incl. the fake engine)")


if __name__ == "__main__":
    main()
