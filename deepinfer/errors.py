"""Typed errors. Every error a user can cause names the problem and derives from DeepInferError."""


class DeepInferError(Exception):
    """Base class of every error DeepInfer raises on purpose."""


class InvalidRequestError(DeepInferError, ValueError):
    """A request (prompt or sampling parameters) is malformed; raised at submission."""


class UnknownParameterError(InvalidRequestError, TypeError):
    """A keyword names no parameter (e.g. SamplingParams(n=2)). Also a TypeError: that is what
    Python raises for an unexpected keyword argument, so code that caught it keeps working."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens where it matters) does not fit the model's context."""


class ModelLoadError(DeepInferError):
    """A model directory or file is missing, corrupt, or of an unsupported architecture."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture DeepInfer has no implementation for."""


class GrammarError(InvalidRequestError):
    """A regex, JSON schema or grammar is invalid or no backend can compile it."""


class InvalidSpecError(GrammarError):
    """The constraint itself is invalid or admits no output (empty enum, minimum > maximum, ...):
    every backend refuses it; the fallback never hands it to a weaker backend."""


class GrammarBudgetError(GrammarError):
    """A constraint is past a compile budget: its spec's size, the compile's time or its memory.
    `budget` names the budget ("size", "time", "memory") and `option` the EngineConfig option that
    raises it (e.g. "grammar_max_spec_bytes"); the request fails, nothing else does."""

    def __init__(self, message: str, budget: str = "", option: str = ""):
        super().__init__(message)
        self.budget = budget
        self.option = option


class OutOfBlocksError(DeepInferError):
    """The KV-cache block pool cannot satisfy an allocation (the scheduler preempts on this)."""


class ProgramError(DeepInferError):
    """An error raised inside a user's @deepinfer.function program, captured in its state."""


class ExpertParallelConfigError(InvalidRequestError):
    """Expert parallelism cannot be set up as asked (experts do not divide evenly over the ranks, an
    unsupported option combination, a process group that cannot be formed)."""


class DistributedWorkerError(DeepInferError):
    """A worker process of an expert-parallel engine died, hung past the collective timeout or raised;
    `rank` names it. The engine ends: its unfinished requests finish with reason "error"."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
