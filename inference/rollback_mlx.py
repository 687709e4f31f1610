"""Rolling an mlx_lm cache back to the committed length after a verify pass (twin of ``rollback_torch.py``).

Attention caches are trimmed one by one (``KVCache.trim``). We do not use ``trim_prompt_cache``:
it trims nothing, silently, as soon as one cache reports itself untrimmable (a full
``RotatingKVCache``). A rotating cache after a multi-token update holds its window plus the new
block in temporal order, so trimming it means dropping the tail of its buffer, which we do
explicitly. GatedDeltaNet layers (Qwen3.5 / 3.6) keep a conv window and a recurrent state that
cannot be trimmed: before the verify pass we keep references to both (MLX arrays are immutable,
so a snapshot costs nothing) and record each linear layer's input; after acceptance we restore
the snapshot and replay only the committed steps through that layer's ``linear_attn``
(O(accepted), not O(context)). A fully accepted block needs no replay.

``check`` asserts after every cycle that every attention cache holds exactly the committed length.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from models.target_mlx import TargetModel, UnsupportedTarget


class CacheRollback:
    def __init__(self, target: TargetModel):
        self.target = target
        self.linear = target.linear_attention_layers()
        self._inputs: dict[int, mx.array] = {}
        self._snapshots: dict[int, list] = {}

    @contextmanager
    def recording(self, cache: list):
        """Snapshot linear-attention states and record their inputs during the verify pass."""
        if not self.linear:
            yield
            return
        self._snapshots = {i: list(cache[i].cache) for i, _ in self.linear}
        with self.target.capture(record_inputs=[i for i, _ in self.linear]) as cap:
            yield
        self._inputs = cap.inputs

    def commit(self, cache: list, keep: int, block_len: int) -> None:
        """Keep the first ``keep`` positions of the block just verified."""
        drop = block_len - keep
        if drop == 0:
            self._inputs.clear()
            return
        for c in cache:
            if isinstance(c, RotatingKVCache):
                trim_rotating(c, drop)
            elif isinstance(c, ArraysCache):
                continue
            elif c.is_trimmable():
                c.trim(drop)
            else:
                raise UnsupportedTarget(f"cannot roll back a {type(c).__name__} cache: draftsmith's MLX loop "
                                        "supports KVCache, RotatingKVCache and GatedDeltaNet (ArraysCache) caches; "
                                        "load the target without a quantized or custom KV cache")
        for i, layer in self.linear:
            state = cache[i]
            state.cache = list(self._snapshots[i])
            x = self._inputs[i][:, :keep]
            layer.linear_attn(layer.input_layernorm(x), None, state)
        self._inputs.clear()

    @staticmethod
    def check(cache: list, committed: int) -> None:
        """Every attention cache must hold exactly the committed tokens (rotating: a consistent window)."""
        for idx, c in enumerate(cache):
            if isinstance(c, ArraysCache):
                if c.cache[0] is None or c.cache[1] is None:
                    raise AssertionError(f"target cache layer {idx} (GatedDeltaNet) has no state after a cycle")
                continue
            n = c.offset
            if n != committed:
                raise AssertionError(f"target cache layer {idx} holds {n} positions, committed length is {committed}")
            if isinstance(c, RotatingKVCache):
                held = 0 if c.keys is None else c.keys.shape[2]
                if c._idx != held or held < min(committed, c.max_size - 1):
                    raise AssertionError(
                        f"rotating cache layer {idx}: buffer holds {held} rows, write index {c._idx}, window "
                        f"{c.max_size}, committed {committed}: the trim left stale positions behind")
            elif isinstance(c, KVCache) and c.keys is not None and c.keys.shape[2] < committed:
                raise AssertionError(f"target cache layer {idx} buffer has {c.keys.shape[2]} rows "
                                     f"< committed {committed}")


def trim_rotating(c: RotatingKVCache, n: int) -> None:
    """Drop the newest ``n`` positions of a rotating cache that was just updated with a multi-token block.

    mlx_lm's ``RotatingKVCache.trim`` only moves the offsets, and refuses (``is_trimmable`` False)
    once the window is full; its next update would then treat the dropped rows as the oldest ones.
    After a multi-token update the buffer is in temporal order (window + block), so cutting its
    tail is exact.
    """
    if c.keys is None or n == 0:
        return
    if c._idx != c.keys.shape[2]:
        raise AssertionError("rotating cache is not in temporal order: roll back only right after a "
                             "multi-token (verify) update")
    c.keys = c.keys[..., : c._idx - n, :]
    c.values = c.values[..., : c._idx - n, :]
    c.offset -= n
    c._idx -= n
