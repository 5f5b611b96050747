"""A gather (csrc/cpu/gather.cpp) returns exactly the rows of ``idx`` in ``idx``'s order,
whatever the order, repeats, parts, row numbers and threads. Checked against an independent
spec (``torch.cat(parts)[idx]``), the reference backend and, through
:class:`~pyhook.dataset.CaptureDataset`, against plain indexing of the reader."""

from __future__ import annotations

import pytest
import torch
from pyhook.dataset import CaptureDataset

import pyhook
from pyhook import _backend
from pyhook._backend import gather_rows, gather_rows_into
from pyhook.store import ShardWriter


def spec(parts, idx):
    return torch.cat(parts)[idx]


def make_parts(sizes, row_shape=(768,), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn((n, *row_shape), generator=g) * 100).to(dtype) for n in sizes]


def orders(total, n, seed):
    """Index vectors of length ``n``: random with repeats, a permutation, ascending with
    repeats, descending, blocks of consecutive rows in shuffled order, and one row repeated."""
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, total, (n,), generator=g)
    perm = torch.randperm(total, generator=g)[: min(n, total)]
    blocks = torch.randperm(total // 8, generator=g)[: max(1, n // 8)]
    runs = (blocks[:, None] * 8 + torch.arange(8)).flatten()[:n]
    return {
        "random with repeats": rand,
        "permutation": perm,
        "ascending with repeats": rand.sort().values,
        "descending": rand.sort(descending=True).values,
        "shuffled runs of 8": runs,
        "one row": torch.full((n,), total // 2),
    }


# 4099: several pieces of work, on helper threads when a core is free.
@pytest.mark.parametrize("n", [1, 63, 64, 511, 512, 4099])
def test_every_order_matches_the_spec_and_the_reference(native, n):
    parts = make_parts((700, 3, 0, 1300), row_shape=(75,))
    total = 2003
    for name, idx in orders(total, n, seed=n).items():
        want = spec(parts, idx)
        got = gather_rows(parts, idx)
        assert torch.equal(got, want), name
        out = torch.full_like(want, 7)
        assert torch.equal(gather_rows_into(parts, idx, out), want), name
        with _backend.use_backend("reference"):
            assert torch.equal(gather_rows(parts, idx), want), name


def test_many_layers_in_one_call(native):
    g = torch.Generator().manual_seed(5)
    a = torch.randn(3000, 768, generator=g)
    b = (torch.randn(3000, 2, 9, generator=g) * 50).to(torch.bfloat16)
    t = torch.randint(0, 50_000, (3000,), generator=g)
    layers = [list(a.split([900, 2100])), [b], list(t.split([1, 2999]))]
    flat = [p for parts in layers for p in parts]
    counts = [len(parts) for parts in layers]
    for idx in orders(3000, 2048, seed=1).values():
        got = torch.ops.pyhook.gather_rows_many(flat, counts, idx)
        outs = [torch.zeros_like(x) for x in got]
        torch.ops.pyhook.gather_rows_many_into(flat, counts, idx, outs)
        for parts, x, o in zip(layers, got, outs):
            assert torch.equal(x, spec(parts, idx)) and torch.equal(o, x)


def test_rows_far_apart_are_found_in_every_part(native):
    # Parts of 2**38 rows each (a row stride of 0: no memory), then a dense part: row numbers
    # of 41 bits, and rows of every part.
    consts = [torch.full((1, 4), float(i)).expand(2**38, 4) for i in range(8)]
    dense = torch.arange(400.0).reshape(100, 4)
    parts = [*consts, dense]
    g = torch.Generator().manual_seed(3)
    part = torch.randint(0, 9, (1000,), generator=g)
    within = torch.randint(0, 2**38, (1000,), generator=g)
    within = torch.where(part == 8, within % 100, within)
    idx = part * 2**38 + within
    got = gather_rows(parts, idx)
    want = torch.where(
        (part == 8)[:, None], dense[(within % 100)], part[:, None].float().expand(-1, 4)
    )
    assert torch.equal(got, want)


def test_row_numbers_up_to_2_62_are_exact(native):
    # 2**62 rows (two parts of 2**61 with a row stride of 0) and a dense part between them.
    parts = [torch.full((1, 2), 1.0).expand(2**61, 2), torch.arange(20.0).reshape(10, 2)]
    parts.append(torch.full((1, 2), 3.0).expand(2**61, 2))
    g = torch.Generator().manual_seed(8)
    idx = torch.randint(0, 10, (4096,), generator=g) + 2**61
    idx[::3] = torch.randint(0, 2**62 + 10, (len(idx[::3]),), generator=g)
    got = gather_rows(parts, idx)
    dense = (idx >= 2**61) & (idx < 2**61 + 10)
    const = torch.where(idx < 2**61, 1.0, 3.0)[:, None].expand(-1, 2)
    want = torch.where(dense[:, None], parts[1][(idx - 2**61).clamp(0, 9)], const)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad", [-1, 4000, 10**12])
def test_out_of_range_is_named_before_anything_is_written(native, bad):
    parts = make_parts((1000, 3000), row_shape=(16,))
    idx = torch.randint(0, 4000, (4096,), generator=torch.Generator().manual_seed(2))
    idx[1234] = bad
    with pytest.raises(
        IndexError, match=rf"index {bad} \(at position 1234 of idx\) is out of range for 4000 rows"
    ):
        gather_rows(parts, idx)
    out = torch.full((4096, 16), 7.0)
    with pytest.raises(IndexError, match=rf"index {bad} \(at position 1234 of idx\)"):
        gather_rows_into(parts, idx, out)
    assert bool((out == 7.0).all())


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """A capture of three shards and two layers plus token ids."""
    out = str(tmp_path_factory.mktemp("orders") / "cap")
    g = torch.Generator().manual_seed(0)
    with ShardWriter(out, shard_bytes=1) as w:  # one shard per add
        for s in range(0, 1500, 500):
            w.add(
                {
                    "a": torch.randn(500, 192, generator=g),
                    "b": torch.randn(500, 8, generator=g).to(torch.bfloat16),
                    "__token_ids__": torch.arange(s, s + 500),
                },
                examples=500,
            )
    return out


def test_dataset_batches_equal_plain_indexing_in_both_backends(capture):
    reader = pyhook.open_capture(capture)
    assert len(reader.layer("a")._sources) == 3  # several shards
    want_a, want_b = reader["a"][:], reader["b"][:]
    for backend in ("native", "reference"):
        with _backend.use_backend(backend):
            ds = CaptureDataset(
                capture, ["a", "b"], batch_size=700, tokens=True, with_index=True, seed=3
            )
            seen = []
            for batch in ds:
                i = batch["index"]
                assert torch.equal(batch["a"], want_a[i]), backend
                assert torch.equal(batch["b"], want_b[i]), backend
                assert torch.equal(batch["tokens"], i), backend
                seen.append(i)
            assert sorted(torch.cat(seen).tolist()) == list(range(1500))
            dup = torch.tensor([1499, 0, 0, 750, 3, 1499, 2] * 20)
            assert torch.equal(ds.batch(dup)["a"], want_a[dup])
            with pytest.raises(IndexError, match=r"index 1500 \(at position 1 of idx\)"):
                ds.batch([4, 1500, 2])


def test_set_backend_reference_gives_identical_batches(capture):
    ds = CaptureDataset(capture, ["a", "b"], batch_size=512, tokens=True, seed=1)
    native = list(ds)
    # use_backend puts back the choice itself ('auto'), not the backend it resolved to
    with _backend.use_backend("reference"):
        assert pyhook.get_backend() == "reference"
        reference = list(CaptureDataset(capture, ["a", "b"], batch_size=512, tokens=True, seed=1))
    assert len(native) == len(reference) == 3
    for x, y in zip(native, reference):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_large_outputs_start_at_a_page_boundary(native):
    # A pooled buffer 64 bytes past a page boundary put one 3 KB row in four 64 bytes ahead of
    # its page-aligned source modulo 4 KiB (4K aliasing); the readers it is compared with use
    # page-aligned buffers.
    parts = make_parts((300, 700), row_shape=(768,))
    for n in (22, 1000, 3000):  # 66 KB and more: aligned; the rows exact either way
        idx = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n))
        for _ in range(3):  # fresh and reused pool buffers
            out = gather_rows(parts, idx)
            assert out.data_ptr() % 4096 == 0
            assert torch.equal(out, spec(parts, idx))
            out.fill_(1.5)  # the whole buffer is writable
            del out
    t = torch.ops.pyhook.empty_pooled([4096, 768], torch.float32)
    assert t.data_ptr() % 4096 == 0 and t.untyped_storage().nbytes() == 4096 * 768 * 4
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * 4096 * 768
