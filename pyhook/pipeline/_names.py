"""Names of the models of a paired capture (:mod:`pyhook.pipeline.paired`), checked without
torch: the job and the command check them before importing it."""

from __future__ import annotations

import re
from typing import Any

#: between a model's name and its layer's name (``base/resid_post.6``)
SEP = "/"

_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_model_name(name: Any) -> str | None:
    """What is wrong with ``name`` as the name of a model of a paired capture (None: nothing).
    Layers are stored as ``NAME/LAYER``, so a name holds no ``/`` (nor ``=``, nor spaces) and
    does not start with ``_`` (``__`` names the store's own tensors).

    >>> check_model_name("chat"), check_model_name("a/b")
    (None, "a model's name cannot contain '/' (layers are stored as NAME/LAYER), got 'a/b'")
    """
    if not isinstance(name, str) or not name:
        return f"a model's name must be a non-empty string, got {name!r}"
    if "/" in name:
        return f"a model's name cannot contain '/' (layers are stored as NAME/LAYER), got {name!r}"
    if not _MODEL_NAME.fullmatch(name):
        return (
            "a model's name is letters, digits, '_', '-' and '.', starting with a letter or "
            f"digit, got {name!r}"
        )
    return None
