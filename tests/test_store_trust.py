"""Stores from someone else are untrusted input (issue 45, the store's part): each example of
the issue, locally and on S3 (moto's server, as in test_remote.py). The general property is
fuzzed in test_store_fuzz.py; docs/integrity.md, "Received stores: the threat model".
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
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


# -- issue 49 items 2 and 18, issue 52 item 6: stray copies of an index on S3 -------------------
@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("index-r000 (1).json", False),
        ("index-r000.bak.json", False),
        ("index-r000.json.bak", False),
        ("index-r0000.json", True),
        ("index-r" + "9" * 200 + ".json", True),
    ],
)
def test_s3_a_copy_of_an_index_is_not_read_and_a_second_claim_is_refused(
    tmp_path, s3, capsys, name, refused
):
    _capture(tmp_path / "a")
    want = open_capture(str(tmp_path / "a"))["0"].to_tensor()
    with open(tmp_path / "a" / "index-r000.json", "rb") as f:
        (tmp_path / "a" / name).write_bytes(f.read())
    _upload(tmp_path / "a", s3)
    url = f"{s3}/{name}"
    if refused:
        with pytest.raises(CaptureDamagedError) as e:
            open_capture(s3)
        assert e.value.path == url and str(e.value).startswith(url + ": ")
        problems, _ = verify_capture(s3)
        assert problems == [str(e.value)]
        _cli_one_line(capsys, ["verify", s3], url + ": ")
        return
    got = open_capture(s3, verify=True)["0"].to_tensor()
    assert torch.equal(got, want)  # each row once
    problems, notes = verify_capture(s3)
    assert problems == []
    if name.endswith(".json"):
        assert any(n.startswith(url + ": ") for n in notes), notes
    assert main(["verify", s3]) == 0, capsys.readouterr().err


# -- compact stores and texts: what the readers decode, verify checks first ----------------------
def _compact(out):
    """A compact store (fp8 rows in zstd frames) of 2 shards, and its rows as read."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pyhook.capture(net, "0", out=str(out), quantize="fp8", compress="zstd", shard_bytes=1):
        for i in range(2):
            net(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)))
    return open_capture(str(out))["0"].to_tensor()


def _edit_tensor(out, i, name, fn):
    """Rewrite the bytes of tensor ``name`` of shard ``i`` (``fn`` edits them as a numpy array
    of the tensor's dtype), then record the shard's new size and checksum in the index."""
    path = _shard(out, i)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    (n,) = struct.unpack("<Q", data[:8])
    h = json.loads(data[8 : 8 + n])[name]
    a, b = (8 + n + o for o in h["data_offsets"])
    dtype = {"I64": "<i8", "U8": "u1"}[h["dtype"]]
    arr = np.frombuffer(bytes(data[a:b]), dtype=dtype).copy()
    fn(arr)
    data[a:b] = arr.tobytes()
    with open(path, "wb") as f:
        f.write(data)
    _edit_index(out, lambda p: p["shards"][i].update(checksum=F._file_checksum(path, "crc32c")))


def _refused_by_verify_and_read(out, needle, path):
    """verify names ``needle`` for shard ``path``; the read that decodes it refuses, naming it."""
    problems, _ = verify_capture(str(out))
    assert [p for p in problems if p.startswith(path + ": ") and needle in p], problems
    with pytest.raises(CaptureDamagedError) as e:
        open_capture(str(out))["0"].to_tensor()
    assert e.value.path == path and path in str(e.value)


def test_a_compact_store_verifies_and_reads(tmp_path):
    rows = _compact(tmp_path)
    assert verify_capture(str(tmp_path)) == ([], [])
    assert rows.shape == (6, 8)


def test_a_compressed_layer_whose_row_shape_is_edited_fails_verify(tmp_path):
    """The frames decode to 8 bytes a row; the index (checksum recomputed) says 4."""
    _compact(tmp_path)
    _edit_index(tmp_path, lambda p: p["layers"]["0"].update(row_shape=[4]))
    _refused_by_verify_and_read(tmp_path, "decodes to 24 bytes", _shard(tmp_path, 0))


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda o: o.__setitem__(-1, o[-1] - 1), "has frames over bytes 0.."),  # a byte short
        (lambda o: o.__setitem__(0, 1), "has frames over bytes 1.."),  # the first byte skipped
    ],
    ids=["short", "skipped"],
)
def test_a_forged_frame_table_fails_verify(tmp_path, edit, needle):
    _compact(tmp_path)
    _edit_tensor(tmp_path, 1, "__chunks__.0", edit)
    _refused_by_verify_and_read(tmp_path, needle, _shard(tmp_path, 1))


def test_a_frame_of_another_size_fails_verify(tmp_path):
    """A well-formed zstd frame (its checksums right) holding one row less than its chunk."""
    import zstandard

    rows = _compact(tmp_path)
    fewer = zstandard.ZstdCompressor(write_content_size=True).compress(b"\x01" * 16)
    path = _shard(tmp_path, 0)
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = bytearray(data[8 + n :])
    a, b = header["0"]["data_offsets"]
    body[a:b] = fewer
    shift = len(fewer) - (b - a)
    for name, h in header.items():  # every tensor after the blob moves by the size change
        if name != "__metadata__":
            lo, hi = h["data_offsets"]
            h["data_offsets"] = [lo + shift * (lo >= b), hi + shift * (hi >= b)]
    c0, c1 = header["__chunks__.0"]["data_offsets"]
    body[c0:c1] = np.array([0, len(fewer)], dtype="<i8").tobytes()
    header["0"]["shape"] = [len(fewer)]
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + body)

    def relist(part):
        part["shards"][0].update(bytes=os.path.getsize(path))
        part["shards"][0].update(checksum=F._file_checksum(path, "crc32c"))

    _edit_index(tmp_path, relist)
    _refused_by_verify_and_read(tmp_path, "decodes to 16 bytes, the 3 rows of its chunk", path)
    assert rows.shape == (6, 8)


def _texts(out, lengths, raw, prompts=None):
    """A store (written by the ordinary writer: every checksum right) holding these texts."""
    extra = {"__text_prompt_bytes__": torch.tensor(prompts)} if prompts is not None else {}
    with ShardWriter(str(out)) as w:
        w.add(
            {
                "x": torch.zeros(1, 1),
                "__text_lengths__": torch.tensor(lengths),
                "__text_bytes__": torch.tensor(list(raw), dtype=torch.uint8),
                **extra,
            },
            examples=len(lengths),
        )
    return _shard(out, 0)


@pytest.mark.parametrize(
    "lengths, raw, example, needle",
    [
        ([2, 2], b"ok\xff\xfe", 1, "text 1 in '__text_bytes__' is not utf-8"),
        ([3], b"hello", 0, "add up to 3 bytes, '__text_bytes__' holds 5"),
        ([-1, 6], b"hello", 1, "length -1"),
        ([7, -2], b"hello", 0, "length -2"),
    ],
    ids=["not-utf8", "short", "negative", "negative-later"],
)
def test_forged_texts_fail_verify_and_text_names_the_shard(tmp_path, lengths, raw, example, needle):
    path = _texts(tmp_path, lengths, raw)
    problems, _ = verify_capture(str(tmp_path))
    assert [p for p in problems if p.startswith(path + ": ") and needle in p], problems
    with pytest.raises(CaptureDamagedError, match=needle) as e:
        pyhook.annotations.text(open_capture(str(tmp_path)), example)
    assert e.value.path == path


def test_a_prompt_splitting_a_character_is_a_named_error(tmp_path):
    path = _texts(tmp_path, [3], "hé".encode(), prompts=[2])  # "h" and half of "é"
    r = open_capture(str(tmp_path))
    assert pyhook.annotations.text(r, 0) == "hé"
    with pytest.raises(CaptureDamagedError, match="do not split it into utf-8") as e:
        pyhook.annotations.completion(r, 0)
    assert e.value.path == path


def test_valid_texts_still_verify_and_read(tmp_path):
    _texts(tmp_path, [2, 0, 6], "hiwörld".encode())
    assert verify_capture(str(tmp_path)) == ([], [])
    r = open_capture(str(tmp_path))
    assert [pyhook.annotations.text(r, i) for i in range(3)] == ["hi", "", "wörld"]


def test_s3_verify_checks_texts_as_local_verify_does(tmp_path, s3):
    # forged texts (every checksum right): the same problem from `pyhook verify s3://...`,
    # named by the shard's URL, as from a local verify
    _texts(tmp_path / "t", [2, 2], b"ok\xff\xfe")
    local, _ = verify_capture(str(tmp_path / "t"))
    assert any("is not utf-8" in p for p in local), local
    _upload(tmp_path / "t", s3)
    problems, _ = verify_capture(s3)
    assert [
        p
        for p in problems
        if p.startswith(f"{s3}/shard-r000-000000.safetensors: ") and "is not utf-8" in p
    ], problems
