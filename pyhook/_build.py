"""What the install built, checked at import, and the facts a bug report needs.

Index:

* :func:`build_info` - the build record ``pyhook/_build_info.json`` written by ``setup.py``
  (native core built, failed or skipped and why; the torch it was built against; CUDA
  kernels and why not; compiler and flags; OpenMP);
* :func:`build_problem` - what is wrong with that build for the running torch (``None`` if
  nothing): a failed or skipped build the user did not choose, a module built against another
  torch, a built module missing from the package;
* :func:`info` / :func:`format_info` - versions, native core and CUDA kernels built / loaded
  (and why not), backend, OpenMP threads, pool limits, compiler and flags (``pyhook info``).

``import pyhook`` runs :func:`check_build` once: it warns (once, with the fix) about a
:func:`build_problem`, and stays quiet after a pure-Python install chosen with
``PYHOOK_BUILD_NATIVE=0``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import warnings
from typing import Any

from . import _backend  # (one way: the native loader never imports this report)

__all__ = ["build_info", "build_problem", "check_build", "format_info", "info"]

RECORD_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_info.json")
REINSTALL = _backend.REINSTALL


def build_info(path: str = RECORD_PATH) -> dict[str, Any] | None:
    """The build record of this install, or ``None`` (a source checkout, or no record).

    >>> rec = build_info()
    >>> rec is None or rec["native"] in ("built", "failed", "skipped")
    True
    """
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _opted_out(rec: dict[str, Any]) -> bool:
    value = (rec.get("build_native_env") or "").strip().lower()
    return value in ("0", "false", "no", "off")


def build_problem(
    rec: dict[str, Any] | None, torch_version: str, module_present: bool = True
) -> str | None:
    """Why the native core of build record ``rec`` is not usable with ``torch_version``, with
    the fix; ``None`` when it is (or the user chose a pure-Python install).

    >>> ok = {"native": "built", "torch_version": "2.13.0+cpu"}
    >>> build_problem(ok, "2.13.0+cpu") is None
    True
    >>> print(build_problem(ok, "2.14.1+cpu"))  # doctest: +ELLIPSIS
    pyhook: the native core was built against torch 2.13.0+cpu but torch 2.14.1+cpu is running...
    >>> build_problem({"native": "skipped", "build_native_env": "0"}, "2.13.0") is None
    True
    """
    if rec is None:
        return None
    state = rec.get("native")
    if state == "skipped" and _opted_out(rec):
        return None
    if state == "failed":
        return (
            f"pyhook: the native core failed to build ({str(rec.get('reason'))[:300]}); pyhook "
            "works, on its slower pure-PyTorch backend. Fix the compiler, then reinstall from the "
            f"pyhook source: `{REINSTALL}` (the build log says what failed; `pip install -v`); "
            "or reinstall with PYHOOK_BUILD_NATIVE=0 to choose pure Python and silence this"
        )
    if state == "skipped":
        return (
            f"pyhook: the native core was not built ({rec.get('reason')}); pyhook works, on its "
            f"slower pure-PyTorch backend. Install torch first, then reinstall: `{REINSTALL}`"
        )
    if state == "built":
        built = rec.get("torch_version")
        if built and built != torch_version:
            return (
                f"pyhook: the native core was built against torch {built} but torch "
                f"{torch_version} is running; it may fail to load or misbehave. Rebuild it against "
                f"this torch: `{REINSTALL}` from the pyhook source (or install torch=={built})"
            )
        if not module_present:
            return (
                "pyhook: the build record says the native core was built, but pyhook._C is "
                f"missing from the installed package; reinstall: `{REINSTALL}`"
            )
    return None


def check_build() -> str | None:
    """Warn once about this install's :func:`build_problem`; returns the message (or ``None``).

    Runs at ``import pyhook``; later calls return the message without warning again.

    >>> check_build() is None or check_build().startswith("pyhook: ")
    True
    """
    import importlib.util

    import torch

    rec = build_info()
    present = True
    if rec is not None and rec.get("native") == "built":
        try:
            present = importlib.util.find_spec("pyhook._C") is not None
        except (ImportError, ValueError):
            present = False
    msg = build_problem(rec, torch.__version__, present)
    if rec is None and msg is None:
        msg = _source_tree_problem()
    if msg and not _backend.build_warned:  # (the native loader may have told it already)
        _backend.build_warned = True
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return msg


def _source_tree_problem() -> str | None:
    """Imported from a source checkout (``python -c "import pyhook"`` in the repository root):
    no native core there, whatever is installed. The fix, or ``None`` elsewhere."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not (
        os.path.isfile(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "csrc"))
    ):
        return None
    try:
        if importlib.util.find_spec("pyhook._C") is not None:
            return None
    except (ImportError, ValueError):
        pass
    return (
        f"pyhook: imported from the source tree {root}, which has no native core (the slower "
        f"pure-PyTorch backend runs); install it (`{REINSTALL}`) and run from another folder, "
        "or with `python -I`, so that the installed package is imported"
    )


def _openmp_threads() -> str:
    import torch

    parallel = torch.__config__.parallel_info()
    backend = next(
        (ln.split(":", 1)[1].strip() for ln in parallel.splitlines() if "parallel backend" in ln),
        "?",
    )
    return f"{torch.get_num_threads()} intra-op threads (ATen backend: {backend})"


def info() -> dict[str, str]:
    """What a bug report needs, as ``{field: value}`` (``pyhook info`` prints it).

    >>> import pyhook, torch
    >>> facts = pyhook.info()
    >>> facts["pyhook"].startswith(pyhook.__version__) and facts["torch"].startswith(torch.__version__)
    True
    >>> facts["backend"].split()[0] == pyhook.get_backend()
    True
    """
    import torch

    from ._version import __version__

    rec = build_info()
    loaded = _backend.native_available()
    out: dict[str, str] = {}
    out["pyhook"] = f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})"
    out["python"] = f"{platform.python_version()} ({sys.executable})"
    out["platform"] = platform.platform()
    cuda = torch.version.cuda
    out["torch"] = (
        f"{torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU build'}; "
        f"{torch.cuda.device_count()} GPU(s) visible)"
    )
    if rec is None:
        built = "unknown (no build record: not an installed pyhook?)"
    elif rec.get("native") == "built":
        built = f"built against torch {rec.get('torch_version')}"
    else:
        built = f"{rec.get('native')}: {rec.get('reason')}"
    out["native core"] = f"{built}; " + (
        "loaded" if loaded else f"not loaded ({_backend.native_load_error()})"
    )
    if rec is not None and rec.get("native") == "built" and rec.get("cuda"):
        cuda_built = f"built (archs {rec.get('cuda_arch_list')})"
    elif rec is not None:
        cuda_built = f"not built ({rec.get('cuda_reason') or rec.get('reason')})"
    else:
        cuda_built = "unknown"
    out["CUDA kernels"] = f"{cuda_built}; " + (
        "registered" if loaded and _backend._cuda_kernels else "not registered"
    )
    env = os.environ.get("PYHOOK_BACKEND")
    out["backend"] = (
        f"{_backend.get_backend()} (requested {_backend._requested!r}"
        + (f", PYHOOK_BACKEND={env}" if env else "")
        + f"; native from {_backend.NATIVE_MIN_BYTES >> 10} KiB per call)"
    )
    out["OpenMP"] = f"{_openmp_threads()}; native core compiled " + (
        "with -fopenmp" if rec and rec.get("openmp") else "without OpenMP"
    )
    stats = _backend.pool_stats()
    out["pool"] = (
        f"limit {stats['limit_bytes'] >> 20} MiB, cached {stats['cached_bytes'] >> 20} MiB "
        f"in {stats['cached_buffers']} buffer(s), hits {stats['hits']}, misses {stats['misses']}"
        if loaded
        else "none (native core not loaded)"
    )
    from . import _malloc

    out["malloc"] = (
        _malloc.state[1]
        if _malloc.state is not None
        else "glibc's heap thresholds are set when a capture starts (PYHOOK_MALLOC=0: never)"
    )
    from .pipeline import format as _format

    out["shard checksum"] = (
        "crc32c (package crc32c)"
        if _format.CHECKSUM == "crc32c"
        else "crc32 (zlib: the crc32c package is missing, a disk capture checksums ~4x slower)"
    )
    if rec is not None:
        out["compiler"] = str(rec.get("compiler", "-"))
        flags = " ".join(rec.get("cxx_flags") or []) or "-"
        if rec.get("nvcc_flags"):
            flags += f"; nvcc: {' '.join(rec['nvcc_flags'])}"
        if rec.get("link_flags"):
            flags += f"; link: {' '.join(rec['link_flags'])}"
        out["build flags"] = flags
        out["build switches"] = (
            f"PYHOOK_BUILD_NATIVE={rec.get('build_native_env') or '(unset)'}, "
            f"PYHOOK_BUILD_CUDA={rec.get('build_cuda_env') or '(unset)'}"
        )
    problem = build_problem(rec, torch.__version__)
    if problem:
        out["problem"] = problem
    return out


def format_info(facts: dict[str, str] | None = None) -> str:
    """:func:`info` as aligned ``field: value`` lines.

    >>> print(format_info({"pyhook": "0.1.0", "torch": "2.13.0"}))
    pyhook: 0.1.0
    torch:  2.13.0
    """
    facts = info() if facts is None else facts
    if not isinstance(facts, dict) or not facts:
        raise TypeError(
            f"format_info: facts must be a non-empty dict of field -> value (as info() returns), "
            f"got {type(facts).__name__}"
        )
    width = max(map(len, facts)) + 1
    return "\n".join(f"{k + ':':<{width}} {v}" for k, v in facts.items())
