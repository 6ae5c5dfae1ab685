"""Program IR: the expression nodes a program appends to its state with `s += expr`.

Expressions are plain data; the state executes them in order (see state.py). `"text" + gen(...)`
builds a `Seq`, so SGLang-style one-liners such as `s += "A:" + di.gen("a", stop="\\n")` work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.errors import InvalidRequestError


class Expr:
    """Base of every program expression; supports `+` with strings and other expressions."""

    def __add__(self, other: Any) -> "Seq":
        return Seq([self, as_expr(other)])

    def __radd__(self, other: Any) -> "Seq":
        return Seq([as_expr(other), self])


@dataclass(eq=False)
class Text(Expr):
    """Literal text appended to the prompt."""

    text: str


@dataclass(eq=False)
class Seq(Expr):
    """Several expressions executed left to right."""

    items: list[Expr] = field(default_factory=list)

    def __add__(self, other: Any) -> "Seq":
        return Seq([*self.items, as_expr(other)])

    def __radd__(self, other: Any) -> "Seq":
        return Seq([as_expr(other), *self.items])


@dataclass(eq=False)
class RoleBegin(Expr):
    """Open a chat turn of `role` (system / user / assistant)."""

    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    """Close the open chat turn of `role`."""

    role: str


@dataclass(eq=False)
class Gen(Expr):
    """Generate text into variable `name` (None: append only).

    `sampling` holds the SamplingParams fields the user set explicitly (None-valued ones removed),
    so run-level defaults can fill the rest.
    """

    name: str | None
    sampling: dict[str, Any]
    return_logprob: bool = False
    n: int | None = None  # SGLang's gen(n=): n samples, the variable is their list
    logprob_text: bool = False  # meta info also holds each token's text


@dataclass(eq=False)
class Select(Expr):
    """Pick one of `choices` by scoring each with the model (see choices.py), store it in `name`."""

    name: str | None
    choices: list[str]
    method: Any  # a ChoicesMethod
    temperature: float = 0.0  # > 0: sample a choice with probabilities softmax(score / temperature)
    seed: int | None = None  # that draw's seed (None: not reproducible)


ROLES = ("system", "user", "assistant")


def as_expr(x: Any) -> Expr:
    """Coerce a str (or an Expr) into an Expr; anything else is a typed error naming the type."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    raise InvalidRequestError(
        f"a program can only append str or deepinfer expressions (gen, select, roles), got {type(x).__name__}"
    )


def flatten(expr: Expr) -> list[Expr]:
    """The leaf expressions of `expr` in execution order."""
    if isinstance(expr, Seq):
        out: list[Expr] = []
        for item in expr.items:
            out.extend(flatten(item))
        return out
    return [expr]
