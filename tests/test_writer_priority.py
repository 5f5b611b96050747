"""The disk writer thread runs at the lowest CPU priority (pipeline/_threadprio.py): it takes
only a core the forward leaves idle, and the rows it writes are unchanged."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import pyhook
from pyhook.store import ShardWriter, open_capture

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="thread scheduling policies are read on Linux"
)


def _policy(tid: int) -> int:
    # /proc/self/task/TID/stat field 41 (after the parenthesised command name): the policy.
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    policy = int(fields[41 - 3])
    assert policy == os.sched_getscheduler(tid)  # two readings of the same thing agree
    return policy


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _capture_and_reference(out: str) -> tuple[int, int]:
    """A disk capture of two layers over 3 batches, read back, beside a hand-written hook's
    rows; the writer thread's policy and nice value read while it runs."""
    torch.manual_seed(0)
    net = Net().eval()
    xs = [torch.randn(7, 6) for _ in range(3)]
    ref: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    handles = [
        getattr(net, n).register_forward_hook(
            lambda _m, _i, o, n=n: ref[n].append(o.detach().clone())
        )
        for n in ref
    ]
    with torch.no_grad():
        for x in xs:
            net(x)
    for h in handles:
        h.remove()
    with torch.no_grad(), pyhook.capture(net, ["a", "b"], out=out) as rec:
        for x in xs:
            net(x)
        writer = rec._writer
        writer.flush()
        writer.wait()  # the thread has taken a shard: it set its priority before that
        tid = writer._thread.native_id
        policy, nice = _policy(tid), _nice(tid)
    store = open_capture(out)
    for n in ref:
        torch.testing.assert_close(store[n].to_tensor(), torch.cat(ref[n]), rtol=0, atol=0)
    return policy, nice


def test_writer_thread_runs_at_sched_idle(tmp_path, monkeypatch):
    monkeypatch.setenv("PYHOOK_WRITER_PRIORITY", "idle")
    policy, _ = _capture_and_reference(str(tmp_path / "c"))
    assert policy == os.SCHED_IDLE
    # ... and only that thread: the caller's own policy is untouched
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_writer_priority_default(tmp_path, monkeypatch):
    from pyhook.pipeline import _threadprio

    monkeypatch.delenv("PYHOOK_WRITER_PRIORITY", raising=False)
    mine = _nice(0)
    policy, nice = _capture_and_reference(str(tmp_path / "d"))
    expected = {
        "idle": (os.SCHED_IDLE, nice),  # SCHED_IDLE ignores the nice value
        "nice": (os.SCHED_OTHER, 19),
        "normal": (os.SCHED_OTHER, mine),
    }[_threadprio.DEFAULT]
    assert (policy, nice) == expected


def test_writer_priority_nice_and_normal(tmp_path, monkeypatch):
    mine = _nice(0)  # (run under nice 19, "nice" cannot be told from "normal": both 19)
    monkeypatch.setenv("PYHOOK_WRITER_PRIORITY", "nice")
    policy, nice = _capture_and_reference(str(tmp_path / "n"))
    assert (policy, nice) == (os.SCHED_OTHER, 19)
    for value in ("normal", "0"):
        monkeypatch.setenv("PYHOOK_WRITER_PRIORITY", value)
        policy, nice = _capture_and_reference(str(tmp_path / value))
        assert (policy, nice) == (os.SCHED_OTHER, mine)
    assert _nice(0) == mine


def test_shard_writer_reports_the_priority_it_applied(tmp_path, monkeypatch):
    monkeypatch.setenv("PYHOOK_WRITER_PRIORITY", "idle")
    with ShardWriter(str(tmp_path / "w")) as w:
        w.add({"x": torch.arange(12.0).reshape(4, 3)}, examples=4)
        w.flush()
        w.wait()
        assert _policy(w._thread.native_id) == os.SCHED_IDLE
        assert w.priority == "idle"
    assert (
        open_capture(str(tmp_path / "w"))["x"].to_tensor().equal(torch.arange(12.0).reshape(4, 3))
    )
    assert w.thread_cpu_seconds > 0


def test_bad_priority_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("PYHOOK_WRITER_PRIORITY", "lowest")
    net = Net()
    out = tmp_path / "bad"
    with (
        pytest.raises(ValueError, match="PYHOOK_WRITER_PRIORITY"),
        pyhook.capture(net, ["a"], out=str(out)),
    ):
        net(torch.randn(2, 6))
    assert not out.exists() or not any(out.iterdir())
    assert not net.a._forward_hooks
