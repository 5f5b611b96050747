"""Installing pyhook: the build backend, the build record, the import-time check, ``pyhook info``.

The builds run pip on a copy of this checkout, in fresh virtual environments or against this
interpreter's torch, the way a user installs (``pip install .``, ``pip wheel .``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest
import torch

import pyhook
from pyhook import _backend, _build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEUTRAL_CWD = tempfile.gettempdir()
# A torch or CUDA package being collected or downloaded: what plain `pip install .` must not do.
TORCH_FETCH = re.compile(r"^\s*(Collecting|Downloading|Obtaining)\s+\S*(torch|nvidia)", re.I | re.M)


def copy_source(dst: str) -> str:
    """The checkout as a fresh clone has it (no build products)."""
    shutil.copytree(
        ROOT,
        dst,
        ignore=shutil.ignore_patterns(
            ".git",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            "*.so",
            "_build_info.json",
            ".pytest_cache",
            ".hypothesis",
            ".mypy_cache",
            ".ruff_cache",
            "pyhook-activations",
        ),
    )
    return dst


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would point pip or Python elsewhere."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYHOOK_BUILD_NATIVE", "PYHOOK_BUILD_CUDA")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def make_venv(path: str) -> str:
    """A fresh virtual environment (no system site-packages) with pip; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", path], check=True, capture_output=True)
    return os.path.join(path, "bin", "python")


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: str = NEUTRAL_CWD, timeout=1800):
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env or clean_env(), cwd=cwd, timeout=timeout
    )


def wheel_record(wheel: str) -> tuple[dict, list[str]]:
    with zipfile.ZipFile(wheel) as z:
        return json.loads(z.read("pyhook/_build_info.json")), z.namelist()


def import_from(directory: str, code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` with ``directory`` (an unpacked pyhook) first on sys.path."""
    return run([sys.executable, "-c", code], env=clean_env(PYTHONPATH=directory, **env))


# -- the build backend ------------------------------------------------------------------------------
def test_backend_refuses_without_torch_in_one_line(tmp_path):
    """What pip's isolated build sees, without pip: the target environment (a fresh venv) has no
    torch, the build environment (PYTHONPATH, PYTHONNOUSERSITE=1) only setuptools."""
    import importlib.util

    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True
    )
    build_env = tmp_path / "build-env"
    for name in ("setuptools", "pkg_resources", "_distutils_hack"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            shutil.copytree(next(iter(spec.submodule_search_locations)), build_env / name)
    env = clean_env(
        PYTHONPATH=os.pathsep.join([str(build_env), os.path.join(ROOT, "build_backend")]),
        PYTHONNOUSERSITE="1",
    )
    for hook in ("get_requires_for_build_wheel()", "prepare_metadata_for_build_wheel('.')"):
        proc = run(
            [
                str(tmp_path / "venv" / "bin" / "python"),
                "-c",
                f"import pyhook_build; pyhook_build.{hook}",
            ],
            env=env,
            cwd=str(tmp_path),
        )
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pyhook: torch is not installed"), (
            proc.stderr
        )
        assert "pip install torch==" in lines[0] and "PYHOOK_BUILD_NATIVE=0" in lines[0]
    # the opt-out needs no torch
    opt_out = run(
        [
            str(tmp_path / "venv" / "bin" / "python"),
            "-c",
            "import pyhook_build; print(pyhook_build._require_torch())",
        ],
        env={**env, "PYHOOK_BUILD_NATIVE": "0"},
    )
    assert opt_out.returncode == 0 and opt_out.stdout.strip() == "None", opt_out.stderr


@pytest.mark.slow
def test_plain_install_without_torch_stops_with_one_line(tmp_path):
    """No torch in the target environment: one clear line, and pip fetches no torch."""
    py = make_venv(str(tmp_path / "venv"))
    src = copy_source(str(tmp_path / "src"))
    proc = run([py, "-m", "pip", "install", src])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    ours = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("pyhook:")]
    assert len(ours) == 1, out
    assert "torch is not installed" in ours[0] and "pip install torch==" in ours[0], ours
    assert "[1 lines of output]" in out, out  # nothing else: no traceback
    assert not TORCH_FETCH.search(out), out


@pytest.mark.slow
def test_pure_python_build_needs_no_torch_and_stays_quiet(tmp_path):
    """PYHOOK_BUILD_NATIVE=0 builds a pure-Python wheel without torch at build time; that
    install never warns (the user chose it), and reports why nothing is native."""
    py = make_venv(str(tmp_path / "venv"))  # no torch here
    src = copy_source(str(tmp_path / "src"))
    dist = str(tmp_path / "dist")
    proc = run(
        [py, "-m", "pip", "wheel", "--no-deps", src, "-w", dist],
        env=clean_env(PYHOOK_BUILD_NATIVE="0"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = os.listdir(dist)
    assert wheel.endswith("-py3-none-any.whl"), wheel
    rec, names = wheel_record(os.path.join(dist, wheel))
    assert rec["native"] == "skipped" and rec["build_native_env"] == "0", rec
    assert not [n for n in names if n.startswith("pyhook/_C")], names

    site = str(tmp_path / "site")
    zipfile.ZipFile(os.path.join(dist, wheel)).extractall(site)
    check = import_from(
        site,
        f"import pyhook; assert pyhook.__file__.startswith({site!r}), pyhook.__file__\n"
        "assert not pyhook.native_available()\n"
        "print(pyhook.info()['native core'])",
    )
    assert check.returncode == 0, check.stderr
    assert "pyhook:" not in check.stderr, check.stderr  # torch may warn about numpy; we do not
    assert check.stdout.startswith("skipped: PYHOOK_BUILD_NATIVE=0"), check.stdout


@pytest.mark.slow
def test_failed_native_build_is_recorded_logged_and_warned_once(tmp_path):
    """A broken compiler: the build log says so, the wheel records why, and ``import pyhook``
    warns exactly once with the fix (also after the backend is used)."""
    src = copy_source(str(tmp_path / "src"))
    dist = str(tmp_path / "dist")
    broken = clean_env(CXX="false", CC="false")
    proc = run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", src, "-w", dist], env=broken
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "pyhook: native build FAILED" in log, log
    # pip's isolated build environment has no torch: the backend found this interpreter's
    assert (
        f"pyhook: building against the torch in {os.path.dirname(os.path.dirname(torch.__file__))}"
        in log
    )
    assert not TORCH_FETCH.search(log), log
    (wheel,) = os.listdir(dist)
    rec, names = wheel_record(os.path.join(dist, wheel))
    assert rec["native"] == "failed" and rec["reason"], rec
    assert rec["torch_version"] == torch.__version__
    assert not [n for n in names if n.startswith("pyhook/_C")], names

    site = str(tmp_path / "site")
    zipfile.ZipFile(os.path.join(dist, wheel)).extractall(site)
    check = import_from(
        site,
        "import torch, pyhook, importlib\n"
        "importlib.import_module('pyhook')\n"
        "assert not pyhook.native_available()\n"
        "pyhook.recursive_copy([torch.ones(1 << 20)], clone=True)\n"
        "print(pyhook.get_backend())",
    )
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == "reference"
    warned = [ln for ln in check.stderr.splitlines() if "RuntimeWarning" in ln]
    assert len(warned) == 1, check.stderr
    assert "failed to build" in warned[0] and "pip install --force-reinstall" in warned[0]

    # PYHOOK_BUILD_NATIVE=1: the same failure fails the build instead.
    strict = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", src, "-w", str(tmp_path / "d2")],
        env={**broken, "PYHOOK_BUILD_NATIVE": "1"},
    )
    assert strict.returncode != 0, strict.stdout


# -- the import-time check on the installed package ----------------------------------------------------
@pytest.fixture
def installed_copy(tmp_path):
    """A copy of the installed pyhook package (with its native module and build record)."""
    site = tmp_path / "site"
    shutil.copytree(os.path.dirname(pyhook.__file__), site / "pyhook")
    return site


def _record(site) -> dict:
    return json.loads((site / "pyhook" / "_build_info.json").read_text())


def _needs_native_install():
    if _build.build_info() is None or not _backend.native_available():
        pytest.skip("the installed pyhook has no native core / build record")


def test_installed_build_record_matches_this_torch():
    _needs_native_install()
    rec = _build.build_info()
    assert rec["native"] == "built" and rec["torch_version"] == torch.__version__
    assert rec["cuda"] == (torch.version.cuda is not None and rec["cuda_reason"] is None)
    assert rec["openmp"] == ("-fopenmp" in rec["cxx_flags"])


def test_torch_version_mismatch_warns_once(installed_copy):
    _needs_native_install()
    rec = _record(installed_copy)
    rec["torch_version"] = "2.0.0+cpu"
    (installed_copy / "pyhook" / "_build_info.json").write_text(json.dumps(rec))
    check = import_from(
        str(installed_copy),
        "import torch, pyhook\n"
        "print(pyhook.native_available())\n"
        "pyhook.recursive_copy([torch.ones(1 << 20)], clone=True)",
    )
    assert check.returncode == 0, check.stderr
    warned = [ln for ln in check.stderr.splitlines() if "RuntimeWarning" in ln]
    assert len(warned) == 1, check.stderr
    assert f"built against torch 2.0.0+cpu but torch {torch.__version__} is running" in warned[0]
    assert "pip install --force-reinstall --no-deps ." in warned[0]


def test_unloadable_native_module_warns_once_with_the_fix(installed_copy):
    _needs_native_install()
    (so,) = [p for p in (installed_copy / "pyhook").iterdir() if p.name.startswith("_C")]
    so.write_bytes(b"not an ELF file")
    check = import_from(
        str(installed_copy),
        "import pyhook\n"
        "print(pyhook.native_available(), pyhook.native_available(), pyhook.get_backend())",
    )
    assert check.returncode == 0, check.stderr
    assert check.stdout.split() == ["False", "False", "reference"]
    warned = [ln for ln in check.stderr.splitlines() if "RuntimeWarning" in ln]
    assert len(warned) == 1, check.stderr
    assert "failed to load" in warned[0] and "pip install --force-reinstall" in warned[0]


def test_build_problem_rules():
    built = {"native": "built", "torch_version": "2.13.0+cpu"}
    assert _build.build_problem(built, "2.13.0+cpu") is None
    assert "2.13.0+cpu but torch 2.13.0+cu126" in _build.build_problem(built, "2.13.0+cu126")
    assert "missing" in _build.build_problem(built, "2.13.0+cpu", module_present=False)
    assert _build.build_problem(None, "2.13.0") is None  # a source checkout: nothing recorded
    for opt_out in ("0", "off", "false"):
        rec = {"native": "skipped", "build_native_env": opt_out, "reason": "chosen"}
        assert _build.build_problem(rec, "2.13.0") is None
    not_chosen = {"native": "skipped", "build_native_env": None, "reason": "no torch"}
    assert "not built (no torch)" in _build.build_problem(not_chosen, "2.13.0")
    failed = {"native": "failed", "reason": "CompileError: boom"}
    assert "failed to build (CompileError: boom)" in _build.build_problem(failed, "2.13.0")


# -- pyhook info ------------------------------------------------------------------------------------------
def test_info_reports_the_real_values():
    facts = pyhook.info()
    assert (
        facts["pyhook"].startswith(f"{pyhook.__version__} (")
        and os.path.dirname(pyhook.__file__) in facts["pyhook"]
    )
    assert facts["python"].startswith(".".join(map(str, sys.version_info[:3])))
    assert facts["torch"].startswith(torch.__version__)
    assert ("CPU build" in facts["torch"]) == (torch.version.cuda is None)
    assert facts["backend"].split()[0] == pyhook.get_backend()
    assert facts["OpenMP"].startswith(f"{torch.get_num_threads()} intra-op threads")
    loaded = pyhook.native_available()
    assert facts["native core"].endswith("loaded") == loaded
    if loaded:
        limit = pyhook.pool_stats()["limit_bytes"] >> 20
        assert facts["pool"].startswith(f"limit {limit} MiB")
        rec = _build.build_info()
        assert f"built against torch {rec['torch_version']}" in facts["native core"]
        assert facts["compiler"] == rec["compiler"]
        assert facts["build flags"].startswith(" ".join(rec["cxx_flags"]))
    else:
        assert pyhook._backend.native_load_error() in facts["native core"]


def test_info_command_prints_the_same_facts():
    text = run([sys.executable, "-m", "pyhook", "info"])
    as_json = run([sys.executable, "-m", "pyhook", "info", "--json"])
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    facts = json.loads(as_json.stdout)
    mine = pyhook.info()
    stable = ["pyhook", "python", "torch", "native core", "CUDA kernels", "OpenMP"]
    assert {k: facts[k] for k in stable} == {k: mine[k] for k in stable}
    for key, value in facts.items():
        if key != "pool":  # counters differ between processes
            assert re.search(rf"^{re.escape(key)}:\s+{re.escape(value)}$", text.stdout, re.M), key


# -- the real thing: plain `pip install .` in a fresh environment --------------------------------------
@pytest.mark.slow
def test_plain_pip_install_in_fresh_venv_builds_against_installed_torch(tmp_path):
    """``pip install torch==2.13.0`` then plain ``pip install .``: no torch or CUDA package is
    collected or downloaded, and the installed ``pyhook._C`` loads, built against that torch."""
    py = make_venv(str(tmp_path / "venv"))
    first = run([py, "-m", "pip", "install", "torch==2.13.0"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    src = copy_source(str(tmp_path / "src"))
    t0 = time.perf_counter()
    proc = run([py, "-m", "pip", "install", "-v", src])
    print(f"plain `pip install .` in a fresh venv: {time.perf_counter() - t0:.0f} s")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert not TORCH_FETCH.search(log), TORCH_FETCH.search(log).group(0)
    assert "pyhook: built the native core against torch 2.13.0" in log, log[-5000:]
    check = run(
        [
            py,
            "-c",
            "import json, torch, pyhook\nfrom pyhook import _build\n"
            "print(json.dumps([pyhook.native_available(), pyhook.__file__, torch.__version__, "
            "_build.build_info()['torch_version'], pyhook.get_backend()]))",
        ]
    )
    assert check.returncode == 0, check.stderr
    loaded, where, running, built, backend = json.loads(check.stdout)
    assert loaded and backend == "native", check.stdout
    assert where.startswith(str(tmp_path / "venv")), where
    assert running.startswith("2.13.0") and built == running
    assert "pyhook:" not in check.stderr, check.stderr  # torch may warn about numpy; we do not


def test_the_native_loader_does_not_import_the_build_report():
    # issue 16, item 7: pyhook._build (the report) reads pyhook._backend; never the reverse
    import ast
    import inspect

    import pyhook._backend
    import pyhook._build

    def imported(module) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ImportFrom):
                names.update(f"{node.module or ''}.{a.name}".lstrip(".") for a in node.names)
                names.add(node.module or "")
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    assert not any("_build" in n for n in imported(pyhook._backend))
    assert "_backend" in imported(pyhook._build)
