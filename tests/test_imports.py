"""The import graph of ``src/shardfc``: no circles between modules, no private names across modules,
no imports up the layers.

Every ``import`` / ``from ... import`` of a shardfc module is read with :mod:`ast`, at the top of a
module and inside functions alike (a lazy import that only hides a circle is still a circle). Imports
under ``if TYPE_CHECKING:`` are left out: they never run, they only name types for annotations. A
module's implicit import of its parent packages is not an edge (every submodule would otherwise sit in
a circle with the ``__init__`` that indexes it); an explicit import of a package is.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

SRC = Path(__file__).resolve().parents[1] / "src"

#: (importer, imported module, name) triples of private names allowed across modules, each with why.
#: Empty: keep it so; a name two modules need is public in the module that owns it.
PRIVATE_ALLOWED: Dict[Tuple[str, str, str], str] = {}

#: Packages that must not import from the packages named (the lower layer does not know the upper).
_ABOVE = ("shardfc.cli", "shardfc.train", "shardfc.tools", "shardfc.compat")
LAYERS: Dict[str, Tuple[str, ...]] = {
    # the command line is the top: the library never imports it
    "shardfc.train": ("shardfc.cli",),
    "shardfc.tools": ("shardfc.cli",),
    "shardfc.compat": ("shardfc.cli",),
    "shardfc.data": _ABOVE + ("shardfc.evaluation", "shardfc.head", "shardfc.parallel", "shardfc.checkpoint"),
    "shardfc.head": _ABOVE + ("shardfc.evaluation", "shardfc.data", "shardfc.checkpoint"),
    "shardfc.parallel": _ABOVE + ("shardfc.evaluation", "shardfc.data", "shardfc.head", "shardfc.checkpoint"),
    "shardfc.checkpoint": _ABOVE + ("shardfc.evaluation", "shardfc.data", "shardfc.head"),
    "shardfc.evaluation": _ABOVE,
    # the file gate is the bottom layer: every package that reads a user's file imports it
    "shardfc.files": _ABOVE + ("shardfc.evaluation", "shardfc.data", "shardfc.head", "shardfc.parallel",
                               "shardfc.checkpoint", "shardfc.models", "shardfc.checks", "shardfc.seeding"),
    # the writing side of it, and the commands' progress bar, as low
    "shardfc.outputs": _ABOVE + ("shardfc.evaluation", "shardfc.data", "shardfc.head", "shardfc.parallel",
                                 "shardfc.checkpoint", "shardfc.models", "shardfc.checks", "shardfc.seeding",
                                 "shardfc.files"),
    "shardfc.progress": _ABOVE + ("shardfc.evaluation", "shardfc.data", "shardfc.head", "shardfc.parallel",
                                  "shardfc.checkpoint", "shardfc.models", "shardfc.checks", "shardfc.seeding",
                                  "shardfc.files", "shardfc.outputs"),
}


def _modules(root: Path) -> Dict[str, Tuple[Path, bool]]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skip: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for inner in node.body:
                    skip.update(id(n) for n in ast.walk(inner))
    return skip


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def import_graph(root: Path = SRC):
    """``(edges, private)``: module -> the shardfc modules it imports; and (importer, module, name)
    for every private name (``_x``, not dunder) imported from, or read as an attribute of, another
    shardfc module."""
    modules = _modules(root)
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    private: List[Tuple[str, str, str]] = []
    for module, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        bound: Dict[str, str] = {}  # local name -> the shardfc module it is bound to
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        edges[module].add(alias.name)
                        if alias.asname:
                            bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, is_package, node)
                if base not in modules:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:  # a submodule: the edge goes to it (its package runs anyway)
                        edges[module].add(sub)
                        bound[alias.asname or alias.name] = sub
                    else:
                        edges[module].add(base)
                        if _private(alias.name):
                            private.append((module, base, alias.name))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and _private(node.attr)):
                private.append((module, bound[node.value.id], node.attr))
        edges[module].discard(module)
    return edges, private


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    edges, _ = import_graph()
    found = cycles(edges)
    shown = "\n".join(
        " <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c)
        for c in found
    )
    assert not found, f"import circles (move what both sides need into a third module):\n{shown}"


def test_no_private_names_across_modules():
    _, private = import_graph()
    bad = sorted({p for p in private if p not in PRIVATE_ALLOWED})
    assert not bad, "private names used across modules (make them public where they live):\n" + "\n".join(
        f"{a} uses {b}.{name}" for a, b, name in bad)


def test_no_imports_up_the_layers():
    edges, _ = import_graph()
    bad = [(a, b) for a, targets in edges.items() for b in targets for low, high in LAYERS.items()
           if (a == low or a.startswith(low + ".")) and any(b == h or b.startswith(h + ".") for h in high)]
    assert not bad, "imports up the layers:\n" + "\n".join(f"{a} -> {b}" for a, b in sorted(bad))


def test_the_checker_sees_a_circle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "shardfc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from shardfc.sub.a import f\n")
    (pkg / "sub" / "a.py").write_text("from shardfc.sub.b import g\n\ndef f():\n    return g()\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shardfc.sub.a import f\n\n"
        "def g():\n    from . import c\n    return c._h\n")
    (pkg / "sub" / "c.py").write_text("from ..sub import a\n_h = 1\n")
    edges, private = import_graph(tmp_path)
    assert cycles(edges) == [["shardfc.sub.a", "shardfc.sub.b", "shardfc.sub.c"]]
    assert private == [("shardfc.sub.b", "shardfc.sub.c", "_h")]
    (pkg / "sub" / "c.py").write_text("_h = 1\n")  # the circle through the function is gone; TYPE_CHECKING's never counted
    assert cycles(import_graph(tmp_path)[0]) == []
