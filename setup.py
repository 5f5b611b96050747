"""Build script for pyhook.

The native core ``pyhook._C`` is optional:

* C++ (CPU kernels) is built whenever a compiler works;
* CUDA kernels are added when torch was built with CUDA and ``CUDA_HOME`` is set
  (``PYHOOK_BUILD_CUDA=0`` skips them, ``=1`` insists on them);
* ``PYHOOK_BUILD_NATIVE=0`` installs pure Python only;
* a failed native build never fails the install: it prints one line and pyhook uses its
  pure-PyTorch reference backend.

Install with ``pip install --no-build-isolation .`` so the build sees the installed torch.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


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


def native_extensions() -> tuple[list, dict]:
    """The extension list and cmdclass; both empty for a pure-Python install."""
    if env_flag("PYHOOK_BUILD_NATIVE") is False:
        print("pyhook: PYHOOK_BUILD_NATIVE=0, installing pure Python only")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:  # no torch at build time: nothing to compile against
        print(f"pyhook: torch not importable at build time ({e}); installing pure Python only")
        return [], {}

    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    want_cuda = env_flag("PYHOOK_BUILD_CUDA")
    has_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if want_cuda and not has_cuda:
        raise RuntimeError("PYHOOK_BUILD_CUDA=1 but torch has no CUDA or CUDA_HOME is unset")
    use_cuda = has_cuda and want_cuda is not False

    # py_limited_api: _C only defines an empty module (its import runs the op
    # registrations), so torch's cpp_extension compiles it against the stable ABI
    # (it adds -DPy_LIMITED_API itself) and one .so fits every CPython it supports.
    cxx = ["-O3", "-DPYHOOK_PYTHON_MODULE", *openmp_flags(torch)]
    kwargs: dict = {"py_limited_api": True}
    if use_cuda:
        ext_cls = cpp_extension.CUDAExtension
        sources += cuda_sources
        kwargs["extra_compile_args"] = {"cxx": cxx, "nvcc": ["-O3", "-DPYHOOK_WITH_CUDA"]}
    else:
        ext_cls = cpp_extension.CppExtension
        kwargs["extra_compile_args"] = {"cxx": cxx}
    ext = ext_cls("pyhook._C", sources, **kwargs)

    class OptionalBuildExt(cpp_extension.BuildExtension):
        """BuildExtension that falls back to a pure-Python install on failure."""

        def run(self) -> None:
            try:
                super().run()
            except Exception as e:  # compiler missing or broken: stay installable
                print(
                    f"pyhook: native build failed ({type(e).__name__}: {e}); "
                    "installing pure Python (reference backend)",
                    file=sys.stderr,
                )

        def build_extension(self, extension) -> None:
            try:
                super().build_extension(extension)
            except Exception as e:
                print(
                    f"pyhook: native build failed ({type(e).__name__}: {e}); "
                    "installing pure Python (reference backend)",
                    file=sys.stderr,
                )

    cmdclass = {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}
    return [ext], cmdclass


ext_modules, cmdclass = native_extensions()

# Metadata (dependencies, extras, the `pyhook` command, package data) lives in pyproject.toml.
setup(
    packages=find_packages(include=["pyhook", "pyhook.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)
