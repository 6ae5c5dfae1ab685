"""Tree search: `fork` a state into branches, let each branch propose an idea, score every branch
with `select`, keep the best and expand it again.

    python examples/tree_search.py
"""

from __future__ import annotations

import deepinfer as di


@di.function
def tree_search(s, task: str, width: int = 3, depth: int = 2):
    """Beam of width 1: each level forks `width` proposals, scores them, continues from the best."""
    s += di.system("You are a creative and practical planner.")
    s += di.user(task)
    s += di.assistant_begin()
    s["path"], s["scores"] = [], []
    for level in range(depth):
        branches = s.fork(width)
        for i, b in enumerate(branches):
            # distinct seeds: the branches explore different continuations
            b += f"Step {level + 1}:" + di.gen("step", max_tokens=20, stop="\n", temperature=0.8,
                                               seed=1000 * level + i)
            b += "\nIs this step useful? Answer yes or no: " + di.select("verdict", ["yes", "no"])
        branches.join()
        # score: how much the model prefers "yes" over "no" for each branch
        scores = []
        for meta in s.get_meta_info("verdict"):
            yes, no = meta["normalized_prompt_logprobs"]
            scores.append(yes - no)
        best = max(range(width), key=scores.__getitem__)
        step = s["step"][best]
        s["path"] = s["path"] + [step.strip()]
        s["scores"] = s["scores"] + [scores]
        s += f"Step {level + 1}:" + step + "\n"
    s += di.assistant_end()


def main(engine=None) -> None:
    """Run the example (on `engine`, else a freshly loaded default model) and print its results."""
    engine = engine if engine is not None else di.Engine(kv_cache_memory=256 << 20)
    tasks = ["Plan a cheap weekend trip to the mountains.", "Plan how to learn to cook in a month."]
    for task, st in zip(tasks, tree_search.run_batch([{"task": t} for t in tasks], backend=engine)):
        print("Task:", task)
        if not st.ok:
            print("   error:", st.error())
            continue
        for level, (step, scores) in enumerate(zip(st["path"], st["scores"]), 1):
            print(f"   step {level} (scores {', '.join(f'{x:+.2f}' for x in scores)}): {step}")


if __name__ == "__main__":
    main()
