"""export.hf / export.mlx of a DFlash2 drafter: the published layout, reloads that propose the same tokens, cards.

A tiny Qwen3 target folder and a tiny DFlash2 drafter whose every weight is away from its initial value (convs
not identity, selector on), laid out as a training checkpoint, built once per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

from export.hf import export_hf
from models.drafter import DraftCache
from models.drafter2 import DFlash2DraftModel, load_drafter
from models.target import TargetModel
from tests.helpers import assert_close, tiny_drafter_config
from tests.helpers.dflash2 import golden_config, random_dflash2

PROMPT = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
quiet = lambda *_: None  # noqa: E731
# Keys of the published config.json that transformers writes for its own bookkeeping: no engine reads them for a
# drafter (we write torch_dtype, which transformers 5 reads as dtype).
HF_BOOKKEEPING = {"bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "max_window_layers",
                  "transformers_version", "use_cache", "dtype"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from models.tiny import save_tiny_target

    root = tmp_path_factory.mktemp("export2")
    target_dir = save_tiny_target(root / "target", "qwen3")
    target = TargetModel.from_pretrained(target_dir)
    config = tiny_drafter_config(target, rope_theta=10000.0, variant="dflash2", selector_rank=8, selector_top_k=4)
    drafter = random_dflash2(config, seed=3)
    ckpt = root / "run" / "checkpoints" / "step_7"
    drafter.save_pretrained(ckpt / "drafter")
    (ckpt / "config.yaml").write_text(yaml.safe_dump({"recipe": "tiny", "target": {"path": str(target_dir)}}))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 7, "epoch": 0}))
    return target_dir, target, drafter, ckpt


def block_inputs(target, drafter):
    ids = torch.tensor([PROMPT])
    feats = target.forward(ids, drafter.config.target_layer_ids).features
    block = torch.tensor([[PROMPT[-1]] + [drafter.config.mask_token_id] * (drafter.config.block_size - 1)])
    return block, target.embed(block), feats, torch.arange(len(PROMPT) + drafter.config.block_size)[None]


def test_hf_export_is_the_published_layout_and_every_reload_proposes_the_same(setup, tmp_path):
    target_dir, target, drafter, ckpt = setup
    out = tmp_path / "hf"
    summary = export_hf(ckpt, out, dtype="fp32", log=quiet)
    d = json.loads((out / "config.json").read_text())
    published = golden_config("A")
    assert d["architectures"] == ["DFlash2DraftModel"] and d["auto_map"] == {
        "AutoModel": "modeling_dflash.DFlash2DraftModel"}
    assert set(published) - HF_BOOKKEEPING <= set(d)
    assert set(d["dflash_config"]) == set(published["dflash_config"])
    assert d["is_causal"] is False and d["use_sliding_window"] is True and d["sliding_window"] == 2048
    assert d["layer_types"] == ["sliding_attention"] * 2 and d["num_target_layers"] == target.num_layers
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == drafter.config.weight_shapes()
    assert summary["parity"]["draftsmith"]["selector_tokens"] == summary["parity"]["transformers"]["selector_tokens"] \
        == 1.0
    assert summary["commands"]["vllm"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve ")
    assert "--speculative-num-draft-tokens 8" in summary["commands"]["sglang"]
    assert "PR #52816" in summary["engines"]["vllm"] and "unreleased as of 0.5.18" in summary["engines"]["sglang"]

    # our loader, torch: the same hidden states and proposals as the drafter trained
    drafter.bind_target(target.embed_tokens, target.lm_head)
    again = load_drafter(out).bind_target(target.embed_tokens, target.lm_head)
    assert isinstance(again, DFlash2DraftModel)
    block, emb, feats, pos = block_inputs(target, drafter)
    with torch.no_grad():
        hidden = drafter(emb, feats, pos)
        expected = drafter.propose(hidden[:, 1:], block[:, 0])
        assert torch.equal(again.propose_block(block, feats, pos, DraftCache(2)).tokens, expected.tokens)

    # our loader, MLX
    import mlx.core as mx

    from models.drafter2_mlx import load_drafter as load_mlx

    with mx.stream(mx.cpu):
        m = load_mlx(out, dtype=mx.float32)
        m_hidden = m(mx.array(emb.numpy()), mx.array(feats.numpy()), mx.array(pos.numpy()))
        assert_close(np.array(m_hidden), hidden, 1e-5, "MLX reload hidden states")

    # transformers + the shipped modeling file, in a clean interpreter (no draftsmith import)
    head = target.model.get_output_embeddings().weight.detach()
    np.savez(tmp_path / "in.npz", emb=emb.numpy(), feats=feats.numpy(), pos=pos.numpy(), head=head.numpy(),
             bonus=block[:, 0].numpy())
    script = (
        "import sys, numpy as np, torch\n"
        "from transformers import AutoModel\n"
        "m = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()\n"
        "x = np.load(sys.argv[2])\n"
        "with torch.no_grad():\n"
        "    h = m(torch.from_numpy(x['emb']), torch.from_numpy(x['feats']), torch.from_numpy(x['pos']))\n"
        "    t = m.propose(h[:, 1:], torch.from_numpy(x['head']), torch.from_numpy(x['bonus']))\n"
        "np.savez(sys.argv[3], h=h.numpy(), t=t.numpy())\n"
        "assert type(m).__name__ == 'DFlash2DraftModel' and 'models' not in sys.modules\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": "",
           "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script, str(out), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                   check=True, env=env, cwd=tmp_path, capture_output=True)
    got = np.load(tmp_path / "out.npz")
    assert_close(torch.from_numpy(got["h"]) @ head.T, hidden @ head.T, 1e-5, "AutoModel(trust_remote_code) logits")
    assert np.array_equal(got["t"], expected.tokens.numpy())

    from export.card import render_card

    card = str(render_card(out, "org/tiny-dflash2"))
    assert "A DFlash2 drafter for" in card and "| generation | `DFlash2 (DFlash2DraftModel)` |" in card
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in card and "PR #35371" in card


@pytest.mark.parametrize("quantize", [None, 4])
def test_mlx_export_keeps_the_published_names_and_float_codebooks(setup, tmp_path, quantize):
    """fp32 (held to the fp32 tolerance against torch) and 4-bit (bf16 norms and codebooks, agreement reported)."""
    mx = pytest.importorskip("mlx.core")
    from export.check import weight_problems
    from export.mlx import export_mlx
    from models.config import DFlashConfig

    _, _, drafter, ckpt = setup
    out = tmp_path / "mlx"
    with mx.stream(mx.cpu):
        summary = export_mlx(ckpt, out, quantize=quantize, group_size=32, dtype="bf16" if quantize else "fp32",
                             log=quiet)
    agreement = summary["parity"]["selector_tokens"]  # reported; a 4-bit tiny random drafter agrees far less
    assert agreement == 1.0 if not quantize else 0.0 <= agreement <= 1.0
    with safe_open(str(out / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        assert name in names and f"{name}.scales" not in names
    assert ("candidate_selector.hidden_projection.scales" in names) == bool(quantize)
    assert weight_problems(out, DFlashConfig.load(out)) == []
