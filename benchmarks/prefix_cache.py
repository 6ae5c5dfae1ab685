"""Radix prefix cache on vs off, side by side, on the default model.

Workloads: few-shot (one ~600-token 5-shot prefix shared by many questions) and multi-turn chat
(conversations whose every turn resends the whole history). Prints the wall-time ratio (off / on)
and the cache hit rate against the ideal: the tokens that could have been reused, i.e. for each
request the longest prefix it shares with anything submitted before it (its own earlier turns
included), less the one token that must be computed.

    python benchmarks/prefix_cache.py [--questions 256] [--conversations 64] [--turns 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from deepinfer import Engine, SamplingParams
from deepinfer.engine.scheduler import common_prefix_len

SHOTS = [
    ("What is the boiling point of water at sea level?", "Water boils at 100 degrees Celsius at sea level, which is 212 degrees Fahrenheit. At higher altitudes the air pressure is lower, so water boils at a lower temperature."),
    ("Who wrote the play Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet in the 1590s. It is a tragedy about two young lovers from feuding families in Verona, and it remains one of his most performed plays."),
    ("What is the largest planet in the solar system?", "Jupiter is the largest planet in the solar system. It is a gas giant with a mass more than twice that of all the other planets combined, and it has dozens of moons."),
    ("How many continents are there on Earth?", "There are seven continents: Africa, Antarctica, Asia, Australia, Europe, North America and South America. Asia is the largest both by area and by population."),
    ("What gas do plants absorb from the air?", "Plants absorb carbon dioxide from the air. During photosynthesis they use sunlight to turn carbon dioxide and water into sugars, releasing oxygen as a by-product."),
]
QUESTIONS = [
    "What is the capital of {}?", "What language is spoken in {}?", "What is the population of {}?",
    "What is a famous dish from {}?",
]
PLACES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Italy", "Egypt", "Peru", "Norway",
          "Spain", "Chile", "Ghana", "Nepal", "Cuba", "Fiji"]


def few_shot_prompts(tok, n: int) -> list[list[int]]:
    prefix = "Answer each question in two or three sentences.\n\n" + "".join(
        f"Question: {q}\nAnswer: {a}\n\n" for q, a in SHOTS * 2
    )
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)].format(PLACES[(i // len(QUESTIONS)) % len(PLACES)]) + f" (#{i})"
        out.append(tok.encode(prefix + f"Question: {q}\nAnswer:"))
    return out


def ideal_reusable(requests: list[list[int]], history: list[list[int]]) -> int:
    """Sum over requests of the longest prefix shared with any earlier request's full tokens."""
    total = 0
    for i, r in enumerate(requests):
        best = max((common_prefix_len(r, h) for h in history[:i]), default=0)
        total += min(best, len(r) - 1)
    return total


def run_few_shot(engine: Engine, n: int, max_tokens: int):
    tok = engine.tokenizer
    prompts = few_shot_prompts(tok, n)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.reset_prefix_cache()
    s0 = engine.stats.cached_prompt_tokens
    t = time.perf_counter()
    outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t
    cached = engine.stats.cached_prompt_tokens - s0
    ideal = ideal_reusable(prompts, [p + o.token_ids for p, o in zip(prompts, outs)])
    return dt, cached, ideal, sum(map(len, prompts)), [o.token_ids for o in outs]


def run_chat(engine: Engine, convs: int, turns: int, max_tokens: int):
    tok = engine.tokenizer
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    histories = [[{"role": "system", "content": "You are a concise travel assistant."}] for _ in range(convs)]
    engine.reset_prefix_cache()
    s0 = engine.stats.cached_prompt_tokens
    requests, fulls, total_prompt = [], [], 0
    t = time.perf_counter()
    for turn in range(turns):
        for c, h in enumerate(histories):
            h.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)].format(PLACES[c % len(PLACES)])})
        prompts = [tok.encode(tok.apply_chat_template(h, add_generation_prompt=True)) for h in histories]
        outs = engine.generate(prompts, sp)
        for h, p, o in zip(histories, prompts, outs):
            h.append({"role": "assistant", "content": o.text})
            requests.append(p)
            fulls.append(p + o.token_ids)
            total_prompt += len(p)
    dt = time.perf_counter() - t
    cached = engine.stats.cached_prompt_tokens - s0
    return dt, cached, ideal_reusable(requests, fulls), total_prompt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=256)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=None, help="KV page size (default: the engine default)")
    args = ap.parse_args()
    opts = {"block_size": args.block_size} if args.block_size else {}
    on = Engine(kv_cache_memory=2 << 30, **opts)
    off = Engine(kv_cache_memory=2 << 30, enable_prefix_caching=False, **opts)
    off.generate(["warm up"], SamplingParams(max_tokens=2))
    on.generate(["warm up"], SamplingParams(max_tokens=2))

    t_on, cached, ideal, total, toks_on = run_few_shot(on, args.questions, args.max_tokens)
    t_off, _, _, _, toks_off = run_few_shot(off, args.questions, args.max_tokens)
    prefix_len = common_prefix_len(*few_shot_prompts(on.tokenizer, 2))
    print(f"few-shot: {args.questions} questions, shared prefix {prefix_len} tokens, {total} prompt tokens")
    print(f"  cache off {t_off:.1f}s  on {t_on:.1f}s  speed-up {t_off / t_on:.2f}x (target >= 3x)")
    print(f"  cached {cached} of {ideal} reusable tokens: {cached / max(ideal, 1):.1%} of ideal (target >= 95%)")
    print(f"  outputs identical on/off: {toks_on == toks_off}")

    c_on, cached, ideal, total = run_chat(on, args.conversations, args.turns, args.max_tokens)
    c_off, _, _, _ = run_chat(off, args.conversations, args.turns, args.max_tokens)
    print(f"multi-turn chat: {args.conversations} conversations x {args.turns} turns, {total} prompt tokens")
    print(f"  cache off {c_off:.1f}s  on {c_on:.1f}s  speed-up {c_off / c_on:.2f}x")
    print(f"  cached {cached} of {ideal} reusable tokens: {cached / max(ideal, 1):.1%} of ideal (target >= 95%)")


if __name__ == "__main__":
    main()
