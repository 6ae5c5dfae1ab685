"""Speculative decoding (prompt-lookup n-gram drafts) on vs off, side by side in one run, on the
default model: output tokens/s, the speed-up, mean accepted length and verified draft tokens per step,
at several batch sizes on three workloads:

  (a) input-grounded: rewrite / summarise / extract from a given review text (the output copies it);
  (b) JSON-schema extraction of the same texts (jump-forward off in both runs, since it would write
      the forced text itself);
  (c) free chat (little to copy: the case where drafts cost and rarely pay).

Both engines are greedy and give identical outputs (checked here on every run). Each figure is the
best of --repeats runs, on and off alternating (which goes first alternates too), so both see the
same host conditions; "paired med." is the median over repeats of each pair's on/off ratio.

    python benchmarks/speculative.py [--batches 1 8 32 128] [--max-tokens 96] [--repeats 2]
        [--method ngram|draft|mtp] [--draft-layers N | --draft-model PATH] [--model PATH]

--method mtp needs a checkpoint with a multi-token-prediction layer (DeepSeek-V3 family; --model).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from deepinfer import Engine, SamplingParams

DATA = pathlib.Path(__file__).resolve().parents[1] / "examples" / "data" / "reviews.jsonl"
SCHEMA = {
    "type": "object",
    "properties": {
        "product": {"type": "string", "maxLength": 40},
        "sentiment": {"enum": ["positive", "negative", "mixed"]},
        "quote": {"type": "string", "maxLength": 120},
    },
    "required": ["product", "sentiment", "quote"],
    "additionalProperties": False,
}
TASKS = [
    "Rewrite this review in formal English, keeping every detail:\n\n{t}",
    "Repeat the review below word for word, then add one sentence of summary.\n\n{t}",
    "Quote the sentence of this review that says the most about quality, then explain why.\n\n{t}",
]
CHAT = ["Tell me a short story about a {w}.", "What should I cook tonight if I like {w}?",
        "Give me three tips for learning about {w}.", "Write a haiku about {w}."]
WORDS = ["dragon", "tomatoes", "astronomy", "rivers", "bicycles", "jazz", "volcanoes", "tea"]


def workloads(n: int):
    texts = [json.loads(line)["text"] for line in DATA.read_text().splitlines() if line.strip()]
    grounded = [[{"role": "user", "content": TASKS[i % len(TASKS)].format(t=texts[i % len(texts)])}] for i in range(n)]
    extract = [[{"role": "user", "content": "Extract the product, the sentiment and a verbatim quote as JSON:\n\n"
                 + texts[i % len(texts)]}] for i in range(n)]
    chat = [[{"role": "user", "content": CHAT[i % len(CHAT)].format(w=WORDS[i % len(WORDS)])}] for i in range(n)]
    return {"grounded": (grounded, {}), "json": (extract, {"json_schema": SCHEMA}), "chat": (chat, {})}


def run(engine: Engine, prompts, sp: SamplingParams):
    st = engine.stats
    steps0, d0, a0, v0 = st.num_steps, st.draft_tokens, st.accepted_draft_tokens, st.verify_runs
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    steps = st.num_steps - steps0
    runs = st.verify_runs - v0
    acc_len = 1 + (st.accepted_draft_tokens - a0) / runs if runs else 0.0
    return outs, toks / dt, acc_len, (st.draft_tokens - d0) / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--workloads", nargs="+", default=["grounded", "json", "chat"])
    ap.add_argument("--method", choices=["ngram", "draft", "mtp"], default="ngram",
                    help="drafter: prompt lookup, self-drafting with the first --draft-layers layers, or the "
                         "checkpoint's MTP layer")
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--draft-layers", type=int, default=None)
    ap.add_argument("--draft-model", default=None, help="--method draft: a separate draft checkpoint")
    args = ap.parse_args()

    common = dict(model=args.model, kv_cache_memory=1 << 30, jump_forward=False)
    off = Engine(**common)
    extra_on = {}
    if args.method == "draft":
        extra_on = {"draft_model": args.draft_model} if args.draft_model else {"draft_layers": args.draft_layers}
    on = Engine(speculative=args.method, num_speculative_tokens=args.draft, **extra_on, **common)
    for e in (off, on):
        e.generate(["warm up"], SamplingParams(temperature=0, max_tokens=4))
    print(f"method={args.method}  max_tokens={args.max_tokens}  drafts<={args.draft}  best of {args.repeats}")
    print(f"{'workload':>9} {'batch':>6} {'off tok/s':>10} {'on tok/s':>10} {'speed-up':>9} {'acc.len':>8} {'drafts/step':>12}"
          f" {'paired med.':>12}")
    worst = None
    for name in args.workloads:
        for b in args.batches:
            prompts, extra = workloads(b)[name]
            sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, **extra)
            best_off = best_on = 0.0
            paired = []
            for rep in range(args.repeats):
                for e in (off, on):
                    e.reset_prefix_cache()  # both start cold: the same prefill work
                if rep % 2:  # on first every other repeat: neither arm always runs in the other's wake
                    got, r_on, acc_len, per_step = run(on, prompts, sp)
                    ref, r_off, _, _ = run(off, prompts, sp)
                else:
                    ref, r_off, _, _ = run(off, prompts, sp)
                    got, r_on, acc_len, per_step = run(on, prompts, sp)
                if [o.token_ids for o in ref] != [o.token_ids for o in got]:
                    raise SystemExit(f"outputs differ with speculation on ({name}, batch {b}): a bug")
                best_off, best_on = max(best_off, r_off), max(best_on, r_on)
                paired.append(r_on / r_off)
            ratio = best_on / best_off
            worst = ratio if worst is None else min(worst, ratio)
            print(f"{name:>9} {b:>6} {best_off:>10.1f} {best_on:>10.1f} {ratio:>8.2f}x {acc_len:>8.2f} {per_step:>12.1f}"
                  f" {statistics.median(paired):>11.2f}x", flush=True)
    print(f"lowest speed-up: {worst:.2f}x")


if __name__ == "__main__":
    main()
