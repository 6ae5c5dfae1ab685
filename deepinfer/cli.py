"""The `deepinfer` command line. Subcommands: `run` (an offline job over a JSON-lines file) and
`run-batch` (an OpenAI batch file); both also run on a Ray cluster with `--ray`.

    deepinfer run examples/extract.py:extract --input records.jsonl --output results.jsonl
    deepinfer run-batch -i batch.jsonl -o results.jsonl [--ray [ADDRESS] --replicas 2]

Exit status: 0 when every record succeeded, 1 when any failed, 2 for usage errors (bad program
path or options, output file in the way), 130 when interrupted. Usage errors are reported
before the model loads.
"""

from __future__ import annotations

import argparse
import os
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
    run.add_argument("--input", "-i", required=True,
                     help="JSON-lines input, one record per line (with --ray: paths, globs, folders; .parquet too)")
    run.add_argument("--output", "-o", required=True,
                     help="JSON-lines results file (appended; with --ray: a folder of result shards + manifest.json)")
    run.add_argument("--map", action="append", metavar="OLD=NEW", default=[],
                     help="rename input field OLD to program argument NEW (repeatable)")
    run.add_argument("--field", metavar="NAME", help="pass each whole line as the one argument NAME")
    _add_job_args(run)
    batch = sub.add_parser(
        "run-batch", help="run an OpenAI batch file (/v1/chat/completions, /v1/completions)",
        description="Run every request of an OpenAI batch input file; OpenAI batch output lines "
                    "(id, custom_id, response, error) are appended to OUTPUT as requests finish.",
    )
    batch.add_argument("--input", "-i", required=True, help="OpenAI batch input (JSON lines)")
    batch.add_argument("--output", "-o", required=True, help="OpenAI batch output file (appended)")
    _add_job_args(batch)
    return parser


def _add_job_args(run: argparse.ArgumentParser) -> None:
    run.add_argument("--model", "-m", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M)")
    run.add_argument("--kv-cache-memory", type=int, default=None, metavar="MIB", help="KV cache size in MiB")
    run.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16", "quantized", "quantized_exact"],
                     default=None, help="precision (default auto: exact; on CPU 'quantized' (int8 dot products on a "
                                        "GGUF) and 'bfloat16' (bf16 dot products) are the fast, approximate modes)")
    run.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16"], default=None,
                     help="KV cache element type (default auto: bf16 on CPU in the quantized and bfloat16 modes)")
    run.add_argument("--fp8-weights", choices=["auto", "keep", "dequantize"], default=None,
                     help="a block-FP8 checkpoint (DeepSeek-V3's): 'auto' (default) keeps its projections FP8 where "
                          "the FP8 kernels run (CUDA, bf16 / fp16) and dequantises them at load elsewhere; 'keep' "
                          "keeps them FP8 everywhere (a quarter of fp32's bytes, dequantised per call without the "
                          "kernels: slower)")
    run.add_argument("--speculative", choices=["ngram", "draft", "mtp"], default=None,
                     help="speculative decoding (exact: same output): 'ngram' drafts from the record's own text, "
                          "'draft' from the model's own first layers (or --draft-model), 'mtp' from the checkpoint's "
                          "MTP layer (DeepSeek-V3)")
    run.add_argument("--draft-model", default=None, metavar="PATH",
                     help="with --speculative draft: a smaller checkpoint sharing the model's tokenizer drafts")
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
    ray = run.add_argument_group("Ray (pip install 'deepinfer[ray]')")
    ray.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                     help="run on a Ray cluster (ADDRESS, e.g. 'auto' or ray://host:10001; none: a local cluster)")
    ray.add_argument("--replicas", type=int, default=1, help="engine actors (default 1)")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs each actor reserves (default 1)")
    ray.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs each actor reserves (default 0)")


def _engine_options(args: argparse.Namespace) -> dict:
    options = {}
    if args.kv_cache_memory is not None:
        options["kv_cache_memory"] = args.kv_cache_memory << 20
    for name in ("dtype", "kv_cache_dtype", "fp8_weights", "speculative"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.draft_model is not None:
        options["draft_model"] = args.draft_model
    if args.seed is not None:
        options["seed"] = args.seed
    return options


def _run(args: argparse.Namespace) -> int:
    from deepinfer.jobs import JobOptions, JobUsageError, load_program, validate_options
    from deepinfer.jobs.batch_runner import validate_batch_options
    from deepinfer.jobs.records import parse_map

    name = f"deepinfer {args.command}"
    batch = args.command == "run-batch"
    try:
        program = None if batch else load_program(args.program)
        opts = JobOptions(
            input=args.input, output=args.output, batch_size=args.batch_size, limit=args.limit,
            resume=args.resume, ordered=args.ordered, seed=args.seed,
            mapping={} if batch else parse_map(args.map), field=None if batch else args.field,
            progress=not args.quiet, log_interval=args.log_interval,
            sampling={k: getattr(args, k) for k in _SAMPLING_OPTIONS if getattr(args, k) is not None}
            | {"complete_within_budget": args.complete_within_budget},  # only constrained gens use it
        )
        if args.ray is not None:  # input: paths/globs/folders; output: a folder of shards (jobs/ray.py)
            from deepinfer.jobs.ray import RayOptions, require_ray, validate_ray_job

            require_ray()
            ray_opts = RayOptions(address=args.ray or None, replicas=args.replicas,
                                  cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica)
            ray_opts.validate()
            validate_ray_job("batch" if batch else "program", None if batch else args.program, opts, args.model)
        elif batch:
            validate_batch_options(opts)
        else:
            validate_options(program, opts)  # everything checkable before the model loads
    except JobUsageError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return EXIT_USAGE

    from deepinfer.errors import DeepInferError

    options = _engine_options(args)
    try:
        if args.ray is not None:
            from deepinfer.jobs import ray as ray_jobs

            if batch:
                summary = ray_jobs.run_batch_job(opts, args.model, options, ray_opts)
            else:
                summary = ray_jobs.run_job(args.program, opts, args.model, options, ray_opts)
        else:
            from deepinfer.engine.engine import Engine
            from deepinfer.jobs import run_job
            from deepinfer.jobs.batch_runner import run_batch_job

            engine = Engine(args.model, **options)
            if not args.quiet:
                print(f"{name}: {os.path.basename(str(engine.model_source))}, precision {engine.precision}, "
                      f"KV cache {engine.kv_cache_dtype}, CPU level {engine.cpu}", file=sys.stderr)
            summary = run_batch_job(opts, engine, model=args.model) if batch else run_job(program, opts, engine)
    except JobUsageError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except DeepInferError as e:  # e.g. ModelLoadError: the job could not start
        print(f"{name}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{name}: interrupted; results so far are in the output (use --resume)", file=sys.stderr)
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
