"""Lowering of `gen` / `select` to engine requests, and of their outputs back to state updates.

An op is what a state waits on. It lists the requests it needs (`requests()`), receives each
request's incremental outputs from the runtime (`on_output`), and finishes the state when it has
everything. Raising from `on_output` fails the op (the runtime aborts its other requests and
records the error in the state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import ProgramError
from deepinfer.lang.choices import sample_choice

if TYPE_CHECKING:
    from deepinfer.lang.state import ProgramState


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


class Op:
    """Base: bookkeeping the runtime uses (submitted request ids, cancellation)."""

    def __init__(self, state: "ProgramState | None") -> None:
        self.state = state
        self.rids: list[str] = []
        self.cancelled = False

    def requests(self) -> Iterator[tuple[Any, list[int], SamplingParams]]:
        raise NotImplementedError

    def on_output(self, tag: Any, out: RequestOutput) -> None:
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        """Called once when the op cannot complete (submission error, engine error, bug)."""
        st = self.state
        if st is not None and st.current_op is self:
            st.fail(exc)


class GenOp(Op):
    """One generation request; streams deltas into the state when it is streamed."""

    def __init__(self, state: "ProgramState", expr: Any, params: SamplingParams, prompt: list[int]) -> None:
        super().__init__(state)
        self.expr, self.params, self.prompt = expr, params, prompt
        self.streamed = ""

    def requests(self):
        yield None, self.prompt, self.params

    def on_output(self, tag, out):
        if out.delta_text and self.state.streaming:
            self.streamed += out.delta_text
            self.state.stream_delta(self.expr.name, out.delta_text)
        if out.finished:
            _check_finished(f"gen {self.expr.name!r}", out)
            self.state.finish_gen(self, out)


class MultiGenOp(Op):
    """gen(n=k): k requests with the same prompt (seeded ones get seeds seed, seed+1, ...)."""

    def __init__(self, state: "ProgramState", expr: Any, params: list[SamplingParams], prompt: list[int]) -> None:
        super().__init__(state)
        self.expr, self.all_params, self.prompt = expr, params, prompt
        self.params = params[0]
        self.outs: dict[int, RequestOutput] = {}

    def requests(self):
        for i, p in enumerate(self.all_params):
            yield i, self.prompt, p

    def on_output(self, tag, out):
        if not out.finished:
            return
        _check_finished(f"gen {self.expr.name!r} sample {tag}", out)
        self.outs[tag] = out
        if len(self.outs) == len(self.all_params):
            self.state.finish_gen_n(self, [self.outs[i] for i in range(len(self.all_params))])


class SelectOp(Op):
    """Score every choice in one batch of prefill-only requests (plus unconditional ones if needed).

    Request ("c", i): prompt = state ids + choice i's ids, max_tokens=0, prompt_logprobs=0; the
    last len(choice) prompt logprobs are the choice's conditional token logprobs. Request ("u", i):
    [BOS] + choice ids alone, for unconditional_likelihood_normalized.
    """

    def __init__(self, state: "ProgramState", expr: Any, prompt: list[int], choice_ids: list[list[int]],
                 bos_token_id: int | None) -> None:
        super().__init__(state)
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
            return
        _check_finished(f"select {self.expr.name!r}", out)
        self.outs[tag] = out
        if len(self.outs) < self.need:
            return
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
        self.state.finish_select(self, index, meta)


class PrefixOp(Op):
    """The prefill-only request of a batch's shared static prefix; opens the batch's gate when done."""

    def __init__(self, runtime: Any, batch: Any, prompt: list[int]) -> None:
        super().__init__(None)
        self.runtime, self.batch, self.prompt = runtime, batch, prompt

    def requests(self):
        yield None, self.prompt, SamplingParams(max_tokens=0)

    def on_output(self, tag, out):
        if out.finished:
            self.runtime.prefix_done(self.batch)

    def fail(self, exc):
        # sharing is an optimisation: on failure just let the programs' own requests through
        self.runtime.open_gate(self.batch)
