"""Bad inputs a user makes at this stage, each ending in a clear error (or a correct rebuild), never silently.

Part of the bad-input table: ``pytest -m bad_input`` runs every stage's cases.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_store_rows
from tests.helpers.bad_input import _DATA_FIX, argparse_error, bench

pytestmark = pytest.mark.bad_input


def test_no_held_out_rows_trains_without_eval(data_target, tmp_path):
    """data.eval_rows=0 once raised IndexError (datasets refuses an empty range starting at len(ds))."""
    from data.prepare import ensure_prepared
    from models.target import TargetModel
    from train.config import load_config
    from train.setup import load_data

    out = tmp_path / "data"
    ensure_prepared(str(data_target), str(_DATA_FIX / "openai.jsonl"), out, progress=False, log=lambda *_: None)
    cfg = load_config(["recipe=tiny", f"data.prepared={out}", "data.eval_rows=0", "data.regenerate=none"])
    target = TargetModel.from_pretrained(data_target)
    train_ds, eval_ds, _ = load_data(cfg, str(data_target), target, tmp_path, None, lambda *_: None)
    assert len(eval_ds) == 0 and len(train_ds) > 0


def test_a_subset_with_a_local_source_is_refused_before_any_target_loads(data_target, tmp_path, monkeypatch):
    """--subset / data.subset name a Hub data set's configuration: with a local file it was ignored, yet recorded in
    the prepared folder's settings, so correcting it later was refused as "other settings"."""
    import data.prepare
    import train.setup
    from data.readers import iter_conversations
    from train.distill import main

    src = tmp_path / "chats.jsonl"
    src.write_text((_DATA_FIX / "openai.jsonl").read_text())
    said = f"subset 'en' names a configuration of a Hub data set, and {src} is local"
    with pytest.raises(ValueError, match=said):
        next(iter_conversations(src, subset="en"))
    monkeypatch.setattr(data.prepare, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
    with pytest.raises(ValueError, match=said):
        data.prepare.main(["--source", str(src), "--subset", "en", "--out", str(tmp_path / "data"), "--target",
                           str(data_target), "--regenerate", "local", "--no-progress"])
    monkeypatch.setattr(train.setup, "load_target", lambda *a, **k: pytest.fail("the target loaded first"))
    with pytest.raises(ValueError, match=said):
        main(["recipe=tiny", f"out_dir={tmp_path / 'run'}", f"data.source={src}", "data.subset=en"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]
    assert next(iter_conversations(src))["messages"]  # without the subset the file reads as before


@pytest.mark.parametrize("override, suggestion", [
    ("train.learning_rate=1e-3", "train.lr"), ("lr=1e-3", "train.lr"), ("data.path=x.jsonl", "data.source"),
    ("dataset=x.jsonl", "data.source"), ("model=Qwen/Qwen3-8B", "target.path"), ("path=./t", "target.path"),
    ("train.gradient_accumulation_steps=4", "train.grad_accum"), ("drafter.layers=3", "drafter.num_hidden_layers"),
])
def test_other_trainers_key_names_suggest_ours_and_list_the_section(override, suggestion):
    from train.config import load_config
    from train.overrides import ConfigKeyError

    with pytest.raises(ConfigKeyError, match=f"did you mean '{suggestion}'") as e:
        load_config(["recipe=tiny", override])
    section = suggestion.split(".")[0]
    assert f"({section}. keys: " in str(e.value)  # the valid names, not just one guess


@pytest.mark.parametrize("override, suggestion", [
    ("train.Learning_Rate=1e-3", "train.lr"), ("train.learning-rate=1e-3", "train.lr"),  # any case, dashes
    ("eval.path=x", "target.path"),  # a section without the aliased key: the key's usual home
    ("optim.weight_decay=0.1", "train.weight_decay"),  # no such section: the leaf of that name
    ("featuresmode=offline", "features.mode"),  # no leaf name close to it: the closest whole key
    ("trn.ep=2", "train.epochs"),  # the whole key is compared, not only its last part
    ("opt.train=1", "train.lr"),  # a section's name is no key to set: a leaf is suggested
])
def test_a_misspelled_key_suggests_the_key_it_was_meant_for(override, suggestion):
    from train.config import load_config
    from train.overrides import ConfigKeyError

    with pytest.raises(ConfigKeyError, match=f"did you mean '{suggestion}'"):
        load_config(["recipe=tiny", override])


def test_an_unknown_key_lists_the_names_of_the_section_it_belongs_in():
    """The names listed are the section's own (the suggestion's section when the one typed does not exist);
    a top-level suggestion lists the top-level keys alone."""
    from dataclasses import fields

    from train.config import RunConfig, TrainConfig, load_config
    from train.overrides import ConfigKeyError

    with pytest.raises(ConfigKeyError) as e:
        load_config(["recipe=tiny", "optim.weight_decay=0.1"])
    names = ", ".join(f.name for f in fields(TrainConfig))
    assert str(e.value).endswith(f"did you mean 'train.weight_decay'? (train. keys: {names}; `--help` lists every key)")
    with pytest.raises(ConfigKeyError) as e:
        load_config(["recipe=tiny", "optim.out_dirr=x"])
    top = ", ".join(f.name for f in fields(RunConfig))
    assert str(e.value) == (f"unknown config key 'optim.out_dirr'; did you mean 'out_dir'? (top-level keys: {top}; "
                            "`--help` lists every key)")


@pytest.mark.parametrize("changes, refused", [
    (["drafter.block_size=16"], ["drafter.block_size: 8 -> 16"]),
    (["drafter.target_layer_ids=[1,2,4]", "drafter.num_hidden_layers=3"],
     ["drafter.num_hidden_layers: 2 -> 3", "drafter.target_layer_ids: None -> [1, 2, 4]"]),
    (["train.seed=1"], ["train.seed: 0 -> 1"]),  # another data order and other anchors
    (["train.loss=kl"], ["train.loss: 'ce' -> 'kl'"]),
    (["data.max_length=512"], ["data.max_length: 256 -> 512"]),
    (["target.path=./other"], ["target.path: 'tiny:qwen3' -> './other'"]),
    (["train.batch_size=4"], ["train.batch_size: 8 -> 4"]),
])
def test_resume_with_changed_model_or_data_settings_is_refused_naming_each(tmp_path, changes, refused):
    from train.checkpoint import ResumeConfigError, check_resume_config
    from train.config import load_config

    ckpt = tmp_path / "checkpoints" / "step_3"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(load_config(["recipe=tiny"]).to_yaml())
    logged: list[str] = []
    with pytest.raises(ResumeConfigError) as e:
        check_resume_config(ckpt, load_config(["recipe=tiny", "resume=true", "logging.every=1", *changes]),
                            logged.append)
    msg = str(e.value)
    assert all(r in msg for r in refused) and "logging.every" not in msg and "another out_dir" in msg, msg


def test_resume_shorter_than_the_checkpoint_is_refused_and_a_broken_trainer_state_named(tmp_path):
    """Lengthening a run on resume is allowed (tests/test_train_reliability.py); a train.max_steps before
    the checkpoint's step has nothing to train, and an unreadable trainer_state.json names the checkpoint."""
    from train.checkpoint import ResumeConfigError, resume_checkpoint
    from train.config import load_config

    ckpt = tmp_path / "checkpoints" / "step_6"
    ckpt.mkdir(parents=True)
    saved = load_config(["recipe=tiny", f"out_dir={tmp_path}", "train.max_steps=6"])
    (ckpt / "config.yaml").write_text(saved.to_yaml())
    (ckpt / "trainer_state.json").write_text('{"step": 6, "epoch": 0, "step_in_epoch": 6}')
    cfg = load_config(["recipe=tiny", f"out_dir={tmp_path}", "resume=true", "train.max_steps=4"])
    with pytest.raises(ResumeConfigError, match=r"step_6 is at step 6, past train\.max_steps=4: raise it to train "
                                                r"longer, or export that checkpoint"):
        resume_checkpoint(cfg, tmp_path, lambda *_: None)
    logged: list[str] = []
    longer = load_config(["recipe=tiny", f"out_dir={tmp_path}", "resume=true", "train.max_steps=9"])
    assert resume_checkpoint(longer, tmp_path, logged.append) == ckpt
    assert logged == ["resume: settings changed since the checkpoint (harmless): train.max_steps: 6 -> 9"]
    (ckpt / "trainer_state.json").write_text('{"step": 6, "ep')  # killed while writing
    with pytest.raises(ValueError, match=r"trainer_state\.json is missing or not JSON .*incomplete\. Delete \(or move "
                                         r"away\) .*step_6 to start over: it is the only checkpoint"):
        resume_checkpoint(cfg, tmp_path, lambda *_: None)


@pytest.mark.parametrize("error", ["dcp", "safetensors", "pickle", "eof"])
def test_every_reader_error_of_a_damaged_checkpoint_becomes_one_line(tmp_path, error):
    """The readers accelerate.load_state calls raise their own types (FSDP's sharded reader a
    BaseException): each becomes the one-line CheckpointError; a bug elsewhere (KeyError) stays a traceback."""
    import pickle

    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from train.checkpoint import CheckpointError, load_checkpoint

    raised = {"dcp": CheckpointException("read failed", {1: _wrap_exception(ValueError("bad __1_0.distcp"))}),
              "safetensors": SafetensorError("Error while deserializing header: HeaderTooLarge"),
              "pickle": pickle.UnpicklingError("pickle data was truncated"), "eof": EOFError("Ran out of input")}
    for step in (1, 4):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "trainer_state.json").write_text(f'{{"step": {step}}}')

    class Accelerator:
        def __init__(self, exc):
            self.exc = exc

        def load_state(self, path):
            raise self.exc

    with pytest.raises(CheckpointError, match=f"step_4 \\({type(raised[error]).__name__}: .*Delete \\(or move away\\) "
                                              ".*step_4 to resume from .*step_1$"):
        load_checkpoint(Accelerator(raised[error]), tmp_path / "checkpoints" / "step_4")
    if error == "dcp":  # the failing rank's own error, not "CheckpointException ranks:dict_keys([1])"
        with pytest.raises(CheckpointError, match=r"\(CheckpointException: rank 1: ValueError: bad __1_0\.distcp\)"):
            load_checkpoint(Accelerator(raised[error]), tmp_path / "checkpoints" / "step_4")
    with pytest.raises(KeyError):
        load_checkpoint(Accelerator(KeyError("optimizer")), tmp_path / "checkpoints" / "step_4")


def test_a_full_disk_while_checkpointing_keeps_the_last_checkpoint_and_says_so(tmp_path_factory, tmp_path,
                                                                               monkeypatch):
    """ENOSPC while writing step 2's checkpoint: one line naming the intact step_1 and resume=true, the
    half-written step_2.tmp removed (it only takes space); the resumed run then finishes."""
    import errno

    import train.checkpoint
    from tests.helpers.tiny_run import FAST, losses, run, tiny_input_dirs
    from train.checkpoint import CheckpointError

    d = tiny_input_dirs(tmp_path_factory)
    args = [f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "checkpoint.every=1",
            "train.max_steps=3", "train.batch_size=4", "train.anchors=8", "eval.batches=1", "logging.every=1"]
    real, calls = train.checkpoint.save_drafter, []

    def full_disk_at_the_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **kw)

    monkeypatch.setattr(train.checkpoint, "save_drafter", full_disk_at_the_second)
    with pytest.raises(CheckpointError, match=r"could not write the checkpoint of step 2 under .* \(No space left on "
                                              r"device; [\d.]+ [GM]iB free there\), the half-written step_2.tmp "
                                              r"removed: the newest complete one, .*step_1, is intact: free space "
                                              r"\(or fix the folder\) and rerun with resume=true"):
        run(tmp_path, *args)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    monkeypatch.setattr(train.checkpoint, "save_drafter", real)
    assert run(tmp_path, *args, "resume=true")["steps"] == 3 and sorted(losses(tmp_path)) == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_3"]  # keep_last 2
    # The final drafter cannot be written: the last step's checkpoint holds it, and resume=true writes it again.
    import shutil

    shutil.rmtree(tmp_path / "final")
    monkeypatch.setattr(train.checkpoint, "save_drafter", lambda *a, **kw: (_ for _ in ()).throw(
        OSError(errno.EDQUOT, "Disk quota exceeded")))
    with pytest.raises(CheckpointError, match=r"could not write the final drafter to .*final \(Disk quota exceeded; "
                                              r".* free there\), the half-written final.tmp removed: the checkpoint of "
                                              r"the last step, .*step_3, holds the same weights"):
        run(tmp_path, *args, "resume=true")
    monkeypatch.setattr(train.checkpoint, "save_drafter", real)
    run(tmp_path, *args, "resume=true")
    assert (tmp_path / "final" / "drafter" / "model.safetensors").is_file()


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.bin"])
def test_resume_from_a_damaged_checkpoint_names_it_and_the_one_before(tmp_path_factory, tmp_path, damaged):
    """A checkpoint truncated after it was written (a copy cut short, a full disk): one line naming the
    checkpoint and the fallback, instead of torch's or pickle's traceback; the older one then resumes.
    (accelerate itself skips an unreadable random_states_N.pkl with a log line: harmless here, the data
    order and the anchors come from their own generators, train/rng.py.)"""
    from tests.helpers.tiny_run import FAST, run, tiny_input_dirs
    from train.checkpoint import CheckpointError

    d = tiny_input_dirs(tmp_path_factory)
    args = [f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "checkpoint.every=1",
            "train.max_steps=2", "train.batch_size=4", "train.anchors=8", "eval.batches=1"]
    run(tmp_path, *args)
    __import__("shutil").rmtree(tmp_path / "final")  # stopped before final/ was written: resume=true reads step_2
    (tmp_path / "checkpoints" / "step_2" / "checksums.json").unlink()  # written before checkpoints had checksums
    f = tmp_path / "checkpoints" / "step_2" / "state" / damaged
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"could not restore the checkpoint .*step_2 \(.*\): a file under "
                                              r".*step_2/state is damaged or missing\. Delete \(or move away\) "
                                              r".*step_2 to resume from .*step_1$"):
        run(tmp_path, *args, "resume=true")
    __import__("shutil").rmtree(tmp_path / "checkpoints" / "step_2")
    assert run(tmp_path, *args, "resume=true")["steps"] == 2


def test_resume_with_only_harmless_changes_warns_and_continues(tmp_path):
    from train.checkpoint import HARMLESS_KEYS, check_resume_config
    from train.config import load_config

    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(load_config(["recipe=tiny"]).to_yaml())
    logged: list[str] = []
    check_resume_config(ckpt, load_config(["recipe=tiny", "resume=true", "logging.every=1", "eval.every=7",
                                           "checkpoint.keep_last=5", "train.ce_chunk=64",
                                           "train.flex_backward=64,64,64,64,2,8"]), logged.append)
    assert logged == ["resume: settings changed since the checkpoint (harmless): checkpoint.keep_last: 2 -> 5; "
                      "eval.every: 0 -> 7; logging.every: 10 -> 1; train.ce_chunk: 2048 -> 64; "
                      "train.flex_backward: 'auto' -> '64,64,64,64,2,8'"]
    assert len(HARMLESS_KEYS) < 32  # an explicit, short list: everything else is refused


def test_compiled_drafter_layers_off_cuda_are_refused():
    """train.compile=true targets CUDA kernels: on a CPU run it says so instead of compiling for minutes."""
    from types import SimpleNamespace

    import torch

    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer
    from tests.helpers import tiny_drafter_config
    from train.config import load_config
    from train.distill import build_drafter

    target = TargetModel(tiny_target("qwen3"), tiny_tokenizer())
    run = SimpleNamespace(cfg=load_config(["recipe=tiny", "train.compile=true"]), device=torch.device("cpu"))
    with pytest.raises(ValueError, match="train.compile=true .* this run is on cpu: drop train.compile"):
        build_drafter(run, tiny_drafter_config(target), target)


def test_flex_attention_off_cuda_is_refused_before_anything_loads(monkeypatch, tmp_path):
    """train.attention=flex on a CPU ended in torch's NotImplementedError traceback at the first backward."""
    import torch

    from train.config import load_config
    from train.distill import setup_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(["recipe=tiny", "train.attention=flex", f"out_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="train.attention=flex needs a CUDA GPU .*use train.attention=auto"):
        setup_run(cfg)
    assert not (tmp_path / "run").exists()


def test_a_run_folder_as_drafter_init_from_names_the_drafter_inside(tmp_path):
    """drafter.init_from=runs/NAME said only "config.json not found", where --draft named the drafter inside."""
    from models.drafter import DFlashDraftModel

    (tmp_path / "run" / "final" / "drafter").mkdir(parents=True)
    (tmp_path / "run" / "final" / "drafter" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="a training run or checkpoint folder: pass .*run/final/drafter"):
        DFlashDraftModel.from_pretrained(tmp_path / "run")


@pytest.mark.parametrize("what, said", [("missing", "is neither a local folder nor a Hub id"),
                                        ("not a drafter", "not a DFlash drafter folder")])
def test_a_warm_start_folder_that_is_no_drafter_is_named_before_the_target_loads(tmp_path, monkeypatch, what, said):
    """drafter.init_from=<a typo> was named only once the target had loaded and the data had been prepared
    (regenerated: hours on a real target)."""
    import train.setup
    from train.distill import main

    folder = tmp_path / "old-run" / "final" / "drafterr"
    if what == "not a drafter":
        folder.mkdir(parents=True)
        (folder / "config.json").write_text('{"model_type": "qwen3"}')
    monkeypatch.setattr(train.setup, "load_target", lambda *a, **k: pytest.fail("the target loaded first"))
    with pytest.raises((FileNotFoundError, ValueError), match=f"drafter.init_from.*{said}"):
        main(["recipe=tiny", f"out_dir={tmp_path / 'run'}", f"drafter.init_from={folder}"])
    assert not (tmp_path / "run").exists()


def test_an_offline_store_that_is_missing_or_unfinished_is_named_before_the_target_loads(tmp_path, monkeypatch):
    """features.store=<a typo>, or a store whose extraction is still running, was named only once the target had
    loaded (the whole target on the main process, for true tau) and the data had been prepared."""
    import train.setup
    from data.store_writer import StoreWriter
    from train.distill import main

    monkeypatch.setattr(train.setup, "load_target", lambda *a, **k: pytest.fail("the target loaded first"))
    run = ["recipe=tiny", f"out_dir={tmp_path / 'run'}", "features.mode=offline"]
    with pytest.raises(FileNotFoundError, match="feats-typo is not a feature store .*python -m data.extract"):
        main([*run, f"features.store={tmp_path / 'feats-typo'}"])
    StoreWriter(tmp_path / "feats", {"dtype": "bf16", "layer_ids": [1], "topk": 0, "rows": 4},
                [(0, 2), (2, 4)]).write_shard(0, tiny_store_rows())
    with pytest.raises(ValueError, match="extraction not finished \\(1/2 shards\\); re-run the same data.extract"):
        main([*run, f"features.store={tmp_path / 'feats'}"])
    assert not (tmp_path / "run").exists()


def test_a_list_override_with_an_empty_item_is_refused():
    """drafter.target_layer_ids=1,,17 was read as [1, 17]: a value left out (1,9,17 meant) trained a drafter
    on two taps instead of a clear error. A whole empty value is still the empty list."""
    from train.config import load_config
    from train.overrides import ConfigValueError

    for bad in ("1,,17", "1,9,", "1, ,9"):  # (",1,9" is not YAML: refused before, as such)
        with pytest.raises(ConfigValueError, match="an empty item in the list.*separated by single commas"):
            load_config(["recipe=tiny", f"drafter.target_layer_ids={bad}"])
    assert load_config(["recipe=tiny", "drafter.target_layer_ids=1, 3,5"]).drafter.target_layer_ids == [1, 3, 5]


def test_an_optional_override_of_the_wrong_kind_says_what_it_takes():
    """data.thinking=maybe said "expected bool | None" (a Python type, not a value one can write)."""
    from train.config import load_config
    from train.overrides import ConfigValueError

    with pytest.raises(ConfigValueError, match=r"data.thinking='maybe': expected true or false or null$"):
        load_config(["recipe=tiny", "data.thinking=maybe"])
    with pytest.raises(ConfigValueError, match=r"train.max_steps='ten': expected an integer or null$"):
        load_config(["recipe=tiny", "train.max_steps=ten"])


@pytest.mark.parametrize("overrides, message", [
    (["export.push_repo=me/d"], "pushes the HF export: add export.hf=true"),
    (["export.push_mlx_repo=me/d"], "pushes the MLX export: add export.mlx=true"),
    (["export.mlx=true", "export.mlx_quantize=3"], "use 4 or 8 (bits)"),
    (["export.mlx=true", "export.mlx_group_size=16"], "use 32, 64 or 128"),
    (["export.hf=true", "export.hf_dtype=int8"], "use bf16, fp16 or fp32"),
])
def test_training_export_keys_are_checked_before_training(overrides, message):
    import re

    from train.config import load_config

    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(["recipe=tiny"] + overrides)


@pytest.mark.parametrize("overrides, message", [
    (["export.hf=true", "export.push_repo=me/d"], "export.push_repo push to the Hub after training, and there is "
                                                  "no Hugging Face token: run `hf auth login`"),
    (["export.hf=true", "export.push_repo=my-drafter"], "export.push_repo='my-drafter' is not a Hub repo id: use "
                                                        "user/name"),
    (["export.mlx=true"], "export.mlx=true needs MLX, which is not installed here"),
])
def test_an_export_stage_that_would_fail_after_training_is_refused_before_anything_loads(tmp_path, monkeypatch,
                                                                                         overrides, message):
    """A push without a Hub token, a repo id without its owner, or export.mlx without MLX failed only once the
    whole training was done."""
    import sys

    import huggingface_hub

    import train.setup
    from train.distill import main
    from train.export_stage import ExportStageError

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setitem(sys.modules, "mlx.core", None)  # import mlx.core: ImportError, as without MLX
    monkeypatch.setattr(train.setup, "load_target", lambda *a, **k: pytest.fail("the target loaded first"))
    with pytest.raises(ExportStageError, match=re.escape(message)):
        main(["recipe=tiny", f"out_dir={tmp_path / 'run'}", *overrides])
    assert not (tmp_path / "run").exists()


def test_a_fresh_run_over_an_earlier_one_never_mixes_their_checkpoints(tmp_path_factory, tmp_path, capsys):
    """A run without resume=true in a used out_dir once kept the earlier run's later checkpoints, which a
    later resume=true then picked. A finished earlier run is replaced; an unfinished one is refused."""
    import shutil

    from tests.helpers.tiny_run import FAST, run, tiny_input_dirs
    from train.checkpoint import ResumeConfigError, checkpoint_dirs

    d = tiny_input_dirs(tmp_path_factory)
    tiny = [f"target.path={d['target']}", f"data.prepared={d['data']}"]
    STEPS = ["logging.every=1", "eval.batches=2"]

    base = [*tiny, *FAST, *STEPS, "checkpoint.every=1"]
    run(tmp_path, *base, "train.max_steps=3")
    capsys.readouterr()
    run(tmp_path, *base, "train.max_steps=2", "train.seed=1")
    assert "removing the earlier (finished) run's checkpoints step_2, step_3" in capsys.readouterr().out
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_1", "step_2"]
    assert run(tmp_path, *base, "train.max_steps=3", "train.seed=1", "resume=true")["steps"] == 3  # its own steps
    shutil.rmtree(tmp_path / "final")  # as if it had crashed after step 3's checkpoint
    with pytest.raises(ResumeConfigError, match="holds an unfinished run \\(newest checkpoint .*step_3, step 3\\): "
                                                "resume=true continues it; to start over, delete"):
        run(tmp_path, *base, "train.max_steps=2")
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_2", "step_3"]  # untouched


def test_a_rerun_that_stops_on_a_mistake_keeps_the_finished_runs_checkpoints(tmp_path_factory, tmp_path):
    """Rerunning a finished run's command without resume=true and with a mistake (a tap past the target's
    layers, a mistyped data.source) removed its checkpoints and metrics at start, then stopped on the mistake:
    the run could no longer be resumed to train longer."""
    from tests.helpers.tiny_run import FAST, run, tiny_input_dirs
    from train.checkpoint import checkpoint_dirs

    d = tiny_input_dirs(tmp_path_factory)
    base = [f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "logging.every=1",
            "eval.batches=2", "checkpoint.every=1"]
    run(tmp_path, *base, "train.max_steps=2")
    logged, settings = (tmp_path / "metrics.jsonl").read_text(), (tmp_path / "config.yaml").read_text()
    with pytest.raises(ValueError, match="layer id 99 is outside"):
        run(tmp_path, *base, "train.max_steps=2", "drafter.target_layer_ids=[1,99]")
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_1", "step_2"]
    assert (tmp_path / "metrics.jsonl").read_text() == logged
    assert (tmp_path / "config.yaml").read_text() == settings  # still the finished run's settings
    assert run(tmp_path, *base, "train.max_steps=3", "resume=true")["steps"] == 3
    run(tmp_path, *base, "train.max_steps=1")  # a fresh run that loads: it owns the folder now
    assert "max_steps: 1" in (tmp_path / "config.yaml").read_text()


def test_more_held_out_rows_than_the_data_allows_are_said_to_be_capped(tmp_path_factory, tmp_path, capsys):
    """data.eval_rows=1000 on a few hundred rows was quietly cut to a fifth of them."""
    from tests.helpers.tiny_run import FAST, run, tiny_input_dirs

    d = tiny_input_dirs(tmp_path_factory)
    run(tmp_path, f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "train.max_steps=1",
        "eval.batches=1", "data.eval_rows=1000")
    assert re.search(r"held out \(data.eval_rows=1000 capped at a fifth of the rows\)", capsys.readouterr().out)


def test_held_out_rows_are_the_last_ones_and_at_most_a_fifth(tmp_path_factory, tmp_path):
    """data.eval_rows rows from the end of the prepared set are held out (at most a fifth of them); the
    rest, in their order, are trained on."""
    from data.prepare import load_prepared
    from models.target import TargetModel
    from tests.helpers.tiny_run import tiny_input_dirs
    from train.config import load_config
    from train.plan import held_out_rows
    from train.setup import load_data

    assert [held_out_rows(e, 240) for e in (0, 10, 48, 1000)] == [0, 10, 48, 48]
    d = tiny_input_dirs(tmp_path_factory)
    rows = load_prepared(d["data"])[0]["input_ids"]
    cfg = load_config(["recipe=tiny", f"data.prepared={d['data']}", "data.eval_rows=3"])
    train_ds, eval_ds, _ = load_data(cfg, str(d["target"]), TargetModel.from_pretrained(d["target"]), tmp_path, None,
                                     lambda *_: None)
    assert train_ds["input_ids"] == rows[:-3] and eval_ds["input_ids"] == rows[-3:]


@pytest.mark.parametrize("caught_by", ["logged loss", "checkpoint"])
def test_a_diverged_run_stops_and_saves_nothing_non_finite(tmp_path_factory, tmp_path, monkeypatch, caught_by):
    """Weights gone NaN once trained on and were saved as checkpoints (keep_last then deleting the good
    ones) and as a final drafter. The run now stops at the next logged loss or checkpoint, naming the
    newest checkpoint (finite, kept) and what to change; nothing non-finite is written."""
    import torch

    import train.loop
    from tests.helpers.tiny_run import FAST, run, tiny_input_dirs
    from train.checkpoint import checkpoint_dirs
    from train.loop import TrainingDiverged

    d = tiny_input_dirs(tmp_path_factory)
    real, steps = train.loop.train_step, []

    def poisoned(run_, model, *args, **kwargs):  # the weights go NaN in the optimizer step of step 3
        stats = real(run_, model, *args, **kwargs)
        steps.append(1)
        if len(steps) == 3:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        return stats

    monkeypatch.setattr(train.loop, "train_step", poisoned)
    every = ["logging.every=1", "checkpoint.every=100"] if caught_by == "logged loss" else \
        ["logging.every=100", "checkpoint.every=2"]
    with pytest.raises(TrainingDiverged, match="training diverged at step 4: .*Nothing non-finite was saved"):
        run(tmp_path, f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "train.max_steps=6",
            "eval.batches=1", "checkpoint.keep_last=1", *every)
    assert not (tmp_path / "final").exists()
    kept = [p.name for p in checkpoint_dirs(tmp_path)]
    assert kept == ([] if caught_by == "logged loss" else ["step_2"])  # step 4 not written, step 2 not rotated out


def test_final_drafter_is_replaced_whole_and_records_its_own_steps(tmp_path_factory, tmp_path, monkeypatch, capsys):
    """final/ was written in place: a kill could pair a new config.yaml with the old weights, and Ctrl-C
    there printed no resume command. Export took the steps from metrics.jsonl, which a resumed run
    killed later had logged past what final/ held. Now final/ is written whole then renamed, with
    trained.json (its steps), which export reads first."""
    import json

    import train.checkpoint
    from export.hf import main as export_hf
    from tests.helpers.tiny_run import FAST, run, tiny_input_dirs

    d = tiny_input_dirs(tmp_path_factory)
    base = [f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "eval.batches=1", "logging.every=1"]
    run(tmp_path, *base, "train.max_steps=2")
    final = tmp_path / "final"
    assert json.loads((final / "trained.json").read_text()) == {"step": 2}
    weights = (final / "drafter" / "model.safetensors").read_bytes()
    real = train.checkpoint.save_drafter

    def interrupted(accelerator, model, directory, dtype=None):
        if directory.parent.name == "final.tmp":
            raise KeyboardInterrupt
        return real(accelerator, model, directory, dtype)

    monkeypatch.setattr(train.checkpoint, "save_drafter", interrupted)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, *base, "train.max_steps=3", "resume=true")
    assert "resume=true" in capsys.readouterr().out  # the resume command, as for Ctrl-C during training
    assert json.loads((final / "trained.json").read_text()) == {"step": 2}  # the old final/, whole
    assert (final / "drafter" / "model.safetensors").read_bytes() == weights
    assert not (tmp_path / "final.tmp").exists()
    monkeypatch.setattr(train.checkpoint, "save_drafter", real)
    # Cut between its two renames (final -> final.old done, final.tmp -> final not): the old final/ is put back.
    from pathlib import Path

    rename = Path.rename

    def cut(self, to):
        if self.name == "final.tmp":
            raise KeyboardInterrupt
        return rename(self, to)

    monkeypatch.setattr(Path, "rename", cut)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, *base, "train.max_steps=3", "resume=true")
    monkeypatch.setattr(Path, "rename", rename)
    assert json.loads((final / "trained.json").read_text()) == {"step": 2}
    assert not (tmp_path / "final.old").exists() and not (tmp_path / "final.tmp").exists()
    run(tmp_path, *base, "train.max_steps=3", "resume=true")
    assert json.loads((final / "trained.json").read_text()) == {"step": 3}
    with (tmp_path / "metrics.jsonl").open("a") as f:  # as a later resumed run, killed, would have logged
        f.write(json.dumps({"step": 9, "loss": 1.0}) + "\n")
    export_hf(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf")])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["draftsmith"]["steps"] == 3


def test_resume_reads_the_same_rows_from_a_moved_folder_and_refuses_other_rows(tmp_path_factory, tmp_path, capsys):
    """The checkpoint records the rows' identity: data.prepared may then name a copy of the data (a run folder
    moved elsewhere), which once was refused as a changed setting, while other rows are refused."""
    import shutil
    from pathlib import Path

    from datasets import load_from_disk

    from tests.helpers.tiny_run import FAST, losses, run, tiny_input_dirs
    from train.checkpoint import ResumeConfigError

    d = tiny_input_dirs(tmp_path_factory)
    tiny = [f"target.path={d['target']}", f"data.prepared={d['data']}"]
    STEPS = ["logging.every=1", "eval.batches=2"]
    data = Path(tiny[1].split("=", 1)[1])
    moved, fewer = tmp_path / "moved-data", tmp_path / "fewer-rows"
    shutil.copytree(data, moved, copy_function=shutil.copy)
    ds = load_from_disk(str(data))
    ds.select(range(len(ds) - 1)).save_to_disk(str(fewer))
    shutil.copy(data / "draftsmith_data.json", fewer)
    base = [tiny[0], *FAST, *STEPS, "train.max_steps=2", "checkpoint.every=1"]
    run(tmp_path / "cut", f"data.prepared={data}", *base)
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_2")  # as if stopped after step 1
    with pytest.raises(ResumeConfigError, match="prepared rows differ from those the checkpoint .*step_1 trained "
                                                "on .*data order would change"):
        run(tmp_path / "cut", f"data.prepared={fewer}", *base, "resume=true")
    capsys.readouterr()
    run(tmp_path / "cut", f"data.prepared={moved}", *base, "resume=true")
    assert f"(harmless): data.prepared: '{data}' -> '{moved}'" in capsys.readouterr().out
    run(tmp_path / "full", f"data.prepared={data}", *base)
    assert losses(tmp_path / "cut")[2] == pytest.approx(losses(tmp_path / "full")[2], abs=1e-6)


def test_resume_counts_a_key_the_checkpoint_predates_as_its_default():
    """A checkpoint written before a setting existed is resumable when the run keeps that setting's default."""
    from train.checkpoint import config_changes

    saved, defaults = {"train": {"lr": 1e-4}}, {"train": {"lr": 3e-4, "new_knob": 3}}
    assert config_changes(saved, {"train": {"lr": 1e-4, "new_knob": 3}}, defaults) == ([], [])
    assert config_changes(saved, {"train": {"lr": 1e-4, "new_knob": 4}}, defaults)[0] == ["train.new_knob: 3 -> 4"]


def test_resume_compares_paths_as_folders_not_as_text(tmp_path, monkeypatch):
    """target.path=./run/tiny_target then run/tiny_target was refused as a changed setting."""
    from train.checkpoint import config_changes

    (tmp_path / "run" / "tiny_target").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    saved = {"target": {"path": "./run/tiny_target"}}
    for same in ("run/tiny_target", str(tmp_path / "run" / "tiny_target")):
        assert config_changes(saved, {"target": {"path": same}}, {}) == ([], [])
    (tmp_path / "run" / "other").mkdir()
    assert config_changes(saved, {"target": {"path": "run/other"}}, {})[0] == [
        "target.path: './run/tiny_target' -> 'run/other'"]


@pytest.mark.parametrize("override, message", [
    ("target.dtype=fp16x", "target.dtype='fp16x': use one of \\('auto', 'float32', 'bfloat16', 'float16'\\)"),
    ("train.epochs=0", "train.epochs=0.0: give a positive number of passes"),  # trained 1 step silently
    ("train.epochs=-1", "train.epochs=-1.0: give a positive number of passes"),
    ("train.max_steps=0", "train.max_steps=0 must be >= 1"),
    ("train.gamma=0", "train.gamma=0.0 must be > 0"),  # trained to NaN and saved a NaN "final drafter"
    ("train.gamma=-1", "train.gamma=-1.0 must be > 0"),
    ("train.lr=0", "train.lr=0.0 must be > 0"),
    ("train.warmup_ratio=1", "train.warmup_ratio=1.0 must be in \\[0, 1\\)"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio=2.0 must be in \\[0, 1\\]"),
    ("train.clip=-1", "train.clip=-1.0 must be >= 0"),
    ("train.kl_topk=0", "train.kl_topk=0 must be >= 1"),
    ("train.betas=[0.9,1.5]", "train.betas=\\[0.9, 1.5\\] must be two numbers in \\[0, 1\\)"),
    # each below once failed only after the target and data loaded, or after training (the final eval),
    # or named no key, or was silently replaced by a default
    ("eval.true_tau_max_new_tokens=0", "eval.true_tau_max_new_tokens=0 must be >= 1"),  # lost the run
    ("logging.every=0", "logging.every=0 must be >= 1"),  # ZeroDivisionError at step 1
    ("data.eval_rows=-1", "data.eval_rows=-1 must be >= 0"),
    ("data.max_length=-5", "data.max_length=-5 must be >= 1"),  # cut 5 tokens off every row
    ("train.epochs=.inf", "train.epochs=inf: give a finite number"),
    ("train.seed=-1", "train.seed=-1 must be in \\[0, 2\\*\\*32\\)"),
    ("drafter.num_attention_heads=0", "drafter.num_attention_heads=0 must be >= 1"),  # meant the target's
    ("drafter.intermediate_size=0", "drafter.intermediate_size=0 must be >= 1"),
    ("drafter.target_layer_ids=[]", "drafter.target_layer_ids=\\[\\] taps no layer"),
    ("drafter.head_dim=3", "drafter.head_dim=3 must be even"),  # a RoPE shape error at the first step
    ("drafter.rope_theta=-1", "drafter.rope_theta=-1.0 must be a positive RoPE base"),  # "diverged, lower lr"
    ("checkpoint.keep_last=-1", "checkpoint.keep_last=-1 must be >= 0"),
    # read by no run: training never extracts features (data.extract --dtype decides a store's dtype)
    ("features.dtype=fp8", "features.dtype=fp8 changes nothing: .*pass --dtype fp8 to python -m data.extract"),
    # failed at the first stage, after out_dir/config.yaml was written
    ("target.path=tiny:qwen9", "target.path=tiny:qwen9: no tiny target 'qwen9'; use one of tiny:qwen3, "),
    ("logging.wandb_mode=ofline", "logging.wandb_mode='ofline': use online, offline or disabled"),  # at wandb.init
])
def test_bad_training_values_fail_at_config_time(override, message):
    """target.dtype=bf16 once ended in an AttributeError from torch; it now means bfloat16, as elsewhere."""
    from train.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(["recipe=tiny", override])
    assert load_config(["recipe=tiny", "target.dtype=bf16"]).target.dtype == "bfloat16"


@pytest.mark.parametrize("overrides, message", [
    (["train.loss_weighting=dpce"], "train.loss_weighting='dpce': use one of \\('decay', 'dpace'\\)"),
    (["train.loss_weighting=dpace", "train.dpace_alpha=1.5"], "train.dpace_alpha=1.5 must be in \\[0, 1\\]"),
    (["train.loss_weighting=dpace", "train.dpace_alpha=-0.1"], "train.dpace_alpha=-0.1 must be in \\[0, 1\\]"),
    (["train.loss_weighting=dpace", "train.dpace_normaliser=batch"],
     "train.dpace_normaliser='batch': use weights \\(the default\\), tokens or rows"),
    # a key of the other weighting would be ignored without a word
    (["train.loss_weighting=decay", "train.dpace_alpha=0.3"],
     "train.dpace_alpha=0.3 set with train.loss_weighting=decay, which ignores it: add train.loss_weighting=dpace, "
     "or drop the dpace_\\* key"),
    (["train.loss_weighting=decay", "train.dpace_normaliser=rows"],
     "train.dpace_normaliser=rows set with train.loss_weighting=decay"),
    (["train.loss_weighting=dpace", "train.gamma=2"], "train.gamma=2.0 is the decay weighting's constant and does "
                                                      "nothing with train.loss_weighting=dpace: unset it with "
                                                      "train.gamma=null"),
])
def test_bad_loss_weighting_fails_at_config_time(overrides, message):
    """Each weighting takes its own keys; D-PACE's unset ones are resolved into the config (what checkpoints and
    the provenance record), and a recipe that sets gamma (small) needs it unset for D-PACE."""
    from train.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(["recipe=tiny", *overrides])
    with pytest.raises(ValueError, match="train.gamma=1.0 is the decay weighting's constant"):
        load_config(["recipe=small", "train.loss_weighting=dpace"])
    cfg = load_config(["recipe=small", "train.loss_weighting=dpace", "train.gamma=null"])
    assert (cfg.train.dpace_alpha, cfg.train.dpace_normaliser) == (0.5, "weights")
    assert cfg.loss_weighting() == {"gamma": None, "weighting": "dpace", "dpace_alpha": 0.5, "normaliser": "weights"}
    assert load_config(["recipe=tiny"]).loss_weighting() == cfg.loss_weighting()  # D-PACE is the default
    decay = load_config(["recipe=tiny", "train.loss_weighting=decay"])
    assert (decay.train.loss_weighting, decay.train.dpace_alpha, decay.train.dpace_normaliser) == ("decay", None, None)
    assert decay.loss_weighting() == {"gamma": 4.0, "weighting": "decay", "normaliser": "weights"}


def test_block_loss_refuses_an_unknown_weighting_or_normaliser():
    from train.blocks import draw_blocks
    from train.objective import block_loss

    ids = torch.arange(12)[None]
    blocks = draw_blocks(ids, torch.ones_like(ids), None, None, 2, 4, 0, torch.Generator().manual_seed(0))
    for kw in ({"weighting": "dpac"}, {"weighting": "dpace", "normaliser": "batch"}):
        with pytest.raises(ValueError, match="use decay or dpace, and one of \\('weights', 'tokens', 'rows'\\)"):
            block_loss(torch.randn(1, 8, 4), blocks, torch.randn(16, 4), 4.0, **kw)


def test_resume_refuses_a_change_of_the_loss_weighting_and_reads_an_older_checkpoint_as_decay():
    """The three keys are objective keys: a change is refused like train.gamma's. A checkpoint saved before they
    existed trained with decay: it resumes as decay, and is refused under D-PACE, whatever the default becomes."""
    from train.checkpoint import config_changes
    from train.config import RunConfig, load_config

    def cfg(*over):
        return load_config(["recipe=tiny", *over]).to_dict()

    dpace, decay = ["train.loss_weighting=dpace"], ["train.loss_weighting=decay"]
    defaults = RunConfig().to_dict()
    assert defaults["train"]["loss_weighting"] == "dpace"  # the default since the reference-budget ablation
    assert config_changes(cfg(*dpace), cfg(*dpace, "train.dpace_alpha=0.5"), defaults) == ([], [])  # resolved
    for change, said in [(["train.dpace_alpha=0.3"], "train.dpace_alpha: 0.5 -> 0.3"),
                         (["train.dpace_normaliser=tokens"], "train.dpace_normaliser: 'weights' -> 'tokens'")]:
        assert config_changes(cfg(*dpace), cfg(*dpace, *change), defaults)[0] == [said]
    assert config_changes(cfg(*decay), cfg(*dpace), defaults)[0] == [
        "train.dpace_alpha: None -> 0.5", "train.dpace_normaliser: None -> 'weights'",
        "train.loss_weighting: 'decay' -> 'dpace'"]
    older = cfg(*decay)
    for key in ("loss_weighting", "dpace_alpha", "dpace_normaliser"):
        del older["train"][key]
    # saved before the keys existed: it trained with decay, though the default is now D-PACE
    assert config_changes(older, cfg(*decay), defaults) == ([], [])
    assert "train.loss_weighting: 'decay' -> 'dpace'" in config_changes(older, cfg(), defaults)[0]
    assert "train.loss_weighting: 'decay' -> 'dpace'" in config_changes(older, cfg(*dpace), defaults)[0]


@pytest.mark.parametrize("overrides, message", [
    (["train.selector_loss_alpha=0.5"], "train.selector_loss_alpha=0.5 weighs DFlash2's selector loss and this run "
                                        "trains a dflash drafter, which has no selector: add drafter.variant=dflash2"),
    (["drafter.variant=dflash2", "train.selector_loss_alpha=-1"],
     "train.selector_loss_alpha=-1.0 must be a number >= 0"),
    (["drafter.variant=dflash2", "train.selector_loss_alpha=.nan"], "train.selector_loss_alpha=nan must be a number"),
])
def test_bad_selector_loss_alpha_fails_at_config_time(overrides, message):
    """DFlash2's selector weight: refused for a v1 run (it would be ignored), negative or not finite; unset it is
    resolved to 1.0 in the config (what checkpoints and the provenance record), and a resume refuses a change."""
    from train.checkpoint import config_changes
    from train.config import RunConfig, load_config

    with pytest.raises(ValueError, match=message):
        load_config(["recipe=tiny", *overrides])
    v2 = load_config(["recipe=tiny", "drafter.variant=dflash2"])
    assert v2.train.selector_loss_alpha == 1.0 and load_config(["recipe=tiny"]).train.selector_loss_alpha is None
    other = load_config(["recipe=tiny", "drafter.variant=dflash2", "train.selector_loss_alpha=0.1"])
    assert config_changes(v2.to_dict(), other.to_dict(), RunConfig().to_dict())[0] == [
        "train.selector_loss_alpha: 1.0 -> 0.1"]


def test_online_kl_top_k_larger_than_the_vocabulary():
    """train.kl_topk=100000 with a 288-token target ended in torch.topk's "selected index k out of range"."""
    from types import SimpleNamespace

    from train.config import load_config
    from train.setup import make_features

    cfg = load_config(["recipe=tiny", "train.loss=kl", "train.kl_topk=100000"])
    with pytest.raises(ValueError, match="train.kl_topk=100000 is more than the target's 288 tokens"):
        make_features(cfg, SimpleNamespace(vocab_size=288), [1, 2, 3], [], [], "cpu")


@pytest.mark.parametrize("missing", ["topk_ids", "topk_logprobs"])
def test_kl_loss_with_half_of_the_teacher_is_refused(missing):
    """A KL loss given the teacher's top-k ids without their log-probs (or the reverse) is refused by
    name, not left to fail on None inside the loss."""
    import torch

    from train.blocks import draw_blocks
    from train.objective import block_loss

    ids = torch.arange(8)[None]
    blocks = draw_blocks(ids, torch.ones_like(ids), None, None, 4, 4, 0, torch.Generator().manual_seed(0))
    teacher = {"topk_ids": torch.zeros(1, 8, 2, dtype=torch.long), "topk_logprobs": torch.zeros(1, 8, 2)}
    teacher[missing] = None
    with pytest.raises(ValueError, match="train.loss=kl needs the target's top-k log-probs"):
        block_loss(torch.randn(1, blocks.num_blocks * 4, 8), blocks, torch.randn(16, 8), 4.0, mode="kl", **teacher)


@pytest.mark.parametrize("count", [1, 3])
def test_anchor_draw_with_a_generator_count_other_than_the_rows(count):
    """One generator per row: a list of another length is refused (zip would drop the extra rows or
    generators silently)."""
    import torch

    from train.blocks import sample_anchors

    gens = [torch.Generator().manual_seed(i) for i in range(count)]
    with pytest.raises(ValueError, match=f"{count} generators for 2 rows: pass one per row"):
        sample_anchors(torch.ones(2, 6, dtype=torch.bool), 3, gens)


@pytest.mark.parametrize("override, message", [
    ("train.batch_size=2.5", "train.batch_size=2.5: expected an integer"),  # never truncated to 2
    ("train.anchors=true", "train.anchors=True: expected an integer"),
    ("train.lr=fast", "train.lr='fast': expected a number"),
    ("data.pack=maybe", "data.pack='maybe': expected true or false"),
    ("drafter.target_layer_ids=abc", "drafter.target_layer_ids='abc': expected a list or null"),
    ("train=3", "train is a section: give keys under it"),
    ("train.lr=true", "train.lr=True: expected a number"),  # a boolean is no learning rate (True == 1.0)
    ("train.lr=3e-4:", "train.lr='3e-4:': expected a number"),  # as typed, not YAML's mapping {'3e-4': None}
    ("train.betas=0.9", "train.betas=0.9: expected a list"),
])
def test_values_of_the_wrong_type_are_refused(override, message):
    from train.config import load_config
    from train.overrides import ConfigValueError

    with pytest.raises(ConfigValueError, match=re.escape(message)):
        load_config(["recipe=tiny", override])
    assert load_config(["recipe=tiny", "train.batch_size=2.0"]).train.batch_size == 2  # a whole number is fine


def test_a_section_given_a_plain_value_is_refused_even_with_keys_under_it(tmp_path):
    """A recipe's ``train: 3`` beside ``train.lr=...`` was silently replaced by the override's section."""
    from train.config import load_config
    from train.overrides import ConfigValueError

    recipe = tmp_path / "r.yaml"
    recipe.write_text("train: 3\n")
    message = "train is a section, but it was given the value 3: give keys under it (e.g. train.lr=...)"
    with pytest.raises(ConfigValueError, match=re.escape(message)):
        load_config([f"recipe={recipe}", "train.lr=1e-4"])
    with pytest.raises(ConfigValueError, match=re.escape(message)):
        load_config(["recipe=tiny"], overrides={"train": 3, "train.lr": 1e-4})
    assert load_config(["recipe=tiny", "train.lr=1e-4"]).train.lr == 1e-4  # a real section still takes keys


def test_string_keys_keep_the_text_as_typed_and_bad_yaml_is_named(tmp_path):
    """YAML 1.1 read out_dir=0123 as 83 and out_dir=12:30 as 750; out_dir=.../{name} was a KeyError traceback;
    an unclosed list or a broken recipe file a yaml traceback; a second recipe= silently won."""
    from train.config import load_config
    from train.overrides import ConfigValueError

    cfg = load_config(["recipe=tiny", "out_dir=0123", "data.subset=off", "target.revision=12:30"])
    assert (cfg.out_dir, cfg.data.subset, cfg.target.revision) == ("0123", "off", "12:30")
    assert load_config(["recipe=tiny", "data.subset=null"]).data.subset is None
    assert load_config(["recipe=tiny", "out_dir=/r/{recipe}-{name}"]).resolved_out_dir() == Path("/r/tiny-{name}")
    with pytest.raises(ConfigValueError, match=re.escape("drafter.target_layer_ids='[1,2' is not a value (expected ',' "
                                                         "or ']', but got '<stream end>')")):
        load_config(["recipe=tiny", "drafter.target_layer_ids=[1,2"])
    broken = tmp_path / "mine.yaml"
    broken.write_text("train:\n  lr: [3e-4\n  epochs: 2\n")
    with pytest.raises(ValueError, match=r"recipe .*mine.yaml is not valid YAML at line \d"):
        load_config([f"recipe={broken}"])
    with pytest.raises(ValueError, match=r"recipe given twice \(recipe=tiny and recipe=small\): keep one"):
        load_config(["recipe=tiny", "recipe=small"])


def test_command_line_spellings_a_recipe_file_reads_alike(tmp_path):
    """6e3 (a string to YAML 1.1) is a number for an integer key too; an empty value unsets a key; --resume is
    resume=true; `mixed_precision: no` in a .yml recipe (YAML's False) means "no"; a word without `=` and a
    missing .yml recipe are named, not ignored or looked up among the shipped recipes."""
    from train.config import load_config

    cfg = load_config(["recipe=tiny", "train.max_steps=6e3", "data.subset=", "--resume"])
    assert (cfg.train.max_steps, cfg.data.subset, cfg.resume) == (6000, None, True)
    mine = tmp_path / "mine.yml"
    mine.write_text("train:\n  mixed_precision: no\n  grad_checkpointing: yes\n")
    cfg = load_config([f"recipe={mine}"])
    assert (cfg.train.mixed_precision, cfg.train.grad_checkpointing) == ("no", True)
    with pytest.raises(ValueError, match="argument 'lr' is not key=value"):
        load_config(["recipe=tiny", "lr"])
    with pytest.raises(FileNotFoundError, match="recipe file .*gone.yml not found"):
        load_config([f"recipe={tmp_path / 'gone.yml'}"])


def test_a_mapping_under_a_recipe_key_is_named_as_the_wrong_type(tmp_path):
    """`lr:` followed by an indented mapping is a value of the wrong type for train.lr, not a key train.lr.value."""
    from train.config import load_config
    from train.overrides import ConfigValueError

    mine = tmp_path / "mine.yaml"
    mine.write_text("train:\n  lr:\n    value: 3.0e-4\n")
    with pytest.raises(ConfigValueError, match=re.escape("train.lr={'value': 0.0003}: expected a number")):
        load_config([f"recipe={mine}"])


def test_flag_spellings_and_a_recipe_name_with_a_typo():
    """--dry_run, --dry-run=true and --key=value read as key=value; a value may hold '='; the same recipe named
    twice is one recipe; a misspelled recipe name suggests the shipped one."""
    from train.config import load_config
    from train.overrides import parse_args

    assert parse_args(["--dry_run", "--dry-run=true", "--train.lr=1e-3", "data.subset=a=b", "recipe=tiny",
                       "recipe=tiny"]) == ("tiny", [("dry_run", "true"), ("dry_run", "true"), ("train.lr", "1e-3"),
                                                    ("data.subset", "a=b")])
    with pytest.raises(FileNotFoundError, match="unknown recipe 'tinny' .*; did you mean 'tiny'"):
        load_config(["recipe=tinny"])
    cfg = load_config(["recipe=tiny", "target.revision=~", "data.subset=None"])  # YAML's and Python's null
    assert (cfg.target.revision, cfg.data.subset) == (None, None)


def test_values_given_as_text_or_a_tuple_read_like_the_command_line():
    """load_config's overrides (and values quoted in a recipe) arrive as Python text, not YAML: "Yes" and "no" are
    booleans, " [0.8, 0.9]" a list; a tuple is a list; a list is no string."""
    from train.config import load_config
    from train.overrides import ConfigValueError

    cfg = load_config(["recipe=tiny"], overrides={"train.grad_checkpointing": "Yes", "eval.at_start": "no",
                                                  "train.betas": " [0.8, 0.9]", "drafter.target_layer_ids": (1, 2, 3)})
    assert (cfg.train.grad_checkpointing, cfg.eval.at_start, cfg.train.betas) == (True, False, [0.8, 0.9])
    assert cfg.drafter.target_layer_ids == [1, 2, 3]
    with pytest.raises(ConfigValueError, match=re.escape("out_dir=['runs', 'x']: expected a string")):
        load_config(["recipe=tiny"], overrides={"out_dir": ["runs", "x"]})  # never the text "['runs', 'x']"


def test_an_empty_value_of_a_key_that_needs_one_is_named_not_read_as_none(tmp_path):
    """out_dir=$UNSET trained into a folder named "None" (and target.path= loaded a Hub id "None"): an empty
    value of a key that cannot be unset is refused, on the command line and in a recipe; optional ones unset."""
    from train.config import load_config
    from train.overrides import ConfigValueError

    for override in ("out_dir=", "target.path=", "data.source="):
        with pytest.raises(ConfigValueError, match=f"{override[:-1]} is empty .*give a string"):
            load_config(["recipe=tiny", override])
    mine = tmp_path / "mine.yaml"
    mine.write_text("out_dir:\ntarget:\n  path: tiny:qwen3\n")
    with pytest.raises(ConfigValueError, match="out_dir is empty"):
        load_config([f"recipe={mine}"])
    assert load_config(["recipe=tiny", "data.prepared="]).data.prepared is None


@pytest.mark.parametrize("value, message", [
    ("gptq", "not a quantization draftsmith knows: use none | mlx:PATH_OR_ID"),
    ("mlx-7bit", "7 bits is not an MLX affine width"),
    ("mlx-4bit-g48", "group size 48 is not supported; use one of \\[32, 64, 128\\]"),
    ("mlx-4bit-g256", "group size 256 is not supported"),  # a multiple of 32, still not an MLX group size
    ("bnb-8bit", "not a quantization draftsmith knows"),  # only bnb-4bit is wired up: never read as it
    ("mlx:", "needs a folder or Hub id after 'mlx:'"),  # once read as the YAML mapping {'mlx': None}
])
def test_bad_quantization_value_fails_at_config_time(value, message):
    from models.quantization import QuantizationError
    from train.config import load_config

    with pytest.raises(QuantizationError, match=message):
        load_config(["recipe=tiny", f"target.quantization={value}"])


@pytest.mark.parametrize("value", ["bnb-4bit", "fp8"])
def test_loader_quantization_with_offline_features_is_refused(value):
    """The store's features come from the unquantized weights data.extract runs: training would take
    them for the quantized target's (the fingerprint reads the same files)."""
    from train.config import load_config

    with pytest.raises(ValueError, match=f"target.quantization={value} with features.mode=offline: .*unquantized "
                                         "weights.*features.mode=online, or an MLX-quantized target"):
        load_config(["recipe=tiny", f"target.quantization={value}", "features.mode=offline", "features.store=/f"])
    load_config(["recipe=tiny", "target.quantization=mlx:/q4", "features.mode=offline", "features.store=/f"])


def test_dry_run_of_the_tiny_recipe_plans_the_target_it_builds(monkeypatch):
    """recipe=tiny --dry-run once said "cannot plan" (the tiny target's shape is fixed in code); a target whose
    shape is unknown names every missing key."""
    from train import plan as plan_module
    from train.config import load_config

    out = plan_module.plan(load_config(["recipe=tiny"]))
    assert "error" not in out and out["target_layer_ids"] == [1, 2, 3]  # what training taps (6 layers, 3 taps)
    monkeypatch.setattr(plan_module, "_fetch_config", lambda cfg: (None, "offline (test)"))
    out = plan_module.plan(load_config(["recipe=tiny", "target.path=org/unknown"]))
    assert out["error"] == ("cannot plan: the target's num_hidden_layers, hidden_size, vocab_size unknown (set "
                            "target.num_layers=N target.hidden_size=N target.vocab_size=N)")


def test_dry_run_of_a_local_target_path_that_is_missing_says_so_not_the_hub(monkeypatch, tmp_path):
    """target.path=./typo was looked up on the Hub: the plan blamed the network (or said "Repo id must be in the
    form ..."), not the missing folder."""
    import huggingface_hub

    from train import plan as plan_module
    from train.config import load_config

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("looked up on the Hub"))
    config, source = plan_module._fetch_config(load_config(["recipe=qwen3-8b", f"target.path={tmp_path / 'typo'}"]))
    assert config is None and source == f"the local folder {tmp_path / 'typo'} does not exist; using the recipe's " \
                                        "shape facts"
    config, source = plan_module._fetch_config(load_config(["recipe=qwen3-8b", f"target.path={tmp_path}"]))
    assert config is None and source.endswith(f"{tmp_path} has no config.json; using the recipe's shape facts")


def test_dry_run_without_network_reads_the_cache_instead_of_retrying(monkeypatch, tmp_path):
    """With no network the dry run sat through ~25 s of the Hub client's connection retries before
    using the recipe's facts: a host name that does not resolve now means the local cache only."""
    import socket

    import huggingface_hub

    from train import plan as plan_module
    from train.config import load_config

    def no_name(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    def cache_only(repo_id, filename, revision=None, local_files_only=False):
        assert local_files_only, "would have tried the network"
        if repo_id != "org/cached":
            raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache")
        (tmp_path / "config.json").write_text('{"num_hidden_layers": 7, "hidden_size": 64, "vocab_size": 320}')
        return str(tmp_path / "config.json")

    monkeypatch.setattr(socket, "getaddrinfo", no_name)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cache_only)
    config, source = plan_module._fetch_config(load_config(["recipe=qwen3-8b", "target.path=org/cached"]))
    assert config["num_hidden_layers"] == 7 and source == "Hub config.json of org/cached (config only, no weights)"
    config, source = plan_module._fetch_config(load_config(["recipe=qwen3-8b"]))
    assert config is None
    assert "the Hub's host name does not resolve (no network?) and it is not in the local cache" in source


def test_a_hub_endpoint_whose_host_is_not_a_valid_name_means_no_network(monkeypatch):
    """An endpoint host with a label over 63 characters makes getaddrinfo raise UnicodeError (the IDNA codec), not
    gaierror: the dry run reads the cache alone, as with no network, instead of ending in that error."""
    from huggingface_hub import constants

    from train import plan as plan_module

    monkeypatch.setattr(constants, "ENDPOINT", "https://" + "a" * 64 + ".example")
    assert plan_module._hub_resolves() is False


def test_dry_run_steps_count_every_process_of_the_node(tmp_path):
    """With devices=8x80 the plan said as many steps as one process takes: 8 processes each train their own rows
    of a step, so an epoch is an eighth of those steps (held-out rows capped at a fifth, as training does)."""
    import json

    from train.config import load_config
    from train.plan import plan

    (tmp_path / "stats.json").write_text(json.dumps({"rows": 1000, "tokens": 10 ** 6}))
    args = ["recipe=tiny", f"data.prepared={tmp_path}", "train.batch_size=4", "train.epochs=2"]
    schedule = lambda *more: plan(load_config([*args, *more]))["schedule"]
    assert (schedule("devices=1x80")["steps"], schedule("devices=8x80")["steps"]) == (2 * 242, 2 * 30)  # 968 rows
    assert plan(load_config([*args, "devices=8x80", "target.device_map=auto"]))["schedule"]["processes"] == 1


def test_dry_run_names_the_learning_rate_schedule_the_run_takes(capsys):
    """train.schedule=constant was printed as "cosine" by the plan."""
    from train.config import load_config
    from train.plan import print_plan

    print_plan(load_config(["recipe=tiny", "train.schedule=constant", "devices=1x80"]))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("schedule:"))
    assert "lr 0.003 constant, warmup" in line and "cosine" not in line


@pytest.mark.parametrize("spec", ["eight", "8", "0x80", "8x", "8x0", "8x-80"])
def test_dry_run_devices_that_are_not_count_x_gib(spec):
    from train.plan import parse_devices

    with pytest.raises(ValueError, match=r"devices=.*: write COUNTxGiB, e.g. devices=8x80"):
        parse_devices(spec)


def test_fewer_training_rows_than_one_micro_batch_per_process_are_refused():
    from train.config import load_config
    from train.plan import make_schedule

    cfg = load_config(["recipe=tiny", "train.batch_size=4"])
    with pytest.raises(ValueError, match=re.escape("7 training rows is less than one micro-batch per process "
                                                   "(4 x 2): lower train.batch_size or add data")):
        make_schedule(cfg, 7, 2, 0)


def test_a_run_without_a_target_path_says_what_to_give(tmp_path):
    """No recipe and no target.path: the target is named before anything tries to load ""."""
    from train.config import load_config
    from train.setup import load_target

    with pytest.raises(ValueError, match="target.path is empty: set it to a local folder, a Hub id, or tiny:<arch>"):
        load_target(load_config([]), tmp_path, None, log=lambda *_: None)


def test_a_training_target_without_tokenizer_files_is_named(tmp_path):
    """Training tokenizes the data with the target's chat template: a folder of weights alone is refused."""
    from models.tiny import save_tiny_target
    from train.config import load_config
    from train.setup import load_target

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink()

    class OneProcess:
        is_main_process, device, distributed_type = True, torch.device("cpu"), "NO"

        def wait_for_everyone(self):
            pass

    cfg = load_config(["recipe=tiny", f"target.path={folder}", "eval.true_tau_prompts=0"])
    said = f"target {folder} has no tokenizer files: training needs its tokenizer"
    with pytest.raises(ValueError, match=re.escape(said)):
        load_target(cfg, tmp_path, OneProcess(), log=lambda *_: None)


def test_target_device_map_with_one_process_per_gpu(monkeypatch, tmp_path):
    """target.device_map spreads one target over a node: 8 processes on that node would each load all of it."""
    from train.config import load_config
    from train.setup import load_target

    class OneOfEight:
        is_main_process, device = True, "cpu"

        def wait_for_everyone(self):
            pass

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = load_config(["recipe=tiny", f"target.path={tmp_path}", "target.device_map=auto"])
    with pytest.raises(ValueError, match="launch one process per node"):
        load_target(cfg, tmp_path, OneOfEight(), log=lambda *_: None)


def test_train_bench_e2e_tiny_runs_the_tiny_recipe(capsys):
    bench("train")(["--e2e", "tiny", "--steps", "1", "--warmup", "0", "--seq", "64", "--anchors", "4"])
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["bench"] == "train_e2e" and row["recipe"] == "tiny"
    assert (row["hidden"], row["layers"], row["block"]) == (64, 2, 8)  # the tiny target's width, tiny.yaml's drafter


def test_train_bench_e2e_with_drafter_shape_flags_says_they_are_the_targets(capsys, no_build):
    """--e2e tiny --heads 8 --intermediate 512 timed the target's shape and reported hidden, heads... as if asked."""
    said = argparse_error(capsys, "train", ["--e2e", "tiny", "--heads", "8", "--interm", "512"])
    assert "--heads, --intermediate with --e2e: the drafter takes the target's shape" in said


@pytest.mark.parametrize("over, said", [
    (["eval.every=4", "eval.true_tau_every=6"], "true tau every 12 steps; make eval.true_tau_every a multiple"),
    (["eval.every=0", "eval.true_tau_every=6"], "eval.every=0: true tau only at the end"),
    (["eval.every=4", "eval.true_tau_every=8", "eval.true_tau_prompts=0"], "does nothing with eval.true_tau_prompts=0"),
    (["eval.every=4", "eval.true_tau_every=8"], None),  # on the cadence: nothing to say
    (["eval.every=4"], None),
])
def test_a_true_tau_cadence_the_run_will_not_keep_is_said_at_start(over, said):
    """eval.true_tau_every runs inside an eval: off the eval cadence, without evals or without prompts it ran
    less often or never, without a word."""
    from train.config import load_config
    from train.loop import eval_due, true_tau_cadence_note

    cfg = load_config(["recipe=tiny", *over])
    note = true_tau_cadence_note(cfg)
    assert (note is None) if said is None else (said in note)
    if said is None and cfg.eval.true_tau_every:  # and what the note leaves unsaid is what the loop does
        assert [eval_due(cfg, s, False)[1] for s in (4, 8, 16)] == [False, True, True]


def test_fewer_true_tau_prompts_than_asked_are_said():
    """eval.true_tau_prompts=16 with 3 usable held-out rows measured true tau on 3 without a word."""
    from train.eval import true_tau_prompt_set

    rows = [{"input_ids": [5, 6, 7], "doc_ids": [0, 0, 0], "loss_mask": m} for m in ([0, 1, 1], [0, 0, 0], [0, 0, 1])]
    said = []
    assert true_tau_prompt_set(rows, 16, said.append) == [[5], [5, 6]]
    assert said == ["note: eval.true_tau_prompts=16, but the 3 held-out rows give 2 prompts: true tau is measured "
                    "on 2; raise data.eval_rows for more"]
    said.clear()
    assert true_tau_prompt_set(rows, 2, said.append) == [[5], [5, 6]] and said == []
    assert true_tau_prompt_set(rows, 0, said.append) == [] and said == []


def test_fp16_mixed_precision_on_a_cpu_is_refused_before_anything_loads(no_cuda, tmp_path):
    """accelerate ignores fp16 on a CPU (float32 autocast-free steps) while the run recorded fp16."""
    from train.distill import main

    with pytest.raises(ValueError, match="train.mixed_precision=fp16 has no effect on the CPU.*auto"):
        main(["recipe=tiny", "train.mixed_precision=fp16", f"out_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("resume", ["false", "true"])
def test_a_training_run_into_an_out_dir_another_run_holds_is_refused(tmp_path, monkeypatch, resume):
    """The same command in two terminals (or a requeued job while the first still ran, resume=true) trained into
    one out_dir: both wrote metrics.jsonl, the same step_N checkpoints and final/. The second is refused before
    anything loads, naming the holder's pid; a run that ended (here: by an error) leaves the folder free."""
    import os

    import train.setup
    from models.support import hold
    from train.distill import LOCK, main

    def no_target(*a, **k):
        raise FileNotFoundError("no-target")

    monkeypatch.setattr(train.setup, "load_target", no_target)
    out = tmp_path / "run"
    args = ["recipe=tiny", f"out_dir={out}", f"resume={resume}"]
    with hold(out, LOCK, "out_dir", "-"):
        with pytest.raises(ValueError, match=f"out_dir {out} is in use by another run \\(pid {os.getpid()}\\): wait"):
            main(args)
        assert sorted(p.name for p in out.iterdir()) == [LOCK]  # no config.yaml, no data: nothing written
    with pytest.raises((FileNotFoundError, ValueError), match="no-target"):  # fails after taking out_dir
        main(args)
    with hold(out, LOCK, "out_dir", "-"):  # and gave it back
        pass


def test_a_flex_backward_typo_fails_when_the_config_loads():
    """It was read only by the first CUDA step of the drafter, after the target and data had loaded."""
    from train.config import load_config

    with pytest.raises(ValueError, match=r"flex backward setting 'fastest'"):
        load_config(["recipe=tiny", "train.flex_backward=fastest"])
    assert load_config(["recipe=tiny", "train.flex_backward=32,64,64,32,2,4"]).train.flex_backward == "32,64,64,32,2,4"


def test_train_bench_refuses_bad_flex_tiles_before_building(capsys, no_build):
    said = "flex backward setting '1,2': use auto, torch, or six whole numbers"
    assert said in argparse_error(capsys, "train", ["--e2e", "qwen35-9b", "--flex-backward", "1,2"])


def test_train_bench_has_no_flex_sweep(capsys, no_build):
    """The tile sweep is a lab experiment (python -m lab.flex_sweep); the bench keeps --flex-backward."""
    assert "unrecognized arguments: --flex-sweep" in argparse_error(capsys, "train", ["--e2e", "qwen35-9b",
                                                                                     "--flex-sweep"])


# ----------------------------------------------------------------------------- issue 44 (training side)
def _nothing_loads(monkeypatch):
    """Building, fitting or loading a target (or preparing data) fails the test: the refusal must come first."""
    import train.distill
    import train.setup

    def refuse(*a, **k):
        raise AssertionError("a target was built or loaded before the refusal")

    for name in ("load_target", "build_tiny_target", "ensure_prepared"):
        monkeypatch.setattr(train.setup, name, refuse)
    monkeypatch.setattr(train.distill, "run_stages", refuse)


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("where, said", [
    ("the target", "is the target's folder \\(target.path\\)"),
    ("inside the target", "is inside the target's folder \\(target.path\\)"),
    ("another model", "is a model folder \\(config.json beside weights\\)"),
    ("inside a drafter", "is inside a DFlash drafter folder"),
    ("prepared data", "is a prepared data folder"),
])
def test_an_out_dir_in_a_model_folder_is_refused_before_anything_is_written(data_target, export_drafter, tmp_path,
                                                                             monkeypatch, where, said):
    """out_dir equal to (or inside) the target's folder or another model folder once got checkpoints, final/,
    metrics.jsonl and a lock file written among the model's files."""
    import shutil

    from train.distill import main

    _nothing_loads(monkeypatch)
    target = tmp_path / "target"
    shutil.copytree(data_target, target)
    other = tmp_path / "other-model"
    shutil.copytree(data_target, other)
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "draftsmith_data.json").write_text("{}")
    out = {"the target": target, "inside the target": target / "run", "another model": other,
           "inside a drafter": export_drafter / "run", "prepared data": prepared}[where]
    before = _listing(tmp_path)
    with pytest.raises(ValueError, match=f"out_dir={re.escape(str(out))} {said}.* the run's checkpoints, final/, "
                                         "metrics and lock file would be written among its files; give the run a "
                                         "folder of its own, e.g. out_dir=runs/tiny"):
        main(["recipe=tiny", f"target.path={target}", f"out_dir={out}", "data.source=tiny"])
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("override, said", [
    ("data.source=./nope.jsonl", "data source './nope.jsonl' is neither a local file/folder nor a Hub id"),
    ("data.source=chats.csv", "unsupported file type '.csv'"),
    ("target.path=./no-target", "target.path './no-target' is neither a local folder nor a Hub id"),
    ("target.quantization=mlx:./no-mlx", "target.quantization=mlx:./no-mlx: no such folder"),
    ("drafter.init_from=./no-drafter", "drafter.init_from './no-drafter' is neither a local folder nor a Hub id"),
    ("features.store=./no-store", "no-store"),
])
def test_every_path_a_run_reads_is_checked_before_the_target_is_built(tmp_path, monkeypatch, override, said):
    """`recipe=tiny data.source=./nope.jsonl` fitted the tiny target for minutes before saying the source does not
    exist; each path the run reads is now checked before anything is built, loaded or written."""
    from train.distill import main

    _nothing_loads(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chats.csv").write_text("a,b\n")
    extra = ["features.mode=offline"] if override.startswith("features.") else []
    with pytest.raises((ValueError, OSError), match=re.escape(said) if "(" not in said else said):
        main(["recipe=tiny", "out_dir=run", override, *extra])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.csv"]


def test_prepared_data_that_is_missing_with_no_source_is_named_before_anything_loads(tmp_path, monkeypatch):
    from train.config import load_config
    from train.distill import train

    _nothing_loads(monkeypatch)
    cfg = load_config(["recipe=tiny", f"out_dir={tmp_path / 'run'}", f"data.prepared={tmp_path / 'nothing-here'}"],
                      overrides={"data.source": ""})
    with pytest.raises(ValueError, match="data.source is empty and no prepared data set exists at .*nothing-here"):
        train(cfg)
    assert list(tmp_path.iterdir()) == []


def test_every_bad_drafter_shape_key_is_named_at_once_before_anything_loads(tmp_path, monkeypatch):
    """drafter.block_size=1 first asked for train.gamma, then loaded the target, and only then said a block needs
    two slots; the shape keys are now checked together, and against the target's config before it loads."""
    from train.config import load_config
    from train.distill import main

    with pytest.raises(ValueError) as e:
        load_config(["recipe=tiny", "drafter.block_size=1"])
    assert str(e.value).startswith("drafter.block_size=1 must be >= 2") and "train.gamma" not in str(e.value)
    with pytest.raises(ValueError) as e:
        load_config(["recipe=tiny", "drafter.block_size=1", "train.gamma=4", "drafter.head_dim=3",
                     "drafter.num_attention_heads=6", "drafter.num_key_value_heads=4",
                     "drafter.target_layer_ids=[1,1]"])
    assert str(e.value) == (
        "drafter.block_size=1 must be >= 2 (a block holds the bonus token and at least one mask; default 16); "
        "drafter.head_dim=3 must be even (RoPE rotates pairs of dimensions); drafter.num_key_value_heads=4 must "
        "divide drafter.num_attention_heads=6 (grouped-query attention); drafter.target_layer_ids=[1, 1] taps a "
        "layer twice")
    _nothing_loads(monkeypatch)
    for override, said in (("drafter.target_layer_ids=[1,99]", "layer id 99 is outside"),
                           ("drafter.num_taps=40", "too few target layers for 40 distinct taps"),
                           ("drafter.mask_token_id=100000", "outside the target embedding")):
        with pytest.raises(ValueError, match=f"the drafter.\\* settings do not fit the target tiny:qwen3: .*{said}"):
            main(["recipe=tiny", f"out_dir={tmp_path / 'run'}", override])
    assert list(tmp_path.iterdir()) == []


def test_a_run_config_that_is_not_yaml_is_one_line_naming_an_intact_copy(tmp_path):
    """A run's config.yaml (given back as the recipe, or a checkpoint's, read by resume=true) that does not parse was
    an 8-line parser dump, or a traceback; it is one line naming a copy of the same settings to restore it from."""
    from models.support import run_cli
    from train.checkpoint import resume_checkpoint
    from train.config import load_config
    from train.distill import main

    run = tmp_path / "run"
    settings = load_config(["recipe=tiny", f"out_dir={run}"]).to_yaml()
    for step in (1, 2):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "config.yaml").write_text(settings)
        (run / "checkpoints" / f"step_{step}" / "trainer_state.json").write_text(f'{{"step": {step}}}')
    broken = settings.replace("train:\n", "train:\n  lr: [3e-4\n", 1)
    (run / "config.yaml").write_text(broken)
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main([f"recipe={run / 'config.yaml'}", "resume=true"]))
    line = str(e.value.code).splitlines()[0]
    assert re.fullmatch(f"error: recipe {re.escape(str(run / 'config.yaml'))} is not valid YAML at line \\d+: .*; "
                        f"restore it from {re.escape(str(run / 'checkpoints' / 'step_2' / 'config.yaml'))}", line), line
    (run / "config.yaml").write_text(settings)
    (run / "checkpoints" / "step_2" / "config.yaml").write_text(broken)
    cfg = load_config(["recipe=tiny", f"out_dir={run}", "resume=true"])
    with pytest.raises(ValueError, match=f"step_2/config.yaml is not valid YAML at line \\d+: .*; restore it from "
                                         f"{re.escape(str(run / 'checkpoints' / 'step_1' / 'config.yaml'))}$"):
        resume_checkpoint(cfg, run, lambda *_: None)


FULL_DISK = {  # what each writer raises when the disk fills up under it
    "safetensors": lambda: __import__("safetensors").SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'),
    "torch.save": lambda: RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing "
                                       "file data/0: file write failed"),
}


@pytest.mark.parametrize("writer", sorted(FULL_DISK))
def test_a_full_disk_under_any_writer_is_one_line_and_leaves_no_half_written_folder(tmp_path_factory, tmp_path,
                                                                                    monkeypatch, writer):
    """The save handlers caught OSError only: safetensors' SafetensorError and torch.save's RuntimeError on a full disk
    ended in a traceback and left step_N.tmp / final.tmp half-written. Each is one line naming the folder, the space
    left and resume=true; a RuntimeError that is no failed write (a CUDA error) keeps its traceback."""
    import train.checkpoint
    from tests.helpers.tiny_run import FAST, run, tiny_input_dirs
    from train.checkpoint import CheckpointError

    d = tiny_input_dirs(tmp_path_factory)
    args = [f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "checkpoint.every=1",
            "train.max_steps=2", "train.batch_size=4", "train.anchors=8", "eval.batches=1"]
    real = train.checkpoint.save_drafter

    def fills_the_disk(where, error=FULL_DISK[writer]):
        def save(accelerator, model, directory, dtype=None):
            if directory.parent.name != where:
                return real(accelerator, model, directory, dtype)
            directory.mkdir(parents=True)
            (directory / "model.safetensors").write_bytes(b"half")  # what the writer got out before the disk filled
            raise error()
        return save

    monkeypatch.setattr(train.checkpoint, "save_drafter", fills_the_disk("step_2.tmp"))
    said = {"safetensors": "No space left on device", "torch.save": "PytorchStreamWriter failed writing file data/0: "
                                                                      "file write failed"}[writer]
    with pytest.raises(CheckpointError, match=r"could not write the checkpoint of step 2 under .*checkpoints "
                                              rf"\({said}; [\d.]+ [GM]iB free there\), the half-written "
                                              r"step_2.tmp removed: the newest complete one, .*step_1, is intact: free "
                                              r"space \(or fix the folder\) and rerun with resume=true$"):
        run(tmp_path, *args)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    monkeypatch.setattr(train.checkpoint, "save_drafter", fills_the_disk("final.tmp"))
    with pytest.raises(CheckpointError, match=rf"could not write the final drafter to .*final \({said}; "
                                              r"[\d.]+ [GM]iB free there\), the half-written final.tmp removed: .*free "
                                              r"space and rerun with resume=true"):
        run(tmp_path, *args, "resume=true")
    assert not (tmp_path / "final.tmp").exists() and not (tmp_path / "final").exists()
    monkeypatch.setattr(train.checkpoint, "save_drafter", fills_the_disk(
        "final.tmp", lambda: RuntimeError("CUDA error: an illegal memory access was encountered")))
    with pytest.raises(RuntimeError, match="illegal memory access") as e:
        run(tmp_path, *args, "resume=true")
    assert not isinstance(e.value, CheckpointError)


@pytest.mark.parametrize("damage", ["zeroed bytes", "NaN weights, no checksums"])
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_resumes(tmp_path_factory, tmp_path, capsys, damage):
    """Bytes zeroed inside state/model.safetensors resumed silently on wrong weights; NaN written there ended in
    "training diverged ... lower train.lr". Checkpoints carry checksums: a damaged one is named, set aside, and the
    run resumes from the newest intact one with the losses of an intact copy; a checkpoint without checksums whose
    weights are not finite is named as damaged."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.helpers.tiny_run import FAST, losses, run, tiny_input_dirs
    from train.checkpoint import CheckpointError

    d = tiny_input_dirs(tmp_path_factory)
    args = [f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "checkpoint.every=1",
            "train.max_steps=2", "train.batch_size=4", "train.anchors=8", "eval.batches=1", "logging.every=1"]
    run(tmp_path, *args)
    intact = losses(tmp_path)
    step_2 = tmp_path / "checkpoints" / "step_2"
    listed = json.loads((step_2 / "checksums.json").read_text())["files"]
    assert {"state/model.safetensors", "drafter/model.safetensors", "trainer_state.json", "config.yaml"} <= set(listed)
    weights = step_2 / "state" / "model.safetensors"
    if damage == "zeroed bytes":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
        weights.write_bytes(bytes(data))
        capsys.readouterr()
        run(tmp_path, *args, "train.max_steps=3", "resume=true")
        out = capsys.readouterr().out
        assert (f"warning: the checkpoint {step_2} is damaged (state/model.safetensors differs from what was written "
                f"(sha256 ") in out
        assert f"set aside as step_2.damaged; resuming from the newest intact one, {step_2.parent / 'step_1'}" in out
        assert losses(tmp_path)[2] == pytest.approx(intact[2], abs=1e-6)  # trained again from step 1, as before
        assert (step_2.parent / "step_2.damaged").is_dir() and (step_2 / "checksums.json").is_file()
        return
    (step_2 / "checksums.json").unlink()  # as a checkpoint written before checksums existed
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, weights)
    shutil.rmtree(tmp_path / "final")
    with pytest.raises(CheckpointError, match=f"the checkpoint {re.escape(str(step_2))} holds NaN / inf weights, "
                                              r"which training never saves: its files were damaged after it was "
                                              r"written \(not a diverged run\). Delete \(or move away\) .*step_2 to "
                                              "resume from .*step_1$"):
        run(tmp_path, *args, "train.max_steps=3", "resume=true")


def test_every_checkpoint_damaged_is_one_error_naming_each(tmp_path):
    from train.checkpoint import CheckpointError, set_aside_damaged, write_manifest

    for step in (1, 2):
        folder = tmp_path / "checkpoints" / f"step_{step}"
        (folder / "state").mkdir(parents=True)
        (folder / "state" / "model.safetensors").write_bytes(b"weights")
        write_manifest(folder)
    (tmp_path / "checkpoints" / "step_1" / "state" / "model.safetensors").write_bytes(b"w")
    (tmp_path / "checkpoints" / "step_2" / "state" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"every checkpoint under .*checkpoints is damaged \(step_2: "
                                              "state/model.safetensors is missing; step_1: state/model.safetensors "
                                              r"holds 1 bytes, 7 were written\): restore them from a copy, or delete"):
        set_aside_damaged(tmp_path, lambda *_: None)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1", "step_2"]  # nothing renamed


def test_resume_on_a_finished_run_says_there_is_nothing_to_train_and_leaves_final_alone(tmp_path_factory, tmp_path,
                                                                                       monkeypatch, capsys):
    """resume=true on a finished run loaded the target and the data, trained nothing and wrote final/ again (new
    files, new times, and the export stage again); it now says so and touches nothing. A longer run still trains."""
    import train.setup
    from tests.helpers.tiny_run import FAST, run, tiny_input_dirs

    d = tiny_input_dirs(tmp_path_factory)
    args = [f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "train.max_steps=2",
            "train.batch_size=4", "train.anchors=8", "eval.batches=1"]
    run(tmp_path, *args)
    final = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "final").rglob("*") if p.is_file()}
    real = train.setup.load_target
    monkeypatch.setattr(train.setup, "load_target", lambda *a, **k: pytest.fail("loaded the target of a finished run"))
    capsys.readouterr()
    assert run(tmp_path, *args, "resume=true")["steps"] == 2
    assert (f"resume=true: the run in {tmp_path} is finished (final/ holds the drafter of step 2, its newest "
            "checkpoint's, and train.epochs / train.max_steps are the ones it trained with): nothing to train, final/ "
            "is left as it is. Raise train.epochs or train.max_steps to train on from it") in capsys.readouterr().out
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "final").rglob("*") if p.is_file()} == final
    monkeypatch.setattr(train.setup, "load_target", real)
    assert run(tmp_path, *args, "train.max_steps=3", "resume=true")["steps"] == 3


def test_sigterm_stops_like_ctrl_c_with_the_last_steps_state_on_disk(tmp_path_factory, tmp_path):
    """SIGTERM (what a job scheduler sends on preemption) exited 143 without a word, with the steps since the last
    checkpoint lost. The run now ends the step under way, checkpoints it, and prints the newest checkpoint and the
    command that resumes it, as Ctrl-C does; the exit status stays 143."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers.tiny_run import tiny_input_dirs

    d = tiny_input_dirs(tmp_path_factory)
    out = tmp_path / "run"
    command = [sys.executable, "-m", "train.distill", "recipe=tiny", f"out_dir={out}", f"target.path={d['target']}",
               f"data.prepared={d['data']}", "logging.progress=false", "eval.at_start=false", "eval.every=0",
               "eval.true_tau_prompts=0", "checkpoint.every=0", "train.max_steps=100000", "train.batch_size=4",
               "train.anchors=8", "logging.every=1"]
    proc = subprocess.Popen(command, cwd=Path(__file__).parents[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    newest = out / "checkpoints" / f"step_{step}"
    assert f"stopped by SIGTERM at step {step}: newest checkpoint: {newest}; resume from it with:\n" in output, output
    assert output.split("resume from it with:\n  ", 1)[1].splitlines()[0].endswith(" resume=true")
    assert json.loads((newest / "trainer_state.json").read_text())["step"] == step
    assert (newest / "checksums.json").is_file() and not list((out / "checkpoints").glob("*.tmp"))
    assert "Traceback" not in output


def _offline_plan(monkeypatch, *args) -> tuple[dict, str]:
    """The dry run of ``args`` with no network (the recipe's shape facts), and what it printed."""
    import contextlib
    import io

    from train import plan as plan_module
    from train.config import load_config

    monkeypatch.setattr(plan_module, "_hub_resolves", lambda: False)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        p = plan_module.print_plan(load_config(list(args)))
    return p, printed.getvalue()


def test_dry_run_before_the_data_is_prepared_prints_the_steps_train_max_steps_sets(monkeypatch):
    """`--dry-run` before the data was prepared printed "steps None" even with train.max_steps set."""
    p, out = _offline_plan(monkeypatch, "recipe=qwen35-9b", "train.max_steps=1000")
    assert p["schedule"]["steps"] == 1000 and p["schedule"]["steps_exact"]
    assert "  schedule: 1,000 steps, epochs unknown, at most 12.3M tokens (1 process(es) x 4 rows per step)" in out
    assert "steps None" not in out and "rows unknown (offline)" in out  # a Hub data set, no network


def test_dry_run_answers_the_planning_questions(monkeypatch, tmp_path):
    """Rows (a local JSONL counted; a Hub data set's metadata when reachable, else unknown offline), steps, epochs
    and tokens; the time per measured card with the measurement it comes from; the regeneration's tokens and the
    memory its server needs beside training; the disk offline features take."""
    import json

    import huggingface_hub
    from huggingface_hub import constants

    from train.estimates import MEASURED_STEPS

    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                         {"role": "assistant", "content": "a"}]})
                                for i in range(1000)) + "\n\n")
    base = ["recipe=qwen35-9b", f"out_dir={tmp_path / 'run'}", "devices=1x141"]
    p, out = _offline_plan(monkeypatch, *base, f"data.source={source}")
    assert (p["data"]["rows"], p["data"]["rows_exact"], p["data"]["tokens"]) == (1000, False, 1000 * 3072)
    # 1000 rows, 200 held out (a fifth), 4 rows a step: 200 steps an epoch, 6 epochs
    assert (p["schedule"]["steps"], p["schedule"]["epochs"], p["schedule"]["steps_exact"]) == (1200, 6, False)
    assert f"~1,000 rows (counted in {source}), at most 3.07M tokens" in out
    assert "schedule: ~1,200 steps, 6 epochs, at most 14.7M tokens" in out
    # The recipe's own shape on an H200, as measured (compiled): no scaling
    h200 = next(t for t in _offline_plan(monkeypatch, *base, f"data.source={source}", "train.compile=true")[0]["time"]
                if t["card"] == "H200")
    measured = next(m for m in MEASURED_STEPS if m[0] == "H200")
    assert h200["seconds_per_row"] == round(measured[3], 4) and h200["measured"]["commit"] == measured[4]
    assert h200["hours"] == round(1200 * 4 * measured[3] / 3600, 2)
    assert "time (an estimate from estimated steps) on 1 GPU of each kind: H100 ~" in out
    assert f"H200: the measured qwen35-9b step (compiled, 0.2432 s a row of 3072 tokens, {measured[4]}: " \
           f"{measured[5]}; docs/performance.md) scaled by FLOPs per row" in out
    # Another shape: scaled by FLOPs per row (a bigger target costs more a row)
    bigger = _offline_plan(monkeypatch, "recipe=qwen35-27b", f"data.source={source}", "devices=1x141")[0]["time"]
    assert all(b["seconds_per_row"] > t["seconds_per_row"] for b, t in zip(bigger, p["time"]))
    assert "regeneration (http://127.0.0.1:8000/v1): up to 1,000 answers x 2048 new tokens = 2.05M tokens" in out
    assert ("a server sharing a GPU with training needs ~17.5 GiB of weights + at most ~5.0 GiB of KV cache (8 "
            "answers in flight x 5120 tokens) + ~1 GiB = at most ~23.5 GiB; with training's, ~75.8 GiB on that GPU: "
            "fits a 141 GiB GPU, give the server --gpu-memory-utilization 0.2 (vLLM)") in out
    features = p["offline_features"]
    assert features["bf16_gib"] == round(1000 * 3072 * (5 * 4096 * 2 + 13) / 1024 ** 3, 1)
    assert "offline features (python -m data.extract --layers 1,8,15,22,29): at most ~117.2 GiB in bf16" in out
    # A Hub data set: its metadata's row count when the Hub answers, the splits joined with "+" added up
    card = huggingface_hub.DatasetCardData(dataset_info={"splits": [{"name": "chat", "num_examples": 627720},
                                                                    {"name": "code", "num_examples": 175000}]})
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, name, **kw: type("I", (), {
        "card_data": card})())
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    from train import plan as plan_module
    from train.config import load_config

    monkeypatch.setattr(plan_module, "_hub_resolves", lambda: True)
    monkeypatch.setattr(plan_module, "_fetch_config", lambda cfg: (None, "the recipe's facts (test)"))
    hub = plan_module.plan(load_config(base))["data"]
    assert (hub["rows"], hub["rows_from"]) == (802720, "the Hub's metadata of nvidia/Nemotron-Post-Training-Dataset-v2")
