"""Issue 17, item 7: the loop that closes. A parquet corpus -> packed capture of two layers of a
GPT-2-shaped model (the command) -> a tiny sparse autoencoder trained from the store -> the
top-activating tokens of one feature, with their contexts, from the store's token bookkeeping.

The token ids and contexts are checked against the packing written out by hand here."""

from __future__ import annotations

import pytest
import torch
from _models import save_gpt2_lm, word_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
annotations = pytest.importorskip("pyhook.annotations")  # the recorder's token bookkeeping

from pyhook.cli import main  # noqa: E402
from pyhook.store import open_capture  # noqa: E402

ANIMALS = ["fox", "wolf", "bear", "hare", "owl", "crow"]
PLACES = ["wood", "river", "hill", "field", "castle"]
DOCS = [
    f"the {ANIMALS[i % 6]} went to the {PLACES[i % 5]} and saw a {ANIMALS[(i * 7) % 6]} there ."
    for i in range(300)
]


def face(reader, name, *args):
    """``reader.tokens`` / ``reader.row_index`` / ``reader.text(i)`` once wired on the reader,
    else the pyhook.annotations functions they are made of."""
    attr = getattr(type(reader), name, None)
    if attr is not None:
        value = getattr(reader, name)
        return value(*args) if args else value
    return getattr(annotations, name)(reader, *args)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sae")
    tok = word_tokenizer(DOCS)
    save_gpt2_lm(root / "model", tok)
    pq.write_table(pa.table({"text": DOCS}), root / "corpus.parquet")
    return root, tok


def test_parquet_to_sae_to_top_tokens(setup, tmp_path, capsys):
    root, tok = setup
    out = tmp_path / "acts"
    args = ["capture", "--model", str(root / "model"), "--input", str(root / "corpus.parquet")]
    args += ["--layers", "transformer.h.0", "transformer.h.1", "--context-size", "32"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    reader = open_capture(out)

    # the hand-made reference: <|endoftext|> before each document, cut into contexts of 32
    stream = []
    for d in DOCS:
        stream += [tok.bos_token_id, *tok(d, add_special_tokens=False)["input_ids"]]
    contexts = torch.tensor(stream[: len(stream) // 32 * 32]).reshape(-1, 32)
    keep = contexts != tok.bos_token_id
    ids = face(reader, "tokens")
    where = face(reader, "row_index")
    assert torch.equal(ids, contexts[keep])  # no BOS rows, every other token once, in order
    assert torch.equal(contexts[where[:, 0], where[:, 1]], ids)
    assert reader.examples == len(contexts)

    # a tiny sparse autoencoder on layer 1's rows: loss falls
    x = reader["transformer.h.1"].to_tensor().float()
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
    torch.manual_seed(0)
    d, f = x.shape[1], 64
    enc, dec = torch.nn.Linear(d, f), torch.nn.Linear(f, d)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=3e-3)
    losses = []
    for _ in range(300):
        batch = x[torch.randint(0, len(x), (256,))]
        acts = torch.relu(enc(batch))
        loss = (dec(acts) - batch).pow(2).mean() + 1e-3 * acts.abs().sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20

    # the top-activating tokens of the most active feature, with their contexts
    with torch.no_grad():
        acts = torch.relu(enc(x))
    feature = int(acts.mean(0).argmax())
    top = acts[:, feature].topk(5).indices
    for row in top.tolist():
        ctx, pos = where[row].tolist()
        word = tok.convert_ids_to_tokens(int(ids[row]))
        text = face(reader, "text", ctx)
        assert text == tok.decode(contexts[ctx].tolist())  # the context, as the tokenizer reads it
        assert text.split()[pos] == word  # WordLevel: one word per token
        print(f"feature {feature}: {word!r} in context {ctx}: {text[:60]!r}")
    assert capsys.readouterr().out.count(f"feature {feature}:") == 5
