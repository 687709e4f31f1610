"""Bad inputs a user makes at this stage, each ending in a clear error (or a correct rebuild), never silently.

Part of the bad-input table: ``pytest -m bad_input`` runs every stage's cases.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.bad_input import _export_error

pytestmark = pytest.mark.bad_input


@pytest.mark.parametrize("size", ["5XB", "0", "-5GB", ""])
def test_a_max_shard_size_that_is_no_size_is_refused_naming_the_flag(tmp_path, capsys, size):
    """export.hf --max-shard-size 5XB failed with the writer's message (not naming the flag) after the drafter
    loaded; 0 did too, and -5GB wrote one shard per tensor. Refused when the arguments are read."""
    from export.hf import export_hf, parse_args, shard_bytes

    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", "c", "--out", "o", f"--max-shard-size={size}"])
    assert f"--max-shard-size {size!r}: give a positive size such as 5GB" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--max-shard-size"):  # before the checkpoint is even looked for
        export_hf(tmp_path / "no-such-run", tmp_path / "out", max_shard_size=size)
    assert (shard_bytes("5GB"), shard_bytes("1.5gb"), shard_bytes("2MiB"), shard_bytes("60000")) == (
        5 * 10**9, 15 * 10**8, 2 * 2**20, 60000)


def test_a_report_or_export_inside_what_training_replaces_is_refused(tmp_path, capsys):
    """validate --out runs/X/final/val (or an export there) was written, then the next save of the final drafter
    (a resumed or repeated run) replaced final/ whole and the report went with it; inside checkpoints/step_N the
    next rotation removed it. Refused before any work, with a folder beside the run to use."""
    from export.folder import check_out
    from inference.validate import parse_args
    from train.config import load_config

    run = tmp_path / "run"
    (run / "final" / "drafter").mkdir(parents=True)
    (run / "final" / "trained.json").write_text('{"step": 8}')
    (run / "checkpoints" / "step_8").mkdir(parents=True)
    with pytest.raises(SystemExit):
        parse_args(["--target", "t", "--draft", "d", "--out", str(run / "final" / "val")])
    err = capsys.readouterr().err
    assert f"inside the training output {run / 'final'}" in err and f"--out {run / 'validate'}" in err
    with pytest.raises(SystemExit):
        parse_args(["--compare", "a.json", "b.json", "--out", str(run / "checkpoints" / "step_8" / "cmp")])
    assert "newer checkpoints remove it" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"would go with it.*--out {run / 'export'}"):
        check_out(run / "final" / "hf", overwrite=False, source=run / "final" / "drafter")
    check_out(run / "export" / "hf", overwrite=False)  # beside the run: fine
    check_out(tmp_path / "final" / "hf", overwrite=False)  # a folder named final that no training wrote: fine
    parse_args(["--target", "t", "--draft", "d", "--out", str(run / "validate")])

    with pytest.raises(ValueError, match="export.dir=.* is inside .*final, which training replaces whole"):
        load_config(["recipe=tiny", f"out_dir={run}", "export.hf=true", f"export.dir={run / 'final' / 'exp'}"])
    with pytest.raises(ValueError, match="export.dir=.* is inside .*checkpoints"):
        load_config(["recipe=tiny", f"out_dir={run}", "export.mlx=true", f"export.dir={run / 'checkpoints'}"])
    assert load_config(["recipe=tiny", f"out_dir={run}", "export.hf=true", f"export.dir={run / 'exp'}"]).export.hf


def _export_case(case: str, root, drafter) -> list[str]:
    """Set up the mistake ``case`` under ``root``; returns the command's arguments."""

    out = str(root / "out")
    if case == "missing folder":
        return ["--checkpoint", str(root / "nope"), "--out", out]
    if case == "a file":
        (root / "f.json").write_text("{}")
        return ["--checkpoint", str(root / "f.json"), "--out", out]
    if case == "no config.json":
        (root / "empty").mkdir()
        return ["--checkpoint", str(root / "empty"), "--out", out]
    if case == "a target, not a drafter":
        (root / "llama").mkdir()
        (root / "llama" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        return ["--checkpoint", str(root / "llama"), "--out", out]
    if case == "config.json not JSON":
        (drafter / "config.json").write_text("{not json")
        return ["--checkpoint", str(drafter), "--out", out]
    if case == "truncated safetensors":
        w = drafter / "model.safetensors"
        w.write_bytes(w.read_bytes()[:-100])
        return ["--checkpoint", str(drafter), "--out", out]
    if case == "unfinished run":
        (root / "run" / "checkpoints").mkdir(parents=True)
        return ["--checkpoint", str(root / "run"), "--out", out]
    if case == "a resumed run that has not finished":  # final/ from step 60, then resumed, killed at step 75
        (root / "run" / "final").mkdir(parents=True)
        drafter.rename(root / "run" / "final" / "drafter")
        (root / "run" / "final" / "trained.json").write_text('{"step": 60}')
        for step in (50, 75):
            (root / "run" / "checkpoints" / f"step_{step}").mkdir(parents=True)
        return ["--checkpoint", str(root / "run"), "--out", out]
    if case == "config.json a JSON list":
        (drafter / "config.json").write_text('["DFlashDraftModel"]')
        return ["--checkpoint", str(drafter), "--out", out]
    if case == "an incomplete checkpoint":  # killed while saving: drafter/ made, its config.json not yet
        ckpt = root / "checkpoints" / "step_3"
        (ckpt / "drafter").mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text('{"step": 3}')
        return ["--checkpoint", str(ckpt), "--out", out]
    if case in ("a checkpoint without drafter/", "a checkpoint without trainer_state.json"):
        # export.hf said "not a drafter folder ... pass runs/NAME/checkpoints/step_N": what the user had passed
        for step in (2, 3):
            ckpt = root / "run" / "checkpoints" / f"step_{step}"
            (ckpt / "state").mkdir(parents=True)
            (ckpt / "config.yaml").write_text("recipe: tiny\n")
            if step == 2 or "drafter/" not in case:
                shutil.copytree(drafter, ckpt / "drafter")
            if step == 2 or "trainer_state" not in case:
                (ckpt / "trainer_state.json").write_text(f'{{"step": {step}}}')
        return ["--checkpoint", str(root / "run" / "checkpoints" / "step_3"), "--out", out]
    if case in ("run config not YAML", "a run's final/ folder"):
        (root / "run" / "final").mkdir(parents=True)
        drafter.rename(root / "run" / "final" / "drafter")
        (root / "run" / "final" / "config.yaml").write_text("recipe: [tiny\n" if "YAML" in case else "recipe: tiny\n")
        given = root / "run" / "final" / ("drafter" if "YAML" in case else "")
        return ["--checkpoint", str(given), "--out", out]
    if case == "damaged trainer state":
        ckpt = root / "checkpoints" / "step_3"
        ckpt.mkdir(parents=True)
        drafter.rename(ckpt / "drafter")
        (ckpt / "trainer_state.json").write_text("{}")
        return ["--checkpoint", str(ckpt), "--out", out]
    if case in ("--out holds the user's files", "--overwrite of the user's files"):
        (root / "out").mkdir()
        (root / "out" / "notes.txt").write_text("mine")
        return ["--checkpoint", str(drafter), "--out", out] + (["--overwrite"] if "overwrite" in case else [])
    if case == "--out is the source":
        return ["--checkpoint", str(drafter), "--out", str(drafter), "--overwrite"]
    if case == "a quantized MLX export as the source":
        pytest.importorskip("mlx.core")
        from export.mlx import export_mlx

        export_mlx(drafter, root / "q4", quantize=4, group_size=32, log=lambda *_: None)
        return ["--checkpoint", str(root / "q4"), "--out", out]
    if case == "a mistyped --target folder":  # was recorded as the target, its check reported as skipped
        return ["--checkpoint", str(drafter), "--out", out, "--target", "./runs/tiny/tiny_targt"]
    if case == "a drafter as --target":  # its own depth: "num_target_layers=8: the target has 1 decoder layers"
        return ["--checkpoint", str(drafter), "--out", out, "--target", str(drafter)]
    raise AssertionError(case)


EXPORT_CASES = {
    "missing folder": "does not exist", "a file": "is a file", "no config.json": "(no config.json)",
    "a target, not a drafter": "config.json is not a DFlash drafter's", "config.json not JSON": "not valid JSON",
    "truncated safetensors": "corrupt or truncated", "unfinished run": "run folder without final/drafter",
    "a resumed run that has not finished": "holds two drafters: final/drafter (60 steps) and the newer ",
    "damaged trainer state": "holds no integer 'step': the folder is damaged",
    "config.json a JSON list": "config.json is not a DFlash drafter's",
    "an incomplete checkpoint": "drafter/ holds no DFlash config.json (the checkpoint is incomplete)",
    "a checkpoint without drafter/": "step_3 is incomplete: no drafter/ (it holds config.yaml, state/, "
                                     "trainer_state.json; a checkpoint holds drafter/, state/, config.yaml and "
                                     "trainer_state.json): pass another checkpoint (the newest complete one: ",
    "a checkpoint without trainer_state.json": "step_3 is incomplete: no trainer_state.json (it holds config.yaml, "
                                               "drafter/, state/; ",
    "run config not YAML": "config.yaml is not valid YAML (",
    "a run's final/ folder": "final is not a drafter folder (no config.json), a checkpoint or a run folder: pass "
                             "runs/NAME/checkpoints/step_N, runs/NAME/final/drafter or runs/NAME",
    "--out holds the user's files": "exists and is not empty",
    "--overwrite of the user's files": "not a draftsmith export", "--out is the source": "the folder being exported",
    "a quantized MLX export as the source": "already a quantized MLX export",
    "a mistyped --target folder": "--target ./runs/tiny/tiny_targt: no such folder, and not a Hub id (org/name)",
    "a drafter as --target": "drafter is a DFlash drafter (",
}


@pytest.mark.parametrize("module", ["hf", "mlx"])
@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_mistakes_end_in_one_line_and_leave_files_alone(tmp_path, export_drafter, module, case):
    argv = _export_case(case, tmp_path, export_drafter)
    assert EXPORT_CASES[case] in _export_error(module, argv + ["--no-remote-code-check"] * (module == "hf"))
    if "user's files" in case:
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["notes.txt"]
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "a temp folder was left behind"


@pytest.mark.parametrize("config", [b"{not json", b"\xff\xfe", b'["DFlashDraftModel"]', b'"draftsmith"'])
def test_overwrite_of_a_folder_whose_config_json_is_no_export_leaves_it_alone(tmp_path, export_drafter, config):
    """A config.json that is not JSON, not text, or JSON but not an object is no earlier export: --overwrite
    refuses the folder with the usual line (not a decoder's error, and never taking it for an export)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_bytes(config)
    argv = ["--checkpoint", str(export_drafter), "--out", str(tmp_path / "out"), "--overwrite"]
    assert "holds files that are not a draftsmith export" in _export_error("hf", argv + ["--no-remote-code-check"])
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["config.json"]
    assert (tmp_path / "out" / "config.json").read_bytes() == config


def test_the_source_folder_spelled_another_way_as_out_is_refused(tmp_path, export_drafter, monkeypatch):
    """--out naming the drafter being exported by a relative path or through `..`: with --overwrite the export
    replaced the training output it read (an fp32 drafter by its bf16 export)."""
    before = {p.name: p.read_bytes() for p in export_drafter.iterdir()}
    monkeypatch.chdir(tmp_path)
    for out in ("drafter", str(tmp_path / "drafter" / ".." / "drafter")):
        for module in ("hf", "mlx"):
            message = _export_error(module, ["--checkpoint", str(export_drafter), "--out", out, "--overwrite"])
            assert f"--out {out} is the folder being exported: pass a new folder" in message
    assert {p.name: p.read_bytes() for p in export_drafter.iterdir()} == before


def test_an_out_that_is_a_file_is_refused_before_the_drafter_loads(tmp_path, export_drafter, monkeypatch):
    """--out naming a file: refused up front with what to pass, the file kept (the export used to run in full
    and then fail renaming its folder onto the file)."""
    from models.drafter import DFlashDraftModel

    (tmp_path / "out").write_text("mine")
    monkeypatch.setattr(DFlashDraftModel, "from_pretrained", lambda *a, **k: pytest.fail("the drafter was loaded"))
    for module in ("hf", "mlx"):
        message = _export_error(module, ["--checkpoint", str(export_drafter), "--out", str(tmp_path / "out")])
        assert f"--out {tmp_path / 'out'} is a file: pass a folder path" in message
    assert (tmp_path / "out").read_text() == "mine"


def test_push_refuses_files_an_export_does_not_write(tmp_path, export_drafter, capsys):
    """Files in sub-folders (or beside the weights) were uploaded with the export, although the dry run listed
    only the top-level export files: a user's chats kept in the folder would have gone public."""
    from export.hf import main as export_hf
    from export.push import push

    out = tmp_path / "export"
    export_hf(["--checkpoint", str(export_drafter), "--out", str(out), "--no-remote-code-check"])
    (out / "data").mkdir()
    (out / "data" / "private_chats.jsonl").write_text("{}\n")
    (out / "notes.txt").write_text("mine")
    (out / ".cache").mkdir()  # hidden: never uploaded, not refused
    (out / ".cache" / "x").write_text("")
    with pytest.raises(ValueError, match=r"holds files an export does not write: data/private_chats.jsonl, "
                                         r"notes.txt\. A push uploads the export only"):
        push(out, "me/x", dry_run=True, log=lambda *_: None)
    (out / "notes.txt").unlink()
    (out / "data" / "private_chats.jsonl").unlink()
    assert push(out, "me/x", dry_run=True, log=lambda *_: None)["uploaded"] is False


def test_push_names_the_first_eight_stray_files_and_counts_the_rest(tmp_path):
    """A folder full of other files is refused with a short message that still says how many it holds."""
    from export.push import export_files

    (tmp_path / "config.json").write_text("{}")
    for i in range(9):
        (tmp_path / f"chat{i}.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"write: chat0.jsonl, .*, chat7.jsonl \(\+1 more\)\. A push uploads"):
        export_files(tmp_path)


def test_a_resumed_unfinished_runs_drafters_are_each_exportable_by_name(tmp_path, export_drafter):
    """The run folder is ambiguous once a finished run is resumed to train longer (refused above); its
    final/drafter and the newer checkpoint's folder each still export when named."""
    from export.source import resolve_source

    _export_case("a resumed run that has not finished", tmp_path, export_drafter)
    final = tmp_path / "run" / "final" / "drafter"
    assert resolve_source(final).drafter_dir == final
    (tmp_path / "run" / "checkpoints" / "step_75").rmdir()  # the resumed run finished: one answer again
    assert resolve_source(tmp_path / "run").drafter_dir == final


def test_a_killed_exports_staging_folder_is_removed_by_the_next_export(tmp_path, export_drafter):
    """A kill mid-export left a hidden .OUT.<random>.tmp folder (a drafter's size) that no rerun removed."""
    import os
    import time

    from export.hf import main as export_hf

    def staging(name: str, hours_ago: float):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
        for p in (folder / "model.safetensors", folder):
            os.utime(p, (time.time() - hours_ago * 3600,) * 2)

    staging(".hf.k1ll3d_1.tmp", 2)  # killed two hours ago: removed
    staging(".hf.runn1ng2.tmp", 0)  # being written by a concurrent export to the same --out: kept
    staging(".hf.mlx-q4.abcdefgh.tmp", 2)  # another export's (--out hf.mlx-q4): not this one's to remove
    staging(".hf.backup.tmp", 2)  # a user's folder of another shape
    export_hf(["--checkpoint", str(export_drafter), "--out", str(tmp_path / "hf"), "--no-remote-code-check"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".hf.backup.tmp", ".hf.mlx-q4.abcdefgh.tmp", ".hf.runn1ng2.tmp", "drafter", "hf"]


@pytest.mark.parametrize("module, said", [
    ("data.prepare", "regenerated answers are kept"), ("data.extract", "finished shards are kept"),
    ("export.hf", "--out is untouched"), ("export.mlx", "--out is untouched"), ("export.push", "no commit was made"),
])
def test_ctrl_c_says_what_a_rerun_does(module, said, monkeypatch, capsys):
    """Ctrl-C in these commands once exited 130 without a word (training printed its resume command)."""

    mod = importlib.import_module(module)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(mod, "main", interrupted)
    with pytest.raises(SystemExit) as e:
        mod.cli()
    err = capsys.readouterr().err
    assert e.value.code == 130 and err.startswith("interrupted: ") and said in err


@pytest.mark.parametrize("group, expected", [
    (128, "does not divide the input width of 8 of the drafter's 8 linears .*use --group-size 32"),
    # Only down_proj (width 64) fits: the others were left in bf16 in a folder labelled 4-bit g64.
    (64, "does not divide the input width of 7 of the drafter's 8 linears \\(e.g. fc: 96\\), which would stay "
         "unquantized: use --group-size 32 \\(the largest that divides them all\\)"),
])
def test_export_mlx_refuses_a_group_size_that_leaves_linears_unquantized(tmp_path, export_drafter, group, expected):
    pytest.importorskip("mlx.core")
    msg = _export_error("mlx", ["--checkpoint", str(export_drafter), "--out", str(tmp_path / "q"), "--quantize", "4",
                                "--group-size", str(group)])
    assert re.search(f"--group-size {group} {expected}", msg), msg
    assert not (tmp_path / "q").exists()


def test_export_to_another_target_than_the_trained_one_warns():
    """``--target`` overrides the run's recorded target: once silently, now with a warning when it is another model
    (a quantized copy of the same one is not)."""
    from export.hf import provenance

    trained = {"target": "Qwen/Qwen3-8B", "recipe": "qwen3-8b"}
    for target, warns in (("Qwen/Qwen3-14B", True), ("mlx-community/Qwen3-8B-4bit", False)):
        lines = []
        prov = provenance(trained, target, None, lines.append)
        assert prov["target"] == target and prov["recipe"] == "qwen3-8b"
        assert bool(lines) == warns and (not warns or "not the target the drafter was trained against "
                                                       "(Qwen/Qwen3-8B): recording Qwen/Qwen3-14B" in lines[0])


def test_export_bad_dtype_is_an_argparse_error(tmp_path, export_drafter, capsys):
    from export.hf import main

    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", str(export_drafter), "--out", str(tmp_path / "o"), "--dtype", "int8"])
    assert e.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err


@pytest.mark.parametrize("case, expected", [
    ("repo without a user", "use user/name or org/name"), ("repo with two slashes", "use user/name or org/name"),
    ("repo with a space", "is not a valid Hub repo id"), ("folder missing", "is not a folder"),
    ("folder is not a drafter", "is not a DFlash drafter export"),
    ("folder fails the engine schema", "eagle_aux_hidden_state_layer_ids"),
    ("truncated weights", "corrupt or truncated"), ("--report missing", "not found: pass the report.json"),
    ("revision that is no branch name", "--revision 'bad..rev' is not a valid branch name"),
    ("a run's final drafter", "final/drafter is a training run's drafter, not an export: export it first (python -m "
                              "export.hf --checkpoint "),
    ("--report not JSON", "is not valid JSON"), ("--report of another tool", "not an inference.validate report"),
    ("--report of another drafter", "measured with another drafter: block size 16 (this folder: 4)"),
    ("--report of another drafter's weights", "measured with another drafter: other weights (its drafter 'd2' has"),
    # passed the dry run; the Hub's card check refused it during the upload, after the repo was created
    ("license MIT", "--license 'MIT' is not a Hub license id: those are lowercase, without spaces (e.g. 'mit'"),
    ("license Apache 2.0", "--license 'Apache 2.0' is not a Hub license id: those are lowercase, without spaces "
                           "(e.g. 'apache-2.0'"),
])
def test_push_mistakes_end_in_one_line_before_anything_is_sent(tmp_path, export_drafter, monkeypatch, case,
                                                                 expected):
    import shutil

    from huggingface_hub import HfApi

    def never(*a, **k):
        raise AssertionError("the Hub client was called")

    for name in ("create_repo", "create_branch", "upload_folder"):
        monkeypatch.setattr(HfApi, name, never)
    repo, folder, extra = "me/drafter", export_drafter, []
    if case.startswith("repo"):
        repo = {"repo without a user": "drafter", "repo with two slashes": "me/a/b",
                "repo with a space": "me/bad name"}[case]
    elif case == "folder missing":
        folder = tmp_path / "nope"
    elif case == "folder is not a drafter":
        folder = tmp_path / "other"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    elif case == "folder fails the engine schema":
        d = json.loads((folder / "config.json").read_text())
        d["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
        (folder / "config.json").write_text(json.dumps(d))
    elif case == "truncated weights":
        w = folder / "model.safetensors"
        w.write_bytes(w.read_bytes()[:-100])
    elif case == "revision that is no branch name":  # passed the dry run; the upload then failed
        extra = ["--revision", "bad..rev"]
    elif case.startswith("license "):
        extra = ["--license", case.removeprefix("license "), "--dry-run"]
    elif case == "a run's final drafter":  # fp32, never through the export checks
        folder = tmp_path / "run" / "final" / "drafter"
        shutil.copytree(export_drafter, folder)
        (folder.parent / "config.yaml").write_text("recipe: tiny\n")
    elif case.startswith("--report"):
        path = tmp_path / "report.json"
        if case == "--report not JSON":
            path.write_text("{")
        elif case == "--report of another tool":
            path.write_text(json.dumps({"tau": 2.5, "speedup": 2.0}))
        elif case == "--report of another drafter":
            path.write_text(json.dumps({"schema": "draftsmith.validate/1", "tau": 2.5, "tau_per_prompt_mean": 2.7,
                                        "backend": "mlx", "device": "cpu", "dtype": "float32", "target": "t",
                                        "num_prompts": 3, "per_category": {}, "trained_block_size": 16,
                                        "mask_token_id": 290}))
        elif case == "--report of another drafter's weights":  # same shape facts, other trained norms
            from models.config import DFlashConfig
            from models.weights import norm_signature

            config = DFlashConfig.load(folder)
            other = {k: [v + 0.2 for v in vals] for k, vals in norm_signature(folder).items()}
            path.write_text(json.dumps({"schema": "draftsmith.validate/1", "tau": 2.5, "tau_per_prompt_mean": 2.7,
                                        "backend": "mlx", "device": "cpu", "dtype": "float32", "target": "t",
                                        "num_prompts": 3, "per_category": {}, "draft": "d2",
                                        "trained_block_size": config.block_size,
                                        "mask_token_id": config.mask_token_id, "draft_signature": other}))
        extra = ["--report", str(path)]
    msg = _export_error("push", ["--folder", str(folder), "--repo", repo] + extra)
    assert expected in msg and "Nothing was exported" not in msg  # push's own words, not export's
    assert not (export_drafter / "README.md").exists()


def test_push_private_to_a_repo_that_exists_public_uploads_nothing(tmp_path, export_drafter, monkeypatch):
    """create_repo(exist_ok=True) leaves an existing repo's visibility as it is: --private pushed the weights
    into the public repo without a word."""
    from huggingface_hub import HfApi

    from export.hf import main as export_hf
    from export.push import main as push
    from models.support import run_cli

    export_hf(["--checkpoint", str(export_drafter), "--out", str(tmp_path / "hf"), "--no-remote-code-check"])
    sent = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, **k: sent.append("create_repo"))
    monkeypatch.setattr(HfApi, "repo_info", lambda self, **k: type("ModelInfo", (), {"private": False})())
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **k: sent.append("upload_folder"))
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: push(["--folder", str(tmp_path / "hf"), "--repo", "me/d", "--private"]))
    message = str(e.value.code)
    assert "--private but me/d already exists and is public" in message and "nothing was uploaded" in message
    assert sent == ["create_repo"]


def test_export_mlx_group_size_without_quantize(capsys):
    """It was ignored: a bf16 export when the user asked for a group size."""
    from export.mlx import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", "c", "--out", "o", "--group-size", "32"])
    assert "--group-size applies to quantized exports: add --quantize 4" in capsys.readouterr().err
    assert parse_args(["--checkpoint", "c", "--out", "o", "--quantize", "4"]).group_size == 64


@pytest.mark.parametrize("new_one_moved_in", [False, True])
def test_an_overwrite_export_killed_between_its_renames_is_put_right(tmp_path, export_drafter, capsys,
                                                                     new_one_moved_in):
    """--overwrite moves the previous export to .NAME.old, then the new one in. A kill between the two
    left the previous export only as a hidden folder, which no rerun looked at."""
    import shutil

    from export.card import MARKER
    from export.hf import main as export_hf

    out = tmp_path / "hf"
    argv = ["--checkpoint", str(export_drafter), "--out", str(out), "--no-remote-code-check"]
    export_hf(argv)
    (out / "README.md").write_text(f"the previous export's card\n{MARKER}\n")  # push's: replaced too
    if new_one_moved_in:  # killed after the second rename: both copies on disk
        shutil.copytree(out, tmp_path / ".hf.old")
        (out / "README.md").unlink()
    else:
        out.rename(tmp_path / ".hf.old")
    assert "exists and is not empty" in _export_error("hf", argv)  # the rerun without --overwrite
    assert not (tmp_path / ".hf.old").exists()
    assert (out / "README.md").exists() != new_one_moved_in  # the previous export back in place, or the new kept
    assert ("put the previous export back" in capsys.readouterr().err) != new_one_moved_in
    export_hf(argv + ["--overwrite"])
    assert not (out / "README.md").exists() and (out / "config.json").is_file()


def test_an_overwrite_export_whose_last_rename_fails_keeps_the_previous_one(tmp_path, export_drafter, monkeypatch):
    """The swap moves the previous export aside, then the new one in: if the second move fails (a full
    disk), the previous export goes back in place (it was deleted first by no step of the swap)."""

    from export.hf import main as export_hf

    out = tmp_path / "hf"
    argv = ["--checkpoint", str(export_drafter), "--out", str(out), "--no-remote-code-check"]
    export_hf(argv)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = Path.rename

    def rename(self, target):
        if Path(target) == out and self.name.endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="No space left"):
        export_hf(argv + ["--overwrite"])
    monkeypatch.setattr(Path, "rename", real)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # put back at once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "hf"]  # no .hf.old, no staging folder


def test_overwrite_keeps_files_an_export_does_not_write_and_replaces_push_s_card(tmp_path, export_drafter):
    """--overwrite replaced the earlier export whole: a hand-written README.md (which push uploads as it is) and
    notes kept beside the weights were deleted without a word."""
    from export.card import MARKER
    from export.hf import export_hf

    out = tmp_path / "out"
    export_hf(export_drafter, out, remote_code_check=False, log=lambda *_: None)
    (out / "README.md").write_text("# my card\n")
    (out / "eval").mkdir()
    (out / "eval" / "notes.txt").write_text("mine")
    (out / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # a download's: not the user's work
    message = _export_error("hf", ["--checkpoint", str(export_drafter), "--out", str(out), "--overwrite",
                                   "--no-remote-code-check"])
    assert "(README.md (not written by draftsmith), eval/notes.txt): --overwrite would delete them" in message
    assert (out / "README.md").read_text() == "# my card\n" and (out / "eval" / "notes.txt").read_text() == "mine"
    (out / "README.md").write_text(f"# card\n{MARKER}\n")  # push's own card is written again by the next push
    (out / "eval" / "notes.txt").unlink()
    (out / "eval").rmdir()
    export_hf(export_drafter, out, overwrite=True, remote_code_check=False, log=lambda *_: None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]


def test_a_checkpoints_drafter_folder_exports_with_the_checkpoints_steps_and_run(tmp_path, export_drafter):
    """--checkpoint runs/NAME/checkpoints/step_N/drafter was exported as a bare drafter folder: the card lost
    the optimizer steps and the run's recipe that the same checkpoint given as step_N records."""

    from export.hf import export_hf

    ckpt = tmp_path / "run" / "checkpoints" / "step_7"
    ckpt.mkdir(parents=True)
    export_drafter.rename(ckpt / "drafter")
    (ckpt / "trainer_state.json").write_text('{"step": 7}')
    (ckpt / "config.yaml").write_text("recipe: tiny\n")
    out = export_hf(ckpt / "drafter", tmp_path / "out", remote_code_check=False, log=lambda *_: None)
    prov = json.loads((tmp_path / "out" / "config.json").read_text())["draftsmith"]
    assert (prov["steps"], prov["recipe"]) == (7, "tiny") and out["source"] == str(ckpt / "drafter")


# ----------------------------------------------------------------------------- DFlash2 folders
def _dflash2_folder(root, edit_config=None, suffix_codebooks=False):
    from safetensors.torch import load_file, save_file

    from tests.helpers.dflash2 import random_dflash2, tiny_dflash2_config

    model = random_dflash2(tiny_dflash2_config())
    folder = model.save_pretrained(root / "drafter")
    if suffix_codebooks:  # what z-lab's own save_pretrained writes
        state = load_file(str(folder / "model.safetensors"))
        state = {k + ".weight" if k.endswith("_codebook") else k: v for k, v in state.items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        d = json.loads((folder / "config.json").read_text())
        edit_config(d)
        (folder / "config.json").write_text(json.dumps(d))
    return model, folder


@pytest.mark.parametrize("case, message", [
    ("suffixed codebooks", "weight 'candidate_selector.predecessor_codebook.weight': DFlash2 codebooks are "
                           "stored without '.weight' (engines read 'candidate_selector.predecessor_codebook')"),
    ("full-attention layers", "fails the engine schema: layer_types=['full_attention', 'full_attention']: every "
                              "DFlash2 layer is sliding_attention"),
    ("causal layers", "fails the engine schema: is_causal=None: a DFlash2 drafter must say is_causal: false"),
])
def test_the_export_gate_refuses_a_dflash2_folder_off_the_published_layout_in_one_line(tmp_path, case, message):
    """The gate (export.hf) and push's folder check refuse, in one line, codebooks spelled as z-lab's torch class
    saves them and a layer list engines would run causally or without the window."""
    import torch

    from export.check import ExportCheckError
    from export.hf import gate
    from export.push import check_folder

    edit = {"full-attention layers": lambda d: d.update(layer_types=["full_attention"] * 2),
            "causal layers": lambda d: d.pop("is_causal")}.get(case)
    model, folder = _dflash2_folder(tmp_path, edit, suffix_codebooks=case == "suffixed codebooks")
    for check in (lambda: gate(folder, model, torch.float32, False, lambda *_: None), lambda: check_folder(folder)):
        with pytest.raises(ExportCheckError) as e:
            check()
        assert message in str(e.value) and "\n" not in str(e.value)


def test_exporting_a_folder_with_suffixed_codebooks_writes_the_published_names(tmp_path):
    """Our loaders read z-lab's torch spelling; what we export is the published one."""
    from safetensors import safe_open

    from export.hf import export_hf

    _, folder = _dflash2_folder(tmp_path, suffix_codebooks=True)
    export_hf(folder, tmp_path / "out", dtype="fp32", remote_code_check=False, log=lambda *_: None)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "candidate_selector.successor_codebook" in names and not any(n.endswith("codebook.weight") for n in names)


def _dtype_of(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["torch_dtype"]


def test_overwrite_through_a_symlink_replaces_the_export_it_points_at(tmp_path, export_drafter):
    """export --out LINK --overwrite, LINK a symlink to an earlier export: exited 0 having replaced the link with a
    new folder, the old weights left where it pointed and a `.LINK.old` link beside it. The export is written where
    the link points; the link stays and nothing is left beside either."""
    from export.hf import export_hf

    quiet = lambda *_: None  # noqa: E731
    exports = tmp_path / "exports"
    export_hf(export_drafter, exports / "v1", dtype="fp32", remote_code_check=False, log=quiet)
    (tmp_path / "latest").symlink_to(exports / "v1")
    export_hf(export_drafter, tmp_path / "latest", dtype="bf16", overwrite=True, remote_code_check=False, log=quiet)
    assert (tmp_path / "latest").is_symlink() and (tmp_path / "latest").resolve() == exports / "v1"
    assert _dtype_of(exports / "v1") == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "exports", "latest"]
    assert sorted(p.name for p in exports.iterdir()) == ["v1"]


def test_an_out_that_is_a_symlink_to_an_empty_folder_or_a_mount_point_is_written_into(tmp_path, export_drafter,
                                                                                       monkeypatch):
    """--out a symlink to an empty folder passed every gate, then failed with [Errno 20] Not a directory; an --out
    that is a mount point failed with [Errno 16] Device or resource busy (the export renamed the folder itself).
    Both are written into: a mount point gets the files moved in (its lost+found left alone), the folder itself is
    never renamed or removed."""
    import errno
    import os

    from export.hf import export_hf

    quiet = lambda *_: None  # noqa: E731
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    export_hf(export_drafter, tmp_path / "link", dtype="fp32", remote_code_check=False, log=quiet)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "empty" / "model.safetensors").is_file()

    mount = tmp_path / "mnt"
    (mount / "lost+found").mkdir(parents=True)
    real_rename, real_rmdir, real_ismount = os.rename, os.rmdir, os.path.ismount

    def busy(f):  # what the kernel answers for a mount point
        def call(src, *a, **k):
            if Path(src) == mount:
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src))
            return f(src, *a, **k)
        return call

    monkeypatch.setattr(os, "rename", busy(real_rename))
    monkeypatch.setattr(os, "rmdir", busy(real_rmdir))
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mount or real_ismount(p))
    export_hf(export_drafter, mount, dtype="fp32", remote_code_check=False, log=quiet)
    assert _dtype_of(mount) == "float32"
    export_hf(export_drafter, mount, dtype="bf16", overwrite=True, remote_code_check=False, log=quiet)
    assert _dtype_of(mount) == "bfloat16"
    assert sorted(p.name for p in mount.iterdir()) == ["config.json", "lost+found", "model.safetensors",
                                                       "modeling_dflash.py"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "empty", "link", "mnt"]
    message = _export_error("hf", ["--checkpoint", str(export_drafter), "--out", str(mount), "--no-remote-code-check"])
    assert "exists and is not empty" in message  # without --overwrite, as for any folder


def _poison(folder: Path, name: str = "fc.weight", value: float = float("nan")) -> None:
    """Set one value of a tensor in a folder's model.safetensors (a diverged or damaged drafter)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(str(path))
    state[name] = state[name].clone()
    state[name].view(-1)[3] = value
    save_file(state, str(path), metadata={"format": "pt"})


def test_a_drafter_with_nan_or_inf_weights_is_refused_naming_the_tensor(tmp_path, export_drafter, monkeypatch):
    """push --dry-run passed every gate and would have uploaded it; export.hf blamed the disk ("fc.weight changed on
    the way to disk": NaN is not equal to itself). One finiteness check names the tensor, before any work."""
    import shutil

    from huggingface_hub import HfApi

    from export.hf import export_hf

    export_hf(export_drafter, tmp_path / "hf", dtype="fp32", remote_code_check=False, log=lambda *_: None)
    _poison(export_drafter)
    _poison(export_drafter, "norm.weight", float("inf"))
    modules = ["hf"] + ["mlx"] * bool(importlib.util.find_spec("mlx"))
    for module in modules:
        message = _export_error(module, ["--checkpoint", str(export_drafter), "--out", str(tmp_path / "to" / module)])
        assert (f"{export_drafter}: weight fc.weight (1 NaN, 0 Inf of 3072 values) is not finite (and 1 more: "
                "norm.weight): the drafter diverged in training or its file is damaged. Nothing was exported: export "
                "an earlier checkpoint") in message, message
        assert not (tmp_path / "to" / module).exists()
    monkeypatch.setattr(HfApi, "upload_folder", lambda *a, **k: pytest.fail("uploaded"))
    shutil.copytree(tmp_path / "hf", tmp_path / "hf-nan")
    _poison(tmp_path / "hf-nan", "layers.0.mlp.down_proj.weight", float("-inf"))
    message = _export_error("push", ["--folder", str(tmp_path / "hf-nan"), "--repo", "me/d", "--dry-run"])
    assert "weight layers.0.mlp.down_proj.weight (0 NaN, 1 Inf of 2048 values) is not finite" in message
    assert "Nothing was uploaded" in message


def test_a_report_of_another_checkpoint_of_the_run_is_refused_by_an_exact_hash(tmp_path, export_drafter):
    """push --report R, R measured on another drafter of the same run (a step-100 export with the final drafter's
    report): the card showed the other drafter's numbers, because the norm fingerprint's tolerance (1e-2) is wider
    than two checkpoints differ (<= 0.0042). validate records exact hashes of a few tensors, push compares them in
    the two folders' common dtype: the same drafter in any format matches, another checkpoint does not."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from export.hf import export_hf
    from models.config import DFlashConfig
    from models.weights import norm_signature, same_signature, weight_hashes

    quiet = lambda *_: None  # noqa: E731
    later = Path(shutil.copytree(export_drafter, tmp_path / "step_200"))
    state = load_file(str(later / "model.safetensors"))
    save_file({k: v + 0.004 * torch.rand_like(v) if k.endswith("norm.weight") or k == "fc.weight" else v
               for k, v in state.items()}, str(later / "model.safetensors"), metadata={"format": "pt"})
    assert same_signature(norm_signature(later), norm_signature(export_drafter))  # the old check let it through

    def report_of(drafter: Path) -> Path:  # what validate writes about the drafter it measured
        config = DFlashConfig.load(drafter)
        path = tmp_path / f"report-{drafter.name}.json"
        path.write_text(json.dumps({
            "schema": "draftsmith.validate/1", "tau": 2.5, "tau_per_prompt_mean": 2.7, "backend": "torch",
            "device": "cpu", "dtype": "float32", "target": "t", "num_prompts": 3, "per_category": {},
            "draft": str(drafter), "trained_block_size": config.block_size, "mask_token_id": config.mask_token_id,
            "draft_quantization": None, "draft_signature": norm_signature(drafter),
            "draft_hashes": weight_hashes(drafter)}))
        return path

    export_hf(export_drafter, tmp_path / "step100-bf16", remote_code_check=False, log=quiet)
    push = ["--folder", str(tmp_path / "step100-bf16"), "--repo", "me/d", "--dry-run", "--report"]
    message = _export_error("push", push + [str(report_of(later))])
    assert (f"was measured with another drafter: other weights (its drafter '{later}' differs from this folder in "
            "fc.weight, hidden_norm.weight, layers.0.input_layernorm.weight (+") in message
    from export.push import main

    # the fp32 drafter's report matches its bf16 export, exactly
    assert main(push + [str(report_of(export_drafter))])["uploaded"] is False
    if importlib.util.find_spec("mlx"):
        from export.mlx import export_mlx

        export_mlx(export_drafter, tmp_path / "step100-mlx", log=quiet)  # bf16: MLX rounds as torch does
        main(["--folder", str(tmp_path / "step100-mlx"), "--repo", "me/d", "--dry-run", "--report",
              str(report_of(export_drafter))])


def test_serve_commands_and_cards_state_the_engine_releases_that_load_the_folder(tmp_path, export_drafter):
    """vLLM 0.20-0.21 tap one layer early and SGLang 0.5.11-0.5.12 ignore the RoPE base (0.5.17 and earlier run
    sliding layers causally): the folder loads there and drafts worse without a word. Every printed serve command
    and the card name the releases that load it correctly; a quantized MLX export names the MLX loaders that read
    it and points the others to the bf16 folder."""
    from export.card import render_card
    from export.hf import export_hf
    from export.usage import engine_requirements

    said = []
    summary = export_hf(export_drafter, tmp_path / "hf", remote_code_check=False, log=said.append)
    printed = "\n".join(said)
    assert "(needs vLLM >= 0.22.0 (0.20-0.21 tap each target layer one layer early: MT-bench acceptance 3.92 " \
           "instead of 4.11; fixed by vLLM PR #40727))" in printed
    assert "(needs SGLang >= 0.5.13 (0.5.11-0.5.12 ignore the drafter's RoPE base" in printed
    assert summary["engines"] == engine_requirements("dflash")
    card = str(render_card(tmp_path / "hf", "me/d"))
    assert "vLLM: Needs vLLM >= 0.22.0" in card and "SGLang: Needs SGLang >= 0.5.13" in card
    assert engine_requirements("dflash", sliding=True)["sglang"].startswith("SGLang >= 0.5.18 (this drafter has "
                                                                            "sliding-window layers")
    assert "0.5.18" in engine_requirements("dflash2")["sglang"]  # DFlash2 keeps its own, later builds
    if importlib.util.find_spec("mlx"):
        from export.mlx import export_mlx

        said.clear()
        export_mlx(export_drafter, tmp_path / "q4", quantize=4, group_size=32, log=said.append)
        loaders = ("loads in draftsmith's MLX loop and in bstnxbt/dflash-mlx; z-lab's model_mlx.py and "
                   "Aryagm/dflash-mlx refuse its extra scales/biases: give those the bf16 folder")
        assert loaders in "\n".join(said) and loaders in str(render_card(tmp_path / "q4", "me/d-4bit"))
