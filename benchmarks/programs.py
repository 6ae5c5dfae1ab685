"""DSL programs vs the raw engine, and prefix sharing on vs off, side by side on the default model.

1. batch:   `run_batch` of N programs with two `gen` calls each vs the same requests submitted to
            `engine.generate` directly (round 1, then round 2 on round 1's output). Ratio =
            program throughput / direct throughput (target >= 0.97). Runs alternate which side goes
            first, with the prefix cache reset before each (else the second side reuses the first's
            KV); best and median ratios are printed.
2. select:  a shared 5-shot prefix, Q questions, a 4-way `select` each.
3. fork:    a shared prompt, `fork(4)` and a short `gen` per branch, Q programs.
   For 2 and 3, "sharing on" = run_batch(share_prefix=True), "off" = run_batch(share_prefix=False),
   both on the same engine with its radix prefix cache on (reset before each run), alternating
   pairs after a warm-up: the ratio (off / on wall time, paired median) is what the DSL's shared
   prefill adds on top of the cache, next to each arm's engine steps, forward tokens and time
   outside the forward. (It used to compare against an engine without a prefix cache, which
   credited the cache's work to the DSL.)
4. frontend overhead per gen call on the instant FakeEngine (deepinfer.lang.bench).
5. compiler (deepinfer.lang.compiler), compiled (default) vs compile=False, alternating pairs: wall
   time, time to the first generated token (the end of the step that sampled the batch's first
   token, timed from the run_batch call, so the compiled arm's tracing counts) and to the first
   finished generation:
   a. 3-stage program (extract -> classify with select -> summarise with a JSON schema) over R records;
   b. fork(4) tree search (propose 4 steps, score each with select, keep the best), Q programs;
   c. S programs with S distinct JSON schemas, fresh per run, the grammar compiler's one-time set-up
      done before both arms. Interpreted, the engine compiles the first schema inside its
      add_request (idle engine) and the other S-1 in its two compile threads, which run beside the
      first step; compiled, the first program's schema compiles first, alone, its request runs its
      first step alone (submitted while the schema still compiles: the engine prefills it
      meanwhile), and the others compile after that step (EngineBackend.precompile_after).
      Targets: (c) first output >= 5x sooner, (a)/(b) >= 1.0x.

    python benchmarks/programs.py [--programs 64] [--questions 128] [--tokens 16] [--records 200]
                                  [--schemas 100] [--only batch,sharing,frontend,compiler]
Smoke run: python benchmarks/programs.py --programs 16 --questions 8 --tokens 4 --records 8 --schemas 8
"""

from __future__ import annotations

import argparse
import gc
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


def _stats(engine: Engine) -> tuple:
    st = getattr(engine, "stats", None)
    return (getattr(st, "num_steps", 0), getattr(st, "num_forward_tokens", 0), getattr(st, "forward_time", 0.0))


def bench_batch(engine: Engine, n: int, tokens: int, reps: int = 3) -> dict:
    """run_batch vs engine.generate on the same requests, `reps` times alternating which goes first,
    the prefix cache reset before every run (the second of a pair would otherwise hit the first's
    cache). Returns the best and the median ratio, and each side's engine steps / forward tokens."""
    prompts = [f"Question {i}: explain why {SUBJECTS[i % len(SUBJECTS)]} matters, briefly." for i in range(n)]
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    tail = tok.encode("\nIn short:", add_special_tokens=False)

    def dsl() -> tuple[float, int]:
        t = time.perf_counter()
        states = two_gens.run_batch([{"prompt": p, "tokens": tokens} for p in prompts], backend=engine,
                                    temperature=0.0, share_prefix=False)
        wall = time.perf_counter() - t
        assert all(st.ok for st in states), next(st.error() for st in states if not st.ok)
        return wall, sum(st.get_meta_info(k)["completion_tokens"] for st in states for k in ("a", "b"))

    def direct() -> tuple[float, int]:
        # the same requests, straight to the engine: round 2 continues round 1's tokens exactly
        t = time.perf_counter()
        first_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        if getattr(tok, "add_bos", False) and tok.bos_token_id is not None:
            first_ids = [[tok.bos_token_id] + ids for ids in first_ids]
        outs1 = engine.generate(first_ids, params)
        outs2 = engine.generate([ids + list(o.token_ids) + tail for ids, o in zip(first_ids, outs1)], params)
        return time.perf_counter() - t, sum(len(o.token_ids) for o in outs1 + outs2)

    two_gens.run_batch([{"prompt": prompts[0], "tokens": 2}], backend=engine)  # warm-up
    engine.generate([prompts[0]], SamplingParams(max_tokens=2))
    reset = getattr(engine, "reset_prefix_cache", None)
    runs: dict[str, list] = {"dsl": [], "direct": []}
    for r in range(reps):
        for name in (("dsl", "direct") if r % 2 == 0 else ("direct", "dsl")):
            if reset:
                reset()
            gc.collect()  # each side starts from a fresh collection (else one pays the other's garbage)
            before = _stats(engine)
            wall, ntok = (dsl if name == "dsl" else direct)()
            after = _stats(engine)
            runs[name].append((wall, ntok, *(a - b for a, b in zip(after, before))))
    ratios = sorted((d[1] / d[0]) / (g[1] / g[0]) for d, g in zip(runs["dsl"], runs["direct"]))
    # the same ratio with each pair's forward passes charged equally (the smaller of the two forward
    # times to both): the steps and forward tokens are the same on both sides, so what differs in
    # the forward time is the neighbours' load, not the work; what is left is the frontend's cost
    level = sorted((g[0] - g[4] + min(d[4], g[4])) / g[1] / ((d[0] - d[4] + min(d[4], g[4])) / d[1])
                   for d, g in zip(runs["dsl"], runs["direct"]))
    best = {k: min(v, key=lambda x: x[0]) for k, v in runs.items()}
    return {"programs": n, "reps": reps, "dsl_s": best["dsl"][0], "direct_s": best["direct"][0],
            "dsl_tok_s": best["dsl"][1] / best["dsl"][0], "direct_tok_s": best["direct"][1] / best["direct"][0],
            "ratio_best": (best["dsl"][1] / best["dsl"][0]) / (best["direct"][1] / best["direct"][0]),
            "ratio_median": ratios[len(ratios) // 2], "ratios": ratios, "level_median": level[len(level) // 2],
            "dsl_rest_s": best["dsl"][0] - best["dsl"][4], "direct_rest_s": best["direct"][0] - best["direct"][4],
            "dsl_steps": best["dsl"][2], "direct_steps": best["direct"][2],
            "dsl_fwd_tokens": best["dsl"][3], "direct_fwd_tokens": best["direct"][3],
            "dsl_fwd_s": best["dsl"][4], "direct_fwd_s": best["direct"][4]}


def _paired(on: list[tuple], off: list[tuple]) -> dict:
    """Median over pairs of off / on wall, and the same with each pair's forward passes charged
    equally (the smaller forward time to both): what is left is the time outside the forward."""
    mid = len(on) // 2
    wall = sorted(f[0] / o[0] for o, f in zip(on, off))
    level = sorted((f[0] - f[3] + min(o[3], f[3])) / (o[0] - o[3] + min(o[3], f[3])) for o, f in zip(on, off))
    return {"ratio": wall[mid], "ratios": wall, "level": level[mid]}


def bench_sharing(engine: Engine, q: int, tokens: int, reps: int = 3) -> dict:
    """share_prefix on vs off for the select and fork workloads, `reps` pairs alternating which
    goes first, each run from a reset prefix cache and a fresh collection, after a warm-up of
    both. Per arm: wall, engine steps, forward tokens, forward seconds (each run's; medians and
    the best printed). The first measurement ran on before off with no warm-up, once, under load:
    on read 0.63x (select) and 0.81x (fork) of off, with the same engine steps and forward tokens
    within 1 % (32 questions: 4 vs 4 steps, 1086 vs 1103 tokens; 17 vs 17, 3085 vs 3059): the
    difference was the forward's time, i.e. the load, not work either arm did."""
    prefix = few_shot_prefix()
    qs = [f"Is {SUBJECTS[i % len(SUBJECTS)]} ever found in space? (#{i})" for i in range(q)]
    work = {
        "select": (quiz, [{"prefix": prefix, "question": x} for x in qs]),
        "fork": (brainstorm, [{"context": FORK_CONTEXT, "topic": f"{SUBJECTS[i % len(SUBJECTS)]} #{i}",
                               "tokens": tokens} for i in range(q)]),
    }
    reset = getattr(engine, "reset_prefix_cache", None)
    res = {}
    for name, (prog, batch) in work.items():
        for share in (True, False):  # warm-up: first-use costs (templates, encoders) out of the timed runs
            prog.run_batch(batch[:2], backend=engine, share_prefix=share)
        runs: dict[bool, list] = {True: [], False: []}
        for r in range(reps):
            for share in ((True, False) if r % 2 == 0 else (False, True)):
                if reset:
                    reset()
                gc.collect()
                before = _stats(engine)
                t = time.perf_counter()
                states = prog.run_batch(batch, backend=engine, share_prefix=share)
                wall = time.perf_counter() - t
                assert all(st.ok for st in states), next(st.error() for st in states if not st.ok)
                runs[share].append((wall, *(a - b for a, b in zip(_stats(engine), before))))
        res[name] = {"on": runs[True], "off": runs[False], **_paired(runs[True], runs[False])}
    return res


# ---------------------------------------------------------------------- 5. compiler
REVIEW_SCHEMA = {
    "type": "object",
    "properties": {"product": {"type": "string", "maxLength": 20}, "stars": {"type": "integer", "minimum": 1,
                                                                             "maximum": 5}},
    "required": ["product", "stars"],
}
EXTRACT_SYSTEM = ("You read short customer reviews. First quote the product, then classify the review, "
                  "then summarise it as JSON with the product and a star rating from 1 to 5.")


@di.function
def three_stage(s, review, tokens):
    s += di.system(EXTRACT_SYSTEM)
    s += di.user("Review: " + review + "\nWhich product is it about?")
    s += di.assistant(di.gen("product", max_tokens=tokens, stop="\n"))
    s += di.user("Is the review positive, negative or mixed?")
    s += di.assistant(di.select("sentiment", ["positive", "negative", "mixed"]))
    s += di.user("Summarise it as JSON.")
    s += di.assistant(di.gen("summary", json_schema=REVIEW_SCHEMA, max_tokens=64, complete_within_budget=True))


@di.function
def tree_step(s, task, tokens):
    s += di.system("You are a practical planner. Propose one concrete next step.")
    s += di.user(task)
    s += di.assistant_begin()
    branches = s.fork(4)
    for i, b in enumerate(branches):
        b += "Step:" + di.gen("step", max_tokens=tokens, stop="\n", temperature=0.8, seed=i)
        b += "\nIs this step useful? " + di.select("verdict", ["yes", "no"])
    branches.join()
    s += di.assistant_end()


@di.function
def schema_prog(s, i, schema, tokens):
    s += f"Record {i}. Fill in the fields as JSON:\n" + di.gen("obj", json_schema=schema, max_tokens=tokens,
                                                                complete_within_budget=True)


def distinct_schemas(n: int, tag: str) -> list[dict]:
    """n schemas that differ (and from another tag's), so no compile is served from the cache."""
    kinds = ["string", "integer", "boolean", "number"]
    return [{"type": "object",
             "properties": {f"{tag}_field_{i}_{k}": {"type": kinds[(i + k) % 4]} for k in range(3)},
             "required": [f"{tag}_field_{i}_0"]} for i in range(n)]


class _FirstOutput:
    """Engine proxy that notes when the run's first generated token comes back (`first`: the end of
    the step that sampled it) and when its first generation finishes (`done`)."""

    def __init__(self, engine):
        self._e, self.tokenizer, self.first, self.done = engine, engine.tokenizer, None, None

    def __getattr__(self, name):
        return getattr(self._e, name)

    def step(self):
        outs = self._e.step()
        if self.done is None:
            now = time.perf_counter()
            if self.first is None and any(o.token_ids for o in outs):
                self.first = now
            if any(o.finished and o.token_ids for o in outs):
                self.done = now
        return outs


_PROXIES: dict[int, _FirstOutput] = {}


def first_output_proxy(engine) -> _FirstOutput:
    """The engine's one _FirstOutput, reset. run_batch keeps one runtime per backend object (its
    thread, its chat-template analysis and segment encoder, built on first use), as a program server
    reusing one engine has; a fresh proxy per timed run built all of that again inside every run of
    both modes (2-2.5 ms of each run's time to the first output on the Zen 5 host: the first encode
    1.6-2.1 ms, the runtime's thread start 0.4-0.6 ms), which the workloads' warm-ups, run on the engine's
    own runtime, were meant to take out."""
    proxy = _PROXIES.get(id(engine))
    if proxy is None or proxy._e is not engine:
        proxy = _PROXIES[id(engine)] = _FirstOutput(engine)
    proxy.first = proxy.done = None
    return proxy


def timed_batch(prog, batch, engine, compile_: bool, **kw) -> tuple[float, ...]:
    """(wall seconds, seconds to the first generated token, engine steps, forward tokens, forward
    seconds, seconds to the first finished generation) of one run_batch, timed from the call (the
    compiled arm's tracing and planning included). Steps and forward tokens are the work done,
    which the machine's load does not change: where the two modes' walls differ but these do
    not, the difference is noise."""
    reset = getattr(engine, "reset_prefix_cache", None)
    if reset:
        reset()
    gc.collect()  # each run starts from a fresh collection
    proxy = first_output_proxy(engine)
    before = _stats(engine)
    t = time.perf_counter()
    states = prog.run_batch(batch, backend=proxy, compile=compile_, **kw)
    wall = time.perf_counter() - t
    bad = [st.error() for st in states if not st.ok]
    assert not bad, bad[0]
    end = time.perf_counter()
    return (wall, (proxy.first or end) - t, *(a - b for a, b in zip(_stats(engine), before)), (proxy.done or end) - t)


def bench_compiler(engine: Engine, records: int, q: int, n_schemas: int, tokens: int, parts: str = "abc",
                   rounds: int = 3, report=None, compiled_first: bool = False) -> dict:
    """Compiled vs interpreted for each workload in `parts` (in that order), `rounds` pairs
    alternating which mode goes first; res[f"{key}_{mode}"] lists each run's timed_batch tuple.
    `report(key, res)` is called as each workload finishes (a full-size one takes minutes here)."""
    res = {}
    reviews = [f"I bought the {SUBJECTS[i % len(SUBJECTS)]} kit #{i}; it works, but the box was damaged."
               for i in range(records)]
    tasks = [f"Plan a one-week project about {SUBJECTS[i % len(SUBJECTS)]} (#{i})." for i in range(q)]
    workloads = {
        "a": (three_stage, [{"review": r, "tokens": tokens} for r in reviews], {"temperature": 0.0}),
        "b": (tree_step, [{"task": t, "tokens": tokens} for t in tasks], {}),
    }
    for key in parts:
        if key in workloads:
            prog, batch, kw = workloads[key]
            # warm-up (and the shared schema's compile), on the runtime the timed runs use
            prog.run_batch(batch[:2], backend=first_output_proxy(engine), **kw)
            # alternate the modes and keep each one's best: the machine is shared and noisy
            for r in range(rounds):  # alternate which mode goes first (--compiled-first flips it)
                for compile_ in ((False, True) if (r + compiled_first) % 2 == 0 else (True, False)):
                    name = f"{key}_{'compiled' if compile_ else 'interp'}"
                    res.setdefault(name, []).append(timed_batch(prog, batch, engine, compile_, **kw))
        elif key == "c":
            # the grammar compiler's one-time set-up (the vocabulary) first, so neither mode pays it: both
            # arms start with the compiler built and warm and none of their own (fresh) schemas compiled
            schema_prog.run_batch([{"i": 0, "schema": distinct_schemas(1, "warm")[0], "tokens": 4}],
                                  backend=first_output_proxy(engine))
            # what the first output waits on in either mode: one fresh schema's compile, one step
            alone = []
            for k in range(3):
                t = time.perf_counter()
                fut = engine.precompile(SamplingParams(json_schema=distinct_schemas(1, f"alone{k}")[0], max_tokens=24))
                if fut is not None:
                    fut.result()
                alone.append(time.perf_counter() - t)
            # and the first step: the first program's prompt prefilled from an empty cache, as in the
            # timed runs (the warm-up above cached this very prompt: a 1-token step read 12-18 ms on
            # the Zen 5 host against 35-45 ms for the real first step)
            step = []
            for _ in range(3):
                if getattr(engine, "reset_prefix_cache", None):
                    engine.reset_prefix_cache()
                t = time.perf_counter()
                engine.generate(["Record 0. Fill in the fields as JSON:\n"], SamplingParams(max_tokens=1))
                step.append(time.perf_counter() - t)
            res["c_parts"] = (min(alone), sorted(step)[1])
            for r in range(rounds):  # alternate which mode goes first; fresh schemas every run
                for compile_ in ((False, True) if (r + compiled_first) % 2 == 0 else (True, False)):
                    tag = f"{'c' if compile_ else 'i'}{r}"
                    batch = [{"i": i, "schema": sc, "tokens": 24}
                             for i, sc in enumerate(distinct_schemas(n_schemas, tag))]
                    name = f"c_{'compiled' if compile_ else 'interp'}"
                    res.setdefault(name, []).append(timed_batch(schema_prog, batch, engine, compile_, temperature=0.0))
        else:
            continue
        if report is not None:
            report(key, res)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", type=int, default=256, help="programs of the run_batch vs generate workload")
    ap.add_argument("--questions", type=int, default=128, help="questions of the select and fork workloads")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per gen")
    ap.add_argument("--reps", type=int, default=3, help="alternating run_batch / generate pairs of the batch workload")
    ap.add_argument("--records", type=int, default=200, help="records of the 3-stage compiler workload")
    ap.add_argument("--schemas", type=int, default=100, help="programs (and distinct schemas) of workload 5c")
    ap.add_argument("--kv-cache-mib", type=int, default=512)
    ap.add_argument("--only", default="batch,sharing,frontend,compiler", help="comma-separated sections to run")
    ap.add_argument("--parts", default="abc", help="which compiler workloads (a, b, c) to run, in that order")
    ap.add_argument("--rounds", type=int, default=3, help="interpreted / compiled pairs per compiler workload")
    ap.add_argument("--compiled-first", action="store_true", help="start each workload's pairs with the compiled run")
    args = ap.parse_args()
    only = set(args.only.split(","))

    if only & {"batch", "sharing", "compiler"}:
        t = time.perf_counter()
        on = Engine(kv_cache_memory=args.kv_cache_mib << 20)
        print(f"engine loaded in {time.perf_counter() - t:.1f}s")
    if "batch" in only:
        b = bench_batch(on, args.programs, args.tokens, args.reps)
        print(f"[batch]  {b['programs']} programs x 2 gens x {args.tokens} tokens, {b['reps']} alternating runs, "
              f"prefix cache reset before each: run_batch best {b['dsl_s']:.2f}s ({b['dsl_tok_s']:.0f} tok/s) vs "
              f"engine.generate best {b['direct_s']:.2f}s ({b['direct_tok_s']:.0f} tok/s) -> ratio best "
              f"{b['ratio_best']:.3f}, median {b['ratio_median']:.3f} (target >= 0.97); all "
              f"{', '.join(f'{x:.3f}' for x in b['ratios'])}; engine steps {b['dsl_steps']} vs {b['direct_steps']}, "
              f"forward tokens {b['dsl_fwd_tokens']} vs {b['direct_fwd_tokens']}, forward time "
              f"{b['dsl_fwd_s']:.2f}s vs {b['direct_fwd_s']:.2f}s, outside the forward {b['dsl_rest_s']:.2f}s vs "
              f"{b['direct_rest_s']:.2f}s; ratio with equal forward time per pair (median) {b['level_median']:.3f}")
    if "sharing" in only:
        s = bench_sharing(on, args.questions, args.tokens, args.reps)
        what = {"select": f"{args.questions} questions, 5-shot prefix, 4 choices",
                "fork": f"{args.questions} programs, fork(4) x {args.tokens} tokens"}
        for name, r in s.items():
            med = {k: sorted(r[k])[len(r[k]) // 2] for k in ("on", "off")}
            print(f"[{name}] {what[name]}, radix cache on in both, {len(r['on'])} alternating pairs: share_prefix on "
                  f"median {med['on'][0]:.2f}s, off {med['off'][0]:.2f}s -> off/on paired median {r['ratio']:.2f}x "
                  f"(all {', '.join(f'{x:.2f}' for x in r['ratios'])}); engine steps {med['on'][1]} vs {med['off'][1]}, "
                  f"forward tokens {med['on'][2]} vs {med['off'][2]}, forward {med['on'][3]:.2f}s vs {med['off'][3]:.2f}s, "
                  f"outside the forward {med['on'][0] - med['on'][3]:.2f}s vs {med['off'][0] - med['off'][3]:.2f}s "
                  f"(on vs off); off/on with equal forward time per pair (median) {r['level']:.2f}x", flush=True)
    if "frontend" in only:
        runs = [frontend_overhead_us(n_programs=200, gens_per_program=4) for _ in range(args.reps * 3)]
        f = {k: sorted(r[k] for r in runs) for k in runs[0]}
        mid = len(runs) // 2
        print(f"[frontend] {len(runs)} runs of 200 programs x 4 gens on the FakeEngine, us per gen call, best / "
              f"median: frontend wall {f['us_per_gen_frontend'][0]:.0f} / {f['us_per_gen_frontend'][mid]:.0f} "
              f"(CPU {f['cpu_us_per_gen_frontend'][0]:.0f} / {f['cpu_us_per_gen_frontend'][mid]:.0f}), of which the "
              f"fake tokenizer {f['us_per_gen_tokenizer'][0]:.0f} / {f['us_per_gen_tokenizer'][mid]:.0f}; "
              f"incl. the fake engine {f['us_per_gen_total'][0]:.0f} / {f['us_per_gen_total'][mid]:.0f}")
        from deepinfer.lang.bench import encode_cost_us
        from deepinfer.lang.testing import FakeTokenizer

        toks = [("fake", FakeTokenizer())]
        if only & {"batch", "sharing", "compiler"}:
            toks.append(("model", on.tokenizer))
        for label, tok in toks:
            e = encode_cost_us(tok)
            print(f"[encode] {label} tokenizer, a chat gen's pending text: whole string {e['whole']:.1f} us, "
                  f"SegmentEncoder {e['pieces']:.1f} us ({e['whole'] / e['pieces']:.2f}x, {e['markers']:.0f} markers)")
    if "compiler" in only:
        names = {"a": f"3-stage x {args.records} records", "b": f"fork(4) tree step x {args.questions}",
                 "c": f"{args.schemas} distinct JSON schemas"}

        def report(key: str, c: dict) -> None:
            ri, rc = c[f"{key}_interp"], c[f"{key}_compiled"]
            mi, mc = ([sorted(col)[len(col) // 2] for col in zip(*runs)] for runs in (ri, rc))
            pair = {what: sorted(i[j] / k[j] for i, k in zip(ri, rc))[len(ri) // 2]
                    for what, j in (("wall", 0), ("first", 1), ("done", 5))}
            print(f"[compiler {key}] {names[key]}, {len(ri)} alternating pairs, medians: interpreted {mi[0]:.2f}s "
                  f"(first token {mi[1]:.3f}s, first finished gen {mi[5]:.2f}s), compiled {mc[0]:.2f}s (first token "
                  f"{mc[1]:.3f}s, first finished gen {mc[5]:.2f}s); paired medians interpreted / compiled: wall "
                  f"{pair['wall']:.2f}x, first token {pair['first']:.2f}x sooner, first finished gen {pair['done']:.2f}x "
                  f"(first tokens interpreted {', '.join(f'{r[1]:.3f}' for r in ri)}; compiled "
                  f"{', '.join(f'{r[1]:.3f}' for r in rc)}); engine steps {mi[2]} vs {mc[2]}, forward tokens {mi[3]} vs "
                  f"{mc[3]}, forward time {mi[4]:.2f}s vs {mc[4]:.2f}s (interpreted vs compiled)", flush=True)
            if key == "c" and "c_parts" in c:
                print(f"[compiler c] both modes start with the grammar compiler warm and none of their schemas "
                      f"compiled; one fresh schema compiles in {c['c_parts'][0] * 1e3:.0f} ms alone, the first "
                      f"program's prompt from an empty cache, 1 token, takes {c['c_parts'][1] * 1e3:.0f} ms (median "
                      f"of 3): the first output waits on the first schema's compile and that step in both modes "
                      f"(interpreted, the engine compiles the first schema at once and the rest in its pool)",
                      flush=True)

        bench_compiler(on, args.records, args.questions, args.schemas, args.tokens, args.parts, args.rounds, report,
                       args.compiled_first)

if __name__ == "__main__":
    main()
