"""Every ```python block of README.md and docs/**/*.md runs as written, alone, from an empty folder.

Each block is one test (id ``file:line``): it is written to a fresh temporary directory and run
there by a fresh interpreter (``sys.executable``), so it sees the *installed* pyhook and nothing a
previous block defined. A block fails the test when it exits non-zero or writes anything to
stderr (a warning the reader would see when pasting it is a defect of the example too).

Blocks that are not meant to run use another language tag: ```bash for shell and torchrun
commands, ```text for output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A fence opens with ``` or ~~~ (three or more), possibly indented (inside a list item).
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")


def markdown_files() -> list[Path]:
    """README.md and every Markdown page of the docs site (not the build output)."""
    docs = ROOT / "docs"
    pages = sorted(p for p in docs.rglob("*.md") if "_build" not in p.relative_to(docs).parts)
    return [ROOT / "README.md", *pages]


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line of the opening fence, code)`` of every fenced block tagged ``python``."""
    blocks: list[tuple[int, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        lang = m["info"].split()[0] if m["info"] else ""
        start, body = i + 1, []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence) and not close["info"]:
                break
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        if lang in ("python", "py", "python3"):
            blocks.append((start, "\n".join(body) + "\n"))
    return blocks


def _collect() -> list:
    params = []
    for path in markdown_files():
        if not path.exists():
            continue
        rel = path.relative_to(ROOT).as_posix()
        for line, code in python_blocks(path):
            params.append(pytest.param(code, id=f"{rel}:{line}"))
    return params


BLOCKS = _collect()


def test_the_docs_have_python_examples():
    # Guards the collector itself: a parsing regression would otherwise silently test nothing.
    assert len(BLOCKS) >= 10, [p.id for p in BLOCKS]
    assert any(p.id.startswith("README.md:") for p in BLOCKS)


def test_block_parser_handles_indented_fences_and_other_languages(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n"
        "* item\n\n  ```python\n  if True:\n      y = 2\n  ```\n"
        "````markdown\n```python\nnot_a_block\n```\n````\n"
        "```bash\necho no\n```\n```text\nout\n```\n"
    )
    assert python_blocks(page) == [(2, "x = 1\n"), (7, "if True:\n    y = 2\n")]


@pytest.mark.parametrize("code", BLOCKS)
def test_example_runs_alone_from_an_empty_folder(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The child sees the installed pyhook, never this checkout: its cwd and its script's folder
    # are a fresh, empty directory, and PYTHONPATH is dropped.
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, script.name],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"the example failed:\n{code}\n--- stderr ---\n{proc.stderr}"
    assert not proc.stderr.strip(), f"the example printed to stderr:\n{code}\n--- stderr ---\n{proc.stderr}"
