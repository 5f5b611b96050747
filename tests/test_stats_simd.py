"""The statistics kernel's AVX-512 and AVX2 builds (csrc/cpu/stats.cpp) give the same bits as its
baseline build (capped with the test op ``_test_stats_simd``) over dtypes, odd widths, strided views, inf and nan, one or
two threads; and all agree with the float64 torch reference (batch_stats' torch path). On a CPU
without AVX-512 (or AVX2) the first settings fall back to the next build: still the same bits."""

from __future__ import annotations

import pytest
import torch

from pyhook import _backend, annotations

pytestmark = pytest.mark.skipif(not _backend.native_available(), reason="needs the native kernel")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int8]
SHAPES = [(1, 1), (5, 3), (9, 7), (33, 8), (17, 9), (100, 63), (100, 65), (300, 257), (1024, 768)]


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int64).reshape(-1).tolist()


def _both(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The default build's result (AVX-512 where the CPU has it) and the baseline's; the AVX2
    build's (the level capped at 1) is checked against the default's here too."""
    cap = torch.ops.pyhook._test_stats_simd
    try:
        fast = torch.ops.pyhook.row_stats(rows)
        cap(1)
        avx2 = torch.ops.pyhook.row_stats(rows)
        cap(0)
        base = torch.ops.pyhook.row_stats(rows)
    finally:
        cap(2)
    assert _bits(avx2) == _bits(fast)
    return fast, base


def _rows(shape: tuple[int, int], dtype: torch.dtype, special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 100
    if dtype in (torch.int32, torch.int8):
        return (x - 100).round().clamp(-100, 100).to(dtype)
    x = x.to(dtype)
    if special:
        flat = x.view(-1)
        n = flat.numel()
        flat[n // 2] = float("inf")
        flat[n // 3] = float("nan")
        flat[n - 1] = -float("inf")
    return x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "dtype,special",
    [(d, s) for d in DTYPES for s in (False, True) if d.is_floating_point or not s],
    ids=lambda v: str(v) if isinstance(v, torch.dtype) else ("inf-nan" if v else "finite"),
)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_simd_build_gives_the_baseline_bits(shape, dtype, special, threads):
    rows = _rows(shape, dtype, special)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fast, base = _both(rows)
        assert _bits(fast) == _bits(base)
        view = rows[:, 1::2]  # a strided view: read as its values
        if view.shape[1]:
            fv, bv = _both(view)
            assert _bits(fv) == _bits(bv)
    finally:
        torch.set_num_threads(before)
    if not special:  # and both are the float64 statistics of the rows
        x = rows.double()
        var, mean = torch.var_mean(x, dim=0, correction=0)
        got = annotations.merge_stats(fast)
        torch.testing.assert_close(got["mean"], mean, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got["var"], var, rtol=1e-9, atol=1e-7)
        norms = torch.linalg.vector_norm(x, dim=1).mean()
        torch.testing.assert_close(got["norm_mean"], norms, rtol=1e-9, atol=1e-9)


def test_bool_rows():
    rows = torch.rand(257, 131, generator=torch.Generator().manual_seed(1)) > 0.5
    fast, base = _both(rows)
    assert _bits(fast) == _bits(base)
