"""The engine's per-request state: tokens, KV blocks, progress, and what to report back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.outputs import TokenLogprob
from deepinfer.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # submission order; preemption victims are the latest arrivals
    rng_seed: int  # seed of this request's sampling draws (its own or derived from the engine seed)
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    prefix_node: Any = None  # radix node locked by this sequence
    num_tree_blocks: int = 0  # leading blocks of block_table owned by the radix tree (not by us)
    kv_pool: int | None = None  # the rank whose KV pool holds its blocks (kv_pools.RankedKV), while it holds any
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    matcher: Any = None  # grammar matcher (deepinfer.grammar), None when unconstrained
    grammar_backend: str | None = None
    grammar: Any = None  # the CompiledGrammar behind matcher (exactness, validation at finish)
    grammar_pending: Any = None  # Future of its grammar while it compiles off the step loop
    valid: bool | None = None  # JSON-schema output validated at finish (None: not checked)
    violation: str | None = None  # the first reason it is not valid
    detok: Any = None  # IncrementalDetokenizer
    text: str = ""
    reported_tokens: int = 0  # output tokens already handed to the caller
    reported_text: int = 0  # chars of text already handed to the caller
    num_preemptions: int = 0
    counted: bool = False  # its cache hit is in the engine stats
    placeholders: list[int] = field(default_factory=list)  # ids of steps whose sample is still pending
    discarded: set[int] = field(default_factory=set)  # ids of steps whose sample must be dropped
    next_mask: Any = None  # grammar bitmask row for the pending sample, filled ahead (overlap mode)
    next_mask_step: int = -1  # the step that bitmask is for
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step, unverified
    draft_key: Any = None  # what the drafts' acceptance is learned under (speculation.DraftConfidence)
    num_draft_tokens: int = 0  # drafts verified by the target so far
    num_accepted_draft_tokens: int = 0  # of those, accepted
    mtp_draft: Any = None  # (num_tokens it is for, token, confidence bucket): mtp_drafter.MtpDrafter

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_span(self, a: int, b: int) -> list[int]:
        """Tokens a .. b-1 of prompt + output, without building all_token_ids."""
        n = len(self.prompt_token_ids)
        if b <= n:
            return self.prompt_token_ids[a:b]
        if a >= n:
            return self.output_token_ids[a - n : b - n]
        return self.prompt_token_ids[a:] + self.output_token_ids[: b - n]

    def token_at(self, i: int) -> int:
        """Token i of prompt + output, without building all_token_ids."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
