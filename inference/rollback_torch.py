"""Rolling a transformers cache back to the committed length after a verify pass.

Attention layers are cropped. GatedDeltaNet layers (Qwen3.5 / 3.6) keep a recurrent state and a
conv window that cannot be cropped, so before the verify pass we snapshot both and record each
linear-attention layer's input; after acceptance we restore the snapshot and replay only the
committed steps through that layer (O(accepted), not O(context)). A fully accepted block needs
no replay.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from models.target import TargetModel


class CacheRollback:
    def __init__(self, target: TargetModel):
        self.linear = target.linear_attention_modules()
        self._inputs: dict[int, torch.Tensor] = {}
        self._snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @contextmanager
    def recording(self, cache):
        """Snapshot linear-attention states and record their inputs during the verify pass."""
        if not self.linear:
            yield
            return
        self._snapshots = {}
        for i, _ in self.linear:
            layer = cache.layers[i]
            self._snapshots[i] = (layer.conv_states[0].clone(), layer.recurrent_states[0].clone())
        handles = [m.register_forward_pre_hook(self._recorder(i), with_kwargs=True) for i, m in self.linear]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _recorder(self, idx: int):
        def hook(_module, args, kwargs):
            self._inputs[idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return hook

    def commit(self, cache, keep: int, block_len: int) -> None:
        """Keep the first ``keep`` positions of the block just verified."""
        drop = block_len - keep
        if drop == 0:
            return
        for layer in cache.layers:
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.crop(-drop)
        for i, module in self.linear:
            layer = cache.layers[i]
            conv, rec = self._snapshots[i]
            layer.conv_states[0].copy_(conv)
            layer.recurrent_states[0].copy_(rec)
            module(hidden_states=self._inputs[i][:, :keep], cache_params=cache, attention_mask=None)
        self._inputs.clear()

    @staticmethod
    def check(cache, committed: int) -> None:
        """Every attention layer must hold exactly the committed tokens."""
        for idx, layer in enumerate(cache.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                continue
            n = layer.get_seq_length()
            if n != committed:
                raise AssertionError(f"target cache layer {idx} holds {n} positions, committed length is {committed}")
