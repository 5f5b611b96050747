"""Issue 44 item 5: host buffers that are faulted in once and reused (``pyhook.HostBuffers``).

A capture to host memory joined every batch's rows into fresh memory at the end (a second copy
of every byte, into pages faulted in as the copy first touched them); on CUDA the batches also
landed in pinned memory taken per batch. With ``capture(..., buffers=HostBuffers())`` each
batch's rows are copied straight into one buffer per layer, ``rec[layer]`` is a view of it, and
later captures reuse that memory, but never a buffer whose rows somebody still holds.

References: hand-written forward hooks that clone each output, and the same capture without
buffers.
"""

from __future__ import annotations

import gc
import resource
import threading

import pytest
import torch
from _models import all_hooks, gpt2
from pyhook.capture import capture
from torch import nn

import pyhook
from pyhook import _backend
from pyhook.offload import HostBuffers, resident_bytes


def _batches(n: int, b: int = 3, t: int = 7, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (b, t), generator=g) for _ in range(n)]


def _by_hand(model: nn.Module, names: list[str], batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's output rows (tokens), over all batches, from plain torch hooks."""
    got: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    mods = dict(model.named_modules())

    def keep(name: str):
        def hook(_m, _a, out):
            t = out[0] if isinstance(out, tuple) else out
            got[name].append(t.detach().reshape(-1, t.shape[-1]).clone())

        return hook

    handles = [mods[n].register_forward_hook(keep(n)) for n in names]
    try:
        with torch.no_grad():
            for ids in batches:
                model(ids)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v) for n, v in got.items()}


LAYERS = ["transformer.h.0", "transformer.h.1", "transformer.h.1.mlp.c_fc"]


def _run(model, batches, bufs, **kw) -> pyhook.Recorder:
    with torch.no_grad(), capture(model, LAYERS, buffers=bufs, **kw) as rec:
        for ids in batches:
            model(ids)
    return rec


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("use_backend", ["native", "reference"])
def test_rows_equal_hand_written_hooks_and_are_views_of_one_buffer(use_backend):
    if use_backend == "native" and not _backend.native_available():
        pytest.skip("native backend not built")
    model = gpt2()
    bufs = HostBuffers(pin=False)
    with _backend.use_backend(use_backend):
        for seed in range(4):  # the first capture learns the sizes, the rest reuse them
            batches = _batches(5, seed=seed)
            expected = _by_hand(model, LAYERS, batches)
            rec = _run(model, batches, bufs)
            for name in LAYERS:
                rows = rec[name]
                assert torch.equal(rows, expected[name]), name
                # no join: every batch's rows are views of the buffer rec[name] is a view of
                parts = rec.parts(name)
                assert len(parts) == 5
                assert {_storage(p) for p in parts} == {_storage(rows)}
            del rec, rows, parts
    s = bufs.stats()
    assert s["joins"] == len(LAYERS)  # only the first capture outgrew its (empty) buffers


def test_later_captures_allocate_nothing_and_alternate_while_the_last_rows_are_held():
    model = gpt2()
    bufs = HostBuffers(pin=False)
    held = _run(model, _batches(4), bufs).results()  # learns
    after_first = bufs.stats()
    storages = []
    for seed in range(1, 9):
        batches = _batches(4, seed=seed)
        new = _run(model, batches, bufs).results()  # `held` is still referenced meanwhile
        assert torch.equal(new["transformer.h.0"], _by_hand(model, ["transformer.h.0"], batches)["transformer.h.0"])
        storages.append(_storage(new["transformer.h.1"]))
        held = new
    s = bufs.stats()
    # one more buffer per layer (the one the held results did not let go), then none
    assert s["allocations"] == after_first["allocations"] + len(LAYERS)
    assert s["joins"] == after_first["joins"]
    assert s["reuses"] >= 7 * len(LAYERS)
    assert len(set(storages)) == 2  # two buffers, in turn
    assert storages[::2] == [storages[0]] * 4 and storages[1::2] == [storages[1]] * 4
    del held


def test_rows_still_held_are_never_overwritten():
    model = gpt2()
    bufs = HostBuffers(pin=False, depth=2)
    kept, inputs = [], []
    for seed in range(6):  # every result kept: each later capture must find fresh memory
        batches = _batches(3, seed=seed)
        inputs.append(batches)
        rec = _run(model, batches, bufs)
        kept.append((rec["transformer.h.1"], rec.parts("transformer.h.0")[1]))
    for (whole, part), batches in zip(kept, inputs):
        ref = _by_hand(model, ["transformer.h.0", "transformer.h.1"], batches)
        assert torch.equal(whole, ref["transformer.h.1"])
        assert torch.equal(part, ref["transformer.h.0"][21:42])
    assert len({_storage(w) for w, _ in kept}) == 6
    # a slice or a view of held rows keeps the buffer too
    view = kept[-1][0][3:5].view(-1)
    expected = view.clone()
    del kept, whole, part, rec
    for seed in range(10, 14):
        _run(model, _batches(3, seed=seed), bufs).results()
    assert torch.equal(view, expected)


def test_a_larger_capture_is_joined_once_and_its_size_is_learned():
    model = gpt2()
    bufs = HostBuffers(pin=False)
    for n, seed in ((2, 0), (2, 1), (6, 2), (6, 3), (3, 4), (6, 5)):
        batches = _batches(n, seed=seed)
        ref = _by_hand(model, LAYERS, batches)
        before = bufs.stats()["joins"]
        rec = _run(model, batches, bufs)
        for name in LAYERS:
            assert torch.equal(rec[name], ref[name])
        joined = bufs.stats()["joins"] - before
        # the first capture (2 batches) and the first of 6 batches outgrow their buffers
        assert joined == (len(LAYERS) if seed in (0, 2) else 0), (n, seed)
        del rec


def test_masks_positions_dtype_and_shapes_that_differ_between_batches():
    model = gpt2()
    bufs = HostBuffers(pin=False)
    batches = _batches(4)
    masks = []
    for i, ids in enumerate(batches):
        m = torch.ones_like(ids)
        m[i % 3, 2 + i :] = 0
        masks.append(m)
    for _ in range(2):
        plain = {}
        for kw in ({"mask": "attention_mask"}, {"positions": "last", "mask": "attention_mask"}, {"dtype": torch.float16}):
            with torch.no_grad(), capture(model, "transformer.h.1", **kw) as ref:
                for ids, m in zip(batches, masks):
                    model(input_ids=ids, attention_mask=m)
            with torch.no_grad(), capture(model, "transformer.h.1", buffers=bufs, **kw) as rec:
                for ids, m in zip(batches, masks):
                    model(input_ids=ids, attention_mask=m)
            plain[str(kw)] = ref["transformer.h.1"]
            assert torch.equal(rec["transformer.h.1"], ref["transformer.h.1"]), kw
            assert rec["transformer.h.1"].dtype == ref["transformer.h.1"].dtype
            assert torch.equal(rec.row_index, ref.row_index)
    # rows of different shapes (flatten=False, other sequence lengths): the same error as
    # without buffers, and the batches are there
    with torch.no_grad(), capture(model, "transformer.h.0", flatten=False, buffers=bufs) as rec:
        model(_batches(1, t=5)[0])
        model(_batches(1, t=9)[0])
    with pytest.raises(ValueError, match="differ in shape between batches"):
        rec["transformer.h.0"]
    assert [tuple(p.shape) for p in rec.parts("transformer.h.0")] == [(3, 5, 32), (3, 9, 32)]


def test_no_page_faults_and_no_growth_over_many_captures():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256)).eval()
    xs = [torch.randn(16, 64, 64) for _ in range(4)]  # 4 x 1024 rows x 256 x 4 B = 4 MB a layer
    bufs = HostBuffers(pin=False)

    def run():
        with torch.no_grad(), capture(net, ["1", "2"], buffers=bufs) as rec:
            for x in xs:
                net(x)
        return rec.results()

    held = run()
    held = run()
    row_pages = 2 * 4 * 1024 * 256 * 4 // 4096
    gc.collect()
    rss = resident_bytes()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        held = run()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    grown = resident_bytes() - rss
    # 20 captures would fault in 40,960 pages of rows in fresh memory; reused, only a handful
    assert faults < 0.05 * row_pages * 20, faults
    assert grown < 8 << 20, grown  # one capture's rows is 8 MB
    assert bufs.stats()["buffers"] == 4 and bufs.stats()["bytes"] == 4 * (4 << 20)
    expected = net[2](net[1](net[0](xs[3])))
    assert torch.equal(held["2"][-1024:], expected.reshape(-1, 256))


def test_clear_forgets_the_buffers_but_not_held_rows():
    model = gpt2()
    bufs = HostBuffers(pin=False)
    batches = _batches(3)
    rows = _run(model, batches, bufs)["transformer.h.0"]
    bufs.clear()
    assert bufs.stats()["buffers"] == 0
    _run(model, _batches(3, seed=5), bufs).results()
    assert torch.equal(rows, _by_hand(model, ["transformer.h.0"], batches)["transformer.h.0"])


def test_a_forward_that_raises_keeps_the_other_batches():
    model = gpt2()
    bufs = HostBuffers(pin=False)
    batches = _batches(3)
    with torch.no_grad(), capture(model, "transformer.h.0", buffers=bufs) as rec:
        model(batches[0])
        with pytest.raises(IndexError):
            model(torch.full((3, 7), 10_000))  # beyond the vocabulary: raises in the embedding
        model(batches[2])
    ref = _by_hand(model, ["transformer.h.0"], [batches[0], batches[2]])
    assert torch.equal(rec["transformer.h.0"], ref["transformer.h.0"])
    assert rec.skipped == 3


def test_two_threads_share_one_set():
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(8, 16), nn.ReLU()).eval() for _ in range(2)]
    bufs = HostBuffers(pin=False)
    xs = [torch.randn(4, 5, 8) for _ in range(3)]
    errors, out = [], {}

    def work(i: int) -> None:
        try:
            for r in range(20):
                with torch.no_grad(), capture(nets[i], ["0"], buffers=bufs) as rec:
                    for x in xs:
                        nets[i](x)
                got = rec["0"]
                want = torch.cat([nets[i][0](x).reshape(-1, 16) for x in xs])
                if not torch.equal(got, want):
                    errors.append((i, r))
                out[i] = got
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert _storage(out[0]) != _storage(out[1])


def test_compiled_model_rows_go_into_the_buffers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    compiled = torch.compile(net, backend="eager")
    bufs = HostBuffers(pin=False)
    xs = [torch.randn(3, 5, 8) for _ in range(3)]
    for _ in range(4):
        with torch.no_grad(), capture(compiled, ["0", "2"], buffers=bufs) as rec:
            for x in xs:
                compiled(x)
        for name, upto in (("0", 1), ("2", 3)):
            want = torch.cat([net[:upto](x).reshape(-1, net[upto - 1].out_features) for x in xs])
            assert torch.equal(rec[name], want)
            assert {_storage(p) for p in rec.parts(name)} == {_storage(rec[name])}
    assert bufs.stats()["reuses"] >= 2  # the rows of the later captures reuse buffers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"to": "disk"}, "buffers= holds rows in host memory: it is for to='host', not to='disk'"),
        ({"to": "device"}, "not to='device'"),
        ({"copy": False}, "copy=False keeps references"),
    ],
)
def test_bad_arguments_name_buffers_and_leave_no_hook(tmp_path, kwargs, match):
    model = gpt2()
    if kwargs.get("to") == "disk":
        kwargs = {**kwargs, "out": str(tmp_path / "c")}
    with pytest.raises(ValueError, match=match):
        capture(model, "transformer.h.0", buffers=HostBuffers(pin=False), **kwargs)
    with pytest.raises(TypeError, match=r"buffers must be a pyhook\.HostBuffers, got dict"):
        capture(model, "transformer.h.0", buffers={})
    assert all_hooks(model) == 0
    assert not (tmp_path / "c").exists()


def test_bad_host_buffers_arguments():
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        HostBuffers(depth=0)
    with pytest.raises(TypeError, match="pin must be True, False or None"):
        HostBuffers(pin="yes")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            HostBuffers(pin=True)
        assert HostBuffers().pin is False


@pytest.mark.cuda
def test_cuda_rows_land_in_pinned_buffers_exactly():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda().eval()

    class InPlace(nn.Module):  # the captured output is updated in place right after the hook
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            h = self.inner[0](x)
            h2 = self.inner[1](h)
            h.mul_(-3)  # must not reach the rows of layer inner.0
            return self.inner[2](h2) + h.sum()

    model = InPlace(net)
    bufs = HostBuffers()
    assert bufs.pin
    xs = [torch.randn(8, 128, 64, device="cuda") for _ in range(4)]
    held = None
    for _ in range(4):
        with torch.no_grad(), capture(model, ["inner.0", "inner.2"], buffers=bufs) as rec:
            for x in xs:
                model(x)
        got = rec.results()
        for name, fn in (("inner.0", net[0]), ("inner.2", lambda x: net[2](net[1](net[0](x))))):
            want = torch.cat([fn(x).reshape(-1, fn(x).shape[-1]) for x in xs]).cpu()
            assert torch.equal(got[name], want), name
            assert got[name].is_pinned()
        held = got
    assert bufs.stats()["joins"] == 2 and bufs.stats()["allocations"] <= 2 * 5
    del held
