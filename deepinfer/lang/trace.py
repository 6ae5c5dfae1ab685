"""Tracing: run a program on a recording state to get its `Graph` (see graph.py), without a model.

The program runs on a `TraceState` with example arguments. Appends become nodes; reading a
generated variable returns a placeholder string that may be concatenated or formatted into later
text (recorded as a read of that variable) but breaks the trace when used for anything else
(compared, tested, parsed, indexed): control flow on a generated value is a graph break, as in
torch.compile, and the rest of the program is not traced. Structured values (json_schema /
dtype gens) and joined lists break the trace when read. An exception the program raises ends the
trace as a break too, except the language's own InvalidRequestError (e.g. `select` with no
choices), which is recorded as a check error at its line.

Which node depends on which argument is found by re-tracing with one argument changed at a time
(a marker put before and after a string, +1 on a number, `not` on a bool): nodes that change
depend on it; from the first node whose kind changes on, everything does. Arguments that cannot be
changed this way (lists, dicts, objects) count as read by every node.

A program that performs side effects before its first read of a generated value (printing,
calling a tool) performs them once per trace; tracing runs it 1 + (up to) 2 x its arguments times.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Callable

from deepinfer.errors import InvalidRequestError
from deepinfer.lang.graph import Graph, Node
from deepinfer.lang.ir import Gen, RoleBegin, RoleEnd, Select, Seq, Text, as_expr, flatten

_LANG_DIR = os.path.dirname(os.path.abspath(__file__))
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"  # private-use characters around a placeholder's name
_PERTURB = "\ue002"


class GraphBreak(BaseException):
    """Ends a trace (a BaseException so a program's `except Exception` does not swallow it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.where = _user_line()


class CheckFailure(BaseException):
    """An ahead-of-time check failed while tracing (ends the trace)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error
        self.where = _user_line()


_in_lang: dict[str, bool] = {}  # code file name -> inside deepinfer/lang (abspath per frame cost ~40 us)


def _is_lang(filename: str) -> bool:
    hit = _in_lang.get(filename)
    if hit is None:
        hit = _in_lang[filename] = os.path.dirname(os.path.abspath(filename)) == _LANG_DIR
    return hit


def _user_line() -> tuple[str | None, int | None]:
    """(file, line) of the innermost frame outside deepinfer/lang: the program's own line."""
    f = sys._getframe(1)
    while f is not None and _is_lang(f.f_code.co_filename):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno) if f is not None else (None, None)


def _traceback_line(exc: BaseException) -> tuple[str | None, int | None]:
    """(file, line) of the innermost traceback frame outside deepinfer/lang."""
    found: tuple[str | None, int | None] = (None, None)
    tb = exc.__traceback__
    while tb is not None:
        if not _is_lang(tb.tb_frame.f_code.co_filename):
            found = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _breaker(what: str) -> Callable:
    def method(self, *a: Any, **kw: Any) -> Any:
        raise GraphBreak(f"the program uses generated variable {self.var!r} ({what})")

    return method


class GenRef(str):
    """Placeholder for a generated text value: fine in text, a graph break in control flow."""

    var: str

    def __new__(cls, name: str) -> "GenRef":
        obj = super().__new__(cls, MARK_OPEN + name + MARK_CLOSE)
        obj.var = name
        return obj

    def __add__(self, other: Any) -> Any:
        if isinstance(other, str):
            return str.__str__(self) + other
        return NotImplemented

    def __radd__(self, other: Any) -> Any:
        if isinstance(other, str):
            return other + str.__str__(self)
        return NotImplemented


for _name in dir(str):
    if not _name.startswith("_"):
        setattr(GenRef, _name, _breaker(f".{_name}()"))
for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__len__", "__iter__",
              "__getitem__", "__contains__", "__bool__", "__mul__", "__rmul__", "__int__", "__float__"):
    setattr(GenRef, _name, _breaker(_name))


def refs_in(text: str) -> tuple[str, ...]:
    """Names of the placeholders inside `text`, in order."""
    out, i = [], text.find(MARK_OPEN)
    while i >= 0:
        j = text.find(MARK_CLOSE, i)
        if j < 0:
            break
        out.append(text[i + 1:j])
        i = text.find(MARK_OPEN, j)
    return tuple(out)


class _Recorder:
    """The node list of one trace, shared by a state and its fork children."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.file: str | None = None

    def add(self, kind: str, branch: str, where: tuple | None = None, **fields: Any) -> Node:
        file, line = where or _user_line()
        if self.file is None:
            self.file = file
        node = Node(len(self.nodes), kind, branch, line, **fields)
        self.nodes.append(node)
        return node


class _RoleBlock:
    def __init__(self, state: "TraceState", role: str) -> None:
        self.state, self.role = state, role

    def __enter__(self) -> "TraceState":
        self.state += RoleBegin(self.role)
        return self.state

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.state += RoleEnd(self.role)


class TraceState:
    """Stands in for ProgramState while tracing (same public API; see the module docstring)."""

    def __init__(self, rec: _Recorder, branch: str = "s", parent: "TraceState | None" = None) -> None:
        self._rec, self._branch = rec, branch
        # variable -> (kind: "text" | "value" | "opaque", the value for "value", defining node id)
        self._vars: dict[str, tuple[str, Any, int | None]] = dict(parent._vars) if parent else {}
        self._last_gen: int | None = parent._last_gen if parent else None
        self._pending_reads: list[str] = []
        self._assigned: list[str] = []

    # ------------------------------------------------------------------ appending
    def __iadd__(self, expr: Any) -> "TraceState":
        try:
            leaves = flatten(as_expr(expr))
        except InvalidRequestError as e:
            raise CheckFailure(e) from None
        for leaf in leaves:
            self._record(leaf)
        return self

    def _define(self, name: str | None, kind: str, value: Any, node: Node) -> None:
        if name is not None:
            self._vars[name] = (kind, value, node.id)
            self._assigned.append(name)

    def _deps(self) -> list[int]:
        deps = [self._last_gen] if self._last_gen is not None else []
        for v in self._pending_reads:
            d = self._vars.get(v, (None, None, None))[2]
            if d is not None and d not in deps:
                deps.append(d)
        self._pending_reads = []
        return deps

    def _record(self, leaf: Any) -> None:
        rec, b = self._rec, self._branch
        if isinstance(leaf, Text):
            text = str.__str__(leaf.text)  # a bare placeholder appended as is: its plain text
            reads = refs_in(text)
            for v in reads:
                if v not in self._pending_reads:
                    self._pending_reads.append(v)
            rec.add("text", b, text=text, reads=reads)
        elif isinstance(leaf, RoleBegin):
            rec.add("role_begin", b, text=leaf.role)
        elif isinstance(leaf, RoleEnd):
            rec.add("role_end", b, text=leaf.role)
        elif isinstance(leaf, Gen):
            node = rec.add("gen", b, name=leaf.name, sampling=dict(leaf.sampling), expr=leaf, deps=self._deps())
            structured = any(k in leaf.sampling for k in ("json_schema", "dtype", "json_object")) or leaf.n is not None
            self._define(leaf.name, "opaque" if structured else "text", None, node)
            self._last_gen = node.id
        elif isinstance(leaf, Select):
            node = rec.add("select", b, name=leaf.name, choices=list(leaf.choices), expr=leaf, deps=self._deps())
            self._define(leaf.name, "text", None, node)
            self._last_gen = node.id
        else:  # pragma: no cover - as_expr only builds the kinds above
            raise GraphBreak(f"unknown expression {leaf!r}")

    # ------------------------------------------------------------------ reading
    def __getitem__(self, name: str) -> Any:
        if name not in self._vars:
            # no location in the message: CheckFailure records the program line, and whoever
            # reports the error puts it in front (check_graph: "file, line N: ...")
            raise CheckFailure(InvalidRequestError(
                f"the program reads variable {name!r}, which no earlier gen, select or "
                f"assignment defines (defined: {sorted(self._vars)})"))
        kind, value, _ = self._vars[name]
        self._rec.add("read", self._branch, name=name)
        if kind == "value":
            return value
        if kind == "opaque":
            raise GraphBreak(f"the program reads structured or gathered variable {name!r}")
        return GenRef(name)

    def get_var(self, name: str) -> Any:
        return self[name]

    def __setitem__(self, name: str, value: Any) -> None:
        node = self._rec.add("set", self._branch, name=name)
        self._define(name, "value", value, node)

    def __contains__(self, name: str) -> bool:
        return name in self._vars

    def _break(self, what: str) -> Any:
        raise GraphBreak(f"the program reads {what}")

    def get_meta_info(self, name: str) -> Any:
        return self._break(f"meta info of {name!r}")

    def text(self) -> str:
        return self._break("the state's text")

    def token_ids(self) -> list[int]:
        return self._break("the state's token ids")

    def messages(self) -> list:
        return self._break("the state's messages")

    def variables(self) -> dict:
        return self._break("all variables")

    def text_iter(self, name: str | None = None) -> Any:
        return self._break("streamed text")

    def error(self) -> Any:
        return self._break("the state's error")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise GraphBreak(f"the program uses state attribute {name!r}, which tracing does not model")

    # ------------------------------------------------------------------ roles
    def _role(self, role: str, expr: Any) -> Any:
        if expr is None:
            return _RoleBlock(self, role)
        self += Seq([RoleBegin(role), as_expr(expr), RoleEnd(role)])
        return None

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    # ------------------------------------------------------------------ fork / join
    def fork(self, n: int = 1) -> "TraceForkGroup":
        if not isinstance(n, int) or n < 1:
            raise CheckFailure(InvalidRequestError(f"fork needs an int n >= 1, got {n!r}"))
        self._rec.add("fork", self._branch, text=f"x{n}")
        base = f"{self._branch}.{sum(1 for n_ in self._rec.nodes if n_.kind == 'fork')}"
        kids = []
        for i in range(n):
            kid = TraceState(self._rec, f"{base}.{i}", parent=self)
            kid._pending_reads = list(self._pending_reads)
            kids.append(kid)
        return TraceForkGroup(self, kids)

    def join(self, children: Any, mode: str = "gather") -> None:
        if mode not in ("gather", "concat"):
            raise CheckFailure(InvalidRequestError(f"join mode must be 'gather' or 'concat', got {mode!r}"))
        children = list(children)
        if not all(isinstance(c, TraceState) for c in children):
            raise GraphBreak("join of something other than this program's forks")
        gens = [c._last_gen for c in children if c._last_gen is not None]
        node = self._rec.add("join", self._branch, text=mode, deps=sorted(set(gens)))
        names: list[str] = []
        for c in children:
            for k in c._assigned:
                if k not in names:
                    names.append(k)
        for k in names:
            self._define(k, "opaque", None, node)
        if mode == "concat":
            self._last_gen = node.id  # the joined text is generated
            self._pending_reads.extend(names)

    def copy(self) -> "TraceState":
        return self.fork(1)[0]

    def var_scope(self, name: str) -> Any:
        raise GraphBreak(f"var_scope({name!r}) captures generated text")


class TraceForkGroup(list):
    def __init__(self, parent: TraceState, children: list[TraceState]) -> None:
        super().__init__(children)
        self.parent = parent

    def __iadd__(self, expr: Any) -> "TraceForkGroup":  # type: ignore[override]
        for c in self:
            c += expr
        return self

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            raise GraphBreak(f"the program reads fork variable {key!r}")
        return super().__getitem__(key)

    def join(self, mode: str = "gather") -> None:
        self.parent.join(list(self), mode=mode)


# ---------------------------------------------------------------------- tracing a function
def _run_once(func: Callable, args: tuple, kwargs: dict) -> tuple[list[Node], str | None, Exception | None]:
    """Run `func` on a fresh TraceState: (nodes, file, the check error that ended it or None)."""
    rec = _Recorder()
    st = TraceState(rec)
    error = None
    try:
        func(st, *args, **kwargs)
    except GraphBreak as e:
        rec.add("break", "s", e.where, text=e.reason)
    except CheckFailure as e:
        error = e.error
        rec.add("break", "s", e.where, text=f"check failed: {e.error}")
    except InvalidRequestError as e:  # e.g. select(choices=[]) built by the program: a check error
        error = e
        rec.add("break", "s", _traceback_line(e), text=f"check failed: {e}")
    except Exception as e:  # the program raised on its own: not traced further
        rec.add("break", "s", _traceback_line(e), text=f"the program raised {type(e).__name__}: {e}")
    return rec.nodes, rec.file, error


def _variants(value: Any) -> list[Any]:
    """Changed copies of an argument value, to see which nodes depend on it (see module docstring)."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, str):
        return [_PERTURB + value, value + _PERTURB]
    if isinstance(value, int):
        return [value + 1]
    if isinstance(value, float):
        return [value + 1.0]
    if value is None:
        return []
    return []


def _first_diff(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _mark(node: Node, arg: str, offset: int = 0) -> None:
    node.args.add(arg)
    if node.kind == "text":
        node.arg_offset = offset if node.arg_offset is None else min(node.arg_offset, offset)


class TraceResult:
    """A graph plus the check error that ended its trace (None when there was none)."""

    def __init__(self, graph: Graph, error: Exception | None) -> None:
        self.graph, self.error = graph, error


def trace_function(func: Callable, args: tuple = (), kwargs: dict | None = None) -> TraceResult:
    """Trace `func(s, *args, **kwargs)`; see the module docstring."""
    kwargs = dict(kwargs or {})
    sig = inspect.signature(func)
    params = list(sig.parameters)[1:]
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError as e:
        raise InvalidRequestError(f"cannot trace {getattr(func, '__name__', func)!r} with these arguments: {e}") from e
    nodes, file, error = _run_once(func, args, kwargs)
    graph = Graph(getattr(func, "__name__", "program"), params, nodes, file)
    first = list(sig.parameters)[0]
    for name, value in bound.arguments.items():
        if name == first:
            continue
        variants = _variants(value)
        if not variants:  # cannot be changed: conservatively read by every node
            for node in nodes:
                _mark(node, name)
            continue
        for alt in variants:
            b2 = sig.bind(None, *args, **kwargs)
            b2.arguments[name] = alt
            other, _, _ = _run_once(func, b2.args[1:], b2.kwargs)
            for i, node in enumerate(nodes):
                o = other[i] if i < len(other) else None
                if o is None or o.kind != node.kind or o.branch != node.branch:
                    for later in nodes[i:]:
                        _mark(later, name)
                    graph.shape_args.add(name)
                    break
                if o.signature() != node.signature():
                    _mark(node, name, _first_diff(node.text, o.text))
            if len(other) != len(nodes):
                graph.shape_args.add(name)
    return TraceResult(graph, error)
