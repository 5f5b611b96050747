"""Captures on object storage (issue 19 item 3), against a real S3-compatible server.

A module fixture starts moto's standalone S3 server (``python -m moto.server``) on 127.0.0.1 at a
free port and points fsspec/s3fs at it through ``AWS_ENDPOINT_URL`` with dummy keys; nothing of
pyhook is mocked. Checked: a capture to ``s3://`` is byte-for-byte the local one, reads stream
shards through a bounded cache with prefetch, ``verify`` works on URLs, two gloo ranks write one
prefix, a capture SIGKILLed at each upload step resumes to the same bytes, and the bad inputs
(no backend, wrong credentials, a missing bucket, a bucket or shard that vanishes mid-read) are
named errors that come back quickly.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

import pyhook
from pyhook.cli import main
from pyhook.store import (
    CaptureDamagedError,
    RemoteStorageError,
    ShardWriter,
    open_capture,
    verify_capture,
)

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")

SETTINGS = {"what": "remote"}
N_BATCHES, PER_BATCH = 8, 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto(**env: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.skip("moto's S3 server did not start")
            time.sleep(0.1)


@contextlib.contextmanager
def s3_server():
    """A moto S3 server on a free port with bucket ``pyhook``, and the environment that points
    fsspec/s3fs at it (restored after); yields the environment (spawned ranks pass it on)."""
    proc, port = _start_moto()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("pyhook")
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def s3():
    """A running S3 server with bucket ``pyhook``; yields a function giving fresh prefixes."""
    with s3_server():
        counter = itertools.count()
        yield lambda: f"s3://pyhook/run{next(counter)}"


def _fs():
    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


def _names(url: str) -> list[str]:
    """The objects under ``url``, relative to it (a listing only: nothing is read)."""
    root = url.removeprefix("s3://")
    # An empty prefix lists as the prefix itself (found racing the first uploads): not an object.
    return [p[len(root) + 1 :] for p in sorted(_fs().find(root)) if p != root]


def _objects(url: str) -> dict[str, bytes]:
    fs = _fs()
    root = url.removeprefix("s3://")
    return {n: fs.cat_file(f"{root}/{n}") for n in _names(url)}


def _local_files(out) -> dict[str, bytes]:
    files = {}
    for name in sorted(os.listdir(out)):
        if not name.startswith(".lock"):
            with open(os.path.join(out, name), "rb") as f:
                files[name] = f.read()
    return files


def _batches():
    g = torch.Generator().manual_seed(0)
    return [
        {
            "a": torch.randn(PER_BATCH, 4, generator=g),
            "b": torch.randn(PER_BATCH + 1, 2, generator=g).to(torch.bfloat16),
        }
        for _ in range(N_BATCHES)
    ]


def _write(out):
    """The README's loop: open (resuming), skip what is stored, add the rest."""
    with ShardWriter(out, settings=SETTINGS, shard_bytes=150) as w:
        for b in _batches()[w.examples_done // PER_BATCH :]:
            w.add(b, examples=PER_BATCH)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_capture_to_s3_is_the_local_capture(s3, tmp_path):
    url, local = s3(), tmp_path / "local"
    net, xs = (
        _net(),
        [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)],
    )
    for out in (url, local):
        with pyhook.capture(net, ["0", "2"], out=out, shard_bytes=1) as rec:
            for x in xs:
                net(x)
        assert rec.batches == 6
    assert _objects(url) == _local_files(local)  # same shards, same index, same bytes
    r = open_capture(url)
    assert r.layers == ["0", "2"] and r.path == url
    with torch.no_grad():
        ref = torch.cat([net[0](x) for x in xs])
    assert torch.equal(r["0"][:], ref)
    assert torch.equal(r["2"][:], open_capture(local)["2"][:])
    assert verify_capture(url) == ([], [])
    assert main(["verify", url]) == 0


def _cached_bytes(directory: str) -> int:
    """Bytes of the shards (and downloads in progress) in the cache directory. The prefetch
    thread renames a finished download (``.part``) while this lists the folder: measure again."""
    while True:
        try:
            return sum(
                os.path.getsize(os.path.join(directory, n))
                for n in os.listdir(directory)
                if n.startswith("shard-")
            )
        except FileNotFoundError:
            continue


def test_reads_stream_through_a_bounded_cache(s3):
    url = s3()
    x = torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256)
    with ShardWriter(url, shard_bytes=1) as w:
        for i in range(0, 64, 4):  # 16 shards of 4 KB
            w.add({"h": x[i : i + 4]}, examples=4)
    shard = 4 * 256 * 4
    r = open_capture(url, cache_bytes=3 * shard, prefetch=1)
    cache = r._remote_cache
    assert torch.equal(r["h"][0], x[0])
    assert cache.downloads <= 2  # the first batch needed one shard (and one prefetched), not 16
    for i, batch in enumerate(r.batches(4)):
        assert torch.equal(batch["h"], x[4 * i : 4 * i + 4])
        on_disk = _cached_bytes(cache.dir)
        assert on_disk <= 3 * shard + 2 * (shard + 200)  # the bound, plus prefetch in flight
    assert cache.downloads >= 16
    # shuffled reads come back right through evictions too
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(r["h"][perm], x[perm])
    r.close()
    assert not os.path.exists(cache.dir)


def test_verify_on_memory_and_file_urls(tmp_path):
    for url in (f"memory://pyhook-test/{os.getpid()}", f"file://{tmp_path}/cap"):
        _write(url)
        assert verify_capture(url) == ([], [])
        assert main(["verify", url]) == 0
        r = open_capture(url, verify=True)
        assert torch.equal(r["a"][:], torch.cat([b["a"] for b in _batches()]))


KILL_SCRIPT = """
import os, signal, sys
import torch
from pyhook.store import ShardWriter, format as fmt
step, k, url = sys.argv[1], int(sys.argv[2]), sys.argv[3]
seen = {}
def hook(s):
    seen[s] = seen.get(s, 0) + 1
    if s == step and seen[s] == k:
        os.kill(os.getpid(), signal.SIGKILL)
fmt._fault_hook = hook
g = torch.Generator().manual_seed(0)
batches = [{"a": torch.randn(3, 4, generator=g),
            "b": torch.randn(4, 2, generator=g).to(torch.bfloat16)} for _ in range(8)]
with ShardWriter(url, settings={"what": "remote"}, shard_bytes=150) as w:
    for b in batches[w.examples_done // 3:]:
        w.add(b, examples=3)
sys.exit(4)
"""

KILLS = [
    ("upload.shard", 2),  # a shard in the bucket, not listed there
    ("upload.listed", 3),  # the third shard listed (as an entry object)
    ("journal.fsynced", 2),  # the last shard listed locally, maybe not uploaded
    ("upload.index", 1),  # closing: the compacted index uploaded, entry objects not removed
    ("merged.replaced", 1),  # closing: merged index written locally, not uploaded
]


@pytest.mark.parametrize("step, k", KILLS, ids=[f"{s}#{k}" for s, k in KILLS])
def test_killed_capture_resumes_from_the_bucket(s3, step, k):
    ref, url = s3(), s3()
    _write(ref)
    p = subprocess.run(
        [sys.executable, "-I", "-c", KILL_SCRIPT, step, str(k), url],
        capture_output=True,
        timeout=120,
    )
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr.decode()[-2000:])
    _write(url)  # resume
    assert _objects(url) == _objects(ref)
    assert torch.equal(open_capture(url, verify=True)["b"][:], open_capture(ref)["b"][:])


# -- two gloo ranks, one prefix -----------------------------------------------------------------------
def _rank_worker(rank: int, world: int, port: int, url: str, env: dict) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        net = _net()
        xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
        share = xs[rank * 4 : rank * 4 + 4]  # contiguous shares: the index keeps data order
        with pyhook.capture(net, "0", out=url, shard_bytes=1) as rec:
            for x in share[rec.examples_done // 5 :]:
                net(x)
    finally:
        dist.destroy_process_group()


def test_two_ranks_write_one_prefix(s3):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    url = s3()
    env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    ctx = mp.spawn(_rank_worker, args=(2, _free_port(), url, env), nprocs=2, join=False)
    deadline = time.monotonic() + 150
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the ranks did not finish in 150 s: a hang")
    names = set(_objects(url))
    assert {"index.json", "index-r000.json", "index-r001.json"} <= names
    assert not [n for n in names if ".d/" in n]  # the entry objects were compacted away
    r = open_capture(url, verify=True)
    assert r.index["world_size"] == 2 and r.index["ranks"] == [0, 1]
    net = _net()
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    with torch.no_grad():
        ref = torch.cat([net[0](x) for x in xs])
    assert torch.equal(r["0"][:], ref)
    assert verify_capture(url) == ([], [])


def _two_ranks(out, global_rows: bool) -> None:
    """Two data-parallel ranks' rows: example indices that are global, or (what main wrote
    once) that each rank counted from 0, so that both ranks store examples 0 and 1."""
    for rank in (1, 0):  # rank 0 last: it merges the index
        with ShardWriter(out, rank=rank, world_size=2, shard_bytes=1) as w:
            for k in range(2):
                e = 2 * k + rank if global_rows else k
                rows = torch.tensor([[e, 0], [e, 1]])
                w.add({"x": torch.randn(2, 4), "__row_index__": rows}, examples=1)


def test_verify_of_a_url_names_rows_stored_twice(s3, tmp_path, monkeypatch):
    """verify of a URL runs the checks across the ranks that a local verify runs: rows stored
    by two ranks, a rank's missing index file, and the index files of two captures, each named
    as the local verify of the same store names them (the reference), with the command's exit
    2; the same ranks with global row indices verify clean."""
    from pyhook.store.remote import Remote

    got, get = [], Remote.get

    def counting_get(self, name, *args, **kwargs):
        got.append(name)
        return get(self, name, *args, **kwargs)

    for global_rows in (False, True):
        url, local = s3(), str(tmp_path / f"global{global_rows}")
        for out in (url, local):
            _two_ranks(out, global_rows)
        got.clear()
        monkeypatch.setattr(Remote, "get", counting_get)
        problems, notes = verify_capture(url)
        monkeypatch.undo()
        # each shard downloaded once (its checksum), its row index read from that copy
        assert sorted(n for n in got if n.startswith("shard-")) == sorted(
            n for n in os.listdir(local) if n.startswith("shard-")
        )
        expected, expected_notes = verify_capture(local)
        assert notes == expected_notes == []
        assert problems == [p.replace(local, url) for p in expected]
        if global_rows:  # the control: each row once
            assert problems == [] and main(["verify", url]) == 0
        else:
            (problem,) = problems
            assert problem.startswith(f"{url}: 4 row(s) are stored more than once")
            for e, pos in [(0, 0), (0, 1), (1, 0)]:  # the first three, with both shards
                assert (
                    f"example {e} position {pos} in shard-r000-00000{e}.safetensors and "
                    f"shard-r001-00000{e}.safetensors" in problem
                )
            assert "; and 1 more." in problem
            assert main(["verify", url]) == 2
    # the clean store, a rank's index file gone: its rows are not read, verify says so
    _fs().rm_file(f"{url.removeprefix('s3://')}/index-r001.json")
    os.remove(os.path.join(local, "index-r001.json"))
    expected, _ = verify_capture(local)
    assert verify_capture(url)[0] == [p.replace(local, url) for p in expected]
    assert expected[0].startswith(f"{local}/index-r001.json: missing (rank 1 of 2")
    assert main(["verify", url]) == 2
    # the ranks' index files of two captures (other settings), put together and uploaded
    url, local = s3(), tmp_path / "mixed"
    for rank in (1, 0):
        with ShardWriter(tmp_path / f"r{rank}", rank=rank, world_size=2, settings={"r": rank}) as w:
            w.add({"x": torch.randn(2, 4)}, examples=1)
        for name in os.listdir(tmp_path / f"r{rank}"):
            if not name.startswith(".lock"):
                _fs().put_file(tmp_path / f"r{rank}" / name, f"{url.removeprefix('s3://')}/{name}")
                local.mkdir(exist_ok=True)
                (local / name).write_bytes((tmp_path / f"r{rank}" / name).read_bytes())
    (expected,), _ = verify_capture(local)
    assert "index-r001.json: not an index of the same capture as index-r000.json" in expected
    assert verify_capture(url) == ([expected.replace(str(local), url)], [])


@pytest.mark.parametrize("when", ["open", "merge"])
def test_a_rank_closing_between_anothers_listing_and_reading(s3, monkeypatch, when):
    """Ranks start and close at different times: rank 1 compacts its journal (uploads its
    index, removes its entry objects) right after rank 0 listed the prefix, before rank 0 reads
    what it listed: when rank 0 opens, and when it merges. The interleaving is injected."""
    from pyhook.store.remote import Remote

    url = s3()
    data = _batches()
    w1 = ShardWriter(url, settings=SETTINGS, shard_bytes=1, rank=1, world_size=2)
    w0 = (
        ShardWriter(url, settings=SETTINGS, shard_bytes=1, rank=0, world_size=2)
        if when == "merge"
        else None
    )
    for b in data[4:]:
        w1.add(b, examples=PER_BATCH)  # shard 1: the index object; shards 2-4: entry objects
    deadline = time.monotonic() + 60
    while sum(".d/" in n for n in _names(url)) < 3:  # the uploads run in the background
        assert time.monotonic() < deadline, "rank 1's entry objects never appeared"
        time.sleep(0.05)
    orig, injected = Remote.pull_indexes, []

    def pull_indexes(self, local, listing, *args, **kwargs):
        if not injected and any(n.startswith("index-r001.d/") for n in listing):
            injected.append(True)
            w1.close(merge=False)  # between the listing and the reads
        return orig(self, local, listing, *args, **kwargs)

    monkeypatch.setattr(Remote, "pull_indexes", pull_indexes)
    if w0 is None:
        w0 = ShardWriter(url, settings=SETTINGS, shard_bytes=1, rank=0, world_size=2)
    for b in data[:4]:
        w0.add(b, examples=PER_BATCH)
    w0.close()  # rank 0 merges last (without a barrier: rank 1 closes during the merge)
    assert injected == [True]
    w1.close()
    names = set(_objects(url))
    assert {"index.json", "index-r000.json", "index-r001.json"} <= names
    assert not [n for n in names if ".d/" in n]
    r = open_capture(url, verify=True)
    assert r.index["ranks"] == [0, 1] and r.examples == N_BATCHES * PER_BATCH
    assert torch.equal(r["a"][:], torch.cat([b["a"] for b in data]))
    assert verify_capture(url) == ([], [])


def test_a_vanished_object_is_not_called_a_missing_bucket(s3):
    from pyhook.store.remote import Remote

    url = s3()
    _write(url)
    remote = Remote(url)
    with pytest.raises(RemoteStorageError, match="object is not there") as e:
        remote.call("reading index-r009.json", "cat_file", remote.path("index-r009.json"))
    assert "bucket" not in str(e.value) and url in str(e.value)
    gone = Remote("s3://nosuchbucket/acts")
    with pytest.raises(RemoteStorageError, match="bucket 'nosuchbucket' does not exist"):
        gone.call("reading x", "cat_file", gone.path("x"))


STALL_SCRIPT = """
import sys, time, torch, pyhook
net = torch.nn.Sequential(torch.nn.Linear(64, 64))
t0 = None
try:
    with pyhook.capture(net, ["0"], out=sys.argv[1], shard_bytes=1) as rec:
        for i in range(100000):
            net(torch.randn(256, 64))
            if i == 3:
                print("capturing", flush=True)
                sys.stdin.readline()  # the parent stopped the server
                t0 = time.monotonic()
except Exception as e:
    chain, c = [], e
    while c is not None:
        chain.append(f"{type(c).__name__}: {c}")
        c = c.__cause__ or c.__context__
    print("RAISED", round(time.monotonic() - t0, 1), " <- ".join(chain), flush=True)
    sys.exit(3)
print("FINISHED", flush=True)
"""


def test_a_server_that_stops_answering_ends_the_capture_within_the_stated_bound():
    """moto's server is SIGSTOPped in the middle of a capture to s3:// (it still accepts
    connections, and never answers): the capture raises a named error within the deadline
    the documented options give, not a hang."""
    from pyhook.store.remote import network_limits, operation_deadline

    proc, port = _start_moto()
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "PYHOOK_REMOTE_CONNECT_TIMEOUT": "1",
        "PYHOOK_REMOTE_READ_TIMEOUT": "1",
        "PYHOOK_REMOTE_ATTEMPTS": "2",
    }
    child = None
    try:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            _fs().mkdir("stall")
            limits = network_limits()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        # the capture waits for one upload at a time (a shard, then its entry object)
        bound = 3 * 2 * operation_deadline(limits, 256 * 64 * 4 + 4096)
        child = subprocess.Popen(
            [sys.executable, "-I", "-c", STALL_SCRIPT, "s3://stall/acts"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "capturing", child.stderr.read()[-2000:]
        os.kill(proc.pid, signal.SIGSTOP)
        child.stdin.write("go\n")
        child.stdin.flush()
        try:
            out, err = child.communicate(timeout=bound + 30)
        except subprocess.TimeoutExpired:
            child.kill()
            pytest.fail(f"the capture still waited {bound + 30:.0f} s after the server stopped")
        assert child.returncode == 3 and out.startswith("RAISED"), (out, err[-2000:])
        raised_after = float(out.split()[1])  # the child's own clock, from the go to the raise
        assert raised_after < bound, (raised_after, bound, out)
        assert "s3://stall/acts" in out and "got no answer within" in out and "upload" in out, out
        # the message names the URL the user gave, not the local staging folder, and no "[Errno 0]"
        first = out.split(" <- ")[0]
        assert "writing the capture to 's3://stall/acts' failed" in first, first
        assert "pyhook-stage" not in first and "[Errno 0]" not in first, first
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


# -- bad input: named errors, quickly ------------------------------------------------------------------
def _quick(fn, exc, match, seconds=60.0):
    t0 = time.monotonic()
    with pytest.raises(exc, match=match):
        fn()
    assert time.monotonic() - t0 < seconds


def test_url_without_a_backend_names_the_pip_command():
    _quick(lambda: open_capture("gs://bucket/acts"), RemoteStorageError, "pip install gcsfs")
    _quick(lambda: ShardWriter("gs://bucket/acts"), RemoteStorageError, "pip install gcsfs")
    problems, _ = verify_capture("gs://bucket/acts")
    assert problems and "pip install gcsfs" in problems[0]
    _quick(lambda: open_capture("nosuchproto://x/y"), RemoteStorageError, "nosuchproto")


def test_wrong_credentials_are_named():
    # a server that enforces authentication: the dummy keys are unknown to it
    proc, port = _start_moto(INITIAL_NO_AUTH_ACTION_COUNT="0")
    saved = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "wrong")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "wrong")
    try:
        for fn in (
            lambda: open_capture("s3://pyhook/acts"),
            lambda: ShardWriter("s3://pyhook/acts"),
        ):
            _quick(fn, RemoteStorageError, "credentials")
    finally:
        if saved is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = saved
        proc.terminate()
        proc.wait(timeout=30)


def test_missing_bucket_is_named(s3):
    for fn in (
        lambda: open_capture("s3://nosuchbucket/acts"),
        lambda: ShardWriter("s3://nosuchbucket/a"),
    ):
        _quick(fn, RemoteStorageError, "nosuchbucket.*bucket")


def test_shard_deleted_mid_read_is_named(s3):
    url = s3()
    _write(url)
    r = open_capture(url, cache_bytes=0, prefetch=0)
    first = next(r.batches(3, layers=["a"]))
    assert first["a"].shape == (3, 4)
    gone = "shard-r000-000002.safetensors"
    _fs().rm_file(f"{url.removeprefix('s3://')}/{gone}")
    with pytest.raises(CaptureDamagedError, match=gone):
        for _ in r.batches(3, layers=["a"]):
            pass


def test_bucket_vanishing_mid_read_is_named(s3):
    fs = _fs()
    fs.mkdir("vanishing")
    url = "s3://vanishing/acts"
    _write(url)
    r = open_capture(url, cache_bytes=0, prefetch=0)
    assert r["a"][0].shape == (4,)
    fs.rm("vanishing", recursive=True)
    t0 = time.monotonic()
    with pytest.raises((CaptureDamagedError, RemoteStorageError), match="vanishing"):
        r["a"][:]
    assert time.monotonic() - t0 < 60


def test_the_command_captures_verifies_and_inspects_an_s3_prefix(s3, tmp_path, monkeypatch, capsys):
    """`pyhook capture --out s3://...` writes to the bucket (not to a local folder named
    's3:'), and verify/inspect read it back: rows, token ids and statistics."""
    from pyhook.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    url = s3()
    assert (
        main(["capture", "--out", url, "--limit", "3", "--layers", "resid_post.5", "--quiet"]) == 0
    )
    assert not any(tmp_path.iterdir())  # nothing written locally
    assert "index.json" in {k.rsplit("/", 1)[-1] for k in _objects(url)}
    assert main(["verify", url]) == 0
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert url in out and "statistics of every row" in out
    r = open_capture(url)
    rows = r["resid_post.5"].to_tensor()
    assert (
        r.examples == 3 and rows.shape[0] == r.tokens.shape[0] == r.stats("resid_post.5")["count"]
    )
    torch.testing.assert_close(r.stats("resid_post.5")["mean"], rows.double().mean(0))


def test_dataloader_fork_workers_read_s3_with_an_empty_cache(s3, tmp_path, monkeypatch):
    # Forked DataLoader workers kept the parent's fsspec event loop (a thread only the parent
    # has) and file system: with no shard cached yet every download waited its whole deadline
    # (213 s by default) and failed as "no answer". Fork workers, empty cache, healthy server.
    from torch.utils.data import DataLoader

    from pyhook.dataset import CaptureDataset

    url = s3()
    x = torch.arange(48 * 16, dtype=torch.float32).reshape(48, 16)
    with ShardWriter(url, shard_bytes=1) as w:
        for i in range(0, 48, 4):  # 12 shards
            w.add({"h": x[i : i + 4]}, examples=4)
    # short bounds: the old failure is an error in seconds here, not a wait of minutes
    for name, value in (("CONNECT_TIMEOUT", "3"), ("READ_TIMEOUT", "3"), ("ATTEMPTS", "1")):
        monkeypatch.setenv(f"PYHOOK_REMOTE_{name}", value)
    # the workers' caches go under tmp_path (a forked child inherits tempfile's directory)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = open_capture(url)
    parent_dir = r._remote_cache.dir
    assert r._remote_cache.downloads == 0 and not _cached_bytes(parent_dir)
    ds = CaptureDataset(r, "h", batch_size=5, seed=3, with_index=True)
    loader = DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60
    )
    t0 = time.monotonic()
    got = list(loader)
    took = time.monotonic() - t0
    index = torch.cat([b["index"] for b in got])
    assert sorted(index.tolist()) == list(range(48))  # every row once
    assert torch.equal(torch.cat([b["h"] for b in got]), x[index])
    assert took < 30, f"{took:.0f} s"
    assert r._remote_cache.downloads == 0  # the workers downloaded, into caches of their own
    # the parent's cache is still there (no worker removed it); the workers' went with them
    assert os.path.isdir(parent_dir)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(parent_dir)]
    # the parent still reads (its own loop and file system)
    assert torch.equal(r["h"][40:44], x[40:44])
    r.close()
