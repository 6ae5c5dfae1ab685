"""Admission of user input, kept apart from the engine loop: the shape of `generate`'s prompts
argument, and the rule that anything failing while one request is admitted is that request's
typed error, never a batch-wide failure.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any, Callable, TypeVar

from deepinfer.engine.outputs import RequestOutput
from deepinfer.errors import DeepInferError, InvalidRequestError

F = TypeVar("F", bound=Callable[..., Any])


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _is_messages(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(m, dict) for m in x)


def prompt_list(prompts: Any) -> list[Any]:
    """`generate`'s prompts as a list of single prompts.

    One prompt is a string, a non-empty list of token ids (ints only) or a non-empty list of chat
    messages (dicts only). Anything else that is a list/tuple is a batch, and each element is judged
    on its own, so `[42, "text"]` is two prompts (the first invalid), never one misread prompt.
    Deciding from the first element alone once turned such a batch into a single error.
    """
    if isinstance(prompts, str) or _is_token_ids(prompts) or _is_messages(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    if isinstance(prompts, (bytes, bytearray, Mapping)) or not isinstance(prompts, Iterable):
        # one (invalid) prompt: iterating would turn a dict into its keys and bytes into ints
        return [prompts]
    return list(prompts)  # a generator or other iterable of prompts


def error_output(prompt: Any, err: BaseException) -> RequestOutput:
    """The finished error output `generate` returns for a prompt that could not be admitted."""
    ids = list(prompt) if _is_token_ids(prompt) else []
    return RequestOutput(request_id="invalid", prompt_token_ids=ids, finished=True, finish_reason="error",
                         error=f"{type(err).__name__}: {err}")


def typed_admission_errors(fn: F) -> F:
    """Wrap a submission method so that it raises only DeepInferErrors.

    Validation raises typed errors itself; this catches what slips past it (a tokenizer or
    grammar library raising TypeError/RuntimeError/MemoryError on odd input) so one request's
    input can never surface as an untyped exception in a batch loop.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DeepInferError:
            raise
        except Exception as e:  # noqa: BLE001 - see docstring
            raise InvalidRequestError(f"request could not be admitted: {type(e).__name__}: {e}") from e

    return wrapper  # type: ignore[return-value]
