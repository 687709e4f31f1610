"""Eval during training: simulated acceptance on held-out rows, and (optionally) true acceptance.

*Simulated tau*: the training objective's forward on held-out rows with a fixed anchor draw; per
block, ``1 + leading slots whose draft equals the label``, the draft being what the loops propose: the
argmax (v1), or DFlash2's selector walk from the bonus token over each slot's unary top-K (its unary
argmax figure is reported beside it, ``eval_tau_sim_unary``). With labels that are the target's own
greedy tokens (regenerated data) this is exactly the acceptance length the block would get in the
real loop at that position. Reported as the mean, per-slot accuracy, and per-slot acceptance.

*True tau*: a real DFlash generation with the torch loop (``inference.torch_loop.dflash_generate``)
on a few held-out prompts, proposing through the loop's own adapter and proposal step
(``DrafterProposer`` -> ``inference.cycle.propose_block``: the selector walk for DFlash2). Layering
note: docs/design.md lets ``train/`` import only ``models/`` and ``data/``; this is the one deliberate
exception, isolated in :func:`true_tau` and imported lazily there, because the point of the
measurement is to run *the* inference loop, not a copy of it.
"""

from __future__ import annotations

import contextlib

import torch

from train.blocks import attention_masks, draw_blocks
from train.objective import block_loss, drafter_forward, simulated_acceptance
from train.selector_loss import block_embedder, selector_term
from train.rng import row_generators


@torch.no_grad()
def evaluate_sim(drafter, target, provider, indices: list[int], *, batch_size: int, num_anchors: int,
                 gamma: float | None = None, seed: int, max_batches: int, use_flex: bool, ce_chunk: int, autocast=None,
                 objective: dict | None = None, selector_loss_alpha: float | None = None) -> dict:
    """Held-out simulated tau, loss, per-slot accuracy/acceptance. Same anchors every call (fixed seed).

    objective: ``block_loss``'s weighting keywords (``RunConfig.loss_weighting()``; None: the decay of ``gamma``),
    so the held-out loss is the training loss's; the simulated tau does not depend on it. DFlash2: the loss has
    the selector term (``selector_loss_alpha``, ``train.selector_loss_alpha``), the tau is the selector walk's,
    and the unary argmax's tau and the selector CE come beside it."""
    cfg = drafter.config
    was_training = drafter.training
    drafter.eval()
    selector = selector_term(drafter, selector_loss_alpha)
    embed = block_embedder(drafter, target.embed_tokens)
    totals: dict[str, torch.Tensor] = {}
    loss_sum, n_batches, sel_sum, scored = 0.0, 0, 0.0, 0
    for bi, start in enumerate(range(0, len(indices), batch_size)):
        if bi >= max_batches:
            break
        batch = provider.get_batch(indices[start:start + batch_size])
        dev = target.device
        ids, lm, doc, pos = (batch.input_ids.to(dev), batch.loss_mask.to(dev), batch.doc_ids.to(dev).long(),
                             batch.position_ids.to(dev))
        rows = indices[start:start + batch_size]  # one stream per held-out row: same blocks at any batch size
        gens = row_generators(seed, "eval", rows)
        blocks = draw_blocks(ids, lm, doc, pos, num_anchors, cfg.block_size, cfg.mask_token_id, gens)
        mask = attention_masks(cfg, blocks, doc, pos, use_flex)
        with (autocast() if autocast else contextlib.nullcontext()):
            hidden = drafter_forward(drafter, embed, blocks, batch.features.to(dev), pos, mask)
            out = block_loss(hidden, blocks, target.lm_head.weight, chunk=ce_chunk, selector=selector,
                             **(objective or {"gamma": gamma}))
        loss_sum += float(out.loss)
        n_batches += 1
        for k, v in simulated_acceptance(out.correct, out.label_mask, out.valid).items():
            totals[k] = totals[k] + v.cpu() if k in totals else v.cpu()
        if selector is not None:
            unary = simulated_acceptance(out.unary_correct, out.label_mask, out.valid)["tau_sum"].cpu()
            totals["unary_tau_sum"] = totals["unary_tau_sum"] + unary if "unary_tau_sum" in totals else unary
            sel_sum += float(out.selector_ce_sum)
            scored += out.scored
    drafter.train(was_training)
    if not n_batches:
        return {}
    blocks_n = max(float(totals["blocks"]), 1.0)
    return {
        "eval_loss": loss_sum / n_batches,
        "eval_tau_sim": float(totals["tau_sum"]) / blocks_n,
        "eval_pos_acc": [round(float(c / max(n, 1)), 4) for c, n in zip(totals["pos_correct"], totals["pos_count"])],
        "eval_pos_accept": [round(float(a) / blocks_n, 4) for a in totals["pos_accept"]],
        "eval_blocks": int(totals["blocks"]),
        **({"eval_tau_sim_unary": float(totals["unary_tau_sum"]) / blocks_n,
            "eval_selector_ce": sel_sum / max(scored, 1)} if selector is not None else {}),
    }


def held_out_prompts(rows, limit: int) -> list[list[int]]:
    """Served prompts of held-out rows: the tokens before the first assistant answer (loss span)."""
    prompts = []
    for r in rows:
        if len(prompts) >= limit:
            break
        mask = list(r["loss_mask"])
        doc = list(r["doc_ids"])
        if 1 not in mask:
            continue
        first = mask.index(1)
        start = doc.index(doc[first])  # packed rows: the prompt starts at its document's first token
        if first > start:
            prompts.append([int(t) for t in list(r["input_ids"])[start:first]])
    return prompts


def true_tau_prompt_set(rows, asked: int, log) -> list[list[int]]:
    """``eval.true_tau_prompts`` prompts of the held-out rows; fewer than asked is said (the metrics' true tau did
    not say how few prompts it was measured on)."""
    prompts = held_out_prompts(rows, asked) if asked else []
    if len(prompts) < asked:
        log(f"note: eval.true_tau_prompts={asked}, but the {len(rows)} held-out rows give {len(prompts)} prompts: "
            f"true tau is measured on {len(prompts)}; raise data.eval_rows for more")
    return prompts


@torch.no_grad()
def true_tau(drafter, target, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Real DFlash generation (greedy) with the torch inference loop; tau pooled over all cycles."""
    from inference.torch_loop import DrafterProposer, dflash_generate  # the documented layering exception

    was_training = drafter.training
    drafter.eval()
    proposer = DrafterProposer(drafter, target)
    lengths: list[int] = []
    uncut = 0  # committed tokens, each generation's last cycle counted in full (validate's tau_uncut)
    for p in prompts:
        result = dflash_generate(target, proposer, p, max_new_tokens=max_new_tokens)
        lengths += result.acceptance_lengths
        uncut += result.committed_uncut
    drafter.train(was_training)
    hist: dict[str, int] = {}
    for n in lengths:
        hist[str(n)] = hist.get(str(n), 0) + 1
    return {"eval_tau_true": sum(lengths) / len(lengths) if lengths else 0.0, "eval_true_cycles": len(lengths),
            "eval_tau_true_uncut": uncut / len(lengths) if lengths else 0.0,
            "eval_true_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0])))}
