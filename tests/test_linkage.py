"""The native core uses the shared libstdc++ (torch's), even where the compiler links it
statically by default.

A second C++ runtime inside ``_C`` (a driver that adds ``-static-libstdc++``, as the ``g++`` of
some CUDA images does) crashed the interpreter on an H200 image: formatting a number in an
error message (``clone_many`` given tensors on two devices) ran the static copy's
``std::ostream::_M_insert<unsigned long>`` against locale facets made by the process's newer
``libstdc++.so.6``. setup.py and CMakeLists.txt name the shared library by file (``-l:libstdc++.so.6``) before the
driver's own libraries (``shared_libstdcxx_flags`` in setup.py): that image's driver searched a
folder holding only ``libstdc++.a`` first, so ``-Wl,-Bdynamic -lstdc++`` (the first fix) still
linked the archive.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pyhook import _backend, _build

INSERT = "_ZNSo9_M_insertImEERSoT_"  # std::ostream& std::ostream::_M_insert<unsigned long>
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF / libstdc++ only")
binutils = pytest.mark.skipif(
    shutil.which("readelf") is None or shutil.which("nm") is None, reason="binutils not installed"
)


def needed(path: str) -> list[str]:
    """The DT_NEEDED entries of an ELF shared object."""
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    return [
        line.split("[", 1)[1].rstrip("]") for line in out.stdout.splitlines() if "(NEEDED)" in line
    ]


def defines(path: str, symbol: str) -> bool:
    """Whether the object defines ``symbol`` (in any symbol table), rather than importing it."""
    out = subprocess.run(["nm", path], capture_output=True, text=True, check=True).stdout
    return any(
        line.split()[-1] == symbol and line.split()[-2] not in ("U", "w")
        for line in out.splitlines()
        if line.strip()
    )


def static_driver(tmp_path, kind: str = "flag") -> str:
    """A C++ compiler driver that links libstdc++ statically into every shared object.

    ``kind="flag"``: it adds ``-static-libstdc++``. ``kind="search"``: as the H200 image's
    ``CXX=/opt/gcc/bin/g++`` does, it runs the compiler with ``-B`` a folder holding
    ``libstdc++.a`` and no shared library, searched first, so that even ``-Wl,-Bdynamic
    -lstdc++`` finds the archive (the fix that did not work on the second GPU run).
    """
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    wrapper = tmp_path / f"static-c++-{kind}"
    if kind == "flag":
        wrapper.write_text(f'#!/bin/sh\nexec {cxx} "$@" -static-libstdc++\n')
    else:
        archive = subprocess.run(
            [cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True
        ).stdout.strip()
        if not os.path.isabs(archive):
            pytest.skip("the compiler has no libstdc++.a")
        folder = tmp_path / "static-only"
        folder.mkdir(exist_ok=True)
        os.symlink(archive, folder / "libstdc++.a")
        wrapper.write_text(f'#!/bin/sh\nexec {cxx} -B{folder}/ "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@linux
@binutils
def test_installed_native_core_links_the_shared_libstdcxx():
    if not _backend.native_available():
        pytest.skip(f"native backend not built: {_backend.native_load_error()}")
    import pyhook._C as native

    assert "libstdc++.so.6" in needed(native.__file__)
    assert not defines(native.__file__, INSERT), "a copy of libstdc++ is linked into pyhook._C"
    rec = _build.build_info()
    assert rec is not None and rec.get("link_flags"), rec  # what setup.py linked with


@linux
@binutils
@pytest.mark.parametrize("kind", ["flag", "search"])
def test_link_flags_keep_libstdcxx_shared_under_a_static_driver(tmp_path, kind):
    rec = _build.build_info()
    if rec is None or not rec.get("link_flags"):
        pytest.skip("no build record with link flags (pure-Python install)")
    cxx = static_driver(tmp_path, kind)
    src = tmp_path / "f.cpp"
    # An unsigned long into a stream: the libstdc++ function the H200 crash was in.
    src.write_text(
        "#include <sstream>\n#include <string>\n"
        "std::string f(unsigned long n) { std::ostringstream s; s << n; return s.str(); }\n"
    )

    def link(name: str, flags: list[str]) -> str:
        out = str(tmp_path / name)
        subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", out, *flags], check=True)
        return out

    plain = link("plain.so", [])
    # the driver really links statically (else this test could not fail)
    assert "libstdc++.so.6" not in needed(plain) and defines(plain, INSERT)
    fixed = link("fixed.so", list(rec["link_flags"]))
    assert "libstdc++.so.6" in needed(fixed)
    assert not defines(fixed, INSERT)
    if kind == "search":  # the flags of the first fix, which this driver defeats
        old = link("old.so", ["-Wl,-Bdynamic", "-lstdc++"])
        assert "libstdc++.so.6" not in needed(old) and defines(old, INSERT)
