"""capture / the store on inputs that used to go wrong: broadcasting first layers, misspelled
mask names, out-of-range positions, unstorable dtypes, boolean-mask reads, the global RNG."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _models import all_hooks
from torch import nn

from pyhook.capture import capture
from pyhook.store import open_capture


def _gpt2():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    return GPT2Model(cfg).eval()


@pytest.mark.parametrize("to", ["host", "disk"])
def test_examples_come_from_the_inputs_not_a_broadcasting_layer(to, tmp_path):
    # wpe's output is [1, tokens, hidden] and its hook runs first: the batch has 4 examples.
    model = _gpt2()
    out = {"out": str(tmp_path / "c")} if to == "disk" else {}
    with capture(model, ["wpe", "h.*"], to=to, flatten=False, **out) as rec:
        for _ in range(2):
            model(input_ids=torch.randint(0, 100, (4, 7)))
    assert rec.examples == 8
    if to == "disk":
        assert open_capture(out["out"]).index["examples"] == 8
        with capture(model, ["wpe", "h.*"], to=to, flatten=False, **out) as rec:
            assert rec.examples_done == 8  # a resume skips exactly what was stored


def test_misspelled_mask_name_is_refused_or_warned():
    net = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(
        ValueError,
        match=r"mask 'atention_mask' is not an argument of Sequential.forward; its arguments are: input",
    ):
        capture(net, "0", mask="atention_mask")
    assert all_hooks(net) == 0
    # GPT2Model.forward takes **kwargs: the name cannot be refused up front, so it is warned
    # about on the first call that does not pass it.
    model = _gpt2()
    ids = torch.randint(0, 100, (2, 5))
    with (
        pytest.warns(UserWarning, match="mask 'atention_mask' was not among the arguments"),
        capture(model, "h.0", mask="atention_mask") as rec,
    ):
        model(input_ids=ids, attention_mask=torch.ones(2, 5, dtype=torch.long))
    assert rec.rows["h.0"] == 10
    # the real name: no warning, padding dropped
    am = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with capture(model, "h.0", mask="attention_mask") as rec:
        model(input_ids=ids, attention_mask=am)
    assert rec.rows["h.0"] == 8


@pytest.mark.parametrize("positions", [9, -6, [0, 9]])
def test_out_of_range_positions_name_the_layer(positions):
    net = nn.Sequential(nn.Linear(4, 4))
    with (
        pytest.raises(ValueError, match=r"layer '0': positions=.* but this batch has 5 tokens"),
        capture(net, "0", positions=positions),
    ):
        net(torch.randn(2, 5, 4))
    assert all_hooks(net) == 0


def test_unstorable_dtypes_are_refused_by_name(tmp_path):
    net = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="dtype must be a dtype the store can hold"):
        capture(net, "0", out=str(tmp_path / "a"), dtype=torch.complex64)
    with (
        pytest.raises(ValueError, match=r"layer '0': rows of dtype uint16 cannot be stored"),
        capture(net, "0", out=str(tmp_path / "b"), select=lambda o: o.to(torch.uint16)),
    ):
        net(torch.randn(2, 4))
    assert all_hooks(net) == 0
    # str() of a dtype is accepted as a name
    with capture(net, "0", dtype="torch.float16") as rec:
        net(torch.randn(2, 4))
    assert rec["0"].dtype == torch.float16


def test_layer_data_indexing_by_mask_numpy_and_0d(tmp_path):
    net = nn.Sequential(nn.Linear(4, 3))
    x = torch.randn(7, 4)
    with capture(net, "0", out=str(tmp_path / "c"), shard_bytes=40):  # several shards
        for chunk in x.split(2):
            net(chunk)
    d = open_capture(str(tmp_path / "c"))["0"]
    want = net(x).detach()
    assert len(d.parts) > 1 and torch.equal(d.to_tensor(), want)
    m = torch.zeros(7, dtype=torch.bool)
    m[[1, 3, 6]] = True
    assert torch.equal(d[m], want[m])
    assert torch.equal(
        d[np.array([True, False] * 3 + [True])], want[torch.tensor([True, False] * 3 + [True])]
    )
    assert torch.equal(d[np.int64(5)], want[5]) and torch.equal(d[torch.tensor(-1)], want[-1])
    with pytest.raises(IndexError, match="boolean mask over layer '0' must have shape"):
        d[torch.ones(3, dtype=torch.bool)]
    with pytest.raises(IndexError, match="indexed by ints"):
        d[torch.tensor([0.5])]


def test_unseeded_shuffle_leaves_the_global_rng_alone(tmp_path):
    net = nn.Sequential(nn.Linear(4, 3))
    with capture(net, "0", out=str(tmp_path / "c")):
        net(torch.randn(6, 4))
    reader = open_capture(str(tmp_path / "c"))
    torch.manual_seed(0)
    a = torch.rand(3)
    torch.manual_seed(0)
    batches = list(reader.batches(2, shuffle=True, layers=["0"]))
    assert torch.equal(a, torch.rand(3))
    rows = torch.cat([b["0"] for b in batches])
    assert torch.equal(
        rows[rows[:, 0].argsort()], reader["0"].to_tensor()[reader["0"].to_tensor()[:, 0].argsort()]
    )


def test_refused_disk_batch_is_not_counted(tmp_path):
    net = nn.Sequential(nn.Linear(4, 3))
    with (
        pytest.raises(ValueError, match="rows of one layer must share their shape"),
        capture(net, "0", out=str(tmp_path / "c"), flatten=False) as rec,
    ):
        net(torch.randn(2, 5, 4))
        try:
            net(torch.randn(2, 6, 4))  # another sequence length: refused by the store
        finally:
            assert (rec.batches, rec.examples, rec.rows["0"]) == (1, 2, 2)
    assert all_hooks(net) == 0
