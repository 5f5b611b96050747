"""pyhook.evaluate_dictionaries against a plain loop: FVU, L0, dead features, KL and
cross-entropy with one, some or all dictionaries spliced in, over batches with padding and over
a store's token ids."""

from __future__ import annotations

import pytest
import torch
from test_splice import _dicts, _model, _Plain

import pyhook
from pyhook.dictionaries import as_dictionary, dense_features

T = pytest.importorskip("transformers")


def _batches():
    g = torch.Generator().manual_seed(4)
    out = []
    for lengths in ([7, 4], [5, 7, 2]):
        ids = torch.randint(1, 64, (len(lengths), 7), generator=g)
        mask = torch.zeros_like(ids)
        for r, n in enumerate(lengths):
            mask[r, :n] = 1
        ids[mask == 0] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _reference(model, dicts, batches, sets):
    """The plain loop: every token kept, concatenated, the formulas applied once."""
    adapted = {k: as_dictionary(d) for k, d in dicts.items()}
    xs = {k: [] for k in dicts}
    ys = {k: [] for k in dicts}
    rec = {k: [] for k in dicts}
    feats = {k: [] for k in dicts}
    kl = {s: [] for s in sets}
    ce = {s: [] for s in sets}
    kl_ab = {s: [] for s in sets}
    ce_ab = {s: [] for s in sets}
    ce_clean = []
    with torch.no_grad():
        for b in batches:
            ids, mask = b["input_ids"], b["attention_mask"]
            valid = mask.bool()
            seen = {}

            def grab(k, x, y, seen=seen):
                seen[k] = (x, y)
                return y

            with _Plain(model, grab):
                clean = model(ids, attention_mask=mask).logits
            for k in dicts:
                x, y = seen[k]
                f = adapted[k].encode(x)
                xs[k].append(x[valid])
                ys[k].append(y[valid])
                rec[k].append(adapted[k].decode(f)[valid])
                feats[k].append(dense_features(f)[valid])
            keep = valid[:, 1:] & valid[:, :-1]
            lp_clean = torch.log_softmax(clean[:, :-1].double(), -1)
            nxt = ids[:, 1:, None]
            ce_clean.append(-lp_clean.gather(-1, nxt).squeeze(-1)[keep])
            for s, members in sets.items():

                def swap(k, x, y, members=members):
                    return adapted[k].decode(adapted[k].encode(x)) if k in members else y

                with _Plain(model, swap):
                    lp = torch.log_softmax(model(ids, attention_mask=mask).logits[:, :-1], -1)
                kl[s].append((lp_clean.exp() * (lp_clean - lp)).sum(-1)[keep])
                ce[s].append(-lp.gather(-1, nxt).squeeze(-1)[keep])

                def zero(k, x, y, members=members):
                    return torch.zeros_like(y) if k in members else y

                with _Plain(model, zero):
                    lp = torch.log_softmax(model(ids, attention_mask=mask).logits[:, :-1], -1)
                kl_ab[s].append((lp_clean.exp() * (lp_clean - lp)).sum(-1)[keep])
                ce_ab[s].append(-lp.gather(-1, nxt).squeeze(-1)[keep])
    per = {}
    for k in dicts:
        y, r, f = torch.cat(ys[k]), torch.cat(rec[k]), torch.cat(feats[k])
        per[k] = {
            "fvu": float(((y - r) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()),
            "cossim": float(torch.nn.functional.cosine_similarity(y, r, dim=-1).mean()),
            "l2_ratio": float((r.norm(dim=-1) / y.norm(dim=-1)).mean()),
            "l1": float(f.abs().sum(-1).mean()),
            "l0": float((f != 0).sum(-1).double().mean()),
            "dead": int(((f != 0).sum(0) == 0).sum()),
            "tokens": y.shape[0],
        }
    base = torch.cat(ce_clean).mean()
    spl = {}
    for s in sets:
        k, c = torch.cat(kl[s]).mean(), torch.cat(ce[s]).mean()
        ka, ca = torch.cat(kl_ab[s]).mean(), torch.cat(ce_ab[s]).mean()
        spl[s] = {
            "kl": float(k),
            "ce_increase": float(c - base),
            "kl_div_score": float((ka - k) / ka),
            "ce_loss_score": float((ca - c) / (ca - base)),
        }
    return per, spl


def test_evaluate_matches_a_plain_loop():
    model = _model("gpt2")
    dicts = _dicts()
    keys = list(dicts)
    some = (keys[0], keys[2])
    ev = pyhook.evaluate_dictionaries(model, dicts, _batches(), spliced=[keys[1], some, "all"])
    per, spl = _reference(
        model, dicts, _batches(), {keys[1]: [keys[1]], some: list(some), "all": keys}
    )
    assert sorted(ev.spliced, key=str) == sorted(spl, key=str)
    for k in keys:
        got = ev.per_dictionary[k]
        assert got["tokens"] == per[k]["tokens"] == 25
        assert got["dead"] == per[k]["dead"]
        assert got["dead_fraction"] == per[k]["dead"] / 40
        for m in ("fvu", "l0", "l1", "cossim", "l2_ratio"):
            assert got[m] == pytest.approx(per[k][m], rel=1e-9), (k, m)
    for s in spl:
        for m in ("kl", "ce_increase", "kl_div_score", "ce_loss_score"):
            assert ev.spliced[s][m] == pytest.approx(spl[s][m], rel=1e-9, abs=1e-12), (s, m)
        assert ev.spliced[s]["kl"] > 0
    # the default sets: each dictionary alone, then all
    assert list(pyhook.evaluate_dictionaries(model, dicts, _batches()[:1]).spliced) == [
        *keys,
        "all",
    ]


def test_evaluate_over_a_store_equals_the_batches(tmp_path):
    model = _model("gpt2")
    dicts = _dicts()
    data = _batches()
    with (
        torch.no_grad(),
        pyhook.capture(model, "resid_post.0", out=tmp_path, mask="attention_mask"),
    ):
        for b in data:
            model(**b)
    reader = pyhook.open_capture(tmp_path)
    ev = pyhook.evaluate_dictionaries(model, dicts, reader, spliced=["all"], batch_size=2)
    want = pyhook.evaluate_dictionaries(model, dicts, data, spliced=["all"])
    for k in dicts:
        for m in ("fvu", "l0", "dead", "tokens"):
            assert ev.per_dictionary[k][m] == pytest.approx(want.per_dictionary[k][m], rel=1e-9)
    for m in ("kl", "ce_increase", "ce_clean"):
        assert ev.spliced["all"][m] == pytest.approx(want.spliced["all"][m], rel=1e-9)


def test_evaluate_refuses_unknown_sets():
    model = _model("gpt2")
    with pytest.raises(pyhook.DictionaryError, match=r"spliced names 'resid_post\.1'"):
        pyhook.evaluate_dictionaries(model, _dicts(), _batches(), spliced=["resid_post.1"])


def test_evaluate_a_clt_gives_one_fvu_per_output():
    from _dicts import CLT

    model = _model("llama")
    torch.manual_seed(7)
    clt = CLT(16, 30, 16, 2).double()
    key = ("mlp_in.0", ("mlp_out.0", "mlp_out.1"))
    ids = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(8))
    seen = {}
    mlps = [model.model.layers[i].mlp for i in range(2)]
    hs = [mlps[0].register_forward_pre_hook(lambda _m, a: seen.__setitem__("x", a[0]))]
    for i, m in enumerate(mlps):
        hs.append(m.register_forward_hook(lambda _m, _a, y, i=i: seen.__setitem__(i, y)))
    with torch.no_grad():
        model(ids)
    for h in hs:
        h.remove()
    with torch.no_grad():
        recon = clt.decode(clt.encode(seen["x"]))
    want = []
    for i in range(2):
        y, r = seen[i].reshape(-1, 16), recon[i].reshape(-1, 16)
        want.append(float(((y - r) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()))
    ev = pyhook.evaluate_dictionaries(model, {key: clt}, [ids], ablation=False)
    got = ev.per_dictionary[key]
    assert got["fvu"] == pytest.approx(want, rel=1e-9)
    assert list(ev.spliced) == [key] and "ce_loss_score" not in ev.spliced[key]


def test_evaluate_a_per_head_point_reads_it_as_splice_does():
    """An attention SAE at attn_z.L (trained on [batch, pos, heads * d_head], as SAELens'
    attention SAEs are): its FVU, L0 and KL against hand-written hooks on the input of GPT-2's
    c_proj (the heads' outputs side by side)."""
    model = _model("gpt2")
    d = model.config.n_embd
    g = torch.Generator().manual_seed(9)

    class SAE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W_enc = torch.nn.Parameter(torch.randn(d, 2 * d, generator=g, dtype=torch.float64))
            self.b_enc = torch.nn.Parameter(torch.full((2 * d,), -0.5, dtype=torch.float64))
            self.W_dec = torch.nn.Parameter(torch.randn(2 * d, d, generator=g, dtype=torch.float64))

        def encode(self, x):
            return torch.relu(x @ self.W_enc + self.b_enc)

        def decode(self, f):
            return f @ self.W_dec / (2 * d)

    sae = SAE()
    ev = pyhook.evaluate_dictionaries(model, {"attn_z.1": sae}, _batches(), ablation=False)
    proj = model.transformer.h[1].attn.c_proj
    ys, rs, fs, kls = [], [], [], []
    with torch.no_grad():
        for b in _batches():
            ids, mask = b["input_ids"], b["attention_mask"]
            valid = mask.bool()
            seen = {}
            h = proj.register_forward_pre_hook(lambda m, a, s=seen: s.__setitem__("x", a[0]))
            clean = model(ids, attention_mask=mask).logits
            h.remove()
            f = sae.encode(seen["x"])
            ys.append(seen["x"][valid])
            rs.append(sae.decode(f)[valid])
            fs.append(f[valid])
            h = proj.register_forward_pre_hook(lambda m, a: (sae.decode(sae.encode(a[0])),))
            spliced = model(ids, attention_mask=mask).logits
            h.remove()
            keep = valid[:, 1:] & valid[:, :-1]
            lp_clean = torch.log_softmax(clean[:, :-1].double(), -1)
            lp = torch.log_softmax(spliced[:, :-1].double(), -1)
            kls.append((lp_clean.exp() * (lp_clean - lp)).sum(-1)[keep])
    y, r, f = torch.cat(ys), torch.cat(rs), torch.cat(fs)
    got = ev.per_dictionary["attn_z.1"]
    assert got["fvu"] == pytest.approx(float(((y - r) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()))
    assert got["l0"] == pytest.approx(float((f != 0).sum(-1).double().mean()))
    assert ev.spliced["attn_z.1"]["kl"] == pytest.approx(float(torch.cat(kls).mean()), rel=1e-9)
