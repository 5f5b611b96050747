"""Gradient layers of a capture (capture(gradients=..., metric=...)): each stored row equals the
gradient of its example's own metric at that point, computed by hand with plain hooks and
torch.autograd.grad, for padded batches; the store verifies and reads back; bad input is
refused by name with no hook left."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
import transformers as T
from _hygiene import diff, hook_snapshot
from _models import randomise_norms
from pyhook.capture import capture

import pyhook
from pyhook.pipeline.dataset import CaptureDataset
from pyhook.store import open_capture, verify_capture

H = 16
V = 64


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "gpt2":
        model = T.GPT2LMHeadModel(
            T.GPT2Config(n_embd=H, n_layer=2, n_head=2, vocab_size=V, bos_token_id=0,
                         eos_token_id=0)
        )  # fmt: skip
    elif arch == "llama":
        cfg = T.LlamaConfig(
            hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=V, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model = T.LlamaForCausalLM(cfg)
    else:
        cfg = T.BertConfig(
            hidden_size=H, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            vocab_size=V,
        )  # fmt: skip
        model = T.BertModel(cfg)
    return randomise_norms(model).eval()


def batch():
    ids = torch.randint(2, V - 2, (3, 6), generator=torch.Generator().manual_seed(0))
    am = torch.ones(3, 6, dtype=torch.long)
    am[1, 4:] = 0  # right padding
    am[2, 2:] = 0
    return ids, am


# the module whose output each point is (for the hand-written reference)
MODULES = {
    "gpt2": {"resid_post.0": "transformer.h.0", "transformer.h.1.mlp": "transformer.h.1.mlp"},
    "llama": {"resid_post.0": "model.layers.0", "model.layers.1.mlp": "model.layers.1.mlp"},
    "bert": {"resid_post.0": "encoder.layer.0", "encoder.layer.1.output.dense":
             "encoder.layer.1.output.dense"},
}  # fmt: skip

W = torch.randn(H, generator=torch.Generator().manual_seed(3))


def bert_metric(output, batch):
    """A per-example score of a model without a head: the CLS vector against a fixed direction."""
    return output.last_hidden_state[:, 0] @ W


def hand_loss(logits_i: torch.Tensor, ids_i: torch.Tensor, am_i: torch.Tensor) -> torch.Tensor:
    """One example's mean next-token loss over the predictions whose token and target are real."""
    terms = [
        torch.nn.functional.cross_entropy(logits_i[t].float()[None], ids_i[t + 1][None])
        for t in range(len(ids_i) - 1)
        if am_i[t] and am_i[t + 1]
    ]
    return torch.stack(terms).mean()


def reference(model, arch, ids, am):
    """{point: [rows of gradients]}: per example i, torch.autograd.grad of example i's metric
    at the module output (plain forward hooks), rows = the example's real tokens."""
    held = {}
    handles = []
    for point, mod in MODULES[arch].items():

        def keep(_m, _a, out, point=point):
            held[point] = out[0] if isinstance(out, tuple) else out

        handles.append(model.get_submodule(mod).register_forward_hook(keep))
    try:
        out = model(input_ids=ids, attention_mask=am)
    finally:
        for h in handles:
            h.remove()
    rows = {p: [] for p in held}
    for i in range(ids.shape[0]):
        if arch == "bert":
            m_i = bert_metric(out, None)[i]
        else:
            m_i = hand_loss(out.logits[i], ids[i], am[i])
        grads = torch.autograd.grad(m_i, list(held.values()), retain_graph=True)
        for p, g in zip(held, grads):
            rows[p].append(g[i][am[i].bool()])
    return {p: torch.cat(r) for p, r in rows.items()}


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_gradient_rows_equal_each_examples_own_autograd_grad(arch):
    model = build(arch)
    ids, am = batch()
    points = list(MODULES[arch])
    metric = bert_metric if arch == "bert" else "loss"
    with capture(model, points, mask="attention_mask", gradients=True, metric=metric) as rec:
        model(input_ids=ids, attention_mask=am)
    want = reference(model, arch, ids, am)
    assert rec.layers == points + [p + "_grad" for p in points]
    for p in points:
        got = rec[p + "_grad"]
        assert got.shape == want[p].shape == rec[p].shape
        assert want[p].abs().max() > 0
        torch.testing.assert_close(got, want[p], rtol=1e-4, atol=1e-6)
    # the parameters' .grad are left alone
    assert all(p.grad is None for p in model.parameters())


def test_gradients_of_some_layers_with_positions_last_and_a_logit_metric():
    model = build("gpt2")
    ids, am = batch()
    with capture(
        model,
        ["resid_post.0", "resid_post.1"],
        mask="attention_mask",
        positions="last",
        gradients=["resid_post.0"],
        metric="logit:7",
    ) as rec:
        model(input_ids=ids, attention_mask=am)
    assert rec.layers == ["resid_post.0", "resid_post.1", "resid_post.0_grad"]
    held = {}
    h = model.transformer.h[0].register_forward_hook(
        lambda m, a, o: held.update(x=o[0] if isinstance(o, tuple) else o)
    )
    try:
        out = model(input_ids=ids, attention_mask=am)
    finally:
        h.remove()
    last = am.sum(1) - 1
    want = []
    for i in range(3):
        (g,) = torch.autograd.grad(out.logits[i, last[i], 7], held["x"], retain_graph=True)
        want.append(g[i, last[i]])
    torch.testing.assert_close(rec["resid_post.0_grad"], torch.stack(want), rtol=1e-4, atol=1e-6)


def test_a_disk_store_of_gradients_verifies_and_reads_back(tmp_path, capsys):
    model = build("gpt2")
    ids, am = batch()
    out = tmp_path / "store"
    with capture(model, "resid_post.*", mask="attention_mask", gradients=["resid_post.1"],
                 metric="loss", dtype="float32") as host:  # fmt: skip
        model(input_ids=ids, attention_mask=am)
        model(input_ids=ids[:2], attention_mask=am[:2])
    with capture(model, "resid_post.*", out=out, mask="attention_mask",
                 gradients=["resid_post.1"], metric="loss", dtype="float32") as rec:  # fmt: skip
        model(input_ids=ids, attention_mask=am)
        model(input_ids=ids[:2], attention_mask=am[:2])
    problems, _ = verify_capture(out)
    assert problems == []
    from pyhook.cli import main

    assert main(["verify", str(out)]) == 0
    assert main(["inspect", str(out)]) == 0
    assert "resid_post.1_grad" in capsys.readouterr().out
    r = open_capture(out)
    assert "resid_post.1_grad" in r.layers
    assert r.settings["gradients"] == ["resid_post.1"] and r.settings["metric"] == "loss"
    torch.testing.assert_close(r["resid_post.1_grad"][:], host["resid_post.1_grad"])
    assert len(r["resid_post.1_grad"]) == len(r["resid_post.1"]) == int(am.sum() + am[:2].sum())
    # the row index is shared: row k of the gradient is row k of the activation
    assert r.row_index is not None and len(r.row_index) == len(r["resid_post.1_grad"])
    ds = CaptureDataset(r, ["resid_post.1", "resid_post.1_grad"], batch_size=100, shuffle=False)
    (b,) = list(ds)
    torch.testing.assert_close(b["resid_post.1_grad"], host["resid_post.1_grad"])
    torch.testing.assert_close(b["resid_post.1"], host["resid_post.1"])
    assert rec.rows["resid_post.1_grad"] == len(b["resid_post.1_grad"])


def _refused(model, match, *, forward=None, **kw):
    before = hook_snapshot(model)
    ids, am = batch()
    points = ["resid_post.0", "resid_post.1"]
    with (
        pytest.raises((ValueError, TypeError, RuntimeError), match=match),
        capture(model, points, mask="attention_mask", **kw),
    ):
        (forward or (lambda: model(input_ids=ids, attention_mask=am)))()
    assert diff(before, hook_snapshot(model)) == []


def test_bad_input_is_refused_by_name_with_no_hook_left():
    model = build("gpt2")
    _refused(model, r"'lossy' is not a named metric", gradients=True, metric="lossy")
    _refused(model, r"'resid_post\.5' is not a captured layer", gradients=["resid_post.5"],
             metric="loss")  # fmt: skip
    _refused(model, r"gradients= needs metric=", gradients=True)
    _refused(model, r"must return one value per example",
             gradients=True, metric=lambda out, b: out.logits.sum())  # fmt: skip
    ids, am = batch()

    def no_grad():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=am)

    _refused(model, r"layer 'resid_post\.0' does not require grad", forward=no_grad,
             gradients=True, metric="loss")  # fmt: skip
    model.train()
    try:
        _refused(model, r"dropout is active in transformer\.drop", gradients=True, metric="loss")
    finally:
        model.eval()

    # switched on after the capture began: refused at the forward
    def train_then_forward():
        model.train()
        try:
            model(input_ids=ids, attention_mask=am)
        finally:
            model.eval()

    _refused(model, r"dropout is active", forward=train_then_forward, gradients=True,
             metric="loss")  # fmt: skip


def test_batchnorm_in_training_mode_is_refused_by_name():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    before = hook_snapshot(net)
    with pytest.raises(ValueError, match=r"1 \(BatchNorm1d\) is in training mode"):
        capture(net, ["0"], gradients=True, metric=lambda out, b: out[:, 0])
    assert diff(before, hook_snapshot(net)) == []
    net.eval()
    x = torch.randn(5, 4)
    with capture(net, ["0"], gradients=True, metric=lambda out, b: out[:, 0]) as rec:
        net(x)
    h0 = net[0](x)
    (want,) = torch.autograd.grad(net[2](net[1](h0))[:, 0].sum(), h0)
    torch.testing.assert_close(rec["0_grad"], want)
    assert pyhook  # the package is the installed one (conftest)


# -- the job and the command ------------------------------------------------------------------
DOCS = [f"the fox number {i} ran {' '.join(['far'] * (i % 7))} away ." for i in range(40)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from _models import save_gpt2_lm, word_tokenizer

    root = tmp_path_factory.mktemp("gradjob")
    save_gpt2_lm(root / "model", word_tokenizer(DOCS))
    randomise_norms(T.GPT2LMHeadModel.from_pretrained(root / "model")).save_pretrained(
        root / "model"
    )
    (root / "c.txt").write_text("\n".join(DOCS) + "\n")
    return root


def test_job_stores_gradients_equal_to_autograd_and_the_command_writes_the_same(ckpt, tmp_path):
    from pyhook.cli import main
    from pyhook.pipeline.job import CaptureJob

    opts = dict(model=str(ckpt / "model"), input=str(ckpt / "c.txt"), layers=["resid_post.1"],
                context_size=16, exclude_special_tokens=False, limit=5, batch_size=2)  # fmt: skip
    job = CaptureJob(**opts, gradients=True, metric="loss", out=str(tmp_path / "job"))
    job.run()
    r = open_capture(tmp_path / "job")
    assert r.layers == ["resid_post.1", "resid_post.1_grad"] and verify_capture(r.path)[0] == []
    # context 0 by hand: every position kept, the loss over its 15 predictions
    rows = r.row_index[:, 0] == 0
    ids = r.tokens[rows][None]
    model = T.GPT2LMHeadModel.from_pretrained(ckpt / "model").eval()
    held = {}
    h = model.transformer.h[1].register_forward_hook(
        lambda m, a, o: held.update(x=o[0] if isinstance(o, tuple) else o)
    )
    try:
        out = model(input_ids=ids)
    finally:
        h.remove()
    loss = hand_loss(out.logits[0], ids[0], torch.ones(16, dtype=torch.bool))
    (want,) = torch.autograd.grad(loss, held["x"])
    torch.testing.assert_close(r["resid_post.1_grad"][:][rows], want[0], rtol=1e-4, atol=1e-6)
    # the command, with the same options as flags, writes the same rows
    flags = ["--model", opts["model"], "--input", opts["input"], "--layers", "resid_post.1"]
    flags += ["--context-size", "16", "--no-exclude-special-tokens", "--limit", "5"]
    flags += ["--batch-size", "2", "--gradients", "--metric", "loss", "--quiet"]
    assert main(["capture", *flags, "--out", str(tmp_path / "cmd")]) == 0
    c = open_capture(tmp_path / "cmd")
    assert c.settings["gradients"] == ["resid_post.1"] and c.settings["metric"] == "loss"
    assert torch.equal(c["resid_post.1_grad"][:], r["resid_post.1_grad"][:])
    # a job without gradients is a different capture there
    with pytest.raises(ValueError, match="gradients"):
        CaptureJob(**opts, out=str(tmp_path / "job")).plan()


def test_a_job_file_names_its_metric_as_data(tmp_path):
    import json

    from pyhook.pipeline.job import CaptureJob, JobError

    f = tmp_path / "job.json"
    f.write_text(json.dumps({"layers": ["resid_post.1"], "gradients": True, "metric": "logit:3"}))
    job = CaptureJob.from_file(f)
    assert job.gradients is True and job.metric == "logit:3"
    f.write_text(json.dumps({"gradients": ["resid_post.1"], "metric": "print(1)"}))
    with pytest.raises(JobError, match=r"metric`? must be a named metric, .loss. or .logit"):
        CaptureJob.from_file(f)
    with pytest.raises(JobError, match=r"gradients`? needs `?metric"):
        CaptureJob(gradients=True)
    with pytest.raises(JobError, match=r"give `?gradients`? too"):
        CaptureJob(metric="loss")
    # gradients on a tensor-parallel model are allowed (exact: tests/test_large_jobs.py)
    assert CaptureJob(gradients=True, metric="loss", tp_size=2).tp_size == 2
    # a callable only from Python
    assert callable(CaptureJob(gradients=True, metric=bert_metric).metric)


def _tensor_handles() -> int:
    import gc

    from torch.utils.hooks import RemovableHandle

    gc.collect()
    return sum(type(o) is RemovableHandle for o in gc.get_objects())


def test_gradient_hook_handles_do_not_grow_over_many_batches():
    """Each batch's tensor (gradient) hook handles are released once its graph is gone: over a
    long capture the number of handles stays bounded, not one set per batch ever run."""
    model = build("gpt2")
    ids, am = batch()
    counts = []

    def metric(output, batch):
        if len(calls) in (10, 11, 118, 119):
            counts.append(_tensor_handles())
        calls.append(1)
        return output.logits[:, -1, 7]

    calls = []
    with capture(model, "resid_post.*", gradients=True, metric=metric) as rec:
        for _ in range(120):
            model(input_ids=ids, attention_mask=am)
    assert rec["resid_post.0_grad"].shape[0] == 120 * 3 * 6
    # two gradient hooks per batch: 216 more handles between the counts if each batch kept its
    # own; a bounded set (dead ones dropped as the set doubles, at least 64) grows by less
    assert counts[-1] - counts[0] < 64, counts


def test_lens_hooks_gradient_handles_do_not_grow_over_a_training_loop():
    model = build("gpt2")
    ids, _ = batch()
    seen = []
    with pyhook.hooks(
        model,
        fwd_hooks=[("attn_z.0", lambda z, hook: z * 1.5)],
        bwd_hooks=[
            ("resid_post.*", lambda g, hook: seen.append(1)),
            ("attn_z.*", lambda g, h: None),
        ],
    ):
        counts = []
        for i in range(150):
            model(ids, labels=ids).loss.backward()
            if i in (10, 11, 148, 149):
                counts.append(_tensor_handles())
    model.zero_grad()
    assert len(seen) == 150 * 2
    # four gradient hooks per forward: 548 more handles if each forward kept its own
    assert counts[-1] - counts[0] < 64, counts
