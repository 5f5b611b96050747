"""The SAELens recipe of docs/training.md against SAELens itself (skipped where it is not
installed: it brings its own dependency set, so CI checks the layout in test_dataset.py and this
file runs in an environment with ``pip install sae-lens``, e.g. a throwaway venv)."""

from __future__ import annotations

import pytest
import torch

from pyhook.dataset import to_hf_dataset
from pyhook.store import ShardWriter

sae_lens = pytest.importorskip("sae_lens")


def test_saelens_activations_store_reads_the_export(tmp_path):
    from sae_lens.training.activations_store import ActivationsStore

    T, D, contexts, per_batch = 8, 6, 10, 2
    acts = torch.randn(contexts * T, D)
    ids = torch.randint(0, 1000, (contexts * T,))
    out = str(tmp_path / "cap")
    with ShardWriter(out, shard_bytes=1) as w:
        for c in range(0, contexts, 5):
            rows = slice(c * T, (c + 5) * T)
            w.add({"h.0": acts[rows], "__token_ids__": ids[rows]}, examples=5)
    hook = "blocks.0.hook_resid_pre"
    cached = str(tmp_path / "cached")
    to_hf_dataset(out, "h.0", context_size=T, columns={"h.0": hook}).save_to_disk(cached)

    store = ActivationsStore(
        model=None,
        dataset=None,
        streaming=False,
        hook_name=hook,
        hook_head_index=None,
        context_size=T,
        d_in=D,
        n_batches_in_buffer=2,
        total_training_tokens=contexts * T,
        store_batch_size_prompts=per_batch,
        train_batch_size_tokens=per_batch * T,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=cached,
    )
    for step in range(contexts // per_batch):
        got, got_ids = store.get_raw_llm_batch()
        rows = slice(step * per_batch * T, (step + 1) * per_batch * T)
        assert torch.equal(got, acts[rows])
        assert torch.equal(got_ids.long(), ids[rows])
