"""DFlash2's training objective: the unary loss + selector_loss_alpha x the selector's teacher-forced K-way CE
(train/objective.py, docs/design.md "DFlash2"), against slow references written here."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from models.drafter2 import unary_logits
from tests.helpers import GradCapture, assert_close
from train.blocks import Blocks, draw_blocks
from train.objective import block_loss, dpace_weights, slot_weights
from train.selector_loss import SelectorTerm, _selector_ce

# ----------------------------------------------------------------------------- a hand-built case
# One row, two blocks of B = 4 (3 slots each), vocabulary 6, K = 3 candidates, selector rank 2. The head is the
# identity, so each slot's hidden row IS its logits. The second block's last slot is past the loss mask.
HB, HV, HK = 4, 6, 3
BONUS = [5, 1]
LABELS = [[0, 3, 2], [4, 1, 0]]
SCORED = [[True, True, True], [True, True, False]]
LOGITS = [[[3.0, 2.0, 1.0, 0.5, 0.0, -1.0],    # top-3 0 1 2: the label 0 is the best candidate
           [0.0, 1.0, 2.5, 2.0, -0.5, 0.2],    # top-3 2 3 1: the label 3 is the second
           [1.5, 0.1, 0.2, 2.0, 1.0, 0.3]],    # top-3 3 0 4: the label 2 is not in it, so it replaces 4
          [[0.0, 0.3, 0.1, 1.2, 2.2, 0.9],     # top-3 4 3 5: the label 4 is the best
           [2.0, -1.0, 0.5, 1.0, 0.0, 1.7],    # top-3 0 5 3: the label 1 replaces 3
           [9.0, 9.0, 9.0, 9.0, 9.0, 9.0]]]    # not scored
# The candidates each scored slot is trained on (the label injected at rank K when missing) and its target index.
CANDIDATES = [[0, 1, 2], [2, 3, 1], [3, 0, 2], [4, 3, 5], [0, 5, 1]]
TARGETS = [0, 1, 2, 0, 2]
PROJECTION = [[0.5, -0.2, 0.0, 0.3, 0.1, 0.0], [0.0, 0.4, -0.3, 0.0, 0.2, 0.6]]  # hidden_projection [r, H]
PREDECESSOR = [[0.3, -0.5], [1.0, 0.2], [-0.4, 0.8], [0.6, 0.6], [-1.0, 0.1], [0.2, -0.7]]  # [V, r]
SUCCESSOR = [[0.9, 0.1], [-0.3, 0.5], [0.4, -0.6], [0.0, 1.1], [0.7, 0.7], [-0.8, 0.2]]  # [V, r]


def selector_module(projection, predecessor, successor) -> torch.nn.Module:
    """A stand-in ``candidate_selector`` with the given weights (float64)."""
    m = torch.nn.Module()
    m.hidden_projection = torch.nn.Linear(len(projection[0]), len(projection), bias=False).double()
    with torch.no_grad():
        m.hidden_projection.weight.copy_(torch.tensor(projection, dtype=torch.float64))
    m.predecessor_codebook = torch.nn.Parameter(torch.tensor(predecessor, dtype=torch.float64))
    m.successor_codebook = torch.nn.Parameter(torch.tensor(successor, dtype=torch.float64))
    return m


def hand_blocks() -> tuple[Blocks, torch.Tensor]:
    """The case's blocks and hidden states ``[1, 2 B, V]`` (slot 0 rows: zeros, never read)."""
    mask = torch.tensor([SCORED])
    block_ids = torch.full((1, 2, HB), HV - 1)
    block_ids[0, :, 0] = torch.tensor(BONUS)
    blocks = Blocks(anchors=torch.tensor([[0, 10]]), valid=torch.tensor([[True, True]]), doc=torch.zeros(1, 2).long(),
                    block_ids=block_ids, positions=torch.arange(2 * HB).view(1, 2, HB), labels=torch.tensor([LABELS]),
                    label_mask=mask, scored_index=mask.flatten().nonzero().squeeze(1))
    hidden = torch.zeros(1, 2, HB, HV, dtype=torch.float64)
    hidden[0, :, 1:] = torch.tensor(LOGITS, dtype=torch.float64)
    return blocks, hidden.view(1, 2 * HB, HV)


def slow_reference(alpha: float, gamma: float, multiplier: float, softcap: float | None):
    """The objective by its definition, slot by slot in Python floats: (loss, selector CE sum, candidates, targets).

    unary = the drafter's logits (c tanh(m l / c)); CE to the label over the vocabulary; the selector's candidates:
    the K best unary tokens, the K-th replaced by the label when the label is not among them; scores
    unary + sum_j P[prev, j] z_j S[cand, j], z = projection . h, prev = the bonus, then the previous slot's label;
    loss = sum_k w_k (CE_k + alpha x selector CE_k) / sum_k w_k over the scored slots, w_k = exp(-(k-1)/gamma)."""

    def unary(x):
        x = x * multiplier
        return softcap * math.tanh(x / softcap) if softcap else x

    def logsumexp(xs):
        top = max(xs)
        return top + math.log(sum(math.exp(x - top) for x in xs))

    total = weight = selector_sum = 0.0
    seen_candidates, seen_targets = [], []
    for blk in range(2):
        prev = BONUS[blk]
        for k in range(3):
            if not SCORED[blk][k]:
                break
            row, label = LOGITS[blk][k], LABELS[blk][k]
            u = [unary(x) for x in row]
            ranked = sorted(range(HV), key=lambda t: -u[t])[:HK]
            if label in ranked:
                target = ranked.index(label)
            else:
                ranked[HK - 1], target = label, HK - 1
            z = [sum(PROJECTION[j][i] * row[i] for i in range(HV)) for j in range(2)]
            scores = [u[c] + sum(PREDECESSOR[prev][j] * z[j] * SUCCESSOR[c][j] for j in range(2)) for c in ranked]
            selector = logsumexp(scores) - scores[target]
            ce = logsumexp(u) - u[label]
            w = math.exp(-k / gamma)
            total, weight, selector_sum = total + w * (ce + alpha * selector), weight + w, selector_sum + selector
            seen_candidates.append(ranked)
            seen_targets.append(target)
            prev = label
    return total / weight, selector_sum, seen_candidates, seen_targets


@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (1.5, 3.0)])
@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_the_selector_loss_of_a_hand_built_case_equals_the_slow_reference(alpha, multiplier, softcap):
    """Known top-K (two labels injected at rank K), known codebooks and projection: block_loss's loss and selector CE
    equal the slot-by-slot reference, with and without DFlash2's output multiplier and soft-cap, at every chunk."""
    loss, selector_sum, candidates, targets = slow_reference(alpha, 4.0, multiplier, softcap)
    assert candidates == CANDIDATES and targets == TARGETS  # the case is what its comments say
    blocks, hidden = hand_blocks()
    unary = None if softcap is None else functools.partial(unary_logits, output_multiplier=multiplier, softcap=softcap)
    term = SelectorTerm(selector_module(PROJECTION, PREDECESSOR, SUCCESSOR), HK, alpha, unary)
    for chunk in (1, 2, 5):
        out = block_loss(hidden, blocks, torch.eye(HV, dtype=torch.float64), 4.0, chunk=chunk, selector=term)
        # the loss math runs in float32 (block_loss's convention), the reference in Python floats
        assert_close(out.loss, loss, atol=1e-6, what=f"loss, chunk {chunk}")
        assert_close(out.selector_ce_sum, selector_sum, atol=1e-6, what=f"selector CE sum, chunk {chunk}")


def test_a_label_outside_the_top_k_replaces_the_kth_candidate_with_its_unary_score():
    """Row 0: the label (7) is the second candidate: nothing moves, target 1. Row 1: the label (9) is not among the
    K: it takes the K-th place with its own unary value (-2.0), target K-1. Every row has a target, and the gradient
    reaches the injected label's value, not the candidate it replaced."""
    ids = torch.tensor([[3, 7, 5, 7], [3, 7, 5, 9]])  # the top-3, then the label
    values = torch.tensor([[4.0, 3.0, 1.0, 3.0], [4.0, 3.0, 1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([7, 9])
    projected = torch.zeros(2, 2, dtype=torch.float64)  # no edge term: the scores are the unary values
    codebooks = (torch.zeros(10, 2, dtype=torch.float64), torch.zeros(10, 2, dtype=torch.float64))
    ce = _selector_ce(projected, torch.tensor([0, 0]), values, ids, labels, *codebooks)
    kept = torch.tensor([4.0, 3.0, 1.0], dtype=torch.float64)
    injected = torch.tensor([4.0, 3.0, -2.0], dtype=torch.float64)
    assert_close(ce[0], torch.logsumexp(kept, 0) - 3.0, atol=1e-12, what="label in the top-K")
    assert_close(ce[1], torch.logsumexp(injected, 0) + 2.0, atol=1e-12, what="label injected at rank K")
    ce.sum().backward()
    assert values.grad[1, 2] == 0 and values.grad[1, 3] != 0  # the replaced candidate is out, the label in
    assert values.grad[0, 3] == 0  # a label already among the K is scored once, as a candidate


# ----------------------------------------------------------------------------- exactness
B, H, V, MASK, R, K = 4, 32, 64, 63, 8, 5


def autograd_reference(hidden, blocks, head, selector, alpha, weighting, unary):
    """The DFlash2 objective from whole logits through autograd (no chunks, no hand-written backward): loss and
    selector CE sum."""
    b, n = blocks.anchors.shape
    h = hidden.view(b, n, B, -1)[:, :, 1:]
    logits = h @ head.t()
    if unary is not None:
        logits = unary(logits)
    labels, mask = blocks.labels, blocks.label_mask
    ce = -torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    top_v, top_i = logits.topk(K, dim=-1)
    found = (top_i == labels[..., None]).any(-1)
    cand = torch.cat([top_i[..., :-1], torch.where(found, top_i[..., -1], labels)[..., None]], -1)
    label_v = logits.gather(-1, labels[..., None])[..., 0]
    val = torch.cat([top_v[..., :-1], torch.where(found, top_v[..., -1], label_v)[..., None]], -1)
    target = torch.where(found, (top_i == labels[..., None]).long().argmax(-1), torch.full_like(labels, K - 1))
    prev = torch.cat([blocks.block_ids[..., :1], labels[..., :-1]], -1)
    z = selector.hidden_projection(h)
    edge = ((selector.predecessor_codebook[prev] * z)[..., None, :] * selector.successor_codebook[cand]).sum(-1)
    sel = torch.nn.functional.cross_entropy((val + edge).flatten(0, 2), target.flatten(), reduction="none")
    sel = sel.view_as(ce) * mask
    w = (dpace_weights(ce, mask, 0.5) if weighting == "dpace" else slot_weights(B, 4.0).expand_as(ce)) * mask
    return (w * (ce + alpha * sel)).sum() / w.sum(), sel.sum()


def _rows():
    from tests.train.test_objective import _rows as rows

    return rows()


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("trained_head", [False, True])
def test_the_selector_term_and_its_gradients_do_not_depend_on_the_chunk_size(weighting, softcap, trained_head):
    """Every LM-head chunk size (1, blocks straddling chunks, all at once) gives the whole-logits reference's loss,
    selector CE and gradients (hidden states, projection, both codebooks; the head's when it is trained): the
    top-K taken inside each chunk, the candidates' backward through the head's rows (frozen head) or autograd
    (trained head), the label injected, D-PACE's weights from the unary CE."""
    torch.manual_seed(3)
    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 5, B, MASK, torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 5 * B, H, dtype=torch.float64, requires_grad=True)
    head = (torch.randn(V, H, dtype=torch.float64) / 2).requires_grad_(trained_head)
    g = torch.Generator().manual_seed(1)
    module = selector_module(torch.randn(R, H, generator=g).tolist(), torch.randn(V, R, generator=g).tolist(),
                             torch.randn(V, R, generator=g).tolist())
    unary = functools.partial(unary_logits, output_multiplier=1.3, softcap=4.0) if softcap else None
    term = SelectorTerm(module, K, 0.7, unary)
    params = [hidden, *module.parameters(), *([head] if trained_head else [])]
    ref, ref_sel = autograd_reference(hidden, blocks, head, module, 0.7, weighting, unary)
    ref_grads = torch.autograd.grad(ref, params)
    m = int(blocks.label_mask.sum())
    injected = 0
    for chunk in (1, 3, m + 1):
        out = block_loss(hidden, blocks, head, 4.0 if weighting == "decay" else None, chunk=chunk, selector=term,
                         weighting=weighting)
        assert_close(out.loss, ref, atol=1e-5, rtol=1e-5, what=f"loss, chunk {chunk}")  # float32 loss math
        assert_close(out.selector_ce_sum, ref_sel, atol=1e-4, rtol=1e-5, what=f"selector CE sum, chunk {chunk}")
        grads = torch.autograd.grad(out.loss, params)
        for got, want, name in zip(grads, ref_grads, ["hidden", "projection", "predecessor", "successor", "head"]):
            assert_close(got, want, atol=1e-6, rtol=1e-4, what=f"gradient of the {name}, chunk {chunk}")
    top = ((hidden.view(2, 5, B, H)[:, :, 1:] @ head.t()).topk(K, -1).indices == blocks.labels[..., None]).any(-1)
    injected = int((~top & blocks.label_mask).sum())
    assert 0 < injected < m  # both kinds of slot are in the case


def _v2_drafter():
    from models.drafter2 import DFlash2DraftModel
    from tests.helpers.dflash2 import random_dflash2, tiny_dflash2_config

    cfg = tiny_dflash2_config(hidden_size=H, head_dim=8, intermediate_size=64, vocab_size=V, mask_token_id=MASK,
                              block_size=B, target_layer_ids=[1, 3], selector_rank=R, selector_top_k=K)
    d = random_dflash2(cfg, seed=2).train()
    assert isinstance(d, DFlash2DraftModel)
    torch.manual_seed(4)
    emb, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    for p in (*emb.parameters(), *head.parameters()):
        p.requires_grad_(False)
    return d.bind_target(emb, head), emb, head


def _v2_step(split: list[list[int]], overrides: list[str], tmp_path):
    """train_step of a DFlash2 drafter over the rows of _rows() in the micro-batches ``split``: (stats, grads)."""
    import types

    from accelerate import Accelerator

    from train.config import load_config
    from train.loop import MicroBatch, Run, train_step
    from train.rng import row_generators

    cfg = load_config(["recipe=tiny", "drafter.variant=dflash2", "drafter.block_size=4", "train.clip=0",
                       "train.mixed_precision=no", "train.ce_chunk=3", "train.selector_loss_alpha=0.6", *overrides])
    d, emb, head = _v2_drafter()
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2))
    provider = types.SimpleNamespace(get_batch=lambda rows: types.SimpleNamespace(
        features=feats[rows], topk_ids=None, topk_logprobs=None))
    micro = []
    for rows in split:
        blocks = draw_blocks(ids[rows], lm[rows], doc[rows], pos[rows], 6, B, MASK, row_generators(0, 0, rows))
        micro.append(MicroBatch(rows, None, blocks, doc[rows], pos[rows], True, int(lm[rows].numel())))
    run = Run(cfg, Accelerator(cpu=True, mixed_precision="no"), tmp_path, "", "no", print)
    optimizer = GradCapture(d)
    target = types.SimpleNamespace(embed_tokens=emb, lm_head=head)
    stats = train_step(run, d, optimizer, types.SimpleNamespace(step=lambda: None), target, provider, micro, d.config)
    return stats, optimizer.grads


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_a_dflash2_step_in_micro_batches_is_the_one_big_batch_step(weighting, tmp_path):
    """train_step with 2 rows in one micro-batch, and with 1 row in each of 2 (accumulation), logs the loss and the
    selector CE and leaves the gradients of one block_loss over both rows (LM head in chunks of 3 slots): the
    selector term is normalised with the unary one, so it is exact across micro-batches too."""
    from train.blocks import attention_masks
    from train.objective import drafter_forward
    from train.selector_loss import block_embedder, selector_term
    from train.rng import row_generators

    over = [f"train.loss_weighting={weighting}"] + ([] if weighting == "dpace" else ["train.gamma=4"])
    one, g_one = _v2_step([[0, 1]], over, tmp_path)
    two, g_two = _v2_step([[0], [1]], [*over, "train.grad_accum=2"], tmp_path)
    d, emb, head = _v2_drafter()
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2))
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, row_generators(0, 0, [0, 1]))
    hidden = drafter_forward(d, block_embedder(d, emb), blocks, feats, pos,
                             attention_masks(d.config, blocks, doc, pos, False))
    ref = block_loss(hidden, blocks, head.weight, 4.0 if weighting == "decay" else None, weighting=weighting,
                     selector=selector_term(d, 0.6))
    ref.loss.backward()
    for name, (stats, grads) in {"1 x 2 rows": (one, g_one), "2 x 1 row": (two, g_two)}.items():
        assert_close(stats.loss, ref.loss.detach(), atol=1e-6, rtol=1e-6, what=f"loss, {name}")
        assert_close(stats.selector_ce_sum, ref.selector_ce_sum, atol=1e-5, rtol=1e-6, what=f"selector CE, {name}")
        for k, p in d.named_parameters():
            assert_close(grads[k], p.grad, atol=1e-7, rtol=1e-5, what=f"gradient of {k}, {name}")


# ----------------------------------------------------------------------------- the drafter's own functions
def test_gradients_reach_every_selector_and_conv_parameter():
    """One loss backward of a trained-like DFlash2 drafter sends a finite, non-zero gradient to every parameter,
    each conv's and the selector's included. From the fresh init (identity convs, zero hidden_projection) every
    parameter has a gradient (none unused: DDP needs them all) and hidden_projection's is not zero, so the edge
    term leaves zero at the first step; the codebooks' are zero there only because the projection is."""
    from models.drafter2 import DFlash2DraftModel
    from train.blocks import attention_masks
    from train.objective import drafter_forward
    from train.selector_loss import block_embedder, selector_term

    d, emb, head = _v2_drafter()
    fresh = DFlash2DraftModel(d.config).init_weights().bind_target(emb, head).train()
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2))
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    for model in (d, fresh):
        hidden = drafter_forward(model, block_embedder(model, emb), blocks, feats, pos,
                                 attention_masks(model.config, blocks, doc, pos, False))
        block_loss(hidden, blocks, head.weight, 4.0, chunk=7, selector=selector_term(model)).loss.backward()
    names = [k for k, _ in d.named_parameters()]
    assert any("_conv." in k for k in names) and any("candidate_selector." in k for k in names)
    for k, p in d.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, k
    for k, p in fresh.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), k
    assert fresh.candidate_selector.hidden_projection.weight.grad.abs().sum() > 0


def test_the_simulated_acceptance_of_a_dflash2_drafter_is_its_selector_walk():
    """block_loss's ``correct`` for DFlash2 is the drafter's own proposal (``propose``, what the loops call: the walk
    from the bonus token over the unary top-K) compared with the labels, block by block; ``unary_correct`` is the
    unary argmax's. The selector is set to disagree with the argmax, so the two differ."""
    from train.blocks import attention_masks
    from train.objective import drafter_forward
    from train.selector_loss import block_embedder, selector_term

    d, emb, head = _v2_drafter()
    with torch.no_grad():
        d.candidate_selector.hidden_projection.weight.mul_(30)  # a strong edge term: the walk leaves the argmax
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2))
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = drafter_forward(d, block_embedder(d, emb), blocks, feats, pos,
                                 attention_masks(d.config, blocks, doc, pos, False))
        out = block_loss(hidden, blocks, head.weight, 4.0, chunk=5, selector=selector_term(d))
        slots = hidden.view(2, -1, B, H)[:, :, 1:]
        walked = d.propose(slots.flatten(0, 1), blocks.block_ids[..., 0].flatten()).tokens.view_as(blocks.labels)
        argmax = d.logits(slots).argmax(-1)
    mask = blocks.label_mask
    assert torch.equal(out.correct, (walked == blocks.labels) & mask)
    assert torch.equal(out.unary_correct, (argmax == blocks.labels) & mask)
    assert not torch.equal(walked[mask], argmax[mask])
