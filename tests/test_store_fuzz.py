"""Received stores are untrusted input (issue 45): a store made by ``pyhook.capture``, its index
files, journal and shard headers mutated by hypothesis, then verified, read and resumed.

Each mutation is one change to one file: a JSON value replaced (near misses of the right value:
off by one, negative, a float, a string, ``null``; other types; ``NaN``; nesting 5,000 deep), a
key or list element removed, a key added, raw bytes flipped, inserted or cut, or the file
replaced by a symbolic link (to a file outside the store, to an identical copy of it outside, or
to a path outside that does not exist), or, in a shard, an offset of a compressed layer's zstd
frame table moved (checksums recomputed). Half the JSON mutations recompute the checksums that
cover them (the index's, the journal line's, the shard's size and checksum in its entry), so
that the mutation reaches the schema checks rather than the checksum alone.

What must hold for every mutation:

* ``open_capture(verify=True)`` either reads exactly the original rows of the shards the
  mutated index lists (in its order, every layer), or raises a named pyhook error
  (:class:`CaptureDamagedError`; ``FileNotFoundError`` only for a store whose index is gone)
  whose message names a file of the store; so does a read without ``verify``, which may read
  other bytes only where a checksum alone could tell;
* ``verify_capture`` finds a problem whenever that read is refused (verify passes: the readers
  read), and a link is always refused, naming it;
* a resume (``pyhook.capture`` on the same directory) succeeds or raises a named error;
* nothing outside the store is opened, written or created: a sentinel file outside keeps its
  bytes and mtime, no path outside is created, and no ``open`` (audited with
  :func:`sys.addaudithook`) names a path outside.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import warnings

import pytest
import torch
from _hygiene import bounded
from hypothesis import event, given
from hypothesis import strategies as st

import pyhook
from pyhook.store import CaptureDamagedError, CaptureExistsError, open_capture, verify_capture
from pyhook.store import format as F

N_SHARDS = 4
DEEP = "\x00deep\x00"  # stands for a value nested 5,000 deep (json.dumps cannot write one)
FILES = [
    "index-r000.json",
    "index-r000.journal",
    "index.json",
    *[f"shard-r000-{i:06d}.safetensors" for i in range(N_SHARDS)],
]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 5))


def _capture(net: torch.nn.Module, out: str, batches: list[torch.Tensor], **kw) -> None:
    with pyhook.capture(net, ["0", "1"], out=out, shard_bytes=1, **kw) as rec:
        for b in batches[rec.examples_done // 2 :]:
            net(b)


#: A plain store, and a compact one (fp8 rows, zstd chunks: an ``encoding`` in the layer table
#: and ``__scale__``/``__chunks__`` tensors in the shards).
KINDS = {"plain": {}, "compact": {"quantize": "fp8", "compress": "zstd"}}


@pytest.fixture(scope="module", params=list(KINDS))
def original(request, tmp_path_factory):
    """A store of 4 shards in the state a crash leaves: the first 2 shards in the index, the
    last 2 in the journal; with its rows per shard (every layer, the reserved ones too, as the
    reader gives them) and the capture's options."""
    kw = KINDS[request.param]
    base = tmp_path_factory.mktemp("original")
    out = str(base / "store")
    g = torch.Generator().manual_seed(1)
    _capture(_net(), out, [torch.randn(2, 4, generator=g) for _ in range(N_SHARDS)], **kw)
    path = os.path.join(out, "index-r000.json")
    with open(path) as f:
        part = json.load(f)
    part.pop("index_checksum")
    head, tail = part["shards"][:2], part["shards"][2:]
    with open(F._journal_path(path), "wb") as f:
        for entry in tail:
            f.write(F.journal_line(entry, None))
    with open(path, "w") as f:
        json.dump(F._with_checksum({**part, "shards": head}), f)
    r = open_capture(out, verify=True)
    layers = list(r.index["layers"])
    rows: dict[str, dict[str, torch.Tensor]] = {s["file"]: {} for s in r.index["shards"]}
    for n in layers:  # each layer's rows as read, split into the shards that hold them
        listed = [s for s in r.index["shards"] if n in s["rows"]]
        parts = r.layer(n).to_tensor().split([s["rows"][n] for s in listed])
        for s, t in zip(listed, parts):
            rows[s["file"]][n] = t
    assert len(rows) == N_SHARDS and verify_capture(out) == ([], [])
    return out, layers, rows, kw


# -- mutations -------------------------------------------------------------------------------
def _paths(obj, at=()):
    yield at
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for k, v in items:
        yield from _paths(v, (*at, k))


def _near(v):
    """Values close to ``v`` that a careless check lets through."""
    if isinstance(v, bool):
        return [not v, int(v)]
    if isinstance(v, int):
        return [v + 1, v - 1, -v - 1, float(v), str(v), v * 2**40, None]
    if isinstance(v, float):
        return [int(v), -v]
    if isinstance(v, str):
        return [v + "x", v[:-1], "../" + v, v.upper(), 0]
    if isinstance(v, list):
        return [v[:-1], [*v, *v[-1:]], [float(x) if isinstance(x, int) else x for x in v], {}]
    if isinstance(v, dict):
        return [[], 7, {k: v[k] for k in list(v)[:-1]}]
    return [0]


JSON_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(),  # NaN and infinities too: not JSON, written as the tokens Python's json writes
    st.text(max_size=4),
    st.none(),
    st.booleans(),
    st.lists(st.integers(-3, 10), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-2, 5), max_size=2),
    st.just(DEEP),
)


def _dumps(obj) -> bytes:
    text = json.dumps(obj, separators=(",", ":"))
    return text.replace(json.dumps(DEEP), "[" * 5000 + "]" * 5000).encode()


@st.composite
def json_edits(draw, obj):
    """``obj`` with one value replaced, removed or added (``None``: nothing to change)."""
    obj = json.loads(json.dumps(obj))
    paths = list(_paths(obj))
    at = draw(st.sampled_from(paths))
    parent = obj
    for k in at[:-1]:
        parent = parent[k]
    old = parent[at[-1]] if at else obj
    op = draw(st.sampled_from(["near", "near", "value", "remove", "add"]))
    if op == "near":
        new = draw(st.sampled_from(_near(old)))
    elif op == "value" or (op == "remove" and not at):
        new = draw(JSON_VALUES)
    elif op == "add":
        if not isinstance(old, (dict, list)):
            return None
        value = draw(JSON_VALUES)
        if isinstance(old, dict):
            old[draw(st.sampled_from(["x", "__metadata__", "shard", "0", "rows", ""]))] = value
        else:
            old.insert(draw(st.integers(0, len(old))), value)
        return obj
    else:
        del parent[at[-1]]
        return obj
    if not at:
        return new
    parent[at[-1]] = new
    return obj


def _header(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _relist(out: str, name: str) -> None:
    """Record shard ``name``'s new size and checksum in whichever document lists it (the index
    or a journal line), with that document's own checksum."""
    path = os.path.join(out, name)
    size, checksum = os.path.getsize(path), F._file_checksum(path, "crc32c")
    index = os.path.join(out, "index-r000.json")
    with open(index) as f:
        part = json.load(f)
    for s in part["shards"]:
        if s.get("file") == name:
            s.update(bytes=size, checksum=checksum)
    part.pop("index_checksum", None)
    with open(index, "w") as f:
        json.dump(F._with_checksum(part), f)
    journal = F._journal_path(index)
    with open(journal, "rb") as f:
        lines = [json.loads(x) for x in f.read().splitlines()]
    with open(journal, "wb") as f:
        for obj in lines:
            if obj["entry"].get("file") == name:
                obj["entry"].update(bytes=size, checksum=checksum)
            f.write(F.journal_line(obj["entry"], obj.get("layers")))


@st.composite
def mutations(draw):
    """``(file, kind, how)``: one change to one file of the store."""
    name = draw(st.sampled_from([*FILES, ".lock-r000"]))
    kinds = ["link"] if name == ".lock-r000" else ["json", "json", "json", "bytes", "link"]
    if name.startswith("shard-"):
        kinds.append("frames")
    kind = draw(st.sampled_from(kinds))
    if kind == "frames":  # an offset of a compressed layer's frame table (checksums recomputed)
        return name, kind, (draw(st.floats(0, 1)), draw(st.sampled_from([1, -1, 7, -(2**40)])))
    if kind == "link":
        return name, kind, draw(st.sampled_from(["sentinel", "copy", "dangling"]))
    if kind == "bytes":
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        return name, kind, (op, draw(st.floats(0, 1)), draw(st.integers(1, 255)))
    return name, kind, draw(st.booleans())  # recompute the checksums


def _apply(out: str, outside: str, name: str, kind: str, how, data) -> None:
    path = os.path.join(out, name)
    if kind == "link":
        target = {
            "sentinel": os.path.join(outside, "sentinel"),
            "copy": os.path.join(outside, "copy-" + name),
            "dangling": os.path.join(outside, "created"),
        }[how]
        if how == "copy":
            shutil.copyfile(path, target)
        with _suppress_missing():
            os.remove(path)
        os.symlink(target, path)
        return
    shard = name.startswith("shard-")
    if kind == "frames":  # (a plain store has no frame table: nothing changes)
        where, delta = how
        header, body = _header(path)
        tables = sorted(n for n in header if n.startswith("__chunks__."))
        if not tables:
            return
        a, b = header[tables[int(where * len(tables)) % len(tables)]]["data_offsets"]
        offsets = bytearray(body[a:b])
        i = 8 * (int(where * (len(offsets) // 8)) % (len(offsets) // 8))
        (v,) = struct.unpack("<q", offsets[i : i + 8])
        offsets[i : i + 8] = struct.pack("<q", v + delta)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - len(body) + a)
            f.write(offsets)
        _relist(out, name)
        return
    if kind == "bytes":
        op, where, byte = how
        with open(path, "rb") as f:
            raw = bytearray(f.read())
        end = 8 + struct.unpack("<Q", raw[:8])[0] if shard else len(raw)  # the header, in a shard
        at = min(int(where * end), end - 1)
        if op == "flip":
            raw[at] ^= byte
        elif op == "cut":
            del raw[at:end]
        else:
            raw[at:at] = bytes([byte])
        with open(path, "wb") as f:
            f.write(raw)
        return
    fix = how
    if shard:
        header, body = _header(path)
        header = data.draw(json_edits(header))
        if header is None:
            return
        raw = _dumps(header)
        raw += b" " * (-(8 + len(raw)) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw + body)
        if fix:
            _relist(out, name)
        return
    if name.endswith(".journal"):
        with open(path, "rb") as f:
            lines = [json.loads(x) for x in f.read().splitlines()]
        i = data.draw(st.integers(0, len(lines) - 1))
        obj = data.draw(json_edits(lines[i]))
        if obj is None:
            return
        if fix and isinstance(obj, dict) and isinstance(obj.get("entry"), dict):
            lines[i] = json.loads(F.journal_line(obj["entry"], obj.get("layers")))
            out_lines = [_dumps(x) for x in lines]
        else:
            out_lines = [_dumps(x) for x in lines[:i]] + [_dumps(obj)]
            out_lines += [_dumps(x) for x in lines[i + 1 :]]
        with open(path, "wb") as f:
            f.write(b"".join(x + b"\n" for x in out_lines))
        return
    with open(path) as f:
        obj = data.draw(json_edits(json.load(f)))
    if obj is None:
        return
    if fix and isinstance(obj, dict):
        obj.pop("index_checksum", None)
        obj = F._with_checksum(obj)
    with open(path, "wb") as f:
        f.write(_dumps(obj))


class _suppress_missing:
    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        return kind is not None and issubclass(kind, FileNotFoundError)


# -- the checks ------------------------------------------------------------------------------
_OPENED: list[str] = []
_AUDITING = [False]


def _audit(event: str, args: tuple) -> None:
    if _AUDITING[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_audit)


def _state(path: str) -> tuple[bytes, int]:
    with open(path, "rb") as f:
        return f.read(), os.stat(path).st_mtime_ns


def _named(e: BaseException, out: str) -> None:
    """``e`` is one of pyhook's named errors and its message names a file of the store."""
    assert isinstance(e, (CaptureDamagedError, CaptureExistsError, FileNotFoundError)), repr(e)
    text = str(e)
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    if isinstance(e, CaptureDamagedError):
        assert e.path and os.path.dirname(os.path.abspath(e.path)) == os.path.abspath(out), e.path
        assert e.path in text, text
    else:
        assert out in text, text


def _read_all(out: str, layers: list[str], rows: dict, *, verify: bool) -> list[str] | None:
    """The shards the store lists, read through the reader with every layer compared with
    the original rows of those shards; ``None`` when refused (a named error)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a world_size edited upwards: "missing ranks"
            r = open_capture(out, verify=verify)
            listed = [s["file"] for s in r.index["shards"]]
            got = {n: r.layer(n).to_tensor() for n in r.index["layers"]}
    except Exception as e:  # checked: a named error
        _named(e, out)
        return None
    assert set(listed) <= set(rows), listed
    assert set(got) <= set(layers), list(got)
    for n, t in got.items():
        want = [rows[f][n] for f in listed if n in rows[f]]
        if verify and not want:
            assert t.numel() == 0, n
        elif verify:  # (unverified, only a checksum tells a changed data byte)
            expected = torch.cat(want)
            assert t.dtype == expected.dtype and torch.equal(t, expected), n
    return listed


@bounded(150)
@given(mutation=mutations(), data=st.data())
def test_a_mutated_store_is_read_exactly_or_refused_by_name(
    original, tmp_path_factory, mutation, data
):
    src, layers, rows, kw = original
    base = tmp_path_factory.mktemp("fuzz")
    out, outside = str(base / "store"), str(base / "outside")
    shutil.copytree(src, out, symlinks=True)
    os.mkdir(outside)
    sentinel = os.path.join(outside, "sentinel")
    with open(sentinel, "wb") as f:
        f.write(b"not part of any store\n" * 3)
    os.utime(sentinel, ns=(10**18, 10**18))
    before = _state(sentinel)
    name, kind, how = mutation
    _apply(out, outside, name, kind, how, data)
    copies = set(os.listdir(outside))

    _OPENED.clear()
    _AUDITING[0] = True
    try:
        problems, _notes = verify_capture(out)
        verified = _read_all(out, layers, rows, verify=True)
        _read_all(out, layers, rows, verify=False)
        try:
            _capture(_net(), out, [], **kw)  # a resume: checks, then rewrites the index
        except Exception as e:  # checked: a named error
            _named(e, out)
    finally:
        _AUDITING[0] = False

    event(f"{kind}: {'read' if verified is not None else 'refused'}")
    assert _state(sentinel) == before
    assert set(os.listdir(outside)) == copies  # nothing created outside (a dangling link's path)
    assert not [p for p in _OPENED if p.startswith(outside + os.sep)], _OPENED
    for line in problems:
        assert out in line and "Traceback" not in line, line
    if verified is None:  # (compact stores too: verify checks the zstd frame table and sizes)
        assert problems, "a store the verified reader refuses passed verify"
    if not problems:
        assert verified is not None, "verify passed a store the reader refuses"
    if kind == "link":  # a link in the store is named by verify, whichever file it replaces,
        linked = os.path.join(out, name)  # and refused by the readers when they would read it
        assert any(p.startswith(linked + ":") and "symbolic link" in p for p in problems)
        if name not in ("index.json", ".lock-r000"):
            assert verified is None


# -- stray and near-miss file names (issue 49 items 2 and 18) ---------------------------------
#: Copies a person or a tool leaves beside a file: never part of the store (not read; kept).
COPY_NAMES = [
    "{stem} (1){ext}",
    "{stem}.bak{ext}",
    "{stem}-copy{ext}",
    "{name}.bak",
    "{name}~",
    "Copy of {name}",
    ".{name}.swp",
]
#: Names that claim rank 0 (or a rank past any world) as an index file: refused by name.
CLAIMING_NAMES = [
    "index-r0000.json",
    "index-r00.json",
    "index-r0.json",
    "index-r00000000000000000000000000000.json",
    "index-r" + "9" * 200 + ".json",
]


@st.composite
def strays(draw):
    """``(source file, stray name, refused)``: a copy of a store file under another name."""
    source = draw(st.sampled_from(FILES))
    if draw(st.booleans()):
        stem, ext = os.path.splitext(source)
        pattern = draw(st.sampled_from(COPY_NAMES))
        return source, pattern.format(stem=stem, ext=ext, name=source), False
    return source, draw(st.sampled_from(CLAIMING_NAMES)), True


@bounded(40)
@given(stray=strays())
def test_stray_and_near_miss_names_are_ignored_or_refused_by_name(
    original, tmp_path_factory, stray
):
    """A copy beside the store's files is not read: exactly the original rows, once, verify
    passes (a note names an index-like copy) and a resume keeps the copy. A name that claims a
    rank's index another way (``index-r0000.json`` beside ``index-r000.json``) is refused by
    the readers, verify and a resume, naming it."""
    src, layers, rows, kw = original
    out = str(tmp_path_factory.mktemp("stray") / "store")
    shutil.copytree(src, out, symlinks=True)
    source, name, refused = stray
    shutil.copyfile(os.path.join(out, source), os.path.join(out, name))
    path = os.path.join(out, name)

    problems, notes = verify_capture(out)
    verified = _read_all(out, layers, rows, verify=True)
    unverified = _read_all(out, layers, rows, verify=False)
    try:
        _capture(_net(), out, [], **kw)
        resumed = None
    except Exception as e:  # checked: a named error
        _named(e, out)
        resumed = e
    if refused:
        assert verified is None and unverified is None, "a second index of rank 0 was read"
        assert any(p.startswith(path + ":") for p in problems), problems
        assert isinstance(resumed, CaptureDamagedError) and resumed.path == path, resumed
    else:
        assert problems == [], problems
        assert verified == unverified == [s for s in rows], "a copy's rows were read"
        assert resumed is None
        if name.startswith("index-r") and name.endswith(".json"):
            assert any(n.startswith(path + ":") for n in notes), notes
        assert verify_capture(out)[0] == []
        with open(os.path.join(src, source), "rb") as f, open(path, "rb") as g:
            assert g.read() == f.read()  # the copy is kept, as it was


@pytest.mark.parametrize("where", ["rank", "number"])
def test_a_shard_name_of_5000_digits_in_an_index_is_damage_naming_the_file(
    original, tmp_path, where
):
    src = original[0]
    out = str(tmp_path / "store")
    shutil.copytree(src, out, symlinks=True)
    path = os.path.join(out, "index-r000.json")
    with open(path) as f:
        part = json.load(f)
    part.pop("index_checksum")
    digits = "1" * 5000
    part["shards"][0]["file"] = (
        f"shard-r{digits}-000000.safetensors"
        if where == "rank"
        else f"shard-r000-{digits}.safetensors"
    )
    with open(path, "w") as f:
        json.dump(F._with_checksum(part), f)
    for verify in (True, False):
        with pytest.raises(CaptureDamagedError) as e:
            open_capture(out, verify=verify)
        _named(e.value, out)
        assert e.value.path == path
    problems, _ = verify_capture(out)
    assert problems and all(p.startswith(path + ":") for p in problems), problems
