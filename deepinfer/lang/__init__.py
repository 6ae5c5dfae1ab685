"""The program DSL: `@function` programs of gen/select/roles/fork run as batched engine requests.

See docs/ARCHITECTURE.md ("deepinfer/lang") for the IR and how programs lower to engine requests.
"""

from deepinfer.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from deepinfer.lang.backend import get_default_backend, set_default_backend
from deepinfer.lang.choices import (
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from deepinfer.lang.compiler import ProgramCheckError
from deepinfer.lang.function import Function, function
from deepinfer.lang.graph import Graph
from deepinfer.lang.runtime import get_runtime
from deepinfer.lang.state import ForkGroup, ProgramState

__all__ = [
    "ChoicesMethod", "ForkGroup", "Function", "Graph", "ProgramCheckError", "ProgramState", "gen_int", "gen_string",
    "assistant", "assistant_begin", "assistant_end", "function", "gen", "get_default_backend",
    "get_runtime", "greedy_token_selection", "select", "set_default_backend", "system",
    "system_begin", "system_end", "token_length_normalized", "unconditional_likelihood_normalized",
    "user", "user_begin", "user_end",
]
