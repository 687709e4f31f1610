"""Packing tokenized rows into fixed-budget sequences without losing document boundaries.

Every prepared row (packed or not) carries, per token:

- ``doc_ids``:      0, 0, ..., 1, 1, ...: which document (conversation row) the token belongs to,
                    counted from 0 inside the packed row. Unpacked rows are all 0.
- ``position_ids``: the token's position inside its own document (restarts at 0 per document).

The training objective uses them so that anchors, blocks and context features never cross a
document: a block token may only see context features of its own document, and the target is
run per document (or with a block-diagonal mask) so features never leak across documents.
"""

from __future__ import annotations


def document_columns(lengths: list[int]) -> tuple[list[int], list[int]]:
    """doc_ids and position_ids for documents of the given lengths laid end to end."""
    doc_ids, position_ids = [], []
    for d, n in enumerate(lengths):
        doc_ids += [d] * n
        position_ids += list(range(n))
    return doc_ids, position_ids


def document_bounds(doc_ids) -> list[tuple[int, int]]:
    """``[start, end)`` of every document in a row, from its ``doc_ids`` column."""
    bounds, start = [], 0
    ids = list(doc_ids)
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1]:
            bounds.append((start, i))
            start = i
    return bounds


def pack_rows(rows: list[tuple[list[int], list[int]]], max_length: int) -> list[dict]:
    """Greedy in-order packing of (input_ids, loss_mask) rows into rows of at most ``max_length``.

    In order (not best-fit) so that the output is a deterministic function of the input and a
    shard plan computed once stays valid on resume.
    """
    packed, cur = [], []

    def flush():
        if cur:
            lengths = [len(ids) for ids, _ in cur]
            doc_ids, position_ids = document_columns(lengths)
            packed.append({"input_ids": [t for ids, _ in cur for t in ids],
                           "loss_mask": [m for _, mask in cur for m in mask],
                           "doc_ids": doc_ids, "position_ids": position_ids})
            cur.clear()

    used = 0
    for ids, mask in rows:
        if len(ids) > max_length:
            raise ValueError(f"row of {len(ids)} tokens is longer than max_length {max_length}: truncate first")
        if used + len(ids) > max_length:
            flush()
            used = 0
        cur.append((ids, mask))
        used += len(ids)
    flush()
    return packed


def unpacked_rows(rows: list[tuple[list[int], list[int]]]) -> list[dict]:
    out = []
    for ids, mask in rows:
        doc_ids, position_ids = document_columns([len(ids)])
        out.append({"input_ids": ids, "loss_mask": mask, "doc_ids": doc_ids, "position_ids": position_ids})
    return out
