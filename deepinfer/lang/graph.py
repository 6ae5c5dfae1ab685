"""The traced form of a program: IR nodes with their data dependencies, shown as text or Graphviz dot.

`Function.trace(...)` builds a `Graph` (see trace.py). Each node records which arguments its
content depends on (`args`, and for text the first character that does: `arg_offset`) and which
generated variables it reads (`reads`). A node is *static* when it depends on neither: it is the
same in every program of a batch, which is what the prefix plan and the ahead-of-time checks use.
A `break` node marks where the trace stopped (control flow on a generated value); everything
after it runs interpreted only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

# Graphviz fill colours by node class
COLOURS = {"static": "#dddddd", "argument": "#ffe599", "generated": "#b6d7a8", "break": "#ea9999"}


@dataclass(eq=False)
class Node:
    """One traced operation of a program (see the module docstring)."""

    id: int
    kind: str  # text | role_begin | role_end | gen | select | read | set | fork | join | break
    branch: str  # "s" for the program's state, "s.0" for fork child 0, "s.0.1" ...
    line: int | None  # the program source line that appended / read it
    text: str = ""  # text (kind text), role (roles), reason (break)
    name: str | None = None  # variable defined (gen, select, set) or read (read)
    sampling: dict[str, Any] | None = None  # gen: the sampling fields the program set
    choices: list[str] | None = None  # select
    expr: Any = None  # the IR leaf (gen / select)
    reads: tuple[str, ...] = ()  # generated variables the content reads
    args: set[str] = field(default_factory=set)  # arguments the content depends on
    arg_offset: int | None = None  # text: first character that depends on an argument
    deps: list[int] = field(default_factory=list)  # ids of the gen/select nodes it waits for

    def signature(self) -> tuple:
        """What must be equal for two traces' nodes to be the same operation with the same content."""
        return (self.kind, self.branch, self.text, self.name, _stable(self.sampling), tuple(self.choices or ()))

    def category(self, varying: Iterable[str] | None = None) -> str:
        """static / argument / generated / break (arguments outside `varying` count as static)."""
        if self.kind == "break":
            return "break"
        if self.kind in ("gen", "select") or self.reads:
            return "generated"
        args = self.args if varying is None else self.args & set(varying)
        return "argument" if args else "static"


def _stable(x: Any) -> str:
    try:
        return repr(x)
    except Exception:  # a user type with a broken repr
        return f"<{type(x).__name__}>"


@dataclass
class Graph:
    """A traced program: nodes in execution order plus where (and why) the trace stopped."""

    name: str
    arguments: list[str]
    nodes: list[Node] = field(default_factory=list)
    file: str | None = None
    shape_args: set[str] = field(default_factory=set)  # arguments that change which nodes there are

    @property
    def broken(self) -> Node | None:
        """The break node, if the trace stopped before the program's end."""
        return next((n for n in self.nodes if n.kind == "break"), None)

    def gens(self) -> list[Node]:
        return [n for n in self.nodes if n.kind in ("gen", "select")]

    def _label(self, n: Node) -> str:
        if n.kind == "text":
            body = n.text if len(n.text) <= 40 else n.text[:37] + "..."
            return f"text {body!r}"
        if n.kind in ("role_begin", "role_end"):
            return f"{n.kind} {n.text}"
        if n.kind == "gen":
            return f"gen {n.name!r} {n.sampling or {}}"
        if n.kind == "select":
            return f"select {n.name!r} {n.choices}"
        if n.kind == "break":
            return f"break: {n.text}"
        if n.kind in ("fork", "join"):
            return f"{n.kind} {n.text}"
        return f"{n.kind} {n.name!r}"

    def to_text(self, varying: Iterable[str] | None = None) -> str:
        """One line per node: id, branch, category, line, label and dependencies."""
        out = [f"program {self.name}({', '.join(self.arguments)})"
               + (f"  [node count depends on: {', '.join(sorted(self.shape_args))}]" if self.shape_args else "")]
        for n in self.nodes:
            extra = []
            if n.args:
                extra.append("args=" + ",".join(sorted(n.args)))
            if n.reads:
                extra.append("reads=" + ",".join(n.reads))
            if n.deps:
                extra.append("after=" + ",".join(f"#{d}" for d in n.deps))
            line = f"L{n.line}" if n.line else "L?"
            out.append(f"  #{n.id:<3} {n.branch:<6} {n.category(varying):<9} {line:<5} {self._label(n)}"
                       + (f"  [{' '.join(extra)}]" if extra else ""))
        return "\n".join(out)

    def to_dot(self, varying: Iterable[str] | None = None) -> str:
        """Graphviz dot: nodes coloured static / per-argument / generated / break, edges = order and reads."""
        lines = [f'digraph "{self.name}" {{', "  rankdir=TB;", '  node [shape=box, style=filled, fontname="monospace"];']
        last: dict[str, int] = {}
        for n in self.nodes:
            label = self._label(n).replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'  n{n.id} [label="#{n.id} {label}", fillcolor="{COLOURS[n.category(varying)]}"];')
            parent = last.get(n.branch)
            if parent is None and "." in n.branch:
                parent = last.get(n.branch.rsplit(".", 1)[0])
            if parent is not None:
                lines.append(f"  n{parent} -> n{n.id};")
            for d in n.deps:
                if d != parent:
                    lines.append(f'  n{d} -> n{n.id} [style=dashed, color="#38761d"];')
            last[n.branch] = n.id
        lines.append("}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()
