"""The training step never reads a device value back to the host.

On a GPU such a read (``.item()``, ``if tensor``, a boolean selection, ``nonzero``) waits for every kernel
queued before it, and the GPU then idles while the host queues the next ones: each one is a bubble in
the step. On the CPU the same operations go through the dispatcher, so a dispatch mode that records them
shows where a GPU would wait. Host-side counts read host copies through numpy (which refuses a GPU
tensor) or plain ints, so they do not show here either. tests/test_cuda.py runs the same step under
CUDA's own sync detector.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from tests.helpers.tiny_run import FAST, run, tiny_input_dirs

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
         aten.is_nonzero.default, aten.equal.default}
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class HostReads(TorchDispatchMode):
    """Records each operation that reads tensor data back to the host, with where it was called from."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        read = func in READS or (func in INDEXING and any(  # a boolean index is a nonzero underneath
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]))
        if read:
            where = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.line}" for f in traceback.extract_stack()[:-1]
                     if "_python_dispatch" not in f.filename and "test_host_reads" not in f.filename]
            self.reads.append(f"{func}: " + " <- ".join(reversed(where[-3:])))
        return func(*args, **(kwargs or {}))


def test_the_recorder_sees_what_a_gpu_waits_for():
    x = torch.arange(6.0)
    with HostReads() as r:
        x.sum().item()
        _ = x[x > 2]
        _ = (x > 2).nonzero()
        bool(x.any())
        x[x > 4] = 0.0
    assert len(r.reads) == 5, r.reads
    with HostReads() as r:  # gathers and scatters by index, sums, products: queued, nothing read
        idx = torch.tensor([1, 3])
        x.index_select(0, idx), x[idx], torch.zeros(6).scatter(0, idx, x[:2]), (x * (x > 2)).sum()
    assert r.reads == []


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "llama", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl"])
def test_unpadded_target_forward_reads_nothing_and_equals_hf_masks(arch, monkeypatch):
    """HF's mask builders read the GPU to find there is nothing to mask; the mask-free call skips them
    and gives the very same taps and logits."""
    import models.target
    from models.target import TargetModel
    from models.tiny import tiny_target

    target = TargetModel(tiny_target(arch))
    ids = torch.randint(0, 250, (2, 23), generator=torch.Generator().manual_seed(0))
    with HostReads() as fast:
        ours = target.forward(ids, [1, 3, 5])
    monkeypatch.setattr(models.target, "mask_free", lambda *a: False)
    with HostReads() as hf:
        theirs = target.forward(ids, [1, 3, 5])
    assert fast.reads == [] and hf.reads, (fast.reads, hf.reads)
    assert torch.equal(ours.features, theirs.features) and torch.equal(ours.logits, theirs.logits)
    assert all(c._attn_implementation == "sdpa" for c in target._attention_configs)  # switched back
    target.forward(ids, [1], with_logits=False)  # stops after the deepest tap by raising inside the switch
    assert all(c._attn_implementation == "sdpa" for c in target._attention_configs)


def test_masks_are_built_where_they_are_needed():
    """Padding, a cache, eager attention or sliding-window layers keep HF's mask builders."""
    from models.attention import mask_free
    from models.target import TargetModel
    from models.tiny import tiny_target

    target = TargetModel(tiny_target("qwen3"))
    configs = target._attention_configs
    assert mask_free(configs, target.layer_types)
    assert not mask_free(configs, ["full_attention", "sliding_attention"])
    target.model.config._attn_implementation = "eager"
    assert not mask_free(configs, target.layer_types)
    target.model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(1))
    pad = torch.ones_like(ids)
    pad[1, 6:] = 0
    with HostReads() as r:
        target.forward(ids, [1], attention_mask=pad)
    assert r.reads  # HF's padding mask, built as before


@pytest.mark.parametrize("loss", ["ce", "ce+kl", "dpace", "dflash2"])
def test_a_training_step_reads_nothing_back(loss, tmp_path, tmp_path_factory, monkeypatch):
    """Every micro-batch of an online step (target forward, drafter, loss, backward, acceptance counts) and
    the gradient clip; the optimizer runs outside the recorder (CPU AdamW reads its step count, the fused
    CUDA one does not). ``dpace``: D-PACE normalised by its weight sum, known only after the last forward (the
    gradients are rescaled on the device). ``dflash2``: the selector term (top-K in each LM-head chunk, label
    injection, teacher-forced CE and its backward) and the selector walk of the step's acceptance counts."""
    import train.loop

    d = tiny_input_dirs(tmp_path_factory)
    real, seen = train.loop.train_step, []

    def recorded(run_, model, optimizer, *args, **kwargs):
        step = optimizer.step

        def outside(*a, **kw):
            with _disable_current_modes():
                return step(*a, **kw)
        optimizer.step = outside
        try:
            with HostReads() as r:
                stats = real(run_, model, optimizer, *args, **kwargs)
        finally:
            optimizer.step = step
        seen.append(r.reads)
        return stats

    monkeypatch.setattr(train.loop, "train_step", recorded)
    run(tmp_path / "run", f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "train.max_steps=2",
        "train.grad_accum=2", "train.batch_size=2", "train.anchors=8", "eval.batches=1",
        *{"dpace": ["train.loss_weighting=dpace", "train.ce_chunk=16"],
          "dflash2": ["drafter.variant=dflash2", "train.loss_weighting=dpace", "train.ce_chunk=16"]}.get(
            loss, [f"train.loss={loss}"]))
    assert seen == [[], []]


def test_to_device_off_the_gpu_is_a_plain_move():
    """Pinned staging is for a GPU destination only; elsewhere the tensor moves (or stays) as ``.to`` does."""
    from models.support import to_device

    x = torch.arange(4)
    assert to_device(x, "cpu") is x
    moved = to_device(x, "meta")
    assert moved.device.type == "meta" and moved.shape == x.shape
