"""Counters the engine keeps about its own work (read them as `engine.stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field, asdict


@dataclass
class EngineStats:
    num_requests: int = 0
    num_finished: int = 0
    num_steps: int = 0
    num_forward_tokens: int = 0  # tokens that went through the model (prefill + decode + recompute)
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache at first admission
    computed_prompt_tokens: int = 0  # prompt tokens that went through the model (incl. recompute)
    generated_tokens: int = 0  # tokens sampled
    jump_forward_tokens: int = 0  # tokens appended by grammar jump-forward, without a decode step
    num_preemptions: int = 0
    schedule_time: float = 0.0
    forward_time: float = 0.0
    sample_time: float = 0.0
    postprocess_time: float = 0.0
    grammar_time: float = 0.0
    grammar_calls: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
