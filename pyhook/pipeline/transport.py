"""Captures on object storage and other fsspec file systems (``s3://``, ``gs://``, ``memory://``...).

The store's own code stays local: a writer works in a local staging directory and a background
thread uploads each shard once it is complete (then deletes the local copy), followed by its index
entry; the index is written last, when the capture closes. A reader downloads the index files,
then each shard when it is first read (prefetching the next ones) into a bounded local cache,
checking its size and checksum before it is used.

Layout under the prefix: the same files as a local capture, except that the per-rank journal is
one small object per shard (``index-rNNN.d/<shard>.json``, object stores cannot append), removed
when the rank's index is compacted at close.

Credentials and endpoints come from fsspec's usual configuration (for S3: ``AWS_*`` environment
variables, ``~/.aws``, ``AWS_ENDPOINT_URL`` for S3-compatible servers).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import re
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .format import (
    _CHECKSUM_FUNCS,
    MAX_INDEX_BYTES,
    MAX_WORLD_SIZE,
    CaptureDamagedError,
    _check_shard,
    _fault,
    _journal_path,
    merged_index,
    name_number,
    rank_indexes,
    stray_indexes,
)

__all__ = ["RemoteStorageError", "is_url"]

#: pip packages of the fsspec backends users most often lack, by protocol.
_BACKENDS = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "hf": "huggingface_hub",
}
#: Protocols whose first path component is a bucket.
_BUCKETS = ("s3", "s3a", "gs", "gcs")
#: The bounds of every network wait, each from an environment variable (read when a URL is
#: opened): seconds to connect, seconds without an answer per read, attempts per request (S3's
#: botocore settings; s3fs's own retries are turned off so that they do not multiply), and the
#: slowest transfer rate tolerated (MB/s). See :func:`network_limits`.
_LIMITS = {
    "connect_timeout": ("PYHOOK_REMOTE_CONNECT_TIMEOUT", 10.0),
    "read_timeout": ("PYHOOK_REMOTE_READ_TIMEOUT", 60.0),
    "attempts": ("PYHOOK_REMOTE_ATTEMPTS", 3),
    "min_rate_mb_s": ("PYHOOK_REMOTE_MIN_RATE", 1.0),
}


def network_limits() -> dict[str, float]:
    """The network bounds in force (defaults, or the ``PYHOOK_REMOTE_*`` environment variables).

    Every request to an asynchronous fsspec file system (S3, GCS, Azure...) gives up after
    :func:`operation_deadline` seconds, and raises :class:`RemoteStorageError` naming the URL
    and the operation.

    Example::

        >>> from pyhook.store.remote import network_limits
        >>> sorted(network_limits())
        ['attempts', 'connect_timeout', 'min_rate_mb_s', 'read_timeout']
    """
    out: dict[str, float] = {}
    for key, (env, default) in _LIMITS.items():
        raw = os.environ.get(env, "").strip()
        if not raw:
            out[key] = default
            continue
        try:
            value = int(raw) if key == "attempts" else float(raw)
        except ValueError:
            value = 0
        if not value > 0:
            raise RemoteStorageError(
                f"{env}={raw!r}: expected a positive {'integer' if key == 'attempts' else 'number'}"
            )
        out[key] = value
    return out


def operation_deadline(limits: dict[str, float], nbytes: int = 0) -> float:
    """Seconds one request (or listing) moving ``nbytes`` may take in all: ``attempts`` tries of
    ``connect_timeout + read_timeout``, the back-off between tries (1, 2, 4... s, at most 20 s
    each), and the bytes at ``min_rate_mb_s``.

    Example::

        >>> from pyhook.store.remote import operation_deadline
        >>> operation_deadline({"connect_timeout": 10, "read_timeout": 60, "attempts": 3,
        ...                     "min_rate_mb_s": 1.0}, nbytes=2_000_000)
        215.0
    """
    attempts = int(limits["attempts"])
    backoff = sum(min(2.0**i, 20.0) for i in range(attempts - 1))
    per_try = limits["connect_timeout"] + limits["read_timeout"]
    return attempts * per_try + backoff + nbytes / (limits["min_rate_mb_s"] * 1e6)


#: A rank's index objects: ``index-rNNN.json`` and its entry objects ``index-rNNN.d/<shard>.json``.
_INDEX_OBJECT = re.compile(r"index-r(\d{3,})(?:\.json|\.d/[^/]+\.json)\Z")
#: Listings a reader of a rank's index objects takes before giving up (each one sees the rank
#: closed since the one before; a rank closes once).
_PULL_TRIES = 3


class RemoteStorageError(OSError):
    """Object storage could not be reached or used: no fsspec backend installed for the URL's
    protocol (the message gives the ``pip install`` command), wrong credentials, a bucket that
    does not exist or vanished, a network that does not answer within the bounded retries.

    The message names the URL and what failed. A listed shard that is missing from the bucket is
    :class:`CaptureDamagedError` instead (the capture is damaged, not the connection).

    Example::

        >>> import pyhook.store as store
        >>> try:
        ...     store.open_capture("nosuchprotocol://bucket/acts")
        ... except store.RemoteStorageError as e:
        ...     print("nosuchprotocol" in str(e))
        True
    """


def is_url(path: Any) -> bool:
    """Whether ``path`` names an fsspec location (``proto://...``) rather than a local path.

    Example::

        >>> from pyhook.store import is_url
        >>> is_url("s3://bucket/acts"), is_url("runs/acts"), is_url("file:///tmp/acts")
        (True, False, True)
    """
    return isinstance(path, str) and re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", path) is not None


def _protocol(url: str) -> str:
    return url.split("://", 1)[0]


def filesystem(url: str) -> tuple[Any, str]:
    """``(fs, root)`` of ``url``; :class:`RemoteStorageError` with the pip command when the
    protocol has no installed backend."""
    try:
        import fsspec
    except ImportError:
        raise RemoteStorageError(
            f"{url!r}: reading and writing URLs needs fsspec: pip install 'pyhook[remote]' "
            "(or pip install fsspec s3fs)"
        ) from None
    proto = _protocol(url)
    options: dict[str, Any] = {}
    if proto in ("s3", "s3a"):
        limits = network_limits()
        options = {
            "config_kwargs": {
                "connect_timeout": limits["connect_timeout"],
                "read_timeout": limits["read_timeout"],
                "retries": {"max_attempts": int(limits["attempts"]), "mode": "standard"},
            },
            "use_listings_cache": False,
            "skip_instance_cache": True,
        }
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        pkg = _BACKENDS.get(proto, f"the fsspec backend for {proto}://")
        raise RemoteStorageError(
            f"{url!r}: no fsspec backend for {proto}:// is installed ({e}); pip install {pkg}"
        ) from None
    except ValueError as e:
        raise RemoteStorageError(
            f"{url!r}: fsspec knows no protocol {proto!r} ({e}); check the URL, or install the "
            "package that provides it"
        ) from None
    if hasattr(fs, "retries") and options:
        fs.retries = 1  # s3fs's retry loop around botocore's attempts: botocore's alone count
    return fs, root.rstrip("/")


def at_url(e: CaptureDamagedError, local: str, url: str) -> CaptureDamagedError:
    """``e`` (raised on the local copy in ``local`` of files of the capture at ``url``) naming
    the objects by their URLs: the error of a remote capture names what is in the bucket."""
    path = e.path.replace(local, url) if e.path else url
    return CaptureDamagedError(str(e).replace(local, url), path)


def _wrap(url: str, what: str, e: BaseException, hint: str = "") -> RemoteStorageError:
    kind = type(e).__name__
    if isinstance(e, PermissionError):
        hint = " (check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, ...)"
    return RemoteStorageError(f"{url}: {what} failed: {kind}: {e}{hint}")


class Remote:
    """One capture prefix on an fsspec file system, with the operations the store needs.

    On an asynchronous file system (S3, GCS, Azure...) every operation runs on fsspec's event
    loop with a deadline (:func:`operation_deadline`): past it the operation is cancelled and
    :class:`RemoteStorageError` names the URL and the operation."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.limits = network_limits()
        self._conn: tuple[int, Any, Any] | None = None
        self._connection()

    def _connection(self) -> tuple[int, Any, Any]:
        """``(pid, fs, loop)``: the file system and its event loop (None: not asynchronous)
        of this process. A forked child (a ``DataLoader`` worker under Linux's default start
        method) has neither of its parent's: fsspec's loop runs on a thread only the parent
        has, so every operation there waited its whole deadline and failed. The child makes
        its own at first use (its download threads may each do so: one of them is kept)."""
        conn = self._conn
        if conn is None or conn[0] != os.getpid():
            fs, self.root = filesystem(self.url)
            loop = getattr(fs, "loop", None) if getattr(fs, "async_impl", False) else None
            # one assignment: another thread sees the parent's connection or this one whole
            self._conn = conn = (os.getpid(), fs, loop)
        return conn

    @property
    def fs(self) -> Any:
        """The fsspec file system (this process's own: see :meth:`_connection`)."""
        return self._connection()[1]

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def deadline(self, nbytes: int = 0) -> float:
        return operation_deadline(self.limits, nbytes)

    def run(self, what: str, url: str, method: str, *args: Any, nbytes: int = 0, **kw: Any) -> Any:
        """``fs.<method>(*args)``, bounded by :meth:`deadline` on an asynchronous file system.
        A timeout is :class:`RemoteStorageError`; other errors pass through."""
        _, fs, loop = self._connection()
        if loop is None:
            return getattr(fs, method)(*args, **kw)
        import fsspec.asyn
        from fsspec.exceptions import FSTimeoutError

        seconds = self.deadline(nbytes)
        try:
            return fsspec.asyn.sync(loop, getattr(fs, "_" + method), *args, timeout=seconds, **kw)
        except FSTimeoutError:
            lim = self.limits
            raise RemoteStorageError(
                f"{url}: {what} got no answer within {seconds:.0f} s ({int(lim['attempts'])} "
                f"attempt(s) of {lim['connect_timeout']:g} s to connect and "
                f"{lim['read_timeout']:g} s to read, at least {lim['min_rate_mb_s']:g} MB/s; "
                "PYHOOK_REMOTE_* set these): is the server up and reachable?"
            ) from None

    def call(self, what: str, method: str, *args: Any, nbytes: int = 0, **kw: Any) -> Any:
        """:meth:`run` with every error as :class:`RemoteStorageError` naming the prefix."""
        try:
            return self.run(what, self.url, method, *args, nbytes=nbytes, **kw)
        except (CaptureDamagedError, RemoteStorageError):
            raise
        except Exception as e:
            raise self._wrap(self.url, what, e) from e

    def _wrap(self, url: str, what: str, e: BaseException) -> RemoteStorageError:
        """``e`` as a named error; a missing object or bucket says which of the two it is."""
        hint = ""
        if isinstance(e, FileNotFoundError):
            bucket = self.root.split("/", 1)[0]
            try:
                there = _protocol(self.url) not in _BUCKETS or bool(
                    self.run("checking the bucket", url, "exists", bucket)
                )
            except Exception:
                there = None
            if there is False:
                hint = f" (the bucket {bucket!r} does not exist)"
            elif there:
                hint = " (the object is not there: removed meanwhile, or never written)"
        return _wrap(url, what, e, hint)

    def listing(self) -> dict[str, int]:
        """Every object under the prefix (relative name -> size); {} when there is none."""
        what = "listing the prefix"
        try:
            found = self.run(what, self.url, "find", self.root, detail=True)
        except FileNotFoundError:
            found = {}
        except RemoteStorageError:
            raise
        except Exception as e:
            raise self._wrap(self.url, what, e) from e
        out = {}
        for p, info in found.items():
            rel = p[len(self.root) + 1 :] if p.startswith(self.root + "/") else p
            if info.get("type", "file") != "directory":
                out[rel] = int(info.get("size") or 0)
        return out

    def check_bucket(self) -> None:
        """Touch the prefix's bucket or root (fails fast on wrong credentials or no bucket)."""
        bucket = self.root.split("/", 1)[0]
        if _protocol(self.url) in _BUCKETS:
            self.call("opening the bucket", "ls", bucket)

    def get(self, name: str, local: str, nbytes: int = 0) -> None:
        """Download ``name`` (``nbytes`` long, if known: it extends the deadline) to ``local``;
        FileNotFoundError passes through."""
        tmp = f"{local}.part"
        try:
            self.run(
                "downloading", self.url_of(name), "get_file", self.path(name), tmp, nbytes=nbytes
            )
            os.replace(tmp, local)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        except RemoteStorageError:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        except Exception as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise self._wrap(self.url_of(name), "downloading", e) from e

    def _parent(self, name: str) -> None:
        # object stores have no directories; a local (file://) target needs them made
        if getattr(self.fs, "local_file", False):
            self.fs.makedirs(self.path(name).rsplit("/", 1)[0], exist_ok=True)

    def put(self, local: str, name: str) -> None:
        self._parent(name)
        self.call(
            f"uploading {name}", "put_file", local, self.path(name), nbytes=os.path.getsize(local)
        )

    def put_bytes(self, data: bytes, name: str) -> None:
        self._parent(name)
        self.call(f"uploading {name}", "pipe_file", self.path(name), data, nbytes=len(data))

    def rm(self, names: list[str]) -> None:
        """Remove objects (one batched request where the file system has one)."""
        if not names:
            return
        what = f"removing {names[0]}..."
        try:
            self.run(what, self.url, "rm", [self.path(n) for n in names])
        except FileNotFoundError:
            for n in names:  # some were gone already: remove the others one by one
                with contextlib.suppress(FileNotFoundError):
                    self.run(f"removing {n}", self.url_of(n), "rm_file", self.path(n))
        except RemoteStorageError:
            raise
        except Exception as e:
            raise self._wrap(self.url, what, e) from e

    def pull_indexes(self, local: str, listing: dict[str, int], own: int | None = None) -> None:
        """Download the index files into ``local``: every rank's complete index (its index
        file, and its journal rebuilt from its entry objects) when ``own`` is None (a reader,
        the merge), else rank ``own``'s complete index and only the other ranks' index files.

        A rank's index file is its source of truth: it closes by uploading its complete index,
        then removing its entry objects. An entry object that was listed and is gone when read
        means exactly that happened (another process closed the rank meanwhile), so that rank's
        objects are listed and read again. The other ranks' files a writer pulls are only used to
        compare settings; one that vanished meanwhile is skipped.
        """
        _fault("pull.listed")
        # Only each rank's exact index name is read; another name claiming a rank is refused.
        files, errors = rank_indexes([n for n in listing if "/" not in n], self.url)
        if errors:
            raise errors[0]
        names: dict[int, list[str]] = {name_number(n[7:-5]): [n] for n in files}
        for name in listing:
            m = _INDEX_OBJECT.match(name)
            if m and "/" in name:
                rank = name_number(m.group(1))
                if not name.startswith(f"index-r{rank:03d}.d/") or rank >= MAX_WORLD_SIZE:
                    url = self.url_of(name)
                    raise CaptureDamagedError(
                        f"{url}: not an entry object of a rank's index (pyhook writes "
                        "index-rNNN.d/<shard>.json, NNN the rank as its index file spells it)",
                        url,
                    )
                names.setdefault(rank, []).append(name)
            if (m or name == "index.json") and listing[name] > MAX_INDEX_BYTES:
                url = self.url_of(name)  # refused before it is downloaded
                raise CaptureDamagedError(
                    f"{url}: {listing[name]} bytes, more than an index file may hold "
                    f"({MAX_INDEX_BYTES} bytes)",
                    url,
                )
        if "index.json" in listing:
            self._get_if_there("index.json", local)
        for rank in sorted(names):
            if own is None or rank == own:
                self._pull_rank(local, rank, listing)
            elif f"index-r{rank:03d}.json" in listing:
                self._get_if_there(f"index-r{rank:03d}.json", local)

    def _get_if_there(self, name: str, local: str) -> bool:
        try:
            self.get(name, os.path.join(local, name))
            return True
        except FileNotFoundError:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(local, name))
            return False

    def _pull_rank(self, local: str, rank: int, listing: dict[str, int]) -> None:
        """Rank ``rank``'s index file and journal as one consistent snapshot (see above)."""
        head = f"index-r{rank:03d}"
        index = f"{head}.json"
        journal = _journal_path(os.path.join(local, index))
        for _ in range(_PULL_TRIES):
            entries = sorted(
                n for n in listing if n.startswith(f"{head}.d/") and n.endswith(".json")
            )
            with contextlib.suppress(FileNotFoundError):
                os.remove(journal)
            try:
                if index in listing:
                    self.get(index, os.path.join(local, index))
                lines = [self._read(name) for name in entries]
            except FileNotFoundError:
                # compacted (or removed) meanwhile: its complete index is uploaded by now
                listing = self.listing()
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(local, index))
                continue
            if lines:
                with open(journal, "wb") as f:
                    for data in lines:
                        f.write(data if data.endswith(b"\n") else data + b"\n")
            return
        raise RemoteStorageError(
            f"{self.url_of(index)}: the index objects of rank {rank} changed under each of "
            f"{_PULL_TRIES} listings while being read; is another process writing rank {rank} "
            "of this capture?"
        )

    def _read(self, name: str) -> bytes:
        """An object's bytes; FileNotFoundError passes through (the caller knows what it means)."""
        try:
            return self.run("reading", self.url_of(name), "cat_file", self.path(name))
        except (FileNotFoundError, RemoteStorageError):
            raise
        except Exception as e:
            raise self._wrap(self.url_of(name), "reading", e) from e


# -- writing ---------------------------------------------------------------------------------------
class Uploader:
    """The writer's remote side: a thread that uploads each completed shard (then its index
    entry) in order, at most ``max_pending`` shards waiting; errors surface on the next call.

    Each upload is bounded (:meth:`Remote.deadline`), and so are the waits on the thread: no
    call here waits longer than the deadlines of the uploads ahead of it."""

    def __init__(self, remote: Remote, rank: int, max_pending: int = 2) -> None:
        self.remote = remote
        self.rank = rank
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._bounds: dict[int, float] = {}  # id(task) -> its deadline, while queued or running
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"pyhook-upload-r{rank}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                if self.error is None:
                    task()
            except BaseException as e:
                self.error = e
            finally:
                self._bounds.pop(id(task), None)
                self._queue.task_done()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _left(self) -> float:
        """Seconds the queued and running uploads may still take, at most (plus a margin)."""
        return sum(list(self._bounds.values())) + 5.0

    def submit(self, task: Callable[[], None], nbytes: int = 0) -> None:
        self.check()
        self._bounds[id(task)] = self.remote.deadline(nbytes) * 2  # a shard, then its entry
        try:
            while True:
                try:
                    self._queue.put(task, timeout=0.1)
                    return
                except queue.Full:
                    self.check()
        except BaseException:
            self._bounds.pop(id(task), None)
            raise

    def shard_done(self, local_dir: str, name: str, line: bytes | None, part: str) -> None:
        """Upload shard ``name`` (then drop the local copy), then list it: its journal line as
        an entry object, or (the first shard of a run) the rank's index file."""
        own = f"index-r{self.rank:03d}"
        if line is None:  # the index as it is now: closing rewrites the file before uploading
            with open(part, "rb") as f:
                index = f.read()

        def task() -> None:
            path = os.path.join(local_dir, name)
            self.remote.put(path, name)
            _fault("upload.shard")
            os.remove(path)
            if line is not None:
                self.remote.put_bytes(line, f"{own}.d/{name}.json")
            else:
                self.remote.put_bytes(index, f"{own}.json")
            _fault("upload.listed")

        self.submit(task, os.path.getsize(os.path.join(local_dir, name)))

    def drain(self) -> None:
        """Wait for every submitted upload (each bounded by its deadline), then raise its error."""
        q = self._queue
        deadline = time.monotonic() + self._left()
        with q.all_tasks_done:
            while q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RemoteStorageError(
                        f"{self.remote.url}: waiting for {q.unfinished_tasks} upload(s) got no "
                        "answer within their deadlines: is the server up and reachable?"
                    )
                q.all_tasks_done.wait(min(left, 1.0))
        self.check()

    def stop(self) -> None:
        """End the thread: after the queued uploads, or (they outlast their deadlines) leave
        the daemon thread behind rather than wait on it."""
        try:
            self._queue.put(None, timeout=self._left())
        except queue.Full:
            return
        self._thread.join(self._left())


# -- reading -----------------------------------------------------------------------------------------
class ShardCache:
    """Shards of a remote capture downloaded on first use into a local directory of at most
    ``cache_bytes`` (least recently used shards evicted), ``prefetch`` shards ahead."""

    def __init__(
        self,
        remote: Remote,
        directory: str,
        layers: dict[str, Any],
        *,
        cache_bytes: int,
        prefetch: int,
    ) -> None:
        self.remote = remote
        self.dir: str | None = directory
        self.layers = layers
        self.cache_bytes = cache_bytes
        self.prefetch = prefetch
        # downloads run on daemon threads (never keep the interpreter alive), a few at a time
        self._slots = threading.BoundedSemaphore(max(1, min(prefetch, 4)))
        self._lock = threading.Lock()
        self._futures: dict[str, concurrent.futures.Future[str]] = {}
        self._lru: OrderedDict[str, int] = OrderedDict()  # name -> bytes, on disk and checked
        self._order: list[str] = []
        self._shards: dict[str, Any] = {}
        self.downloads = 0
        self._finalizer: Any = _remove_with(self, directory)
        _CACHES.add(self)

    def _after_fork(self) -> None:
        """In a forked child: a cache of its own. The parent's downloads in flight never end
        here (their threads are the parent's), its locks may be held, and its directory is
        the parent's to fill and evict: the child starts empty in a new directory (shards the
        parent had mapped stay readable through the child's copy of the mapping)."""
        self._slots = threading.BoundedSemaphore(max(1, min(self.prefetch, 4)))
        self._lock = threading.Lock()
        self._futures = {}
        self._lru = OrderedDict()
        self.downloads = 0
        self._finalizer.cancel()  # the parent's directory is not the child's to remove
        self._finalizer = None
        # made at the first download: after multiprocessing has set the child up (it drops
        # the finalizers registered before), and never in a child that reads nothing
        self.dir = None

    def _directory(self) -> str:
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="pyhook-remote-")
            self._finalizer = _remove_with(self, self.dir)
        return self.dir

    def register(self, shards: list[Any]) -> None:
        self._order = [m.entry["file"] for m in shards]
        self._shards = {m.entry["file"]: m for m in shards}

    def _download(self, entry: dict[str, Any]) -> str:
        """Download and check one shard (size, checksum, header); returns its local path."""
        name = entry["file"]
        local = os.path.join(self._directory(), name)
        url = self.remote.url_of(name)
        try:
            self.remote.get(name, local, entry.get("bytes") or 0)
        except FileNotFoundError:
            raise CaptureDamagedError(
                f"{url}: missing (listed in the index; deleted from the bucket?)", url
            ) from None
        self.downloads += 1
        size = os.path.getsize(local)
        if isinstance(entry.get("bytes"), int) and size != entry["bytes"]:
            os.remove(local)
            raise CaptureDamagedError(
                f"{url}: size {size} bytes, the index records {entry['bytes']}", url
            )
        recorded = entry.get("checksum")
        if recorded is not None:
            algorithm = str(recorded).partition(":")[0]
            crc = _CHECKSUM_FUNCS.get(algorithm)
            if crc is None:
                raise CaptureDamagedError(f"{url}: unknown checksum algorithm {recorded!r}", url)
            value = 0
            with open(local, "rb") as f:
                while chunk := f.read(8 << 20):
                    value = crc(chunk, value)
            got = f"{algorithm}:{value & 0xFFFFFFFF:08x}"
            if got != recorded:
                os.remove(local)
                raise CaptureDamagedError(
                    f"{url}: checksum {got} differs from the index's {recorded} (its bytes "
                    "changed in the bucket, or the download was damaged)",
                    url,
                )
        return local

    def _submit(self, name: str) -> concurrent.futures.Future[str]:
        fut = self._futures.get(name)
        if fut is None:
            fut = concurrent.futures.Future()
            entry = self._shards[name].entry

            def run() -> None:
                with self._slots:
                    if not fut.set_running_or_notify_cancel():
                        return
                    try:
                        fut.set_result(self._download(entry))
                    except BaseException as e:
                        fut.set_exception(e)

            threading.Thread(target=run, name="pyhook-fetch", daemon=True).start()
            self._futures[name] = fut
        return fut

    def fetch(self, shard: Any) -> tuple[str, dict[str, Any], int]:
        """Local path, header and data start of ``shard`` (downloaded and checked if needed)."""
        name = shard.entry["file"]
        with self._lock:
            self._directory()  # here, once: not in two download threads at the same time
            fut = self._submit(name)
            i = self._order.index(name)
            for ahead in self._order[i + 1 : i + 1 + self.prefetch]:
                if ahead not in self._lru:
                    self._submit(ahead)
        try:
            local = fut.result()
        except BaseException:
            with self._lock:
                self._futures.pop(name, None)
            raise
        try:
            header, start = _check_shard(self._directory(), shard.entry, self.layers)
        except CaptureDamagedError as e:
            raise at_url(e, self._directory(), self.remote.url) from None
        with self._lock:
            self._lru[name] = os.path.getsize(local)
            self._lru.move_to_end(name)
            self._evict(keep=name)
        return local, header, start

    def _evict(self, keep: str) -> None:
        total = sum(self._lru.values())
        for name in list(self._lru):
            if total <= self.cache_bytes:
                break
            if name == keep:
                continue
            total -= self._lru.pop(name)
            self._futures.pop(name, None)
            shard = self._shards.get(name)
            if shard is not None:
                shard.release()
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self._directory(), name))

    def close(self) -> None:
        with self._lock:
            for fut in self._futures.values():
                fut.cancel()
        if self._finalizer is not None:
            self._finalizer()


def _remove_dir(directory: str, pid: int) -> None:
    if os.getpid() == pid:  # never a directory of another process (a forked parent's)
        shutil.rmtree(directory, ignore_errors=True)


def _remove_with(owner: Any, directory: str) -> Any:
    """A finalizer removing ``directory`` when ``owner`` goes, or when this process exits,
    including a ``multiprocessing`` child such as a ``DataLoader`` worker (which ends with
    ``os._exit``, past the ``atexit`` hooks a ``weakref.finalize`` relies on)."""
    from multiprocessing import util

    return util.Finalize(owner, _remove_dir, args=(directory, os.getpid()), exitpriority=0)


#: The shard caches of this process, made anew in a forked child (:meth:`ShardCache._after_fork`).
_CACHES: weakref.WeakSet[ShardCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for cache in list(_CACHES):
        cache._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def open_remote_index(
    url: str, *, verify_shards: bool = False
) -> tuple[Remote, str, dict[str, int]]:
    """The prefix's :class:`Remote`, a temp directory holding its index files, and its listing."""
    remote = Remote(url)
    remote.check_bucket()
    listing = remote.listing()
    local = tempfile.mkdtemp(prefix="pyhook-remote-")
    try:
        remote.pull_indexes(local, listing)
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise
    return remote, local, listing


def merged_index_of(path: str) -> dict[str, Any]:
    """:func:`.format.merged_index` of a capture directory or URL (whose index files are
    fetched into a temporary directory first)."""
    if not is_url(path):
        return merged_index(path)
    remote, local, _ = open_remote_index(str(path))
    try:
        return merged_index(local)
    except CaptureDamagedError as e:
        raise at_url(e, local, remote.url) from None
    finally:
        shutil.rmtree(local, ignore_errors=True)


def verify_remote(
    url: str,
    check: Callable[[str, dict, dict, dict], None] | None = None,
    finish: Callable[[str, list[str], list[tuple[str, dict]], list[str]], list[str]] | None = None,
) -> tuple[list[str], list[str]]:
    """:func:`verify_capture` of a URL: the index files, then each shard downloaded, checked
    and deleted (one at a time: the local disk needs room for one shard). ``check(path,
    entry, layers, header)``, given by the reader's verify (the transport knows nothing of
    encodings, texts or row indexes), runs on each downloaded shard after its header and
    checksum. ``finish(local, names, loaded, problems)``, given by the reader's verify too,
    runs once after every shard: the checks across the ranks, on the index files in the
    temporary directory ``local`` (``names``: the paths of the rank index files there,
    ``loaded``: ``(path, index)`` of those that loaded, ``problems``: what was found so far);
    the problems it returns name the objects by their URLs."""
    from .format import _check_shard, _load_json, _load_part, check_merged

    try:
        remote, local, listing = open_remote_index(url)
    except (RemoteStorageError, CaptureDamagedError) as e:
        return [str(e)], []
    problems: list[str] = []
    notes: list[str] = []

    def say(msg: str) -> str:
        return msg.replace(local, remote.url)

    try:
        top = [n for n in listing if "/" not in n]
        parts = rank_indexes(top, remote.url)[0]  # (names claiming a rank otherwise: refused)
        if not parts:
            return [f"{remote.url}: holds no pyhook capture (no index-r*.json files)"], []
        notes += stray_indexes(remote.url, top, parts, [])
        seen: set[str] = set()
        loaded: list[tuple[str, dict]] = []
        for name in parts:
            try:
                part = _load_part(os.path.join(local, name))
            except CaptureDamagedError as e:
                problems.append(say(str(e)))
                continue
            loaded.append((os.path.join(local, name), part))
            for s in part["shards"]:
                seen.add(s["file"])
                shard = s["file"]
                if shard not in listing:
                    problems.append(f"{remote.url_of(shard)}: missing (listed in the index)")
                    continue
                try:
                    remote.get(shard, os.path.join(local, shard), listing[shard])
                    header, _ = _check_shard(local, s, part["layers"], checksum=True, notes=notes)
                    if check is not None:
                        check(os.path.join(local, shard), s, part["layers"], header)
                except FileNotFoundError:
                    problems.append(f"{remote.url_of(shard)}: missing (listed in the index)")
                except (CaptureDamagedError, RemoteStorageError) as e:
                    problems.append(say(str(e)))
                finally:
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(local, shard))
        if finish is not None:
            names = [os.path.join(local, n) for n in parts]
            problems += [say(p) for p in finish(local, names, loaded, problems)]
        if "index.json" in listing:
            try:
                merged = os.path.join(local, "index.json")
                check_merged(merged, _load_json(merged))  # the schema local verify checks
            except CaptureDamagedError as e:
                problems.append(say(str(e)))
        for name in sorted(listing):
            if name.startswith("shard-r") and "/" not in name and name not in seen and not problems:
                notes.append(f"{remote.url_of(name)}: not listed in the index (debris)")
        notes = [say(n) for n in notes]
        return problems, notes
    finally:
        shutil.rmtree(local, ignore_errors=True)
