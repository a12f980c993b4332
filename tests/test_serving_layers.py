"""The layers of ``mlarope.serving``: every import of every module under
``src/mlarope/serving/`` (module level or inside a function, read with ``ast``, nothing
imported) goes to its own layer or a layer before it, in the order its ``__init__``'s docstring
declares, and no modules import each other in a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = "mlarope.serving"
ROOT = Path(__file__).resolve().parents[1] / "src" / "mlarope" / "serving"


def declared_layers(root: Path) -> list[set[str]]:
    """``formats -> checks -> ... -> __init__`` from the package docstring: one set of names a
    layer (a name is a module, or a subpackage with all its modules)."""
    doc = ast.get_docstring(ast.parse((root / "__init__.py").read_text()))
    found = re.findall(r"Layers: ``([^`]+)``", doc or "")
    assert len(found) == 1, "serving/__init__.py's docstring declares its layers once"
    return [{name.strip() for name in layer.split(",")} for layer in found[0].split("->")]


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package by its dotted name below ``mlarope.serving`` (``""`` for the
    package itself, ``"checks"`` for a subpackage's ``__init__``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _inner(module: str) -> str | None:
    """``mlarope.serving.checks.common`` -> ``checks.common``; None outside the package."""
    if module == PACKAGE:
        return ""
    if module.startswith(PACKAGE + "."):
        return module.removeprefix(PACKAGE + ".")
    return None


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports, anywhere in its code: ``from M
    import n`` imports module ``M.n`` if there is one, else ``M`` (``n`` an attribute of it).
    The packages above an imported module are not counted (Python runs their ``__init__``
    first, whoever imports)."""
    package = (f"{PACKAGE}.{name}" if name else PACKAGE).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            candidates = [
                f"{module}.{alias.name}" if _inner(f"{module}.{alias.name}") in known else module
                for alias in node.names
            ]
        else:
            continue
        targets |= {_inner(c) for c in candidates if _inner(c) in known}
    return targets - {name}


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def _label(name: str) -> str:
    return name or "__init__"


def upward_imports(root: Path) -> list[str]:
    """``"a -> b"`` for each import of a later layer (a module in no layer is an error)."""
    layers = declared_layers(root)

    def layer_of(name: str) -> int:
        top = name.split(".")[0] if name else "__init__"
        for index, layer in enumerate(layers):
            if top in layer:
                return index
        raise AssertionError(
            f"serving module {_label(name)!r} is in no layer of serving/__init__.py's docstring "
            f"('Layers: ...'): declare it there"
        )

    edges = graph(root)
    for name in edges:
        layer_of(name)
    return sorted(
        f"{_label(name)} -> {_label(target)}"
        for name, targets in edges.items()
        for target in targets
        if layer_of(target) > layer_of(name)
    )


def circles(root: Path) -> list[str]:
    """``"a -> b -> a"`` for each import circle a depth-first walk meets."""
    edges = graph(root)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    found = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                found.append(" -> ".join(map(_label, [*path[path.index(target) :], target])))
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_every_import_goes_down():
    assert upward_imports(ROOT) == []


def test_no_import_circle():
    assert circles(ROOT) == []


def test_the_checker_sees_what_it_checks(tmp_path):
    """The reader on a package with a lazy upward import, a circle and a module in no layer:
    each found (the tests above cannot pass by reading nothing)."""
    pkg = tmp_path / "serving"
    (pkg / "checks").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Layers: ``formats -> checks -> api -> __init__``"""\n')
    (pkg / "formats.py").write_text("def f():\n    from .checks import common\n")
    (pkg / "checks" / "__init__.py").write_text("from . import common\n")
    (pkg / "checks" / "common.py").write_text("from ..formats import X\nfrom .. import api\n")
    (pkg / "api.py").write_text("from . import checks\nimport mlarope.serving.formats\n")
    edges = graph(pkg)
    assert edges == {
        "": set(), "formats": {"checks.common"}, "checks": {"checks.common"},
        "checks.common": {"formats", "api"}, "api": {"checks", "formats"},
    }  # fmt: skip
    assert upward_imports(pkg) == ["checks.common -> api", "formats -> checks.common"]
    assert circles(pkg) == [
        "api -> checks -> checks.common -> api",
        "checks.common -> formats -> checks.common",
    ]
    (pkg / "extra.py").write_text("")
    try:
        upward_imports(pkg)
    except AssertionError as e:
        assert "'extra' is in no layer" in str(e)
    else:
        raise AssertionError("a module in no layer went unnoticed")
