"""Output tokens/s of DeepInfer in each precision (fp32 vs GGUF blocks as stored, or with --model an HF
directory in float32 / bfloat16: bf16 dot products, csrc/gemm_bf16dot.c) vs HF transformers `generate`
and, where their environments exist, llama.cpp and vLLM CPU (bf16 and fp32; `vllm_peer.py`), side by
side, on the default model (or --model: the same model as an HF directory, e.g. DIR/smollm2-hf).

Greedy, EOS ignored, the same ~20-token prompts for all; HF runs the same weights in fp32. Also batch-1
decode speed against the memory roofline (bytes of weights read per token / measured bandwidth).

This VM's speed drifts by 10-20% within minutes (HF's included), so every figure is the best of
`--repeats` runs, every arm in turn and the order reversed every other repeat, and the roofline's
bandwidth probe alternates with the batch-1 decode runs in the same way: both sides of every ratio see
the same conditions. Against vLLM also the paired median (over repeats) of ours-best / vLLM-bf16.
vLLM's start-up and one warm-up call are outside the timing (its workers stay loaded for the run).

    python benchmarks/throughput.py [--batches 1 8 32 128] [--new-tokens 64] [--repeats 2] [--no-hf]
        [--precisions float32 auto quantized bfloat16] [--peers DIR] [--vllm-dtypes bfloat16 float32]
        [--no-llamacpp] [--llamacpp-threads N] [--model DIR]

    python benchmarks/throughput.py --model /work/peers/smollm2-hf --precisions float32 bfloat16 \
        --peers /work/peers --vllm-dtypes bfloat16 --no-hf --no-llamacpp

    python benchmarks/throughput.py --cpu-levels avx512 avx2 generic --batches 1 32 128 \
        --precisions float32 auto quantized --no-llamacpp --vllm-dtypes

With --cpu-levels the whole benchmark runs once per CPU level, each in its own process under
DEEPINFER_CPU=level (and torch held to that level: deepinfer_kernels.cpu.torch_env, so transformers
runs as it would on such a CPU too), one level after the other in this run; then a table of each
level's ratios. A level above this CPU's is refused by name.

llama.cpp gets an explicit thread count (default: every core, like our engine's OpenMP/torch threads),
for both its decode and its prompt batches: llama-cpp-python's own default is half the cores for
decode, which on a 2-core machine compares one llama.cpp thread against two of ours.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch

from common import hf_reference_model, make_prompts, read_bandwidth_gbs, timed, run_on_compute_thread
from vllm_peer import start_vllm

from deepinfer import Engine, SamplingParams


def hf_generate(hf, tokenizer, prompts, new_tokens):
    ids = [tokenizer.encode(p) for p in prompts]
    L = max(map(len, ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (L - len(x)) + x for x in ids])  # left padding
    mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in ids])
    with torch.inference_mode():
        out = hf.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=pad,
        )
    return out.shape[0] * new_tokens


PEER_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
gguf, prompts, n, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=gguf, n_ctx=512, n_batch=512, verbose=False, seed=0, n_threads=threads,
            n_threads_batch=threads)
llm("warm up", max_tokens=2, temperature=0)
t = time.perf_counter()
for p in prompts:  # llama-cpp-python serves one sequence at a time; EOS banned so every run is n tokens
    llm(p, max_tokens=n, temperature=0, logit_bias={llm.token_eos(): -1e9})
print(json.dumps({"tokens": len(prompts) * n, "seconds": time.perf_counter() - t}))
"""


def llamacpp_peer(peers_dir: str | None):
    """The llama.cpp peer's python (DIR/llamacpp, built by ../shared/peers/setup.sh) or None, with why."""
    if not peers_dir:
        return None, "no --peers directory given (DEEPINFER_PEERS unset)"
    py = os.path.join(peers_dir, "llamacpp", "bin", "python")
    if not os.path.exists(py):
        return None, f"{py} not found (build with ../shared/peers/setup.sh {peers_dir} llamacpp: ~40 min on 2 cores)"
    import subprocess

    if subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode != 0:
        return None, f"{py} cannot import llama_cpp (its build did not finish)"
    return py, ""


def run_llamacpp(py: str, gguf: str, prompts: list[str], n: int, threads: int) -> float:
    import json
    import subprocess

    r = subprocess.run([py, "-c", PEER_SCRIPT, gguf, json.dumps(prompts), str(n), str(threads)], capture_output=True, text=True,
                       check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["tokens"] / out["seconds"]


def vllm_rate(peer, ids: list[list[int]], n: int) -> float:
    """Output tokens/s of one vLLM run (LLM.generate only), checking every sequence made n tokens."""
    r = peer.generate(ids, n, ignore_eos=True)
    if sum(r.tokens) != len(ids) * n:
        raise SystemExit(f"vLLM {peer.dtype} made {sum(r.tokens)} tokens, not {len(ids) * n}: EOS was not ignored")
    return len(ids) * n / r.seconds


def batch_arms(engines, hf, tok, peer_py, vllm, prompts, ids, n, sp, llamacpp_threads: int) -> list:
    """(name, run) per system measured at one batch; run() returns output tokens/s."""
    b = len(prompts)

    def ours(e):
        e.reset_prefix_cache()
        _, t = timed(e.generate, ids, sp)
        return b * n / t

    def hf_run():
        toks, t = timed(hf_generate, hf, tok, prompts, n)
        return toks / t

    arms = [(p, lambda e=e: ours(e)) for p, e in engines.items()]
    if hf is not None:
        arms.append(("hf", hf_run))
    if peer_py:
        model = next(iter(engines.values())).model_source
        arms.append(("llama.cpp", lambda: run_llamacpp(peer_py, model, prompts, n, llamacpp_threads)))
    for d, v in vllm.items():
        arms.append(("vllm " + d, lambda v=v: vllm_rate(v, ids, n)))
    return arms


def throughput_table(args, engines, hf, tok, peer_py, vllm, sp) -> tuple[dict[int, float], float]:
    """Per batch: every arm in turn (order reversed every other repeat), best of --repeats each; returns
    ours (the last precision) per batch and the best HF figure."""
    n = args.new_tokens
    engine = engines[args.precisions[-1]]
    print(f"CPU level {engine.cpu}  torch {torch.backends.cpu.get_cpu_capability()}")
    print(f"threads={torch.get_num_threads()}  llama.cpp n_threads={args.llamacpp_threads if peer_py else '-'}  new_tokens={n}  best of {args.repeats}  model={os.path.basename(engine.model_source)}")
    for p, e in engines.items():
        print(f"  dtype={p!r}: precision {e.precision}, KV cache {e.kv_cache_dtype}, resident weights {e.stats.weight_bytes / 1e6:.1f} MB "
              f"= {e.stats.weight_bytes / max(e.stats.checkpoint_bytes, 1):.2f}x the checkpoint's {e.stats.checkpoint_bytes / 1e6:.1f} MB")
    base = args.precisions[0]
    vref = next(iter(vllm), None)  # ratios against vLLM's first dtype (bf16 by default)
    cols = "".join(f" {p + ' tok/s':>22}" for p in args.precisions)
    ratios = "".join(f" {p + '/' + base:>24}" for p in args.precisions[1:])
    vcols = "".join(f" {'vLLM ' + d:>15}" for d in vllm)
    vrat = f" {'ours/vLLM ' + vref:>19} {'paired med.':>12}" if vref else ""
    print(f"{'batch':>6}{cols}{ratios} {'hf tok/s':>10} {'llama.cpp tok/s':>16}{vcols}{vrat}", flush=True)
    ours_at, best_hf, best_ours_v, best_v = {}, 0.0, 0.0, 0.0
    table = args.table = {}  # batch -> best tok/s per arm (the --summary-json line)
    for b in args.batches:
        prompts = make_prompts(b, seed=b)
        ids = [engine.encode_prompt(p) for p in prompts]  # ours and vLLM get the same token ids
        arms = batch_arms(engines, hf, tok, peer_py, vllm, prompts, ids, n, sp, args.llamacpp_threads)
        runs = {name: [] for name, _ in arms}
        for rep in range(args.repeats):
            for name, fn in (arms if rep % 2 == 0 else arms[::-1]):  # neither side always runs first
                runs[name].append(fn())
        best = {name: max(r) for name, r in runs.items()}
        table[b] = best
        ours = {p: best[p] for p in args.precisions}
        ours_at[b] = ours[args.precisions[-1]]
        best_hf = max(best_hf, best.get("hf", 0.0))
        vals = "".join(f" {ours[p]:>22.1f}" for p in args.precisions)
        rs = "".join(f" {ours[p] / ours[base]:>24.2f}" for p in args.precisions[1:])
        vv = "".join(f" {best['vllm ' + d]:>15.1f}" for d in vllm)
        if vref:
            top = max(ours.values())
            paired = [max(runs[p][i] for p in args.precisions) / runs["vllm " + vref][i] for i in range(args.repeats)]
            vv += f" {top / best['vllm ' + vref]:>19.2f} {statistics.median(paired):>11.2f}x"
            best_ours_v, best_v = max(best_ours_v, top), max(best_v, best["vllm " + vref])
        other = "".join(f" {f'{best[k]:.1f}' if k in best else '-':>{w}}" for k, w in (("hf", 10), ("llama.cpp", 16)))
        print(f"{b:>6}{vals}{rs}{other}{vv}", flush=True)
    if vref:
        print(f"best batch: ours {best_ours_v:.1f} tok/s vs vLLM {vref} {best_v:.1f} tok/s -> "
              f"{best_ours_v / best_v:.2f}x (target >= 1.5)")
    return ours_at, best_hf


def run_levels(levels: list[str], argv: list[str]) -> None:
    """This benchmark once per CPU level (a child process each, DEEPINFER_CPU=level), then the ratios per level."""
    import json
    import subprocess

    from deepinfer_kernels import cpu

    here = cpu.info()
    print(f"CPU: {here.model} ({here.arch}), its level {here.detected}; levels run: {', '.join(levels)}", flush=True)
    rows = {}
    for level in levels:
        env = {**os.environ, "DEEPINFER_CPU": level, **cpu.torch_env(level)}
        print(f"\n===== DEEPINFER_CPU={level} =====", flush=True)
        child = subprocess.run([sys.executable, __file__, *argv, "--summary-json"], env=env, stdout=subprocess.PIPE,
                               text=True)
        lines = child.stdout.splitlines()
        print("\n".join(ln for ln in lines if not ln.startswith("SUMMARY ")), flush=True)
        if child.returncode:
            raise SystemExit(f"the {level} run failed (exit {child.returncode})")
        rows[level] = json.loads(next(ln for ln in lines if ln.startswith("SUMMARY "))[8:])
    print("\n===== per level (tok/s, best of the repeats; ratios side by side within each level's run) =====")
    for level, r in rows.items():
        base, precs = r["precisions"][0], r["precisions"]
        print(f"{level} ({r['cpu']}):")
        print(f"  {'batch':>6}" + "".join(f" {p:>10}" for p in precs) + f" {'hf':>8}"
              + "".join(f" {p + '/' + base:>18}" for p in precs[1:])
              + (f" {'quantized/auto':>15}" if {"auto", "quantized"} <= set(precs) else "") + f" {'best/hf':>8}")
        for b, t in r["tok_s"].items():
            hf = t.get("hf")
            line = f"  {b:>6}" + "".join(f" {t[p]:>10.1f}" for p in precs) + f" {hf if hf else '-':>8}"
            line += "".join(f" {t[p] / t[base]:>18.2f}" for p in precs[1:])
            if {"auto", "quantized"} <= set(precs):
                line += f" {t['quantized'] / t['auto']:>15.2f}"
            line += f" {max(t[p] for p in precs) / hf:>8.2f}" if hf else f" {'-':>8}"
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    # engine precisions run side by side (one engine each, alternating): the first is the baseline
    ap.add_argument("--precisions", nargs="+", default=["float32", "auto"],
                    help="Engine(dtype=...) values: float32, auto, quantized, quantized_exact, bfloat16 (on the GGUF: "
                         "bf16 products from 16 rows; on an HF directory: bf16 dot products)")
    ap.add_argument("--model", default=None, help="our engines' model (default: the default model's GGUF); "
                    "an HF directory of the same model runs dtype='bfloat16' as bf16 dot products")
    ap.add_argument("--peers", default=os.environ.get("DEEPINFER_PEERS"),
                    help="directory built by ../shared/peers/setup.sh (llama.cpp from DIR/llamacpp, vLLM from DIR/vllm)")
    ap.add_argument("--vllm-dtypes", nargs="*", default=["bfloat16", "float32"],
                    help="vLLM CPU workers to run (none: skip vLLM); ratios are taken against the first")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--llamacpp-threads", type=int, default=os.cpu_count() or 1,
                    help="llama.cpp's n_threads and n_threads_batch (default: all cores, os.cpu_count())")
    ap.add_argument("--cpu-levels", nargs="+", default=None, choices=["avx512", "avx2", "generic"],
                    help="run everything once per CPU level (DEEPINFER_CPU), each in its own process, then compare")
    ap.add_argument("--summary-json", action="store_true", help=argparse.SUPPRESS)  # (a --cpu-levels child)
    args = ap.parse_args()
    if args.cpu_levels:
        argv, skip = [], False
        for a in sys.argv[1:]:  # the same options, less --cpu-levels and its values
            if a == "--cpu-levels":
                skip = True
            elif skip and a.startswith("--"):
                skip = False
            if not skip:
                argv.append(a)
        return run_levels(args.cpu_levels, argv)
    n = args.new_tokens

    engines = {p: Engine(args.model, kv_cache_memory=1 << 30, dtype=p) for p in args.precisions}
    engine = engines[args.precisions[-1]]
    hf = tok = None
    if not args.no_hf:
        hf, tok = hf_reference_model(args.model)
    peer_py, why = llamacpp_peer(args.peers) if not args.no_llamacpp else (None, "--no-llamacpp")
    print(f"llama.cpp peer: {f'found at {peer_py}, n_threads={args.llamacpp_threads}' if peer_py else 'skipped: ' + why}")
    vllm, why = start_vllm(args.peers, args.vllm_dtypes) if args.vllm_dtypes else ({}, "--vllm-dtypes empty")
    print(f"vLLM CPU peer: {'running ' + ', '.join(vllm) + ' (enforce_eager)' if vllm else 'skipped: ' + why}")
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for e in engines.values():  # warm-up
        e.generate(make_prompts(2, seed=99), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    try:
        ours_at, best_hf = throughput_table(args, engines, hf, tok, peer_py, vllm, sp)
    finally:
        for v in vllm.values():
            v.close()
    if hf is not None:
        print(f"best deepinfer / best hf: {max(ours_at.values()) / best_hf:.2f}  (target >= 1.5)")
    if args.summary_json:
        import json

        from deepinfer_kernels import cpu

        print("SUMMARY " + json.dumps({"cpu": cpu.info().describe(), "precisions": args.precisions,
                                       "tok_s": {str(b): v for b, v in args.table.items()}}), flush=True)

    # batch-1 decode vs the memory roofline
    # a decode step reads every weight once (the resident weights: quantised blocks as stored, or
    # fp32 packed panels), except the embedding table of an untied model (one row); with packed
    # copies only the packed one is read, so count the weights once
    mc = engine.model_config
    weight_bytes = engine.stats.weight_bytes
    if engine.precision == "float32":
        weight_bytes = sum(p.numel() for p in engine.runner.model.parameters()) * 4
    if not mc.tie_word_embeddings:
        per = {"float32": 4, "bfloat16-dot": 2}.get(engine.precision, 1)
        weight_bytes -= mc.vocab_size * mc.hidden_size * per
    prompt = make_prompts(1, seed=7)
    bw = decode = 0.0
    for _ in range(max(args.repeats, 3)):
        bw = max(bw, read_bandwidth_gbs())
        engine.reset_prefix_cache()
        _, t1 = timed(engine.generate, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        engine.reset_prefix_cache()
        _, t2 = timed(engine.generate, prompt, SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
        if t2 > t1:  # else the prefill alone took longer than prefill + n decodes: noise, not a figure
            decode = max(decode, n / (t2 - t1))
    roofline = bw * 1e9 / weight_bytes
    if not decode:
        print("batch-1 decode: not measured (every run's prefill took longer than prefill + decodes: a busy machine)")
        return
    print(
        f"batch-1 decode: {decode:.1f} tok/s; roofline {roofline:.1f} tok/s "
        f"({weight_bytes / 1e6:.0f} MB weights at {bw:.1f} GB/s) -> {decode / roofline:.0%} of roofline (target >= 60%)"
    )


if __name__ == "__main__":
    run_on_compute_thread(main)  # (common.py: one OpenMP thread for engine and reference)
