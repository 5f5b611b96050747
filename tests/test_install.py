"""The installed package is the one under test, and the native core is there when CI expects it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

import pyhook


def test_native_core_loaded_when_expected():
    if os.environ.get("PYHOOK_EXPECT_NATIVE") != "1":
        pytest.skip("set PYHOOK_EXPECT_NATIVE=1 to require the native core (CI does)")
    assert pyhook.native_available(), pyhook._backend.native_load_error()
    assert pyhook.get_backend() == "native"


def test_import_does_not_initialise_cuda():
    code = "import torch, pyhook; pyhook.recursive_copy(torch.ones(1), clone=True); print(torch.cuda.is_initialized())"
    # outside the checkout, so that the installed pyhook (with its native module) is imported
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tempfile.gettempdir()
    )
    assert out.stdout.strip() == "False"


def test_public_names_have_docstrings_with_examples():
    missing = [
        name for name in pyhook.__all__
        if not name.startswith("__") and ">>>" not in (getattr(pyhook, name).__doc__ or "")
        and callable(getattr(pyhook, name))
    ]
    assert not missing, f"public objects without a runnable example: {missing}"


def _modules():
    import pkgutil

    # every module of every subpackage (the pipeline's stages live in pyhook.pipeline)
    return sorted(
        m.name
        for m in pkgutil.walk_packages(pyhook.__path__, "pyhook.")
        if m.name not in ("pyhook._C", "pyhook.__main__") and ".data" not in m.name
    )


@pytest.mark.parametrize("modname", _modules())
def test_docstring_examples_run(modname):
    import doctest
    import importlib

    try:
        module = importlib.import_module(modname)
    except ImportError as e:  # an optional dependency of that module is missing
        pytest.skip(f"{modname}: {e}")
    from pyhook import _backend

    chosen = _backend._requested
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failures in {modname}"
    # an example that changes the process-wide backend must put it back: the tests that run
    # after it in the same worker would otherwise take the other backend's paths
    assert _backend._requested == chosen, f"{modname}'s examples left the backend changed"
