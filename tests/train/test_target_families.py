"""GLM 4.x MoE, Qwen3-Next, DeepSeek-V3 and Kimi K2.5 targets through the whole pipeline on tiny seeded targets:
prepare -> extract -> train (offline features, then online against the target quantized by mlx_lm) -> export
-> generate with the exported drafter (torch and MLX), losslessly. One small case per family: the loops, rollback
and parity are tested beside their stages (tests/inference, tests/models)."""

from __future__ import annotations

import json

import pytest

from models.tiny import MOE_FAMILY_ARCHS
from tests.helpers.tiny_run import FAST, losses, run

PROMPT = "257,85,82,68,81,198,72,68,75,75,78,258,198,257,64"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Per family, built on first use: a tiny seeded target folder (6 layers, Hub layout) and its prepared tiny
    chat data (the templated answers, not regenerated: the pipeline is under test, not the drafter's quality)."""
    from data.prepare import prepare
    from data.tiny_chat import write
    from models.tiny import save_tiny_target

    built: dict = {}

    def get(arch: str):
        if arch not in built:
            root = tmp_path_factory.mktemp(arch)
            target = save_tiny_target(root / "target", arch, num_layers=6)
            source = write(root / "chat.jsonl", n=24, seed=0)
            prepare(str(target), str(source), root / "data", thinking=False, max_length=96, progress=False)
            built[arch] = root
        return built[arch]

    return get


@pytest.mark.parametrize("arch", MOE_FAMILY_ARCHS)
def test_extract_train_export_generate(inputs, arch, tmp_path, capsys):
    from data.extract import main as extract
    from export.hf import main as export_hf
    from inference.generate import main as generate
    from models.config import default_layer_ids
    from train.config import load_config

    root = inputs(arch)
    target, data = root / "target", root / "data"
    taps = default_layer_ids(6, load_config(["recipe=tiny"]).drafter.num_taps)
    extract(["--target", str(target), "--data", str(data), "--out", str(tmp_path / "store"), "--layers",
             *map(str, taps), "--target-dtype", "float32", "--device", "cpu", "--no-progress"])
    common = [f"target.path={target}", f"data.prepared={data}", *FAST, "train.anchors=8", "train.batch_size=2",
              "data.eval_rows=2", "eval.batches=1", "logging.every=1"]
    run(tmp_path / "offline", *common, "features.mode=offline", f"features.store={tmp_path / 'store'}",
        "train.max_steps=2")
    assert sorted(losses(tmp_path / "offline")) == [1, 2]
    # online against the target quantized as mlx_lm -q does (4-bit, group 32), dequantized in torch
    run(tmp_path / "quantized", *common, "train.max_steps=1", "target.quantization=mlx-4bit-g32")
    trained = json.loads((tmp_path / "quantized" / "final" / "drafter" / "config.json").read_text())
    assert trained["draftsmith"]["target_quantization"].startswith("mlx-4bit-g32")
    export_hf(["--checkpoint", str(tmp_path / "offline" / "final" / "drafter"), "--out", str(tmp_path / "hf"),
               "--dtype", "fp32", "--target", str(target), "--no-remote-code-check"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == taps
    if arch == "kimi_k25":  # the exported folder with the keys of z-lab's published Kimi-K2.5 drafter config only
        published_layout(tmp_path / "hf")
    capsys.readouterr()
    backends = ["torch"] + (["mlx"] if _has_mlx() else [])
    for backend in backends:
        out = generate(["--backend", backend, "--target", str(target), "--draft", str(tmp_path / "hf"),
                        "--prompt-ids", PROMPT, "--max-new-tokens", "12", "--dtype", "float32", "--baseline",
                        "--json"])
        # the seeded target may end at its EOS early: the same place as the target alone
        assert out["matches_baseline"] and out["first_divergence"] is None and out["tokens"], (backend, out)


# The keys of z-lab/Kimi-K2.5-DFlash's config.json (flat layout; block 8, mask 163838 there). Its YaRN rope block
# (a copy of the target's) is left out: the drafter config reads plain RoPE only for now.
PUBLISHED_KIMI_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "vocab_size", "head_dim",
                       "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "num_target_layers",
                       "max_position_embeddings", "rope_theta", "rms_norm_eps", "block_size", "torch_dtype",
                       "hidden_act", "attention_bias", "tie_word_embeddings", "auto_map")


def published_layout(folder) -> None:
    d = json.loads((folder / "config.json").read_text())
    kept = {k: d[k] for k in PUBLISHED_KIMI_KEYS}
    kept["dflash_config"] = {k: d["dflash_config"][k] for k in ("target_layer_ids", "mask_token_id")}
    (folder / "config.json").write_text(json.dumps(kept, indent=2))


def _has_mlx() -> bool:
    try:
        import mlx.core  # noqa: F401  (optional dependency: the MLX generate case)
        import mlx_lm  # noqa: F401
    except ImportError:
        return False
    return True
