"""The `deepinfer` command line. Subcommands: `run` (an offline job over a JSON-lines file).

    deepinfer run examples/extract.py:extract --input records.jsonl --output results.jsonl

Exit status: 0 when every record succeeded, 1 when any failed, 2 for usage errors (bad program
path or options, output file in the way), 130 when interrupted. Usage errors are reported
before the model loads.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

# CLI option -> SamplingParams field, applied as run-level defaults to every gen of the program
_SAMPLING_OPTIONS = {
    "max_tokens": int, "min_tokens": int, "temperature": float, "top_p": float, "top_k": int,
    "min_p": float, "repetition_penalty": float, "frequency_penalty": float, "presence_penalty": float,
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="Run LLM programs offline.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run", help="run a program over a JSON-lines file",
        description="Run PROGRAM (FILE.py:FUNCTION or MODULE:FUNCTION) once per input line; each line's "
                    "fields are the program's arguments. Results (id, variables, error) are appended "
                    "to OUTPUT as records finish.",
    )
    run.add_argument("program", help="FILE.py:FUNCTION or MODULE:FUNCTION (a @deepinfer.function)")
    run.add_argument("--input", "-i", required=True, help="JSON-lines input, one record per line")
    run.add_argument("--output", "-o", required=True, help="JSON-lines results file (appended)")
    run.add_argument("--map", action="append", metavar="OLD=NEW", default=[],
                     help="rename input field OLD to program argument NEW (repeatable)")
    run.add_argument("--field", metavar="NAME", help="pass each whole line as the one argument NAME")
    run.add_argument("--model", "-m", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M)")
    run.add_argument("--kv-cache-memory", type=int, default=None, metavar="MIB", help="KV cache size in MiB")
    run.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                     help="speculative decoding (exact: same output): 'ngram' drafts from the record's own text, "
                          "'draft' from the model's own first layers")
    run.add_argument("--batch-size", "-b", type=int, default=64, help="programs in flight at once (default 64)")
    for name, typ in _SAMPLING_OPTIONS.items():
        run.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=f"default {name} of every gen")
    run.add_argument("--no-complete-within-budget", dest="complete_within_budget", action="store_false",
                     help="let constrained gens run out of max_tokens half-written (default: near max_tokens "
                          "only tokens that still let the output complete are allowed)")
    run.add_argument("--seed", type=int, default=None, help="seed: each record samples from (seed, its id)")
    run.add_argument("--limit", type=int, default=None, help="process only the first N records")
    run.add_argument("--resume", action="store_true", help="continue OUTPUT, skipping records already in it")
    run.add_argument("--ordered", action="store_true", help="write results in input order")
    run.add_argument("--quiet", "-q", action="store_true", help="no progress output")
    run.add_argument("--log-interval", type=float, default=10.0, help="seconds between log lines when not a tty")
    return parser


def _run(args: argparse.Namespace) -> int:
    from deepinfer.jobs import JobOptions, JobUsageError, load_program, run_job, validate_options
    from deepinfer.jobs.records import parse_map

    try:
        program = load_program(args.program)
        opts = JobOptions(
            input=args.input, output=args.output, batch_size=args.batch_size, limit=args.limit,
            resume=args.resume, ordered=args.ordered, seed=args.seed, mapping=parse_map(args.map),
            field=args.field, progress=not args.quiet, log_interval=args.log_interval,
            sampling={k: getattr(args, k) for k in _SAMPLING_OPTIONS if getattr(args, k) is not None}
            | {"complete_within_budget": args.complete_within_budget},  # only constrained gens use it
        )
        validate_options(program, opts)  # everything checkable before the model loads
    except JobUsageError as e:
        print(f"deepinfer run: error: {e}", file=sys.stderr)
        return EXIT_USAGE

    from deepinfer.engine.engine import Engine
    from deepinfer.errors import DeepInferError

    options = {}
    if args.kv_cache_memory is not None:
        options["kv_cache_memory"] = args.kv_cache_memory << 20
    if args.speculative is not None:
        options["speculative"] = args.speculative
    if args.seed is not None:
        options["seed"] = args.seed
    try:
        engine = Engine(args.model, **options)
        summary = run_job(program, opts, engine)
    except JobUsageError as e:
        print(f"deepinfer run: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except DeepInferError as e:  # e.g. ModelLoadError: the job could not start
        print(f"deepinfer run: error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("deepinfer run: interrupted; results so far are in the output (use --resume)", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(summary.line(), file=sys.stderr)
    return EXIT_FAILED if summary.failed else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `deepinfer` console script; returns the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
