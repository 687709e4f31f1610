"""The training objective against the rule itself: anchors, labels, mask (naive references), flex == dense."""

from __future__ import annotations

import pytest
import torch

from models.config import DFlashConfig
from models.drafter import DFlashDraftModel
from tests.helpers import GradCapture, assert_close
from train.config import load_config
from train.blocks import attention_masks, dense_mask, draw_blocks, flex_block_mask
from train.objective import block_loss, drafter_forward, simulated_acceptance, slot_weights
from train.overrides import ConfigKeyError

B, H, V, MASK = 4, 32, 64, 63


def _rows():
    """Two rows: one unpacked with a user turn between two answers, one packed (2 docs) + padding."""
    g = torch.Generator().manual_seed(1)
    b, s = 2, 40
    ids = torch.randint(0, 60, (b, s), generator=g)
    lm = torch.zeros(b, s, dtype=torch.long)
    lm[0, 5:15] = 1
    lm[0, 22:34] = 1
    lm[1, 8:18] = 1
    lm[1, 24:33] = 1
    doc = torch.zeros(b, s, dtype=torch.long)
    doc[1, 20:35] = 1
    doc[1, 35:] = -1  # padding
    lm[1, 35:] = 0
    pos = torch.arange(s).expand(b, s).clone()
    pos[1, 20:35] = torch.arange(15)
    pos[1, 35:] = 0
    return ids, lm, doc, pos


def _drafter(layer_types=None):
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=V, num_target_layers=8, target_layer_ids=[1, 3],
                       mask_token_id=MASK, block_size=B, torch_dtype="float32", layer_types=layer_types or [],
                       sliding_window=6 if layer_types else None)
    d = DFlashDraftModel(cfg)
    emb, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    d.bind_target(emb, head)
    return d, emb, head


@pytest.mark.parametrize("holes", [False, True])
def test_anchors_and_labels_follow_the_rule(holes):
    ids, lm, doc, pos = _rows()
    if holes:  # one-token holes inside the answers (a masked tool result): a block spans them, and no
        lm[:, 3::5] = 0  # slot after a hole is scored, even where the loss mask starts again
    blocks = draw_blocks(ids, lm, doc, pos, num_anchors=64, block_size=B, mask_token_id=MASK,
                         generator=torch.Generator().manual_seed(0))
    b, s = ids.shape
    for r in range(b):
        cands = {a for a in range(s - 1) if lm[r, a] and lm[r, a + 1] and doc[r, a] == doc[r, a + 1] >= 0}
        got = [int(a) for a, v in zip(blocks.anchors[r], blocks.valid[r]) if v]
        assert set(got) == cands and len(got) == len(cands), "64 >= candidates: every candidate is an anchor once"
        for n, a in enumerate(blocks.anchors[r].tolist()):
            if not blocks.valid[r, n]:
                assert not blocks.label_mask[r, n].any()
                continue
            assert blocks.block_ids[r, n].tolist() == [int(ids[r, a])] + [MASK] * (B - 1)
            assert blocks.positions[r, n].tolist() == [int(pos[r, a]) + k for k in range(B)]
            alive = True
            for k in range(1, B):
                p = a + k
                alive = alive and p < s and bool(lm[r, p]) and doc[r, p] == doc[r, a]
                assert bool(blocks.label_mask[r, n, k - 1]) == alive, (r, a, k)
                if alive:
                    assert blocks.labels[r, n, k - 1] == ids[r, p]


def test_anchor_draw_is_seeded_and_subsamples():
    ids, lm, doc, pos = _rows()
    draw = lambda seed: draw_blocks(ids, lm, doc, pos, 5, B, MASK, torch.Generator().manual_seed(seed)).anchors
    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4)), "a new epoch (new seed) must redraw the anchors"
    assert draw(3).shape == (2, 5)


def naive_mask(blocks, doc, window=None, block_causal=False, pos=None):
    b, n = blocks.anchors.shape
    s = doc.shape[1]
    m = torch.zeros(b, 1, n * B, s + n * B, dtype=torch.bool)
    for r in range(b):
        for qn in range(n):
            a, d = int(blocks.anchors[r, qn]), int(blocks.doc[r, qn])
            for j in range(B):
                q = qn * B + j
                for t in range(s):  # context strictly before the anchor, same document
                    ok = t < a and int(doc[r, t]) == d
                    if window is not None:
                        ok = ok and int(blocks.positions[r, qn, j]) - int(pos[r, t]) < window
                    m[r, 0, q, t] = ok
                for kn in range(n):  # own block only
                    for i in range(B):
                        m[r, 0, q, s + kn * B + i] = kn == qn and (not block_causal or i <= j)
    return m


@pytest.mark.parametrize("window,causal", [(None, False), (6, False), (6, True)])
def test_dense_mask_equals_naive_reference(window, causal):
    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    got = dense_mask(blocks, doc, window=window, block_causal=causal, position_ids=pos)
    assert torch.equal(got, naive_mask(blocks, doc, window, causal, pos))


def test_flex_mask_equals_naive_reference():
    from torch.nn.attention.flex_attention import create_mask

    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    bm = flex_block_mask(blocks, doc)
    dense = create_mask(bm.mask_mod, 2, 1, 6 * B, doc.shape[1] + 6 * B, device="cpu")
    assert torch.equal(dense, naive_mask(blocks, doc))


@pytest.mark.parametrize("sliding", [False, True])
def test_flex_forward_equals_dense_loss(sliding):
    """CPU flex attention has a forward only: same hidden states and loss as the dense SDPA path."""
    d, emb, head = _drafter(["sliding_attention", "full_attention"] if sliding else None)
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2))
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    dense_h = drafter_forward(d, emb, blocks, feats, pos, attention_masks(d.config, blocks, doc, pos, use_flex=False))
    dense = block_loss(dense_h, blocks, head.weight, 4.0, chunk=7)
    with torch.no_grad():
        flex_h = drafter_forward(d, emb, blocks, feats, pos, attention_masks(d.config, blocks, doc, pos, use_flex=True))
        flex = block_loss(flex_h, blocks, head.weight, 4.0, chunk=7)
    scored = blocks.valid.repeat_interleave(B, dim=1)
    assert_close(flex_h[scored], dense_h.detach()[scored], atol=1e-5, what="flex vs dense hidden")
    assert_close(flex.loss, dense.loss.detach(), atol=1e-6, what="flex vs dense loss")
    dense.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in d.parameters())


def test_loss_is_decayed_normalised_ce():
    d, emb, head = _drafter()
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H)
    blocks = draw_blocks(ids, lm, doc, pos, 8, B, MASK, torch.Generator().manual_seed(0))
    hidden = drafter_forward(d, emb, blocks, feats, pos, dense_mask(blocks, doc))
    out = block_loss(hidden, blocks, head.weight, 4.0, chunk=5)
    # Reference: whole logits at once, explicit weights.
    logits = head(hidden.view(2, -1, B, H)[:, :, 1:])
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none")
    w = (slot_weights(B, 4.0).expand_as(blocks.labels) * blocks.label_mask).flatten()
    assert_close(out.loss, (w * ce).sum() / w.sum(), atol=1e-6, what="chunked decayed CE")
    assert_close(slot_weights(16, 7.0)[[0, 7]], torch.tensor([1.0, torch.exp(torch.tensor(-1.0))]), atol=1e-7)
    acc = simulated_acceptance(out.correct, out.label_mask, out.valid)
    pred = logits.argmax(-1) == blocks.labels
    lead = (pred & blocks.label_mask).long().cumprod(-1).sum(-1) + 1
    assert_close(acc["tau_sum"] / acc["blocks"], lead[blocks.valid].float().mean(), what="simulated tau")


def test_kl_loss_uses_top_k_teacher():
    d, emb, head = _drafter()
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H)
    blocks = draw_blocks(ids, lm, doc, pos, 8, B, MASK, torch.Generator().manual_seed(0))
    hidden = drafter_forward(d, emb, blocks, feats, pos, dense_mask(blocks, doc))
    # A teacher whose top-k covers the whole vocabulary: top-k KL is then the exact KL.
    teacher = torch.log_softmax(torch.randn(2, ids.shape[1], V), -1)
    lp, ti = teacher.topk(V, dim=-1)
    out = block_loss(hidden, blocks, head.weight, 4.0, mode="kl", topk_ids=ti, topk_logprobs=lp)
    src = (blocks.anchors[:, :, None] + torch.arange(B - 1)).clamp(max=ids.shape[1] - 1)
    t = teacher.gather(1, src.flatten(1)[..., None].expand(-1, -1, V)).view(2, -1, B - 1, V)
    q = torch.log_softmax(head(hidden.view(2, -1, B, H)[:, :, 1:]), -1)
    kl = (t.exp() * (t - q)).sum(-1)
    w = slot_weights(B, 4.0).expand_as(kl) * blocks.label_mask
    assert_close(out.loss, (w * kl).sum() / w.sum(), atol=1e-5, what="top-k KL")
    out.loss.backward()


def test_config_rejects_unknown_keys_with_closest():
    with pytest.raises(ConfigKeyError, match="did you mean 'train.lr'"):
        load_config(["recipe=tiny", "train.lrate=1e-3"])
    with pytest.raises(ConfigKeyError, match="did you mean 'data.max_length'"):
        load_config(["recipe=tiny", "data.max_len=10"])
    cfg = load_config(["recipe=qwen3-8b", "train.lr=3e-4", "data.max_length=4096", "features.mode=offline",
                       "features.store=/x", "--dry-run"])
    assert (cfg.train.lr, cfg.data.max_length, cfg.features.mode, cfg.dry_run) == (3e-4, 4096, "offline", True)
    for name in ("qwen35-4b", "qwen35-9b", "qwen35-27b", "qwen35-35b-a3b", "qwen3-8b", "llama31-8b"):
        c = load_config([f"recipe={name}"])
        assert (c.drafter.num_hidden_layers, c.drafter.num_taps, c.drafter.block_size, c.gamma, c.train.anchors,
                c.train.lr, c.train.warmup_ratio, c.train.clip, c.train.epochs, c.data.max_length) == \
            (5, 5, 16, 7.0, 512, 6e-4, 0.04, 1.0, 6, 3072), name


def test_yaml_boolean_spellings_stay_strings_for_string_keys():
    """`no` is YAML for False; `train.mixed_precision=no` (the documented fp32 value) must still mean "no"."""
    assert load_config(["recipe=tiny", "train.mixed_precision=no"]).train.mixed_precision == "no"
    assert load_config(["recipe=tiny", "train.mixed_precision=bf16"]).train.mixed_precision == "bf16"


def test_dry_run_qwen35_9b_offline(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from train.distill import main

    plan = main(["recipe=qwen35-9b", "--dry-run", "out_dir=/nonexistent/never-written"])
    text = capsys.readouterr().out
    assert "could not fetch config.json of Qwen/Qwen3.5-9B" in text
    assert plan["target_shape"]["num_hidden_layers"] == 32 and plan["target_layer_ids"] == [1, 8, 15, 22, 29]
    assert plan["drafter"]["layers"] == 5 and plan["memory_per_gpu"]["total_gib"] > 0


@pytest.mark.parametrize("mode", ["ce", "kl", "ce+kl"])
def test_frozen_head_gradient_from_forward_equals_autograd(mode):
    """The frozen head's ``d loss / d hidden``, computed while each chunk's logits exist, equals plain
    autograd through whole logits (repeated top-k ids and -inf teacher entries included)."""
    torch.manual_seed(3)
    b, k = 2, 5
    hidden = torch.randn(b, 6 * B, H, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, H, dtype=torch.float64) / H ** 0.5
    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    s = ids.shape[1]
    ti = torch.randint(0, V, (b, s, k))
    ti[..., 1] = ti[..., 0]
    lp = torch.log_softmax(torch.randn(b, s, k, dtype=torch.float64), -1)
    lp[..., -1] = -float("inf")
    kw = dict(mode=mode, kl_weight=0.7, topk_ids=ti, topk_logprobs=lp)
    out = block_loss(hidden, blocks, head, 4.0, chunk=7, **kw)
    (g,) = torch.autograd.grad(out.loss, hidden)
    ref = block_loss(hidden, blocks, head.requires_grad_(), 4.0, chunk=10 ** 6, **kw)  # trained head: checkpoint path
    (g_ref,) = torch.autograd.grad(ref.loss, hidden)
    assert_close(out.loss, ref.loss, atol=1e-6, what=f"{mode} loss")
    assert_close(g, g_ref, atol=1e-7, rtol=1e-5, what=f"{mode} grad")
    assert torch.equal(out.correct, ref.correct)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    """train.grad_checkpointing recomputes each drafter layer in the backward (a flag on the drafter,
    no patched forward): same loss and gradients as keeping the activations."""
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2))
    grads, calls = [], []
    for flag in (False, True):
        d, emb, head = _drafter()
        d.gradient_checkpointing = flag
        d.train()
        n, mlp = [], d.layers[0].mlp.forward  # a spy: module hooks do not fire during checkpoint recompute
        d.layers[0].mlp.forward = lambda x, mlp=mlp, n=n: (n.append(1), mlp(x))[1]
        blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
        mask = attention_masks(d.config, blocks, doc, pos, use_flex=False)
        out = block_loss(drafter_forward(d, emb, blocks, feats, pos, mask), blocks, head.weight, 4.0, chunk=7)
        out.loss.backward()
        grads.append((out.loss.detach(), {k: p.grad.clone() for k, p in d.named_parameters()}))
        calls.append(len(n))
    assert calls == [1, 2]  # with the flag, the layer runs again in the backward pass
    assert_close(grads[1][0], grads[0][0], atol=0, what="loss with gradient checkpointing")
    for k, g in grads[0][1].items():
        assert_close(grads[1][1][k], g, atol=1e-6, what=f"gradient of {k} with checkpointing")


def test_console_rows_keep_small_learning_rates():
    """Console rows once rounded to 4 decimals, so lr 6e-5 printed as 0.0 (metrics.jsonl was exact)."""
    from train.metrics import step_line

    row = {"step": 3, "epoch": 0.1, "loss": 4.215631, "tau": 1.0, "lr": 6e-5, "grad_norm": 0.0, "tau_hist": [1, 2],
           "tokens_per_s": 10.0}
    assert "  lr 6.00e-05  " in step_line(row, 10, 1.0) and "grad_norm 0" in step_line(row, 10, 1.0)


def test_held_out_prompts_start_at_their_own_document():
    """A packed held-out row's prompt is its document's tokens before the first answer, not the whole
    row before it (that would prepend another conversation to the true-tau prompt)."""
    from train.eval import held_out_prompts

    ids = list(range(100, 107))
    rows = [{"input_ids": ids, "doc_ids": [0, 0, 0, 1, 1, 1, 1], "loss_mask": [0, 1, 1, 0, 0, 1, 1]},
            {"input_ids": ids, "doc_ids": [0, 0, 0, 1, 1, 1, 1], "loss_mask": [0, 0, 0, 0, 0, 1, 1]},
            {"input_ids": ids, "doc_ids": [0] * 7, "loss_mask": [0] * 7},  # no answer: no prompt
            {"input_ids": ids, "doc_ids": [0] * 7, "loss_mask": [1] * 7},  # answer from the first token: none
            {"input_ids": ids, "doc_ids": [0] * 7, "loss_mask": [0, 0, 1, 1, 1, 1, 1]}]
    assert held_out_prompts(rows, 10) == [[100], [103, 104], [100, 101]]
    assert held_out_prompts(rows, 2) == [[100], [103, 104]]


def test_true_tau_pools_cycles_and_counts_each_generations_last_cycle_in_full_when_uncut(monkeypatch):
    """eval_tau_true = committed tokens / cycles over all prompts; the uncut figure counts each generation's
    last cycle (cut by EOS or the budget) with its full acceptance, as validate's tau_uncut does."""
    import inference.torch_loop as loop
    from inference.stats import GenerationResult
    from train.eval import true_tau

    results = iter([GenerationResult([], acceptance_lengths=[3, 2, 1], last_cycle_uncut=5),  # the budget cut it
                    GenerationResult([], acceptance_lengths=[4, 1], last_cycle_uncut=1)])  # an EOS ended it whole
    monkeypatch.setattr(loop, "DrafterProposer", lambda drafter, target: None)
    monkeypatch.setattr(loop, "dflash_generate", lambda target, proposer, prompt, max_new_tokens: next(results))
    drafter = torch.nn.Linear(2, 2).train()
    out = true_tau(drafter, None, [[1, 2], [3]], max_new_tokens=8)
    assert out == {"eval_tau_true": pytest.approx(11 / 5), "eval_true_cycles": 5,
                   "eval_tau_true_uncut": pytest.approx(15 / 5), "eval_true_hist": {"1": 2, "2": 1, "3": 1, "4": 1}}
    assert drafter.training  # put back in training mode


def test_simulated_eval_averages_losses_over_batches_and_pools_blocks(monkeypatch):
    """eval_loss is the mean of the held-out batches' losses; tau and the per-slot figures pool the
    blocks of all batches; batches past eval.batches are not read. The model parts are stand-ins
    with known outputs, so the numbers follow from the definitions alone."""
    import types

    import train.eval as ev

    T, F = True, False
    outputs = iter([(2.0, [[[T, T, F]]], [[[T, T, T]]], [[T]]),
                    (4.0, [[[F, T, T], [T, T, T]]], [[[T, T, T], [T, T, F]]], [[T, T]])])

    def loss(*args, **kwargs):
        value, correct, label_mask, valid = next(outputs)
        return types.SimpleNamespace(loss=torch.tensor(value), correct=torch.tensor(correct),
                                     label_mask=torch.tensor(label_mask), valid=torch.tensor(valid))

    for name in ("draw_blocks", "attention_masks", "drafter_forward"):
        monkeypatch.setattr(ev, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(ev, "block_loss", loss)
    read = []

    def get_batch(rows):
        read.append(list(rows))
        z = torch.zeros(len(rows), 4, dtype=torch.long)
        return types.SimpleNamespace(input_ids=z, loss_mask=z, doc_ids=z, position_ids=z, features=z.float())

    drafter = torch.nn.Linear(2, 2).train()
    drafter.config = types.SimpleNamespace(block_size=4, mask_token_id=0)
    target = types.SimpleNamespace(device=torch.device("cpu"), embed_tokens=None, lm_head=torch.nn.Linear(2, 2))
    out = ev.evaluate_sim(drafter, target, types.SimpleNamespace(get_batch=get_batch), [10, 11, 12, 13, 14],
                          batch_size=2, num_anchors=2, gamma=7.0, seed=0, max_batches=2, use_flex=False, ce_chunk=8)
    assert read == [[10, 11], [12, 13]]  # the third batch (row 14) is past eval.batches
    assert out["eval_loss"] == pytest.approx(3.0) and out["eval_blocks"] == 3
    assert out["eval_tau_sim"] == pytest.approx(7 / 3)  # blocks accept 3, 1 and 3
    assert out["eval_pos_acc"] == [pytest.approx(0.6667), 1.0, 0.5]
    assert out["eval_pos_accept"] == [pytest.approx(0.6667), pytest.approx(0.6667), 0.0]
    assert drafter.training  # back in training mode


def test_padding_positions_are_never_anchors():
    """A negative document id is padding: no anchor there, even under a set loss mask."""
    ids = torch.arange(10)[None]
    lm = torch.ones(1, 10, dtype=torch.long)
    doc = torch.tensor([[0, 0, 0, 0, 0, -1, -1, -1, -1, -1]])
    blocks = draw_blocks(ids, lm, doc, None, 16, B, MASK, torch.Generator().manual_seed(0))
    assert blocks.anchors[blocks.valid].tolist() == [0, 1, 2, 3]


def test_rows_without_candidates_get_one_padding_block_and_a_zero_loss():
    """No answer anywhere in the batch: one invalid block per row (the drafter pass keeps a shape),
    nothing scored, and a zero loss that still reaches the graph."""
    d, emb, head = _drafter()
    ids, _, doc, pos = _rows()
    lm = torch.zeros_like(ids)
    blocks = draw_blocks(ids, lm, doc, pos, 8, B, MASK, torch.Generator().manual_seed(0))
    assert blocks.anchors.shape == (2, 1) and not blocks.valid.any() and not blocks.label_mask.any()
    hidden = drafter_forward(d, emb, blocks, torch.randn(2, ids.shape[1], 2 * H), pos, dense_mask(blocks, doc))
    out = block_loss(hidden, blocks, head.weight, 4.0)
    assert out.loss.item() == 0.0 and out.scored == 0 and out.loss.requires_grad


def test_per_row_anchors_do_not_depend_on_the_padding_width():
    """With one generator per row, a row padded to a longer batch keeps the anchors it gets alone
    (subsampled: 3 of its candidates), so batch_size x grad_accum can be traded."""
    ids, lm, doc, pos = _rows()
    row = lambda x, width: torch.nn.functional.pad(x[:1], (0, width))  # noqa: E731
    alone = draw_blocks(ids[:1], lm[:1], doc[:1], pos[:1], 3, B, MASK, [torch.Generator().manual_seed(5)])
    for width in (1, 7, 40):
        padded = draw_blocks(row(ids, width), row(lm, width), row(doc, width), row(pos, width), 3, B, MASK,
                             [torch.Generator().manual_seed(5)])
        assert torch.equal(padded.anchors, alone.anchors), width


def test_each_row_draws_from_its_own_generator():
    """A batch with one generator per row gives each row the anchors it gets alone with its generator."""
    ids, lm, doc, pos = _rows()
    gens = lambda: [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]  # noqa: E731
    both = draw_blocks(ids, lm, doc, pos, 3, B, MASK, gens())
    for r, g in enumerate(gens()):
        alone = draw_blocks(ids[r:r + 1], lm[r:r + 1], doc[r:r + 1], pos[r:r + 1], 3, B, MASK, [g])
        assert torch.equal(both.anchors[r], alone.anchors[0]), r


def test_padding_blocks_come_after_the_real_ones():
    """Chosen anchors are sorted by position with the invalid (padding) blocks last."""
    ids, lm, doc, pos = _rows()
    lm[1] = 0
    lm[1, 30:33] = 1  # row 1 has 2 candidates, row 0 many
    for seed in range(5):
        blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(seed))
        assert blocks.valid[1].tolist() == [True, True, False, False, False, False]
        assert blocks.anchors[1].tolist() == [30, 31, 0, 0, 0, 0]


def test_no_slot_is_scored_past_the_end_of_the_row():
    """An answer that runs to the last token: the slots past the row's end have no label."""
    ids = torch.arange(8)[None]
    lm = torch.ones(1, 8, dtype=torch.long)
    blocks = draw_blocks(ids, lm, None, None, 16, B, MASK, torch.Generator().manual_seed(0))
    assert blocks.anchors[0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert blocks.label_mask[0, -3:].tolist() == [[True, True, True], [True, True, False], [True, False, False]]
    assert blocks.labels[0, -3:][blocks.label_mask[0, -3:]].tolist() == [5, 6, 7, 6, 7, 7]  # the last token included
    # No position ids given: the row's own positions, so slot k of the block at a sits at a + k.
    assert torch.equal(blocks.positions[0], blocks.anchors[0, :, None] + torch.arange(B))


def test_labels_stop_at_a_document_boundary():
    """Two packed documents whose answers touch: a block anchored near the end of the first one is
    not scored on the second one's tokens."""
    ids = torch.arange(10)[None]
    lm = torch.ones(1, 10, dtype=torch.long)
    doc = torch.tensor([[0] * 5 + [1] * 5])
    blocks = draw_blocks(ids, lm, doc, None, 16, B, MASK, torch.Generator().manual_seed(0))
    assert blocks.anchors[0].tolist() == [0, 1, 2, 3, 5, 6, 7, 8]
    assert blocks.label_mask[0, 3].tolist() == [True, False, False]  # anchor 3: only token 4 is its document's
    assert blocks.label_mask[0, 2].tolist() == [True, True, False]


def test_kl_teacher_near_the_end_of_the_row():
    """Blocks anchored near the row's end read the teacher at the last positions (slots past the
    end are not scored, and their teacher index stays inside the row)."""
    torch.manual_seed(0)
    s = 8
    ids = torch.randint(0, V, (1, s))
    lm = torch.ones(1, s, dtype=torch.long)
    blocks = draw_blocks(ids, lm, None, None, 16, B, MASK, torch.Generator().manual_seed(0))
    assert int(blocks.anchors.max()) == s - 2
    hidden = torch.randn(1, blocks.num_blocks * B, H)
    head = torch.randn(V, H)
    teacher = torch.log_softmax(torch.randn(1, s, V), -1)
    lp, ti = teacher.topk(V, dim=-1)
    out = block_loss(hidden, blocks, head, 4.0, mode="kl", topk_ids=ti, topk_logprobs=lp)
    q = torch.log_softmax(hidden.view(1, -1, B, H)[:, :, 1:] @ head.t(), -1)
    num = den = 0.0
    for n, a in enumerate(blocks.anchors[0].tolist()):
        for k in range(1, B):
            if a + k < s:
                t = teacher[0, a + k - 1]
                w = float(slot_weights(B, 4.0)[k - 1])
                num, den = num + w * float((t.exp() * (t - q[0, n, k - 1])).sum()), den + w
    assert_close(out.loss, num / den, atol=1e-5, what="KL with blocks at the row's end")


def test_sliding_layers_get_a_causal_block_only_when_configured():
    """``sliding_block_attention: causal``: sliding layers see earlier slots of their block only;
    full-attention layers keep the bidirectional block."""
    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    d, _, _ = _drafter(["sliding_attention", "full_attention"])
    for mode, causal in (("causal", True), ("bidirectional", False)):
        d.config.sliding_block_attention = mode
        masks = attention_masks(d.config, blocks, doc, pos, use_flex=False)
        assert torch.equal(masks["sliding_attention"], naive_mask(blocks, doc, 6, causal, pos)), mode
        assert torch.equal(masks["full_attention"], naive_mask(blocks, doc)), mode


@pytest.mark.parametrize("window,causal", [(6, False), (6, True), (None, True)])
def test_flex_mask_with_window_or_causal_block_equals_naive_reference(window, causal):
    from torch.nn.attention.flex_attention import create_mask

    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    bm = flex_block_mask(blocks, doc, window=window, block_causal=causal, position_ids=pos)
    dense = create_mask(bm.mask_mod, 2, 1, 6 * B, doc.shape[1] + 6 * B, device="cpu")
    assert torch.equal(dense, naive_mask(blocks, doc, window, causal, pos))


@pytest.mark.parametrize("flex", [False, True])
def test_window_mask_without_position_ids_uses_the_row_positions(flex):
    """No position ids: the window counts plain row positions 0..s-1 (an unpacked row)."""
    from torch.nn.attention.flex_attention import create_mask

    ids, lm, doc, pos = _rows()
    ids, lm, doc, pos = ids[:1], lm[:1], doc[:1], pos[:1]  # row 0: its positions are 0..s-1
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    if flex:
        bm = flex_block_mask(blocks, doc, window=6)
        got = create_mask(bm.mask_mod, 1, 1, 6 * B, doc.shape[1] + 6 * B, device="cpu")
    else:
        got = dense_mask(blocks, doc, window=6)
    assert torch.equal(got, naive_mask(blocks, doc, 6, False, pos))


def test_correct_marks_the_scored_slots_whose_argmax_is_the_label():
    """``correct`` (the simulated tau's input) is True exactly where the drafter's top token is the
    label: an identity head makes the logits the hidden states, and about half the scored slots get
    a large value at their label (the others a large negative one)."""
    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 6, B, V, generator=torch.Generator().manual_seed(1))
    hit = blocks.label_mask & (torch.rand(blocks.label_mask.shape, generator=torch.Generator().manual_seed(2)) < 0.5)
    slots = hidden[:, :, 1:]
    slots.scatter_add_(-1, blocks.labels[..., None], 20.0 * (2 * hit[..., None].float() - 1))
    out = block_loss(hidden.view(2, 6 * B, V), blocks, torch.eye(V), 4.0, chunk=5)
    assert hit.any() and (blocks.label_mask & ~hit).any()
    assert torch.equal(out.correct, hit)


def test_simulated_acceptance_leaves_padding_blocks_out():
    """Sums over valid blocks only; a scored slot after a miss still counts for pos_correct, not for
    pos_accept."""
    T, F = True, False
    correct = torch.tensor([[[T, F, T], [T, T, F], [F, F, F]]])
    label_mask = torch.tensor([[[T, T, T], [T, T, F], [F, F, F]]])
    valid = torch.tensor([[T, T, F]])  # the third block is padding
    acc = simulated_acceptance(correct, label_mask, valid)
    assert acc["tau_sum"].item() == 2 + 3 and acc["blocks"].item() == 2
    assert acc["pos_correct"].tolist() == [2, 1, 1] and acc["pos_count"].tolist() == [2, 2, 1]
    assert acc["pos_accept"].tolist() == [2, 1, 0]


@pytest.mark.parametrize("mode", ["kl", "ce+kl"])
def test_half_precision_teacher_log_probs_give_the_fp32_loss_and_gradient(mode):
    """An offline store keeps the top-k log-probs in float16: the loss and the frozen head's gradient
    are those of the same values in float32 (the loss math runs in fp32)."""
    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 6 * B, H, requires_grad=True)
    head = torch.randn(V, H) / H ** 0.5
    lp, ti = torch.log_softmax(torch.randn(2, ids.shape[1], V), -1).topk(8, dim=-1)
    got, ref = (block_loss(hidden, blocks, head, 4.0, chunk=7, mode=mode, topk_ids=ti, topk_logprobs=t)
                for t in (lp.half(), lp.half().float()))
    assert_close(got.loss, ref.loss, atol=1e-6, what=f"{mode} loss from float16 log-probs")
    (g,), (g_ref,) = (torch.autograd.grad(o.loss, hidden) for o in (got, ref))
    assert_close(g, g_ref, atol=1e-7, what=f"{mode} gradient from float16 log-probs")


@pytest.mark.parametrize("trained_head", [False, True])
def test_backward_keeps_no_chunk_by_vocab_tensor_and_a_trained_head_gets_its_gradient(trained_head):
    """Nothing of shape ``[rows, vocab]`` is kept for the backward (the frozen head keeps ``d loss / d h``,
    a trained head recomputes its chunk), and the gradients equal plain autograd through whole logits."""
    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 6 * B, H, dtype=torch.float64, requires_grad=True)
    head = (torch.randn(V, H, dtype=torch.float64) / H ** 0.5).requires_grad_(trained_head)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(tuple(t.shape)), t)[1], lambda t: t):
        out = block_loss(hidden, blocks, head, 4.0, chunk=7)
    assert not [shape for shape in kept if shape[-1:] == (V,)], kept
    params = (hidden, head) if trained_head else (hidden,)
    grads = torch.autograd.grad(out.loss, params)
    logits = (hidden.view(2, 6, B, H)[:, :, 1:] @ head.t())[blocks.label_mask]
    ce = torch.nn.functional.cross_entropy(logits, blocks.labels[blocks.label_mask], reduction="none")
    w = slot_weights(B, 4.0).double().expand_as(blocks.labels)[blocks.label_mask]
    for g, g_ref, name in zip(grads, torch.autograd.grad((w * ce).sum() / w.sum(), params), ("hidden", "head")):
        assert_close(g, g_ref, atol=1e-6, what=f"gradient of {name}")


def test_loss_and_sums_do_not_depend_on_the_chunk_size():
    """Every chunk size, down to 1 and past the number of scored slots, gives the same loss, CE
    and KL sums; ce_sum and kl_sum are unweighted sums over the scored slots."""
    torch.manual_seed(1)
    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 5, B, MASK, torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 5 * B, H, dtype=torch.float64)
    head = torch.randn(V, H, dtype=torch.float64) / H ** 0.5
    teacher = torch.log_softmax(torch.randn(2, ids.shape[1], V, dtype=torch.float64), -1)
    lp, ti = teacher.topk(V, dim=-1)
    logits = (hidden.view(2, 5, B, H)[:, :, 1:] @ head.t())[blocks.label_mask]
    ce = torch.nn.functional.cross_entropy(logits, blocks.labels[blocks.label_mask], reduction="none")
    m = int(blocks.label_mask.sum())
    ref = block_loss(hidden, blocks, head, 4.0, chunk=10 ** 6, mode="ce+kl", topk_ids=ti, topk_logprobs=lp)
    assert ref.scored == m and m > 3
    assert_close(ref.ce_sum, ce.sum(), atol=1e-4, what="unweighted CE sum")  # the loss math runs in fp32
    assert_close(ref.ce, ce.mean(), atol=1e-5, what="mean CE")
    # top-k covers the whole vocabulary: the exact KL; slot k's teacher is at anchor + k - 1.
    src = (blocks.anchors[:, :, None] + torch.arange(B - 1)).flatten(1)
    t = teacher.gather(1, src[..., None].expand(-1, -1, V)).view(2, 5, B - 1, V)[blocks.label_mask]
    kl = (t.exp() * (t - torch.log_softmax(logits, -1))).sum(-1)
    w = slot_weights(B, 4.0).double().expand_as(blocks.labels)[blocks.label_mask]
    assert_close(ref.kl_sum, kl.sum(), atol=1e-4, what="unweighted KL sum")
    assert_close(ref.loss, (w * (ce + kl)).sum() / w.sum(), atol=1e-5, what="ce+kl loss")
    for chunk in range(1, m + 2):
        out = block_loss(hidden, blocks, head, 4.0, chunk=chunk, mode="ce+kl", topk_ids=ti, topk_logprobs=lp)
        for name in ("loss", "ce_sum", "kl_sum", "weight"):
            assert_close(getattr(out, name), getattr(ref, name), atol=1e-4, what=f"{name}, chunk {chunk}")
        assert torch.equal(out.correct, ref.correct)


def test_each_training_block_equals_a_standalone_drafter_pass_over_its_context():
    """One forward over all blocks with the training mask gives, per block, the hidden states of the
    inference-style pass: only that block, its document's context features before the anchor (at their
    own position ids), no mask. Holds for the unpacked row and for the second document of the packed one."""
    d, emb, _ = _drafter()
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(4))
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = drafter_forward(d, emb, blocks, feats, pos, dense_mask(blocks, doc)).view(2, -1, B, H)
        checked = set()
        for r in range(2):
            for n in range(blocks.num_blocks):
                if not blocks.valid[r, n]:
                    continue
                a = int(blocks.anchors[r, n])
                ctx = [t for t in range(a) if doc[r, t] == doc[r, a]]
                noise = emb(torch.tensor([[int(ids[r, a])] + [MASK] * (B - 1)]))
                p = torch.tensor([[int(pos[r, t]) for t in ctx] + [int(pos[r, a]) + k for k in range(B)]])
                ref = d(noise, feats[r, ctx][None], p)
                assert_close(hidden[r, n], ref[0], atol=1e-5, what=f"row {r} block at {a}")
                checked.add((r, int(doc[r, a])))
    assert checked == {(0, 0), (1, 0), (1, 1)}


def test_loss_weight_is_the_decayed_weight_of_the_scored_slots():
    """loss_weight (the trainer's denominator, known before any forward) is sum_k w_k over scored slots,
    the same figure block_loss reports as its weight; a batch with nothing scored weighs 0."""
    from train.objective import loss_weight

    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    ref = 0.0
    for r, n, k in blocks.label_mask.nonzero().tolist():  # k is slot k + 1
        ref += torch.exp(torch.tensor(-k / 4.0)).item()
    assert_close(loss_weight(blocks, 4.0), torch.tensor(ref), atol=1e-5, what="loss_weight")
    hidden = torch.randn(2, blocks.num_blocks * B, H)
    out = block_loss(hidden, blocks, torch.randn(V, H), 4.0)
    assert_close(out.weight, torch.tensor(ref), atol=1e-5, what="block_loss weight")
    empty = draw_blocks(ids, torch.zeros_like(lm), doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    none = block_loss(torch.randn(2, B, H), empty, torch.randn(V, H), 4.0)
    assert loss_weight(empty, 4.0).item() == 0.0 and none.weight.item() == 0.0 and none.weighted_sum.item() == 0.0


def test_per_row_generators_can_draw_every_candidate():
    """A row's own stream draws uniformly among its candidates, the last one included (it once got no key)."""
    ids = torch.arange(12)[None]
    lm = torch.zeros(1, 12, dtype=torch.long)
    lm[0, 4:8] = 1  # candidates 4, 5, 6 (7's next token is outside the mask)
    counts = {4: 0, 5: 0, 6: 0}
    for seed in range(60):
        blocks = draw_blocks(ids, lm, None, None, 1, B, MASK, [torch.Generator().manual_seed(seed)])
        counts[int(blocks.anchors[0, 0])] += 1
    assert all(c >= 10 for c in counts.values()), counts


def test_blocks_move_whole_to_another_device():
    from dataclasses import fields

    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    moved = blocks.to("meta")
    assert type(moved) is type(blocks)
    for f in fields(blocks):
        got, want = getattr(moved, f.name), getattr(blocks, f.name)
        assert got.device.type == "meta" and got.shape == want.shape and got.dtype == want.dtype, f.name
    same = blocks.to("cpu")
    assert all(torch.equal(getattr(same, f.name), getattr(blocks, f.name)) for f in fields(blocks))


# ----------------------------------------------------------------------------- D-PACE loss weighting
# A 2 x 3 grid of per-slot CE (2 blocks of B = 4): the second block's last slot is past the loss mask.
GRID_CE = [[0.2, 1.0, 0.5], [0.7, 0.1, 9.0]]
GRID_MASK = [[True, True, True], [True, True, False]]


def _grid_by_hand(alpha: float) -> list[list[float]]:
    """The D-PACE weights of GRID_CE, written out: q~ = (1 - alpha) exp(-CE) + alpha, C_k = q~_1 ... q~_k,
    w_j = sum_{k >= j} C_k over the scored k; the masked slot weighs 0 and adds nothing to the sums."""
    import math

    (a1, a2, a3), (b1, b2, _) = [[(1 - alpha) * math.exp(-c) + alpha for c in row] for row in GRID_CE]
    return [[a1 + a1 * a2 + a1 * a2 * a3, a1 * a2 + a1 * a2 * a3, a1 * a2 * a3],
            [b1 + b1 * b2, b1 * b2, 0.0]]


def _grid_blocks():
    """Blocks of one row whose hidden rows give GRID_CE exactly: vocabulary 2, head [[0, 0], [0, 1]], every label 0,
    so a slot's CE is softplus(h[1]) and h[1] = log(exp(CE) - 1) sets it (the masked slot's CE: GRID_CE's 9.0)."""
    from train.blocks import Blocks

    mask = torch.tensor([GRID_MASK])
    blocks = Blocks(anchors=torch.tensor([[0, 4]]), valid=torch.tensor([[True, True]]), doc=torch.zeros(1, 2).long(),
                    block_ids=torch.zeros(1, 2, B).long(), positions=torch.arange(2 * B).view(1, 2, B),
                    labels=torch.zeros(1, 2, B - 1).long(), label_mask=mask,
                    scored_index=mask.flatten().nonzero().squeeze(1))
    hidden = torch.zeros(1, 2, B, 2, dtype=torch.float64)
    hidden[0, :, 1:, 1] = torch.tensor(GRID_CE, dtype=torch.float64).expm1().log()
    head = torch.tensor([[0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    return blocks, hidden.view(1, 2 * B, 2).requires_grad_(), head


def _weights_seen_by_the_gradient(out, hidden) -> torch.Tensor:
    """The weight block_loss gave each slot, read off its gradient: d weighted_sum / d h[1] = w * sigmoid(h[1])."""
    (g,) = torch.autograd.grad(out.weighted_sum, hidden)
    h = hidden.detach().view(2, B, 2)[:, 1:, 1]
    return g.view(2, B, 2)[:, 1:, 1] / torch.sigmoid(h)


@pytest.mark.parametrize("alpha", [0.5, 0.2])
def test_dpace_weights_of_a_fixed_grid_match_the_closed_form(alpha):
    """dpace_weights of the grid equal the hand-written closed form; block_loss uses exactly those (each slot's
    gradient is its weight times its CE's gradient), sums them into `weight` and, per slot, into `slot_weight`."""
    from train.objective import dpace_weights

    want = torch.tensor(_grid_by_hand(alpha), dtype=torch.float64)
    got = dpace_weights(torch.tensor(GRID_CE), torch.tensor(GRID_MASK), alpha)
    assert_close(got, want, atol=1e-6, what="D-PACE weights of the grid")
    blocks, hidden, head = _grid_blocks()
    out = block_loss(hidden, blocks, head, None, weighting="dpace", dpace_alpha=alpha)
    assert_close(out.ce_sum, sum(c for row, m in zip(GRID_CE, GRID_MASK) for c, s in zip(row, m) if s), atol=1e-5,
                 what="the grid's CE")
    assert_close(_weights_seen_by_the_gradient(out, hidden), want, atol=1e-6, what="block_loss's weights")
    assert_close(out.weight, want.sum(), atol=1e-6, what="weight sum")
    assert_close(out.slot_weight, want.sum(0), atol=1e-6, what="weight per slot")


def test_a_masked_slot_changes_nothing():
    """The masked slot counts as q~ = 1 and weighs 0: whatever its CE (here 9, 0.01, or the inf / NaN a garbage
    logit gives), the weights, loss and gradients are the same."""
    from train.objective import dpace_weights

    ce, mask = torch.tensor(GRID_CE), torch.tensor(GRID_MASK)
    ref = dpace_weights(ce, mask, 0.5)
    for other in (0.01, float("inf"), float("nan")):
        changed = ce.clone()
        changed[1, 2] = other
        assert torch.equal(dpace_weights(changed, mask, 0.5), ref), other
    blocks, hidden, head = _grid_blocks()
    outs, grads = [], []
    for h_masked in (hidden.detach()[0, 2 * B - 1, 1].item(), -3.0):
        h = hidden.detach().clone()
        h[0, 2 * B - 1, 1] = h_masked  # the masked slot's hidden row: another CE there
        h.requires_grad_()
        out = block_loss(h, blocks, head, None, weighting="dpace")
        outs.append(out)
        grads.append(torch.autograd.grad(out.loss, h)[0])
    assert outs[0].loss.item() == outs[1].loss.item() and torch.equal(grads[0], grads[1])


def test_dpace_weights_carry_no_gradient():
    """The weights are constants of the backward: from a CE that requires grad they come out detached, and the
    gradient of block_loss is exactly sum_j w_j dCE_j (no d w / d CE term: with one, it would differ)."""
    from train.objective import dpace_weights

    ce = torch.tensor(GRID_CE, requires_grad=True)
    assert not dpace_weights(ce, torch.tensor(GRID_MASK), 0.5).requires_grad
    blocks, hidden, head = _grid_blocks()
    out = block_loss(hidden, blocks, head, None, weighting="dpace")
    (g,) = torch.autograd.grad(out.loss, hidden)
    w = torch.tensor(_grid_by_hand(0.5), dtype=torch.float64)
    ce_rows = torch.nn.functional.softplus(hidden.view(2, B, 2)[:, 1:, 1])  # the grid's CE, differentiable
    (g_const,) = torch.autograd.grad((w * ce_rows).sum() / w.sum(), hidden, retain_graph=True)
    assert_close(g, g_const, atol=1e-7, what="gradient with constant weights")
    q = 0.5 * torch.exp(-ce_rows) + 0.5  # the same weights, differentiable: a different gradient
    reach = torch.cumprod(torch.where(torch.tensor(GRID_MASK), q, torch.ones_like(q)), -1) * torch.tensor(GRID_MASK)
    w_live = reach.flip(-1).cumsum(-1).flip(-1) * torch.tensor(GRID_MASK)
    (g_live,) = torch.autograd.grad((w_live * ce_rows).sum() / w_live.sum(), hidden)
    assert (g_live - g).abs().max() > 1e-3


def test_dpace_with_alpha_1_does_not_depend_on_the_drafter():
    """alpha = 1: every q~ is 1, so w_j = the number of scored slots from j on (B-1, ..., 1 for a whole block),
    whatever the CE: a fixed weighting, and the loss is that fixed weighting's."""
    from train.objective import dpace_weights

    mask = torch.tensor(GRID_MASK)
    for ce in (torch.tensor(GRID_CE), torch.rand(2, 3) * 5):
        assert torch.equal(dpace_weights(ce, mask, 1.0), torch.tensor([[3.0, 2.0, 1.0], [2.0, 1.0, 0.0]]))
    blocks, hidden, head = _grid_blocks()
    out = block_loss(hidden, blocks, head, None, weighting="dpace", dpace_alpha=1.0)
    ce = torch.tensor(GRID_CE, dtype=torch.float64)
    assert_close(out.loss, (ce[0] * torch.tensor([3, 2, 1])).sum().add(0.7 * 2 + 0.1) / 9, atol=1e-6,
                 what="alpha 1 loss")


def _dpace_reference(hidden, blocks, head, mode, teacher, alpha, normaliser):
    """D-PACE by its definition, from whole logits: w from the hard-label CE, loss_k CE, KL or both."""
    from train.objective import dpace_weights

    b, n = blocks.anchors.shape
    logits = hidden.view(b, n, B, -1)[:, :, 1:] @ head.t()
    logp = torch.log_softmax(logits.double(), -1)
    ce = -logp.gather(-1, blocks.labels[..., None])[..., 0]
    per = torch.zeros_like(ce)
    if mode in ("ce", "ce+kl"):
        per = per + ce
    if mode in ("kl", "ce+kl"):
        src = (blocks.anchors[:, :, None] + torch.arange(B - 1)).clamp(max=teacher.shape[1] - 1)
        t = teacher.gather(1, src.flatten(1)[..., None].expand(-1, -1, teacher.shape[-1])).view_as(logp)
        per = per + (t.exp() * (t - logp)).sum(-1)
    mask = blocks.label_mask
    w = dpace_weights(ce, mask, alpha).double()
    norm = {"weights": w.sum(), "tokens": mask.sum(), "rows": b}[normaliser]
    return (w * per * mask).sum() / norm


@pytest.mark.parametrize("mode", ["ce", "kl", "ce+kl"])
@pytest.mark.parametrize("normaliser", ["weights", "tokens", "rows"])
def test_dpace_loss_is_the_weighted_sum_over_the_normaliser_at_every_chunk_size(normaliser, mode):
    """loss = sum_j w_j loss_j / normaliser (weight sum, scored slots, rows), the weights from the hard-label CE
    whatever the loss (KL included); every LM-head chunk size, 1 included (blocks straddle chunks), gives the same
    loss and gradient, and both are the whole-logits reference's."""
    torch.manual_seed(5)
    ids, lm, doc, pos = _rows()
    blocks = draw_blocks(ids, lm, doc, pos, 5, B, MASK, torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 5 * B, H, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, H, dtype=torch.float64)  # large logits: CE from ~0 to ~10, weights far from uniform
    teacher = torch.log_softmax(torch.randn(2, ids.shape[1], V, dtype=torch.float64), -1)
    lp, ti = teacher.topk(V, dim=-1)  # the whole vocabulary: top-k KL is the exact KL
    ref = _dpace_reference(hidden, blocks, head, mode, teacher, 0.5, normaliser)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    m = int(blocks.label_mask.sum())
    for chunk in (1, 2, 5, m + 1):
        out = block_loss(hidden, blocks, head, None, chunk=chunk, mode=mode, topk_ids=ti, topk_logprobs=lp,
                         weighting="dpace", normaliser=normaliser)
        assert_close(out.loss, ref, atol=1e-5, rtol=1e-5, what=f"{normaliser} {mode} loss, chunk {chunk}")
        (g,) = torch.autograd.grad(out.loss, hidden)
        assert_close(g, g_ref, atol=1e-6, rtol=1e-4, what=f"{normaliser} {mode} gradient, chunk {chunk}")
    assert 0.2 < float(out.weight) / m < 2.5  # not the uniform 1 per slot


def _train_step(split: list[list[int]], overrides: list[str], mode: str, tmp_path):
    """train_step over the rows of _rows() in the micro-batches ``split`` (one process): (logged loss, grads)."""
    import types

    from accelerate import Accelerator

    from train.loop import MicroBatch, Run, train_step
    from train.rng import row_generators

    cfg = load_config(["recipe=tiny", "drafter.block_size=4", "train.clip=0", f"train.loss={mode}",
                       "train.mixed_precision=no", "train.ce_chunk=3", *overrides])
    d, emb, head = _drafter()
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2))
    lp, ti = torch.log_softmax(torch.randn(2, ids.shape[1], V, generator=torch.Generator().manual_seed(3)), -1).topk(8)
    provider = types.SimpleNamespace(get_batch=lambda rows: types.SimpleNamespace(
        features=feats[rows], topk_ids=ti[rows], topk_logprobs=lp[rows]))
    micro = []
    for rows in split:
        blocks = draw_blocks(ids[rows], lm[rows], doc[rows], pos[rows], 6, B, MASK, row_generators(0, 0, rows))
        micro.append(MicroBatch(rows, None, blocks, doc[rows], pos[rows], True, int(lm[rows].numel())))
    run = Run(cfg, Accelerator(cpu=True, mixed_precision="no"), tmp_path, "", "no", print)
    optimizer = GradCapture(d)
    target = types.SimpleNamespace(embed_tokens=emb, lm_head=head)
    stats = train_step(run, d, optimizer, types.SimpleNamespace(step=lambda: None), target, provider, micro,
                       d.config)
    return stats, optimizer.grads


@pytest.mark.parametrize("mode", ["ce", "ce+kl"])
@pytest.mark.parametrize("normaliser", ["weights", "tokens", "rows"])
def test_a_dpace_step_in_micro_batches_is_the_one_big_batch_step(normaliser, mode, tmp_path):
    """train_step with 2 rows in one micro-batch, and with 1 row in each of 2 (gradient accumulation), logs the
    loss and leaves the gradients of block_loss over both rows at once (LM head in chunks of 3 slots): for the
    weight sum, only known after the last forward, the gradients are rescaled once the step is through."""
    over = ["train.loss_weighting=dpace", f"train.dpace_normaliser={normaliser}"]
    one, g_one = _train_step([[0, 1]], over, mode, tmp_path)
    two, g_two = _train_step([[0], [1]], [*over, "train.grad_accum=2"], mode, tmp_path)
    # the reference: one block_loss over both rows, straight from its definition's normaliser
    from train.rng import row_generators

    d, emb, head = _drafter()
    ids, lm, doc, pos = _rows()
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2))
    lp, ti = torch.log_softmax(torch.randn(2, ids.shape[1], V, generator=torch.Generator().manual_seed(3)), -1).topk(8)
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, row_generators(0, 0, [0, 1]))
    hidden = drafter_forward(d, emb, blocks, feats, pos, dense_mask(blocks, doc))
    ref = block_loss(hidden, blocks, head.weight, None, mode=mode, topk_ids=ti, topk_logprobs=lp,
                     weighting="dpace", normaliser=normaliser)
    ref.loss.backward()
    for name, (stats, grads) in {"1 x 2 rows": (one, g_one), "2 x 1 row": (two, g_two)}.items():
        assert_close(stats.loss, ref.loss.detach(), atol=1e-6, rtol=1e-6, what=f"{normaliser} loss, {name}")
        for k, p in d.named_parameters():
            assert_close(grads[k], p.grad, atol=1e-7, rtol=1e-5, what=f"{normaliser} gradient of {k}, {name}")
        assert_close(stats.slot_weight, ref.slot_weight, atol=1e-5, what=f"weight per slot, {name}")


@pytest.fixture(scope="module")
def golden_inputs(tmp_path_factory):
    """The seeded tiny target and the tiny chats as written (no fitting, no regeneration): cheap to build."""
    from tests.helpers.tiny_run import golden_input_dirs

    return golden_input_dirs(tmp_path_factory.mktemp("dpace_inputs"))


@pytest.mark.parametrize("normaliser", ["weights", "tokens", "rows"])
def test_dpace_two_processes_take_the_same_steps_as_one(golden_inputs, normaliser, tmp_path):
    """DDP (2 CPU processes, gloo) with 1 row each == 1 process with 2 rows under D-PACE, for each normaliser (the
    weight sum, the scored slots and the rows are reduced over processes; the LM head runs in chunks of 16 slots,
    so blocks straddle chunks); the logged per-slot weights agree too, and the run records its objective."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers.tiny_run import FAST, losses, run

    common = [*golden_inputs, *FAST, "logging.every=1", "eval.batches=1", "train.max_steps=2", "train.anchors=8",
              "train.ce_chunk=16", "train.loss_weighting=dpace", f"train.dpace_normaliser={normaliser}"]
    run(tmp_path / "one", *common, "train.batch_size=2")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(root / "train" / "distill.py"), "recipe=tiny", f"out_dir={tmp_path / 'two'}", *common,
           "train.batch_size=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert_close([b[1], b[2]], [a[1], a[2]], atol=1e-5, rtol=1e-6, what=f"{normaliser} losses, 2 processes vs 1")
    w_one, w_two = losses(tmp_path / "one", "w_slot"), losses(tmp_path / "two", "w_slot")
    assert len(w_one[1]) == B + 3 and abs(sum(w_one[1]) - 1) < 1e-2  # block 8: 7 slots, shares of the weight
    assert_close(w_two[2], w_one[2], atol=1e-3, what="logged weight per slot")
    from safetensors.torch import load_file

    g_one, g_two = losses(tmp_path / "one", "grad_norm"), losses(tmp_path / "two", "grad_norm")
    assert_close([g_two[1], g_two[2]], [g_one[1], g_one[2]], atol=1e-5, rtol=1e-6, what="gradient norms")
    # Adam's first steps divide each gradient element by its own size: an element whose gradient is near Adam's eps
    # turns a rounding-level difference into ~1% of the step (measured: 2.2e-5 on one fc element at lr 1.5e-3,
    # for tokens as for weights; everything else within 4e-6), so the weights are held to that, and on average.
    wa, wb = (load_file(str(tmp_path / r / "final" / "drafter" / "model.safetensors")) for r in ("one", "two"))
    for k in wa:
        assert_close(wb[k], wa[k], atol=5e-5, what=f"drafter weight {k} after 2 steps ({normaliser})")
        assert (wb[k] - wa[k]).abs().mean() < 1e-7, k
    prov = json.loads((tmp_path / "one" / "final" / "drafter" / "config.json").read_text())["draftsmith"]
    assert prov["objective"] == {"weighting": "dpace", "alpha": 0.5, "normaliser": normaliser}


def test_dpace_gradients_rescaled_under_fsdp_equal_one_process(golden_inputs, tmp_path):
    """FSDP2 (2 CPU processes through tests/helpers/fsdp_on_cpu.py): the rescale of D-PACE's weight sum reaches
    the sharded DTensor gradients (a 0-dim factor, replicated), so the step is the one process's.
    Measured: losses within 1e-6, weights within 2e-6."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from tests.helpers.tiny_run import FAST, losses, run

    common = [*golden_inputs, *FAST, "logging.every=1", "eval.batches=1", "train.max_steps=2", "train.anchors=8",
              "train.ce_chunk=16", "train.loss_weighting=dpace"]
    run(tmp_path / "one", *common, "train.batch_size=2")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(root / "recipes" / "accelerate" / "fsdp.yaml"), "--mixed_precision", "no", "--num_processes", "2",
           str(root / "tests" / "helpers" / "fsdp_on_cpu.py"), "recipe=tiny", f"out_dir={tmp_path / 'fsdp'}", *common,
           "train.batch_size=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fsdp on cpu: version 2" in proc.stdout + proc.stderr
    a, b = losses(tmp_path / "one"), losses(tmp_path / "fsdp")
    assert_close([b[1], b[2]], [a[1], a[2]], atol=1e-5, rtol=1e-6, what="losses, FSDP 2 x 1 row vs 1 x 2 rows")
    wa, wb = (load_file(str(tmp_path / r / "final" / "drafter" / "model.safetensors")) for r in ("one", "fsdp"))
    for k in wa:
        assert_close(wb[k].float(), wa[k].float(), atol=5e-5, what=f"drafter weight {k} after 2 steps")
