"""export.hf / export.mlx: what is written, what reloads, and what the gates refuse.

A tiny Qwen3 target folder (seeded) and a seeded drafter laid out as a training checkpoint
(``checkpoints/step_7/{drafter, config.yaml, trainer_state.json}``) are built once per module.
Logits are the target's own LM head over the drafter's hidden states on a real block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

from export.check import ExportCheckError, schema_problems
from export.hf import export_hf
from models.drafter import DFlashDraftModel
from models.target import TargetModel
from tests.helpers import assert_close, tiny_drafter_config

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
quiet = lambda *_: None  # noqa: E731
# Every top-level key vLLM dflash, SGLang DFLASH, z-lab's code and the MLX runtimes read (auto_map: AutoModel).
ENGINE_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "attention_bias",
               "max_position_embeddings", "vocab_size", "tie_word_embeddings", "layer_types", "sliding_window",
               "use_sliding_window", "torch_dtype", "num_target_layers", "block_size", "rope_theta", "rope_parameters",
               "dflash_config", "auto_map")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target folder, TargetModel, in-memory drafter, checkpoint folder)."""
    from models.tiny import save_tiny_target

    root = tmp_path_factory.mktemp("export")
    target_dir = save_tiny_target(root / "target", "qwen3")
    target = TargetModel.from_pretrained(target_dir)
    torch.manual_seed(3)
    drafter = DFlashDraftModel(tiny_drafter_config(target, rope_theta=10000.0)).eval()
    ckpt = root / "run" / "checkpoints" / "step_7"
    drafter.save_pretrained(ckpt / "drafter")
    run = {"recipe": "tiny", "target": {"path": str(target_dir), "revision": None, "quantization": "none"},
           "data": {"source": "tiny", "split": "train", "max_length": 256, "regenerate": "local", "thinking": False},
           "features": {"mode": "online"}, "train": {"epochs": 2.5, "lr": 3e-3, "anchors": 48, "loss": "ce"}}
    (ckpt / "config.yaml").write_text(yaml.safe_dump(run))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 7, "epoch": 0}))
    return target_dir, target, drafter, ckpt


def block_inputs(target: TargetModel, drafter: DFlashDraftModel):
    """A real block: target features of the prompt, then [bonus, MASK x (B-1)]."""
    ids = torch.tensor([PROMPT])
    feats = target.forward(ids, drafter.config.target_layer_ids).features
    B = drafter.config.block_size
    block = torch.tensor([[PROMPT[-1]] + [drafter.config.mask_token_id] * (B - 1)])
    emb = target.embed(block)
    pos = torch.arange(len(PROMPT) + B)[None]
    return emb, feats, pos


def test_hf_export_reloads_with_identical_logits_in_torch_mlx_and_automodel(setup, tmp_path):
    target_dir, target, drafter, ckpt = setup
    out = tmp_path / "hf"
    summary = export_hf(ckpt, out, dtype="fp32", log=quiet)
    emb, feats, pos = block_inputs(target, drafter)
    head = target.model.get_output_embeddings().weight.detach()
    with torch.no_grad():
        expected = drafter(emb, feats, pos) @ head.T
        again = DFlashDraftModel.from_pretrained(out)
        assert torch.equal(again(emb, feats, pos) @ head.T, expected), "draftsmith torch reload"

    import mlx.core as mx

    from models.drafter_mlx import DFlashDraftModel as MLXDrafter

    with mx.stream(mx.cpu):
        hidden = MLXDrafter.from_pretrained(out, dtype=mx.float32)(mx.array(emb.numpy()), mx.array(feats.numpy()),
                                                                   mx.array(pos.numpy()))
        assert_close(np.array(hidden) @ head.numpy().T, expected, atol=1e-4, what="draftsmith MLX reload")

    # transformers + the shipped modeling file, in a clean interpreter (no draftsmith import)
    np.savez(tmp_path / "inputs.npz", emb=emb.numpy(), feats=feats.numpy(), pos=pos.numpy())
    script = (
        "import sys, numpy as np, torch\n"
        "from transformers import AutoModel\n"
        "m = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()\n"
        "x = np.load(sys.argv[2])\n"
        "with torch.no_grad():\n"
        "    h = m(torch.from_numpy(x['emb']), torch.from_numpy(x['feats']), torch.from_numpy(x['pos']))\n"
        "np.save(sys.argv[3], h.numpy())\n"
        "assert 'models' not in sys.modules and 'export' not in sys.modules\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", script, str(out), str(tmp_path / "inputs.npz"), str(tmp_path / "h.npy")],
                   check=True, env=env, cwd=tmp_path, capture_output=True)
    hf_logits = torch.from_numpy(np.load(tmp_path / "h.npy")) @ head.T
    assert_close(hf_logits, expected, atol=1e-5, what="AutoModel(trust_remote_code=True) in a subprocess")
    assert summary["parity"]["transformers"]["max_abs"] < 1e-5

    prov = json.loads((out / "config.json").read_text())["draftsmith"]
    assert prov["target"] == str(target_dir) and prov["steps"] == 7 and prov["recipe"] == "tiny"
    assert prov["target_quantization"] == "none (unquantized weights)"
    assert prov["data"]["source"] == "tiny" and prov["train"]["lr"] == 3e-3


def test_schema_lists_every_key_engines_read(setup, tmp_path):
    _, _, drafter, ckpt = setup
    out = tmp_path / "hf"
    summary = export_hf(ckpt, out, log=quiet)  # default bf16
    d = json.loads((out / "config.json").read_text())
    for key in ENGINE_KEYS:
        assert key in d, key
    cfg = drafter.config
    assert d["architectures"] == ["DFlashDraftModel"] and d["torch_dtype"] == "bfloat16"
    assert d["block_size"] == d["dflash_config"]["block_size"] == cfg.block_size
    assert d["rope_theta"] == d["rope_parameters"]["rope_theta"] == 10000.0
    assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}  # no partial rotary, no mrope
    assert "rope_scaling" not in d and "partial_rotary_factor" not in d
    assert d["num_target_layers"] == 8 and d["dflash_config"]["mask_token_id"] == cfg.mask_token_id
    assert d["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids and max(cfg.target_layer_ids) < 8 - 1
    assert d["layer_types"] == ["full_attention"] * d["num_hidden_layers"]
    assert "eagle_aux_hidden_state_layer_ids" not in d
    assert (out / (d["auto_map"]["AutoModel"].split(".")[0] + ".py")).is_file()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert keys == set(drafter.state_dict()) and not any("embed_tokens" in k or "lm_head" in k for k in keys)
    assert schema_problems(d, out) == []
    assert "num_speculative_tokens\": 7" in summary["commands"]["vllm"]
    assert "--speculative-num-draft-tokens 8" in summary["commands"]["sglang"]


def test_sharded_export_writes_an_index_and_reloads(setup, tmp_path):
    _, _, drafter, ckpt = setup
    out = tmp_path / "hf"
    export_hf(ckpt, out, dtype="fp32", max_shard_size=60_000, remote_code_check=False, log=quiet)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(drafter.state_dict())
    again = DFlashDraftModel.from_pretrained(out)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in drafter.state_dict().items())


def test_a_tiny_run_records_the_target_folder_it_built(setup, tmp_path):
    """``target.path=tiny:qwen3`` builds the target in the run folder: the export records (and checks) that folder."""
    import shutil

    target_dir, _, _, ckpt = setup
    run = tmp_path / "run"
    shutil.copytree(ckpt / "drafter", run / "final" / "drafter")
    shutil.copytree(target_dir, run / "tiny_target")
    (run / "final" / "config.yaml").write_text(yaml.safe_dump({"recipe": "tiny", "target": {"path": "tiny:qwen3"}}))
    (run / "metrics.jsonl").write_text('{"step": 10, "loss": 2.0}\n{"step": 20, "loss": 1.0}\n')
    summary = export_hf(run, tmp_path / "hf", remote_code_check=False, log=quiet)
    prov = summary["provenance"]
    assert prov["target"] == str((run / "tiny_target").resolve()) and prov["steps"] == 20
    assert summary["source"] == str(run / "final" / "drafter")  # the drafter found in the run folder
    assert prov["target_quantization"] == "none (unquantized weights)"
    assert str(run / "tiny_target") in summary["commands"]["vllm"]


def _bare_drafter(folder: Path, **config) -> Path:
    """A folder that names the DFlash architecture: all that finding the drafter and its provenance read."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], **config}))
    return folder


def test_each_layout_reads_its_own_steps_run_config_and_the_drafters_own_block(tmp_path, monkeypatch):
    """A run's final/drafter, the run folder and a checkpoint (or its drafter/) each take the steps the drafter
    was saved at (final/trained.json over later metrics rows, trainer_state.json), the run config beside it
    (a tiny target resolved to the run's tiny_target), and the block training wrote into the drafter over
    the recipe's data keys. A checkpoint at final's own step is not newer than it."""
    from export.source import NotADrafterError, resolve_source

    run = (tmp_path / "run").resolve()
    run_cfg = yaml.safe_dump({"recipe": "tiny", "target": {"path": "tiny:qwen3"}, "data": {"source": "tiny"}})
    final = _bare_drafter(run / "final" / "drafter", draftsmith={"data": {"source": "/data/prepared"}})
    (run / "final" / "config.yaml").write_text(run_cfg)
    (run / "final" / "trained.json").write_text('{"step": 60}')
    (run / "metrics.jsonl").write_text('{"step": 60}\n{"step": 75}\n')  # a resume killed after final/ was saved
    _bare_drafter(run / "tiny_target")
    ckpt = run / "checkpoints" / "step_60"
    _bare_drafter(ckpt / "drafter")
    (ckpt / "config.yaml").write_text(run_cfg)
    (ckpt / "trainer_state.json").write_text('{"step": 60}')
    expected = {"target": str(run / "tiny_target"), "target_quantization": "none (unquantized weights)",
                "recipe": "tiny", "data": {"source": "/data/prepared"}, "steps": 60}
    for given, kind, folder in ((final, "final", final), (run, "run", final), (ckpt, "checkpoint", ckpt / "drafter"),
                                (ckpt / "drafter", "checkpoint", ckpt / "drafter")):
        src = resolve_source(given)
        assert (src.kind, src.drafter_dir) == (kind, folder), given
        assert src.provenance == (expected if kind != "checkpoint" else {**expected, "data": {"source": "tiny"}})
    (ckpt / "trainer_state.json").write_text('{"step": 0}')  # 0 steps is a count, not a missing one
    assert resolve_source(ckpt).provenance["steps"] == 0
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_source("~/run").drafter_dir == tmp_path / "run" / "final" / "drafter"
    (ckpt / "state").mkdir()  # another folder of the checkpoint is no drafter
    with pytest.raises(NotADrafterError, match="state is not a drafter folder"):
        resolve_source(ckpt / "state")


def test_steps_of_an_older_final_drafter_are_the_largest_logged_and_a_finished_run_needs_no_checkpoint(tmp_path):
    """Without final/trained.json the steps are the largest step in metrics.jsonl, whatever the rows' order and
    past rows that are not JSON or have no step; with it, a run whose checkpoints were all removed exports."""
    from export.source import resolve_source

    run = tmp_path / "run"
    _bare_drafter(run / "final" / "drafter")
    (run / "final" / "config.yaml").write_text("recipe: tiny\n")
    (run / "metrics.jsonl").write_text('{"step": 10}\nnot json\n{"loss": 1.0}\n{"step": 20}\n{"step": 15}\n')
    (run / "checkpoints" / "step_5").mkdir(parents=True)  # no trained.json to compare it with: final/ is taken
    assert resolve_source(run).provenance["steps"] == 20
    (run / "final" / "trained.json").write_text('{"step": 30}')
    assert resolve_source(run).provenance["steps"] == 30


def test_a_bare_drafter_reads_no_config_beside_it_and_one_named_by_its_dflash_block_is_a_drafter(tmp_path):
    """A config.yaml beside a drafter folder that is not a run's final/ is someone else's: not the run config.
    A config.json with a dflash_config block but no architectures (some exports drop it) is a drafter."""
    from export.source import resolve_source

    mine = _bare_drafter(tmp_path / "mine" / "drafter")
    (tmp_path / "mine" / "config.yaml").write_text("recipe: qwen3-8b\n")
    src = resolve_source(mine)
    assert (src.kind, src.provenance) == ("drafter", {})
    (mine / "config.json").write_text(json.dumps({"dflash_config": {"block_size": 8}}))
    assert resolve_source(mine).drafter_dir == mine


def test_training_output_names_what_export_takes_for_a_runs_drafter_folders(tmp_path):
    """push refuses a training run's drafter folder and names the --checkpoint to export instead: final/drafter
    beside the run config, a checkpoint's drafter/; any other folder (another name in final/, a copy of a
    final/drafter without its run config) is not training output."""
    from export.source import training_output

    run = tmp_path / "run"
    (run / "final" / "drafter").mkdir(parents=True)
    (run / "final" / "hf").mkdir()
    (run / "final" / "config.yaml").write_text("recipe: tiny\n")
    ckpt = run / "checkpoints" / "step_3"
    (ckpt / "drafter").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"step": 3}')
    (tmp_path / "copy" / "final" / "drafter").mkdir(parents=True)
    assert training_output(run / "final" / "drafter") == run and training_output(ckpt / "drafter") == ckpt
    assert [training_output(p) for p in (run / "final" / "hf", tmp_path / "copy" / "final" / "drafter")] == [None] * 2


def test_provenance_records_what_the_drafter_was_trained_against(tmp_path):
    from export.source import provenance_from_run

    run = {"recipe": "qwen3-8b", "target": {"path": "Qwen/Qwen3-8B", "revision": "abc", "quantization": "mlx-4bit"},
           "data": {"source": "nvidia/Nemotron-Post-Training-Dataset-v2", "subset": None}, "train": {"lr": 6e-4}}
    prov = provenance_from_run(run)
    assert prov == {"target": "Qwen/Qwen3-8B", "target_revision": "abc", "target_quantization": "mlx-4bit-g64",
                    "recipe": "qwen3-8b", "data": {"source": "nvidia/Nemotron-Post-Training-Dataset-v2"},
                    "train": {"lr": 6e-4}}
    folder = tmp_path / "q"  # a target folder that is itself MLX-quantized
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3",
                                                    "quantization": {"bits": 4, "group_size": 32, "mode": "affine"}}))
    quant = provenance_from_run({"target": {"path": str(folder)}})["target_quantization"]
    assert quant.startswith(f"mlx:{folder}") and "4" in quant and "32" in quant


def test_provenance_keeps_every_recorded_key_with_falsy_values_and_drops_only_unset_ones():
    """Every data and train key a run sets is recorded, 0 and False included (seed 0, thinking off, no
    packing); None, empty text and empty sections are left out; a value this version cannot parse is
    recorded as written."""
    from models.provenance import provenance_from_run

    data = {"source": "tiny", "split": "train", "subset": None, "limit": 0, "regenerate": "none",
            "thinking": False, "max_length": 128, "pack": False, "cache_dir": "/x"}
    train = {"epochs": 1, "max_steps": 0, "batch_size": 2, "grad_accum": 1, "lr": 6e-4, "schedule": "cosine",
             "anchors": 8, "loss": "ce", "seed": 0, "log_dir": "/y"}
    prov = provenance_from_run({"recipe": "tiny", "target": {"path": "Qwen/Qwen3-8B"}, "data": data,
                                "features": {"mode": "online"}, "train": train})
    assert prov == {"target": "Qwen/Qwen3-8B", "target_quantization": "none (unquantized weights)", "recipe": "tiny",
                    "data": {k: v for k, v in data.items() if k not in ("subset", "cache_dir")}, "features": "online",
                    "train": {k: v for k, v in train.items() if k != "log_dir"}}
    assert provenance_from_run({"recipe": "", "target": {"path": "", "revision": None}, "data": {"subset": None},
                                "train": {}}) == {"target_quantization": "none (unquantized weights)"}
    assert provenance_from_run({"target": {"path": "t", "quantization": "weird-9bit"}})["target_quantization"] == \
        "weird-9bit"


def test_provenance_records_the_loss_weighting_of_the_run():
    """A saved run config names its objective: D-PACE with its resolved keys, decay with its gamma (the paper's for
    the block size when unset); a config saved before train.loss_weighting existed trained with decay."""
    from models.provenance import objective_of_run, provenance_from_run
    from train.config import load_config

    dpace = load_config(["recipe=tiny", "train.loss_weighting=dpace", "train.dpace_normaliser=tokens"]).to_dict()
    assert provenance_from_run(dpace)["objective"] == {"weighting": "dpace", "alpha": 0.5, "normaliser": "tokens"}
    assert provenance_from_run(load_config(["recipe=tiny"]).to_dict())["objective"] == {
        "weighting": "dpace", "alpha": 0.5, "normaliser": "weights"}  # the default
    decay = load_config(["recipe=tiny", "train.loss_weighting=decay"]).to_dict()
    assert provenance_from_run(decay)["objective"] == {"weighting": "decay", "gamma": 4.0}  # block 8
    assert objective_of_run(load_config(["recipe=small"]).to_dict()) == {"weighting": "decay", "gamma": 1.0}
    older = {"drafter": {"block_size": 16}, "train": {"gamma": None, "lr": 6e-4}}
    assert objective_of_run(older) == {"weighting": "decay", "gamma": 7.0}


def test_target_quantization_reads_the_folders_config(tmp_path):
    """MLX (top level or the text tower, group size 64 and affine by default), a transformers quant_method, plain
    weights; nothing to say for no folder, a folder without config.json or an unreadable one."""
    from models.provenance import describe_target_quantization, target_quantization

    def folder(name, cfg):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
        return str(tmp_path / name)

    assert target_quantization(folder("mlx", {"quantization": {"bits": 8}})) == "mlx-affine-8bit-g64"
    assert target_quantization(folder("vl", {"text_config": {"quantization": {"bits": 4, "group_size": 32,
                                                                            "mode": "mxfp4"}}})) == "mlx-mxfp4-4bit-g32"
    assert target_quantization(folder("nobits", {"quantization": {"group_size": 64}})) == "none"
    fp8 = folder("fp8", {"quantization_config": {"quant_method": "fp8"}})
    assert target_quantization(fp8) == "fp8" and describe_target_quantization(fp8) == "fp8"
    assert target_quantization(folder("plain", {"model_type": "qwen3"})) == "none"
    assert target_quantization(folder("broken", "{not json")) is None
    (tmp_path / "empty").mkdir()
    assert [target_quantization(t) for t in (None, "", str(tmp_path / "empty"), "Qwen/Qwen3-8B")] == [None] * 4


def test_provenance_of_a_run_names_a_target_the_loops_can_load(tmp_path):
    """``tiny:<arch>`` becomes the run's tiny_target folder (resolved, and described with the run's
    quantization or the folder's own), only once that folder holds a config.json; a local folder becomes its
    resolved path; a Hub id stays as it is."""
    from models.provenance import provenance_of_run

    (tmp_path / "x").mkdir()
    run_root = tmp_path / "x" / ".." / "run"  # resolved in the block
    tiny = {"target": {"path": "tiny:qwen3"}}
    assert provenance_of_run(tiny, run_root)["target"] == "tiny:qwen3"  # not built yet
    assert provenance_of_run(tiny, None)["target"] == "tiny:qwen3"
    (tmp_path / "run" / "tiny_target").mkdir(parents=True)
    (tmp_path / "run" / "tiny_target" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    built = str(tmp_path / "run" / "tiny_target")
    assert provenance_of_run(tiny, run_root)["target"] == built
    quantized = provenance_of_run({"target": {"path": "tiny:qwen3", "quantization": "mlx-4bit"}}, run_root)
    assert (quantized["target"], quantized["target_quantization"]) == (built, "mlx-4bit-g64")
    (tmp_path / "run" / "tiny_target" / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "quantization": {"bits": 4, "group_size": 64}}))
    assert provenance_of_run(tiny, run_root)["target_quantization"].startswith(f"mlx:{built}")
    (tmp_path / "local").mkdir()
    local = provenance_of_run({"target": {"path": str(tmp_path / "x" / ".." / "local")}}, run_root)
    assert local["target"] == str(tmp_path / "local")
    assert provenance_of_run({"target": {"path": "Qwen/Qwen3-8B"}}, run_root)["target"] == "Qwen/Qwen3-8B"


def test_data_provenance_records_what_the_prepared_folder_says():
    """The prepared folder's ``packed`` is the block's ``pack``; 0 and False are recorded, unset keys are not."""
    from models.provenance import data_provenance

    meta = {"source": "tiny", "packed": False, "pack": True, "limit": 0, "split": None, "rows": 24}
    assert data_provenance(meta) == {"source": "tiny", "limit": 0, "pack": False}


def test_drafter_for_a_qwen35_target_keeps_plain_rope(tmp_path):
    """The Qwen3.5 multimodal target has partial rotary in its nested text_config; the export never copies it,
    and the target check reads the text tower's shape."""
    from models.config import DFlashConfig
    from models.tiny import tiny_config, tiny_tokenizer

    target_dir = tmp_path / "qwen35"  # what the check reads: config.json and the tokenizer (no weights needed)
    tiny_config("qwen3_5_vl", 288, 8).save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    text = json.loads((target_dir / "config.json").read_text())["text_config"]
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=288, num_target_layers=8,
                       target_layer_ids=[1, 3, 5], mask_token_id=280, block_size=8, torch_dtype="float32",
                       rope_theta=text["rope_parameters"]["rope_theta"])
    DFlashDraftModel(cfg).save_pretrained(tmp_path / "src")
    export_hf(tmp_path / "src", tmp_path / "hf", target=str(target_dir), remote_code_check=False, log=quiet)
    raw = (tmp_path / "hf" / "config.json").read_text()
    d = json.loads(raw)
    assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0} and d["rope_theta"] == 10000.0
    assert "partial_rotary" not in raw and "mrope" not in raw and d["draftsmith"]["target"] == str(target_dir)


@pytest.mark.parametrize("mode", ["bidirectional", "causal"])
def test_sliding_window_drafter_exports_and_the_shipped_file_matches(tmp_path, mode):
    """The shipped modeling file computes sliding layers (window on the context, in-block mode) as draftsmith."""
    from models.config import DFlashConfig

    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=300, num_target_layers=8,
                       target_layer_ids=[1, 3, 5], mask_token_id=290, block_size=8, sliding_window=3,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                       sliding_block_attention=mode, torch_dtype="float32")
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)  # large enough that a wrong mask shows in the logits
    drafter.save_pretrained(tmp_path / "src")
    summary = export_hf(tmp_path / "src", tmp_path / "hf", dtype="fp32", log=quiet)
    assert summary["parity"]["transformers"]["max_abs"] < 1e-4
    d = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert d["use_sliding_window"] and d["sliding_window"] == 3
    assert d["dflash_config"]["sliding_block_attention"] == mode


BAD_CONFIGS = {
    "last-layer tap": (lambda d: d["dflash_config"].update(target_layer_ids=[1, 3, 7]), "never tapped"),
    "layer id past the target": (lambda d: d["dflash_config"].update(target_layer_ids=[1, 3, 9]), "outside"),
    "block sizes disagree": (lambda d: d["dflash_config"].update(block_size=16), "block_size=8 but"),
    "top-level block size larger": (lambda d: d.update(block_size=16), "block_size=16 but dflash_config.block_size=8"),
    "block size not a number": (lambda d: d["dflash_config"].update(block_size="8"), "a block is the bonus token"),
    "block size 1": (lambda d: (d.update(block_size=1), d["dflash_config"].update(block_size=1)), "bonus token"),
    "mask id outside the vocabulary": (lambda d: d["dflash_config"].update(mask_token_id=288), "not a row"),
    "rope places disagree": (lambda d: d.update(rope_theta=1e6), "rope_theta=1000000.0 but"),
    "rope base only top-level": (lambda d: d["rope_parameters"].pop("rope_theta"),
                                 "rope_theta=10000.0 but rope_parameters.rope_theta=None"),
    "rope type missing": (lambda d: d["rope_parameters"].pop("rope_type"), "rope_type=None, expected 'default'"),
    "partial rotary copied from a Qwen3.5 target": (
        lambda d: d["rope_parameters"].update(partial_rotary_factor=0.25), "full-head"),
    "mrope copied from a VL target": (lambda d: d["rope_parameters"].update(mrope_section=[1, 1]), "full-head"),
    "eagle aux ids": (lambda d: d.update(eagle_aux_hidden_state_layer_ids=[1, 3, 5]), "must not be written"),
    "num_target_layers missing": (lambda d: d.pop("num_target_layers"), "missing key 'num_target_layers'"),
    "mask id missing": (lambda d: d["dflash_config"].pop("mask_token_id"), "missing key 'dflash_config.mask_token_id'"),
    "negative mask id": (lambda d: d["dflash_config"].update(mask_token_id=-1), "mask_token_id=-1 is not a row"),
    "layer_types short": (lambda d: d.update(layer_types=["full_attention"]), "layer_types has 1"),
    "layer_types long": (lambda d: d.update(layer_types=["full_attention"] * 3), "layer_types has 3"),
    "rope_scaling copied from a target": (lambda d: d.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                                          "'rope_scaling' must not be written"),
    "the target's architecture first": (lambda d: d.update(architectures=["Qwen3ForCausalLM", "DFlashDraftModel"]),
                                        "expected ['DFlashDraftModel']"),
    "scaled rope": (lambda d: d["rope_parameters"].update(rope_type="linear", factor=2.0), "rope_type='linear'"),
    "negative layer id": (lambda d: d["dflash_config"].update(target_layer_ids=[-1, 3, 5]), "outside 0..6"),
    "fractional layer id": (lambda d: d["dflash_config"].update(target_layer_ids=[1.5, 3, 5]), "has [1.5] outside"),
    "repeated layer id": (lambda d: d["dflash_config"].update(target_layer_ids=[1, 3, 3]), "repeats a layer"),
    "block size only top-level": (lambda d: d["dflash_config"].pop("block_size"), "dflash_config.block_size'"),
    "quantization mirror differs": (lambda d: d.update(quantization={"bits": 4, "group_size": 32, "mode": "affine"},
                                                       quantization_config={"bits": 8, "group_size": 32,
                                                                            "mode": "affine"}), "differ"),
    "quantization without its mirror": (lambda d: d.update(quantization={"bits": 4, "group_size": 32}), "differ"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_schema_check_names_each_wrong_value(setup, name):
    _, _, drafter, _ = setup
    d = drafter.config.to_dict()
    assert schema_problems(d, hf=True) == []
    mutate, expected = BAD_CONFIGS[name]
    mutate(d)
    problems = schema_problems(d, hf=True)
    assert any(expected in p for p in problems), problems


def test_schema_requires_every_key_engines_read_and_takes_the_first_and_the_last_tappable_layer(setup):
    """Each engine key left out is named; auto_map only for a folder AutoModel loads (hf), not an MLX-only one."""
    d = setup[2].config.to_dict()
    for key in ENGINE_KEYS:
        problems = schema_problems({k: v for k, v in d.items() if k != key}, hf=True)
        assert any(p.startswith(f"missing key {key!r}") for p in problems), (key, problems)
    assert schema_problems({k: v for k, v in d.items() if k != "auto_map"}, hf=False) == []
    d["dflash_config"]["target_layer_ids"] = [0, 3, 6]  # layer 0 and the layer before the last of 8
    assert schema_problems(d, hf=True) == []


def test_config_differences_and_the_gate_message_name_every_problem(setup):
    from export.check import config_differences, raise_if

    cfg = setup[2].config
    assert config_differences(cfg, cfg) == []
    got = cfg.replace(block_size=16, mask_token_id=cfg.mask_token_id + 1)
    assert config_differences(cfg, got) == ["block_size: wrote 8, read back 16",
                                            f"mask_token_id: wrote {cfg.mask_token_id}, read back {got.mask_token_id}"]
    raise_if([], "config.json")
    with pytest.raises(ExportCheckError, match=r"^config.json: a; b\. Nothing was exported: fix the drafter"):
        raise_if(["a", "b"], "config.json")


@pytest.mark.parametrize("corrupt", ["layer id", "mask id", "block size", "engine key"])
def test_gate_refuses_a_writer_that_gets_a_value_wrong(setup, tmp_path, monkeypatch, corrupt):
    """A writer bug (the written config.json differs from the drafter, or carries a key engines must not read)
    is refused and nothing is placed."""
    from models.config import DFlashConfig

    _, _, _, ckpt = setup
    real = DFlashConfig.to_dict

    def wrong(self):
        d = real(self)
        if corrupt == "layer id":
            d["dflash_config"]["target_layer_ids"] = [i + 1 for i in d["dflash_config"]["target_layer_ids"]]
        elif corrupt == "mask id":
            d["dflash_config"]["mask_token_id"] += 1
        elif corrupt == "engine key":
            d["eagle_aux_hidden_state_layer_ids"] = d["dflash_config"]["target_layer_ids"]
        else:
            d["block_size"] = d["dflash_config"]["block_size"] = 16
        return d

    out = tmp_path / "hf"
    export_hf(ckpt, out, remote_code_check=False, log=quiet)  # an earlier, good export: must survive
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(DFlashConfig, "to_dict", wrong)
    said = "config.json fails the engine schema" if corrupt == "engine key" else "does not read back"
    with pytest.raises(ExportCheckError, match=said):
        export_hf(ckpt, out, overwrite=True, remote_code_check=False, log=quiet)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"], "a temp folder was left behind"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_parity_rule_tolerances_and_non_finite_logits():
    """What the parity gates compare: the largest error relative to the largest reference logit,
    against the dtype's tolerance; NaN never passes (NaN > tol is False, so it is checked apart)."""
    from export.check import check_parity, logit_stats

    stats = logit_stats(np.array([[10.0, 0.0]]), np.array([[9.0, 0.0]]))
    assert stats["rel"] == pytest.approx(0.1) and stats["max_abs"] == pytest.approx(1.0) and stats["top1"] == 1.0
    check_parity({"max_abs": 0.45, "rel": 0.045, "top1": 1.0}, "bfloat16", "x")  # within 8e-2 (measured, below)
    check_parity({"max_abs": 0.8, "rel": 8e-2, "top1": 1.0}, "bfloat16", "x")  # the tolerance itself passes
    zeros = np.zeros((2, 3))  # all-zero logits agree exactly: no 0 / 0
    assert logit_stats(zeros, zeros) == {"max_abs": 0.0, "mean_abs": 0.0, "rel": 0.0, "top1": 1.0}
    for rel, dtype in ((0.09, "bfloat16"), (0.02, "float16"), (2e-4, "float32")):
        with pytest.raises(ExportCheckError, match=f"tolerance .* for {dtype}"):
            check_parity({"max_abs": rel * 10, "rel": rel, "top1": 1.0}, dtype, "x")
    with pytest.raises(ExportCheckError, match="logits differ by nan"):
        check_parity(logit_stats(np.array([[1.0, 0.0]]), np.array([[np.nan, 0.0]])), "float32", "x")


def test_logit_stats_by_row_and_a_dtype_without_its_own_tolerance():
    """top1 compares each row's argmax (the last axis), mean_abs is the mean, and a dtype without a tolerance of
    its own is held to bfloat16's."""
    from export.check import check_parity, logit_stats

    ref = np.array([[3.0, 0.0, 1.0], [0.0, 2.0, 1.0]])
    got = np.array([[3.0, 0.0, 1.0], [0.0, 1.0, 2.5]])  # row 2's argmax moves: 1 of 2 rows agree
    stats = logit_stats(ref, got)
    assert stats["top1"] == 0.5 and stats["max_abs"] == 1.5 and stats["mean_abs"] == pytest.approx(2.5 / 6)
    check_parity({"max_abs": 0.3, "rel": 0.03, "top1": 1.0}, "int8", "x")  # within bfloat16's 8e-2
    with pytest.raises(ExportCheckError, match="tolerance 8e-02 for int8"):
        check_parity({"max_abs": 0.9, "rel": 0.09, "top1": 1.0}, "int8", "x")


def test_an_auto_map_to_a_file_the_folder_lacks_is_named(tmp_path):
    """AutoModel(trust_remote_code=True) imports the module auto_map names from the folder (with or without a
    repo prefix): one that is not there fails on every user's machine, not at export."""
    from export.check import schema_problems

    for ref in ("modeling_dflash.DFlashDraftModel", "org/repo--modeling_dflash.DFlashDraftModel"):
        d = {"auto_map": {"AutoModel": ref}}
        assert "auto_map points at modeling_dflash.py, which is not in the folder" in schema_problems(d, tmp_path)
        (tmp_path / "modeling_dflash.py").write_text("")
        assert not [p for p in schema_problems(d, tmp_path) if "auto_map" in p]
        (tmp_path / "modeling_dflash.py").unlink()
        assert not [p for p in schema_problems(d, tmp_path, hf=False) if "auto_map" in p]  # MLX reads no auto_map
        (tmp_path / "modeling_dflash.py").write_text("")
        (tmp_path / "modeling_dflash.py").unlink()


@pytest.mark.parametrize("damage, said", [
    ("stray embed_tokens", "weight 'embed_tokens.weight' is the target's, not the drafter's"),
    ("stray lm_head", "weight 'lm_head.weight' is the target's, not the drafter's"),
    ("stray model.embed_tokens", "weight 'model.embed_tokens.weight' is the target's, not the drafter's"),
    ("a layer missing", "weights hold layers [0], config.json says 2"),
    ("a layer renumbered", "weights hold layers [0, 2], config.json says 2"),
    ("fc missing", "weight 'fc.weight' is missing"),
])
def test_weight_check_names_stray_and_missing_tensors(setup, tmp_path, damage, said):
    """What weight_problems reads from the headers: the target's tensors saved into the drafter (engines take
    them from the target), a decoder layer the config promises but the file lacks, and fc."""
    from safetensors.torch import load_file, save_file

    from export.check import weight_problems
    from models.config import DFlashConfig

    *_, drafter, _ = setup
    assert drafter.config.num_hidden_layers == 2
    drafter.save_pretrained(tmp_path)
    config = DFlashConfig.load(tmp_path)
    assert weight_problems(tmp_path, config) == []
    state = load_file(str(tmp_path / "model.safetensors"))
    if damage.startswith("stray"):
        state[damage.split()[1] + ".weight"] = torch.zeros(4, 4)
    elif damage == "a layer renumbered":
        state = {k.replace("layers.1.", "layers.2."): v for k, v in state.items()}
    else:
        prefix = "layers.1." if damage == "a layer missing" else "fc."
        state = {k: v for k, v in state.items() if not k.startswith(prefix)}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert said in weight_problems(tmp_path, config)


def test_weight_check_names_a_truncated_file_alone(setup, tmp_path):
    """A cut-off safetensors file is named as such, not as the tensors it no longer shows."""
    from export.check import weight_problems
    from models.config import DFlashConfig

    setup[2].save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    problems = weight_problems(tmp_path, DFlashConfig.load(tmp_path))
    assert len(problems) == 1 and problems[0].startswith("model.safetensors is corrupt or truncated ("), problems


@pytest.mark.parametrize("how", ["off by 10%", "NaN"])
def test_gate_refuses_a_folder_whose_logits_differ(setup, tmp_path, monkeypatch, how):
    """Weights that read back bit-equal but compute something else (a modeling-file or loader bug) are
    refused by the logit comparison itself, and the earlier export stays in place."""
    import export.hf

    _, _, _, ckpt = setup
    out = tmp_path / "hf"
    export_hf(ckpt, out, remote_code_check=False, log=quiet)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = export.hf.block_outputs, []

    def reloaded_wrong(model, *args):  # the first call is the reference, the second the reloaded folder
        calls.append(model)
        logits = real(model, *args)
        return logits if len(calls) == 1 else logits * (1.1 if how == "off by 10%" else float("nan"))

    monkeypatch.setattr(export.hf, "block_outputs", reloaded_wrong)
    with pytest.raises(ExportCheckError, match="reloaded with draftsmith: logits differ"):
        export_hf(ckpt, out, overwrite=True, remote_code_check=False, log=quiet)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_quantized_mlx_gate_refuses_non_finite_logits(setup, tmp_path, monkeypatch):
    """A quantized MLX draft is compared by top-1 agreement (warned about, not refused), but logits that
    are not finite are refused: nothing is written."""
    pytest.importorskip("mlx.core")
    import export.mlx
    from export.mlx import export_mlx

    _, _, _, ckpt = setup
    real = export.mlx.mlx_logits
    monkeypatch.setattr(export.mlx, "mlx_logits", lambda model, inputs, head: real(model, inputs, head) * np.nan)
    with pytest.raises(ExportCheckError, match="not finite"):
        export_mlx(ckpt, tmp_path / "q4", quantize=4, group_size=32, log=quiet)
    assert not (tmp_path / "q4").exists()


@pytest.mark.parametrize("loader", ["draftsmith", "AutoModel"])
def test_an_fp32_export_is_held_to_fp32_parity_by_each_loader(setup, tmp_path, monkeypatch, loader):
    """Weights that read back bit-equal through a loader that computes 0.1% off (within bf16's tolerance, not
    fp32's): the reloaded folder's own logits are compared, at the export dtype's tolerance, for draftsmith's
    loader and for AutoModel with the shipped file."""
    import transformers

    _, _, _, ckpt = setup

    class OffByATenth(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return self.model(*args) * 1.001

    if loader == "draftsmith":
        real = DFlashDraftModel.from_pretrained.__func__

        def reload(cls, path, **kw):
            model = real(cls, path, **kw)
            return OffByATenth(model) if Path(path).name.endswith(".tmp") else model

        monkeypatch.setattr(DFlashDraftModel, "from_pretrained", classmethod(reload))
        # the weight comparison reads the wrapped model's names: keep them the drafter's
        monkeypatch.setattr(OffByATenth, "state_dict", lambda self: self.model.state_dict())
    else:
        def auto_model(path, trust_remote_code, **kw):
            return OffByATenth(DFlashDraftModel.from_pretrained(path, **kw))

        monkeypatch.setattr(transformers.AutoModel, "from_pretrained", auto_model)
    said = "with draftsmith" if loader == "draftsmith" else r"with AutoModel\(trust_remote_code=True\)"
    with pytest.raises(ExportCheckError, match=f"reloaded {said}: logits differ .*tolerance 1e-04 for float32"):
        export_hf(ckpt, tmp_path / "hf", dtype="fp32", log=quiet)
    assert not (tmp_path / "hf").exists()


def _edit_saved_weights(monkeypatch, edit) -> None:
    """Every drafter save in this test writes its weights, then ``edit`` changes them on disk."""
    from safetensors.torch import load_file, save_file

    real = DFlashDraftModel.save_pretrained

    def save_then_edit(self, directory, **kw):
        real(self, directory, **kw)
        path = Path(directory) / "model.safetensors"
        state = load_file(str(path))
        edit(state)
        save_file(state, str(path), metadata={"format": "pt"})
        return Path(directory)

    monkeypatch.setattr(DFlashDraftModel, "save_pretrained", save_then_edit)


def test_gate_refuses_a_stray_tensor_in_the_written_weights(setup, tmp_path, monkeypatch):
    """The target's LM head saved into the drafter's weights (engines take it from the target) is named by the
    weight check before any reload."""
    _, _, _, ckpt = setup

    def add_the_head(state):
        state["lm_head.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)

    _edit_saved_weights(monkeypatch, add_the_head)
    with pytest.raises(ExportCheckError, match="the written weights do not match config.json: weight 'lm_head"):
        export_hf(ckpt, tmp_path / "hf", remote_code_check=False, log=quiet)
    assert not (tmp_path / "hf").exists()


def test_gate_refuses_a_drafter_that_does_not_fit_its_target(setup, tmp_path):
    """Checked against the target folder: a mask id the tokenizer emits, a layer count that differs."""
    from models.tiny import save_tiny_target

    target_dir, _, drafter, _ = setup
    bad = tmp_path / "bad_mask"
    DFlashDraftModel(drafter.config.replace(mask_token_id=65)).save_pretrained(bad)  # 65 = the byte 'b'
    with pytest.raises(ExportCheckError, match="mask_token_id=65 .* is a token the target's tokenizer emits"):
        export_hf(bad, tmp_path / "out", target=str(target_dir), log=quiet)
    short = save_tiny_target(tmp_path / "short_target", "qwen3", num_layers=6)
    with pytest.raises(ExportCheckError, match="the target has 6 decoder layers"):
        export_hf(setup[3], tmp_path / "out", target=str(short), log=quiet)
    assert not (tmp_path / "out").exists()


def test_target_check_reads_a_nested_text_tower_and_says_what_it_could_not_check(setup, tmp_path):
    """A multimodal target nests its text tower under text_config; a tokenizer that does not load leaves the shape
    checked and says so; a folder without config.json is not checked (and said so), not an error."""
    from export.check import target_problems

    target_dir, _, drafter, _ = setup
    text = json.loads((target_dir / "config.json").read_text())
    nested = tmp_path / "vl"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "text_config": text}))
    assert target_problems(drafter.config, nested) == ([], f"target shape ({nested})")
    (nested / "config.json").write_text(json.dumps({"text_config": {**text, "num_hidden_layers": 6}}))
    (nested / "tokenizer_config.json").write_text("{not json")
    problems, checked = target_problems(drafter.config, nested)
    assert len(problems) == 1 and "the target has 6 decoder layers" in problems[0]
    assert checked.startswith("target shape (tokenizer not readable: ")
    assert target_problems(drafter.config, tmp_path / "elsewhere") == (
        [], "target not checked (neither a local folder with config.json nor a Hub id)")
    with pytest.raises(ExportCheckError, match="is a DFlash drafter .*not a target model: pass --target"):
        target_problems(drafter.config, setup[3] / "drafter")


def test_gate_checks_a_hub_target_from_its_small_files(setup, tmp_path, monkeypatch):
    """--target org/name fetches config and tokenizer only (no weights) and checks them like a folder;
    with no Hub reachable the export goes on and says the target was not checked."""
    from models.tiny import save_tiny_target
    from tests.helpers.fake_hub import FakeHub

    hub = FakeHub(tmp_path / "cache", monkeypatch)
    hub.add("org/tiny", setup[0])
    hub.add("org/short", save_tiny_target(tmp_path / "short_target", "qwen3", num_layers=6))
    lines: list[str] = []
    export_hf(setup[3], tmp_path / "ok", target="org/tiny", log=lines.append)
    assert "check: target shape and tokenizer (org/tiny)" in lines and hub.downloaded_weights() == set()
    with pytest.raises(ExportCheckError, match="the target has 6 decoder layers"):
        export_hf(setup[3], tmp_path / "out", target="org/short", log=quiet)
    lines.clear()
    export_hf(setup[3], tmp_path / "unchecked", target="org/elsewhere", log=lines.append)
    assert any(line.startswith("check: target not checked (could not fetch the config of org/elsewhere: ")
               for line in lines), lines


def test_cli_prints_serve_commands_and_help(setup, tmp_path, capsys):
    from export.hf import main
    from models.support import run_cli

    _, _, _, ckpt = setup
    with pytest.raises(SystemExit, match="^error: .* is a run folder without final/drafter"):
        run_cli(lambda: main(["--checkpoint", str(ckpt.parent.parent), "--out", str(tmp_path / "x")]))
    run_cli(lambda: main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "x"), "--no-remote-code-check"]))
    out = capsys.readouterr().out
    assert f'vllm serve {ckpt.parent.parent.parent / "target"} --speculative-config' in out
    assert "--speculative-algorithm DFLASH" in out and "--speculative-num-draft-tokens 8" in out
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--checkpoint" in capsys.readouterr().out


def test_export_hf_cli_defaults_and_what_it_passes_on(tmp_path, monkeypatch):
    """Defaults: bf16, shards of 5GB, the run's target, the remote-code check on; every flag reaches export_hf,
    and a dtype or shard size the writer does not take is refused by name when called directly."""
    import export.hf

    args = export.hf.parse_args(["--checkpoint", "c", "--out", "o"])
    assert (args.dtype, args.max_shard_size, args.target, args.target_revision, args.overwrite,
            args.no_remote_code_check) == ("bf16", "5GB", None, None, False, False)
    seen = {}
    monkeypatch.setattr(export.hf, "export_hf", lambda checkpoint, out, **kw: seen.update(kw, at=(checkpoint, out)))
    export.hf.main(["--checkpoint", "c", "--out", "o", "--dtype", "fp16", "--target", "org/t", "--target-revision",
                    "r1", "--max-shard-size", "2GiB", "--overwrite", "--no-remote-code-check"])
    assert seen == {"at": ("c", "o"), "dtype": "fp16", "target": "org/t", "target_revision": "r1",
                    "max_shard_size": "2GiB", "overwrite": True, "remote_code_check": False}
    seen.clear()
    export.hf.main(["--checkpoint", "c", "--out", "o"])
    assert (seen["remote_code_check"], seen["overwrite"], seen["max_shard_size"]) == (True, False, "5GB")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"--dtype 'int8': use one of \['bf16', 'fp16', 'fp32'\]"):
        export_hf(tmp_path / "no-such-run", tmp_path / "out", dtype="int8")
    for size in (True, False, 0.5):  # a flag or a fraction is no size: True was one byte, one shard per tensor
        with pytest.raises(ValueError, match="--max-shard-size"):
            export.hf.shard_bytes(size)
    assert [export.hf.shard_bytes(v) for v in (1024, " 1.5 TB ", "3kib", "7")] == [1024, 15 * 10**11, 3 * 2**10, 7]


# ------------------------------------------------------------------------------------- MLX
def test_mlx_export_bf16_and_4bit_run_lossless_in_the_mlx_loop(setup, tmp_path):
    """Both folders load in draftsmith's MLX loop on the tiny target; greedy output is the target's own
    (the target decides), and each run reports its acceptance."""
    mx = pytest.importorskip("mlx.core")
    from export.mlx import export_mlx
    from inference.mlx_loop import DrafterProposer, dflash_generate, target_generate
    from models.drafter_mlx import DFlashDraftModel as MLXDrafter
    from models.target_mlx import TargetModel as MLXTarget

    target_dir, _, drafter, ckpt = setup
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        fp32 = export_mlx(ckpt, tmp_path / "fp32", dtype="fp32", log=quiet)
        bf16 = export_mlx(ckpt, tmp_path / "bf16", log=quiet)
        q4 = export_mlx(ckpt, tmp_path / "q4", quantize=4, group_size=32, log=quiet)
        assert fp32["parity"]["rel"] < 1e-4 and bf16["parity"]["rel"] < 4e-2
        assert np.isfinite(q4["parity"]["max_abs"]) and 0.0 <= q4["parity"]["top1"] <= 1.0

        d = json.loads((tmp_path / "q4" / "config.json").read_text())
        quant = {"bits": 4, "group_size": 32, "mode": "affine"}
        assert d["quantization"] == d["quantization_config"] == quant and "auto_map" not in d
        assert d["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids
        assert schema_problems(d, tmp_path / "q4", hf=False) == []
        weights = mx.load(str(tmp_path / "q4" / "model.safetensors"))
        assert weights["layers.0.mlp.up_proj.weight"].dtype == mx.uint32 and "layers.0.mlp.up_proj.scales" in weights
        d16 = json.loads((tmp_path / "bf16" / "config.json").read_text())
        assert d16["torch_dtype"] == "bfloat16" and "quantization" not in d16
        assert (tmp_path / "bf16" / "modeling_dflash.py").is_file()

        target = MLXTarget.from_pretrained(target_dir)
        reference = target_generate(target, PROMPT, 40, eos_token_ids=[]).tokens
        for name in ("bf16", "q4"):
            res = dflash_generate(target, DrafterProposer(MLXDrafter.from_pretrained(tmp_path / name), target),
                                  PROMPT, 40, eos_token_ids=[])
            assert res.tokens == reference, f"{name} draft changed the greedy output"
            assert 1.0 <= res.tau <= drafter.config.block_size and sum(res.acceptance_lengths) == 40 - 1
            print(f"{name}: tau {res.tau:.2f} over {len(res.acceptance_lengths)} cycles")
    finally:
        mx.set_default_device(old)


# ------------------------------------------------------------------------------------- provenance, folder, gates
def test_provenance_drops_unset_values_and_records_the_revision_and_a_local_targets_quantization(setup):
    """``None`` values are not written into config.json; ``--target-revision`` is recorded; a local
    ``--target`` folder says how it is quantized, while a Hub id keeps what the run recorded."""
    from export.hf import provenance

    target_dir = setup[0]
    run = {"target": "Qwen/Qwen3-8B", "target_revision": None, "target_quantization": "mlx-4bit-g64", "steps": 7}
    assert provenance(run, None, None, quiet) == {"target": "Qwen/Qwen3-8B", "target_quantization": "mlx-4bit-g64",
                                                  "steps": 7}
    assert provenance(run, None, "abc123", quiet)["target_revision"] == "abc123"
    assert provenance({"steps": 0, "data": {"limit": 0}}, None, None, quiet) == {"steps": 0, "data": {"limit": 0}}
    assert provenance(run, "Qwen/Qwen3-8B-Base", None, quiet)["target_quantization"] == "mlx-4bit-g64"
    local = provenance(run, str(target_dir), None, quiet)
    assert local["target"] == str(target_dir) and local["target_quantization"] == "none (unquantized weights)"


def test_fp16_export_writes_fp16_weights_and_config(setup, tmp_path):
    _, _, drafter, ckpt = setup
    export_hf(ckpt, tmp_path / "hf", dtype="fp16", remote_code_check=False, log=quiet)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float16"
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}


def test_gate_refuses_weights_that_change_on_the_way_to_disk(setup, tmp_path, monkeypatch):
    """One weight one bf16 step off after writing: the logits would still pass the parity rule, the
    bit-equality of the reloaded weights does not."""
    _, _, _, ckpt = setup

    def nudge(state):
        state["norm.weight"][0] = state["norm.weight"][0] * 1.01

    _edit_saved_weights(monkeypatch, nudge)
    with pytest.raises(ExportCheckError, match="norm.weight changed on the way to disk"):
        export_hf(ckpt, tmp_path / "hf", remote_code_check=False, log=quiet)
    assert not (tmp_path / "hf").exists()


def _write_export(folder: Path, marker: str) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"draftsmith": {}, "marker": marker}))


def test_staging_replaces_an_earlier_export_leaves_nothing_beside_it_and_shares_the_files(tmp_path):
    """Even under a private umask the placed folder is world-readable (mkdtemp makes it 0700), and the
    previous export, moved aside during the swap, is gone afterwards."""
    from export.folder import staging

    out = tmp_path / "hf"
    _write_export(out, "old")
    umask = os.umask(0o077)
    try:
        with staging(out, overwrite=True) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".hf.")  # beside --out: one rename moves it in
            (tmp / "config.json").write_text(json.dumps({"draftsmith": {}, "marker": "new"}))
            (tmp / "model.safetensors").write_bytes(b"weights")
    finally:
        os.umask(umask)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert json.loads((out / "config.json").read_text())["marker"] == "new"
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {"config.json": 0o644,
                                                                        "model.safetensors": 0o644}


def test_a_previous_export_is_put_back_over_an_empty_out_folder(tmp_path):
    """Killed between the swap's renames, then an empty ``--out`` made (by the user, or a tool): the
    previous export is put back there, not deleted as if the new one had moved in."""
    from export.folder import recover_replaced

    out = tmp_path / "hf"
    _write_export(tmp_path / ".hf.old", "previous")
    out.mkdir()
    recover_replaced(out)
    assert json.loads((out / "config.json").read_text())["marker"] == "previous"
    assert not (tmp_path / ".hf.old").exists()


def test_a_staging_folder_with_a_recent_file_is_kept_however_old_the_folder(tmp_path):
    """A concurrent export writing into an old staging folder (a folder's time changes only when an
    entry is added or removed) is still running: its newest file decides."""
    import time

    from export.folder import remove_stale_staging

    now = time.time()
    for name, file_age in ((".hf.writing1.tmp", 0), (".hf.abandon1.tmp", 7200)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
        os.utime(folder / "model.safetensors", (now - file_age,) * 2)
        os.utime(folder, (now - 7200,) * 2)
    remove_stale_staging(tmp_path / "hf")
    assert [p.name for p in tmp_path.iterdir()] == [".hf.writing1.tmp"]


def test_only_this_outs_staging_folders_are_stale_and_only_by_their_whole_name(tmp_path):
    """Old folders named like a staging folder of ``hf`` but longer (a user's backup of one, another tool's) are
    not removed; an old one of exactly that shape is."""
    import time

    from export.folder import remove_stale_staging

    for name in (".hf.abcd1234.tmp", ".hf.abcd1234.tmp.keep", ".hf.abcd1234.tmpfiles", "x.hf.abcd1234.tmp"):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (time.time() - 7200,) * 2)
    remove_stale_staging(tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.abcd1234.tmp.keep", ".hf.abcd1234.tmpfiles",
                                                          "x.hf.abcd1234.tmp"]
    for name in (".d.v2.abcd1234.tmp", ".dxv2.abcd1234.tmp"):  # the dot of --out d.v2 is a dot, not any character
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (time.time() - 7200,) * 2)
    remove_stale_staging(tmp_path / "d.v2")
    assert ".dxv2.abcd1234.tmp" in os.listdir(tmp_path) and ".d.v2.abcd1234.tmp" not in os.listdir(tmp_path)


def test_files_put_into_out_during_an_export_are_kept_and_the_export_refused(setup, tmp_path, monkeypatch):
    """--out is checked again when the new folder moves in: files that appeared there while the export ran
    (another export, the user) are neither replaced nor mixed with the new folder, and no temp folder stays."""
    _, _, _, ckpt = setup
    out = tmp_path / "hf"
    real = DFlashDraftModel.save_pretrained

    def save_while_someone_writes_out(self, directory, **kw):
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        return real(self, directory, **kw)

    monkeypatch.setattr(DFlashDraftModel, "save_pretrained", save_while_someone_writes_out)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export_hf(ckpt, out, remote_code_check=False, log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_partial_copy_of_an_earlier_export_beside_out_is_not_put_back_nor_in_the_way(setup, tmp_path):
    """A kill while the swap removed the previous export's copy (``.hf.old``) leaves part of it, without its
    config.json: it is no export to put back over an empty --out, and an --overwrite export still swaps in."""
    _, _, drafter, ckpt = setup
    out, old = tmp_path / "hf", tmp_path / ".hf.old"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"half")
    out.mkdir()  # an empty --out needs no --overwrite
    export_hf(ckpt, out, remote_code_check=False, log=quiet)
    assert json.loads((out / "config.json").read_text())["draftsmith"]["steps"] == 7
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    old.mkdir(exist_ok=True)
    (old / "model.safetensors").write_bytes(b"half")
    export_hf(ckpt, out, dtype="fp32", overwrite=True, remote_code_check=False, log=quiet)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def _mlx_friendly_drafter(tmp_path) -> Path:
    """A drafter whose linears all take widths divisible by 64 (fc 192, down_proj 128, the rest 64)."""
    from models.config import DFlashConfig

    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=300, num_target_layers=8,
                       target_layer_ids=[1, 3, 5], mask_token_id=290, block_size=4, torch_dtype="float32")
    torch.manual_seed(0)
    return DFlashDraftModel(cfg).save_pretrained(tmp_path / "drafter")


def test_mlx_group_size_error_suggests_the_largest_size_that_fits(tmp_path):
    mx = pytest.importorskip("mlx.core")
    from export.mlx import check_group_size
    from models.drafter_mlx import DFlashDraftModel as MLXDrafter

    model = MLXDrafter.from_pretrained(_mlx_friendly_drafter(tmp_path), dtype=mx.float32)
    check_group_size(model, 64)
    with pytest.raises(ValueError, match=r"of 7 of the drafter's 8 linears \(e.g. fc: 192\).*use --group-size 64 "):
        check_group_size(model, 128)


@pytest.mark.parametrize("bits, group, top1, advice", [
    (4, 64, 0.95, None),
    (4, 64, 0.9, None),  # at the floor: no warning (only below it)
    (4, 64, 0.5, "try --quantize 8 or a smaller --group-size"),
    (8, 32, 0.5, "or export it unquantized (bf16)"),
])
def test_quantized_mlx_gate_warns_below_the_top1_floor_with_what_to_try(tmp_path, monkeypatch, bits, group, top1,
                                                                         advice):
    pytest.importorskip("mlx.core")
    import export.mlx

    real = export.mlx.logit_stats
    monkeypatch.setattr(export.mlx, "logit_stats", lambda *a: {**real(*a), "top1": top1})
    lines: list[str] = []
    export.mlx.export_mlx(_mlx_friendly_drafter(tmp_path), tmp_path / "q", quantize=bits, group_size=group,
                          log=lines.append)
    warnings = [line for line in lines if line.startswith("warning:")]
    if advice is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].endswith(f"expect lower acceptance; {advice}"), warnings


def test_mlx_gate_refuses_a_weight_missing_after_reload(setup, tmp_path, monkeypatch):
    mx = pytest.importorskip("mlx.core")
    from export.mlx import export_mlx
    from models.drafter_mlx import DFlashDraftModel as MLXDrafter

    real = MLXDrafter.from_pretrained

    def lose_a_weight(path, dtype=None, revision=None):
        model = real(path, dtype=dtype, revision=revision)
        if Path(path).name.endswith(".tmp"):  # the gate's reload of the staging folder
            del model.hidden_norm["weight"]
        return model

    monkeypatch.setattr(MLXDrafter, "from_pretrained", staticmethod(lose_a_weight))
    with mx.stream(mx.cpu), pytest.raises(ExportCheckError, match="hidden_norm.weight changed on the way to disk"):
        export_mlx(setup[3], tmp_path / "mlx", log=quiet)
    assert not (tmp_path / "mlx").exists()


def test_mlx_gate_refuses_a_stray_tensor_in_the_written_weights(setup, tmp_path, monkeypatch):
    """The target's LM head saved beside the drafter's weights is named by the weight check; nothing is placed."""
    mx = pytest.importorskip("mlx.core")
    from export.mlx import export_mlx
    from models.drafter_mlx import DFlashDraftModel as MLXDrafter

    real = MLXDrafter.save_pretrained

    def save_with_the_head(self, directory):
        real(self, directory)
        path = str(Path(directory) / "model.safetensors")
        mx.save_safetensors(path, {**mx.load(path), "lm_head.weight": mx.zeros((4, 4))}, metadata={"format": "mlx"})
        return Path(directory)

    monkeypatch.setattr(MLXDrafter, "save_pretrained", save_with_the_head)
    with mx.stream(mx.cpu), pytest.raises(ExportCheckError, match="do not match config.json: weight 'lm_head"):
        export_mlx(setup[3], tmp_path / "mlx", log=quiet)
    assert not (tmp_path / "mlx").exists()


def test_an_fp32_mlx_export_is_held_to_fp32_parity_on_the_reloaded_folder(setup, tmp_path, monkeypatch):
    """The reloaded MLX drafter computing 0.1% off (within bf16's tolerance, not fp32's) is refused: the gate
    compares the folder's own reload, at the export dtype's tolerance."""
    mx = pytest.importorskip("mlx.core")
    import export.mlx
    from models.drafter_mlx import DFlashDraftModel as MLXDrafter

    real_load, real_logits = MLXDrafter.from_pretrained, export.mlx.mlx_logits

    def load(path, dtype=None, revision=None):
        model = real_load(path, dtype=dtype, revision=revision)
        model.reloaded = Path(path).name.endswith(".tmp")  # the gate's reload of the staging folder
        return model

    monkeypatch.setattr(MLXDrafter, "from_pretrained", staticmethod(load))
    monkeypatch.setattr(export.mlx, "mlx_logits",
                        lambda model, *a: real_logits(model, *a) * (1.001 if getattr(model, "reloaded", False) else 1))
    with mx.stream(mx.cpu), pytest.raises(ExportCheckError, match="logits differ .*tolerance 1e-04 for float32"):
        export.mlx.export_mlx(setup[3], tmp_path / "mlx", dtype="fp32", log=quiet)
    assert not (tmp_path / "mlx").exists()


def test_export_mlx_refuses_bits_and_group_sizes_it_does_not_write(setup, tmp_path):
    pytest.importorskip("mlx.core")
    from export.mlx import export_mlx

    with pytest.raises(ValueError, match="--group-size 16: use 32, 64 or 128"):
        export_mlx(setup[3], tmp_path / "q", quantize=4, group_size=16, log=quiet)
    with pytest.raises(ValueError, match="--quantize 3: use 4 or 8"):
        export_mlx(setup[3], tmp_path / "q", quantize=3, log=quiet)
    with pytest.raises(ValueError, match=r"--dtype 'int8': use one of \['bf16', 'fp16', 'fp32'\]"):
        export_mlx(setup[3], tmp_path / "q", dtype="int8", log=quiet)
    assert not (tmp_path / "q").exists()


def test_export_mlx_cli_defaults_and_what_it_passes_on(monkeypatch):
    """Defaults: bf16, unquantized, group 64 once --quantize is given; every flag reaches export_mlx."""
    import export.mlx

    args = export.mlx.parse_args(["--checkpoint", "c", "--out", "o"])
    assert (args.quantize, args.group_size, args.dtype, args.overwrite) == (None, 64, "bf16", False)
    assert export.mlx.parse_args(["--checkpoint", "c", "--out", "o", "--quantize", "8"]).group_size == 64
    for bad in (["--quantize", "2"], ["--dtype", "fp64"], ["--group-size", "32"]):  # the last: no --quantize
        with pytest.raises(SystemExit):
            export.mlx.parse_args(["--checkpoint", "c", "--out", "o", *bad])
    seen = {}
    monkeypatch.setattr(export.mlx, "export_mlx", lambda checkpoint, out, **kw: seen.update(kw, at=(checkpoint, out)))
    export.mlx.main(["--checkpoint", "c", "--out", "o", "--quantize", "4", "--group-size", "32", "--dtype", "fp16",
                     "--target", "org/t", "--target-revision", "r1", "--overwrite"])
    assert seen == {"at": ("c", "o"), "quantize": 4, "group_size": 32, "dtype": "fp16", "target": "org/t",
                    "target_revision": "r1", "overwrite": True}


def test_mlx_fp16_export_and_the_gate_runs_the_drafter_in_its_own_dtype(setup, tmp_path):
    """--dtype fp16 writes float16 weights and config; the gate feeds the MLX drafter inputs cast to its
    dtype (as the loop does), so inputs already rounded to it give the very same logits."""
    mx = pytest.importorskip("mlx.core")
    from export.check import random_block, stand_in_head
    from export.mlx import export_mlx, mlx_logits
    from models.drafter_mlx import DFlashDraftModel as MLXDrafter

    _, _, drafter, ckpt = setup
    with mx.stream(mx.cpu):
        summary = export_mlx(ckpt, tmp_path / "fp16", dtype="fp16", log=quiet)
        assert summary["quantization"] is None and summary["dtype"] == "fp16"
        assert json.loads((tmp_path / "fp16" / "config.json").read_text())["torch_dtype"] == "float16"
        weights = mx.load(str(tmp_path / "fp16" / "model.safetensors"))
        assert {v.dtype for v in weights.values()} == {mx.float16}
        model = MLXDrafter.from_pretrained(tmp_path / "fp16")
        inputs, head = random_block(model.config), stand_in_head(model.config)
        rounded = {k: (v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v)
                   for k, v in inputs.items()}
        assert np.array_equal(mlx_logits(model, inputs, head), mlx_logits(model, rounded, head))
        q8 = export_mlx(ckpt, tmp_path / "q8", quantize=8, group_size=32, log=quiet)
        assert q8["quantization"] == {"bits": 8, "group_size": 32, "mode": "affine"}


@pytest.mark.parametrize("corrupt", ["weight value", "config value", "schema", "logits"])
def test_mlx_gate_refuses_a_folder_that_differs_from_the_drafter(setup, tmp_path, monkeypatch, corrupt):
    """Each gate check on its own: a reloaded weight one step off, a config value written wrong, a key the
    engines must not read, logits 10% off with weights and config intact. Nothing is placed."""
    mx = pytest.importorskip("mlx.core")
    import export.mlx
    from models.config import DFlashConfig
    from models.drafter_mlx import DFlashDraftModel as MLXDrafter

    if corrupt == "weight value":
        real_load = MLXDrafter.from_pretrained

        def nudged(path, dtype=None, revision=None):
            model = real_load(path, dtype=dtype, revision=revision)
            if Path(path).name.endswith(".tmp"):  # the gate's reload of the staging folder
                model.hidden_norm["weight"] = model.hidden_norm["weight"] * 1.01
            return model

        monkeypatch.setattr(MLXDrafter, "from_pretrained", staticmethod(nudged))
        expected = "hidden_norm.weight changed on the way to disk"
    elif corrupt in ("config value", "schema"):
        real_dict = DFlashConfig.to_dict

        def wrong(self):
            d = real_dict(self)
            if corrupt == "config value":
                d["dflash_config"]["mask_token_id"] += 1
            else:
                d["eagle_aux_hidden_state_layer_ids"] = d["dflash_config"]["target_layer_ids"]
            return d

        monkeypatch.setattr(DFlashConfig, "to_dict", wrong)
        expected = "does not read back" if corrupt == "config value" else "fails the engine schema"
    else:
        real_logits = export.mlx.mlx_logits
        monkeypatch.setattr(export.mlx, "mlx_logits", lambda *a: real_logits(*a) * 1.1)
        expected = "logits differ"
    with mx.stream(mx.cpu), pytest.raises(ExportCheckError, match=expected):
        export.mlx.export_mlx(setup[3], tmp_path / "mlx", log=quiet)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_mlx_export_records_provenance_and_checks_the_target(setup, tmp_path):
    mx = pytest.importorskip("mlx.core")
    from export.mlx import export_mlx

    target_dir, _, drafter, ckpt = setup
    with mx.stream(mx.cpu):
        export_mlx(ckpt, tmp_path / "ok", log=quiet)
        prov = json.loads((tmp_path / "ok" / "config.json").read_text())["draftsmith"]
        assert prov["target"] == str(target_dir) and prov["steps"] == 7
        bad = tmp_path / "bad_mask"
        DFlashDraftModel(drafter.config.replace(mask_token_id=65)).save_pretrained(bad)  # 65 = the byte 'b'
        with pytest.raises(ExportCheckError, match="mask_token_id=65 .* is a token the target's tokenizer emits"):
            export_mlx(bad, tmp_path / "out", target=str(target_dir), log=quiet)
        with pytest.raises(ValueError, match="--group-size 128 does not divide the input width"):
            export_mlx(ckpt, tmp_path / "out", quantize=4, group_size=128, log=quiet)
    assert not (tmp_path / "out").exists()
