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
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .format import (
    _CHECKSUM_FUNCS,
    CaptureDamagedError,
    _check_shard,
    _fault,
    _journal_path,
    merged_index,
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
#: Bounded network waits for S3 (botocore's defaults wait 60 s per attempt, with more retries).
_S3_OPTIONS = {
    "config_kwargs": {
        "connect_timeout": 10,
        "read_timeout": 60,
        "retries": {"max_attempts": 3, "mode": "standard"},
    },
    "use_listings_cache": False,
    "skip_instance_cache": True,
}


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
    options = dict(_S3_OPTIONS) if proto in ("s3", "s3a") else {}
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
    return fs, root.rstrip("/")


def _wrap(url: str, what: str, e: BaseException) -> RemoteStorageError:
    kind = type(e).__name__
    if isinstance(e, PermissionError):
        hint = " (check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, ...)"
    elif isinstance(e, FileNotFoundError):
        hint = " (does the bucket exist?)"
    else:
        hint = ""
    return RemoteStorageError(f"{url}: {what} failed: {kind}: {e}{hint}")


class Remote:
    """One capture prefix on an fsspec file system, with the operations the store needs."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except (CaptureDamagedError, RemoteStorageError):
            raise
        except Exception as e:
            raise _wrap(self.url, what, e) from e

    def listing(self) -> dict[str, int]:
        """Every object under the prefix (relative name -> size); {} when there is none."""

        def run() -> dict[str, int]:
            try:
                found = self.fs.find(self.root, detail=True)
            except FileNotFoundError:
                found = {}
            out = {}
            for p, info in found.items():
                rel = p[len(self.root) + 1 :] if p.startswith(self.root + "/") else p
                if info.get("type", "file") != "directory":
                    out[rel] = int(info.get("size") or 0)
            return out

        return self.call("listing the prefix", run)

    def check_bucket(self) -> None:
        """Touch the prefix's bucket or root (fails fast on wrong credentials or no bucket)."""
        bucket = self.root.split("/", 1)[0]
        if _protocol(self.url) in ("s3", "s3a", "gs", "gcs"):
            self.call("opening the bucket", self.fs.ls, bucket)

    def get(self, name: str, local: str) -> None:
        tmp = f"{local}.part"
        try:
            self.fs.get_file(self.path(name), tmp)
            os.replace(tmp, local)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        except Exception as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise _wrap(self.url_of(name), "downloading", e) from e

    def _parent(self, name: str) -> None:
        # object stores have no directories; a local (file://) target needs them made
        if getattr(self.fs, "local_file", False):
            self.fs.makedirs(self.path(name).rsplit("/", 1)[0], exist_ok=True)

    def put(self, local: str, name: str) -> None:
        self._parent(name)
        self.call(f"uploading {name}", self.fs.put_file, local, self.path(name))

    def put_bytes(self, data: bytes, name: str) -> None:
        self._parent(name)
        self.call(f"uploading {name}", self.fs.pipe_file, self.path(name), data)

    def rm(self, names: list[str]) -> None:
        """Remove objects (one batched request where the file system has one)."""
        if not names:
            return
        try:
            self.fs.rm([self.path(n) for n in names])
        except FileNotFoundError:
            for n in names:  # some were gone already: remove the others one by one
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self.path(n))
        except Exception as e:
            raise _wrap(self.url, f"removing {names[0]}...", e) from e

    def pull_indexes(self, local: str, listing: dict[str, int], ranks: list[int] | None) -> None:
        """Download the index files (of ``ranks``, or all) into ``local``, rebuilding each
        rank's journal from its entry objects."""
        for name in sorted(listing):
            base = name.split("/", 1)[0]
            if name == "index.json":
                self.get(name, os.path.join(local, name))
                continue
            if not (base.startswith("index-r") and base[7:10].isdigit()):
                continue
            rank = int(base[7:].split(".")[0])
            if ranks is not None and rank not in ranks:
                continue
            if "/" not in name and name.endswith(".json"):
                self.get(name, os.path.join(local, name))
        journals: dict[str, list[tuple[str, bytes]]] = {}
        for name in sorted(listing):
            head, _, tail = name.partition("/")
            if not (head.startswith("index-r") and head.endswith(".d") and tail.endswith(".json")):
                continue
            rank = int(head[7:].split(".")[0])
            if ranks is not None and rank not in ranks:
                continue
            data = self.call(f"reading {name}", self.fs.cat_file, self.path(name))
            journals.setdefault(head[:-2], []).append((tail, data))
        for head, lines in journals.items():
            with open(_journal_path(os.path.join(local, head + ".json")), "wb") as f:
                for _, data in sorted(lines):
                    f.write(data if data.endswith(b"\n") else data + b"\n")


# -- writing ---------------------------------------------------------------------------------------
class Uploader:
    """The writer's remote side: a thread that uploads each completed shard (then its index
    entry) in order, at most ``max_pending`` shards waiting; errors surface on the next call."""

    def __init__(self, remote: Remote, rank: int, max_pending: int = 2) -> None:
        self.remote = remote
        self.rank = rank
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
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
                self._queue.task_done()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, task: Callable[[], None]) -> None:
        self.check()
        while True:
            try:
                self._queue.put(task, timeout=0.1)
                return
            except queue.Full:
                self.check()

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

        self.submit(task)

    def drain(self) -> None:
        self._queue.join()
        self.check()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


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
        self.dir = directory
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
        # the directory goes when the cache does (the reader, or the last LayerData, is gone)
        self._finalizer = weakref.finalize(self, shutil.rmtree, directory, ignore_errors=True)

    def register(self, shards: list[Any]) -> None:
        self._order = [m.entry["file"] for m in shards]
        self._shards = {m.entry["file"]: m for m in shards}

    def _download(self, entry: dict[str, Any]) -> str:
        """Download and check one shard (size, checksum, header); returns its local path."""
        name = entry["file"]
        local = os.path.join(self.dir, name)
        url = self.remote.url_of(name)
        try:
            self.remote.get(name, local)
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
        header, start = _check_shard(self.dir, shard.entry, self.layers)
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
                os.remove(os.path.join(self.dir, name))

    def close(self) -> None:
        with self._lock:
            for fut in self._futures.values():
                fut.cancel()
        self._finalizer()


def open_remote_index(
    url: str, *, verify_shards: bool = False
) -> tuple[Remote, str, dict[str, int]]:
    """The prefix's :class:`Remote`, a temp directory holding its index files, and its listing."""
    remote = Remote(url)
    remote.check_bucket()
    listing = remote.listing()
    local = tempfile.mkdtemp(prefix="pyhook-remote-")
    try:
        remote.pull_indexes(local, listing, None)
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise
    return remote, local, listing


def merged_index_of(path: str) -> dict[str, Any]:
    """:func:`.format.merged_index` of a capture directory or URL (whose index files are
    fetched into a temporary directory first)."""
    if not is_url(path):
        return merged_index(path)
    _, local, _ = open_remote_index(str(path))
    try:
        return merged_index(local)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def verify_remote(url: str) -> tuple[list[str], list[str]]:
    """:func:`verify_capture` of a URL: the index files, then each shard downloaded, checked
    and deleted (one at a time: the local disk needs room for one shard)."""
    from .format import _check_checksum, _check_shard, _load_json, _load_part

    try:
        remote, local, listing = open_remote_index(url)
    except (RemoteStorageError, CaptureDamagedError) as e:
        return [str(e)], []
    problems: list[str] = []
    notes: list[str] = []

    def say(msg: str) -> str:
        return msg.replace(local, remote.url)

    try:
        parts = sorted(n for n in listing if n.startswith("index-r") and n.endswith(".json"))
        parts = [n for n in parts if "/" not in n]
        if not parts:
            return [f"{remote.url}: holds no pyhook capture (no index-r*.json files)"], []
        seen: set[str] = set()
        for name in parts:
            try:
                part = _load_part(os.path.join(local, name))
            except CaptureDamagedError as e:
                problems.append(say(str(e)))
                continue
            for s in part["shards"]:
                seen.add(s["file"])
                shard = s["file"]
                if shard not in listing:
                    problems.append(f"{remote.url_of(shard)}: missing (listed in the index)")
                    continue
                try:
                    remote.get(shard, os.path.join(local, shard))
                    _check_shard(local, s, part["layers"], checksum=True, notes=notes)
                except FileNotFoundError:
                    problems.append(f"{remote.url_of(shard)}: missing (listed in the index)")
                except (CaptureDamagedError, RemoteStorageError) as e:
                    problems.append(say(str(e)))
                finally:
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(local, shard))
        if "index.json" in listing:
            try:
                obj = _load_json(os.path.join(local, "index.json"))
                if isinstance(obj, dict):
                    _check_checksum(os.path.join(local, "index.json"), obj, "the merged index")
            except CaptureDamagedError as e:
                problems.append(say(str(e)))
        for name in sorted(listing):
            if name.startswith("shard-r") and "/" not in name and name not in seen and not problems:
                notes.append(f"{remote.url_of(name)}: not listed in the index (debris)")
        notes = [say(n) for n in notes]
        return problems, notes
    finally:
        shutil.rmtree(local, ignore_errors=True)
