"""Stores from someone else are untrusted input (issue 45, the store's part): each example of
the issue, locally and on S3 (moto's server, as in test_remote.py). The general property is
fuzzed in test_store_fuzz.py; docs/integrity.md, "Received stores: the threat model".
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import pyhook
from pyhook.cli import main
from pyhook.store import (
    CaptureDamagedError,
    ShardWriter,
    open_capture,
    verify_capture,
)
from pyhook.store import format as F


def _capture(out, batches=3, **kw):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    torch.nn.init.normal_(net[0].bias)
    with pyhook.capture(net, "0", out=str(out), shard_bytes=1, **kw) as rec:
        for i in range(rec.examples_done // 2, batches):
            net(torch.randn(2, 4, generator=torch.Generator().manual_seed(i)))
    return net


def _shard(out, i=0):
    return os.path.join(str(out), f"shard-r000-{i:06d}.safetensors")


def _edit_index(out, fn):
    """Edit the rank's index and recompute its checksum (what a careful forger does)."""
    path = os.path.join(str(out), "index-r000.json")
    with open(path) as f:
        part = json.load(f)
    part.pop("index_checksum")
    fn(part)
    with open(path, "w") as f:
        json.dump(F._with_checksum(part), f)


def _edit_header(out, i, fn=None, raw=None):
    """Rewrite shard ``i``'s header (``fn`` edits the parsed header, or ``raw`` replaces its
    text), then record the shard's new size and checksum in the index."""
    path = _shard(out, i)
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    if raw is None:
        header = json.loads(data[8 : 8 + n])
        fn(header)
        raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + n :])

    def relist(part):
        entry = part["shards"][i]
        entry["bytes"] = os.path.getsize(path)
        entry["checksum"] = F._file_checksum(path, "crc32c")

    _edit_index(out, relist)


def _cli_one_line(capsys, argv, needle):
    """``pyhook <argv>`` exits 2 with one line naming ``needle``, no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) >= 1, err
    first = err.strip().splitlines()[0]
    assert first.startswith("pyhook: error: ") and needle in first, err


def _refused_everywhere(out, capsys, needle, path=None):
    """verify (API and command), inspect and open all refuse, naming ``needle``."""
    problems, _ = verify_capture(str(out))
    assert any(needle in p for p in problems), problems
    with pytest.raises(CaptureDamagedError, match=needle.replace("[", r"\[")) as e:
        open_capture(str(out))
    if path is not None:
        assert e.value.path == path
    _cli_one_line(capsys, ["verify", str(out)], needle)
    _cli_one_line(capsys, ["inspect", str(out)], needle)


# -- item 2: a resume never writes through a link -------------------------------------------------
@pytest.mark.parametrize("name", ["index-r000.journal", ".lock-r000", "index-r000.json"])
@pytest.mark.parametrize("target", ["existing", "dangling"])
def test_resume_never_writes_through_a_link(tmp_path, name, target):
    out, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    net = _capture(out)
    victim = outside / "victim"
    if target == "existing":
        victim.write_bytes(b"someone else's file, no newline at its end")
        os.utime(victim, ns=(10**18, 10**18))
    link = out / name
    if name == "index-r000.json":  # the index itself, moved out of the store and linked
        os.replace(link, victim)
        os.utime(victim, ns=(10**18, 10**18))
    elif link.exists():
        link.unlink()
    before = (victim.read_bytes(), victim.stat().st_mtime_ns) if victim.exists() else None
    os.symlink(victim, link)
    with (
        pytest.raises(CaptureDamagedError, match="is a symbolic link") as e,
        pyhook.capture(net, "0", out=str(out), shard_bytes=1),
    ):
        net(torch.randn(2, 4))
    assert e.value.path == str(link)
    after = (victim.read_bytes(), victim.stat().st_mtime_ns) if victim.exists() else None
    assert after == before  # not truncated, not appended to, not created
    assert os.path.islink(link)  # and the link is still there to be seen


def test_a_journal_with_another_hard_link_is_not_written(tmp_path):
    out, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    _capture(out)
    victim = outside / "victim"
    victim.write_bytes(b"someone else's file, no newline at its end")
    os.link(victim, out / "index-r000.journal")
    with pytest.raises(CaptureDamagedError, match="other hard links") as e:
        ShardWriter(
            str(out), settings=json.loads((out / "index-r000.json").read_text())["settings"]
        )
    assert e.value.path == str(out / "index-r000.journal")
    assert victim.read_bytes() == b"someone else's file, no newline at its end"


# -- item 3: a listed shard that links out of the store is not read ----------------------------
def test_a_shard_linking_out_of_the_store_is_refused(tmp_path, capsys):
    out, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    _capture(out)
    copy = outside / "copy.safetensors"
    os.replace(_shard(out, 1), copy)  # the same bytes: only the link is wrong
    os.symlink(copy, _shard(out, 1))
    _refused_everywhere(out, capsys, "shard-r000-000001.safetensors: is a symbolic link")


# -- item 4 and 14: every header a reader cannot read is refused by verify too -----------------
def _float_shape(h):
    h["0"]["shape"] = [float(d) for d in h["0"]["shape"]]


def _float_offsets(h):
    h["0"]["data_offsets"] = [float(o) for o in h["0"]["data_offsets"]]


def _string_offsets(h):
    h["0"]["data_offsets"] = [str(o) for o in h["0"]["data_offsets"]]


def _null_offsets(h):
    h["0"]["data_offsets"] = None


def _metadata_int(h):
    h["__metadata__"] = 7


def _overlap(h):  # layer 0 and the statistics tensor: the same bytes read for both
    h["0"]["data_offsets"], h["__stats__.0"]["data_offsets"] = [0, 24], [0, 64]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (_float_shape, "has shape [2.0, 3.0] in the header"),
        (_float_offsets, "has data offsets [0.0, 24.0] in the header"),
        (_string_offsets, "has data offsets ['0', '24'] in the header"),
        (_null_offsets, "has data offsets None in the header"),
        (_metadata_int, "__metadata__ is not a table of strings"),
        (_overlap, "overlap the bytes of tensor"),
    ],
)
def test_a_header_no_reader_can_read_fails_verify(tmp_path, capsys, edit, needle):
    _capture(tmp_path)
    _edit_header(tmp_path, 0, edit)
    _refused_everywhere(tmp_path, capsys, needle, _shard(tmp_path, 0))


def test_a_negative_row_shape_in_the_index_and_the_header_fails_verify(tmp_path, capsys):
    _capture(tmp_path)
    for i in range(3):  # the index and every header agree on [2, -3]: only the schema sees it

        def neg(h):
            h["0"]["shape"] = [2, -3]
            h["0"]["data_offsets"] = [0, -24]

        _edit_header(tmp_path, i, neg)
    _edit_index(tmp_path, lambda p: p["layers"]["0"].update(row_shape=[-3]))
    _refused_everywhere(tmp_path, capsys, "layer '0' has row shape [-3]")


@pytest.mark.parametrize(
    "where", ["index-r000.json", "index-r000.journal", "shard-r000-000000.safetensors"]
)
def test_deeply_nested_json_is_one_line(tmp_path, capsys, where):
    """Nested 100,000 deep: a RecursionError inside the JSON parser, said as one line."""
    _capture(tmp_path)
    deep = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    if where == "index-r000.json":
        (tmp_path / where).write_bytes(deep)
    elif where == "index-r000.journal":
        (tmp_path / where).write_bytes(deep + b"\n")
    else:
        _edit_header(tmp_path, 0, raw=deep)
    _refused_everywhere(tmp_path, capsys, f"{where}: ", str(tmp_path / where))
    assert "nested more than" in verify_capture(str(tmp_path))[0][0]


@pytest.mark.parametrize(
    "field, value", [("byte_planes", 3), ("chunk_rows", 0), ("scale", "__nope__"), ("level", "1")]
)
def test_an_encoding_no_reader_can_decode_fails_verify(tmp_path, capsys, field, value):
    net = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pyhook.capture(net, "0", out=str(tmp_path), quantize="fp8", compress="zstd"):
        net(torch.randn(6, 4))
    _edit_index(tmp_path, lambda p: p["layers"]["0"]["encoding"].update({field: value}))
    needle = f"layer '0' has encoding field {field!r} = {value!r}"
    _refused_everywhere(tmp_path, capsys, needle, str(tmp_path / "index-r000.json"))


def test_json_beyond_the_depth_limit_is_refused_by_the_writer_first(tmp_path):
    """What the writer writes, the readers read: meta nested past the limit is refused."""
    meta: dict = {}
    for _ in range(F.MAX_JSON_DEPTH + 1):
        meta = {"m": meta}
    with pytest.raises(TypeError, match="meta is nested more than 64 levels deep"):
        ShardWriter(str(tmp_path), meta=meta)
    assert not list(tmp_path.iterdir())


def test_a_million_missing_ranks_are_counted_not_listed(tmp_path):
    _capture(tmp_path)
    _edit_index(tmp_path, lambda p: p.update(world_size=1 << 20))
    problems, _ = verify_capture(str(tmp_path))
    assert len(problems) == 21 and "1048555 more of the 1048576 ranks" in problems[-1]
    _edit_index(tmp_path, lambda p: p.update(world_size=(1 << 20) + 1))
    with pytest.raises(CaptureDamagedError, match=r"world_size 1048577 do not match"):
        open_capture(str(tmp_path))


def test_an_intact_store_still_reads_and_verifies(tmp_path, capsys):
    _capture(tmp_path, batches=4)
    assert verify_capture(str(tmp_path)) == ([], [])
    assert main(["verify", str(tmp_path)]) == 0
    assert open_capture(str(tmp_path), verify=True)["0"].shape == (8, 3)


# -- S3 ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from test_remote import s3_server

    with s3_server():
        yield "s3://pyhook/trust"


def _upload(local, url):
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    root = url.removeprefix("s3://")
    fs.rm(root, recursive=True) if fs.exists(root) else None
    for name in sorted(os.listdir(local)):
        if not name.startswith("."):
            fs.put_file(os.path.join(local, name), f"{root}/{name}")


def test_s3_errors_name_the_url_not_the_local_cache(tmp_path, s3, capsys):
    # a deeply nested shard header (its size and checksum recorded): read when first used
    _capture(tmp_path / "a")
    _edit_header(tmp_path / "a", 1, raw=b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    _upload(tmp_path / "a", s3)
    r = open_capture(s3)
    with pytest.raises(CaptureDamagedError, match="nested more than") as e:
        r["0"].to_tensor()
    assert e.value.path == f"{s3}/shard-r000-000001.safetensors"
    assert str(e.value).startswith(f"{s3}/shard-r000-000001.safetensors: ")
    problems, _ = verify_capture(s3)
    assert problems == [str(e.value)]
    _cli_one_line(capsys, ["verify", s3], f"{s3}/shard-r000-000001.safetensors: ")
    # an index that no reader can use: named by its URL when opened, verified and inspected
    _capture(tmp_path / "b")
    _edit_index(tmp_path / "b", lambda p: p["layers"]["0"].update(row_shape=[3.0]))
    _upload(tmp_path / "b", s3)
    with pytest.raises(CaptureDamagedError, match="row shape") as e:
        open_capture(s3)
    assert e.value.path == f"{s3}/index-r000.json"
    assert str(e.value).startswith(f"{s3}/index-r000.json: ")
    _cli_one_line(capsys, ["inspect", s3], f"{s3}/index-r000.json: ")
    _cli_one_line(capsys, ["verify", s3], f"{s3}/index-r000.json: ")
