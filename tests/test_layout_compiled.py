"""Hooks on compiled models whose modules have a forward patched in (transformers' tensor-parallel
styles, accelerate's hooks): code dynamo compiled for one such module without pyhook's
dispatcher must not serve another of the same class that has one. Single process, eager backend.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyhook

pytest.importorskip("torch._dynamo")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x


def _patch_forward(m: nn.Module) -> None:
    """A forward patched into the instance as a closure, as accelerate and transformers do."""
    orig = m.forward

    def forward(*args, **kwargs):
        return orig(*args, **kwargs)

    m.forward = forward


def test_a_hook_on_one_of_several_patched_modules_runs_after_a_graph_break():
    torch.manual_seed(0)
    net = nn.Sequential(Block(), Block(), Block())
    for block in net:
        _patch_forward(block.lin)
    x = torch.randn(2, 4)
    compiled = torch.compile(net, backend="eager")
    compiled(x)
    # retain_grad keeps the eager hook (graph breaks): the blocks compile as frames of their own
    with pyhook.Trace(compiled, "2.lin", retain_grad=True) as t:
        compiled(x).sum().backward()
    assert "output" in t.__dict__, "the hook on 2.lin never ran"
    h = net[1](net[0](x)).detach().requires_grad_()
    out = net[2].lin(h)
    want = torch.autograd.grad((torch.relu(out) + h).sum(), out)[0]
    torch.testing.assert_close(t.output, out)
    torch.testing.assert_close(t.output.grad, want)
    pyhook.release_compiled(compiled)
    assert isinstance(net[2].lin.__dict__["forward"], type(_patch_forward))  # restored
