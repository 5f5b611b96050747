"""pyhook._omp: the calling thread's OpenMP team released before a producer thread takes over
torch's work (issue 24, the producer-bound stream), and when pyhook.stream does it."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import pyhook
from pyhook import _omp
from pyhook.pipeline import stream as stream_mod
from pyhook.source import Batch


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_release_gives_the_team_workers_back():
    if _omp._pause() is None:
        pytest.skip("torch does not run on libgomp here")
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(512, 512)
        a @ a  # a parallel region: this thread's team has a worker now
        before = _threads()
        assert _omp.release_thread_team()
        deadline = time.monotonic() + 5
        while _threads() >= before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _threads() < before  # the worker exited
        assert torch.equal(a @ a, a @ a)  # and the next region starts a new team
    finally:
        torch.set_num_threads(saved)


def _source():
    for c in range(0, 4, 2):
        ids = torch.arange(c * 8, c * 8 + 16).reshape(2, 8) % 50
        yield Batch(
            ids,
            torch.ones_like(ids),
            torch.ones(2, 8, dtype=torch.bool),
            torch.tensor([c, c + 1]),
            None,
        )


@pytest.mark.parametrize(
    ("load", "released"),
    [
        (0.5, True),  # a core per runnable thread: released
        (50.0, False),  # oversubscribed: the throttled team is kept
    ],
)
def test_stream_releases_the_consumer_team_by_load(monkeypatch, load, released):
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    gpt = transformers.GPT2Model(cfg).eval()
    calls = []
    monkeypatch.setattr(
        stream_mod, "release_thread_team", lambda: calls.append(threading.current_thread().name)
    )
    monkeypatch.setattr(os, "getloadavg", lambda: (load * (os.cpu_count() or 1), 0.0, 0.0))
    rows = sum(
        len(b["tokens"]) for b in pyhook.stream(gpt, _source(), "h.0", batch_size=8, buffer_rows=16)
    )
    assert rows == 32
    assert calls == ([threading.current_thread().name] if released else [])
