"""CMakeLists.txt builds the same sources as setup.py, and the result works.

Runs the CMake build in a temp dir (about 1-2 minutes on 2 cores) and loads the library in a
fresh interpreter: loading it next to pyhook._C in one process would register the
``pyhook`` namespace twice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from test_linkage import INSERT, defines, needed, static_driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cmake_build_loads_and_runs(tmp_path):
    build = tmp_path / "build"
    # On Linux, through a compiler driver that links libstdc++ statically (as some CUDA
    # images' g++ does): the library must still use the shared one (tests/test_linkage.py).
    linkage = sys.platform.startswith("linux") and shutil.which("readelf") and shutil.which("nm")
    compiler = [f"-DCMAKE_CXX_COMPILER={static_driver(tmp_path, 'search')}"] if linkage else []
    configure = subprocess.run(
        [
            "cmake",
            "-S",
            ROOT,
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            *compiler,
        ],
        capture_output=True,
        text=True,
    )
    assert configure.returncode == 0, configure.stdout + configure.stderr
    jobs = str(max(1, min(4, os.cpu_count() or 1)))
    compiled = subprocess.run(
        ["cmake", "--build", str(build), "-j", jobs], capture_output=True, text=True
    )
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    libs = [p for p in build.iterdir() if p.name.startswith("libpyhook_ops")]
    assert libs, list(build.iterdir())
    if linkage:
        assert "libstdc++.so.6" in needed(str(libs[0]))
        assert not defines(str(libs[0]), INSERT)

    code = textwrap.dedent(
        f"""
        import torch
        torch.ops.load_library({str(libs[0])!r})
        xs = [torch.randn(4, 3).t(), torch.arange(5), torch.tensor(True), torch.empty(0, 2)]
        ys = torch.ops.pyhook.clone_many(xs)
        for x, y in zip(xs, ys):
            e = x.clone()
            assert torch.equal(y, e) and y.stride() == e.stride() and y.dtype == e.dtype
            assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() or not x.numel()
        assert torch.ops.pyhook.clone_many([]) == []
        assert len(torch.ops.pyhook.pool_stats()) == 7
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"


def _nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    return shutil.which("nvcc")


@pytest.mark.skipif(_nvcc() is None, reason="no CUDA toolkit (nvcc) on this machine")
def test_cuda_sources_compile(tmp_path):
    """The CUDA sources compile with nvcc against torch's headers, even where torch is a CPU
    build (so they cannot be linked or run here): a CPU wheel lacks only the generated
    ``c10/cuda/impl/cuda_cmake_macros.h``, which the test supplies. On a machine with CUDA
    torch the real build (``setup.py``) compiles, links and tests them."""
    from torch.utils.cpp_extension import include_paths

    shim = tmp_path / "shim"
    macros = shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    macros.parent.mkdir(parents=True)
    macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    sources = sorted(
        os.path.join(ROOT, "csrc", "cuda", f)
        for f in os.listdir(os.path.join(ROOT, "csrc", "cuda"))
        if f.endswith(".cu")
    )
    assert sources
    for src in sources:
        proc = subprocess.run(
            [
                _nvcc(),
                "-c",
                "-std=c++20",
                "--expt-relaxed-constexpr",
                "-DPYHOOK_WITH_CUDA",
                "-Xcompiler",
                "-fPIC",
                *(f"-I{p}" for p in include_paths()),
                f"-I{shim}",  # after torch's own: a CUDA build of torch brings the real header
                src,
                "-o",
                str(tmp_path / (os.path.basename(src) + ".o")),
            ],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, f"{src}:\n{proc.stderr[-4000:]}"
