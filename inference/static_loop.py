"""The DFlash loop on static (preallocated) caches, with CUDA graphs for the fixed-shape passes.

At batch 1 an eager HF forward is launch-bound on a GPU (an 8B decode step launches ~1,000 small
kernels; the weights stream in ~6 ms but the step took 84 ms on an H100), so the speedup of the
eager loop (``torch_loop.py``) measures the host. Here every per-token pass has a fixed shape:

* target: K/V live in buffers of ``max_len`` positions per layer; a pass of ``T`` tokens writes its
  K/V at ``start .. start+T-1`` and attends to key slots ``<= its position`` (stale slots past the
  committed length are masked, then overwritten). **Rollback is a length reset**: nothing moves.
  The HF decoder layers themselves run (same weights and math), handed a duck-typed cache.
* drafter: committed-context K/V in buffers too; each block pass takes a fixed ``B`` new-context
  slots (``c <= B`` real, the rest masked and overwritten by the next cycle).
* on CUDA the three fixed shapes (target 1-token decode, B-token verify, drafter block pass) are
  captured once as CUDA graphs and replayed; the prefill runs eagerly. Inputs (tokens, start
  position, lengths) are copied into static device buffers before a replay.
* at temperature 0 the whole cycle (verify, acceptance, next draft) runs as one function on the
  device, one graph on CUDA, with one read per cycle (``inference.static_greedy``); sampling and
  the per-part timing keep the two graphed passes with the host between them.

* GatedDeltaNet layers (Qwen3.5 / 3.6) keep the state after every position of a pass
  (``inference.static_gdn``); the next pass starts from the one after the committed positions, so
  their rollback is an index too.

The eager loop stays the reference: CPU tests check that this loop (graphs off) gives the same
tokens and acceptance lengths, and ``tests/test_cuda.py`` checks graph replay against eager.
Supported targets: Qwen3 (dense/MoE), Llama 3.x, Qwen3.5 / 3.6 (hybrid, dense/MoE).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from inference.grouped_attention import GROUPED_SDPA, attend_grouped
from inference.static_gdn import StaticGatedDeltaNet
from inference.stats import GenerationResult, commit_tokens, resolve_block_size, warn_if_mask_is_emitted
from inference.torch_loop import Clock, check_draft_cache, draft_block, sample
from models.attention import attention_implementation
from models.drafter import DFlashDraftModel, apply_rope, rope_cos_sin
from models.target import TargetModel, allow_recompiles, cache_kwarg


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


class _Graphed:
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


def check_static_target(target: TargetModel) -> None:
    kinds = set(target.layer_types) - {"full_attention", "linear_attention"}
    if kinds or (target.is_hybrid and target.family != "qwen3_5"):
        raise StaticLoopUnsupported(
            f"the static-cache/CUDA-graph loop supports full-attention and Qwen3.5 GatedDeltaNet layers; "
            f"{target.model_type} has layer types {sorted(set(target.layer_types))}: use the eager loop "
            "(inference.torch_loop.dflash_generate)")
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
        self.graph_layers, self.graph_steps = layers, steps  # what the fixed-shape passes run (static_greedy too)
        self.gdn_buffers = [buf for g in self.gdn.values() for buf in (g.window, g.states)]
        self._passes = {t: _Graphed(lambda t=t: self._pass(self._ids[t], layers, steps), self.graphs,
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
        commits (checked), and which positions this pass's states will be kept for. ``static_greedy``'s
        cycles set the device's count themselves and call only this."""
        keep = start - self._last_start
        if not 1 <= keep <= self._last_len:
            kept = (f"kept for positions {self._last_start} to {self._last_start + self._last_len - 1}"
                    if self._last_start >= 0 else "no state kept yet: a sequence's first pass starts at 0")
            raise RuntimeError(f"GatedDeltaNet states: {kept}; a pass cannot start at {start}")
        # A pass longer than a block (the prompt) keeps only its final state, as if it had started at its end.
        self._last_start, self._last_len = (start, T) if T <= self.block_size else (start + T - 1, 1)
        return keep


class StaticDrafterProposer:
    """The drafter over a preallocated committed-context cache; its block pass is graphed on CUDA."""

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel, max_len: int, graphs: bool | None = None,
                 compile: bool = False):
        cfg = drafter.config
        cfg.check_target(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_layers=target.num_layers)
        if cfg.use_sliding_window:
            raise StaticLoopUnsupported("the static drafter pass has full-attention layers only; this drafter has "
                                        "sliding-window layers: use the eager loop")
        warn_if_mask_is_emitted(cfg.mask_token_id, target.tokenizer)
        drafter.bind_target(target.embed_tokens, target.lm_head)
        self.drafter, self.layer_ids, self.block_size = drafter, list(cfg.target_layer_ids), cfg.block_size
        B, dev, dt = cfg.block_size, drafter.fc.weight.device, drafter.fc.weight.dtype
        self.max_len = max_len
        shape = (1, cfg.num_key_value_heads, max_len + B, cfg.head_dim)
        self.keys = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(cfg.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(cfg.num_hidden_layers)]
        self.ctx_len = 0
        self.graphs = (dev.type == "cuda") if graphs is None else graphs
        self._feats = torch.zeros(1, B, cfg.fc_in_features, device=dev, dtype=dt)
        self._block = torch.full((1, B), cfg.mask_token_id, dtype=torch.long, device=dev)
        self._ctx_len = torch.zeros(1, dtype=torch.long, device=dev)
        self._n_new = torch.zeros(1, dtype=torch.long, device=dev)
        self._slot = torch.arange(max_len, device=dev)
        self._qkv, self._gate_up = _fuse_projections(drafter)
        self._places = weight_places(drafter)
        q_width, kv_width = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self._qkv_split = [q_width, kv_width, kv_width]
        # the fixed-shape pass (compiled or not) as the graphs run it, looked up at call time
        self.block_pass = torch.compile(self._block_pass, dynamic=False) if compile else self._block_pass
        self._pass = _Graphed(lambda: self.block_pass(self._feats), self.graphs)

    def reset(self) -> None:
        check_weights_unchanged(self.drafter, self._places, "drafter")
        self.ctx_len = 0  # stale slots are masked, then overwritten

    def graphed_pass(self) -> Callable[[], torch.Tensor]:
        """The block pass as the loop replays it, on the inputs already in its buffers (profiling)."""
        return self._pass

    def context_length(self) -> int:
        return self.ctx_len

    def _block_pass(self, feats: torch.Tensor) -> torch.Tensor:
        """Draft tokens for slots 1..B-1 from ``feats`` (``C`` new-context slots, ``n_new`` real)."""
        d, cfg = self.drafter, self.drafter.config
        C, B, dev = feats.shape[1], self.block_size, feats.device
        ctx_pos = self._ctx_len + torch.arange(C, device=dev)  # cache slot = position (context is contiguous)
        blk_pos = self._ctx_len + self._n_new + torch.arange(B, device=dev)
        dtype = d.fc.weight.dtype
        rope_ctx = rope_cos_sin(ctx_pos[None], cfg.head_dim, cfg.rope_theta, dtype)
        rope_blk = rope_cos_sin(blk_pos[None], cfg.head_dim, cfg.rope_theta, dtype)
        context = d.hidden_norm(d.fc(feats))
        visible = self._slot < self._ctx_len + self._n_new  # committed context slots
        mask = torch.cat([visible, torch.ones(B, dtype=torch.bool, device=dev)])[None, None, None].expand(1, 1, B, -1)
        h = d.embed(self._block)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            # One Q/K/V matmul over the new context and the block together: a pass is bound by weight
            # reads, so each weight is read once, in one kernel (the context rows' queries are computed and
            # dropped: free at these sizes). The block's K/V go straight into the buffer's last B slots, so
            # the attention reads the buffer as it is (no concatenated copy).
            q, k, v = F.linear(torch.cat([context, x], dim=1), self._qkv[i]).split(self._qkv_split, dim=-1)
            q = apply_rope(a.q_norm(a._heads(q[:, C:], a.num_heads)), *rope_blk)
            k = a.k_norm(a._heads(k, a.num_kv_heads))
            v = a._heads(v, a.num_kv_heads)
            self.keys[i].index_copy_(2, ctx_pos, apply_rope(k[:, :, :C], *rope_ctx))
            self.values[i].index_copy_(2, ctx_pos, v[:, :, :C])
            self.keys[i][:, :, self.max_len:].copy_(apply_rope(k[:, :, C:], *rope_blk))
            self.values[i][:, :, self.max_len:].copy_(v[:, :, C:])
            out = attend_grouped(q, self.keys[i], self.values[i], mask)
            h = h + a.o_proj(out.transpose(1, 2).reshape(1, B, -1))
            gate, up = F.linear(layer.post_attention_layernorm(h), self._gate_up[i]).chunk(2, dim=-1)
            h = h + layer.mlp.down_proj(F.silu(gate) * up)
        return d.logits(d.norm(h)[:, 1:])[0].argmax(-1)

    def check_block_size(self, block_size: int) -> None:
        if block_size != self.block_size:
            raise StaticLoopUnsupported(f"the static drafter pass is built for blocks of {self.block_size}; "
                                        f"got {block_size}")

    @torch.no_grad()
    def propose(self, bonus: int, new_features: torch.Tensor, start: int, block_size: int) -> torch.Tensor:
        c = new_features.shape[1]
        self.check_block_size(block_size)
        if start - c != self.ctx_len:
            raise RuntimeError(f"draft cache holds {self.ctx_len} positions but {c} new features end at {start}")
        if self.ctx_len + max(c, self.block_size) > self.max_len:
            raise ValueError(f"drafter cache holds {self.max_len} positions; raise max_len")
        self._ctx_len.fill_(self.ctx_len)
        self._n_new.fill_(c)
        self._block[0, 0] = bonus
        feats = new_features.to(self._feats.dtype)
        if c <= self.block_size:
            self._feats[:, :c].copy_(feats)
            out = self._pass()
        else:  # the prompt's features: one eager pass of its own width
            out = self._block_pass(feats)
        self.ctx_len += c
        return out


def _fuse_projections(drafter: DFlashDraftModel) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, ``q|k|v`` and ``gate|up`` weights stacked into one matrix each (one matmul, one kernel,
    instead of three and two). The drafter's own Linear weights become views of them (the same
    Parameter objects, their data re-pointed), so GPU memory holds each weight once and the eager
    drafter still computes with the same values; saving copies each view out (``models.weights``)."""
    qkv, gate_up = [], []
    for layer in drafter.layers:
        a, m = layer.self_attn, layer.mlp
        for parts, out in (((a.q_proj, a.k_proj, a.v_proj), qkv), ((m.gate_proj, m.up_proj), gate_up)):
            fused = torch.cat([p.weight.detach() for p in parts])
            rows = 0
            for p in parts:
                n = p.weight.shape[0]
                p.weight.data = fused[rows:rows + n]
                rows += n
            out.append(fused)
    return qkv, gate_up


@torch.no_grad()
def build_static_loop(target: TargetModel, drafter: DFlashDraftModel, max_len: int, block_size: int | None = None,
                      compile: bool = False) -> tuple[StaticTarget, StaticDrafterProposer]:
    """The target and drafter halves of the static loop, sharing one ``max_len`` (what
    ``static_dflash_generate`` takes; ``static_target_generate`` uses the first)."""
    B = block_size or drafter.config.block_size
    return (StaticTarget(target, drafter.config.target_layer_ids, max_len, B, compile=compile),
            StaticDrafterProposer(drafter, target, max_len, compile=compile))


def static_dflash_generate(target: StaticTarget, proposer, prompt_ids: list[int], max_new_tokens: int = 256,
                           temperature: float = 0.0, block_size: int | None = None,
                           eos_token_ids: list[int] | None = None, seed: int = 0,
                           parts: dict[str, float] | None = None, resident: bool | None = None) -> GenerationResult:
    """``torch_loop.dflash_generate`` on static caches: same cycle, same result, rollback = length reset.

    ``parts`` (a dict): accumulate seconds per part (draft, verify, accept, host), with a device
    sync around each, which slows the loop: a profiling run, not the timed one.
    ``resident``: the whole greedy cycle as one function on the device (``inference.static_greedy``);
    None (default) takes it where it applies (temperature 0, no ``parts``, the static drafter),
    False keeps the two graphed passes with the acceptance on the host between them.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    B = resolve_block_size(block_size, proposer.block_size)
    eos = set(target.target.eos_token_ids() if eos_token_ids is None else eos_token_ids)
    applies = temperature == 0 and parts is None and isinstance(proposer, StaticDrafterProposer)
    if resident and not applies:
        raise ValueError("the device-resident cycle is greedy, untimed by parts and needs the static drafter: "
                         "use resident=None or False with temperature > 0, parts or another proposer")
    if applies and resident is not False:
        from inference.static_greedy import greedy_cycle

        proposer.check_block_size(B)
        return greedy_cycle(target, proposer).generate(prompt_ids, max_new_tokens, eos)
    device = target.target.device
    gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    proposer.reset()
    result = GenerationResult(tokens=[], block_size=B, position_accepts=[0] * (B - 1))
    clock = Clock(device, parts)
    feats, _, stop = prefill(target, prompt_ids, result, eos, max_new_tokens, temperature, gen)
    new_features = feats.clone()
    committed = len(prompt_ids)
    t1 = time.perf_counter()
    while stop is None:
        clock.start()
        drafts, block = draft_block(proposer, result.tokens[-1], new_features, committed, B, device)
        clock.lap("draft")
        feats, logits = target.forward(block, committed)
        clock.lap("verify")
        both = torch.cat([drafts, sample(logits[0], temperature, gen)]).tolist()  # the one sync per cycle
        clock.lap("accept")
        drafts, target_tokens = both[:B - 1], both[B - 1:]
        check_draft_cache(proposer, committed)
        keep, stop = result.record_cycle(drafts, target_tokens, eos, max_new_tokens)
        committed += keep  # the rollback: later passes overwrite and mask the slots past `committed`
        new_features = feats[:, :keep].clone()  # the graph's output buffer is reused by the next pass
        clock.lap("host")
    _sync(device)
    result.decode_s = time.perf_counter() - t1
    result.stop_reason = stop
    return result


@torch.no_grad()
def static_target_generate(target: StaticTarget, prompt_ids: list[int], max_new_tokens: int = 256,
                           temperature: float = 0.0, eos_token_ids: list[int] | None = None,
                           seed: int = 0, resident: bool | None = None) -> GenerationResult:
    """The baseline on the same static cache and graphed 1-token pass: one token per forward.

    ``resident``: at temperature 0, the step (decode, argmax, the token fed back) as one function on the
    device, as the DFlash loop's cycle (None: where it applies; False: the argmax read before each step).
    """
    eos = set(target.target.eos_token_ids() if eos_token_ids is None else eos_token_ids)
    if resident and temperature != 0:
        raise ValueError("the device-resident step is greedy: use resident=None or False with temperature > 0")
    if temperature == 0 and resident is not False:
        from inference.static_greedy import greedy_decode

        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        return greedy_decode(target).generate(prompt_ids, max_new_tokens, eos)
    device = target.target.device
    gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    result = GenerationResult(tokens=[], block_size=1)
    _, tok, stop = prefill(target, prompt_ids, result, eos, max_new_tokens, temperature, gen)
    pos = len(prompt_ids)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    t1 = time.perf_counter()
    while stop is None:
        ids.fill_(tok)
        _, logits = target.forward(ids, pos)
        pos += 1
        tok = int(sample(logits[0, -1], temperature, gen))
        stop = commit_tokens([tok], result.tokens, eos, max_new_tokens)
        result.acceptance_lengths.append(int(stop != "eos"))  # the EOS step emits nothing
    _sync(device)
    result.decode_s = time.perf_counter() - t1
    result.stop_reason = stop
    return result


def prefill(target: StaticTarget, prompt_ids: list[int], result: GenerationResult, eos: set[int],
            max_new_tokens: int, temperature: float = 0.0, gen: torch.Generator | None = None):
    """The prompt's pass (eager, any length) and the target's first token, committed to ``result`` with
    its time as ``result.prefill_s``: ``(the prompt's features, first token, stop reason or None)``."""
    device = target.target.device
    t0 = time.perf_counter()
    feats, logits = target.forward(torch.tensor([prompt_ids], device=device), 0)
    first = int(sample(logits[0, -1], temperature, gen))
    _sync(device)
    result.prefill_s = time.perf_counter() - t0
    return feats, first, commit_tokens([first], result.tokens, eos, max_new_tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["StaticTarget", "StaticDrafterProposer", "StaticLoopUnsupported", "static_dflash_generate",
           "static_target_generate"]
