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
    draft_tokens: int = 0  # speculative decoding: draft tokens verified
    accepted_draft_tokens: int = 0  # of those, accepted
    verify_runs: int = 0  # (sequence, step) pairs that verified at least one draft
    drafts_proposed: int = 0  # draft tokens the drafter offered (the verify budget admits some)
    drafts_admitted: int = 0
    draft_plans: int = 0  # steps that planned drafts
    schedule_time: float = 0.0  # drafting + scheduling + step planning (the parts below included)
    forward_time: float = 0.0
    sample_time: float = 0.0  # masks + sampling (mask_time included)
    postprocess_time: float = 0.0  # tokens in, stop checks (detokenize_time, mask_prefill_time included)
    grammar_time: float = 0.0
    # parts of the times above, for the host's time by part (benchmarks/host_overhead.py)
    draft_time: float = 0.0  # proposing drafts (of schedule_time)
    prepare_time: float = 0.0  # plan_step + the runner's prepare: the step's inputs (of schedule_time)
    mask_time: float = 0.0  # filling and applying grammar masks while sampling (of sample_time, grammar_time)
    mask_prefill_time: float = 0.0  # overlap mode: next masks filled while a forward runs (of postprocess_time)
    detokenize_time: float = 0.0  # incremental detokenisation of accepted tokens (of postprocess_time)
    grammar_calls: int = 0
    # time a step's sampling waited for the compile of a sequence admitted while it compiled
    grammar_wait_time: float = 0.0
    wait_time: float = 0.0  # time the planning thread waited for a forward pass (overlap mode)
    idle_gap_time: float = 0.0  # time between the end of one forward pass and the start of the next
    first_forward_start: float = 0.0
    last_forward_end: float = 0.0
    weight_bytes: int = 0  # bytes of model weights held in memory (packed copies included)
    checkpoint_bytes: int = 0  # bytes of the checkpoint's weight files
    grammar_step_samples: list = field(default_factory=list)  # grammar seconds per constrained token, per step (last 100k)

    def record_grammar(self, seconds: float, rows: int) -> None:
        """One step's mask fill (StructuredOutputs._masks) over `rows` constrained rows."""
        self.grammar_time += seconds
        self.mask_time += seconds
        self.grammar_calls += rows
        if rows:
            if len(self.grammar_step_samples) >= 100_000:
                del self.grammar_step_samples[:50_000]
            self.grammar_step_samples.append(seconds / rows)

    def record_verify(self, drafted: int, accepted: int) -> None:
        self.draft_tokens += drafted
        self.accepted_draft_tokens += accepted
        self.verify_runs += 1

    def record_draft_plan(self, proposed: int, admitted: int) -> None:
        self.drafts_proposed += proposed
        self.drafts_admitted += admitted
        self.draft_plans += 1

    @property
    def verify_tokens_per_step(self) -> float:
        """Draft tokens the budget admitted per planned step."""
        return self.drafts_admitted / self.draft_plans if self.draft_plans else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verifying (sequence, step): 1 + accepted drafts on average."""
        return 1.0 + self.accepted_draft_tokens / self.verify_runs if self.verify_runs else 0.0

    def record_forward(self, start: float, end: float) -> None:
        """Called once per forward pass (from whichever thread runs it)."""
        if self.last_forward_end:
            self.idle_gap_time += max(0.0, start - self.last_forward_end)
        else:
            self.first_forward_start = start
        self.forward_time += end - start
        self.last_forward_end = end

    @property
    def idle_share(self) -> float:
        """Idle gap between forward passes as a share of the wall time they span."""
        span = self.last_forward_end - self.first_forward_start
        return self.idle_gap_time / span if span > 0 else 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
