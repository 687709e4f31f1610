"""The MLX DFlash2 drafter against z-lab's reference (golden numbers) and against its torch twin."""

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from models.config import DFlashConfig  # noqa: E402
from models.drafter import DraftCache as TorchCache  # noqa: E402
from models.drafter2 import DFlash2DraftModel as TorchDrafter  # noqa: E402
from models.drafter2_mlx import DFlash2DraftModel, load_drafter  # noqa: E402
from models.drafter_mlx import DraftCache  # noqa: E402
from tests.helpers import assert_close  # noqa: E402
from tests.helpers.dflash2 import (TEMPERATURE, block_calls, golden, golden_config, max_diff_by_token,  # noqa: E402
                                   published_folder, random_dflash2, target_parts, tiny_dflash2_config, uniform_for)


@pytest.fixture(autouse=True, scope="module")
def _cpu():
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(old)


def bound(model):
    embed, head = (mx.array(t.numpy()) for t in target_parts())
    m_embed, m_head = nn.Embedding(*embed.shape), nn.Linear(embed.shape[1], embed.shape[0], bias=False)
    m_embed.weight, m_head.weight = embed, head
    return model.bind_target(m_embed, m_head)


@pytest.mark.parametrize("case", ["A", "B"])
def test_matches_the_reference_drafter_on_both_blocks(tmp_path, case):
    out = golden("outputs")
    model = bound(load_drafter(published_folder(tmp_path, case)))
    assert isinstance(model, DFlash2DraftModel) and model.dtype == mx.float32
    cache = DraftCache(2)
    for n, (ids, feats, pos) in enumerate(block_calls(), 1):
        ref = lambda name: out[f"{case}.block{n}.{name}"].numpy()  # noqa: B023, E731
        ids = mx.array(ids.numpy())
        hidden = model(model.embed(ids), mx.array(feats.numpy()), mx.array(pos.numpy()), cache=cache)
        logits = model.logits(hidden[:, 1:])
        greedy = model.propose(hidden[:, 1:], ids[:, 0])
        q = np.array(mx.softmax(greedy.scores / TEMPERATURE, axis=-1))
        u = uniform_for(np.array(greedy.tokens), np.array(greedy.candidates), q)
        sampled = model.propose(hidden[:, 1:], ids[:, 0], TEMPERATURE, mx.array(u.astype(np.float32)))
        assert_close(np.array(hidden), ref("final_hidden"), 1e-5, f"{case}.block{n} final hidden")
        assert_close(np.array(logits), ref("logits"), 1e-5, f"{case}.block{n} logits")
        cands = np.array(greedy.candidates)
        assert max_diff_by_token(cands, np.take_along_axis(np.array(logits), cands, -1),
                                 ref("unary_topk_indices_sorted"), ref("unary_topk_values_sorted")) <= 1e-5
        assert max_diff_by_token(cands, np.array(greedy.scores), ref("unary_topk_indices_sorted"),
                                 ref("selector_scores_sorted_by_unary")) <= 1e-5
        assert np.array_equal(np.array(greedy.tokens), ref("selector_tokens"))
        assert np.array_equal(np.array(logits).argmax(-1), ref("argmax_tokens"))
        assert np.array_equal(np.array(sampled.tokens), ref("selector_tokens"))
        assert max_diff_by_token(np.array(sampled.candidates), np.array(sampled.q), ref("unary_topk_indices_sorted"),
                                 ref("q_T0.7_greedy_predecessors_sorted_by_unary")) <= 1e-5
        assert len(cache) == (11, 14)[n - 1]


def test_mirrors_the_torch_names_and_a_packed_row_is_block_local():
    from mlx.utils import tree_flatten

    config = tiny_dflash2_config()
    assert set(dict(tree_flatten(DFlash2DraftModel(config).parameters()))) == set(TorchDrafter(config).state_dict())
    out, (b1, b2) = golden("outputs"), block_calls()
    weights = {k: mx.array(v.numpy()) for k, v in golden("weights").items() if not k.startswith("target.")}
    model = DFlash2DraftModel(DFlashConfig.from_dict(golden_config("A")))
    model.load_weights(list(model.state_from_disk(weights).items()), strict=True)
    embed, _ = target_parts()
    ids = torch.cat([b1[0], b2[0]], 1)
    hidden = model(mx.array(embed[ids].numpy()), mx.array(torch.cat([b1[1], b2[1]], 1).numpy()),
                   mx.array(out["A.packed.position_ids"].numpy()),
                   attention_mask=mx.array(out["A.packed.attention_mask"].bool().numpy()))
    assert_close(np.array(hidden), out["A.packed.final_hidden_block_local_conv"], 1e-5, "MLX packed row")


def test_torch_and_mlx_propose_the_same_over_several_cycles(tmp_path):
    """A random DFlash2 drafter (convs and selector far from identity) saved by torch and loaded by MLX: the
    same hidden states, proposals and q through a growing cache."""
    tm = random_dflash2(tiny_dflash2_config(output_multiplier=1.3, final_logit_softcapping=20.0))
    tm.save_pretrained(tmp_path)
    mm = bound(load_drafter(tmp_path))
    embed, head = target_parts()
    lm_head = torch.nn.Linear(64, 288, bias=False)
    lm_head.weight.data = head
    tm.bind_target(torch.nn.Embedding.from_pretrained(embed), lm_head)
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 20, tm.config.fc_in_features, generator=g)
    tc, mc, start = TorchCache(2), DraftCache(2), 0
    for c, bonus in ((9, 17), (1, 40), (4, 3)):
        block = torch.tensor([[bonus] + [tm.config.mask_token_id] * 7])
        pos = torch.arange(start, start + c + 8)[None]
        u = torch.rand(1, 7, generator=g)
        pt = tm.propose_block(block, feats[:, start:start + c], pos, tc, temperature=0.8, uniform=u)
        pm = mm.propose_block(mx.array(block.numpy()), mx.array(feats[:, start:start + c].numpy()),
                              mx.array(pos.numpy()), mc, temperature=0.8, uniform=mx.array(u.numpy()))
        assert np.array_equal(np.array(pm.tokens), pt.tokens.numpy())
        assert np.array_equal(np.array(pm.candidates), pt.candidates.numpy())
        assert_close(np.array(pm.scores), pt.scores, 1e-4, "scores")
        assert_close(np.array(pm.q), pt.q, 1e-5, "q")
        start += c


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_export_keeps_codebooks_and_base_kernels_in_float(tmp_path, bits):
    from mlx.utils import tree_flatten

    random_dflash2(tiny_dflash2_config()).save_pretrained(tmp_path / "hf")
    quant = load_drafter(tmp_path / "hf").quantize(bits=bits, group_size=32)
    quant.save_pretrained(tmp_path / "mlx")
    loaded = load_drafter(tmp_path / "mlx")
    assert isinstance(loaded.candidate_selector.hidden_projection, nn.QuantizedLinear)
    assert isinstance(loaded.layers[0].attention_conv.kernel_projection, nn.QuantizedLinear)
    params = dict(tree_flatten(loaded.parameters()))
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "layers.1.mlp_conv.base_kernel"):
        assert params[name].dtype == mx.float32, name
    mine = dict(tree_flatten(quant.parameters()))
    assert all(mx.array_equal(v, params[k]).item() for k, v in mine.items())
