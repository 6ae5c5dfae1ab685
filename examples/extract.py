"""Structured extraction: each product review becomes a typed `Review` (a msgspec.Struct).

Run as an offline job over a JSON-lines file (each line's "text" is the program's argument):

    deepinfer run examples/extract.py:extract --input examples/data/reviews.jsonl \
        --output results.jsonl --temperature 0

or `python examples/extract.py [--limit N]`, which runs that job on the bundled reviews into a
temporary file and prints the results.
"""


from typing import Annotated, Literal

import msgspec

import deepinfer as di


class Review(msgspec.Struct):
    product: Annotated[str, msgspec.Meta(min_length=1, max_length=30)]
    sentiment: Literal["positive", "negative", "mixed"]
    rating: Annotated[int, msgspec.Meta(ge=1, le=5)]
    summary: Annotated[str, msgspec.Meta(min_length=1, max_length=60)]


@di.function
def extract(s, text: str):
    """Fill `s["review"]` with a Review extracted from one review text."""
    s += di.system("You extract facts from product reviews and answer with JSON only.")
    s += di.user(
        "Review: " + text + "\n\nGive the product, the sentiment (positive, negative or mixed), "
        "a rating from 1 to 5 and a one-line summary."
    )
    s += di.assistant(di.gen("review", json_schema=Review, max_tokens=80))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os
    import tempfile

    from deepinfer.cli import main as cli

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=None)
    args = p.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.jsonl")
        cmd = ["run", f"{os.path.abspath(__file__)}:extract", "--input", os.path.join(here, "data", "reviews.jsonl"),
               "--output", out, "--temperature", "0", "--ordered", "--quiet"]
        if args.limit is not None:
            cmd += ["--limit", str(args.limit)]
        rc = cli(cmd)
        with open(out) as f:
            for line in f:
                r = json.loads(line)
                print(r["id"], json.dumps(r.get("variables", {}).get("review")) if r["ok"] else "ERROR " + r["error"])
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
