"""``pyhook inspect --plot`` on a transcoder-shaped store (``mlp_in.L`` / ``mlp_out.L`` over 12
layers, plus a point with no layer): one line per kind of point over the layer number, and
histograms that say which points they show when they are a subset."""

from __future__ import annotations

import pytest
import torch

from pyhook.cli import _histogram_picks, _point_kinds, main
from pyhook.store import ShardWriter

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

LAYERS = 12


@pytest.fixture
def transcoder_store(tmp_path):
    """Rows whose norm is known: mlp_in.L rows have norm L + 1, mlp_out.L rows 2 (L + 1),
    ``embed`` rows 0.5 (every row of a point the same norm, in random directions)."""
    g = torch.Generator().manual_seed(0)

    def rows(norm):
        x = torch.randn(16, 8, generator=g)
        return x / x.norm(dim=1, keepdim=True) * norm

    batch = {"embed": rows(0.5)}
    for layer in range(LAYERS):  # stored in the order a transcoder capture lists them
        batch[f"mlp_in.{layer}"] = rows(layer + 1.0)
        batch[f"mlp_out.{layer}"] = rows(2.0 * (layer + 1))
    out = tmp_path / "tc"
    with ShardWriter(out) as w:
        w.add(batch, examples=16)
    return out


def test_plot_groups_points_by_kind_and_names_the_histograms_subset(
    transcoder_store, tmp_path, monkeypatch
):
    # with more than 8 layers the labels kept only the last component ("0 0 1 1 ..."), one line
    # joined mlp_in.1 -> mlp_out.1 -> mlp_in.2, and the histograms showed 3 points, unsaid
    figures = []
    save = Figure.savefig

    def keep(fig, *a, **kw):
        figures.append(fig)
        return save(fig, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", keep)
    png = tmp_path / "tc.png"
    assert main(["inspect", str(transcoder_store), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    ax1, ax2 = fig.axes[:2]
    bars = ax1.containers  # one errorbar (line, caps, bars) per kind; its label is the kind's
    lines = {c.get_label(): c.lines[0] for c in bars if not c.get_label().startswith("_")}
    assert sorted(lines) == ["mlp_in.L", "mlp_out.L"]
    for kind, scale in (("mlp_in.L", 1.0), ("mlp_out.L", 2.0)):
        x, y = lines[kind].get_data()
        assert list(x) == list(range(LAYERS))  # over the layer number, one kind per line
        want = scale * torch.arange(1.0, LAYERS + 1)
        assert torch.allclose(torch.tensor([float(v) for v in y]), want, atol=1e-4)
    # the point with no layer is a marker of its own, named, left of layer 0
    assert [t.get_text() for t in ax1.texts] == ["embed"]
    assert ax1.texts[0].xy[0] < 0
    ticks = [t for t in ax1.get_xticks() if 0 <= t <= LAYERS - 1]
    assert all(float(t).is_integer() for t in ticks) and len(ticks) >= 3
    # the histograms: each kind's first, middle, last layer; the title says it is a subset
    shown = [t.get_text() for t in ax2.get_legend().get_texts()]
    assert shown == [
        "embed",
        "mlp_in.0",
        "mlp_in.6",
        "mlp_in.11",
        "mlp_out.0",
        "mlp_out.6",
        "mlp_out.11",
    ]
    assert "7 of 25 points (each kind's first, middle and last layer)" in ax2.get_title()


def test_point_kinds_and_histogram_picks():
    names = [f"{k}.{i}" for i in range(3) for k in ("mlp_in", "mlp_out")] + ["h.2.attn", "ln_f"]
    kinds = _point_kinds(names)
    assert kinds == {
        "mlp_in.L": [(0, "mlp_in.0"), (1, "mlp_in.1"), (2, "mlp_in.2")],
        "mlp_out.L": [(0, "mlp_out.0"), (1, "mlp_out.1"), (2, "mlp_out.2")],
        "h.L.attn": [(2, "h.2.attn")],
        "ln_f": [(None, "ln_f")],
    }
    assert _histogram_picks(kinds)[0] == [*names[0:6:2], *names[1:6:2], "h.2.attn", "ln_f"]
    # too many curves: fewer per kind, and the words say so
    many = _point_kinds([f"k{j}.{i}" for j in range(5) for i in range(4)])
    picks, how = _histogram_picks(many)
    assert picks == [f"k{j}.0" for j in range(5)] and how == "each kind's first layer"
