"""The small interface every grammar backend implements.

A backend compiles a GrammarSpec once (per tokenizer) into a CompiledGrammar; each request gets
its own GrammarMatcher from it. The engine calls, per decode step: `fill_bitmask` (allowed next
tokens into one row of a [B, ceil(V/32)] int32 bitmask, bit t%32 of word t//32 set = allowed),
then `accept_token` with the sampled token. Stop tokens are allowed in the mask exactly when the
matcher `can_terminate()`; accepting one terminates the matcher.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from deepinfer.grammar.spec import GrammarSpec

# Longest forced continuation a matcher reports by default. A grammar can force an endless string
# (`a ::= "x" a`), so every backend bounds the search; the engine passes the request's room instead.
MAX_JUMP_FORWARD_BYTES = 256


class GrammarMatcher(ABC):
    """Per-request matching state over one CompiledGrammar."""

    #: whether rollback(n) is available
    supports_rollback: bool = False

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32, ceil(V/32) words)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted (or nothing more can follow)."""

    @abstractmethod
    def can_terminate(self) -> bool:
        """True when the text so far is a complete match (a stop token would be accepted)."""

    @abstractmethod
    def find_jump_forward_string(self, max_bytes: int = MAX_JUMP_FORWARD_BYTES) -> str:
        """The longest string every valid continuation starts with ("" when none is forced),
        cut at max_bytes bytes; never unbounded, whatever the grammar."""

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        raise NotImplementedError(f"{type(self).__name__} does not support rollback")

    @abstractmethod
    def reset(self) -> None:
        """Back to the initial state."""


class CompiledGrammar(ABC):
    """A spec compiled for one tokenizer; cheap to make matchers from, shareable across threads.

    `warnings`: the backend's own diagnostics from compiling it. `approximated`: the schema
    keywords it does not enforce exactly (set by GrammarCompiler from the backend's keyword table
    and warnings, see deepinfer.grammar.exactness); empty when every accepted output is valid.
    `strict`: the backend compiled the schema in strict mode (undeclared properties and extra
    tuple items forbidden); `narrowed` then names what that narrowing touches, e.g.
    "additionalProperties (strict)": every accepted output is still valid (it does not make the
    grammar inexact), but some valid documents are refused.
    """

    spec: GrammarSpec
    backend_name: str
    warnings: list[str] = []
    approximated: tuple[str, ...] = ()
    strict: bool = False
    narrowed: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return not self.approximated

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the initial state."""


class GrammarBackend(ABC):
    """Compiles specs for one tokenizer vocabulary. Raises GrammarError on a spec it cannot
    compile (invalid or unsupported), naming the problem."""

    name: str

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile one spec."""
