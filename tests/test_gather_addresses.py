"""The row copies of a gather look each row's part up once (``row_addresses``, a binary search
without data-dependent branches, ``part_of_row_branchless`` in csrc/pyhook.h), then copy by
address: rows whose source addresses follow each other are one copy. Checked against an
independent spec (``torch.cat(parts)[idx]``) and the reference backend: many parts (one per
shard) with parts of no rows and of one row anywhere in the list, parts whose rows are not
adjacent in memory (a strided view), parts that are adjacent slices of one tensor (so a run of
consecutive rows crosses from one part into the next by address), batches below and above the
1 MiB at which helper threads and the streaming stores start, and several layers in one call."""

from __future__ import annotations

import pytest
import torch

from pyhook import _backend, _reference
from pyhook._backend import gather_rows, gather_rows_into


def spec(parts, idx):
    return torch.cat(parts)[idx]


SIZES = [
    (0, 5, 0, 7, 1, 0, 3),  # parts of no rows first, between and last
    (1,) * 17,  # one row a part: every row in another part
    (300, 0, 0, 1, 299, 2, 511, 0),
    tuple(range(0, 40)),  # 40 parts, 780 rows: six steps of the search
]


def indices(total, n, seed):
    g = torch.Generator().manual_seed(seed)
    shuffled = torch.randint(0, total, (n,), generator=g)
    sequential = torch.arange(n) % total
    backwards = torch.arange(total - 1, -1, -1)[:n]
    # runs of 9 consecutive rows starting anywhere (across part boundaries too)
    starts = torch.randint(0, max(1, total - 9), ((n + 8) // 9,), generator=g)
    runs = (starts[:, None] + torch.arange(9)).flatten()[:n].clamp(max=total - 1)
    return {"shuffled": shuffled, "sequential": sequential, "backwards": backwards, "runs": runs}


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("row", [3, 768])
@pytest.mark.parametrize("layout", ["separate", "slices of one tensor", "strided rows"])
def test_every_part_layout_matches_the_spec_and_the_reference(native, sizes, row, layout):
    total = sum(sizes)
    g = torch.Generator().manual_seed(total + row)
    if layout == "separate":
        parts = [torch.randn(n, row, generator=g) for n in sizes]
    elif layout == "slices of one tensor":  # adjacent in memory: runs may cross parts
        parts = list(torch.randn(total, row, generator=g).split(list(sizes)))
    else:  # every other row of a tensor: rows dense, not adjacent
        parts = [torch.randn(2 * n, row, generator=g)[::2] for n in sizes]
        assert all(p.stride(0) == 2 * row for p in parts if len(p) > 1)
    # 4096 rows of 3 KB: 12.6 MB, helper threads and streaming stores; and a small batch.
    for n in (37, 4096 if row == 768 else 1000):
        for name, idx in indices(total, n, seed=n).items():
            want = spec(parts, idx)
            got = gather_rows(parts, idx)
            assert torch.equal(got, want), (name, n)
            assert torch.equal(_reference.gather_rows(parts, idx), want), (name, n)
            out = torch.empty_like(want)
            assert torch.equal(gather_rows_into(parts, idx, out), want), (name, n)


@pytest.mark.parametrize("n", [1, 64, 4096])
def test_several_layers_of_many_parts_in_one_call(native, n):
    g = torch.Generator().manual_seed(n)
    sizes = [[0, 300, 1, 0, 700], [1001], [500, 501]]
    layers = [
        [torch.randn(k, 768, generator=g) for k in sizes[0]],
        list((torch.randn(1001, 2, 9, generator=g) * 50).to(torch.bfloat16).split(sizes[1])),
        list(torch.randint(0, 50_000, (1001,), generator=g).split(sizes[2])),
    ]
    idx = torch.randint(0, 1001, (n,), generator=g)
    flat = [p for parts in layers for p in parts]
    outs = _backend._gather_many_direct(flat, [len(p) for p in layers], idx)
    for parts, got in zip(layers, outs):
        assert torch.equal(got, spec(parts, idx))
