"""Code shared by tests/test_stream.py and the processes it starts (gloo ranks, a stream stopped
by SIGINT or killed): the corpus, tokenizer and model, built the same way in every process."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import traceback

import torch

DOCS = [f"doc {i} says {' '.join(['word'] * (i % 7))} end" for i in range(200)]
CONTEXT = 8
LAYERS = ["h.0", "h.1"]


def tokenizer():
    from _models import word_tokenizer

    return word_tokenizer(DOCS)


def write_corpus(path: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS}), path, row_group_size=37)
    return path


def model(vocab: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=vocab,
        n_positions=32,
        bos_token_id=None,
        eos_token_id=None,
    )
    return transformers.GPT2Model(cfg).eval()


def source(corpus: str, tok, **kw):
    from pyhook.source import open_source

    kw.setdefault("batch_size", 8)
    return open_source(corpus, tokenizer=tok, context_size=CONTEXT, **kw)


# -- two gloo ranks -------------------------------------------------------------------------
def dist_worker(rank: int, world: int, port: int, outdir: str, corpus: str, limit: int) -> None:
    import torch.distributed as dist

    import pyhook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    res: dict = {}
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        tok = tokenizer()
        net = model(len(tok))
        # a source opened without shares: the stream takes this rank's share itself
        src = source(corpus, tok, limit=limit)
        for name, tee in (("plain", None), ("tee", os.path.join(outdir, "tee"))):
            s = pyhook.stream(net, src, LAYERS, batch_size=16, buffer_rows=64, tee=tee)
            got = list(s)
            res[name] = {k: torch.cat([b[k] for b in got]) for k in got[0]}
            res[f"{name}_batches"] = len(got)
            if tee is not None:  # a second pass reads the complete tee, each rank its share
                again = list(s)
                res["tee_again"] = {k: torch.cat([b[k] for b in again]) for k in again[0]}
                res["tee_again_from_tee"] = (s.from_tee, s.examples)
        # a trainer with a collective per batch (as DDP makes) over uneven shares
        for even in (False, True):
            s = pyhook.stream(net, src, LAYERS, batch_size=4, buffer_rows=8, even_batches=even)
            n = 0
            for _ in s:
                if even:
                    dist.all_reduce(torch.ones(1))  # would wait forever for a rank run dry
                n += 1
            res[f"even{int(even)}"] = (n, s.rows, s.dropped_rows)
        dist.barrier()
    except BaseException:
        res["exception"] = traceback.format_exc()
    torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


# -- a stream stopped from outside ----------------------------------------------------------
def main() -> None:
    """``python _stream_workers.py MODE CORPUS TEE``: stream with a tee, consume slowly, print
    READY after the second batch; MODE sigint reports what is left after the KeyboardInterrupt."""
    _mode, corpus, tee = sys.argv[1:4]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _hygiene import diff, hook_snapshot

    import pyhook

    tok = tokenizer()
    net = model(len(tok))
    before = hook_snapshot(net)
    src = source(corpus, tok, batch_size=2)
    n = 0
    try:
        for _ in pyhook.stream(
            net, src, LAYERS, batch_size=16, buffer_rows=32, tee=tee, shard_bytes=4000
        ):
            n += 1
            if n == 2:
                print("READY", flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        left = diff(before, hook_snapshot(net))
        threads = [t.name for t in threading.enumerate() if t.name.startswith("pyhook")]
        print(f"STOPPED batches={n} hooks={left} threads={threads}", flush=True)
        sys.exit(0)
    print(f"FINISHED batches={n}", flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
