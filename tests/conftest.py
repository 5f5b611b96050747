"""Shared fixtures: ``device`` (cpu, cuda) x ``backend`` (native, reference)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config: pytest.Config) -> None:
    """The suite tests the INSTALLED package: stop the session if ``pyhook`` would be imported
    from this checkout (``python -m pytest`` puts the current directory on ``sys.path``; the
    test command is ``python -I -m pytest tests``, see docs/install.md)."""
    spec = importlib.util.find_spec("pyhook")
    where = os.path.dirname(os.path.abspath(spec.origin)) if spec and spec.origin else None
    if where is None:
        raise pytest.UsageError("pyhook is not installed: pip install . first (see docs/install.md)")
    if os.path.normcase(where) == os.path.normcase(os.path.join(ROOT, "pyhook")):
        raise pytest.UsageError(
            f"pyhook would be imported from the checkout ({where}), not from the installed "
            "package: run the tests with `python -I -m pytest tests` (-I keeps the current "
            "directory off sys.path on every Python >= 3.10; plain `python -m pytest` puts it "
            "first)"
        )

# Subprocesses run outside the checkout, so that `python -c` imports the installed pyhook
# (with its native module) rather than the source tree beside the tests.
NEUTRAL_CWD = tempfile.gettempdir()


@pytest.fixture(
    params=[
        "cpu",
        pytest.param("cuda", marks=pytest.mark.cuda),
    ]
)
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return torch.device(request.param)


@pytest.fixture(params=["native", "reference"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from pyhook import _backend

    if request.param == "native" and not _backend.native_available():
        pytest.skip(f"native backend not built: {_backend.native_load_error()}")
    # Small test tensors must reach the kernel, not the small-capture shortcut.
    monkeypatch.setattr(_backend, "NATIVE_MIN_BYTES", 0)
    with _backend.use_backend(request.param):
        yield request.param


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyhook import _backend

    if not _backend.native_available():
        pytest.skip(f"native backend not built: {_backend.native_load_error()}")
    monkeypatch.setattr(_backend, "NATIVE_MIN_BYTES", 0)


@pytest.fixture
def host_allocations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The ``(shape, dtype)`` of every tensor taken through ``pyhook._backend.empty_host`` (the
    one place the pipeline takes host memory from) while the test runs; the calls still go
    through."""
    from pyhook import _backend

    taken: list[tuple[tuple[int, ...], torch.dtype]] = []
    real = _backend.empty_host

    def spy(shape, dtype):
        taken.append((tuple(shape), dtype))
        return real(shape, dtype)

    monkeypatch.setattr(_backend, "empty_host", spy)
    return taken


def run_python(code: str, env: dict[str, str] | None = None, cwd: str = NEUTRAL_CWD):
    """Run ``code`` in a fresh interpreter (for import-time behaviour)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, cwd=cwd
    )


@pytest.fixture(scope="session", autouse=True)
def _import_does_not_initialise_cuda() -> None:
    """Session guard: importing pyhook (and loading its native module) leaves CUDA alone."""
    proc = run_python(
        "import torch, pyhook\n"
        "from pyhook import _backend\n"
        "_backend.native_available()\n"
        "assert not torch.cuda.is_initialized(), 'import pyhook initialised CUDA'\n"
    )
    assert proc.returncode == 0, proc.stderr
