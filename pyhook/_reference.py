"""Pure-PyTorch implementations of pyhook's native ops: the specification.

Every native op in ``csrc/`` must give results identical to the function of the same name
here (values, dtype, shape, strides, device, autograd), whichever backend is active.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["clone_tensors"]


def clone_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Return ``[t.clone() for t in tensors]``.

    >>> a, b = torch.ones(2), torch.zeros(3, 4).t()
    >>> [c.stride() for c in clone_tensors([a, b])]
    [(1,), (1, 4)]
    """
    return [t.clone() for t in tensors]
