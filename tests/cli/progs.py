"""Small programs the CLI tests run as jobs (`tests/cli/progs.py:NAME`)."""

import deepinfer as di


@di.function
def echo(s, text, tag="x"):
    s += "Q: " + text + "\nA:"
    s += di.gen("answer", max_tokens=4)
    s["tag"] = tag


@di.function
def explode(s, text):
    s += "Q: " + text + "\nA:"
    s += di.gen("answer", max_tokens=2)
    if "boom" in text and s["answer"] is not None:  # read first: the answer is kept
        raise ValueError(f"program refused {text!r}")


@di.function
def whole(s, rec):
    s += "Record: " + str(rec.get("text")) + "\nA:"
    s += di.gen("answer", max_tokens=2)
    s["n_fields"] = len(rec)


@di.function
def story(s, text):
    s += "Q: " + text + "\nA:"
    s += di.gen("answer", max_tokens=16, ignore_eos=True)


not_a_program = 42
