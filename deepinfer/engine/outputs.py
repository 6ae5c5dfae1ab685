"""What the engine hands back: one RequestOutput per request (and per step, incrementally)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of one chosen token, with the top-n alternatives (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """State of one request. `text`/`token_ids` are cumulative; `delta_*` is what this step added.

    finish_reason: None while running, else "stop" (EOS, stop token or stop string, or the
    grammar completed), "length" (max_tokens or context reached; a constrained output may be
    incomplete), "abort" (aborted by the caller) or "error" (see `error`).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    grammar_backend: str | None = None
    num_draft_tokens: int = 0  # speculative decoding: draft tokens the model verified
    num_accepted_draft_tokens: int = 0  # of those, accepted (each saved one decode step)
    #: JSON-schema keywords the grammar only approximated (empty when it is exact), then the
    #: deliberate narrowings of strict mode, marked "(strict)" (e.g. "additionalProperties (strict)":
    #: undeclared keys refused; the output is still always valid)
    grammar_approximated: list[str] = field(default_factory=list)
    #: a finished JSON-schema output: True / False (see `violation`) / None (not checked)
    valid: bool | None = None
    violation: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
