"""Issue 19 item 5 (the writer's part): the host memory a disk capture holds is bounded.

The writer holds the rows buffered for the next shard, the shards waiting for the disk and the
one being written; ``max_buffer_bytes`` (default 256 MiB) bounds their sum whatever the size of
the capture or of ``shard_bytes``. A slow disk (the real writer, each file write delayed) makes
the producer wait instead of memory growing.
"""

from __future__ import annotations

import os
import time

import torch

from pyhook.store import ShardWriter, open_capture, writer

MB = 1 << 20


def _slow_disk(monkeypatch, seconds=0.02):
    real = writer._write_file

    def slow(*a, **k):
        time.sleep(seconds)
        return real(*a, **k)

    monkeypatch.setattr(writer, "_write_file", slow)


def test_buffered_bytes_stay_under_the_limit(tmp_path, monkeypatch):
    _slow_disk(monkeypatch)
    batch = 256 * 1024 // 4  # 256 KB of float32 rows a batch
    xs = [torch.full((batch // 64, 64), float(i)) for i in range(48)]  # 12 MB in all
    with ShardWriter(tmp_path, shard_bytes=64 * MB, max_pending=8, max_buffer_bytes=2 * MB) as w:
        for x in xs:
            w.add({"h": x}, examples=1)
    # before the limit, shard_bytes=64 MB kept the whole capture (12 MB) in memory
    assert w.peak_buffer_bytes <= 2 * MB, w.peak_buffer_bytes
    assert w.peak_buffer_bytes >= MB  # the writer did use its budget (double buffering)
    sizes = [os.path.getsize(p) for p in sorted(tmp_path.glob("shard-*.safetensors"))]
    assert len(sizes) >= 12 and max(sizes) <= MB + 4096  # shards of half the budget
    assert torch.equal(open_capture(tmp_path)["h"][:], torch.cat(xs))


def test_default_budget_is_256_mb(tmp_path):
    w = ShardWriter(tmp_path)
    try:
        assert w.max_buffer_bytes == 256 * MB
        assert w._shard_limit == 128 * MB
    finally:
        w.close()


def test_a_batch_larger_than_the_budget_is_still_taken(tmp_path):
    big = torch.ones(3 * MB // 4 // 16, 16)  # 3 MB, budget 1 MB
    with ShardWriter(tmp_path, shard_bytes=1, max_buffer_bytes=MB) as w:
        w.add({"h": big}, examples=1)
        w.add({"h": big}, examples=1)
    assert torch.equal(open_capture(tmp_path)["h"][:], torch.cat([big, big]))
