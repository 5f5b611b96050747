"""The documentation site builds with warnings as errors (what CI checks: `pip install ".[docs]"`)."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx", reason="the docs extra is not installed: pip install '.[docs]'")
    pytest.importorskip(
        "myst_parser", reason="the docs extra is not installed: pip install '.[docs]'"
    )
    pytest.importorskip("furo", reason="the docs extra is not installed: pip install '.[docs]'")
    out = tmp_path / "html"
    # A fresh interpreter in an empty folder: autodoc documents the installed pyhook, as the tests
    # test it (`python -m` would otherwise put the checkout on sys.path when run from the root).
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-E",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(ROOT / "docs"),
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stderr}"
    assert "WARNING" not in proc.stderr, proc.stderr
    # The API reference really was generated from the docstrings.
    api = (out / "api" / "pyhook.html").read_text(encoding="utf-8")
    assert 'id="pyhook.TraceDict"' in api and 'id="pyhook.capture"' in api
    # Every in-site link to an anchor lands on an id (viewcode's source pages included: their
    # links to re-exported objects such as pyhook.deephook.TraceMultiple used to miss).
    ids: dict[Path, set[str]] = {}
    broken = []
    for page in out.rglob("*.html"):
        for target, anchor in re.findall(
            r'href="([^"#:]*\.html)#([^"]+)"', page.read_text("utf-8")
        ):
            dest = (page.parent / target).resolve()
            if dest not in ids:
                text = dest.read_text("utf-8") if dest.exists() else ""
                ids[dest] = set(re.findall(r'id="([^"]+)"', text))
            if html.unescape(anchor) not in ids[dest]:
                broken.append(f"{page.relative_to(out)} -> {target}#{anchor}")
    assert not broken, broken
