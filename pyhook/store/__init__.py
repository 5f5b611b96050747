"""On-disk activation store: crash-safe safetensors shards, a JSON index, a memory-mapped reader.

Layout of a capture directory::

    out/
      shard-r000-000000.safetensors   # rank 0, shard 0: one tensor per layer, rows along dim 0
      shard-r000-000001.safetensors
      shard-r001-000000.safetensors   # rank 1 (torchrun), same output directory
      index-r000.json                 # rank 0's part of the index (source of truth, crash-consistent)
      index-r000.journal              # shards listed since (one line each; compacted at close)
      index-r001.json
      index.json                      # all ranks merged, written when the capture closes

This package is the store's public face; the code lives in the pipeline's stages
(:mod:`pyhook.pipeline`): ``format`` (bytes on disk, index schema, errors), ``verify``
(checks), ``writer``, ``reader`` and ``transport`` (fsspec URLs such as ``s3://bucket/prefix``,
accepted wherever a directory is). ``pyhook.store.format``, ``.verify``, ``.writer``,
``.reader`` and ``.remote`` are those modules under their old names.

* :class:`ShardWriter` buffers rows in host memory (at most ``max_buffer_bytes``, 256 MiB by
  default) and hands full shards to a background thread (when the disk is slower than the
  model, the model waits instead of memory growing). A shard is written to ``*.tmp``, fsynced
  and renamed, and only then listed (in the index for the first shard of a run, then by one
  fsynced journal line: O(1) per shard), so after a crash every listed shard is complete and
  unlisted debris is removed on the next open. The index records each shard's size, CRC32C
  checksum and example range, and its own checksum. Reopening with the same settings resumes
  (:attr:`ShardWriter.examples_done` says how many examples to skip) after checking every listed
  shard (size, header, checksum); different settings raise :class:`CaptureExistsError`, a
  damaged shard :class:`CaptureDamagedError` naming it.
* :class:`CaptureReader` (:func:`open_capture`) merges the per-rank index files, checks every
  shard's size and header against them (``verify=True``: the checksums too), maps each shard
  into memory without reading it, and returns per-layer :class:`LayerData` (reads are copies the
  caller owns) or iterates in sequential or shuffled row batches. :func:`verify_capture`
  (``pyhook verify``) lists every problem of a directory.
* A store from someone else is untrusted input: every index file, journal line and shard
  header is parsed with size and nesting bounds and checked against one schema per kind
  (``format.check_part``, ``check_journal_line``, ``check_merged``, ``check_header``) by the
  readers, verify and a resume alike; no store file is read or written through a symbolic
  link. What verify passes, the readers read (docs/integrity.md, "Received stores: the
  threat model").

The shard files are plain safetensors (``safetensors.torch.load_file`` reads them); pyhook writes
them itself so that the pieces of a shard go to the file without being concatenated first.
"""

from ..pipeline import format, reader, verify, writer  # noqa: F401 - the pipeline's modules
from ..pipeline import transport as remote  # noqa: F401 - its old name
from ..pipeline.format import (  # noqa: F401 - the helpers below stay importable from pyhook.store
    _CHECKSUM_FUNCS,
    CHECKSUM,
    FORMAT_VERSION,
    CaptureDamagedError,
    CaptureExistsError,
    CaptureWriteError,
    dtype_name,
    parse_dtype,
    write_safetensors,
)
from ..pipeline.reader import CaptureReader, LayerData, open_capture
from ..pipeline.transport import RemoteStorageError, is_url
from ..pipeline.transport import merged_index_of as merged_index  # noqa: F401 - also URLs
from ..pipeline.verify import verify_capture
from ..pipeline.writer import ShardWriter

# The public objects say they are pyhook.store's (their documented home), not a submodule's.
for _obj in (
    CaptureDamagedError,
    CaptureExistsError,
    CaptureReader,
    CaptureWriteError,
    LayerData,
    RemoteStorageError,
    ShardWriter,
    is_url,
    open_capture,
    verify_capture,
):
    _obj.__module__ = __name__
del _obj

__all__ = [
    "CHECKSUM",
    "FORMAT_VERSION",
    "CaptureDamagedError",
    "CaptureExistsError",
    "CaptureReader",
    "CaptureWriteError",
    "LayerData",
    "RemoteStorageError",
    "ShardWriter",
    "open_capture",
    "verify_capture",
    "is_url",
]
