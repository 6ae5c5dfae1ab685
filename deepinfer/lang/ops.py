"""Lowering of `gen` / `select` to engine requests, and of their outputs back to results.

An op is plain data: what its owner (the state that waits on it, or the runtime for a shared
prefix) asked for. It lists the requests it needs (`requests()`) and collects each request's
outputs (`on_output`), which returns the events its owner is to receive: a streamed text delta
(`Streamed`) and, once it has everything, its result (`GenDone`, `GenNDone`, `SelectDone`,
`PrefixDone`). The runtime delivers them (`owner.deliver(event)`); an op never calls its owner, so
this module imports neither the state nor the runtime. Raising from `on_output` fails the op (the
runtime aborts its other requests and tells the owner: `owner.op_failed(op, exc)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import ProgramError
from deepinfer.lang.choices import sample_choice


@dataclass(frozen=True)
class Streamed:
    """A text delta of a streamed gen's variable `name`."""
    name: str | None
    text: str


@dataclass(frozen=True)
class GenDone:
    op: "GenOp"
    out: RequestOutput


@dataclass(frozen=True)
class GenNDone:
    op: "MultiGenOp"
    outs: list[RequestOutput]


@dataclass(frozen=True)
class SelectDone:
    op: "SelectOp"
    index: int
    meta: dict[str, Any]


@dataclass(frozen=True)
class PrefixDone:
    op: "PrefixOp"


def _check_finished(what: str, out: RequestOutput) -> None:
    if out.finish_reason in ("error", "abort"):
        raise ProgramError(f"{what}: engine request {out.request_id} ended with {out.finish_reason}: {out.error}")


# Engines that know `prompt_logprobs_start` serve the context before it from the prefix cache and
# compute logprobs only for the choice tokens; older SamplingParams lack the field.
_HAS_LOGPROBS_START = "prompt_logprobs_start" in getattr(SamplingParams, "__dataclass_fields__", {})


def _scoring_params(context_len: int) -> SamplingParams:
    """Prefill-only request returning the logprobs of the prompt tokens after `context_len`."""
    if _HAS_LOGPROBS_START:
        return SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=context_len)
    return SamplingParams(max_tokens=0, prompt_logprobs=0)


Event = Streamed | GenDone | GenNDone | SelectDone | PrefixDone


class Op:
    """Base: the owner the runtime delivers to, and its bookkeeping (submitted request ids,
    cancellation)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner  # has deliver(event) and op_failed(op, exc); opaque here
        self.rids: list[str] = []
        self.cancelled = False

    def requests(self) -> Iterator[tuple[Any, list[int], SamplingParams]]:
        raise NotImplementedError

    def on_output(self, tag: Any, out: RequestOutput) -> list[Event]:
        raise NotImplementedError


class GenOp(Op):
    """One generation request; its text deltas go out as they come (a streamed state shows them)."""

    def __init__(self, owner: Any, expr: Any, params: SamplingParams, prompt: list[int],
                 streaming: bool = False) -> None:
        super().__init__(owner)
        self.expr, self.params, self.prompt = expr, params, prompt
        self.streaming = streaming
        self.streamed = ""  # the text the Streamed events carried so far

    def requests(self):
        yield None, self.prompt, self.params

    def on_output(self, tag, out):
        events: list[Event] = []
        if out.delta_text and self.streaming:
            self.streamed += out.delta_text
            events.append(Streamed(self.expr.name, out.delta_text))
        if out.finished:
            _check_finished(f"gen {self.expr.name!r}", out)
            events.append(GenDone(self, out))
        return events


class MultiGenOp(Op):
    """gen(n=k): k requests with the same prompt (seeded ones get seeds seed, seed+1, ...)."""

    def __init__(self, owner: Any, expr: Any, params: list[SamplingParams], prompt: list[int]) -> None:
        super().__init__(owner)
        self.expr, self.all_params, self.prompt = expr, params, prompt
        self.params = params[0]
        self.outs: dict[int, RequestOutput] = {}

    def requests(self):
        for i, p in enumerate(self.all_params):
            yield i, self.prompt, p

    def on_output(self, tag, out):
        if not out.finished:
            return []
        _check_finished(f"gen {self.expr.name!r} sample {tag}", out)
        self.outs[tag] = out
        if len(self.outs) < len(self.all_params):
            return []
        return [GenNDone(self, [self.outs[i] for i in range(len(self.all_params))])]


class SelectOp(Op):
    """Score every choice in one batch of prefill-only requests (plus unconditional ones if needed).

    Request ("c", i): prompt = state ids + choice i's ids, max_tokens=0, prompt_logprobs=0; the
    last len(choice) prompt logprobs are the choice's conditional token logprobs. Request ("u", i):
    [BOS] + choice ids alone, for unconditional_likelihood_normalized.
    """

    def __init__(self, owner: Any, expr: Any, prompt: list[int], choice_ids: list[list[int]],
                 bos_token_id: int | None) -> None:
        super().__init__(owner)
        self.expr, self.prompt, self.choice_ids = expr, prompt, choice_ids
        self.bos_token_id = bos_token_id
        self.method = expr.method
        self.outs: dict[Any, RequestOutput] = {}
        self.need = len(choice_ids) * (2 if self.method.needs_unconditional else 1)

    def requests(self):
        params = _scoring_params(len(self.prompt))
        for i, ids in enumerate(self.choice_ids):
            yield ("c", i), self.prompt + ids, params
        if self.method.needs_unconditional:
            head = [self.bos_token_id] if self.bos_token_id is not None else []
            params = _scoring_params(len(head))
            for i, ids in enumerate(self.choice_ids):
                yield ("u", i), head + ids, params

    def _choice_logprobs(self, out: RequestOutput, n: int) -> list[float]:
        lps = out.prompt_logprobs
        if lps is None or len(lps) < n:
            raise ProgramError(f"select {self.expr.name!r}: the engine returned no prompt logprobs")
        # no context before the first token (no BOS): count it as 0, as the scoring methods expect
        return [0.0 if lp is None else float(lp.logprob) for lp in lps[len(lps) - n:]]

    def on_output(self, tag, out):
        if not out.finished:
            return []
        _check_finished(f"select {self.expr.name!r}", out)
        self.outs[tag] = out
        if len(self.outs) < self.need:
            return []
        k = len(self.choice_ids)
        cond = [self._choice_logprobs(self.outs[("c", i)], len(self.choice_ids[i])) for i in range(k)]
        uncond = None
        if self.method.needs_unconditional:
            uncond = [self._choice_logprobs(self.outs[("u", i)], len(self.choice_ids[i])) for i in range(k)]
        index, scores = self.method.decide(cond, uncond)
        if self.expr.temperature > 0:
            index, scores["choice_probs"] = sample_choice(scores[self.method.score_key], self.expr.temperature,
                                                          self.expr.seed)
        meta = {
            "choices": list(self.expr.choices),
            "method": self.method.name,
            "input_token_logprobs": cond,
            "prompt_tokens": len(self.prompt),
            "num_cached_tokens": [self.outs[("c", i)].num_cached_tokens for i in range(k)],
            **scores,
        }
        return [SelectDone(self, index, meta)]


class PrefixOp(Op):
    """The prefill-only request of a batch's shared static prefix (its owner: the runtime, which
    opens the batch's gate when it is done)."""

    def __init__(self, owner: Any, batch: Any, prompt: list[int]) -> None:
        super().__init__(owner)
        self.batch, self.prompt = batch, prompt

    def requests(self):
        yield None, self.prompt, SamplingParams(max_tokens=0)

    def on_output(self, tag, out):
        return [PrefixDone(self)] if out.finished else []
