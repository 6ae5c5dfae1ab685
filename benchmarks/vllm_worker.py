"""The vLLM CPU side of `vllm_peer.py`: run by the peer environment's own python (it never imports
deepinfer), one process per dtype, kept alive so a benchmark can alternate vLLM runs with ours.

    python vllm_worker.py MODEL_DIR DTYPE EAGER(0|1)

Protocol: one JSON object per line on stdin, one answer per line on the original stdout (every log line
of vLLM and its engine processes goes to stderr). The first answer, {"ready": true}, comes once the model
is loaded and one warm-up generate has run. A request
{"prompts": [[ids...], ...], "max_tokens": n, "ignore_eos": bool, "json_schema": {...} | null}
is answered by {"seconds": ..., "texts": [...], "tokens": [...], "finish": [...]}, where "seconds" times
`LLM.generate` only (greedy; the prefix cache is reset before it, so every run prefills cold).
"""

import json
import os
import sys
import time

# this file's directory (benchmarks/) comes first on sys.path, and its kernels.py would shadow the
# `kernels` package transformers probes for while vLLM imports it
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout, in this process and in the engine processes it spawns
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    model, dtype, eager = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    llm = LLM(model=model, dtype=dtype, enforce_eager=eager, max_model_len=1024, seed=0, disable_log_stats=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        schema = req.get("json_schema")
        sp = SamplingParams(
            temperature=0, max_tokens=req["max_tokens"], ignore_eos=req.get("ignore_eos", False),
            structured_outputs=StructuredOutputsParams(json=schema) if schema is not None else None,
        )
        prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        proto.write(json.dumps({
            "seconds": dt,
            "texts": [o.outputs[0].text for o in outs],
            "tokens": [len(o.outputs[0].token_ids) for o in outs],
            "finish": [o.outputs[0].finish_reason for o in outs],
        }) + "\n")


if __name__ == "__main__":  # vLLM's engine processes are spawned: they re-import this file as __mp_main__
    main()
