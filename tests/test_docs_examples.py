"""Every ```python block of README.md and docs/**/*.md runs as written, alone, from an empty folder.

Each block is one test (id ``file:line``): it is written to a fresh temporary directory and run
there by a fresh interpreter (``sys.executable``), so it sees the *installed* pyhook and nothing a
previous block defined. A block fails the test when it exits non-zero or writes anything to
stderr (a warning the reader would see when pasting it is a defect of the example too).

Blocks that are not meant to run use another language tag: ```bash for shell and torchrun
commands, ```text for output.
"""

from __future__ import annotations

import json
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
            if (
                close
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"]
            ):
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


def test_readme_links_point_to_existing_files():
    # Sphinx checks the links between docs pages; the README is not part of the site.
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links to no docs page"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


# --------------------------------------------------------------------------------------- runners
#
# Each block runs in its own process, with a fresh ``__main__`` namespace, its own empty working
# directory and the installed pyhook. A fresh interpreter per block pays torch's and transformers'
# imports (3-7 s of CPU) every time, most of this file's cost; by default the blocks are therefore
# run by *forking* one interpreter that has imported torch, pyhook and transformers' GPT-2 classes
# and nothing else (`os.fork` after the imports, before any computation). The child changes into
# the block's folder, sends fd 1/2 to files, runs the script with ``runpy.run_path(...,
# run_name="__main__")`` (so `if __name__ == "__main__":` and `multiprocessing` spawn work),
# then does what interpreter shutdown does: joins non-daemon threads, drops the script's globals,
# collects garbage and runs atexit handlers. A block still cannot use a name it did not import.
# PYHOOK_DOCS_EXAMPLES=fresh runs every block in a brand-new interpreter instead (the literal
# check; also used where os.fork does not exist).

_PRELOAD = """
import torch, pyhook
try:
    import transformers
    from transformers import GPT2Model, GPT2LMHeadModel  # the models the examples build
except ImportError:
    pass
"""

_SERVER = (
    _PRELOAD
    + r"""
import atexit, gc, json, os, runpy, signal, sys, threading, time, traceback

def run(req):
    code = 0
    try:
        os.chdir(req["cwd"])
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        sys.stdin = open(os.devnull)
        sys.argv = [req["script"]]
        sys.path[0] = os.path.dirname(req["script"])    # as `python script.py` sets it
        try:
            ns = runpy.run_path(req["script"], run_name="__main__")
            ns.clear()
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        gc.collect()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        run(req)
    deadline = time.monotonic() + req["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = "timeout"
            break
        time.sleep(0.02)
    print(json.dumps({"returncode": rc}), flush=True)
"""
)

TIMEOUT = 300


def _child_env() -> dict[str, str]:
    # The child sees the installed pyhook, never this checkout: its cwd and its script's folder
    # are a fresh, empty directory, and PYTHONPATH is dropped.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class _ForkServer:
    def __init__(self, workdir: Path) -> None:
        self.stderr_path = workdir / "server-stderr.txt"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER],
                cwd=workdir,
                env=_child_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        ready = self.proc.stdout.readline()
        startup_err = self.stderr_path.read_text()
        if not ready or startup_err.strip():
            raise RuntimeError(f"the example runner did not start cleanly:\n{startup_err}")

    def run(self, script: Path, out_dir: Path) -> tuple[int | str, str, str]:
        req = {
            "script": str(script),
            "cwd": str(script.parent),
            "stdout": str(out_dir / "stdout.txt"),
            "stderr": str(out_dir / "stderr.txt"),
            "timeout": TIMEOUT,
        }
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the example runner died:\n{self.stderr_path.read_text()}")
        rc = json.loads(reply)["returncode"]
        return rc, (out_dir / "stdout.txt").read_text(), (out_dir / "stderr.txt").read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _run_fresh(script: Path) -> tuple[int | str, str, str]:
    try:
        proc = subprocess.run(
            [sys.executable, script.name],
            cwd=script.parent,
            env=_child_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as e:
        return "timeout", str(e.stdout), str(e.stderr)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    if os.environ.get("PYHOOK_DOCS_EXAMPLES") == "fresh" or not hasattr(os, "fork"):
        yield None
        return
    server = _ForkServer(tmp_path_factory.mktemp("example-runner"))
    yield server
    server.close()


@pytest.mark.parametrize("code", BLOCKS)
def test_example_runs_alone_from_an_empty_folder(code, tmp_path, runner):
    folder = tmp_path / "example"
    folder.mkdir()
    script = folder / "example.py"
    script.write_text(code, encoding="utf-8")
    if runner is None:
        rc, _, stderr = _run_fresh(script)
    else:
        rc, _, stderr = runner.run(script, tmp_path)
    assert rc == 0, f"the example failed ({rc}):\n{code}\n--- stderr ---\n{stderr}"
    assert not stderr.strip(), f"the example printed to stderr:\n{code}\n--- stderr ---\n{stderr}"
