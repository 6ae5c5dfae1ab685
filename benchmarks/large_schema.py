"""Issue 51: one request's schema never slows or breaks another's. Two scenarios on a default Engine():

    .venv/bin/python benchmarks/large_schema.py [--props 9000] [--batch-props 18000] [--only a|b] [--json OUT]

a) a schema of --props optional string properties with descriptions (9,000: 1.19 MB, the issue's
   1.17 MB one) is submitted, then at once a `choices` request and a `[0-9]{3}` regex request: seconds
   from each one's submission to its finish, and how the schema's request ended (finish reason,
   valid, error).
b) a fresh engine: a plain prompt in one batch with a --batch-props schema (18,000: 2.38 MB, the
   issue's 2.3 MB one): whether the plain output equals its output alone, how the schema's request
   ended, and the peak RSS of this process and of its largest child (a grammar compile worker).

Run it under a memory limit (`prlimit --as=...`): before issue 51 scenario b grew to 24 GB. Only
defaults are used, so the same script measures the code before the change (PYTHONPATH=<old tree>).
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def wide_schema(n: int) -> dict:
    """An object of n optional string properties, each with a description (~130 bytes each)."""
    return {"type": "object", "properties": {
        f"field_{i:05d}": {"type": "string", "description": f"Optional text field number {i} of the record; "
                                                            "free-form, may be left out entirely."}
        for i in range(n)}}


def _run(eng, started: dict) -> dict:
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = (o, time.perf_counter() - started[o.request_id])
    return done


def _row(o, dt: float) -> dict:
    return {"seconds": round(dt, 2), "finish_reason": o.finish_reason, "valid": getattr(o, "valid", None),
            "error": (o.error or "")[:300] or None, "text": o.text[:80]}


def scenario_a(n: int) -> dict:
    from deepinfer import Engine, SamplingParams

    eng = Engine()
    started = {}
    t = time.perf_counter()
    try:
        big = eng.add_request("Fill in the record as JSON.", SamplingParams(json_schema=wide_schema(n), max_tokens=48))
    except Exception as e:  # refused at submission
        return {"schema": {"seconds": round(time.perf_counter() - t, 2), "raised": f"{type(e).__name__}: {e}"[:300]}}
    started[big] = t
    add_s = time.perf_counter() - t
    t = time.perf_counter()
    yes = eng.add_request("Is the sky blue?", SamplingParams(choices=["yes", "no"], max_tokens=4))
    started[yes] = t
    t = time.perf_counter()
    num = eng.add_request("A three-digit number:", SamplingParams(regex="[0-9]{3}", max_tokens=8))
    started[num] = t
    done = _run(eng, started)
    out = {"schema_bytes": len(json.dumps(wide_schema(n), separators=(",", ":"))), "add_request_s": round(add_s, 2),
           "schema": _row(*done[big]), "choices": _row(*done[yes]), "regex": _row(*done[num])}
    eng.close()
    return out


def scenario_b(n: int) -> dict:
    from deepinfer import Engine, SamplingParams

    eng = Engine()
    plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    started = {}
    t = time.perf_counter()
    p = eng.add_request("The capital of France is", plain)
    started[p] = t
    try:
        big = eng.add_request("Fill in the record as JSON.", SamplingParams(json_schema=wide_schema(n), max_tokens=48))
        started[big] = time.perf_counter()
        raised = None
    except Exception as e:
        big, raised = None, f"{type(e).__name__}: {e}"[:300]
    done = _run(eng, started)
    alone = eng.generate(["The capital of France is"], plain)[0]
    out = {"schema_bytes": len(json.dumps(wide_schema(n), separators=(",", ":"))),
           "plain_unchanged": done[p][0].token_ids == alone.token_ids, "plain": _row(*done[p]),
           "schema": _row(*done[big]) if big else {"raised": raised}}
    eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--props", type=int, default=9000)
    ap.add_argument("--batch-props", type=int, default=18000)
    ap.add_argument("--only", choices=["a", "b"])
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = {}
    if args.only in (None, "a"):
        rows["a"] = scenario_a(args.props)
        print("a:", json.dumps(rows["a"]), flush=True)
    if args.only in (None, "b"):
        rows["b"] = scenario_b(args.batch_props)
        print("b:", json.dumps(rows["b"]), flush=True)
    rows["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    rows["peak_child_rss_gb"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2)
    print(json.dumps({k: rows[k] for k in ("peak_rss_gb", "peak_child_rss_gb")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
