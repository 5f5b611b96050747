"""A gather of 1 MiB or more writes its output with non-temporal stores (csrc/cpu/gather.cpp,
``copy_streaming``, with AVX2): a memcpy of the row's first bytes up to a 32-byte boundary of the
destination, 128-byte blocks of streaming stores, then a memcpy of the rest. The result must be
exactly the rows of ``idx`` whatever the row size (below, at and above 256 bytes, not a
multiple of 32), the destination's alignment (``gather_rows_into`` into a view that starts 4,
12 or 20 bytes past a 64-byte boundary), runs of consecutive rows (one copy for the run), several
layers in one call, and either side of the 1 MiB threshold. Checked against an independent
spec (``torch.cat(parts)[idx]``) and the reference backend."""

from __future__ import annotations

import pytest
import torch

from pyhook import _backend
from pyhook._backend import gather_rows, gather_rows_into

MIB = 1 << 20


def spec(parts, idx):
    return torch.cat(parts)[idx]


def make_parts(sizes, row_shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn((n, *row_shape), generator=g) * 100).to(dtype) for n in sizes]


def batches(total, n, seed):
    """Shuffled rows with repeats, and blocks of 40 consecutive rows in a shuffled order (one
    copy of 40 rows each: the streaming loop with a long run)."""
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, total, (n,), generator=g)
    blocks = torch.randperm(total // 40, generator=g)[: n // 40 + 1]
    runs = (blocks[:, None] * 40 + torch.arange(40)).flatten()[:n]
    return {"shuffled": rand, "runs of 40": runs}


def unaligned_out(shape, dtype, skew_bytes):
    """A contiguous tensor of ``shape`` starting ``skew_bytes`` past a 64-byte boundary."""
    item = torch.empty((), dtype=dtype).element_size()
    assert skew_bytes % item == 0
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.empty(numel + 64 // item + skew_bytes // item, dtype=dtype)
    off = (-raw.data_ptr() % 64) // item + skew_bytes // item
    out = raw[off : off + numel].view(shape)
    assert out.data_ptr() % 64 == skew_bytes and out.is_contiguous()
    return out


# Row bytes: 36 (below 256: memcpy only), 258 (just past 256, not a multiple of 16), 300, 3072.
@pytest.mark.parametrize(
    ("dtype", "row_shape"),
    [
        (torch.bfloat16, (2, 9)),
        (torch.float16, (129,)),
        (torch.float32, (75,)),
        (torch.float32, (768,)),
    ],
)
@pytest.mark.parametrize("skew", [0, 4, 12, 20])
def test_large_gathers_match_the_spec_whatever_the_alignment(native, dtype, row_shape, skew):
    parts = make_parts((900, 0, 1700, 3), row_shape, dtype=dtype, seed=skew)
    total = 2603
    row_bytes = parts[0][0].numel() * parts[0].element_size()
    n = max(64, (3 * MIB) // row_bytes)  # past the 1 MiB threshold
    if skew % parts[0].element_size():
        pytest.skip("the skew is not a whole number of elements")
    for name, idx in batches(total, n, seed=n).items():
        want = spec(parts, idx)
        got = gather_rows(parts, idx)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        out = unaligned_out(tuple(want.shape), dtype, skew)
        out.view(torch.uint8).fill_(0xA5)
        gather_rows_into(parts, idx, out)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), name
        with _backend.use_backend("reference"):
            assert torch.equal(gather_rows(parts, idx).view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("n", [MIB // 3072 - 1, MIB // 3072, MIB // 3072 + 1, 4096])
def test_either_side_of_the_threshold_gives_the_spec(native, n):
    parts = make_parts((3000, 1, 2999), (768,), seed=n)
    idx = torch.randint(0, 6000, (n,), generator=torch.Generator().manual_seed(n))
    assert torch.equal(gather_rows(parts, idx), spec(parts, idx))


def test_several_layers_in_one_call_match_the_spec(native):
    # 12 layers of 300-byte rows and one of token ids: 12 x 4096 x 300 B, streamed as one call.
    layers = [make_parts((1500, 2600), (75,), seed=s) for s in range(12)]
    layers.append([torch.arange(1500), torch.arange(1500, 4100)])
    counts = [len(p) for p in layers]
    flat = [t for p in layers for t in p]
    for name, idx in batches(4100, 4096, seed=3).items():
        got = _backend._gather_many_direct(flat, counts, idx)
        outs = [
            unaligned_out((len(idx), *p[0].shape[1:]), p[0].dtype, max(4, p[0].element_size()))
            for p in layers
        ]
        _backend._gather_many_direct_into(flat, counts, idx, outs)
        for p, g, o in zip(layers, got, outs):
            want = spec(p, idx)
            assert torch.equal(g, want), name
            assert torch.equal(o, want), name
