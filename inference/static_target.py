"""The target over static (preallocated) buffers: the static-buffer target state of the one cycle.

At batch 1 an eager HF forward is launch-bound on a GPU (an 8B decode step launches ~1,000 small
kernels; the weights stream in ~6 ms but the step took 84 ms on an H100), so the speedup of the
eager loop (``torch_loop.py``) measures the host. Here every per-token pass has a fixed shape:

* K/V live in buffers of ``max_len`` positions per layer; a pass of ``T`` tokens writes its K/V at
  ``start .. start+T-1`` and attends to key slots ``<= its position`` (stale slots past the committed
  length are masked, then overwritten). **Rollback is a length reset**: nothing moves. The HF decoder
  layers themselves run (same weights and math), handed a duck-typed cache.
* GatedDeltaNet layers (Qwen3.5 / 3.6) keep the state after every position of a pass
  (``inference.static_gdn``); the next pass starts from the one after the committed positions, so
  their rollback is an index too.
* on CUDA the two fixed shapes (1-token decode, B-token verify) are captured once as CUDA graphs
  (``GraphedPass``) and replayed; the prefill runs eagerly. Inputs (tokens, start position, lengths)
  are copied into static device buffers before a replay.

``StaticTarget`` is the ``cycle.TargetState`` of the static and compiled loops (``inference.static_loop``);
its drafter twin is ``inference.static_drafter``. Supported targets: Qwen3 (dense/MoE), Llama 3.x,
Qwen3.5 / 3.6 (hybrid, dense/MoE), GLM 4.x MoE. Refused, in one line (``check_static_target``): Qwen3-Next
(its GatedDeltaNet fuses the projections the static pass reads) and latent-attention targets (DeepSeek-V3,
Kimi: their caches hold latents, not per-head K/V), gpt-oss (attention sinks) and Gemma 4 (sliding, KV-shared
layers): ``--loop auto`` runs them on the eager loop.
"""

from __future__ import annotations

from typing import Callable

import torch

from inference.grouped_attention import GROUPED_SDPA
from inference.static_gdn import StaticGatedDeltaNet
from models.attention import attention_implementation
from models.target import TargetModel, allow_recompiles, cache_kwarg
from models.target_folder import MLA_STATIC, family_facts


class StaticLoopUnsupported(ValueError):
    pass


def weight_places(module: torch.nn.Module) -> list[tuple]:
    """Where each parameter's data lives. A cast, a move or a load into new tensors changes it; an
    in-place update (an optimizer step, ``load_state_dict``) does not."""
    return [(p.data_ptr(), p.dtype, p.device) for p in module.parameters()]


def check_weights_unchanged(module: torch.nn.Module, places: list[tuple], what: str) -> None:
    """Refuse a pass over weights replaced since the static loop was built: its fused projections and
    captured CUDA graphs still read the old tensors (stale values, or freed memory once reused)."""
    if weight_places(module) != places:
        raise RuntimeError(f"the {what}'s weights were replaced (cast, moved or loaded into new tensors) after its "
                           "static loop was built, whose fused projections and captured passes still read the old "
                           f"ones: build the static loop again (build_static_loop) after changing the {what}")


class GraphedPass:
    """One function of static buffers, captured as a CUDA graph on first use (eager elsewhere).

    ``mutable``: buffers the function reads *and* rewrites (GatedDeltaNet windows and states: a pass
    starts from the committed state and overwrites it). The warm-up runs before the capture must not
    advance them, or the first replay starts from a state two passes ahead.
    """

    def __init__(self, fn: Callable[[], object], use_graph: bool, mutable: list[torch.Tensor] = ()):
        self.fn, self.use_graph, self.mutable = fn, use_graph, list(mutable)
        self.graph, self.out = None, None

    def warm_up(self) -> None:
        """Two untimed runs (cuBLAS handles, lazy inits, compiled kernels) that leave the state as it was.
        K/V buffers need nothing: the runs write the same K/V the replay writes (inputs are in place)."""
        saved = [t.clone() for t in self.mutable]
        for _ in range(2):
            self.fn()
            for t, before in zip(self.mutable, saved):
                t.copy_(before)

    def __call__(self):
        if not self.use_graph:
            return self.fn()
        if self.graph is None:
            side = torch.cuda.Stream()  # warm-up on a side stream, as CUDA graph capture asks
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.warm_up()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records, runs nothing: the replay below is the one run
                self.out = self.fn()
        self.graph.replay()
        return self.out


class _StaticKV:
    """Duck-typed HF cache: ``update`` writes the new K/V at ``index`` and returns the whole buffers."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.index: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.index, key_states.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(2, self.index, value_states.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]


# What a GatedDeltaNet module must have for ``StaticGatedDeltaNet`` (Qwen3.5 / 3.6's layout).
STATIC_GDN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
                    "out_proj", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim",
                    "conv_dim", "conv_kernel_size")


def check_static_target(target: TargetModel) -> None:
    """Refuse, in one line, a target the static loop cannot run exactly: a family it does not run (Qwen3-Next's
    fused GatedDeltaNet projections, latent attention), sliding or other layer kinds, GatedDeltaNet modules
    without Qwen3.5's parts, a latent-attention config, or an attention implementation that ignores its mask.
    The family table says it first; the checks on the layers and the config hold for a family not yet in it."""
    refusal = family_facts(getattr(target, "family", "")).static_loop
    if refusal not in ("auto", "asked"):
        raise StaticLoopUnsupported(f"the static-cache/CUDA-graph loop cannot run {target.model_type}: {refusal}; "
                                    "use the eager loop (--loop eager)")
    kinds = set(target.layer_types) - {"full_attention", "linear_attention"}
    if kinds:
        raise StaticLoopUnsupported(
            f"the static-cache/CUDA-graph loop supports full-attention and Qwen3.5 GatedDeltaNet layers; "
            f"{target.model_type} has layer types {sorted(set(target.layer_types))}: use the eager loop "
            "(inference.torch_loop.dflash_generate)")
    layers = getattr(target, "layers", None)  # (stand-ins of tests have none)
    mixers = [getattr(layers[i], "linear_attn", None) for i, kind in enumerate(target.layer_types)
              if kind == "linear_attention"] if layers is not None else []
    other = sorted({type(m).__name__ for m in mixers if m is None or not all(hasattr(m, p) for p in STATIC_GDN_PARTS)})
    if other:
        raise StaticLoopUnsupported(
            f"the static-cache/CUDA-graph loop supports full-attention and Qwen3.5 GatedDeltaNet layers "
            f"(in_proj_qkv/z/b/a); {target.model_type}'s linear-attention layers are {', '.join(other)}: use the "
            "eager loop (--loop eager)")
    if getattr(getattr(target, "config", None), "kv_lora_rank", None):
        raise StaticLoopUnsupported(f"the static-cache/CUDA-graph loop cannot run {target.model_type}: {MLA_STATIC}; "
                                    "use the eager loop (--loop eager)")
    attn = getattr(target.model.config, "_attn_implementation", "sdpa")
    if attn not in ("sdpa", "eager"):  # the static mask (stale slots past the committed length) must be applied
        raise StaticLoopUnsupported(f"the static loop needs attn_implementation 'sdpa' or 'eager' (it masks the "
                                    f"unused cache slots); this target was loaded with {attn!r}")


class StaticTarget:
    """The target over preallocated K/V buffers; ``forward`` passes of 1 and ``block_size`` tokens are graphed."""

    def __init__(self, target: TargetModel, layer_ids: list[int], max_len: int, block_size: int,
                 graphs: bool | None = None, compile: bool = False):
        check_static_target(target)
        self.target, self.layer_ids, self.max_len = target, list(layer_ids), max_len
        cfg, dev, dt = target.config, target.device, target.dtype
        kv_heads = cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attention = [i for i, kind in enumerate(target.layer_types) if kind == "full_attention"]
        bufs = lambda: {i: torch.zeros(1, kv_heads, max_len, head_dim, device=dev, dtype=dt)  # noqa: E731
                        for i in attention}
        self.kv = _StaticKV(bufs(), bufs())
        self._cache_kwarg = cache_kwarg(target.layers[attention[0]]) if attention else "past_key_values"
        self.gdn = {i: StaticGatedDeltaNet(m, i, block_size) for i, m in target.linear_attention_modules()}
        self.block_size = block_size
        self._keep = torch.ones(1, dtype=torch.long, device=dev)  # positions of the last pass now committed
        self._last_start, self._last_len = -1, 1  # the last pass's recorded states: positions start .. start+len-1
        self.graphs = (dev.type == "cuda") if graphs is None else graphs
        self._additive_mask = getattr(target.model.config, "_attn_implementation", "sdpa") == "eager"
        # The 1-token and B-token passes attend over the whole buffer with a mask, so HF's SDPA would write
        # and read `heads / kv_heads` copies of every layer's K/V per pass (a cost that grows with the
        # context); they run attend_grouped instead. The prefill keeps HF's: its query is long.
        self._attn_configs = list({id(la.self_attn.config): la.self_attn.config for la in target.layers
                                   if hasattr(la, "self_attn")}.values())
        self._start = torch.zeros(1, dtype=torch.long, device=dev)
        self._key_pos = torch.arange(max_len, device=dev)
        self._ids = {t: torch.zeros(1, t, dtype=torch.long, device=dev) for t in {1, block_size}}
        self._verified: torch.Tensor | None = None  # the last verify pass's features (a graph buffer)
        self._places = weight_places(target.model)
        # One private memory pool per graph: a shared pool lets one graph's temporaries overlap the
        # other's outputs, which is only safe when replays keep the capture order.
        # compile: each decoder layer through torch.compile for the graphed passes (a captured eager
        # layer still runs ~40 small kernels: norms, rotary, SiLU gate; compiled, they fuse). The
        # prefill keeps the plain layers: its length changes with every prompt.
        layers = list(target.layers)
        if compile:
            # HF layers specialise on their layer index (the cache update): one compile per layer and
            # pass length.
            allow_recompiles(2 * len(layers) + 8)
            layers = [torch.compile(la, dynamic=False) for la in layers]
        # GatedDeltaNet passes: compiled, the token-by-token recurrence fuses into a few kernels per step.
        steps = {i: torch.compile(g.forward, dynamic=False) if compile else g.forward for i, g in self.gdn.items()}
        self.graph_layers, self.graph_steps = layers, steps  # what the fixed-shape passes run (static_loop too)
        self.gdn_buffers = [buf for g in self.gdn.values() for buf in (g.window, g.states)]
        self._passes = {t: GraphedPass(lambda t=t: self._pass(self._ids[t], layers, steps), self.graphs,
                                    self.gdn_buffers)
                        for t in self._ids}

    def _pass(self, ids: torch.Tensor, layers=None, steps=None) -> tuple[torch.Tensor, torch.Tensor]:
        dec, T = self.target.decoder, ids.shape[1]
        pos = self._start + torch.arange(T, device=ids.device)  # [T]
        self.kv.index = pos
        mask = (self._key_pos[None, :] <= pos[:, None])[None, None]  # [1, 1, T, max_len]: causal over the slots
        h = dec.embed_tokens(ids)
        if self._additive_mask:  # HF's eager attention adds its mask to the scores
            mask = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill(~mask, torch.finfo(h.dtype).min)
        rope = self.target.rope(h, pos)
        captured = {}
        prefill = self.target.new_cache() if self.gdn and T > self.block_size else None  # a long prompt
        grouped = None if self._additive_mask or T > self.block_size else GROUPED_SDPA
        with attention_implementation(self._attn_configs, grouped):
            h = self._layers(h, mask, pos, rope, layers, steps, prefill, captured)
        logits = self.target.lm_head(self.target.decoder.norm(h))
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1), logits

    def _layers(self, h, mask, pos, rope, layers, steps, prefill, captured: dict) -> torch.Tensor:
        taps = set(self.layer_ids)
        for i, layer in enumerate(layers or self.target.layers):
            if i in self.gdn:  # the decoder layer's own order: mixer, then MLP, each with its residual
                base = self.target.layers[i]
                x = base.input_layernorm(h)
                step = steps[i] if steps else self.gdn[i].forward
                h = h + (self.gdn[i].prefill(x, prefill) if prefill is not None else step(x, self._keep))
                h = h + base.mlp(base.post_attention_layernorm(h))
                if i in taps:
                    captured[i] = h
                continue
            h = layer(h, attention_mask=mask, position_ids=pos[None], use_cache=True, cache_position=pos,
                      position_embeddings=rope, **{self._cache_kwarg: self.kv})
            h = h[0] if isinstance(h, tuple) else h
            if i in taps:
                captured[i] = h
        return h

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features [1, T, taps*H], logits [1, T, V])`` of tokens at positions ``start .. start+T-1``.

        Graphed outputs are static buffers: read them before the next pass of the same length.
        """
        T = ids.shape[1]
        if start + T > self.max_len:
            raise ValueError(f"static cache holds {self.max_len} positions; a pass to {start + T} does not fit: "
                             "raise max_len (prompt + max_new_tokens + block size)")
        if start == 0:  # a new sequence: once per generation, not per pass
            check_weights_unchanged(self.target.model, self._places, "target")
        self._start.fill_(start)
        if self.gdn:
            self._commit(start, T)
        if T in self._passes:
            self._ids[T].copy_(ids)
            return self._passes[T]()
        return self._pass(ids)  # the prefill: any length, eager

    def graphed_pass(self, T: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The fixed-shape pass of ``T`` tokens (1 or the block size) as the loop replays it, on the
        inputs already in its buffers: for profiling (``inference.bench --profile``)."""
        return self._passes[T]

    # ------------------------------------------------------------ the cycle's target state (cycle.TargetState)
    rollback_part = "host"  # the rollback is a length reset: host bookkeeping, timed with it

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def cache(self) -> _StaticKV:
        return self.kv

    def prefill(self, prompt_ids: list[int], layer_ids: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A new sequence from position 0 (the buffers and states start over; the weights are checked)."""
        if layer_ids and list(layer_ids) != self.layer_ids:
            raise ValueError(f"the proposer reads target layers {list(layer_ids)}, the static target taps "
                             f"{self.layer_ids}: build the static loop for this drafter")
        feats, logits = self.forward(torch.tensor([prompt_ids], device=self.device), 0)
        if not layer_ids:
            return None, logits[0, -1]
        # A prompt of 1 or B tokens ran a graphed pass, whose output buffer the next pass of that length reuses.
        return (feats.clone() if len(prompt_ids) in self._passes else feats), logits[0, -1]

    def verify(self, block: torch.Tensor, start: int) -> torch.Tensor:
        self._verified, logits = self.forward(block, start)
        return logits[0]

    def commit(self, keep: int) -> None:
        """Nothing moves: the next pass starts at the committed length, masks the slots past it and overwrites
        them; GatedDeltaNet layers start from the state after the kept positions (``_commit``, by index)."""

    def features(self, keep: int) -> torch.Tensor:
        return self._verified[:, :keep].clone()  # the graph's output buffer is reused by the next pass

    def check(self, committed: int) -> None:
        """No per-cycle measurement: no buffer was cut (a length reset), a GatedDeltaNet pass that would start
        outside the kept states is refused by ``advance``, and reading the device would cost a sync. The
        static loops are held to the eager loop's tokens and acceptance lengths instead (tests)."""

    def close(self) -> None:
        pass

    def _commit(self, start: int, T: int) -> None:
        """GatedDeltaNet rollback: the last pass's positions before ``start`` are the committed ones."""
        if start == 0:  # a new sequence: the zero state (committed window and state slot 0 cleared)
            for g in self.gdn.values():
                g.window.zero_()
                g.states[0].zero_()
            self._last_start, self._last_len = -1, 1
        self._keep.fill_(self.advance(start, T))

    def advance(self, start: int, T: int) -> int:
        """The host's record of a pass of ``T`` tokens at ``start``: how many positions of the last pass it
        commits (checked), and which positions this pass's states will be kept for. ``static_loop``'s
        device-resident cycles set the device's count themselves and call only this."""
        keep = start - self._last_start
        if not 1 <= keep <= self._last_len:
            kept = (f"kept for positions {self._last_start} to {self._last_start + self._last_len - 1}"
                    if self._last_start >= 0 else "no state kept yet: a sequence's first pass starts at 0")
            raise RuntimeError(f"GatedDeltaNet states: {kept}; a pass cannot start at {start}")
        # A pass longer than a block (the prompt) keeps only its final state, as if it had started at its end.
        self._last_start, self._last_len = (start, T) if T <= self.block_size else (start + T - 1, 1)
        return keep


