"""Data integrity of captures (issue 12): resume rules, reader ownership, damaged stores, verify.

Each test here is a regression test for one item of the issue; the fault-injection suite that
enumerates every kill point and corruption kind is tests/test_faults.py.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from pyhook import store
from pyhook.capture import capture
from pyhook.cli import main
from pyhook.store import CaptureDamagedError, CaptureExistsError, ShardWriter, open_capture

SETTINGS = {"k": 1}


def _data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g)


def _write(out, x, batch=4, **kw):
    """Rows of ``x`` in batches of ``batch`` examples, one shard per batch."""
    with ShardWriter(out, settings=SETTINGS, shard_bytes=kw.pop("shard_bytes", 1), **kw) as w:
        for i in range(w.examples_done, len(x), batch):
            w.add({"a": x[i : i + batch]}, examples=len(x[i : i + batch]))
    return w


def _shard(out, i):
    return os.path.join(out, f"shard-r000-{i:06d}.safetensors")


# -- 1. resume after a missing or damaged shard -------------------------------------------------
def test_resume_after_missing_shard_refuses_and_names_the_file(tmp_path):
    x = _data()
    _write(tmp_path, x[:24])  # six shards, then "interrupted"
    os.remove(_shard(tmp_path, 3))  # examples 12-15
    with pytest.raises(CaptureDamagedError) as e:
        _write(tmp_path, x)
    msg = str(e.value)
    assert "shard-r000-000003.safetensors" in msg and "overwrite" in msg
    # nothing was dropped from the index: the reader still refuses rather than reading 36 rows
    with pytest.raises(CaptureDamagedError):
        open_capture(tmp_path)


def test_resume_after_truncated_shard_refuses_up_front(tmp_path):
    x = _data()
    _write(tmp_path, x[:24])
    path = _shard(tmp_path, 2)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)
    with pytest.raises(CaptureDamagedError, match=r"shard-r000-000002\.safetensors.*size"):
        ShardWriter(tmp_path, settings=SETTINGS)


def test_resume_with_overwrite_starts_again(tmp_path):
    x = _data()
    _write(tmp_path, x[:24])
    os.remove(_shard(tmp_path, 3))
    _write(tmp_path, x, overwrite=True)
    assert torch.equal(open_capture(tmp_path, verify=True)["a"][:], x)


# -- 2. the reader hands out tensors the caller owns ---------------------------------------------
@pytest.mark.parametrize("shards", [1, 3])
def test_in_place_edit_of_a_read_does_not_change_later_reads(tmp_path, shards):
    x = _data(30) + 1.0
    _write(tmp_path, x, batch=30 // shards)
    r = open_capture(tmp_path)
    for _epoch in range(3):
        for i, b in enumerate(r.batches(10)):
            assert torch.equal(b["a"], x[i * 10 : i * 10 + 10])
            b["a"] -= b["a"].mean()  # centre in place
    # every way of reading sees the stored values
    h = r["a"]
    for got in (h[:], h[0:10], h[5], h[[1, 2]], h.to_tensor(), *h.parts):
        got.zero_()
    assert torch.equal(h.to_tensor(), x)
    assert torch.equal(torch.cat([b["a"] for b in r.batches(7)]), x)
    assert torch.equal(r["a"][3], x[3])


# -- 3. damaged stores are detected on open, flipped data by verify -------------------------------
def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, f.read(n)


def test_header_dtype_change_detected_on_open(tmp_path):
    _write(tmp_path, _data(8))
    path = _shard(tmp_path, 1)
    _, raw = _header(path)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(raw.replace(b'"F32"', b'"I32"'))
    with pytest.raises(CaptureDamagedError, match=r"shard-r000-000001\.safetensors.*dtype"):
        open_capture(tmp_path)


def _edit_index(out, fn):
    p = os.path.join(out, "index-r000.json")
    with open(p) as f:
        idx = json.load(f)
    idx = fn(idx)
    with open(p, "w") as f:
        json.dump(idx, f)


def test_shard_listed_twice_detected(tmp_path):
    _write(tmp_path, _data(12))
    _edit_index(tmp_path, lambda i: {**i, "shards": [*i["shards"], i["shards"][1]]})
    with pytest.raises(CaptureDamagedError, match=r"shard-r000-000001\.safetensors.*twice"):
        open_capture(tmp_path)


@pytest.mark.parametrize("bad", ["../other/shard-r000-000000.safetensors", "/tmp/x.safetensors"])
def test_path_escaping_the_directory_detected(tmp_path, bad):
    other = tmp_path / "other"
    _write(other, _data(4) + 100)
    _write(tmp_path / "cap", _data(8))

    def edit(i):
        i["shards"][0]["file"] = bad
        return i

    _edit_index(tmp_path / "cap", edit)
    with pytest.raises(CaptureDamagedError, match=r"not a shard file name"):
        open_capture(tmp_path / "cap")


def test_swapped_shards_detected_on_open(tmp_path):
    _write(tmp_path, _data(12))
    a, b = _shard(tmp_path, 0), _shard(tmp_path, 2)
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)
    with pytest.raises(CaptureDamagedError, match=r"shard-r000-000000\.safetensors"):
        open_capture(tmp_path)


def test_flipped_data_byte_detected_by_verify(tmp_path, capsys):
    _write(tmp_path, _data(12))
    path = _shard(tmp_path, 1)
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    open_capture(tmp_path)  # cheap checks pass: same size, same header
    with pytest.raises(CaptureDamagedError, match=r"shard-r000-000001\.safetensors.*checksum"):
        open_capture(tmp_path, verify=True)
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shard-r000-000001.safetensors" in err[0] and "checksum" in err[0]


def test_verify_good_capture_and_old_store_without_checksums(tmp_path, capsys):
    _write(tmp_path, _data(12))
    assert main(["verify", str(tmp_path)]) == 0
    assert "3 shard" in capsys.readouterr().out

    def strip(i):  # the index of a store written before checksums (format version 1)
        for s in i["shards"]:
            s.pop("checksum", None)
        i.pop("index_checksum", None)
        i["format_version"] = 1
        return i

    _edit_index(tmp_path, strip)
    os.remove(tmp_path / "index.json")
    assert torch.equal(open_capture(tmp_path)["a"][:], _data(12))
    assert main(["verify", str(tmp_path)]) == 0
    assert "no checksum recorded" in capsys.readouterr().out


def test_index_records_size_and_checksum(tmp_path):
    _write(tmp_path, _data(8))
    idx = open_capture(tmp_path).index
    for s in idx["shards"]:
        assert s["bytes"] == os.path.getsize(tmp_path / s["file"])
        algo, _, value = s["checksum"].partition(":")
        assert algo in ("crc32c", "crc32") and len(value) == 8
    assert [s["first_example"] for s in idx["shards"]] == [0, 4]


# -- 4. a skipped batch keeps the resume point ----------------------------------------------------
class Flaky(torch.nn.Module):
    def __init__(self, fail_at):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.fail_at, self.calls = set(fail_at), 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        if self.calls in self.fail_at:
            raise RuntimeError("bad batch")
        return y


def test_skipped_batch_counts_toward_the_resume_point(tmp_path):
    torch.manual_seed(0)
    x = _data(40)
    loader = [x[i : i + 4] for i in range(0, 40, 4)]
    ref = Flaky([])
    # run 1: batch 5 (examples 20-23) raises and the loop skips it; interrupted after batch 7
    net = Flaky([6])
    net.load_state_dict(ref.state_dict())
    with capture(net, "lin", out=tmp_path, shard_bytes=1) as rec:
        for batch in loader[rec.examples_done : 8]:
            try:
                net(batch)
            except RuntimeError:
                continue
    assert rec.examples == 32 and rec.skipped == 4
    # run 2: the README's pattern resumes at example 32
    net2 = Flaky([])
    net2.load_state_dict(ref.state_dict())
    with capture(net2, "lin", out=tmp_path, shard_bytes=1) as rec2:
        assert rec2.examples_done == 32
        for batch in loader[rec2.examples_done // 4 :]:
            net2(batch)
    r = open_capture(tmp_path, verify=True)
    want = torch.cat([ref.lin(b) for i, b in enumerate(loader) if i != 5]).detach()
    assert r.examples == 40 and torch.equal(r["lin"][:], want)
    assert r.index["skipped"] == [[20, 24]]


def test_forward_error_leaving_the_block_is_not_counted(tmp_path):
    x = _data(12)
    net = Flaky([2])
    with pytest.raises(RuntimeError), capture(net, "lin", out=tmp_path, shard_bytes=1) as rec:
        for i in range(0, 12, 4):
            net(x[i : i + 4])
    with capture(net, "lin", out=tmp_path, shard_bytes=1) as rec:
        assert rec.examples_done == 4  # the failed batch is retried


# -- 5. a user's own index.json is never overwritten ----------------------------------------------
@pytest.mark.parametrize("content", ['{"my": "data"}', "[1, 2, 3]", "not json"])
def test_foreign_index_json_is_refused(tmp_path, content):
    p = tmp_path / "index.json"
    p.write_text(content)
    for overwrite in (False, True):
        with pytest.raises(CaptureExistsError, match=r"index\.json"):
            ShardWriter(tmp_path, settings=SETTINGS, overwrite=overwrite)
    assert p.read_text() == content


def test_damaged_merged_index_does_not_block_resume(tmp_path):
    x = _data(24)
    _write(tmp_path, x[:12])
    (tmp_path / "index.json").write_text('{"format": "pyhook-capt')  # torn
    _write(tmp_path, x)
    assert torch.equal(open_capture(tmp_path, verify=True)["a"][:], x)
    assert json.loads((tmp_path / "index.json").read_text())["examples"] == 24


# -- 12. one-line errors ----------------------------------------------------------------------
def _one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyhook: error:"), cap.err
    assert "Traceback" not in cap.err
    for n in needles:
        assert n in lines[0], lines[0]


def _damage_short(out):
    with open(_shard(out, 1), "wb") as f:
        f.write(b"abc")


def _damage_dir(out):
    os.remove(_shard(out, 1))
    os.mkdir(_shard(out, 1))


def _damage_no_layers(out):
    _edit_index(out, lambda i: {k: v for k, v in i.items() if k != "layers"})


def _damage_non_dict(out):
    _edit_index(out, lambda i: [i])


def _damage_bad_json(out):
    with open(os.path.join(out, "index-r000.json"), "w") as f:
        f.write("")


def _damage_shape(out):
    path = _shard(out, 0)
    _, raw = _header(path)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(raw.replace(b'"shape":[4,3]', b'"shape":[3,4]'))


@pytest.mark.parametrize(
    "damage, needle",
    [
        (_damage_short, "shard-r000-000001.safetensors"),
        (_damage_dir, "shard-r000-000001.safetensors"),
        (_damage_no_layers, "index-r000.json"),
        (_damage_non_dict, "index-r000.json"),
        (_damage_bad_json, "index-r000.json"),
        (_damage_shape, "shard-r000-000000.safetensors"),
    ],
)
def test_inspect_and_verify_errors_are_one_line(tmp_path, capsys, damage, needle):
    _write(tmp_path, _data(12))
    damage(str(tmp_path))
    _one_line_error(capsys, ["inspect", str(tmp_path)], needle)
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_verify_names_a_rank_whose_index_is_missing(tmp_path, capsys):
    # a deleted index-r001.json: rank 1's shards were only reported as debris, exit status 0
    for rank in range(2):
        _write(tmp_path, _data(8, seed=rank), rank=rank, world_size=2)
    assert main(["verify", str(tmp_path)]) == 0
    capsys.readouterr()
    os.remove(os.path.join(tmp_path, "index-r001.json"))
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "index-r001.json: missing (rank 1 of 2" in err and "Traceback" not in err


def test_a_rank_index_from_another_capture_is_refused(tmp_path, capsys):
    # index-r001.json (world_size 2) beside a one-rank capture was merged in: 20 examples, exit 0
    one, two = tmp_path / "one", tmp_path / "two"
    _write(one, _data(12))
    for rank in range(2):
        _write(two, _data(8, seed=rank), rank=rank, world_size=2)
    for name in os.listdir(two):
        if "r001" in name:
            os.rename(two / name, one / name)
    assert main(["verify", str(one)]) == 2
    err = capsys.readouterr().err
    assert "index-r001.json: not an index of the same capture as index-r000.json" in err
    with pytest.raises(CaptureDamagedError, match="world_size 2 here, 1 there"):
        open_capture(one)


def test_unreadable_shard_is_one_line(tmp_path, capsys, monkeypatch):
    _write(tmp_path, _data(8))
    real_open = os.open  # every read of a store file opens it with os.open (no link followed)

    def deny(path, *a, **k):
        if str(path).endswith("000001.safetensors"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("os.open", deny)
    _one_line_error(capsys, ["inspect", str(tmp_path)], "shard-r000-000001.safetensors")


def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _one_line_error(capsys, ["capture", "--device", "cuda", "--out", str(tmp_path)], "--device")


def test_ctrl_c_during_start_up_is_one_line(capsys, monkeypatch):
    from pyhook import cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["inspect", "x"]) == 130
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# -- 13. reader indexing edge cases -------------------------------------------------------------
def test_empty_step_slice_and_empty_list(tmp_path):
    x = _data(30)
    _write(tmp_path, x, batch=10)
    h = open_capture(tmp_path)["a"]
    for index in (slice(22, 6, 2), slice(5, 5), slice(3, 9, -1), [], torch.tensor([], dtype=torch.long)):
        got = h[index]
        assert got.shape == (0, 3) and got.dtype == x.dtype
    assert torch.equal(h[22:6:-2], x[torch.arange(22, 6, -2)])
    assert torch.equal(h[1:29:3], x[1:29:3])


def test_store_module_exports():
    assert "CaptureDamagedError" in store.__all__


def test_retried_batch_is_counted_once(tmp_path):
    x = _data(12)
    net = Flaky([2])
    with capture(net, "lin", out=tmp_path, shard_bytes=1) as rec:
        for i in range(0, 12, 4):
            try:
                net(x[i : i + 4])
            except RuntimeError:
                rec.retry()  # run it again, in halves
                net(x[i : i + 2])
                net(x[i + 2 : i + 4])
    assert rec.examples == 12 and rec.skipped == 0
    r = open_capture(tmp_path)
    assert r.examples == 12 and r.index["skipped"] == []
    assert torch.equal(r["lin"][:], net.lin(x).detach())


_IMPORT_INTERRUPTED = """
import builtins, os, signal, sys
sys.argv[0] = os.path.join("bin", "pyhook")  # as the console script
real = builtins.__import__
def interrupting(name, *a, **k):
    if name == "torch" and "torch" not in sys.modules:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while torch is being imported
    return real(name, *a, **k)
builtins.__import__ = interrupting
from pyhook.cli import main
sys.exit(main(["inspect", "nowhere"]))
"""


def _default_sigint() -> None:
    """In a child before exec: SIGINT's default disposition (a suite started with SIGINT ignored,
    under nohup or as a background job, would pass SIG_IGN on, and Python then installs no
    KeyboardInterrupt handler), as in a program started from a terminal."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_the_command_imports_torch_is_one_line():
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-P", "-c", _IMPORT_INTERRUPTED],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_default_sigint,
    )
    assert p.returncode == 130, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyhook: interrupted"), p.stderr


def test_importing_pyhook_from_a_program_leaves_sigint_alone():
    import subprocess
    import sys

    code = "import signal, pyhook; assert signal.getsignal(signal.SIGINT) is signal.default_int_handler"
    subprocess.run(
        [sys.executable, "-P", "-c", code], check=True, timeout=300, preexec_fn=_default_sigint
    )


def test_the_ctrl_c_tests_pass_in_a_suite_started_with_sigint_ignored():
    """``nohup pytest`` / ``pytest &``: the suite's process ignores SIGINT, and its children
    inherit that unless given the default disposition."""
    import signal
    import subprocess
    import sys

    p = subprocess.run(
        [
            sys.executable,
            "-I",
            "-m",
            "pytest",
            __file__,
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "-k",
            "ctrl_c_while or leaves_sigint_alone",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]
