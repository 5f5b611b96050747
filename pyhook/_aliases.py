"""The import paths the capture pipeline had before it became one package.

``pyhook.capture``, ``pyhook.store.writer``, ``pyhook.dataset``, ... were modules of their own;
they now live in :mod:`pyhook.pipeline` (``docs/contributing.md`` shows the map). Each old name
is the *same module object* as its new home (not a copy), so ``from pyhook.capture import
Recorder``, ``import pyhook.store.remote`` and ``monkeypatch.setattr(pyhook.dataset, ...)`` keep
working and act on the one module. A finder on ``sys.meta_path`` answers the old names; it is
installed when this module is imported, first thing in ``pyhook/__init__.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

# old name -> where the module lives now
ALIASES: dict[str, str] = {
    "pyhook.source": "pyhook.pipeline.source",
    "pyhook.runner": "pyhook.pipeline.runner",
    "pyhook.capture": "pyhook.pipeline.capture",
    "pyhook._record": "pyhook.pipeline._record",
    "pyhook._record_eager": "pyhook.pipeline._record_eager",
    "pyhook._record_compiled": "pyhook.pipeline._record_compiled",
    "pyhook.annotations": "pyhook.pipeline.annotations",
    "pyhook.dataset": "pyhook.pipeline.dataset",
    "pyhook._ring": "pyhook.pipeline._ring",
    "pyhook.store.format": "pyhook.pipeline.format",
    "pyhook.store.verify": "pyhook.pipeline.verify",
    "pyhook.store.writer": "pyhook.pipeline.writer",
    "pyhook.store.reader": "pyhook.pipeline.reader",
    "pyhook.store.remote": "pyhook.pipeline.transport",
}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module name to the module object at its new home."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in ALIASES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(ALIASES[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module was imported under its own name); the import system set
        ``__spec__`` to the old name's, so it is put back: the module keeps one identity."""
        module.__spec__ = module.__spec__.loader_state  # type: ignore[union-attr]


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


def bind_loaded() -> None:
    """Give every already-imported new module its old name in ``sys.modules`` too, so that
    ``import pyhook.capture`` finds it there and never rebinds ``pyhook.capture`` (the
    function) to the module."""
    for old, new in ALIASES.items():
        if new in sys.modules and old not in sys.modules:
            sys.modules[old] = sys.modules[new]


install()
