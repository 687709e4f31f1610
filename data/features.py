"""Target features for training: one interface, two providers.

A provider gives, for rows of prepared data (:mod:`data.prepare`), a :class:`FeatureBatch`:
``input_ids``, ``loss_mask``, ``doc_ids``, ``position_ids`` (right-padded ``[b, s]``), the tapped
layers' outputs ``features`` ``[b, s, n_taps * hidden]`` (layer ids in config order, layer ``l``
= ``hidden_states[l + 1]``) and optionally the target's top-k next-token log-probs for KL.

- :class:`OnlineFeatures`: the target runs in the training process under ``no_grad``.
- :class:`data.store.FeatureStore`: features extracted once by ``python -m data.extract``.

Both expose ``layer_ids``, ``__len__``, ``row(i) -> FeatureRow`` and
``get_batch(indices) -> FeatureBatch``, so the trainer switches mode with one flag.

Packed rows: the target never sees two documents at once. Each document of a packed row is run
on its own (positions from 0), so its features are exactly those of the unpacked document.
Unpacked batches run as one right-padded forward: padding sits after the real tokens, and
causal attention keeps it from touching them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from models.config import LAYER_ORDER_FIX, layer_order_problem
from models.config_keys import ConfigError
from models.support import to_device


@dataclass
class FeatureRow:
    input_ids: torch.Tensor  # [n] int64
    loss_mask: torch.Tensor  # [n] int8
    doc_ids: torch.Tensor  # [n] int32
    position_ids: torch.Tensor  # [n] int32
    features: torch.Tensor  # [n, taps * hidden]
    topk_ids: torch.Tensor | None = None  # [n, k] int32: top-k ids of the next-token distribution at each position
    topk_logprobs: torch.Tensor | None = None  # [n, k] float32


@dataclass
class FeatureBatch:
    input_ids: torch.Tensor  # [b, s] int64, pad = pad_id
    loss_mask: torch.Tensor  # [b, s] int8, 0 on padding
    doc_ids: torch.Tensor  # [b, s] int32, -1 on padding
    position_ids: torch.Tensor  # [b, s] int64, 0 on padding
    lengths: torch.Tensor  # [b] int64
    features: torch.Tensor | None = None  # [b, s, taps * hidden], zeros on padding
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None

    @property
    def attention_mask(self) -> torch.Tensor:
        return (self.doc_ids >= 0).to(torch.int64)


def _pad(tensors: list[torch.Tensor], value, width: int) -> torch.Tensor:
    out = tensors[0].new_full((len(tensors), width) + tuple(tensors[0].shape[1:]), value)
    for i, t in enumerate(tensors):
        out[i, :t.shape[0]] = t
    return out


def collate(rows: list[FeatureRow] | list[dict], pad_id: int = 0) -> FeatureBatch:
    """Right-pad rows (``FeatureRow`` or prepared-data dicts) into a batch."""
    rows = [r if isinstance(r, FeatureRow) else FeatureRow(
        torch.as_tensor(r["input_ids"], dtype=torch.int64), torch.as_tensor(r["loss_mask"], dtype=torch.int8),
        torch.as_tensor(r["doc_ids"], dtype=torch.int32), torch.as_tensor(r["position_ids"], dtype=torch.int32),
        None) for r in rows]
    width = max(r.input_ids.shape[0] for r in rows)
    batch = FeatureBatch(
        input_ids=_pad([r.input_ids.long() for r in rows], pad_id, width),
        loss_mask=_pad([r.loss_mask.to(torch.int8) for r in rows], 0, width),
        doc_ids=_pad([r.doc_ids.to(torch.int32) for r in rows], -1, width),
        position_ids=_pad([r.position_ids.long() for r in rows], 0, width),
        lengths=torch.tensor([r.input_ids.shape[0] for r in rows]))
    if rows[0].features is not None:
        batch.features = _pad([r.features for r in rows], 0, width)
    if rows[0].topk_ids is not None:
        batch.topk_ids = _pad([r.topk_ids for r in rows], 0, width)
        batch.topk_logprobs = _pad([r.topk_logprobs for r in rows], float("-inf"), width)
    return batch


def topk_logprobs(logits: torch.Tensor, k: int, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (int32) and log-probs (float32) of ``softmax(logits)``, chunked over positions."""
    flat = logits.reshape(-1, logits.shape[-1])
    ids, lps = [], []
    for i in range(0, flat.shape[0], chunk):
        lp = torch.log_softmax(flat[i:i + chunk].float(), dim=-1)
        v, j = lp.topk(k, dim=-1)
        ids.append(j.to(torch.int32))
        lps.append(v)
    shape = tuple(logits.shape[:-1]) + (k,)
    return torch.cat(ids).reshape(shape), torch.cat(lps).reshape(shape)


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> None:
    """Tapped layers of a ``num_layers``-layer target: each once, and never its last layer."""
    layer_ids, last = list(layer_ids), num_layers - 1
    bad = [i for i in layer_ids if not 0 <= i < last]
    if bad:
        raise ConfigError("target_layer_ids", layer_ids, f"layer ids {bad} are outside [0, {last}) for a "
                          f"{num_layers}-layer target (the last layer cannot be tapped: engines cannot capture it)",
                          f"tap layers 0..{last - 1}")
    if len(set(layer_ids)) != len(layer_ids):
        raise ConfigError("target_layer_ids", layer_ids, "a layer is tapped twice", "list each layer once")
    if problem := layer_order_problem(layer_ids):
        raise ConfigError("target_layer_ids", layer_ids, problem, LAYER_ORDER_FIX)


class OnlineFeatures:
    """Provider that runs the target in-process (``no_grad``) on each batch."""

    def __init__(self, target, layer_ids: Sequence[int], data=None, *, topk: int = 0, pad_id: int | None = None):
        self.target, self.layer_ids, self.data, self.topk = target, list(layer_ids), data, topk
        check_layer_ids(self.layer_ids, target.num_layers)  # before a store's index is written (a bad id left one)
        tok = target.tokenizer
        tok_pad = tok.pad_token_id if tok is not None else None
        self.pad_id = pad_id if pad_id is not None else (tok_pad if tok_pad is not None else 0)

    def __len__(self) -> int:
        return len(self.data)

    @torch.no_grad()
    def features_for(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None):
        """(features, topk_ids, topk_logprobs) for a right-padded batch; doc_ids < 0 marks padding."""
        t = self.target
        # not waiting for the GPU's queue: staged through pinned memory (models/support.py)
        input_ids = to_device(input_ids, t.device)
        packed = doc_ids is not None and bool((doc_ids.numpy() > 0).any())  # the host copy (numpy refuses a GPU's)
        if not packed:
            return self._forward(input_ids)
        # split every packed row into its documents, run them as one padded batch, scatter back
        spans = []
        for b in range(input_ids.shape[0]):
            d = doc_ids[b].tolist()
            start = 0
            for i in range(1, len(d) + 1):
                if i == len(d) or d[i] != d[i - 1]:
                    if d[start] >= 0:
                        spans.append((b, start, i))
                    start = i
        width = max(e - s for _, s, e in spans)
        docs = input_ids.new_full((len(spans), width), self.pad_id)
        for j, (b, s, e) in enumerate(spans):
            docs[j, :e - s] = input_ids[b, s:e]
        feats, ids, lps = self._forward(docs)
        out = feats.new_zeros(input_ids.shape + feats.shape[2:])
        out_ids = ids.new_zeros(input_ids.shape + ids.shape[2:]) if ids is not None else None
        out_lps = lps.new_full(input_ids.shape + lps.shape[2:], float("-inf")) if lps is not None else None
        for j, (b, s, e) in enumerate(spans):
            out[b, s:e] = feats[j, :e - s]
            if ids is not None:
                out_ids[b, s:e], out_lps[b, s:e] = ids[j, :e - s], lps[j, :e - s]
        return out, out_ids, out_lps

    def _forward(self, input_ids: torch.Tensor):
        out = self.target.forward(input_ids, self.layer_ids, with_logits=self.topk > 0)
        if self.topk > 0:
            ids, lps = topk_logprobs(out.logits, self.topk)
            return out.features, ids, lps
        return out.features, None, None

    def batch_from_rows(self, rows: list[dict]) -> FeatureBatch:
        batch = collate(rows, self.pad_id)
        feats, ids, lps = self.features_for(batch.input_ids, batch.doc_ids)
        pad = to_device(batch.doc_ids < 0, feats.device)  # as the offline store's padding
        batch.features = feats.masked_fill(pad[..., None], 0)
        if ids is not None:
            batch.topk_ids = ids.masked_fill(pad[..., None], 0)
            batch.topk_logprobs = lps.masked_fill(pad[..., None], float("-inf"))
        return batch

    def get_batch(self, indices: Sequence[int]) -> FeatureBatch:
        return self.batch_from_rows([self.data[int(i)] for i in indices])

    def row(self, i: int) -> FeatureRow:
        b = self.get_batch([i])
        n = int(b.lengths[0])
        return FeatureRow(b.input_ids[0, :n], b.loss_mask[0, :n], b.doc_ids[0, :n], b.position_ids[0, :n],
                          b.features[0, :n], None if b.topk_ids is None else b.topk_ids[0, :n],
                          None if b.topk_logprobs is None else b.topk_logprobs[0, :n])
