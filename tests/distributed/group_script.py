"""Run by test_torchrun_group.py on every rank of a process group (torchrun, or RANK/WORLD_SIZE/
MASTER_* set by hand): deepinfer.distributed.init() + Engine(expert_parallel_size=world).
usage: group_script.py MODEL OUT {generate|kill|die0}   (rank 0 writes OUT, rank r > 0 writes OUT.r)"""

import json
import os
import signal
import sys
import time

from deepinfer import Engine, SamplingParams
from deepinfer.distributed import init
from deepinfer.errors import ExpertParallelConfigError

PROMPTS = ["The quick brown fox", "Hello world! How are you today my", "def add(a, b):\n    return",
           "one two three four five six seven eight nine ten eleven"]
KW = dict(kv_cache_memory=8 << 20, block_size=4, max_num_batched_tokens=24, batch_invariant=True)


def runs(eng):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, ignore_eos=True, seed=11)
    outs = eng.generate(PROMPTS + PROMPTS[:2], [greedy] * len(PROMPTS) + [seeded] * 2)
    return {"tokens": [o.token_ids for o in outs],
            "logprobs": [[t.logprob for t in o.logprobs] for o in outs[: len(PROMPTS)]]}


def main():
    model, out, mode = sys.argv[1:4]
    info = init(timeout_s=20)
    eng = Engine(model, expert_parallel_size=info.world_size, **KW)
    if mode == "die0" and info.rank == 0:  # rank 0 dies hard right after start-up
        eng.step()
        os.kill(os.getpid(), signal.SIGKILL)
    if not eng.is_driver:
        try:
            eng.generate(PROMPTS[:1])
            refused = ""
        except ExpertParallelConfigError as e:
            refused = str(e)
        json.dump({"rank": info.rank, "refused": refused}, open(f"{out}.{info.rank}", "w"))
        return
    if mode == "generate":
        res = runs(eng)
        res["ranks"] = len(eng.runner.pids)
        res["stats"] = [s["tokens"] for s in eng.runner.comm_stats()]
        eng.close()
    else:  # kill rank 1 mid-generation: every request ends with an error naming it
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        ids = [eng.add_request(p, sp) for p in PROMPTS]
        eng.step()
        os.kill(eng.runner.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        outs = eng.step()
        res = {"elapsed": time.monotonic() - t0, "ids": ids,
               "outs": [[o.request_id, o.finish_reason, o.error] for o in outs]}
    json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main()
