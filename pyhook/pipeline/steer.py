"""Steering in the capture pipeline: vectors from stores (CAA's mean difference), vectors from
files by name, and steering specs given as data (a job file, the command line), never code.

* :func:`mean_difference` -- the mean of a layer's rows over one set of examples minus the
  mean over another (contrastive activation addition), read from a store.
* :func:`load_vector` -- a named tensor from a ``.safetensors``, ``.pt`` (weights only) or
  ``.npy`` (no pickles) file.
* :func:`specs_from_data` -- :class:`pyhook.Steer` specs from JSON-able dicts (vectors named by
  file: a job file's ``steer``, the command's ``--steer``).
* :func:`specs_of_examples` -- a job's per-example steering (named sets chosen by a corpus
  column, scales multiplied by another) as ``steer=``'s list with one entry per prompt.
* :func:`specs_of_batch` -- the specs of one prompt batch from a ``steer=`` argument (one spec
  or list for every row, or a list with one entry per prompt), and :func:`describe` for the
  store's metadata.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..steering import Probe, Steer, SteeringError
from ._generate_options import STEER_FIELDS

__all__ = [
    "describe",
    "load_vector",
    "mean_difference",
    "specs_from_data",
    "specs_of_batch",
    "specs_of_examples",
]


def _open(store: Any) -> Any:
    if isinstance(store, (str, os.PathLike)):
        from .reader import open_capture

        return open_capture(os.fspath(store))
    return store


def mean_difference(
    store: Any,
    layer: str,
    positive: Sequence[int],
    negative: Sequence[int],
    *,
    position: str | int = "all",
) -> torch.Tensor:
    """``mean(rows of positive examples) - mean(rows of negative examples)`` of ``layer`` in
    ``store`` (a path or an open reader), in float64 then the layer's dtype: the steering
    vector of contrastive activation addition (CAA). ``positive``/``negative``: example
    indices; ``position``: ``"all"`` (every stored row of each example), ``"last"`` (each
    example's last stored row, e.g. the answer token) or an int (the row at that absolute
    position of each example).

    >>> import tempfile, torch, pyhook
    >>> net = torch.nn.Sequential(torch.nn.Identity())
    >>> out = tempfile.mkdtemp()
    >>> with pyhook.capture(net, "0", out=out) as rec:
    ...     rec.annotate(torch.ones(2, 2, dtype=torch.long))
    ...     _ = net(torch.tensor([[[1.0, 0.0], [3.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]]))
    >>> mean_difference(out, "0", [0], [1]).tolist()
    [2.0, -1.0]
    """
    reader = _open(store)
    index = reader.row_index
    if index is None:
        raise SteeringError(
            "mean_difference: the store has no row index (example, position) to select "
            "examples by; capture with token annotations (rec.annotate or a corpus source)"
        )
    data = reader.layer(layer)
    examples = index[:, 0]

    def rows_of(which: Sequence[int], what: str) -> torch.Tensor:
        wanted = torch.as_tensor(list(which), dtype=torch.long)
        if wanted.numel() == 0:
            raise SteeringError(f"mean_difference: {what} lists no example")
        hit = torch.isin(examples, wanted)
        if position == "last":
            last = torch.full((int(examples.max()) + 1,), -1, dtype=torch.long)
            rows = hit.nonzero(as_tuple=True)[0]
            last.scatter_reduce_(0, examples[rows], rows, reduce="amax")
            sel = last[wanted.clamp(max=last.numel() - 1)]
            sel = sel[(wanted < last.numel()) & (sel >= 0)]
        elif position == "all":
            sel = hit.nonzero(as_tuple=True)[0]
        elif isinstance(position, int) and not isinstance(position, bool):
            sel = (hit & (index[:, 1] == position)).nonzero(as_tuple=True)[0]
        else:
            raise SteeringError(
                f"mean_difference: position must be 'all', 'last' or an int, got {position!r}"
            )
        if sel.numel() == 0:
            raise SteeringError(
                f"mean_difference: no row of layer {layer!r} belongs to the {what} examples "
                f"{list(which)[:8]} (position {position!r})"
            )
        return data[sel].double().reshape(int(sel.numel()), -1)

    pos = rows_of(positive, "positive")
    neg = rows_of(negative, "negative")
    diff = pos.mean(0) - neg.mean(0)
    return diff.reshape(data.row_shape).to(data.dtype)


def load_vector(path: str, name: str | None = None) -> torch.Tensor:
    """The tensor ``name`` of the file ``path``: ``.safetensors`` (by name; the only tensor when
    ``name`` is None), ``.pt``/``.pth`` (a tensor, or a mapping of them; loaded with
    ``weights_only=True``) or ``.npy`` (an array, without pickles).

    >>> import tempfile, os, torch
    >>> p = os.path.join(tempfile.mkdtemp(), "v.pt")
    >>> torch.save({"happy": torch.ones(3)}, p)
    >>> load_vector(p, "happy").tolist()
    [1.0, 1.0, 1.0]
    """
    ext = os.path.splitext(path)[1].lower()
    who = f"steering vector {path!r}" + (f" ({name!r})" if name else "")
    if not os.path.isfile(path):
        raise SteeringError(f"{who}: no such file")
    try:
        if ext == ".safetensors":
            from safetensors.torch import load_file

            found: Any = load_file(path)
        elif ext in (".pt", ".pth"):
            found = torch.load(path, map_location="cpu", weights_only=True)
        elif ext == ".npy":
            import numpy as np

            found = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            raise SteeringError(
                f"{who}: a vector file is .safetensors, .pt/.pth or .npy, got {ext or 'none'}"
            )
    except SteeringError:
        raise
    except Exception as e:  # a damaged or foreign file
        raise SteeringError(f"{who}: cannot be read ({type(e).__name__}: {e})") from None
    if isinstance(found, Mapping):
        if name is None:
            if len(found) != 1:
                raise SteeringError(
                    f"{who}: holds {len(found)} tensors ({', '.join(sorted(found))[:200]}); "
                    "name one (FILE:NAME)"
                )
            found = next(iter(found.values()))
        elif name not in found:
            raise SteeringError(
                f"{who}: no tensor {name!r}; it holds {', '.join(sorted(found))[:200]}"
            )
        else:
            found = found[name]
    elif name is not None and ext != ".npy":
        raise SteeringError(f"{who}: the file holds one tensor, not a mapping of named ones")
    if not isinstance(found, torch.Tensor):
        raise SteeringError(f"{who}: not a tensor ({type(found).__name__})")
    return found


_PROBE_FIELDS = {"point", "direction", "threshold", "reduce"}


def _vector_of(v: Any, where: str, base: str | None) -> torch.Tensor:
    if isinstance(v, str):
        path, _, name = v.partition(":") if not re.match(r"^[A-Za-z]:[\\/]", v) else (v, "", "")
        if base is not None and not os.path.isabs(path):
            path = os.path.join(base, path)
        return load_vector(path, name or None)
    if isinstance(v, Mapping) and "file" in v:
        path = str(v["file"])
        if base is not None and not os.path.isabs(path):
            path = os.path.join(base, path)
        return load_vector(path, v.get("name"))
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
        return torch.tensor(v, dtype=torch.float32)
    raise SteeringError(
        f"{where}: a vector is 'FILE[:NAME]', {{'file': FILE, 'name': NAME}} or a list of numbers, "
        f"got {v!r}"
    )


def specs_from_data(items: Any, *, base: str | None = None) -> list[Steer]:
    """:class:`~pyhook.Steer` specs from data: a dict, or a list of dicts, with the fields of
    ``Steer`` (``point``, ``vector``, ``scale``, ``op``, ``prompt``, ``generated``, ``when``: a
    dict with the fields of :class:`~pyhook.Probe`); a vector (or direction) is
    ``"FILE[:NAME]"``, ``{"file": FILE, "name": NAME}`` or a list of numbers. Relative file
    paths are taken from ``base``.

    >>> s = specs_from_data({"point": "resid_post.1", "vector": [1.0, 0.0], "scale": 2})
    >>> s[0].point, s[0].scale, s[0].vector.tolist()
    ('resid_post.1', 2, [1.0, 0.0])
    """
    if isinstance(items, Mapping):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise SteeringError(f"steer: a spec (dict) or a list of them, got {type(items).__name__}")
    out = []
    for i, d in enumerate(items):
        where = f"steer[{i}]"
        if not isinstance(d, Mapping):
            raise SteeringError(f"{where}: a spec is a dict of Steer's fields, got {d!r}")
        unknown = set(d) - STEER_FIELDS
        if unknown:
            raise SteeringError(
                f"{where}: unknown field(s) {sorted(unknown)}; a spec has {sorted(STEER_FIELDS)}"
            )
        if "point" not in d or "vector" not in d:
            raise SteeringError(f"{where}: a spec needs 'point' and 'vector'")
        kw = dict(d)
        kw["vector"] = _vector_of(d["vector"], where, base)
        if isinstance(kw.get("generated"), list):
            kw["generated"] = tuple(kw["generated"])
        when = d.get("when")
        if when is not None:
            if not isinstance(when, Mapping) or set(when) - _PROBE_FIELDS or "point" not in when:
                raise SteeringError(
                    f"{where}: 'when' is a dict with {sorted(_PROBE_FIELDS)} ('point' and "
                    f"'direction' required), got {when!r}"
                )
            pk = dict(when)
            pk["direction"] = _vector_of(when.get("direction"), where, base)
            kw["when"] = Probe(**pk)
        out.append(Steer(**kw))
    return out


def specs_of_examples(
    default: Sequence[Steer],
    sets: Mapping[str, Sequence[Steer]],
    chosen: Sequence[str | None] | None,
    factors: Sequence[float | None] | None,
    count: int,
) -> list[tuple[Steer, ...] | None]:
    """The ``steer=`` list of :func:`~pyhook.pipeline.generate.run_generate` (one entry per
    prompt) for ``count`` examples: example ``i`` gets the set ``sets[chosen[i]]``, or
    ``default`` where ``chosen[i]`` is None (or ``chosen`` is), each spec's scale multiplied by
    ``factors[i]`` where that is not None; an example left with no spec gets None
    (unsteered). Examples with the same set and factor share one tuple of specs.

    >>> happy = Steer("resid_post.0", [1.0, 0.0], scale=2.0)
    >>> got = specs_of_examples((), {"happy": (happy,)}, ["happy", None, "happy"],
    ...                         [None, None, 4.0], 3)
    >>> got[0][0] is happy, got[1], got[2][0].scale
    (True, None, 8.0)
    """
    out: list[tuple[Steer, ...] | None] = []
    every, named = tuple(default), {k: tuple(v) for k, v in sets.items()}
    scaled: dict[tuple[str | None, float], tuple[Steer, ...]] = {}
    for i in range(count):
        name = chosen[i] if chosen is not None else None
        base = every if name is None else named[name]
        f = factors[i] if factors is not None else None
        if not base:
            out.append(None)
        elif f is None:
            out.append(base)
        else:
            key = (name, float(f))
            if key not in scaled:
                scaled[key] = tuple(dataclasses.replace(s, scale=s.scale * f) for s in base)
            out.append(scaled[key])
    return out


def specs_of_batch(steer: Any, examples: Sequence[int]) -> Any:
    """The ``specs`` of :func:`pyhook.steering` for a prompt batch holding ``examples``:
    ``steer`` is one spec (or a list of specs, as a tuple) for every row, or a list with one
    entry per prompt (indexed by example number)."""
    if steer is None or isinstance(steer, (Steer, tuple)):
        return steer  # every row (a tuple: all of its specs)
    out = []
    for e in examples:
        if not 0 <= int(e) < len(steer):
            raise SteeringError(
                f"steer: a list with one entry per prompt has {len(steer)} entries; prompt "
                f"{int(e)} has none"
            )
        out.append(steer[int(e)])
    return out


def describe(specs: Any) -> list[dict[str, Any]]:
    """One row's specs (a spec, a list of them, or None) as JSON-able dicts."""
    if specs is None:
        return []
    if isinstance(specs, Steer):
        return [specs.describe()]
    return [s.describe() for s in specs]
