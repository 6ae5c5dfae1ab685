"""Resolve `path/to/file.py:func` (or `package.module:func`) to a program, before any model loads."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

from deepinfer.jobs.errors import JobUsageError
from deepinfer.lang.function import Function


@dataclass(frozen=True)
class ProgramSignature:
    """Which record fields a program takes: its arguments after the state."""

    required: tuple[str, ...]
    optional: tuple[str, ...]
    var_keyword: bool  # def f(s, **kw): every field is passed

    @property
    def names(self) -> tuple[str, ...]:
        return self.required + self.optional


def _load_module(target: str) -> Any:
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise JobUsageError(f"program file {target!r} does not exist")
        name = "deepinfer_job_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise JobUsageError(f"cannot import program file {target!r}")
        module = importlib.util.module_from_spec(spec)
        # the file's folder first on sys.path, so it can import its sibling modules
        if os.path.dirname(path) not in sys.path:
            sys.path.insert(0, os.path.dirname(path))
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise JobUsageError(f"importing {target!r} failed: {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(target)
    except Exception as e:
        raise JobUsageError(f"cannot import module {target!r}: {type(e).__name__}: {e}") from e


def load_program(spec: str) -> Function:
    """The program named by `FILE.py:NAME` or `MODULE:NAME`; a plain function is wrapped.

    Raises JobUsageError naming the problem (missing file, import error, missing name, not a
    program) — all before any model is loaded.
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise JobUsageError(f"program must be given as FILE.py:FUNCTION or MODULE:FUNCTION, got {spec!r}")
    target, name = spec.split(":")
    module = _load_module(target)
    obj = getattr(module, name, None)
    if obj is None:
        have = sorted(k for k, v in vars(module).items() if isinstance(v, Function))
        raise JobUsageError(f"{target!r} has no function {name!r} (programs there: {have or 'none'})")
    if isinstance(obj, Function):
        return obj
    if inspect.isfunction(obj):
        return Function(obj)
    raise JobUsageError(f"{spec!r} is a {type(obj).__name__}, not a @deepinfer.function program")


def program_signature(program: Function) -> ProgramSignature:
    """The record fields `program` takes (the parameters after the state)."""
    params = list(inspect.signature(program.func).parameters.values())[1:]
    required, optional, var_kw = [], [], False
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif p.kind is p.POSITIONAL_ONLY:
            raise JobUsageError(f"program parameter {p.name!r} is positional-only; records pass arguments by name")
        elif p.default is p.empty:
            required.append(p.name)
        else:
            optional.append(p.name)
    return ProgramSignature(tuple(required), tuple(optional), var_kw)
