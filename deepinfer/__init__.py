"""DeepInfer: run LLM programs offline, fast and exactly."""

# first: under DEEPINFER_CPU it holds torch's CPU dispatch to the forced level, which only works
# before torch runs its first op (deepinfer_kernels/cpu.py; imports no torch)
import deepinfer_kernels.cpu  # noqa: F401, I001

from deepinfer.engine.outputs import RequestOutput, TokenLogprob
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import (
    DeepInferError,
    GrammarError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    UnsupportedArchitectureError,
)


def __getattr__(name):
    # Engine pulls in torch and the model loader: import it on first use only
    if name == "Engine":
        from deepinfer.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")


__version__ = "0.1.0"

# the program DSL (deepinfer.lang): importing it does not import torch
from deepinfer.lang import (  # noqa: E402
    ProgramCheckError,
    ProgramState,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    gen_int,
    gen_string,
    greedy_token_selection,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
)
