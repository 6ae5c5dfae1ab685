"""An `Engine` whose runner is the simulated device (simulated_device.py): built from a model's
tokenizer and config as usual (the default model when none is named), with `Engine._make_runner`
giving the stand-in instead of a `ModelRunner` (no weights are packed and no KV cache is allocated)
and `Engine._make_stream_forward` giving the overlapped loop the device's queued launch, as on CUDA.
Everything else (admission, scheduling, KV bookkeeping, step planning, grammar masks, sampling,
output processing, detokenisation) is the real engine's code.

    >>> engine = simulated_engine(step_ms=5, overlap_schedule=True, max_num_seqs=1024)
    >>> engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
"""

from __future__ import annotations

from typing import Any

from deepinfer.engine.engine import Engine
from deepinfer.errors import InvalidRequestError
from deepinfer.testing.simulated_device import SimulatedDevice, SimulatedStream

KV_TOKENS_PER_SEQ = 512  # default KV pool: this many token slots per max_num_seqs (only bookkeeping: no memory)


class SimulatedEngine(Engine):
    """Engine(model, **options) on a simulated device whose every step takes step_ms of wall time.

    device_seed seeds the device's logits pool (the engine's `seed` option still seeds unseeded
    requests' draws); kv_tokens sizes the KV pool the engine manages (default: KV_TOKENS_PER_SEQ per
    max_num_seqs). Runs on CPU tensors only; speculation only as "ngram" (the "draft" and "mtp"
    drafters run the model itself); no expert parallelism."""

    def __init__(self, model: str | None = None, *, step_ms: float = 5.0, device_seed: int = 0, pool_rows: int = 64,
                 kv_tokens: int | None = None, **options: Any):
        options.setdefault("device", "cpu")
        if options["device"] != "cpu":
            raise InvalidRequestError("the simulated device runs on CPU tensors: device must be 'cpu', "
                                      f"got {options['device']!r}")
        if options.get("speculative") not in (None, "ngram"):
            raise InvalidRequestError(f"speculative={options['speculative']!r} needs a model to draft with; "
                                      "the simulated device supports only 'ngram'")
        if options.get("expert_parallel_size", 1) != 1:
            raise InvalidRequestError("the simulated device runs no expert parallelism (expert_parallel_size=1)")
        if step_ms < 0:
            raise InvalidRequestError(f"step_ms must be >= 0, got {step_ms}")
        self._sim_options = dict(step_s=step_ms / 1e3, seed=device_seed, pool_rows=pool_rows, kv_tokens=kv_tokens)
        super().__init__(model, **options)

    @property
    def simulated(self) -> SimulatedDevice:
        return self.runner

    def set_step_ms(self, ms: float) -> None:
        """Change the device's step time T (from the next step on)."""
        if ms < 0:
            raise InvalidRequestError(f"step_ms must be >= 0, got {ms}")
        self.runner.step_s = ms / 1e3

    # ---- the engine's hooks ---------------------------------------------------------------------
    def _make_runner(self, loaded, prec) -> SimulatedDevice:
        o = self._sim_options
        cfg = self.config
        kv_tokens = o["kv_tokens"] or cfg.max_num_seqs * KV_TOKENS_PER_SEQ
        return SimulatedDevice(self.model_config.vocab_size, o["step_s"], max(1, kv_tokens // cfg.block_size),
                               cfg.block_size, seed=o["seed"], pool_rows=o["pool_rows"], rows_hint=cfg.max_num_seqs)

    def _make_stream_forward(self) -> SimulatedStream:
        return SimulatedStream(self.runner, self.stats)


def simulated_engine(step_ms: float = 5.0, model: str | None = None, **options: Any) -> SimulatedEngine:
    """A SimulatedEngine (see there): `model` None loads the default model's tokenizer and config."""
    return SimulatedEngine(model, step_ms=step_ms, **options)
