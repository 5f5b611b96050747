"""benchmarks/gpu_check.py: without CUDA it says so and exits 0; its steps are time-limited."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    report = tmp_path / "report.md"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, even on a GPU machine
    p = subprocess.run(
        [sys.executable, "-I", SCRIPT, "--out", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "no CUDA device" in p.stdout and "nothing to check" in p.stdout
    assert not report.exists()


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_a_step_past_its_limit_is_ended_with_its_children():
    gpu_check = _load()
    # a step that starts a grandchild and waits: both go at the limit
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(120)'])"
    t0 = time.monotonic()
    status, _, _ = gpu_check.run_step([sys.executable, "-c", code], 2.0)
    assert status.startswith("TIMED OUT") and time.monotonic() - t0 < 60
    ok, out, _ = gpu_check.run_step([sys.executable, "-c", "print('hi')"], 60.0)
    assert ok == "ok" and out.strip() == "hi"
    assert gpu_check.run_step([sys.executable, "-c", "pass"], 0.5)[0].startswith("skipped")


def test_the_capture_loop_script_compiles():
    # step 5 runs CAPTURE_LOOP in a fresh interpreter on a GPU machine only: a syntax error in
    # it would first show there, at the cost of the device time
    compile(_load().CAPTURE_LOOP, "<gpu_check capture loop>", "exec")


def test_the_compiled_models_step_runs_on_the_cpu():
    """Step 6 (benchmarks/gpu_compiled.py) in its CPU dry run: rows equal the eager capture
    and a capture block traces no frame once warm (a bug there would cost device time)."""
    script = os.path.join(ROOT, "benchmarks", "gpu_compiled.py")
    p = subprocess.run(
        [sys.executable, "-I", script, "--device", "cpu", "--only", "default mode"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    row = [ln for ln in p.stdout.splitlines() if ln.startswith("| default mode |")]
    assert len(row) == 1, p.stdout[-3000:]
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    assert float(cells[1]) < 1e-4  # max |compiled - eager|
    assert cells[4] == "0"  # frames dynamo traced while timed
