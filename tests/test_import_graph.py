"""The import graph of `deepinfer/` and `kernels/` (installed as `deepinfer_kernels`) has no circle.

Every import counts: top-level, inside a function (a lazy import hides a loop the file layout
does not show) and under `if TYPE_CHECKING:` (an annotation that needs the other module is a
dependency on it too). An edge goes to the module named: `from a.b import c` is a -> a.b.c when c
is a submodule, else a -> a.b; importing a submodule does not count as importing its parent
packages (Python runs their __init__ first, but they are above, not beside). The graph is read
from the source with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"deepinfer": ROOT / "deepinfer", "deepinfer_kernels": ROOT / "kernels"}


def module_files() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    return mods


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in mods:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in mods else base)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_finder_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_lazy_and_type_checking_imports_are_edges(tmp_path):
    (tmp_path / "pkg").mkdir()
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n"
           "def f():\n    from . import c\n")
    (tmp_path / "pkg" / "a.py").write_text(src)
    mods = {"pkg": tmp_path / "pkg" / "__init__.py", "pkg.a": tmp_path / "pkg" / "a.py",
            "pkg.b": tmp_path / "b.py", "pkg.c": tmp_path / "c.py"}
    assert imports_of("pkg.a", mods["pkg.a"], mods) == {"pkg.b", "pkg.c"}


def test_no_import_circles():
    mods = module_files()
    assert "deepinfer.lang.state" in mods and "deepinfer_kernels.cpu" in mods
    graph = {name: imports_of(name, path, mods) for name, path in mods.items()}
    found = circles(graph)
    assert not found, "import circles (each module list imports itself through the others): " + "; ".join(
        " <-> ".join(c) for c in found)
