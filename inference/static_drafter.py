"""The drafter over static (preallocated) buffers: the static-buffer drafter state of the one cycle.

Committed-context K/V live in buffers of ``max_len`` positions per layer (plus the block's ``B``
slots); each block pass takes a fixed ``B`` new-context slots (``c <= B`` real, the rest masked and
overwritten by the next cycle), so the pass has one shape and is captured once as a CUDA graph
(``static_target.GraphedPass``; one per temperature), optionally compiled. The pass ends in the proposal
step (``cycle.propose_block``), so a drafter generation's proposal runs inside the graph: DFlash2's
selector walk included, its uniforms (sampling) drawn into a static buffer before the replay. Either
generation: the layers are written out here as ``models/drafter.py`` and ``models/drafter2.py`` compute
them (DFlash2's two dynamic convs around attention and MLP), with sliding-window layers masked as the
eager drafter masks them. Rollback is a length reset, as for the target (``static_target.StaticTarget``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from inference.cycle import Proposal, propose_block, samples_drafts
from inference.grouped_attention import attend_grouped
from inference.static_target import GraphedPass, StaticLoopUnsupported, check_weights_unchanged, weight_places
from inference.stats import warn_if_mask_is_emitted
from models.drafter import DFlashDraftModel, apply_rope, rope_cos_sin
from models.target import TargetModel


class StaticDrafterProposer:
    """The drafter (either generation) over a preallocated committed-context cache; its block pass is graphed
    on CUDA."""

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel, max_len: int, graphs: bool | None = None,
                 compile: bool = False):
        cfg = drafter.config
        cfg.check_target(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_layers=target.num_layers)
        if cfg.rope_scaling or cfg.attention_bias:
            raise StaticLoopUnsupported("the static drafter pass has plain RoPE and no attention biases; this "
                                        "drafter's config carries a YaRN block or attention_bias (a published "
                                        "gpt-oss drafter's): use the eager loop")
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
        # DFlash2 sampling: the selector walk's draws for slots 1..B-1, filled from the generation's generator
        # before each replay (a graph replays its kernels, not a host-side draw)
        self._uniform = torch.zeros(1, B - 1, device=dev)
        self.temperature, self.generator = 0.0, None
        self._qkv, self._gate_up = _fuse_projections(drafter)
        self._places = weight_places(drafter)
        q_width, kv_width = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self._qkv_split = [q_width, kv_width, kv_width]
        # the fixed-shape pass (compiled or not) as the graphs run it, looked up at call time
        self.block_pass = torch.compile(self._block_pass, dynamic=False) if compile else self._block_pass
        # One graphed pass per temperature: the walk's softmax(score / T), or its greedy argmax, is captured.
        self._passes: dict[float, GraphedPass] = {}

    def reset(self, temperature: float = 0.0, generator: torch.Generator | None = None) -> None:
        check_weights_unchanged(self.drafter, self._places, "drafter")
        self.ctx_len = 0  # stale slots are masked, then overwritten
        self.temperature, self.generator = float(temperature), generator

    @property
    def _pass(self) -> GraphedPass:
        """The graphed block pass at the current temperature, built (on CUDA captured) on first use."""
        T = self.temperature if samples_drafts(self.drafter, self.temperature) else 0.0  # v1: one pass for all T
        if T not in self._passes:
            self._passes[T] = GraphedPass(lambda: self.block_pass(self._feats), self.graphs)
        return self._passes[T]

    def graphed_pass(self) -> Callable[[], Proposal]:
        """The block pass as the loop replays it, on the inputs already in its buffers (profiling)."""
        return self._pass

    def context_length(self) -> int:
        return self.ctx_len

    def _block_pass(self, feats: torch.Tensor) -> Proposal:
        """The proposal for slots 1..B-1 from ``feats`` (``C`` new-context slots, ``n_new`` real)."""
        d, cfg = self.drafter, self.drafter.config
        C, B, dev = feats.shape[1], self.block_size, feats.device
        ctx_pos = self._ctx_len + torch.arange(C, device=dev)  # cache slot = position (context is contiguous)
        blk_pos = self._ctx_len + self._n_new + torch.arange(B, device=dev)
        dtype = d.fc.weight.dtype
        rope_ctx = rope_cos_sin(ctx_pos[None], cfg.head_dim, cfg.rope_theta, dtype)
        rope_blk = rope_cos_sin(blk_pos[None], cfg.head_dim, cfg.rope_theta, dtype)
        context = d.hidden_norm(d.fc(feats))
        masks = self._masks(blk_pos)
        h = d.embed(self._block)
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            conv = getattr(layer, "attention_conv", None)  # DFlash2: a dynamic conv around each sublayer
            x = layer.input_layernorm(h)
            if conv is not None:
                x, dynamic = conv.prepare(x)  # the block's slots only: the context is never convolved
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
            out = attend_grouped(q, self.keys[i], self.values[i], masks[layer.attention_type])
            out = a.o_proj(out.transpose(1, 2).reshape(1, B, -1))
            h = h + (out if conv is None else conv.finish(out, dynamic))
            x = layer.post_attention_layernorm(h)
            if conv is not None:
                x, dynamic = layer.mlp_conv.prepare(x)
            gate, up = F.linear(x, self._gate_up[i]).chunk(2, dim=-1)
            out = layer.mlp.down_proj(F.silu(gate) * up)
            h = h + (out if conv is None else layer.mlp_conv.finish(out, dynamic))
        return propose_block(d, d.norm(h)[:, 1:], self._block[:, 0], self.temperature, self._uniform)

    def _masks(self, blk_pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[1, 1, B, max_len + B]`` masks by layer type: committed context slots, then the block. A sliding
        layer also hides context keys ``window`` or more positions before the query and, in-block ``causal``,
        the block's later slots (``models.drafter.sliding_mask``, the eager drafter's mask)."""
        cfg, B, dev = self.drafter.config, self.block_size, blk_pos.device
        visible = self._slot < self._ctx_len + self._n_new  # committed context slots
        block = torch.ones(B, B, dtype=torch.bool, device=dev)
        full = torch.cat([visible, block[0]])[None, None, None].expand(1, 1, B, -1)
        masks = {"full_attention": full}
        if cfg.use_sliding_window:
            near = visible[None] & (blk_pos[:, None] - self._slot[None] < cfg.sliding_window)  # [B, max_len]
            inside = block if cfg.sliding_block_attention == "bidirectional" else block.tril()
            masks["sliding_attention"] = torch.cat([near, inside], dim=1)[None, None]
        return masks

    def check_block_size(self, block_size: int) -> None:
        if block_size != self.block_size:
            raise StaticLoopUnsupported(f"the static drafter pass is built for blocks of {self.block_size}; "
                                        f"got {block_size}")

    @torch.no_grad()
    def propose(self, bonus: int, new_features: torch.Tensor, start: int, block_size: int) -> Proposal:
        c = new_features.shape[1]
        self.check_block_size(block_size)
        if start - c != self.ctx_len:
            raise RuntimeError(f"draft cache holds {self.ctx_len} positions but {c} new features end at {start}")
        if self.ctx_len + max(c, self.block_size) > self.max_len:
            raise ValueError(f"drafter cache holds {self.max_len} positions; raise max_len")
        self._ctx_len.fill_(self.ctx_len)
        self._n_new.fill_(c)
        self._block[0, 0] = bonus
        if samples_drafts(self.drafter, self.temperature):  # the walk's draws, from the generation's stream
            self._uniform.uniform_(generator=self.generator)
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
