"""The package's shape: no import cycle among pyhook's modules (imports inside functions and
under ``TYPE_CHECKING`` count), the pipeline's stages import one way, the tracers stay out of
the pipeline, and every old import path of a moved module is the moved module itself."""

from __future__ import annotations

import ast
import importlib
import os
import sys

import pytest

import pyhook
from pyhook import _aliases

PKG = os.path.dirname(os.path.abspath(pyhook.__file__))


def _modules() -> dict[str, str]:
    mods = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = path
    return mods


def _edges(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the pyhook modules it imports anywhere in its source. ``from pkg import name``
    counts as importing ``pkg.name`` when that is a module, else ``pkg`` itself; the old
    module paths count as their new homes."""

    def canon(name: str) -> str:
        return _aliases.ALIASES.get(name, name)

    edges: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        out: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out.update(canon(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                target = canon(target)
                for a in node.names:
                    sub = canon(f"{target}.{a.name}")
                    out.add(sub if sub in mods else target)
        edges[mod] = {m for m in out if m in mods and m != mod}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), ignoring the edges into
    ``pyhook`` itself (every submodule's import runs the package's ``__init__`` first)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w == "pyhook":
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_pyhooks_modules() -> None:
    cycles = _cycles(_edges(_modules()))
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_finds_a_cycle() -> None:
    # the checker itself: a two-module loop and a lazy back edge are both found
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


TRACERS = {"pyhook.trace", "pyhook.truncate", "pyhook.extend", "pyhook.deephook", "pyhook.flex"}


def test_the_pipeline_imports_no_tracer_and_no_tracer_imports_the_pipeline() -> None:
    edges = _edges(_modules())
    for mod, deps in edges.items():
        if mod.startswith("pyhook.pipeline"):
            assert not deps & TRACERS, f"{mod} imports tracers {deps & TRACERS}"
            assert "pyhook.store" not in deps, f"{mod} imports the pyhook.store facade"
        if mod in TRACERS:
            inner = {d for d in deps if d.startswith("pyhook.pipeline") or d == "pyhook.store"}
            assert not inner, f"{mod} imports the pipeline: {inner}"


def test_the_reader_knows_nothing_of_hooks_or_the_dataset_that_wraps_it() -> None:
    edges = _edges(_modules())

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for d in edges.get(todo.pop(), ()):
                if d not in seen and d != "pyhook":
                    seen.add(d)
                    todo.append(d)
        return seen

    below_reader = reach("pyhook.pipeline.reader")
    assert "pyhook._hooks" not in below_reader
    assert "pyhook.pipeline.dataset" not in below_reader
    assert "pyhook.pipeline.capture" not in below_reader
    # the transport (fsspec I/O) is below the format's checks, never above them
    assert "pyhook.pipeline.verify" not in reach("pyhook.pipeline.transport")


@pytest.mark.parametrize("old", sorted(_aliases.ALIASES))
def test_every_old_import_path_is_the_moved_module(old: str) -> None:
    new = _aliases.ALIASES[old]
    assert importlib.import_module(old) is importlib.import_module(new)
    assert sys.modules[old] is sys.modules[new]
    assert sys.modules[new].__spec__.name == new  # one identity: reload, pickling by name


def test_the_old_names_do_not_shadow_the_public_functions() -> None:
    import pyhook.capture  # noqa: F401 - the old module path

    assert callable(pyhook.capture) and pyhook.capture.__name__ == "capture"
    from pyhook.capture import Recorder

    assert Recorder is pyhook.Recorder
    from pyhook.dataset import CaptureDataset
    from pyhook.store import open_capture

    assert open_capture.__module__ == "pyhook.store"
    assert CaptureDataset.__module__ == "pyhook.pipeline.dataset"
