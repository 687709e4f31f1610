"""Rolling a transformers cache back to the committed length after a verify pass.

Attention layers are cropped. GatedDeltaNet layers (Qwen3.5 / 3.6) keep a recurrent state and a
conv window that cannot be cropped, so before the verify pass we snapshot both and record each
linear-attention layer's input; after acceptance we restore the snapshot and replay only the
committed steps through that layer (O(accepted), not O(context)). A fully accepted block needs
no replay. Sliding-window layers are full layers in ``TargetModel.new_cache`` (cropped like any other);
Gemma 4 E-models' KV-shared layers (``DummyLayer``) hold nothing: they read their store layer's keys, so
rolling that one back rolls them back.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin

from models.target import TargetModel, cache_kwarg


class CacheRollback:
    def __init__(self, target: TargetModel):
        self.linear = target.linear_attention_modules()
        # the keyword the mixers take their cache by (``cache`` from transformers 5.24, ``cache_params`` before)
        self._cache_kw = cache_kwarg(self.linear[0][1], "cache_params") if self.linear else "cache_params"
        self._inputs: dict[int, torch.Tensor] = {}
        self._snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Tokens each GatedDeltaNet layer folded into its state since the snapshot, counted where they
        # enter the module (verify pass, then replay): ``check`` wants exactly the committed ones. The
        # replay's count starts from zero only if the state was written after the verify pass (the
        # restore): seen from the state's (identity, version), not from commit's own bookkeeping.
        self._folded: dict[int, int] = {}
        self._verified: dict[int, list[tuple[int, int]]] = {}
        self._kept: int | None = None
        self._handles: list = []
        self._recording = False

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
        self.close()
        self._folded, self._kept, self._recording = dict.fromkeys(self._snapshots, 0), None, True
        # The hooks stay until commit's replay has run through the modules too.
        self._handles = [m.register_forward_pre_hook(self._recorder(i), with_kwargs=True) for i, m in self.linear]
        try:
            yield
        except BaseException:
            self.close()
            raise
        finally:
            self._recording = False
        self._verified = {i: _written(cache.layers[i]) for i, _ in self.linear}

    def _recorder(self, idx: int):
        def hook(_module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            if self._recording:
                self._inputs[idx] = x
            else:  # the replay: from zero if the state was restored since the verify pass, else on top of it
                cache = kwargs.get(self._cache_kw)
                verified = self._verified.get(idx) or []
                if cache is not None and all(a != b for a, b in zip(_written(cache.layers[idx]), verified)):
                    self._folded[idx] = 0  # both states (conv window, recurrent) written since: restored
            self._folded[idx] += x.shape[1]
        return hook

    def close(self) -> None:
        """Remove the hooks (commit does; the loop calls this too, so an error between the verify pass
        and commit never leaves them on the target's modules)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._inputs.clear()

    def commit(self, cache, keep: int, block_len: int) -> None:
        """Keep the first ``keep`` positions of the block just verified."""
        drop = block_len - keep
        self._kept = keep
        try:
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
                module(hidden_states=self._inputs[i][:, :keep], attention_mask=None, **{self._cache_kw: cache})
        finally:
            self.close()

    def check(self, cache, committed: int) -> None:
        """Every attention layer holds exactly the committed tokens; every GatedDeltaNet state holds its
        snapshot (taken at the previous committed length) plus exactly the ``keep`` committed tokens."""
        for idx, layer in enumerate(cache.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                continue
            if isinstance(layer, DummyLayer):  # Gemma 4 E-models: KV-shared layers hold nothing (their store does)
                continue
            n = layer.get_seq_length()
            if n != committed:
                raise AssertionError(f"target cache layer {idx} holds {n} positions, committed length is {committed}")
        if self._kept is None:
            return
        for idx, n in self._folded.items():
            if n != self._kept:
                raise AssertionError(f"target cache layer {idx} (GatedDeltaNet) folded {n} tokens of the last "
                                     f"block into its state, {self._kept} were committed: its state is not "
                                     "at the committed length")


def _written(layer) -> list[tuple[int, int]]:
    """Which tensors hold a linear-attention layer's states, and how often they were written in place."""
    return [(id(t), t._version) for t in (layer.conv_states[0], layer.recurrent_states[0])]
