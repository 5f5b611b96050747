"""Build script for pyhook (run through ``build_backend/pyhook_build.py``, see pyproject.toml).

The native core ``pyhook._C`` is compiled against the torch already installed:

* C++ (CPU kernels) is built whenever a compiler works;
* CUDA kernels are added when torch was built with CUDA and ``CUDA_HOME`` is set
  (``PYHOOK_BUILD_CUDA=0`` skips them, ``=1`` insists on them);
* ``PYHOOK_BUILD_NATIVE=0`` installs pure Python only (quietly: the user chose it);
  ``PYHOOK_BUILD_NATIVE=1`` makes a failed native build fail the install;
* by default a failed native build does not fail the install: the build log says why, the
  outcome is recorded in ``pyhook/_build_info.json`` and ``import pyhook`` warns once.

Every build writes ``pyhook/_build_info.json`` (what was built, why not, the torch it was
built against, compiler and flags), read by ``pyhook info`` and the import-time check.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import shlex
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD = "_build_info.json"
FIX = "reinstall with `pip install --force-reinstall --no-deps .` (see `pyhook info`)"


def env_flag(name: str) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return None
    return value not in ("0", "false", "no", "off")


def openmp_flags(torch) -> list[str]:
    """``-fopenmp`` when torch uses OpenMP: ``at::parallel_for`` is inlined into our code with
    ``#pragma omp``, so without the flag every "parallel" copy runs on one thread. Only the
    compile step gets it; the GOMP symbols resolve against the libgomp torch already loaded,
    so no second OpenMP runtime enters the process."""
    info = torch.__config__.parallel_info()
    if sys.platform != "darwin" and "OpenMP" in info and "OpenMP not found" not in info:
        return ["-fopenmp"]
    return []


def compiler_version(cmd: str) -> str:
    try:
        out = subprocess.run(
            [*shlex.split(cmd), "--version"], capture_output=True, text=True, timeout=30
        )
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        return f"{cmd}: not runnable ({type(e).__name__})"


def shared_libstdcxx_flags() -> list[str]:
    """Link flags that make ``_C`` use the shared libstdc++ (the one torch itself uses).

    A compiler driver set up to link libstdc++ statically (``-static-libstdc++``, as the
    ``g++`` of some CUDA images is) puts a second C++ runtime inside ``_C``; calls bind partly
    to it and partly to the process's ``libstdc++.so.6``, and where the two are different
    versions their locale facets do not match: formatting a number in an error message
    crashed the interpreter (a SIGSEGV in ``std::ostream::_M_insert<unsigned long>``, seen
    with g++ 13 linking statically beside GCC 14's ``libstdc++.so.6`` on an H200 image).
    Naming the shared library before the driver's own libraries leaves its static archive
    nothing to add. It is named by file (``-l:libstdc++.so.6``), not as ``-lstdc++``: that
    image's driver (``CXX=/opt/gcc/bin/g++``, a script running ``g++-real -B/opt/gcc/...``)
    searches a folder holding ``libstdc++.a`` and no ``.so`` first, so ``-Wl,-Bdynamic
    -lstdc++`` still linked the archive (seen on the second GPU run). Linux only (elsewhere
    the C++ runtime is not libstdc++ or not optional).
    """
    if not sys.platform.startswith("linux"):
        return []
    # -l:FILE: every GNU-compatible linker (ld, gold, lld) takes it, and it finds only the
    # shared library, wherever the driver's search folders put a static archive first.
    return ["-l:libstdc++.so.6"]


def cuda_arch_list(torch) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` for a build on a machine without a visible GPU.

    torch's cpp_extension derives the list from the visible GPUs; with none (a build node,
    a container build) it fails (``IndexError``). Build for the architectures torch itself
    was compiled for instead; a set ``TORCH_CUDA_ARCH_LIST`` is kept as is."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    try:
        if torch.cuda.device_count() > 0:
            return None  # cpp_extension asks the GPUs
    except Exception:
        pass
    flags = getattr(torch._C, "_cuda_getArchFlags", lambda: "")() or ""
    archs = sorted(
        {f"{a[3:-1]}.{a[-1]}" for a in flags.split() if a.startswith("sm_") and a[3:].isdigit()},
        key=lambda v: tuple(map(int, v.split("."))),
    )
    return ";".join([*archs[:-1], archs[-1] + "+PTX"]) if archs else "7.5;8.0;8.6;8.9;9.0+PTX"


# What the build did, written to pyhook/_build_info.json (see pyhook/_build.py).
record: dict = {
    "native": "skipped",
    "reason": None,
    "cuda": False,
    "cuda_reason": None,
    "build_native_env": os.environ.get("PYHOOK_BUILD_NATIVE"),
    "build_cuda_env": os.environ.get("PYHOOK_BUILD_CUDA"),
    "python": platform.python_version(),
    "platform": platform.platform(),
}


def log(msg: str) -> None:
    print(f"pyhook: {msg}", file=sys.stderr, flush=True)


def native_extensions() -> tuple[list, dict]:
    """The extension list and build_ext class; both empty for a pure-Python install."""
    if env_flag("PYHOOK_BUILD_NATIVE") is False:
        record["reason"] = "PYHOOK_BUILD_NATIVE=0: pure-Python install chosen by the user"
        record["cuda_reason"] = "native build skipped"
        log("PYHOOK_BUILD_NATIVE=0, installing pure Python only")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:  # only reachable without the build backend (plain setup.py)
        record["reason"] = f"torch was not importable at build time ({e}); install torch first"
        record["cuda_reason"] = "native build skipped"
        if env_flag("PYHOOK_BUILD_NATIVE"):
            raise RuntimeError(f"PYHOOK_BUILD_NATIVE=1 but {record['reason']}") from e
        log(f"{record['reason']}; installing pure Python only")
        return [], {}

    record.update(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        torch_path=os.path.dirname(torch.__file__),
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    )
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    want_cuda = env_flag("PYHOOK_BUILD_CUDA")
    if want_cuda is False:
        why_not = "PYHOOK_BUILD_CUDA=0"
    elif torch.version.cuda is None:
        why_not = f"torch {torch.__version__} is a CPU build"
    elif cpp_extension.CUDA_HOME is None:
        why_not = "no CUDA toolkit found (set CUDA_HOME to the directory holding bin/nvcc)"
    else:
        why_not = None
    if want_cuda and why_not:
        raise RuntimeError(f"PYHOOK_BUILD_CUDA=1 but {why_not}")
    use_cuda = why_not is None

    # py_limited_api: _C only defines an empty module (its import runs the op
    # registrations), so torch's cpp_extension compiles it against the stable ABI
    # (it adds -DPy_LIMITED_API itself) and one .so fits every CPython it supports.
    cxx = ["-O3", "-DPYHOOK_PYTHON_MODULE", *openmp_flags(torch)]
    link = shared_libstdcxx_flags()
    kwargs: dict = {"py_limited_api": True, "extra_link_args": link}
    record.update(
        compiler=compiler_version(os.environ.get("CXX", "c++")),
        cxx_flags=cxx,
        link_flags=link,
        openmp="-fopenmp" in cxx,
        cuda_reason=why_not,
    )
    if use_cuda:
        ext_cls = cpp_extension.CUDAExtension
        sources += cuda_sources
        nvcc = ["-O3", "-DPYHOOK_WITH_CUDA"]
        kwargs["extra_compile_args"] = {"cxx": cxx, "nvcc": nvcc}
        arch = cuda_arch_list(torch)
        if arch is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch
        record.update(
            nvcc_flags=nvcc,
            cuda_arch_list=arch or "the visible GPUs'",
            cuda_home=cpp_extension.CUDA_HOME,
        )
    else:
        ext_cls = cpp_extension.CppExtension
        kwargs["extra_compile_args"] = {"cxx": cxx}
    ext = ext_cls("pyhook._C", sources, **kwargs)
    log(
        f"building the native core against torch {torch.__version__} "
        f"({len(sources)} sources, CUDA kernels: {'yes' if use_cuda else 'no, ' + str(why_not)})"
    )

    class RecordingBuildExt(cpp_extension.BuildExtension):
        """BuildExtension that records its outcome; a failure falls back to pure Python
        (or fails the install with PYHOOK_BUILD_NATIVE=1)."""

        def failed(self, e: Exception) -> None:
            message = " ".join(f"{type(e).__name__}: {e}".split())
            record.update(native="failed", reason=message[-2000:], cuda=False)
            if env_flag("PYHOOK_BUILD_NATIVE"):
                raise e
            log(
                f"native build FAILED ({record['reason'][:300]}); installing pure Python "
                f"(reference backend); fix the compiler, then {FIX}"
            )

        def build_extension(self, extension) -> None:
            try:
                super().build_extension(extension)
            except Exception as e:  # compiler missing or broken: stay installable
                self.failed(e)
            else:
                record.update(native="built", reason=None, cuda=use_cuda)
                log(
                    f"built the native core against torch {torch.__version__}: CPU kernels"
                    + (" + CUDA kernels" if use_cuda else f"; CUDA kernels not built: {why_not}")
                )

        def run(self) -> None:
            try:  # the compiler checks run before build_extension
                super().run()
            except Exception as e:
                if record["native"] != "failed":
                    self.failed(e)
                elif env_flag("PYHOOK_BUILD_NATIVE"):
                    raise
            write_record(self.build_lib, getattr(self, "inplace", False))

    return [ext], {"build_ext": RecordingBuildExt.with_options(use_ninja=True)}


def write_record(build_lib: str, inplace: bool = False) -> None:
    with open(os.path.join(HERE, "pyhook", "_version.py"), encoding="utf-8") as f:
        record["pyhook_version"] = re.search(r"__version__ = \"([^\"]+)\"", f.read()).group(1)
    target = os.path.join(HERE if inplace else build_lib, "pyhook", RECORD)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)


class BuildPyWithRecord(build_py):
    """Writes the build record (build_ext, which runs after this, rewrites it)."""

    def run(self) -> None:
        super().run()
        write_record(self.build_lib, bool(getattr(self, "editable_mode", False)))


ext_modules, cmdclass = native_extensions()

# Metadata (dependencies, extras, the `pyhook` command, package data) lives in pyproject.toml.
setup(
    packages=find_packages(include=["pyhook", "pyhook.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_py": BuildPyWithRecord, **cmdclass},
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)
