"""The dictionary protocol (pyhook.dictionaries): adapters and linear_parts against each
library-shaped dictionary's own encode/decode, and refusals by name."""

from __future__ import annotations

import pytest
import torch
from _dicts import CLT, DLAutoEncoder, DLTopK, GatedSAE, SAELensSAE, SparsifyCoder

from pyhook.dictionaries import (
    DictionaryError,
    SparseFeatures,
    as_dictionary,
    dense_features,
    linear_parts,
    parse_key,
)

D, N = 8, 24


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def _cases():
    torch.manual_seed(0)
    return {
        "saelens-standard": SAELensSAE(D, N),
        "saelens-no-b_dec-input": SAELensSAE(D, N, apply_b_dec=False),
        "saelens-jumprelu": SAELensSAE(D, N, arch="jumprelu"),
        "saelens-topk": SAELensSAE(D, N, arch="topk", k=4),
        "saelens-transcoder": SAELensSAE(D, N, d_out=5, apply_b_dec=False),
        "sparsify": SparsifyCoder(D, N, 4),
        "sparsify-transcode": SparsifyCoder(D, N, 4, transcode=True, d_out=6),
        "dl-autoencoder": DLAutoEncoder(D, N),
        "dl-topk": DLTopK(D, N, 5),
        "dl-batchtopk-threshold": DLTopK(D, N, 5, threshold=0.2),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_linear_parts_reproduce_encode_and_decode(name):
    d = _cases()[name].double()
    parts = linear_parts(d)
    dic = as_dictionary(d)
    x = _x(3, 7, D) * 2
    want = dense_features(dic.encode(x))
    got = parts.encode(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (want != 0).any() and (want == 0).any()  # the probe covered both sides of the activation
    torch.testing.assert_close(
        parts.decode(want), dic.decode(dic.encode(x)), rtol=1e-10, atol=1e-10
    )
    n = parts.W_enc.shape[1]
    assert parts.W_enc.shape == (D, n) and parts.b_enc.shape == (n,)
    assert parts.W_dec.shape[0] == n and parts.b_dec.shape == parts.W_dec.shape[1:]


def test_input_bias_is_the_subtracted_b_dec():
    torch.manual_seed(0)
    sae = SAELensSAE(D, N)
    assert linear_parts(sae).input_bias is sae.b_dec
    assert linear_parts(SAELensSAE(D, N, apply_b_dec=False)).input_bias is None
    sc = SparsifyCoder(D, N, 4)
    assert linear_parts(sc).input_bias is sc.b_dec
    assert linear_parts(SparsifyCoder(D, N, 4, transcode=True)).input_bias is None
    dl = DLAutoEncoder(D, N)
    assert linear_parts(dl).input_bias is dl.bias


def test_sparsify_adapter_keeps_features_sparse_and_rows_shaped():
    torch.manual_seed(0)
    sc = SparsifyCoder(D, N, 4).double()
    dic = as_dictionary(sc)
    assert dic is not sc
    x = _x(2, 5, D)
    f = dic.encode(x)
    assert isinstance(f, SparseFeatures) and f.values.shape == (2, 5, 4) and f.size == N
    rows = sc.encode(x.reshape(-1, D))
    torch.testing.assert_close(f.values.reshape(-1, 4), rows.top_acts)
    torch.testing.assert_close(
        dic.decode(f), sc.decode(rows.top_acts, rows.top_indices).reshape(2, 5, D)
    )
    dense = f.dense()
    assert dense.shape == (2, 5, N) and int((dense != 0).sum(-1).max()) <= 4


def test_clt_parts_are_lists_one_per_output():
    torch.manual_seed(0)
    clt = CLT(D, N, 6, 3).double()
    parts = linear_parts(clt)
    assert isinstance(parts.W_dec, list) and len(parts.W_dec) == 3 and len(parts.b_dec) == 3
    x = _x(4, D)
    for got, want in zip(parts.decode(parts.encode(x)), clt.decode(clt.encode(x))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: GatedSAE(D, N), "GatedSAE"),
        (lambda: torch.nn.Linear(D, D), "Linear is not a dictionary"),
    ],
)
def test_refused_by_name(make, words):
    with pytest.raises(DictionaryError, match=words):
        linear_parts(make())


def test_skip_connection_and_scaled_features_refused():
    torch.manual_seed(0)
    sc = SparsifyCoder(D, N, 4)
    sc.W_skip = torch.nn.Parameter(torch.zeros(D, D))
    with pytest.raises(DictionaryError, match="SparsifyCoder has a skip connection"):
        linear_parts(sc)

    class NormScaled(SAELensSAE):  # dictionary_learning's JumpReluAutoEncoder scales features
        def encode(self, x):
            return super().encode(x) * self.W_dec.norm(dim=1)

        def decode(self, f):
            return super().decode(f / self.W_dec.norm(dim=1))

    with pytest.raises(DictionaryError, match="NormScaled: encode"):
        linear_parts(NormScaled(D, N))


def test_parse_key():
    assert parse_key("resid_post.3") == ("resid_post.3", ["resid_post.3"], False)
    assert parse_key(("mlp_in.3", ("mlp_out.3", "mlp_out.4"))) == (
        "mlp_in.3",
        ["mlp_out.3", "mlp_out.4"],
        True,
    )
    with pytest.raises(DictionaryError, match="dictionary key 3"):
        parse_key(3)


def test_sparsify_adapter_decodes_dense_features_with_any_feature_on():
    torch.manual_seed(0)
    sc = SparsifyCoder(D, N, 4).double()
    dic = as_dictionary(sc)
    f = dic.encode(_x(3, D))
    torch.testing.assert_close(dic.decode(f.dense()), dic.decode(f), rtol=1e-12, atol=1e-12)
    dense = f.dense()
    dense[..., :] = 0.5  # every feature on: more than k, as an edit may do
    torch.testing.assert_close(dic.decode(dense), dense @ sc.W_dec + sc.b_dec)
