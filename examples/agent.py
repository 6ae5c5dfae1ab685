"""An agent-style batch workflow: a ReAct loop whose tool is chosen by `select` and whose tool
arguments are generated under a JSON schema, run over a batch of questions at once.

    python examples/agent.py

Tools: a calculator and a lookup table of facts. The loop's control flow follows the model's
choices; every step's thought/action/arguments/observation is kept in `s["trace"]`.
"""


import operator
from typing import Literal

import msgspec

import deepinfer as di

FACTS = {
    "population of france": "68 million",
    "capital of japan": "Tokyo",
    "height of everest": "8849 meters",
    "speed of light": "299792 km/s",
    "boiling point of water": "100 C",
}
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


class CalcArgs(msgspec.Struct):
    a: float
    op: Literal["+", "-", "*", "/"]
    b: float


class LookupArgs(msgspec.Struct):
    key: Literal[tuple(FACTS)]  # type: ignore[valid-type]  # only keys the table has


def calculator(args: CalcArgs) -> str:
    if args.op == "/" and args.b == 0:
        return "error: division by zero"
    return f"{OPS[args.op](args.a, args.b):g}"


def lookup(args: LookupArgs) -> str:
    return FACTS[args.key]


TOOLS = {"calculator": (CalcArgs, calculator), "lookup": (LookupArgs, lookup)}

FEW_SHOT = """Answer questions with tools. Tools: calculator (arithmetic) and lookup (facts).
Question: What is 12 times 4?
Thought: I need to multiply.
Action: calculator
Arguments: {"a": 12, "op": "*", "b": 4}
Observation: 48
Thought: I have the result.
Action: finish
Answer: 48

Question: What is the capital of Japan?
Thought: I should look it up.
Action: lookup
Arguments: {"key": "capital of japan"}
Observation: Tokyo
Thought: I have the answer.
Action: finish
Answer: Tokyo

"""


@di.function
def react(s, question: str, max_steps: int = 3):
    """ReAct: think, pick a tool with `select`, fill its arguments under its schema, observe."""
    s += FEW_SHOT + "Question: " + question + "\n"
    trace = []
    for _ in range(max_steps):
        s += "Thought:" + di.gen("thought", max_tokens=16, stop="\n") + "\n"
        s += "Action: " + di.select("action", ["calculator", "lookup", "finish"]) + "\n"
        action = s["action"]  # control flow follows the model's choice
        if action == "finish":
            break
        schema, tool = TOOLS[action]
        s += "Arguments: " + di.gen("args", json_schema=schema, max_tokens=40) + "\n"
        observation = tool(s["args"])
        s += "Observation: " + observation + "\n"
        trace.append({"thought": s["thought"].strip(), "action": action,
                      "args": msgspec.to_builtins(s["args"]), "observation": observation})
    s += "Answer:" + di.gen("answer", max_tokens=12, stop="\n")
    s["trace"] = trace


QUESTIONS = [
    "What is 7 plus 35?",
    "How tall is Mount Everest?",
    "What is 144 divided by 12?",
    "What is the population of France?",
]


def main(engine=None) -> None:
    """Run the example (on `engine`, else a freshly loaded default model) and print its results."""
    engine = engine if engine is not None else di.Engine(kv_cache_memory=256 << 20)
    states = react.run_batch([{"question": q} for q in QUESTIONS], backend=engine, temperature=0)
    for q, st in zip(QUESTIONS, states):
        print("Q:", q)
        if not st.ok:
            print("   error:", st.error())
            continue
        for step in st["trace"]:
            print(f"   {step['action']}({step['args']}) -> {step['observation']}")
        print("   answer:", st["answer"].strip())


if __name__ == "__main__":
    main()
