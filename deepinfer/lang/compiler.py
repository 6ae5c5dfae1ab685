"""The passes run on a traced program before its batch starts (see trace.py for the graph).

1. `check_graph`: ahead-of-time checks of every traced gen / select — sampling arguments that
   SamplingParams refuses (unknown names, bad values), constraints that are invalid whatever the
   backend (malformed JSON schema, regex that does not parse or matches nothing), plus what the
   trace itself caught (a read of an undefined variable, `select` without choices). Errors name
   the program line. Needs no model.
2. `constraint_params`: every distinct constrained gen's SamplingParams, for compiling them all
   up front in the engine's compile threads (`plan_batch` starts those compiles: the first
   program's at once, the later programs' once those are done and the engine's first step has
   returned, see EngineBackend.precompile_after).
3. `static_prefix`: the leaves at the start of the program that no varying argument changes
   (the text to prefill once for the whole batch), cut where the first varying argument enters;
   `batch_prefix` continues it by the common start of that argument's values in the batch.

Compiled runs execute exactly as interpreted ones (the program still runs op by op on its real
state); the plan only adds the shared prefill and the early compiles, so results are identical.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import GrammarError, InvalidRequestError
from deepinfer.lang.backend import constraint_key
from deepinfer.lang.graph import Graph, Node
from deepinfer.lang.ir import Expr, RoleBegin, RoleEnd, Text
from deepinfer.lang.trace import TraceResult, _run_once, trace_function


class ProgramCheckError(InvalidRequestError):
    """An ahead-of-time check found an error in a program (the message names the line)."""


def gen_params(node: Node, defaults: dict[str, Any]) -> SamplingParams:
    """The SamplingParams a gen node's request would carry (as ProgramState builds them)."""
    fields = {**defaults, **(node.sampling or {})}
    if getattr(node.expr, "return_logprob", False):
        fields["logprobs"] = fields.get("logprobs") or 0
    return SamplingParams(**fields)


def _check_regex(pattern: str) -> None:
    from deepinfer.grammar.emptiness import regex_is_empty

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            re.compile(pattern)
    except re.error as e:
        raise GrammarError(f"regex {pattern!r} does not parse: {e}") from None
    if regex_is_empty(pattern):
        raise GrammarError(f"regex {pattern!r} matches no string")


def check_node(node: Node, defaults: dict[str, Any]) -> None:
    """Raise the error a gen node's request would fail with (InvalidRequestError / GrammarError)."""
    if node.kind != "gen":
        return
    try:
        params = gen_params(node, defaults)
    except TypeError as e:  # an unknown keyword
        raise InvalidRequestError(f"unknown sampling argument: {e}") from None
    from deepinfer.grammar import spec_from_params
    from deepinfer.grammar.exactness import check_spec

    spec = spec_from_params(regex=params.regex, json_schema=params.json_schema, grammar=params.grammar,
                            choices=params.choices, dtype=params.dtype, json_object=params.json_object)
    if spec is None:
        return
    check_spec(spec)
    if spec.kind == "regex":
        _check_regex(spec.text)


def check_graph(result: TraceResult, defaults: dict[str, Any], varying: set[str] | None = None) -> list[ProgramCheckError]:
    """Every ahead-of-time error of a trace, each naming its program line.

    With `varying` (the arguments that differ across a batch), only errors of nodes that no
    varying argument changes are reported: those would fail every program of the batch.
    """
    errors: list[ProgramCheckError] = []
    where = result.graph.file or result.graph.name
    for node in result.graph.nodes:
        if varying is not None and node.args & varying:
            continue
        if node.kind == "gen":
            try:
                check_node(node, defaults)
            except (InvalidRequestError, GrammarError) as e:
                errors.append(ProgramCheckError(f"{where}, line {node.line}: gen {node.name!r}: {e}"))
        elif node.kind == "break" and result.error is not None:
            errors.append(ProgramCheckError(f"{where}, line {node.line}: {result.error}"))
    return errors


def constraint_params(nodes: list[Node], defaults: dict[str, Any], checked: bool = True) -> list[SamplingParams]:
    """The SamplingParams of every valid constrained gen among `nodes`, one per distinct constraint.

    checked=False skips the ahead-of-time validity checks (check_node): for handing the params to
    Engine.precompile, which refuses a malformed spec itself (that request then fails on its own
    with the same error); the JSON-schema meta-validation was 2/3 of planning 100 distinct schemas."""
    out, seen = [], set()
    for node in nodes:
        if node.kind != "gen":
            continue
        try:
            if checked:
                check_node(node, defaults)
            p = gen_params(node, defaults)
        except Exception:  # its request fails on its own, with the same error
            continue
        if not p.constrained:
            continue
        key = constraint_key(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def static_prefix(graph: Graph, varying: set[str]) -> list[Expr]:
    """The leaves every program of the batch starts with: the root state's text and roles before
    its first gen / select / fork / read, cut at the first character a varying argument changes."""
    return _static_walk(graph, varying)[0]


def _static_walk(graph: Graph, varying: set[str]) -> tuple[list[Expr], Node | None]:
    """static_prefix's leaves, and the text node it was cut in (None: it stopped elsewhere)."""
    leaves: list[Expr] = []
    for node in graph.nodes:
        if node.branch != "s" or node.kind not in ("text", "role_begin", "role_end") or node.reads:
            break
        dep = node.args & varying
        if node.kind == "text":
            if dep:
                cut = node.arg_offset or 0
                if cut:
                    leaves.append(Text(node.text[:cut]))
                return leaves, node
            leaves.append(Text(node.text))
        elif dep:
            break
        else:
            leaves.append(RoleBegin(node.text) if node.kind == "role_begin" else RoleEnd(node.text))
    return leaves, None


def batch_prefix(graph: Graph, varying: set[str], values: dict[str, list[Any]]) -> list[Expr]:
    """The text every program of this batch starts with: `static_prefix`, continued into the first
    varying text by the longest common start of the batch's values of the argument that enters
    there (`values`: argument -> its value in each job, job 0 being the traced one).

    Arguments often share a start ("Plan a one-week project about ..."); the interpreted runtime's
    collected prefix shares it, and a plan cut at the argument left fork(4)'s per-program rest at
    17 tokens, past the scheduler's 16-token sibling deferral, whose cap then throttled admission
    (128 programs, tiny model with SmolLM2's tokenizer: 51 engine steps, interpreted 37; now 37
    with the same forward tokens). Extended only when exactly one varying argument
    enters that text, its values are all strings, and the traced text holds job 0's value verbatim
    at the cut; the runtime still keeps only the tokens the programs' first prompts share."""
    leaves, node = _static_walk(graph, varying)
    if node is None:
        return leaves
    dep = node.args & varying
    vals = values.get(next(iter(dep))) if len(dep) == 1 else None
    cut = node.arg_offset or 0
    if not vals or any(type(v) is not str for v in vals) or not node.text.startswith(vals[0], cut):
        return leaves
    import os.path

    common = os.path.commonprefix(vals)
    if not common:
        return leaves
    if cut:
        leaves[-1] = Text(node.text[:cut] + common)
    else:
        leaves.append(Text(common))
    return leaves


def argument_values(func: Callable, jobs: list[tuple[tuple, dict]], names: set[str]) -> dict[str, list[Any]]:
    """For each argument in `names`, its value in every job (in job order); an argument some job
    does not pass (or a job that does not bind) is left out."""
    import inspect

    out: dict[str, list[Any]] = {n: [] for n in names}
    sig = None
    for args, kwargs in jobs:
        if args:
            if sig is None:
                sig = inspect.signature(func)
            try:
                kwargs = sig.bind_partial(None, *args, **kwargs).arguments
            except TypeError:
                return {}
        for n in list(out):
            if n in kwargs:
                out[n].append(kwargs[n])
            else:
                del out[n]
    return out


def first_prompt(nodes: list[Node]) -> list[Expr]:
    """The root state's text and role leaves before its first gen / select / fork / read."""
    leaves: list[Expr] = []
    for node in nodes:
        if node.branch != "s" or node.kind not in ("text", "role_begin", "role_end") or node.reads:
            break
        if node.kind == "text":
            leaves.append(Text(node.text))
        else:
            leaves.append(RoleBegin(node.text) if node.kind == "role_begin" else RoleEnd(node.text))
    return leaves


def varying_arguments(func: Callable, jobs: list[tuple[tuple, dict]]) -> set[str]:
    """Names of the arguments whose values are not all equal across `jobs`."""
    import inspect

    sig = inspect.signature(func)
    first = list(sig.parameters)[0]
    fast = _varying_keywords(sig, first, jobs)
    if fast is not None:
        return fast
    seen: dict[str, Any] = {}
    varying: set[str] = set()
    for args, kwargs in jobs:
        try:
            bound = sig.bind(None, *args, **kwargs)
        except TypeError:
            continue  # this program fails on its own when it runs
        for name, value in bound.arguments.items():
            if name == first or name in varying:
                continue
            if name not in seen:
                seen[name] = value
            else:
                try:
                    same = bool(seen[name] == value) and type(seen[name]) is type(value)
                except Exception:
                    same = False
                if not same:
                    varying.add(name)
    # an argument some jobs pass and others leave to its default varies too
    names: set[str] | None = None
    for args, kwargs in jobs:
        try:
            have = set(sig.bind_partial(None, *args, **kwargs).arguments)
        except TypeError:  # this program fails on its own when it runs
            continue
        if names is None:
            names = have
        varying |= have ^ names
    return varying


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def _varying_keywords(sig: Any, first: str, jobs: list[tuple[tuple, dict]]) -> set[str] | None:
    """varying_arguments without binding each job (inspect's bind was ~40 us per job, 7 us per gen
    call of the FakeEngine benchmark): the same answer when every job passes keywords only, each
    naming a plain parameter; None otherwise (the caller binds)."""
    params = sig.parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in params.values()):
        return None
    names = set(params) - {first}
    required = {n for n in names if params[n].default is params[n].empty}
    seen: dict[str, Any] = {}
    varying: set[str] = set()
    keys0 = None
    for args, kwargs in jobs:
        if args or not names.issuperset(kwargs):
            return None
        keys0 = kwargs.keys() if keys0 is None else keys0
        if kwargs.keys() != keys0:  # passed by some jobs, left to its default by others
            varying |= kwargs.keys() ^ keys0
        if not required.issubset(kwargs):
            continue  # this program fails on its own when it runs (bind would raise)
        for name, value in kwargs.items():
            if name in varying:
                continue
            if name not in seen:
                seen[name] = value
            elif not _same(seen[name], value):
                varying.add(name)
    return varying


@dataclass
class BatchPlan:
    """What the runtime gets from compiling a batch: the shared prefix and the early compiles."""

    graph: Graph | None = None
    prefix: list[Expr] = field(default_factory=list)
    # the static prefix plus the first prompts of two programs: the runtime prefills the longest
    # common token prefix of their renderings (so no token straddles the static text's end)
    probes: list[list[Expr]] = field(default_factory=list)
    compiles: int = 0  # distinct constraints whose compile was started
    # the later programs' constraints compile after the first step (precompile_after): their requests
    # cannot go in before it, so the runtime runs the first program alone until that step returns
    first_alone: bool = False


def plan_batch(func: Callable, jobs: list[tuple[tuple, dict]], defaults: dict[str, Any], backend: Any,
               share_prefix: bool) -> BatchPlan:
    """Trace the batch's first program and plan the batch (see the module docstring).

    Starts the compile of every distinct constraint of every program through
    `backend.precompile`: from the first trace, plus one plain trace per further program when
    a constrained gen depends on a varying argument (with `precompile_after`, those traces run
    after the engine's first step). Never raises for a program's own errors: those surface in
    that program's state when it runs, exactly as interpreted.
    """
    args, kwargs = jobs[0]
    if len(jobs) == 1:  # one program: nothing varies, so no argument analysis (one trace, not 1 + 2 x args)
        nodes, _, _ = _run_once(func, args, kwargs)
        plan = BatchPlan()
        plan.compiles = sum(bool(backend.precompile(p)) for p in constraint_params(nodes, defaults, checked=False))
        return plan
    try:
        result = trace_function(func, args, kwargs)
    except InvalidRequestError:
        return BatchPlan()
    graph = result.graph
    plan = BatchPlan(graph=graph)
    keys: set[tuple] = set()

    def new(params: list[SamplingParams]) -> list[SamplingParams]:
        out = []
        for p in params:
            key = constraint_key(p)
            if key not in keys:
                keys.add(key)
                out.append(p)
        return out

    # the first program's constraints start compiling at once (while the later programs are traced);
    # the later programs' once those are done and the first step has returned, so the first request's
    # compile and step do not share the CPU with them
    first = new(constraint_params(graph.nodes, defaults, checked=False))
    plan.compiles += sum(bool(backend.precompile(p)) for p in first)
    varying = varying_arguments(func, jobs)
    if share_prefix:
        plan.prefix = batch_prefix(graph, varying, argument_values(func, jobs, varying))
        last, _, _ = _run_once(func, *jobs[-1])
        plan.probes = [plan.prefix, first_prompt(graph.nodes), first_prompt(last)]
    if any(n.kind == "gen" and n.args & varying for n in graph.nodes):
        rest = jobs[1:]

        def later() -> list[SamplingParams]:
            """One plain trace per later program: run after the first step where the backend defers it."""
            out: list[SamplingParams] = []
            for a, k in rest:
                nodes, _, _ = _run_once(func, a, k)
                out += new(constraint_params(nodes, defaults, checked=False))
            return out

        after = getattr(backend, "precompile_after", None)
        if after is not None:
            plan.compiles += after(backend.compile_futures(first), later)
            plan.first_alone = True
        else:
            plan.compiles += sum(bool(backend.precompile(p)) for p in later())
    return plan
