"""pyhook.capture: layer selection, on-device reduction, destinations, resume, gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
from _models import DictBlock, NamedTupleBlock, all_hooks, gpt2
from torch import nn

from pyhook.capture import CaptureModifiedError, Recorder, capture, resolve_layers
from pyhook.modules import LayerNotFoundError
from pyhook.store import CaptureExistsError, open_capture


def reference_outputs(model, names, run):
    """Hand-written register_forward_hook reference: first tensor of each output, per call."""
    got = {n: [] for n in names}
    handles = []
    for n in names:
        mod = model.get_submodule(n)

        def hook(_m, _a, out, n=n):
            t = out if isinstance(out, torch.Tensor) else out[0]
            got[n].append(t.detach().clone())

        handles.append(mod.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return got


def gpt_batches(n=3, b=3, t=6, seed=0, left_pad=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 100, (b, t), generator=g)
        am = torch.ones(b, t, dtype=torch.long)
        lens = torch.randint(1, t + 1, (b,), generator=g)
        for i, ln in enumerate(lens.tolist()):
            if left_pad:
                am[i, : t - ln] = 0
            else:
                am[i, ln:] = 0
        out.append((ids, am))
    return out


def test_sequential_host_and_device_match_hooks():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    xs = [torch.randn(2, 5, 4) for _ in range(3)]
    ref = reference_outputs(net, ["0", "1", "2"], lambda: [net(x) for x in xs])
    for to in ("host", "device"):
        with capture(net, ["0", "1", "2"], to=to) as rec:
            for x in xs:
                net(x)
        for n in ["0", "1", "2"]:
            want = torch.cat([r.reshape(-1, r.shape[-1]) for r in ref[n]])
            assert torch.equal(rec[n], want)
        assert rec.examples == 6 and rec.rows["0"] == 30 and rec.batches == 3
    assert all_hooks(net) == 0


def test_captured_rows_are_copies_not_views_of_live_memory():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Identity()

        def forward(self, x):
            h = self.a(x)
            h.mul_(0)  # the model overwrites the captured output afterwards
            return h

    net = InPlace()
    x = torch.ones(2, 3)
    with capture(net, "a") as rec:
        net(x.clone())
    assert torch.equal(rec["a"], torch.ones(2, 3))


@pytest.mark.parametrize("use_backend", ["native", "reference"])
def test_large_copies_come_from_the_pool_and_are_exact(use_backend):
    """Rows of KEPT_MIN_BYTES and more are copied into recycled native pool buffers; smaller
    ones by torch's clone. Either way they equal a hand-written hook's clones, own their memory
    and survive the model overwriting its outputs in place."""
    from pyhook import _backend

    if use_backend == "native" and not _backend.native_available():
        pytest.skip("native backend not built")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.big = nn.Linear(64, 256)  # 8 x 16 x 256 floats = 128 KiB per call
            self.small = nn.Linear(256, 4)  # 2 KiB per call

        def forward(self, x):
            h = self.big(x)
            out = self.small(h)
            h.zero_()  # the model reuses the captured output's memory afterwards
            return out

    torch.manual_seed(0)
    net = Net()
    xs = [torch.randn(8, 16, 64) for _ in range(3)]
    ref = reference_outputs(net, ["big", "small"], lambda: [net(x) for x in xs])
    with _backend.use_backend(use_backend):
        before = _backend.pool_stats()
        with capture(net, ["big", "small"], flatten=False) as rec:
            for x in xs:
                net(x)
        after = _backend.pool_stats()
        parts = rec.parts("big")
        assert len({p.untyped_storage().data_ptr() for p in parts}) == 3  # one buffer a batch
        del parts
        big = rec["big"]
        assert torch.equal(big, torch.cat(ref["big"]))
        assert torch.equal(rec["small"], torch.cat(ref["small"]))
        joined = _backend.pool_stats()
        parts = rec.parts("big")
    served = (after["hits"] + after["misses"]) - (before["hits"] + before["misses"])
    if use_backend == "native":
        # between the two thresholds: only the Recorder's lower one sends it to the pool
        assert (
            _backend.NATIVE_MIN_BYTES > 256 * 8 * 16 * 4 >= _backend.KEPT_MIN_BYTES > 4 * 8 * 16 * 4
        )
        assert served == 3  # one pooled buffer per batch of "big", none for "small"
        assert after["live_buffers"] - before["live_buffers"] == 3
        # rec["big"] joined the batches: they are views of it now, their buffers went back
        assert joined["live_buffers"] == before["live_buffers"]
    else:
        assert served == 0
    assert {p.untyped_storage().data_ptr() for p in parts} == {big.untyped_storage().data_ptr()}
    assert rec["big"] is big  # joined once: later reads return the same rows, no new copy
    del rec, parts, big
    if use_backend == "native":  # dropping the rows gives the buffers back
        assert _backend.pool_stats()["live_buffers"] == before["live_buffers"]


def test_sparse_output_is_refused_with_the_layer_named_and_no_hook_left():
    class Sparse(nn.Module):
        def forward(self, x):
            return x.to_sparse()

    net = nn.Sequential(nn.Linear(3, 3), Sparse())
    with pytest.raises(TypeError, match=r"layer '1'.*sparse_coo.*to_dense"):
        with capture(net, "*") as rec:
            net(torch.eye(3))
    assert all_hooks(net) == 0 and rec.batches == 0
    # the suggested select works
    with capture(net, "1", select=lambda out: out.to_dense()) as rec:
        net(torch.eye(3))
    assert torch.equal(rec["1"], net(torch.eye(3)).to_dense().detach())


@pytest.mark.parametrize("to", ["host", "device", "disk"])
def test_scalar_outputs_give_one_row_per_forward(to, tmp_path):
    class Loss(nn.Module):
        def forward(self, x):
            return (x**2).mean()

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), Loss())
    xs = [torch.randn(2, 3) for _ in range(3)]
    ref = reference_outputs(net, ["1"], lambda: [net(x) for x in xs])
    out = {"out": str(tmp_path / "c")} if to == "disk" else {}
    with capture(net, "1", to=to, **out) as rec:
        for x in xs:
            net(x)
    got = open_capture(out["out"])["1"].to_tensor() if to == "disk" else rec["1"]
    assert got.shape == (3,) and torch.equal(got, torch.stack(ref["1"]))
    assert rec.rows["1"] == 3 and rec.examples == 6  # examples: the inputs' batch size


def test_namedtuple_dict_outputs_and_select():
    torch.manual_seed(0)
    net = nn.Sequential(NamedTupleBlock(4))
    dnet = nn.ModuleDict({"blk": DictBlock(4)})
    x = torch.randn(3, 4)
    with capture(net, "0") as rec:
        out = net(x)
    assert torch.equal(rec["0"], out.hidden)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.blk = DictBlock(4)

        def forward(self, x):
            return self.blk(x)["hidden"]

    w = Wrap()
    with capture(w, "blk", select=lambda o: o["pair"][0]) as rec:
        y = w(x)
    assert torch.equal(rec["blk"], y * 2)
    del dnet


def test_glob_selects_blocks_and_bad_glob_lists_names():
    model = gpt2(n_layer=3)
    names = [n for n, _ in resolve_layers(model, "transformer.h.*")]
    assert names == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    deep = [n for n, _ in resolve_layers(model, "transformer.h.*.mlp")]
    assert deep == [f"transformer.h.{i}.mlp" for i in range(3)]
    assert "transformer.h.0.mlp.c_fc" in [
        n for n, _ in resolve_layers(model, "transformer.**.c_fc")
    ]
    # exact + glob, deduplicated, model order
    mixed = [n for n, _ in resolve_layers(model, ["transformer.h.1", "transformer.h.*", "lm_head"])]
    assert mixed == ["transformer.h.0", "transformer.h.1", "transformer.h.2", "lm_head"]
    with pytest.raises(
        LayerNotFoundError, match="'transformer.blocks.\\*' matches no module.*transformer.h.0.attn"
    ):
        capture(model, ["transformer.h.0", "transformer.blocks.*"])
    with pytest.raises(LookupError):
        capture(model, "transformer.nope")
    assert all_hooks(model) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"to": "cloud"}, "to must be"),
        ({"to": "disk"}, "needs out="),
        ({"positions": "first"}, "positions must be"),
        ({"mask": 3}, "mask must be"),
        ({"mask": "attention_mask", "flatten": False}, "needs flatten=True"),
        ({"dtype": "float7"}, "dtype must be"),
        ({"select": 1}, "select must be callable"),
    ],
)
def test_bad_options_raise_before_registering(kwargs, match):
    model = gpt2()
    with pytest.raises((ValueError, TypeError), match=match):
        with capture(model, "transformer.h.*", **kwargs):
            pass
    assert all_hooks(model) == 0


def test_mask_selects_valid_tokens_exactly():
    model = gpt2()
    batches = gpt_batches()
    layers = ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    ref = reference_outputs(
        model, layers, lambda: [model(input_ids=i, attention_mask=a) for i, a in batches]
    )
    with torch.no_grad(), capture(model, "transformer.**", mask="attention_mask") as rec:
        pass  # glob resolution only; nothing ran
    assert rec.rows["transformer.h.0"] == 0
    with capture(model, layers, mask="attention_mask") as rec:
        for ids, am in batches:
            model(input_ids=ids, attention_mask=am)
    for n in layers:
        want = torch.cat([r[a.bool()] for r, (_, a) in zip(ref[n], batches)])
        assert torch.equal(rec[n], want)
    assert rec.examples == 9
    # mask given positionally is found too
    with capture(model, "transformer.h.1", mask="attention_mask") as rec2:
        for ids, am in batches:
            model(ids, None, am)
    assert torch.equal(rec2["transformer.h.1"], rec["transformer.h.1"])
    assert all_hooks(model) == 0


@pytest.mark.parametrize("left_pad", [False, True])
def test_last_valid_token_and_positions(left_pad):
    model = gpt2()
    batches = gpt_batches(left_pad=left_pad)
    ref = reference_outputs(
        model,
        ["transformer.h.1"],
        lambda: [model(input_ids=i, attention_mask=a) for i, a in batches],
    )
    with capture(
        model, "transformer.h.1", mask="attention_mask", positions="last", dtype=torch.bfloat16
    ) as rec:
        for ids, am in batches:
            model(input_ids=ids, attention_mask=am)
    want = []
    for r, (_, am) in zip(ref["transformer.h.1"], batches):
        for i in range(am.shape[0]):
            last = am[i].nonzero().max()
            want.append(r[i, last])
    got = rec["transformer.h.1"]
    assert got.dtype == torch.bfloat16 and got.shape == (9, 32)
    assert torch.equal(got, torch.stack(want).to(torch.bfloat16))

    ids = batches[0][0]
    out = reference_outputs(model, ["transformer.h.0"], lambda: model(ids))["transformer.h.0"][0]
    for positions, want in [
        (2, out[:, 2]),
        (slice(1, 4), out[:, 1:4].reshape(-1, 32)),
        ([0, 5], out[:, [0, 5]].reshape(-1, 32)),
    ]:
        with capture(model, "transformer.h.0", positions=positions) as rec:
            model(ids)
        assert torch.equal(rec["transformer.h.0"], want), positions
    with capture(model, "transformer.h.0", positions=slice(1, 4), flatten=False) as rec:
        model(ids)
    assert torch.equal(rec["transformer.h.0"], out[:, 1:4])


def test_forward_that_raises_commits_nothing_and_exception_removes_hooks():
    model = gpt2()
    ids = torch.randint(0, 100, (2, 5))
    with capture(model, "transformer.h.*") as rec:
        model(ids)
        with pytest.raises(IndexError):
            model(torch.full((2, 5), 1000))  # out-of-range token ids fail inside the model
        model(ids)
    assert rec.batches == 2 and rec["transformer.h.0"].shape == (20, 32)
    with pytest.raises(RuntimeError, match="boom"), capture(model, "transformer.h.*"):
        model(ids)
        raise RuntimeError("boom")
    assert all_hooks(model) == 0


def test_settings_may_add_to_what_a_resume_compares_not_contradict_it(tmp_path):
    """capture(quantize='fp8', settings={'quantize': None}) stored quantize: None in the index,
    so a later plain capture resumed the fp8 store (mixed encodings in one store); a caller's
    settings that contradict the capture's own are refused by name, equal ones and new keys
    pass."""
    net = nn.Sequential(nn.Linear(4, 8))
    for key, value, kw in (
        ("quantize", None, {"quantize": "fp8"}),
        ("compress", "zstd", {}),
        ("layers", ["1"], {}),
        ("dtype", "float16", {}),
    ):
        with pytest.raises(ValueError, match=rf"settings\['{key}'\] = .* contradicts"):
            capture(net, "0", out=tmp_path / key, settings={key: value}, **kw)
        assert all_hooks(net) == 0 and not (tmp_path / key).exists()
    with capture(
        net, "0", out=tmp_path / "ok", quantize="fp8", settings={"quantize": "fp8", "run": 3}
    ):
        net(torch.randn(2, 4))
    assert open_capture(tmp_path / "ok").index["settings"]["run"] == 3


def test_disk_destination_equals_host_and_resumes(tmp_path):
    model = gpt2()
    batches = gpt_batches(n=5)
    opts = dict(mask="attention_mask")
    with capture(model, "transformer.h.*", **opts) as host:
        for ids, am in batches:
            model(input_ids=ids, attention_mask=am)
    out = tmp_path / "acts"
    with capture(
        model, "transformer.h.*", out=out, shard_bytes=1, meta={"model_path": "tiny"}, **opts
    ) as rec:
        assert rec.examples_done == 0
        for ids, am in batches[:2]:
            model(input_ids=ids, attention_mask=am)
    # a second run with the same settings resumes after the stored examples
    with capture(
        model, "transformer.h.*", out=out, shard_bytes=1, meta={"model_path": "tiny"}, **opts
    ) as rec:
        assert rec.examples_done == 6
        for ids, am in batches[rec.examples_done // 3 :]:
            model(input_ids=ids, attention_mask=am)
    r = open_capture(out)
    assert r.examples == 15 and r.index["meta"]["model_path"] == "tiny"
    assert (
        r.index["settings"]["mask"] == "attention_mask"
        and r.index["settings"]["layers"] == rec.layers
    )
    for n in rec.layers:
        assert torch.equal(r[n].to_tensor(), host[n])
    # different settings: refused, clearly; nothing stays registered
    with pytest.raises(CaptureExistsError, match="positions"):
        with capture(model, "transformer.h.*", out=out, positions="last", **opts):
            pass
    assert all_hooks(model) == 0
    with pytest.raises(RuntimeError, match="open_capture"):
        rec["transformer.h.0"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_capture_cuda_host_and_disk(tmp_path):
    model = gpt2().cuda()
    batches = [(i.cuda(), a.cuda()) for i, a in gpt_batches()]
    ref = reference_outputs(
        model,
        ["transformer.h.1"],
        lambda: [model(input_ids=i, attention_mask=a) for i, a in batches],
    )
    want = torch.cat([r[a.bool()] for r, (_, a) in zip(ref["transformer.h.1"], batches)]).cpu()
    with capture(model, "transformer.h.1", mask="attention_mask") as rec:
        for i, a in batches:
            model(input_ids=i, attention_mask=a)
    assert torch.equal(rec["transformer.h.1"], want)
    with capture(model, "transformer.h.1", mask="attention_mask", out=tmp_path, shard_bytes=1):
        for i, a in batches:
            model(input_ids=i, attention_mask=a)
    assert torch.equal(open_capture(tmp_path)["transformer.h.1"].to_tensor(), want)


# -- two gloo ranks ------------------------------------------------------------------------------
def _rank_worker(rank: int, world: int, init_file: str, out: str, overwrite: bool = False) -> None:
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model = gpt2()
        batches = gpt_batches(n=4)
        share = batches[rank * 2 : (rank + 1) * 2]  # contiguous shares keep the data order
        if overwrite and rank == 0:
            time.sleep(2)  # rank 1 has written its new shard by now: rank 0 must not delete it
        with capture(
            model, "transformer.h.*", out=out, mask="attention_mask", overwrite=overwrite
        ) as rec:
            assert (rec.rank, rec.world_size) == (rank, world)
            for ids, am in share:
                model(input_ids=ids, attention_mask=am)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_write_one_capture(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "acts")
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    model = gpt2()
    with capture(model, "transformer.h.*", mask="attention_mask") as ref:
        for ids, am in gpt_batches(n=4):
            model(input_ids=ids, attention_mask=am)
    assert sorted(
        f for f in os.listdir(out) if not f.startswith(".")
    ) == [  # .lock-rNNN: writer locks
        "index-r000.json",
        "index-r001.json",
        "index.json",
        "shard-r000-000000.safetensors",
        "shard-r001-000000.safetensors",
    ]
    r = open_capture(out)
    assert r.index["world_size"] == 2 and r.index["ranks"] == [0, 1] and r.examples == 12
    for n in ref.layers:
        assert torch.equal(r[n].to_tensor(), ref[n])

    # overwrite=True with several ranks: each rank replaces only its own files
    (tmp_path / "init").unlink(missing_ok=True)
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init2"), out, True), nprocs=2, join=True)
    r = open_capture(out)
    assert r.index["ranks"] == [0, 1] and r.examples == 12
    for n in ref.layers:
        assert torch.equal(r[n].to_tensor(), ref[n])


def test_recorder_repr_and_reuse():
    net = nn.Sequential(nn.Linear(2, 2))
    rec = Recorder(net, "0")
    assert "idle" in repr(rec)
    with rec:
        assert "recording" in repr(rec)
        net(torch.ones(1, 2))
        with pytest.raises(RuntimeError, match="already active"):
            rec.__enter__()
    with rec:  # re-entering continues to accumulate
        net(torch.ones(1, 2))
    assert rec["0"].shape == (2, 2) and all_hooks(net) == 0


# -- copy=False: zero-copy references guarded by version counters --------------------------------
def test_copy_false_keeps_references_and_matches_copies():
    model = gpt2()
    batches = gpt_batches()
    with torch.no_grad():
        with capture(model, "transformer.h.*", flatten=False) as copied:
            for i, a in batches:
                model(input_ids=i, attention_mask=a)
        with capture(model, "transformer.h.*", flatten=False, copy=False) as kept:
            for i, a in batches:
                model(input_ids=i, attention_mask=a)
    for n in copied.layers:
        assert torch.equal(kept[n], copied[n])
    # references, not copies: a row of the kept result is the model's own output tensor
    seen = {}

    def keep(_m, _a, o):
        seen["o"] = o[0] if isinstance(o, tuple) else o

    h = model.transformer.h[0].register_forward_hook(keep)
    try:
        with torch.no_grad(), capture(model, "transformer.h.0", flatten=False, copy=False) as rec:
            model(input_ids=batches[0][0])
    finally:
        h.remove()
    assert rec.parts("transformer.h.0")[0].data_ptr() == seen["o"].data_ptr()


def test_copy_false_detects_inplace_updates_during_and_after_the_forward():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    x = torch.randn(5, 4)
    with capture(net, ["0", "2"], copy=False) as rec:
        # ReLU(inplace=True) overwrites layer 0's output: the forward itself fails, loudly
        with pytest.raises(
            CaptureModifiedError, match="layer '0'.*before the forward returned.*copy=True"
        ) as info:
            net(x)
        assert info.value.layer == "0"
        assert rec.batches == 0  # nothing of that batch was committed
    with capture(net, "2", copy=False) as rec:
        net(x)
    assert torch.equal(rec["2"], net(x))  # untouched layers are fine
    # the default copies: exact whatever the model does afterwards
    with capture(net, "0") as exact:
        out = net[0](x)
        net(x)
    assert torch.equal(exact["0"], torch.nn.functional.linear(x, net[0].weight, net[0].bias))
    # modified after the forward, before the read
    with capture(net, "2", copy=False) as rec2:
        y = net(x)
    y.mul_(2)
    with pytest.raises(CaptureModifiedError, match="after the forward"):
        rec2.results()
    del out


def test_copy_false_inference_tensors_are_copied():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    x = torch.randn(3, 4)
    with torch.inference_mode(), capture(net, "0", copy=False) as rec:
        net(x)
    # no version counter under inference_mode: copied before ReLU overwrote it
    assert torch.equal(rec["0"], torch.nn.functional.linear(x, net[0].weight, net[0].bias))


def test_copy_false_refuses_disk(tmp_path):
    net = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="copy=False.*disk"):
        capture(net, "0", out=tmp_path, copy=False)
    with pytest.raises(TypeError, match="copy must be a bool"):
        capture(net, "0", copy="no")
    assert not list(tmp_path.iterdir())


# -- bad input found by the adversarial pass (issue 16, item 4) ----------------------------------
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"positions": []}, ValueError, "positions is an empty list"),
        ({"out": 5}, TypeError, "out must be a directory path"),
        ({"out": "OUT", "world_size": 0}, ValueError, "world_size must be an int >= 1"),
        (
            {"out": "OUT", "rank": 2, "world_size": 2},
            ValueError,
            r"rank must be .*\[0, world_size=2\)",
        ),
        ({"out": "OUT", "overwrite": "no"}, TypeError, "overwrite must be a bool"),
        ({"out": "OUT", "meta": {"when": object()}}, TypeError, "meta must be a dict of JSON"),
        ({"out": "OUT", "settings": [1]}, TypeError, "settings must be a dict"),
        ({"out": "OUT", "shard_bytes": 0}, ValueError, "shard_bytes"),
        ({"out": "OUT", "max_pending_shards": 0}, ValueError, "max_pending_shards"),
        ({"stats": "yes"}, TypeError, "stats must be"),
    ],
)
def test_bad_arguments_are_refused_before_any_hook_or_file(tmp_path, kwargs, exc, match):
    model = gpt2()
    if kwargs.get("out") == "OUT":
        kwargs = {**kwargs, "out": tmp_path / "acts"}
    with pytest.raises(exc, match=match):
        capture(model, "transformer.h.*", **kwargs)  # refused when made, not at __enter__
    assert all_hooks(model) == 0
    assert not (tmp_path / "acts").exists()  # nothing written


def test_overwrite_no_keeps_the_previous_capture(tmp_path):
    net = nn.Sequential(nn.Linear(2, 2))
    with capture(net, "0", out=tmp_path):
        net(torch.randn(3, 2))
    with pytest.raises(TypeError, match="overwrite must be a bool"):
        capture(net, "0", out=tmp_path, positions=0, overwrite="no")
    assert open_capture(tmp_path).rows("0") == 3


class _Returns(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.make = make

    def forward(self, x):
        return self.make(self.lin(x))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda h: None, r"layer 'inner' returned None"),
        (lambda h: torch.empty(h.shape, device="meta"), r"layer 'inner'.*meta device"),
        (
            lambda h: torch.nested.nested_tensor([h[0], h[1, :2]]),
            r"layer 'inner'.*nested \(ragged\) tensor",
        ),
        (lambda h: {"no": "tensor"}, r"layer 'inner'.*holds no tensor"),
    ],
    ids=["none", "meta", "nested", "no-tensor"],
)
@pytest.mark.parametrize("to", ["host", "disk"])
def test_layer_outputs_without_values_are_named(tmp_path, make, match, to):
    net = nn.Sequential()
    net.add_module("inner", _Returns(make))
    opts = {"out": tmp_path} if to == "disk" else {}
    with pytest.raises(TypeError, match=match), capture(net, "inner", **opts):
        net(torch.randn(2, 3, 4))
    assert all_hooks(net) == 0


# -- host memory (issue 19, item 5) ------------------------------------------------------------
def test_host_results_hold_the_rows_once():
    net = nn.Sequential(nn.Linear(64, 256))
    with capture(net, "0") as rec:
        for _ in range(4):
            net(torch.randn(8, 16, 64))
        first = rec["0"]
        net(torch.randn(8, 16, 64))  # a batch after a read: joined again, with the new rows
    rows = rec["0"]
    assert rows.shape == (5 * 8 * 16, 256) and torch.equal(rows[: first.shape[0]], first)
    storages = {p.untyped_storage().data_ptr() for p in rec.parts("0")}
    assert storages == {rows.untyped_storage().data_ptr()}  # every batch is a view of the rows
    assert rec.results()["0"] is rows


def test_disk_capture_sizes_its_buffers_from_max_host_bytes(tmp_path):
    from pyhook import _backend

    # The writer thread holds up to 3/4 of the budget in rows (the pool keeps 1/4 idle).
    idle = 16 << 20
    net = nn.Sequential(nn.Linear(4, 4))
    rec = capture(net, "0", out=tmp_path, max_host_bytes=64 << 20)
    assert rec._writer_opts["shard_bytes"] == 16 << 20
    assert rec._writer_opts["max_pending"] == 1
    limit = _backend.pool_stats()["limit_bytes"]
    with rec:
        if _backend.native_available() and limit > idle:
            assert _backend.pool_stats()["limit_bytes"] == idle  # the pool is sized down
        net(torch.randn(3, 4))
    assert _backend.pool_stats()["limit_bytes"] == limit  # and restored on close
    assert _backend.pool_stats()["cached_bytes"] == 0  # idle buffers given back
    explicit = capture(net, "0", out=tmp_path, shard_bytes=1 << 20, max_pending_shards=3)
    assert explicit._writer_opts["shard_bytes"] == 1 << 20
    assert explicit._writer_opts["max_pending"] == 3
    with pytest.raises(ValueError, match="max_host_bytes"):
        capture(net, "0", out=tmp_path, max_host_bytes=0)


def test_a_small_host_budget_still_completes_in_order(tmp_path):
    # Batches smaller and larger than the whole budget, in mixed order: the back-pressure
    # flushes and waits, never deadlocks, and the rows arrive complete and in order.
    net = nn.Sequential(nn.Linear(8, 64))
    xs = [torch.randn(n, 8) for n in (1, 30, 2, 3, 100, 1, 1, 40)]  # 256 B a row
    with capture(net, "0", out=tmp_path, max_host_bytes=8192, stats=False) as rec:
        for x in xs:
            net(x)
        assert rec._held <= 100 * 256  # never more than the budget or one batch held
    with torch.no_grad():
        want = torch.cat([net(x) for x in xs])
    assert torch.equal(open_capture(tmp_path)["0"].to_tensor(), want)
