"""pyhook's PEP 517 build backend: setuptools, compiled against the torch you already have.

A torch extension must be compiled against the torch it will be loaded with. PEP 517 build
isolation (pip's default) builds in a fresh environment holding only ``[build-system]
requires``; listing ``torch`` there makes pip download *another* torch (the newest it may
pick, with its CUDA wheels: gigabytes) and compile against that one, which then does not
match the torch the package is installed next to. So ``torch`` is not a build requirement.
Instead this backend, a thin wrapper around ``setuptools.build_meta``:

1. finds the torch of the environment the package is being installed into. pip runs the
   backend with that environment's interpreter (``sys.executable``) but hides its
   site-packages (a ``sitecustomize`` on ``PYTHONPATH`` plus ``PYTHONNOUSERSITE=1``). A child
   of the same interpreter started without those two variables sees the environment as
   ``python`` does, and reports where torch lives;
2. appends that child's ``sys.path`` entries to the build's ``sys.path``, *after* the build
   environment's own entries (the build environment's setuptools still wins), so that
   ``setup.py`` imports the installed torch and compiles against its headers and libraries;
3. without torch, stops in ``get_requires_for_build_wheel`` / ``prepare_metadata_*`` (before
   pip resolves the ``torch`` dependency, which would download it) with one line saying to
   install torch first. ``PYHOOK_BUILD_NATIVE=0`` builds the pure-Python package instead,
   without torch at build time.

With ``--no-build-isolation`` torch is importable directly and step 1 is skipped. Builders
that run the backend with another interpreter than the target's (``python -m build``, ``uv``
create a separate virtual environment for it) need ``--no-isolation`` /
``--no-build-isolation``, or ``PYHOOK_TORCH_PYTHON=/path/to/target/python``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from setuptools import build_meta as _orig

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

# sdists never need torch.
build_sdist = _orig.build_sdist
get_requires_for_build_sdist = _orig.get_requires_for_build_sdist

_PROBE = (
    "import json, os, sys\n"
    "import importlib.util as u\n"
    "s = u.find_spec('torch')\n"
    "print(json.dumps({'torch': os.path.dirname(os.path.dirname(s.origin)) if s and s.origin else None,"
    " 'path': [p for p in sys.path if p]}))\n"
)

_found: dict | None = None


def _native_wanted() -> bool:
    return os.environ.get("PYHOOK_BUILD_NATIVE", "").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


def _candidates() -> list[str]:
    """Interpreters that may see the target environment: ``$PYHOOK_TORCH_PYTHON`` if set,
    else the one running the backend (pip's target). ``$VIRTUAL_ENV`` is deliberately not
    asked: an activated environment need not be the one pip installs into."""
    chosen = os.environ.get("PYHOOK_TORCH_PYTHON")
    return [chosen] if chosen else [sys.executable]


def _probe(exe: str) -> dict | None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")
    }
    try:
        proc = subprocess.run(
            [exe, "-c", _PROBE],
            capture_output=True,
            text=True,
            env=env,
            cwd=os.path.dirname(exe),
            timeout=120,
        )
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return info if info.get("torch") else None


def find_torch() -> dict:
    """Make the target environment's torch importable here; returns how it was found.

    ``{"how": "importable" | "target-env" | None, "python": exe, "dir": site dir}``.
    """
    global _found
    if _found is not None:
        return _found
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        _found = {
            "how": "importable",
            "python": sys.executable,
            "dir": os.path.dirname(os.path.dirname(spec.origin)),
        }
        return _found
    for exe in _candidates():
        info = _probe(exe)
        if info is None:
            continue
        known = {os.path.normcase(os.path.abspath(p)) for p in sys.path if p}
        for p in info["path"]:
            if os.path.isdir(p) and os.path.normcase(os.path.abspath(p)) not in known:
                sys.path.append(p)  # after the build environment's entries
        importlib.invalidate_caches()
        _found = {"how": "target-env", "python": exe, "dir": info["torch"]}
        print(
            f"pyhook: building against the torch in {info['torch']} (seen by {exe})",
            file=sys.stderr,
        )
        return _found
    _found = {"how": None, "python": sys.executable, "dir": None}
    return _found


def _require_torch() -> None:
    if not _native_wanted():
        return
    if find_torch()["how"] is None:
        # One line, no traceback: exiting here stops pip before it resolves (and downloads) torch.
        print(
            f"pyhook: torch is not installed for {_candidates()[0]}; install torch first "
            "(e.g. `pip install torch==2.13.0`, or the build for your CUDA from pytorch.org), "
            "then `pip install .` again (python -m build / uv: add --no-isolation / "
            "--no-build-isolation; PYHOOK_BUILD_NATIVE=0: pure Python, no torch needed to build)",
            file=sys.stderr,
        )
        raise SystemExit(1)


def get_requires_for_build_wheel(config_settings=None):
    _require_torch()
    return _orig.get_requires_for_build_wheel(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _require_torch()
    return _orig.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _require_torch()
    return _orig.build_wheel(wheel_directory, config_settings, metadata_directory)


def get_requires_for_build_editable(config_settings=None):
    _require_torch()
    return _orig.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    _require_torch()
    return _orig.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _require_torch()
    return _orig.build_editable(wheel_directory, config_settings, metadata_directory)
