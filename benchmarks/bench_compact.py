"""Compact stores (issue 26): what fp8 / int8 / zstd cost and save, on real activations.

Run:  python benchmarks/bench_compact.py [--quick] [--dir DIR]

One run captures all-MiniLM-L6-v2's six residual streams (``resid_post.*``, 384 values a row)
over the bundled corpus (``pyhook capture``'s defaults: contexts of 128 tokens, no special
tokens) into a float32 store, then, from those rows:

(a) writes one store per encoding (fp32, bf16, fp8, int8, bf16+zstd, fp8+zstd) with
    ``ShardWriter`` (batches of 4096 rows per layer, ``fsync=False``: the encoding's cost, not
    the disk's), in paired rounds (a shuffled order each round): bytes per row, rows/s (wall)
    and CPU seconds (user + system of this process, all threads), each against bf16;
(b) reads shuffled batches (``dataset``, global shuffle, 2048 rows of all six layers, in this
    process) from each store in paired rounds: rows/s against the bf16 store read in the same
    output dtype (the target, fp8 within 10% of bf16, compares both read as bfloat16: the same
    bytes out; both read as float32 is shown too). zstd twice: with the decoded-chunk cache warm (the store fits in it) and with
    no cache (every batch decodes every chunk it touches: the cost when the store is much
    larger than the cache);
(c) the codec alone on the bf16 rows: ratio with and without the byte-plane split, encode and
    decode MB/s per core (process CPU time, one thread);
(d) dictionary quality: the same ReLU sparse autoencoder (same seeds, width, steps, batch
    order) trained on ``resid_post.3`` rows read from each store (the last 10% of the contexts
    held out), evaluated on the held-out rows as captured (fp32): fraction of variance
    unexplained (FVU) and L0. Target: fp8's FVU within 1% (relative) of bf16's.

At the end: one table of the targets, measured in this run, with pass/miss.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

import pyhook
from pyhook.pipeline import encoding
from pyhook.store import ShardWriter, open_capture

ENCODINGS = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {}),
    "fp8": (torch.float32, {"quantize": "fp8"}),
    "int8": (torch.float32, {"quantize": "int8"}),
    "bf16+zstd": (torch.bfloat16, {"compress": "zstd"}),
    "fp8+zstd": (torch.float32, {"quantize": "fp8", "compress": "zstd"}),
}
LAYER = "resid_post.3"


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(t0: tuple[float, float]) -> tuple[float, float]:
    return time.perf_counter() - t0[0], time.process_time() - t0[1]


def capture(root: str) -> tuple[str, dict[str, torch.Tensor]]:
    out = os.path.join(root, "captured")
    job = pyhook.CaptureJob(model="minilm", layers=["resid_post.*"], out=out)
    t0 = clock()
    job.run()
    wall, _ = since(t0)
    r = open_capture(out)
    rows = {name: r[name].to_tensor() for name in r.layers}
    n = len(rows[LAYER])
    print(f"captured {len(rows)} layers x {n:,} rows x 384 (fp32) in {wall:.1f} s; {load()}")
    return out, rows


def write_store(path: str, rows: dict[str, torch.Tensor], enc: str) -> tuple[float, float]:
    kw = ENCODINGS[enc][1]
    shutil.rmtree(path, ignore_errors=True)
    e = encoding.Encoding(**kw) if kw else None
    t0 = clock()
    with ShardWriter(path, fsync=False, shard_bytes=64 << 20, encoding=e) as w:
        n = len(next(iter(rows.values())))
        for a in range(0, n, 4096):
            w.add({k: v[a : a + 4096] for k, v in rows.items()}, examples=min(4096, n - a))
    return since(t0)


def bench_writes(root: str, rows: dict[str, torch.Tensor], rounds: int) -> dict[str, dict]:
    cast = {enc: {k: v.to(dtype) for k, v in rows.items()} for enc, (dtype, _) in ENCODINGS.items()}
    times: dict[str, list[tuple[float, float]]] = {enc: [] for enc in ENCODINGS}
    for _ in range(rounds):
        order = list(ENCODINGS)
        random.shuffle(order)
        for enc in order:
            times[enc].append(write_store(os.path.join(root, enc), cast[enc], enc))
    n = len(rows[LAYER]) * len(rows)
    out = {}
    for enc in ENCODINGS:
        r = open_capture(os.path.join(root, enc))
        nbytes = sum(
            encoding.layer_bytes(r.index["layers"][k], r._shards, k)[0]
            if "encoding" in r.index["layers"][k]
            else r.index["layers"][k]["rows"] * 384 * ENCODINGS[enc][0].itemsize
            for k in r.layers
        )
        wall = statistics.median(t for t, _ in times[enc])
        cpu = statistics.median(c for _, c in times[enc])
        out[enc] = {"bytes_per_row": nbytes / n, "rows_s": n / wall, "cpu": cpu}
    return out


def out_dtype(enc: str, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a read case returns: the one asked for, else the store's logical dtype."""
    return dtype or ENCODINGS[enc][0]


def bench_reads(root: str, rounds: int, batches: int) -> dict[tuple, dict]:
    # (store, decoded-chunk cache, dtype the dataset returns). Every case is compared with the
    # bf16 store read in the same output dtype: fp8/int8 as bfloat16 against bf16 as bfloat16
    # (the same bytes out: what the target refers to), and as float32 against the bf16 store
    # read as float32 (gathered, then cast).
    cases = [(enc, True, None) for enc in ENCODINGS] + [("bf16+zstd", False, None)]
    cases += [("bf16", True, torch.float32)]
    cases += [("fp8", True, torch.bfloat16), ("int8", True, torch.bfloat16)]
    cases += [("fp8+zstd", True, torch.bfloat16)]
    datasets = {}
    for enc, cache, dtype in cases:
        ds = open_capture(os.path.join(root, enc)).dataset(
            batch_size=2048, seed=0, dtype=dtype, chunk_cache_bytes=None if cache else 0
        )
        for _ in ds:  # opens the maps (and, cached, decodes every chunk once)
            pass
        datasets[(enc, cache, dtype)] = ds
    per: dict[tuple, list[float]] = {c: [] for c in cases}
    cpu: dict[tuple, list[float]] = {c: [] for c in cases}
    for i in range(rounds):
        order = list(cases)
        random.shuffle(order)
        for c in order:
            ds = datasets[c]
            rows = 0
            t0 = clock()
            ds.set_epoch(1 + i)
            for n, b in enumerate(ds):
                rows += len(b[LAYER])
                if n + 1 == batches:
                    break
            wall, c_s = since(t0)
            per[c].append(rows / wall)
            cpu[c].append(c_s / rows * 1e6)
    base = {
        torch.bfloat16: ("bf16", True, None),
        torch.float32: ("bf16", True, torch.float32),
    }
    out = {}
    for c in cases:
        ref = base[out_dtype(c[0], c[2])]
        ratios = [a / b for a, b in zip(per[c], per[ref])]
        cpu_ratios = [a / b for a, b in zip(cpu[c], cpu[ref])]
        out[c] = {
            "rows": per[c],
            "rows_s": statistics.median(per[c]),
            "vs_bf16": statistics.median(ratios),
            "cpu_vs_bf16": statistics.median(cpu_ratios),
            "cpu_us_row": statistics.median(cpu[c]),
        }
    return out


def bench_codec(rows: dict[str, torch.Tensor], repeats: int) -> list[dict]:
    x = torch.cat(list(rows.values())).bfloat16()
    raw = x.numel() * 2
    out = []
    for planes in (1, 2):
        info = encoding.Encoding(compress="zstd", byte_planes=planes > 1).layer_info(
            "h", x.dtype, {"dtype": "bfloat16", "row_shape": [384]}
        )["encoding"]
        cr = info["chunk_rows"]
        enc_t, dec_t = [], []
        for _ in range(repeats):
            t0 = time.process_time()
            blob, off = encoding.compress_rows(x, cr, level=info["level"], planes=planes)
            enc_t.append(time.process_time() - t0)
            chunks = (off.numel() - 1) // planes
            t0 = time.process_time()
            for c in range(chunks):
                encoding.decompress_chunk(
                    blob, off, c, min(cr, len(x) - c * cr), x.dtype, (384,), planes
                )
            dec_t.append(time.process_time() - t0)
        out.append(
            {
                "planes": planes,
                "ratio": raw / blob.numel(),
                "enc": raw / statistics.median(enc_t) / 1e6,
                "dec": raw / statistics.median(dec_t) / 1e6,
                "chunk_rows": cr,
                "level": info["level"],
            }
        )
    return out


def train_sae(batches, d: int, width: int, seed: int, scale: float, k: int):
    """A TopK sparse autoencoder (k active latents a row at most), Adam, MSE loss."""
    g = torch.Generator().manual_seed(seed)
    w_enc = torch.nn.Parameter(torch.randn(d, width, generator=g) / d**0.5)
    w_dec = torch.nn.Parameter(w_enc.detach().t().clone())
    b_enc = torch.nn.Parameter(torch.zeros(width))
    b_dec = torch.nn.Parameter(torch.zeros(d))
    opt = torch.optim.Adam([w_enc, w_dec, b_enc, b_dec], lr=1e-3)
    for x in batches:
        x = x.float() * scale
        f = encode((x - b_dec) @ w_enc + b_enc, k)
        x_hat = f @ w_dec + b_dec
        loss = (x_hat - x).pow(2).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w_enc.detach(), b_enc.detach(), w_dec.detach(), b_dec.detach()


def encode(pre: torch.Tensor, k: int) -> torch.Tensor:
    top = pre.topk(k, dim=1)
    return torch.zeros_like(pre).scatter(1, top.indices, torch.relu(top.values))


@torch.no_grad()
def evaluate(sae, x: torch.Tensor, scale: float, k: int) -> tuple[float, float]:
    w_enc, b_enc, w_dec, b_dec = sae
    x = x * scale
    f = encode((x - b_dec) @ w_enc + b_enc, k)
    x_hat = f @ w_dec + b_dec
    fvu = float((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
    return fvu, float((f > 0).float().sum(1).mean())


def bench_sae(root: str, captured: str, quick: bool) -> dict[str, dict]:
    cap = open_capture(captured)
    examples = cap.row_index[:, 0]
    held = examples >= int(examples.max() * 0.9)
    test = cap[LAYER][held.nonzero().squeeze(1)]
    stats = cap.stats(LAYER)
    scale = 384**0.5 / float(stats["norm_mean"])
    width, epochs, k = (512, 2, 32) if quick else (1024, 6, 32)
    seeds = [0] if quick else [0, 1, 2]
    out = {}
    for enc in ENCODINGS:
        lossless = {"bf16+zstd": "bf16", "fp8+zstd": "fp8"}.get(enc)
        if lossless:  # the same rows as its uncompressed store (checked): the same SAE
            a = open_capture(os.path.join(root, enc))[LAYER].to_tensor()
            b = open_capture(os.path.join(root, lossless))[LAYER].to_tensor()
            assert torch.equal(
                a.view(torch.int16) if a.itemsize == 2 else a.view(torch.int32),
                b.view(torch.int16) if b.itemsize == 2 else b.view(torch.int32),
            )
            out[enc] = {**out[lossless], "same_as": lossless}
            continue
        ds = open_capture(os.path.join(root, enc)).dataset(
            LAYER, batch_size=256, seed=7, with_index=True
        )
        fvus, l0s = [], []
        for seed in seeds:

            def batches(ds=ds):
                for e in range(epochs):
                    ds.set_epoch(e)
                    for b in ds:
                        keep = ~held[b["index"]]
                        yield b[LAYER][keep]

            torch.manual_seed(seed)
            sae = train_sae(batches(), 384, width, seed, scale, k)
            fvu, l0 = evaluate(sae, test, scale, k)
            fvus.append(fvu)
            l0s.append(l0)
        out[enc] = {"fvu": statistics.mean(fvus), "fvus": fvus, "l0": statistics.mean(l0s)}
        print(
            f"  SAE on {enc:10s}: FVU {out[enc]['fvu']:.4f} {[round(f, 4) for f in fvus]}, L0 {out[enc]['l0']:.1f}; {load()}",
            flush=True,
        )
    out["_setup"] = {
        "width": width,
        "epochs": epochs,
        "seeds": len(seeds),
        "k": k,
        "train": int((~held).sum()),
        "test": int(held.sum()),
    }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds, a smaller SAE (< 2 min)")
    p.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    args = p.parse_args()
    random.seed(0)
    root = args.dir or tempfile.mkdtemp(prefix="pyhook-compact-")
    rounds = 2 if args.quick else 5
    torch.set_num_threads(1)  # one core each: the CPU-time columns compare like with like
    print(f"bench_compact: torch {torch.__version__}, {os.cpu_count()} CPUs, {load()}")
    try:
        captured, rows = capture(root)
        w = bench_writes(root, rows, rounds)
        print(f"writes done; {load()}", flush=True)
        rd = bench_reads(root, rounds, 4 if args.quick else 1000)
        print(f"reads done; {load()}", flush=True)
        codec = bench_codec(rows, 1 if args.quick else 3)
        sae = bench_sae(root, captured, args.quick)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    setup = sae.pop("_setup")

    print(
        f"\n(a, b) {len(rows[LAYER]):,} rows x 6 layers of 384; medians of {rounds} paired rounds; {load()}"
    )
    head = (
        f"{'store, read as':24s} {'B/row':>7s} {'vs fp32':>8s} {'write rows/s':>13s} "
        f"{'write CPU s':>12s} {'read rows/s':>12s} {'vs bf16 as same':>16s} "
        f"{'CPU/row vs':>11s} {'read CPU us/row':>16s}"
    )
    print(head)
    print("-" * len(head))
    for (enc, cache, dtype), r in rd.items():
        wr = w[enc]
        as_ = {torch.bfloat16: "bf16", torch.float32: "f32"}[out_dtype(enc, dtype)]
        name = f"{enc}{'' if cache else ' (no cache)'} as {as_}"
        print(
            f"{name:24s} {wr['bytes_per_row']:7.1f} {w['fp32']['bytes_per_row'] / wr['bytes_per_row']:7.2f}x "
            f"{wr['rows_s']:13,.0f} {wr['cpu']:12.2f} {r['rows_s']:12,.0f} {r['vs_bf16']:15.2f}x "
            f"{r['cpu_vs_bf16']:10.2f}x {r['cpu_us_row']:16.2f}"
        )
    print(
        "  (vs bf16 as same: rows/s against the bf16 store read in the same output dtype, median\n"
        "   of the per-round ratios; CPU/row vs: its process CPU time a row against that case's)"
    )
    print("\n(c) zstd on the bf16 rows of all six layers (one thread, process CPU time)")
    for c in codec:
        print(
            f"  byte planes {'on ' if c['planes'] > 1 else 'off'}: ratio {c['ratio']:.3f}x, encode "
            f"{c['enc']:.0f} MB/s, decode {c['dec']:.0f} MB/s per core (chunks of {c['chunk_rows']} rows, level {c['level']})"
        )
    print(
        f"\n(d) TopK SAE (k={setup['k']}) on {LAYER}: width {setup['width']}, {setup['epochs']} epochs of batches of 256 "
        f"over {setup['train']:,} rows, {setup['seeds']} seed(s); held out: {setup['test']:,} rows (fp32)"
    )
    for enc, s in sae.items():
        rel = (s["fvu"] - sae["bf16"]["fvu"]) / sae["bf16"]["fvu"]
        same = f"  (rows bit-identical to {s['same_as']}'s: its SAE)" if "same_as" in s else ""
        print(f"  {enc:10s} FVU {s['fvu']:.4f} ({rel:+.2%} vs bf16)  L0 {s['l0']:.1f}{same}")
    spread = max(sae["bf16"]["fvus"]) - min(sae["bf16"]["fvus"])
    if len(sae["bf16"]["fvus"]) > 1:
        print(f"  (bf16's seed-to-seed spread: {spread / sae['bf16']['fvu']:.2%} of its FVU)")

    fp8_read = rd[("fp8", True, torch.bfloat16)]["vs_bf16"]
    fp8_read32 = rd[("fp8", True, None)]["vs_bf16"]
    fp8_vs_fp32 = statistics.median(
        a / b for a, b in zip(rd[("fp8", True, None)]["rows"], rd[("fp32", True, None)]["rows"])
    )
    fp8_fvu = (sae["fp8"]["fvu"] - sae["bf16"]["fvu"]) / sae["bf16"]["fvu"]
    ratio = max(c["ratio"] for c in codec)
    print(f"\ntargets ({load()}):")
    print(
        f"  fp8 shuffled read rows/s vs bf16 >= 0.90x: {fp8_read:.2f}x  {'met' if fp8_read >= 0.9 else 'MISSED'}"
        f"  (both read as bfloat16; both read as float32: {fp8_read32:.2f}x)"
    )
    print(f"  (fp8 read as float32 vs the fp32 store, a plain float32 gather: {fp8_vs_fp32:.2f}x)")
    print(
        f"  fp8 FVU within 1% of bf16's:             {fp8_fvu:+.2%}  {'met' if abs(fp8_fvu) <= 0.01 else 'MISSED'}"
    )
    print(
        f"  zstd ratio on bf16 activations >= 1.3x:  {ratio:.3f}x  {'met' if ratio >= 1.3 else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
