"""Frontend-overhead micro-benchmark: microseconds of runtime work per gen call.

Runs a batch of small chat programs on the instant FakeEngine, so nearly all time is the
frontend (greenlet switches, state updates, tokenisation of appended text, request
bookkeeping). The engine's own time is measured separately and subtracted.
"""

from __future__ import annotations

import time
from typing import Any

from deepinfer.lang.api import assistant, gen, system, user
from deepinfer.lang.function import function
from deepinfer.lang.testing import FakeEngine


class _TimedTokenizer:
    """Forwards to a tokenizer, accumulating the seconds spent in encode / decode."""

    def __init__(self, tokenizer: Any) -> None:
        self._t = tokenizer
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def encode(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self._t.encode(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t

    def decode(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self._t.decode(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t


class _TimedEngine:
    """Forwards to an engine, accumulating the seconds spent inside it, and records every call so
    that `replay_cpu` can measure the engine's own CPU time without the frontend around it."""

    def __init__(self, engine: Any) -> None:
        self._e = engine
        self.tokenizer = _TimedTokenizer(engine.tokenizer)
        self.seconds = 0.0
        self.calls: list[tuple] = []

    def add_request(self, prompt, params, request_id=None):
        self.calls.append(("add", list(prompt), params, request_id))
        t = time.perf_counter()
        try:
            return self._e.add_request(prompt, params, request_id=request_id)
        finally:
            self.seconds += time.perf_counter() - t

    def step(self):
        self.calls.append(("step",))
        t = time.perf_counter()
        try:
            return self._e.step()
        finally:
            self.seconds += time.perf_counter() - t

    def abort(self, rid):
        self.calls.append(("abort", rid))
        return self._e.abort(rid)

    def has_unfinished(self):
        return self._e.has_unfinished()


def replay_cpu(calls: list[tuple], engine: Any) -> float:
    """CPU seconds `engine` takes for the recorded calls alone (same requests, same steps)."""
    c = time.process_time()
    for call in calls:
        if call[0] == "add":
            engine.add_request(call[1], call[2], request_id=call[3])
        elif call[0] == "step":
            engine.step()
        else:
            engine.abort(call[1])
    return time.process_time() - c


@function
def _bench_program(s, i, turns):
    s += system("You are a helpful assistant.")
    for t in range(turns):
        s += user(f"Question {i}.{t}: what is the answer?")
        s += assistant(gen(f"a{t}", max_tokens=8))


def frontend_overhead_us(n_programs: int = 500, gens_per_program: int = 4, max_in_flight: int = 256,
                         tokens_per_step: int = 64) -> dict[str, float]:
    """Run n_programs x gens_per_program gens on the FakeEngine; report us per gen call.

    Returns {"gens", "wall_s", "engine_s", "us_per_gen_total", "us_per_gen_frontend",
    "cpu_us_per_gen_frontend", "us_per_gen_tokenizer"} (frontend = wall minus the time spent inside
    the fake engine; the cpu_ figure is the process's CPU time minus the CPU time the fake engine
    takes to replay the same calls on its own (replay_cpu): on
    a shared machine wall time also counts the other processes' turns on the cores, CPU time does
    not; tokenizer = the frontend's own encode / decode calls into the (pure-Python) fake tokenizer,
    part of the frontend figures: subtract it for a tokenizer-free count).
    """
    engine = _TimedEngine(FakeEngine(tokens_per_step=tokens_per_step))
    batch = [{"i": i, "turns": gens_per_program} for i in range(n_programs)]
    t0, c0 = time.perf_counter(), time.process_time()
    states = _bench_program.run_batch(batch, backend=engine, max_in_flight=max_in_flight, temperature=0.0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    failed = [s.error() for s in states if not s.ok]
    if failed:
        raise RuntimeError(f"benchmark programs failed: {failed[0]!r}")
    gens = n_programs * gens_per_program
    return {
        "gens": float(gens),
        "wall_s": wall,
        "engine_s": engine.seconds,
        "us_per_gen_total": wall / gens * 1e6,
        "us_per_gen_frontend": (wall - engine.seconds) / gens * 1e6,
        "cpu_us_per_gen_frontend": (cpu - replay_cpu(engine.calls, FakeEngine(tokens_per_step=tokens_per_step)))
        / gens * 1e6,
        "us_per_gen_tokenizer": engine.tokenizer.seconds / gens * 1e6,
    }


@function
def _shared_prefix_program(s, system_prompt, question, max_tokens):
    s += system(system_prompt)
    s += user(question)
    s += assistant(gen("answer", max_tokens=max_tokens))


def prefix_sharing_comparison(engine: Any, questions: list[str], system_prompt: str, max_tokens: int = 16,
                              **sampling: Any) -> dict[str, dict[str, float]]:
    """Run the same batch with share_prefix on and off on `engine` (e.g. a real Engine).

    Returns per mode {"wall_s", "cached_tokens", "prompt_tokens"}; the engine's prefix cache is
    reset before each run when it offers `reset_prefix_cache`.
    """
    batch = [{"system_prompt": system_prompt, "question": q, "max_tokens": max_tokens} for q in questions]
    result = {}
    for share in (True, False):
        reset = getattr(engine, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        t0 = time.perf_counter()
        states = _shared_prefix_program.run_batch(batch, backend=engine, share_prefix=share, **sampling)
        wall = time.perf_counter() - t0
        metas = [st.get_meta_info("answer") for st in states if st.ok]
        result["share_prefix" if share else "no_share"] = {
            "wall_s": wall,
            "cached_tokens": float(sum(m["num_cached_tokens"] for m in metas)),
            "prompt_tokens": float(sum(m["prompt_tokens"] for m in metas)),
        }
    return result


if __name__ == "__main__":
    print(frontend_overhead_us())


def encode_cost_us(tokenizer: Any, n_programs: int = 200, turns: int = 4, rounds: int = 5) -> dict[str, float]:
    """Microseconds per pending-text encode of a chat program's gens, the tokenizer called on the
    whole string vs through the backend's SegmentEncoder (token_cache.py), alternated `rounds`
    times on the same strings (best of each); both give the same ids (checked)."""
    from deepinfer.lang.chat_template import analyze_chat_template
    from deepinfer.lang.token_cache import SegmentEncoder

    fmt = analyze_chat_template(tokenizer)
    markup = [*fmt.start.values(), *fmt.prefix.values(), *fmt.suffix.values()]
    texts = []
    for i in range(n_programs):
        for t in range(turns):
            head = fmt.start["system"] + fmt.prefix["system"] + "You are a helpful assistant." + fmt.suffix["system"] \
                if t == 0 else fmt.suffix["assistant"]
            texts.append(head + fmt.prefix["user"] + f"Question {i}.{t}: what is the answer?" + fmt.suffix["user"]
                         + fmt.prefix["assistant"])
    best = {"whole": float("inf"), "pieces": float("inf")}
    for _ in range(rounds):
        t = time.thread_time()
        whole = [tokenizer.encode(x, add_special_tokens=False) for x in texts]
        best["whole"] = min(best["whole"], time.thread_time() - t)
        enc = SegmentEncoder(tokenizer, markup)  # a fresh cache each round (its probes included)
        t = time.thread_time()
        pieces = [enc.encode(x) for x in texts]
        best["pieces"] = min(best["pieces"], time.thread_time() - t)
        if pieces != [list(w) for w in whole]:
            raise RuntimeError("SegmentEncoder ids differ from the whole-string encode")
    return {k: v / len(texts) * 1e6 for k, v in best.items()} | {"markers": float(len(enc.markers))}
