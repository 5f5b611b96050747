"""glibc's heap thresholds set when a capture starts (pyhook/_malloc.py): measured by their
effect in a fresh process. A block of 16 MiB freed raises glibc's dynamic trim threshold to
32 MiB (what a forward's temporaries do); 80 MiB of 2 MiB blocks then freed at the heap's top are
given back to the kernel, and faulted in again when allocated anew, unless the thresholds are
pyhook's (the heap keeps them: no faults). Opt-out and the user's own glibc settings are left
alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = r"""
import ctypes, resource, sys
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def cycle():
    blocks = [libc.malloc(2 << 20) for _ in range(40)]  # 80 MiB from the heap
    for p in blocks:
        ctypes.memset(p, 1, 2 << 20)
    for p in reversed(blocks):
        libc.free(p)

import torch, pyhook
net = torch.nn.Sequential(torch.nn.Linear(4, 4))
with pyhook.capture(net, "0") as rec:  # a capture starts: pyhook's thresholds, unless left alone
    net(torch.randn(2, 4))
p = libc.malloc(16 << 20)  # a freed mapped block raises glibc's dynamic thresholds (16/32 MiB)
ctypes.memset(p, 1, 16 << 20)
libc.free(p)
cycle()
before = faults()
cycle()
cycle()
print(faults() - before)
print(pyhook.info()["malloc"])
"""

_PAGES = 2 * (80 << 20) // 4096  # two cycles of 80 MiB, all faulted in again


def _run(env: dict[str, str]) -> tuple[int, str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYHOOK_MALLOC", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")
    }
    out = subprocess.run(
        [sys.executable, "-I", "-c", _PROBE],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    return int(out[-2]), out[-1]


@pytest.fixture(scope="module", autouse=True)
def _glibc_only():
    import ctypes

    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        pytest.skip("glibc only")


def test_capture_keeps_the_heap_between_forwards():
    faults, line = _run({})
    assert faults < _PAGES // 20, faults  # the heap kept its top: (almost) nothing faulted
    assert "set by pyhook" in line and "256 MiB" in line


def test_opt_out_leaves_glibc_trimming():
    faults, line = _run({"PYHOOK_MALLOC": "0"})
    assert faults > _PAGES // 2, faults  # glibc's own rule: the top given back, faulted again
    assert "left alone" in line and "PYHOOK_MALLOC=0" in line


def test_users_own_glibc_settings_win():
    # the user's trim threshold (1 MiB) holds: pyhook does not replace it
    faults, line = _run({"MALLOC_TRIM_THRESHOLD_": str(1 << 20)})
    assert faults > _PAGES // 2, faults
    assert "MALLOC_TRIM_THRESHOLD_ is set" in line


def test_bad_switch_value_is_refused_naming_it(monkeypatch):
    import torch

    import pyhook
    from pyhook import _malloc

    monkeypatch.setenv("PYHOOK_MALLOC", "yes")
    monkeypatch.setattr(_malloc, "state", None)
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with (
        pytest.raises(ValueError, match="PYHOOK_MALLOC must be auto or 0"),
        pyhook.capture(net, "0"),
    ):
        pass
    for m in net.modules():  # nothing left registered
        assert not m._forward_hooks and not m._forward_pre_hooks
