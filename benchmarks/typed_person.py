"""Issue 51's typed-Person program: `gen("p", json_schema=Person, max_tokens=48)` with a msgspec
Struct of a str and an int field, N seeded runs through run_batch at the default sampling settings
on the default Engine(); prints how many ended as a valid Person.

    .venv/bin/python benchmarks/typed_person.py [--runs 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec

import deepinfer as di


class Person(msgspec.Struct):
    name: str
    age: int


@di.function
def person(s, seed):
    s += "Describe a person as JSON.\n"
    s += di.gen("p", json_schema=Person, max_tokens=48, seed=seed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args()
    eng = di.Engine()
    t0 = time.perf_counter()
    states = person.run_batch([{"seed": i} for i in range(a.runs)], backend=eng)
    wall = time.perf_counter() - t0
    valid, failures, finish = 0, [], {}
    for i, st in enumerate(states):
        err = st.error()
        if err is None and isinstance(st["p"], Person):
            valid += 1
            r = st.get_meta_info("p")["finish_reason"]
            finish[r] = finish.get(r, 0) + 1
        else:
            failures.append((i, str(err)[:160]))
    res = {"runs": a.runs, "valid": valid, "finish_reasons": finish, "failures": failures[:10], "wall_s": round(wall, 1)}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
