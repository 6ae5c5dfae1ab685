"""DeepInfer in one screen: a program with a chat turn, a `select` and a JSON-schema `gen`.

    python examples/quickstart.py        (or `make run`)

Runs on the default model (SmolLM2-135M-Instruct, CPU is fine): one run, then a batch.
"""


import time
from typing import Literal

import msgspec

import deepinfer as di


class City(msgspec.Struct):
    name: str
    country: str
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]


@di.function
def travel(s, city: str):
    s += di.system("You are a concise travel guide.")
    s += di.user(f"Describe {city} in one sentence.")
    s += di.assistant(di.gen("description", max_tokens=32, stop="\n"))
    s += di.user(f"Is {city} best visited in spring, summer, autumn or winter?")
    s += di.assistant(di.select("season", ["spring", "summer", "autumn", "winter"]))
    s += di.user(f"Give {city}'s name, country and continent as JSON.")
    s += di.assistant(di.gen("facts", json_schema=City, max_tokens=48))


def main(engine=None) -> None:
    """Run the example (on `engine`, else a freshly loaded default model) and print its results."""
    t0 = time.perf_counter()
    engine = engine if engine is not None else di.Engine(kv_cache_memory=256 << 20)
    di.set_default_backend(engine)
    print(f"model loaded in {time.perf_counter() - t0:.1f}s")

    state = travel.run(city="Paris", temperature=0)
    if not state.ok:
        raise SystemExit(f"program failed: {state.error()}")
    print("description:", state["description"])
    print("season:     ", state["season"])
    print("facts:      ", state["facts"])  # a City instance, decoded from the constrained JSON
    print("chat:       ", [m["role"] for m in state.messages()])

    t1 = time.perf_counter()
    states = travel.run_batch([{"city": c} for c in ("Tokyo", "Cairo", "Lima", "Oslo")], temperature=0)
    for st in states:
        print(f"{st['facts'].name:>8}: {st['season']:<6} {st['facts'].continent}" if st.ok else st.error())
    print(f"batch of {len(states)} programs in {time.perf_counter() - t1:.1f}s")


if __name__ == "__main__":
    main()
