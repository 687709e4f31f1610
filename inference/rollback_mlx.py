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

``check`` asserts after every cycle that every cache holds exactly the committed length (GatedDeltaNet:
the verified state when the whole block is kept, else the snapshot + a replay of the kept tokens).
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
        # What ``check`` compares a GatedDeltaNet state with (MLX arrays are immutable, so identity says
        # which state a cache holds): the arrays after the verify pass, and the tokens replayed since.
        self._verified: dict[int, list] = {}
        self._replayed: dict[int, int] = {}
        self._kept: tuple[int, int] | None = None

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
        self._verified = {i: list(cache[i].cache) for i, _ in self.linear}
        self._replayed, self._kept = {}, None

    def commit(self, cache: list, keep: int, block_len: int) -> None:
        """Keep the first ``keep`` positions of the block just verified."""
        drop = block_len - keep
        self._kept = (keep, block_len)
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
            self._replayed[i] = x.shape[1]
        self._inputs.clear()

    def check(self, cache: list, committed: int) -> None:
        """Every attention cache must hold exactly the committed tokens (rotating: a consistent window);
        every GatedDeltaNet state is the verified one (whole block kept) or the snapshot + a replay of
        exactly the kept tokens."""
        for idx, c in enumerate(cache):
            if isinstance(c, ArraysCache):
                if c.cache[0] is None or c.cache[1] is None:
                    raise AssertionError(f"target cache layer {idx} (GatedDeltaNet) has no state after a cycle")
                self._check_state(idx, c)
                continue
            n = c.offset
            if n != committed:
                raise AssertionError(f"target cache layer {idx} holds {n} positions, committed length is {committed}")
            if isinstance(c, RotatingKVCache) and self._kept != (1, 1):  # a one-token pass (the baseline's)
                # writes a rotating buffer in place, as mlx_lm decodes: no temporal order to check, nothing trimmed
                held = 0 if c.keys is None else c.keys.shape[2]
                if c._idx != held or held < min(committed, c.max_size - 1):
                    raise AssertionError(
                        f"rotating cache layer {idx}: buffer holds {held} rows, write index {c._idx}, window "
                        f"{c.max_size}, committed {committed}: the trim left stale positions behind")
            elif isinstance(c, KVCache) and c.keys is not None and c.keys.shape[2] < committed:
                raise AssertionError(f"target cache layer {idx} buffer has {c.keys.shape[2]} rows "
                                     f"< committed {committed}")


    def _check_state(self, idx: int, c: ArraysCache) -> None:
        if self._kept is None or idx not in self._verified:
            return
        keep, block_len = self._kept
        verified = any(a is b for a, b in zip(c.cache, self._verified[idx]))
        snapshot = any(a is b for a, b in zip(c.cache, self._snapshots[idx]))
        ok = verified if keep == block_len else not verified and not snapshot and self._replayed.get(idx) == keep
        if not ok:
            where = ("the verified block's state" if verified else "the snapshot, not replayed" if snapshot else
                     f"a replay of {self._replayed.get(idx)} tokens")
            raise AssertionError(f"target cache layer {idx} (GatedDeltaNet) holds {where}; {keep} of the "
                                 f"{block_len} verified tokens were committed: its state is not at the "
                                 "committed length")


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
