"""train/distill.py against what users do: targets without a spare embedding row, Ctrl-C, resume with
changed settings, wandb across a resume. The loop's state is what the checkpoint saves."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.tiny_run import FAST, losses, run, tiny_input_dirs

STEPS = ["logging.every=1", "eval.batches=2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tiny_input_dirs(tmp_path_factory)
    return [f"target.path={d['target']}", f"data.prepared={d['data']}"]


def small_target(directory: Path, **tokenizer_kw) -> Path:
    """A random Llama-shaped tiny target whose tokenizer is replaced (vocab rows unchanged: 288)."""
    from models.tiny import save_tiny_target, tiny_tokenizer

    save_tiny_target(directory, arch="llama")
    tiny_tokenizer("llama3", **tokenizer_kw).save_pretrained(directory)
    return directory


QUICK = [*FAST, "data.source=tiny", "data.tiny_conversations=24", "data.regenerate=none", "data.max_length=128",
         "data.eval_rows=4", "train.max_steps=2", "train.batch_size=2", "train.anchors=8", "eval.batches=1",
         "logging.every=1"]


def test_llama3_style_target_without_spare_row_trains_on_a_reserved_token(tmp_path, capsys):
    """128000 BPE + 256 reserved specials = every row a token (Llama 3.x): the mask is the first reserved
    special the chat template and the data never produce; before, no row could be found and training
    could not start."""
    target = small_target(tmp_path / "target", reserved=23)  # 256 bytes + 9 specials + 23 reserved = 288 rows
    result = run(tmp_path / "run", f"target.path={target}", *QUICK)
    out = capsys.readouterr().out
    assert "mask token: 265 '<|reserved_special_token_0|>': a reserved special token" in out
    cfg = json.loads((tmp_path / "run" / "final" / "drafter" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 265 and cfg["rope_theta"] == 500000.0  # Llama's base
    assert result["steps"] == 2 and sorted(losses(tmp_path / "run")) == [1, 2]


def test_tokenizer_mask_token_is_preferred_and_explicit_special_accepted(tmp_path, capsys):
    target = small_target(tmp_path / "target", mask_token="<|mask|>")
    run(tmp_path / "a", f"target.path={target}", *QUICK, "train.max_steps=1")
    assert "mask token: 265 '<|mask|>': the tokenizer's own mask token" in capsys.readouterr().out
    # <|im_start|> is a special token the Llama template never writes: accepted when given explicitly.
    run(tmp_path / "b", f"target.path={target}", f"data.prepared={tmp_path / 'a' / 'data'}", *QUICK,
        "train.max_steps=1", "drafter.mask_token_id=257")
    assert "mask token: 257 '<|im_start|>': given explicitly" in capsys.readouterr().out


def test_ctrl_c_prints_the_newest_checkpoint_and_the_resume_command(tiny, tmp_path, monkeypatch, capsys):
    """Ctrl-C during step 3 of a run checkpointing every 2 steps: exit 130, name step_2 and the exact
    command; that command then finishes the run with the uninterrupted run's losses."""
    import train.loop
    from models.support import run_cli
    from train.distill import main

    args = ["recipe=tiny", f"out_dir={tmp_path / 'run'}", *tiny, *FAST, *STEPS, "train.max_steps=4",
            "checkpoint.every=2"]
    real, calls = train.loop.train_step, []

    def interrupt_at_step_3(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(train.loop, "train_step", interrupt_at_step_3)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: main(args))
    assert exit_info.value.code == 130
    out = capsys.readouterr().out
    assert f"interrupted at step 2: newest checkpoint: {tmp_path / 'run' / 'checkpoints' / 'step_2'}" in out
    command = out.split("resume from it with:\n  ", 1)[1].splitlines()[0]
    # called from Python (pytest): the module form, which works from any directory
    assert command.startswith("python -m train.distill recipe=tiny") and command.endswith(" resume=true")
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))
    monkeypatch.setattr(train.loop, "train_step", real)
    main(command.split()[3:])
    full = tmp_path / "full"
    run(full, *tiny, *FAST, *STEPS, "train.max_steps=4", "checkpoint.every=2")
    got, ref = losses(tmp_path / "run"), losses(full)
    assert [got[k] for k in (3, 4)] == pytest.approx([ref[k] for k in (3, 4)], abs=1e-6)


def test_an_error_in_the_final_eval_leaves_the_last_steps_checkpoint(tiny, tmp_path, monkeypatch):
    """The final eval ran before the final checkpoint, so an eval that failed (a true-tau generation out
    of memory) lost every step since the last checkpoint: the checkpoint now comes first, and resume=true
    writes final/ from it without training again."""
    import train.loop

    args = [*tiny, *FAST, *STEPS, "train.max_steps=3"]
    real_eval, real_step = train.loop.run_eval, train.loop.train_step

    def failing_eval(*a, **kw):
        raise RuntimeError("CUDA out of memory (test)")

    monkeypatch.setattr(train.loop, "run_eval", failing_eval)
    with pytest.raises(RuntimeError, match="out of memory"):
        run(tmp_path / "run", *args)
    assert (tmp_path / "run" / "checkpoints" / "step_3").is_dir() and not (tmp_path / "run" / "final").exists()
    monkeypatch.setattr(train.loop, "run_eval", real_eval)
    monkeypatch.setattr(train.loop, "train_step", lambda *a, **kw: pytest.fail("trained again after resume"))
    result = run(tmp_path / "run", *args, "resume=true")
    assert result["steps"] == 3 and (tmp_path / "run" / "final" / "drafter" / "config.json").is_file()
    monkeypatch.setattr(train.loop, "train_step", real_step)


def test_a_warm_start_trains_and_saves_the_folders_drafter_or_is_refused(tiny, tmp_path):
    """drafter.init_from once kept the folder's config while training on the run's resolved taps and block:
    the saved drafter read other layers than it learned from. A different tap list, block or layer count is
    now refused naming the overrides that match; a matching warm start continues from the folder's weights
    and is saved with this run's provenance."""
    from safetensors.torch import load_file

    from models.drafter import DFlashDraftModel

    run(tmp_path / "a", *tiny, *FAST, *STEPS, "train.max_steps=1")
    folder = tmp_path / "a" / "final" / "drafter"
    with pytest.raises(ValueError, match=r"does not match the drafter this run resolved \(target_layer_ids: "
                       r"\[1, 2, 3\] in the folder, \[0, 2, 4\] in this run; block_size: 8 in the folder, 16 in "
                       r"this run\)\. To continue from it, add: drafter.target_layer_ids=\[1,2,3\] "
                       r"drafter.block_size=8"):
        run(tmp_path / "b", *tiny, *FAST, *STEPS, "train.max_steps=1", f"drafter.init_from={folder}",
            "drafter.target_layer_ids=[0,2,4]", "drafter.block_size=16")
    with pytest.raises(ValueError, match=r"init_from=.*: not a DFlash drafter folder"):
        run(tmp_path / "c", *tiny, *FAST, "train.max_steps=1", f"drafter.init_from={tiny[0].split('=', 1)[1]}")
    run(tmp_path / "d", *tiny, *FAST, *STEPS, "train.max_steps=1", f"drafter.init_from={folder}", "train.lr=1e-12")
    before = DFlashDraftModel.from_pretrained(folder).state_dict()
    after = load_file(tmp_path / "d" / "final" / "drafter" / "model.safetensors")
    assert sorted(after) == sorted(before)
    assert all(torch.allclose(after[k].float(), before[k].float(), atol=1e-6) for k in before)
    config = json.loads((tmp_path / "d" / "final" / "drafter" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert config["draftsmith"]["train"]["lr"] == 1e-12  # this run's provenance


@pytest.mark.parametrize("argv0, module, world, expected", [
    ("train/distill.py", None, 1, "python train/distill.py"),
    ("/x/train/distill.py", "train.distill", 1, "python -m train.distill"),
    ("train/distill.py", None, 8, "accelerate launch --num_processes 8 train/distill.py"),
    ("/x/train/distill.py", "train.distill", 2, "accelerate launch --num_processes 2 -m train.distill"),
    ("/venv/bin/draftsmith-distill", None, 1, "draftsmith-distill"),
    ("/venv/bin/draftsmith", None, 1, "draftsmith train"),
    ("/venv/bin/draftsmith", None, 8, "accelerate launch --no_python --num_processes 8 draftsmith train"),
])
def test_the_resume_hint_starts_the_run_the_way_it_was_started(monkeypatch, argv0, module, world, expected):
    """It always said ``python train/distill.py``, a file that only exists in the checkout."""
    import sys
    import types

    from train.interrupt import launch_command

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=module) if module else None
    monkeypatch.setattr(sys, "argv", [argv0])
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert launch_command(world) == expected


@pytest.mark.parametrize("env, world, noted", [
    ({}, 2, False), ({"ACCELERATE_USE_FSDP": "true"}, 2, True), ({"ACCELERATE_USE_DEEPSPEED": "true"}, 8, True),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 16, True), ({"ACCELERATE_USE_FSDP": "true"}, 1, False),
])
def test_the_resume_hint_names_launcher_flags_it_cannot_rebuild(monkeypatch, env, world, noted):
    """An FSDP / DeepSpeed config file or several machines reach the processes only as their effects: the
    hint printed a bare `accelerate launch --num_processes N`, which would start another kind of run."""
    from train.interrupt import launcher_note

    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert ("--config_file" in launcher_note(world)) == noted


def test_resume_refuses_changed_model_settings_and_allows_harmless_ones(tiny, tmp_path, capsys):
    import shutil

    from train.checkpoint import ResumeConfigError

    base = [*tiny, *FAST, *STEPS, "train.max_steps=2", "checkpoint.every=1"]
    run(tmp_path, *base)
    shutil.rmtree(tmp_path / "checkpoints" / "step_2")  # as if stopped after step 1
    config_before = (tmp_path / "config.yaml").read_text()
    with pytest.raises(ResumeConfigError, match=r"drafter\.block_size: 8 -> 16.*drafter\.target_layer_ids"):
        run(tmp_path, *base, "resume=true", "drafter.block_size=16", "drafter.target_layer_ids=[1,2,4]")
    with pytest.raises(ResumeConfigError, match=r"train\.seed: 0 -> 1"):
        run(tmp_path, *base, "resume=true", "train.seed=1")
    assert (tmp_path / "config.yaml").read_text() == config_before  # a refused resume leaves the run as it was
    # Logging and eval cadence may change: reported, then the run continues from step 1 to step 2.
    result = run(tmp_path, *base, "resume=true", "logging.every=2", "eval.batches=1")
    out = capsys.readouterr().out
    assert "settings changed since the checkpoint (harmless): eval.batches: 2 -> 1; logging.every: 1 -> 2" in out
    assert "resumed from" in out and result["steps"] == 2


def test_resume_may_lengthen_the_run_and_takes_the_new_schedule(tiny, tmp_path, capsys):
    """Train 2 steps, then resume with train.max_steps=4: steps 3-4 take the learning rates of a 4-step
    run (cosine), and with a constant schedule the very losses of an uninterrupted 4-step run. A length
    before the checkpoint's step is refused."""
    from train.checkpoint import ResumeConfigError

    base = [*tiny, *FAST, *STEPS, "checkpoint.every=2", "train.warmup_ratio=0"]
    for schedule in ("cosine", "constant"):
        cut, full = tmp_path / f"{schedule}-cut", tmp_path / f"{schedule}-full"
        run(cut, *base, f"train.schedule={schedule}", "train.max_steps=2")
        capsys.readouterr()
        result = run(cut, *base, f"train.schedule={schedule}", "train.max_steps=4", "resume=true")
        out = capsys.readouterr().out
        run(full, *base, f"train.schedule={schedule}", "train.max_steps=4")
        assert result["steps"] == 4 and sorted(losses(cut)) == [1, 2, 3, 4]
        assert "train.max_steps: 2 -> 4" in out
        got, ref = losses(cut, "lr"), losses(full, "lr")
        assert [got[k] for k in (3, 4)] == pytest.approx([ref[k] for k in (3, 4)], rel=1e-9)
        if schedule == "cosine":  # at step 2 the 2-step run had decayed to its floor; a 4-step run is halfway
            assert "schedule now spans 4 steps: learning rate at step 2 0 -> 0.0015" in out, out
            assert got[2] == 0 and got[3] == pytest.approx(ref[3])
        else:
            assert "schedule now spans" not in out
            got, ref = losses(cut), losses(full)
            assert [got[k] for k in (3, 4)] == pytest.approx([ref[k] for k in (3, 4)], abs=1e-6)
    # Shorter than the checkpoint: by max_steps (refused before anything loads) or by epochs (once the data is).
    cut = tmp_path / "cosine-cut"
    with pytest.raises(ResumeConfigError, match=r"at step 4, past train\.max_steps=3: raise it"):
        run(cut, *base, "train.max_steps=3", "resume=true")
    with pytest.raises(ResumeConfigError, match=r"at step 4, past this run's 1 steps \(train\.epochs=0\.01"):
        run(cut, *base, "train.epochs=0.01", "resume=true")


def test_resync_lr_gives_the_first_resumed_step_the_new_schedules_rate():
    """A restored optimizer keeps the old schedule's rate until LambdaLR's next step(): without the
    resync, step 3 of a 2-step run lengthened to 4 would be taken at the 2-step run's floor (0)."""
    import torch

    from train.loop import lr_lambda, resync_lr

    def scheduler(total):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, 0.0, "cosine", 0.0))

    old = scheduler(2)
    for _ in range(2):
        old.optimizer.step()
        old.step()
    new = scheduler(4)
    new.optimizer.load_state_dict(old.optimizer.state_dict())
    new.load_state_dict(old.state_dict())
    assert new.optimizer.param_groups[0]["lr"] == 0.0  # what the checkpoint held
    assert resync_lr(new) == (0.0, pytest.approx(5e-4))  # halfway down a 4-step cosine
    assert new.optimizer.param_groups[0]["lr"] == new.get_last_lr()[0] == pytest.approx(5e-4)


def test_lr_schedule_values_warmup_cosine_and_floor():
    """The tiny recipe's warmup rounds to 0 steps and its floor is 0, so the runs never showed these:
    100 steps, 10% warmup from lr/10 (not 0: the first step moves the weights), cosine over the 90
    steps after it, down to the 0.1 floor."""
    from train.loop import lr_lambda

    f = lr_lambda(100, 0.1, "cosine", 0.1)
    assert [f(0), f(4), f(9), f(10)] == [pytest.approx(0.1), pytest.approx(0.5), 1.0, 1.0]
    assert f(55) == pytest.approx(0.55)  # halfway down the cosine: floor + (1 - floor) / 2
    assert f(100) == pytest.approx(0.1) and f(130) == pytest.approx(0.1)
    assert lr_lambda(100, 0.1, "constant", 0.1)(60) == 1.0


def test_schedule_counts_a_partial_accumulation_step():
    """5 micro-batches with accumulation 2 are 3 optimizer steps per epoch (the last one of one
    micro-batch), not 2 (a row skipped every epoch)."""
    from train.config import load_config
    from train.plan import make_schedule

    cfg = load_config(["recipe=tiny", "train.batch_size=1", "train.grad_accum=2", "train.epochs=2"])
    schedule = make_schedule(cfg, 5, 1, 0)
    assert (schedule.micro_per_epoch, schedule.steps_per_epoch, schedule.total_steps) == (5, 3, 6)
    assert make_schedule(cfg, 5, 2, 1).micro_per_epoch == 2  # two processes: 2 rows each, the odd one left out


@pytest.mark.parametrize("before, now, steps_done", [(1, 2, 5), (2, 1, 3), (2, 3, 4), (3, 2, 1), (4, 4, 2)])
def test_a_resume_with_another_process_count_skips_no_row_and_repeats_less_than_a_step(before, now, steps_done):
    """The step number was kept: 2 -> 1 processes trained 16 rows again, 1 -> 2 skipped 16. The rows the
    checkpoint's processes trained on plus those the new ones train on from the converted step are the
    whole epoch, and the overlap is what reshard_position reports."""
    from train.loop import reshard_position
    from train.rng import epoch_order

    n, batch, accum = 97, 2, 2
    per_step = batch * accum

    def rows(world, first_step, last_step=None):
        out = []
        for rank in range(world):
            order = epoch_order(n, 0, 3, rank, world)
            out += order[first_step * per_step:None if last_step is None else last_step * per_step]
        return out

    trained = rows(before, 0, steps_done)
    step, again = reshard_position(steps_done, per_step * before, per_step * now)
    after = rows(now, step)
    assert len(set(trained)) == len(trained) == steps_done * per_step * before
    assert len(set(trained) & set(after)) == again < per_step * now  # trained again: less than one step
    lost = set(range(n)) - set(trained) - set(after)
    assert len(lost) < max(before, now)  # only the epoch's tail that does not divide among the processes


def test_every_epoch_draws_a_new_order_and_new_anchors():
    """The paper re-draws anchors every epoch; the order of the rows changes too. Both are pure
    functions of (seed, epoch): the same epoch gives the same draw (what resume relies on)."""
    import torch

    from train.rng import epoch_order, row_generators

    e0, e1 = epoch_order(100, 0, 0, 0, 1), epoch_order(100, 0, 1, 0, 1)
    assert sorted(e0) == sorted(e1) == list(range(100)) and e0 != e1
    assert epoch_order(100, 0, 1, 0, 1) == e1 and epoch_order(100, 1, 0, 0, 1) != e0  # another seed
    a, b = epoch_order(101, 0, 0, 0, 2), epoch_order(101, 0, 0, 1, 2)
    assert len(a) == len(b) == 50 and not set(a) & set(b)  # equal, disjoint shares
    draw = lambda epoch: torch.randint(0, 10**6, (4,), generator=row_generators(0, epoch, [5])[0]).tolist()  # noqa: E731
    assert draw(0) == draw(0) and draw(0) != draw(1) and draw("eval") == draw("eval") != draw(0)


def test_checkpoints_sort_by_step_number_past_step_9(tmp_path):
    """As strings, step_10 sorts before step_9: resume would pick step_9 and keep_last delete step_10."""
    from train.checkpoint import checkpoint_dirs, latest_checkpoint

    for step in (2, 10, 9, 100):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_11.tmp").mkdir()  # a checkpoint being written: not one yet
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_2", "step_9", "step_10", "step_100"]
    assert latest_checkpoint(tmp_path).name == "step_100"
    (tmp_path / "checkpoints" / "step_200").write_text("")  # a file, not a checkpoint
    (tmp_path / "checkpoints" / "old_step_300").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_100"
    assert checkpoint_dirs(tmp_path / "none") == [] and latest_checkpoint(tmp_path / "none") is None


def test_what_training_replaces_is_found_from_any_path_inside_it(tmp_path, monkeypatch):
    """final/ (once it holds trained.json) and checkpoints/step_N themselves or anything below them, relative
    paths too; a step_N folder outside checkpoints/ or a folder merely named like one is not training's."""
    from models.provenance import refuse_training_output, replaced_by_training

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "trained.json").write_text('{"step": 2}')
    for name in ("step_2", "xstep_2", "step_2x"):
        (run / "checkpoints" / name).mkdir(parents=True)
    step = run / "checkpoints" / "step_2"
    assert replaced_by_training(step) == step and replaced_by_training(step / "a" / "b") == step
    assert replaced_by_training(run / "final") == run / "final"
    assert [replaced_by_training(p) for p in (run, run / "checkpoints", run / "checkpoints" / "xstep_2" / "a",
                                              run / "checkpoints" / "step_2x", run / "other" / "step_2")] == [None] * 5
    monkeypatch.chdir(tmp_path)
    assert replaced_by_training("run/final/val") == run / "final"
    refuse_training_output(run / "val", "report", "validate")  # beside the run: fine
    with pytest.raises(ValueError) as e:
        refuse_training_output(step / "val", "report", "validate")
    assert str(e.value) == (f"--out {step / 'val'} is inside the training output {step}: newer checkpoints remove it, "
                            f"and the report would go with it. Write it beside the run instead, e.g. --out "
                            f"{run / 'validate'}")


def test_checkpoint_holds_the_loop_state_and_wandb_resumes_the_same_run(tiny, tmp_path, monkeypatch):
    calls: dict[str, list] = {"init": []}

    class Run:
        id = "run-abc123"

        def log(self, *a, **kw):
            pass

        def finish(self):
            pass

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: (calls["init"].append(kw), Run())[1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    import shutil

    base = [*tiny, *FAST, *STEPS, "checkpoint.every=1", "logging.wandb=true", "logging.wandb_mode=offline",
            "train.max_steps=2"]
    run(tmp_path, *base)
    state = json.loads((tmp_path / "checkpoints" / "step_1" / "trainer_state.json").read_text())
    assert set(state) == {"step", "epoch", "step_in_epoch", "tokens_seen", "wandb_run_id", "world_size", "rows"}
    assert state["step"] == 1 and state["wandb_run_id"] == "run-abc123" and state["tokens_seen"] > 0
    shutil.rmtree(tmp_path / "checkpoints" / "step_2")  # as if stopped after step 1
    run(tmp_path, *base, "resume=true")
    assert calls["init"][0]["id"] is None and calls["init"][1]["id"] == "run-abc123"
    assert calls["init"][1]["resume"] == "allow"


def test_fractional_epochs_round_the_step_count_up():
    """train.epochs=1.5 of 3 steps per epoch is 5 steps (the half epoch's 1.5 steps become 2)."""
    from train.config import load_config
    from train.plan import make_schedule

    cfg = load_config(["recipe=tiny", "train.batch_size=1", "train.grad_accum=2", "train.epochs=1.5"])
    assert make_schedule(cfg, 6, 1, 0).total_steps == 5


def test_lr_schedule_whose_warmup_is_the_whole_run():
    """warmup_ratio=1: the steps ramp up to lr, and the scheduler's call past the last step gets the
    top of the (empty) cosine, not a division by zero."""
    from train.loop import lr_lambda

    f = lr_lambda(4, 1.0, "cosine", 0.1)
    assert [f(0), f(1), f(3), f(4), f(9)] == [0.25, 0.5, 1.0, 1.0, pytest.approx(0.1)]


def test_advance_counts_every_processs_tokens_and_rolls_over_at_the_epochs_end():
    from train.loop import LoopState, StepStats, advance
    from train.plan import Schedule

    zero = torch.zeros(())
    stats = StepStats(loss=zero, ce_sum=zero, kl_sum=zero, tokens=3, tokens_all=7)  # 7 over all processes
    state, sched = LoopState(), Schedule(micro_per_epoch=4, steps_per_epoch=2, total_steps=5)
    seen = []
    for _ in range(3):
        advance(state, sched, stats)
        seen.append((state.step, state.epoch, state.step_in_epoch, state.tokens_seen))
    assert seen == [(1, 0, 1, 7), (2, 1, 0, 14), (3, 1, 1, 21)]


def test_the_last_step_of_an_epoch_takes_only_the_micro_batches_left():
    """5 one-row micro-batches with accumulation 2: the epoch's third step has one micro-batch, not a
    second one past the epoch's end."""
    from train.config import load_config
    from train.loop import LoopState, draw_step
    from train.plan import make_schedule
    from train.rng import epoch_order

    cfg = load_config(["recipe=tiny", "train.batch_size=1", "train.grad_accum=2", "train.anchors=4"])
    rows = [{"input_ids": [i, i + 1, i + 2, i + 3], "loss_mask": [0, 1, 1, 1], "doc_ids": [0] * 4,
             "position_ids": [0, 1, 2, 3]} for i in range(5)]
    run_ = types.SimpleNamespace(cfg=cfg, device=torch.device("cpu"))
    sched = make_schedule(cfg, len(rows), 1, 0)
    order = epoch_order(len(rows), cfg.train.seed, 0, 0, 1)
    drafter_cfg = types.SimpleNamespace(block_size=4, mask_token_id=0)
    steps = [draw_step(run_, rows, order, LoopState(step_in_epoch=k), sched, drafter_cfg) for k in range(3)]
    assert [[m.rows for m in step] for step in steps] == [[order[0:1], order[1:2]], [order[2:3], order[3:4]],
                                                          [order[4:5]]]


def test_a_drawn_micro_batch_knows_whether_its_documents_are_contiguous():
    """The flex mask trusts this flag (read on the host when the blocks are drawn) instead of reading the
    GPU's document ids back: it must say what the rows hold."""
    from train.block_mask import documents_contiguous
    from train.config import load_config
    from train.loop import LoopState, draw_step
    from train.plan import make_schedule
    from train.rng import epoch_order

    cfg = load_config(["recipe=tiny", "train.batch_size=2", "train.anchors=4"])
    packed = {"input_ids": list(range(8)), "loss_mask": [0, 1, 1, 1] * 2, "doc_ids": [0] * 4 + [1] * 4,
              "position_ids": [0, 1, 2, 3] * 2}
    repeated = dict(packed, doc_ids=[0, 0, 1, 1, 0, 0, 1, 1])  # document 0 comes back: not one run
    run_ = types.SimpleNamespace(cfg=cfg, device=torch.device("cpu"))
    drafter_cfg = types.SimpleNamespace(block_size=4, mask_token_id=0)
    for rows, contiguous in (([packed, packed], True), ([packed, repeated], False)):
        sched = make_schedule(cfg, len(rows), 1, 0)
        (m,) = draw_step(run_, rows, epoch_order(2, 0, 0, 0, 1), LoopState(), sched, drafter_cfg)
        assert m.contiguous is contiguous and documents_contiguous(m.doc) is contiguous


def test_true_tau_runs_only_with_an_eval():
    from train.config import load_config
    from train.loop import eval_due

    cfg = load_config(["recipe=tiny", "eval.every=4", "eval.true_tau_every=6"])
    assert [eval_due(cfg, step, False) for step in (4, 6, 8, 12)] == [(True, False), (False, False), (True, False),
                                                                     (True, True)]
    assert eval_due(cfg, 7, True) == (True, True)


def test_the_resume_command_drops_every_spelling_of_resume(monkeypatch):
    from train.interrupt import resume_command

    monkeypatch.setattr(sys, "argv", ["train/distill.py"])
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    got = resume_command(["recipe=tiny", "--resume", "resume=false", "--resume=true", "out_dir=a b"], 1)
    assert got == "python train/distill.py recipe=tiny 'out_dir=a b' resume=true"


def test_streams_of_different_seeds_and_epochs_do_not_coincide():
    """Seed 1's first epoch is not seed 0's second, and the parts of a stream's name do not run together
    ((0, 1, 23) and (0, 12, 3) are different rows' streams)."""
    from train.rng import epoch_order, stream_seed

    assert epoch_order(50, 1, 0, 0, 1) != epoch_order(50, 0, 1, 0, 1)
    assert stream_seed(0, 1, 23) != stream_seed(0, 12, 3)
    assert 0 <= stream_seed(2**40, "eval", 7) < 2**63


def test_metrics_rows_for_the_console_wandb_and_a_new_run(tmp_path):
    """Console: small negative values keep their digits. wandb: numbers only (no flags, lists, text),
    at the row's step. A new run (not a resume) starts metrics.jsonl afresh."""
    from train.metrics import MetricsLogger, number, open_metrics

    assert (number(-6e-5), number(-1.23456), number(0.0), number(7)) == ("-6.00e-05", "-1.235", "0", "7")
    sent = []
    wandb_run = types.SimpleNamespace(log=lambda numbers, step: sent.append((numbers, step)))
    MetricsLogger(None, wandb_run=wandb_run).log({"step": 3, "loss": 2.5, "final": True, "hist": [1], "what": "x"})
    assert sent == [({"step": 3, "loss": 2.5}, 3)]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval_loss": 9.0}\n{"step": 1, "loss": 9.0}\n')
    cfg = types.SimpleNamespace(logging=types.SimpleNamespace(wandb=False))
    logger = open_metrics(cfg, tmp_path, True, 0, None, print)
    logger.log({"step": 1, "loss": 2.0})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'


def test_metrics_logger_appends_rows_sends_numbers_and_echoes_their_lines(tmp_path):
    """Rows are appended as JSON lines; wandb gets the numbers (no flags) at the row's step; the console
    gets only the lines asked for (``echo``); close() finishes the wandb run once."""
    from train.metrics import MetricsLogger, eval_line

    printed, sent, finished = [], [], []
    run = types.SimpleNamespace(id="run-1", log=lambda numbers, step: sent.append((numbers, step)),
                                finish=lambda: finished.append(True))
    logger = MetricsLogger(tmp_path / "m.jsonl", printed.append, run)
    assert logger.wandb_run_id == "run-1"
    logger.log({"step": 1, "loss": 2.123456, "skipped": False})
    logger.log({"step": 2, "eval_loss": 1.234567}, echo=eval_line({"step": 2, "eval_loss": 1.234567}, 10))
    assert (tmp_path / "m.jsonl").read_text() == \
        '{"step": 1, "loss": 2.123456, "skipped": false}\n{"step": 2, "eval_loss": 1.234567}\n'
    assert printed == ["eval   2/10  held-out loss 1.2346"]
    assert sent == [({"step": 1, "loss": 2.123456}, 1), ({"step": 2, "eval_loss": 1.234567}, 2)]
    logger.close()
    logger.close()
    assert finished == [True] and logger.wandb_run_id is None
    MetricsLogger(None, printed.append).log({"step": 3, "loss": 1.0})  # a process that is not the main one
    assert MetricsLogger(None).wandb_run_id is None and printed == ["eval   2/10  held-out loss 1.2346"]


def test_console_lines_a_person_reads():
    """A logged step and an eval as one readable line each (the rows stay JSON in metrics.jsonl): every number
    the line does not spell out itself follows as `name value`, lists and dicts (per-slot figures) left out."""
    from train.metrics import eval_line, step_line, tau_trend

    row = {"step": 20, "epoch": 0.25, "loss": 4.215631, "ce": 4.3012, "tau": 1.8712, "lr": 6e-5, "grad_norm": 1.25,
           "tokens_per_s": 5123.4, "anchors_per_s": 80.0, "slot_weight": [0.9, 0.8], "new_metric": 0.5}
    assert step_line(row, 200, 62.0, 558.0) == ("step   20/200  epoch 0.25  loss 4.2156  sim tau 1.87  lr 6.00e-05  "
                                                "5.1k tok/s  0:01:02 (~0:09:18 left)  ce 4.301  grad_norm 1.25  "
                                                "new_metric 0.5")
    ev = {"step": 200, "eval_loss": 3.91234, "eval_tau_sim": 2.3149, "eval_pos_acc": [0.5], "eval_blocks": 512,
          "eval_tau_true": 2.049, "eval_true_cycles": 96, "eval_tau_true_uncut": 2.12, "eval_true_hist": {"1": 3}}
    assert eval_line(ev, 200) == ("eval  200/200  held-out loss 3.9123  sim tau 2.31 (512 blocks)  true tau 2.05 "
                                  "(96 cycles; 2.12 uncut: each prompt's last cycle in full)")
    gpu = {**row, "tokens_per_s": 12600.0, "tflops": 1022.8, "mfu": 0.517, "compile_s": 61.25}
    assert step_line(gpu, 200, 62.0) == ("step   20/200  epoch 0.25  loss 4.2156  sim tau 1.87  lr 6.00e-05  "
                                         "12.6k tok/s  MFU 0.517  0:01:02  ce 4.301  grad_norm 1.25  new_metric 0.5  "
                                         "tflops 1023  compile_s 61.25")
    assert eval_line({"step": 3}) == "eval  3  no held-out rows (data.eval_rows=0)"
    evals = [{"step": 0, "eval_tau_sim": 1.0}, {"step": 5, "eval_tau_sim": 1.5, "eval_tau_true": 1.2},
             {"step": 10, "eval_tau_sim": 2.0}]
    assert tau_trend(evals, "eval_tau_sim") == "1.00 at step 0 -> 2.00 at step 10"
    assert tau_trend(evals, "eval_tau_true") == "1.20 at step 5" and tau_trend(evals, "x") is None


def _metrics_cfg(wandb: bool):
    return types.SimpleNamespace(logging=types.SimpleNamespace(wandb=wandb, wandb_project="proj", wandb_mode="offline"),
                                 to_dict=lambda: {"train": {"lr": 0.1}})


def test_resume_keeps_the_metrics_rows_up_to_its_step(tmp_path):
    """Resuming from step 2 keeps the rows of steps <= 2 (a step written as text or a float counts by its whole
    number) and drops later steps, rows without a step and a line cut short by a kill; what the resumed run
    logs follows on a line of its own. A process that is not the main one writes nothing."""
    from train.metrics import open_metrics

    rows = ['{"step": 0, "eval_loss": 9.0}', '{"step": 1, "loss": 3.0}', '{"step": 2, "loss": 2.0}',
            '{"step": "2", "eval_loss": 8.0}', '{"step": 2.5, "x": 1}', '{"step": 3, "loss": 1.0}',
            '{"loss": 5.0}', '{"step": null}', '{"step": 4, "lo']
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(rows) + "\n")
    printed = []
    logger = open_metrics(_metrics_cfg(False), tmp_path, True, 2, "old-run", printed.append)
    logger.log({"step": 3, "loss": 1.5}, echo="step 3")
    assert path.read_text().splitlines() == rows[:5] + ['{"step": 3, "loss": 1.5}']
    assert printed == ["step 3"] and logger.wandb_run is None
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    other = tmp_path / "other"
    other.mkdir()
    assert open_metrics(_metrics_cfg(False), other, True, 5, None, print).path == other / "metrics.jsonl"
    assert not (other / "metrics.jsonl").exists()  # resuming where no metrics were written: none made up
    assert open_metrics(_metrics_cfg(True), other, False, 0, None, print).path is None
    assert list(other.iterdir()) == []


def test_wandb_starts_a_new_run_or_resumes_the_checkpoints_one(tmp_path, monkeypatch):
    """A fresh run starts a new wandb run (an old id is not reused) with the run config, folder and mode; a
    resumed one continues the id it saved; without wandb a stand-in with no id logs nothing and says so once."""
    from train.metrics import open_metrics

    inits = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: (inits.append(kw), types.SimpleNamespace(id=kw["id"] or "new-run"))[1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    fresh = open_metrics(_metrics_cfg(True), tmp_path, True, 0, "old-run", print)
    resumed = open_metrics(_metrics_cfg(True), tmp_path, True, 3, "old-run", print)
    common = {"project": "proj", "config": {"train": {"lr": 0.1}}, "dir": str(tmp_path), "mode": "offline"}
    assert inits == [{**common, "id": None, "resume": None}, {**common, "id": "old-run", "resume": "allow"}]
    assert (fresh.wandb_run_id, resumed.wandb_run_id) == ("new-run", "old-run")
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    said = []
    with pytest.warns(UserWarning, match="wandb is not importable"):
        logger = open_metrics(_metrics_cfg(True), tmp_path, True, 0, None, said.append)
    assert said == [f"warning: logging.wandb=true but wandb is not importable (pip install wandb): logging to the "
                    f"console and {tmp_path / 'metrics.jsonl'} only"]
    assert logger.wandb_run_id is None
    logger.log({"step": 1, "loss": 1.0})
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


# ----------------------------------------------------------------------------- train/checkpoint.py, directly
class _OneProcess:
    """The parts of an accelerate Accelerator that save_checkpoint uses: one process, a stand-in state."""

    is_main_process = True

    def wait_for_everyone(self):
        pass

    def get_state_dict(self, model):
        return model.state_dict()

    def unwrap_model(self, model):
        return model

    def save_state(self, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"state")


def test_a_checkpoint_clears_killed_saves_and_replaces_an_earlier_one_of_its_step(tmp_path):
    """A ``step_N.tmp`` left by a kill is removed by the next save; a step that already has a checkpoint
    (an earlier run's, never cleared) gets the new one whole, not an error about a non-empty folder."""
    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel
    from train.checkpoint import read_trainer_state, save_checkpoint

    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=300, num_target_layers=8,
                       target_layer_ids=[1, 3, 5], mask_token_id=290, block_size=4, torch_dtype="float32")
    model, root = DFlashDraftModel(cfg), tmp_path / "checkpoints"
    (root / "step_3.tmp").mkdir(parents=True)
    (root / "step_3.tmp" / "half.bin").write_bytes(b"cut short")
    (root / "step_4" / "drafter").mkdir(parents=True)
    (root / "step_4" / "trainer_state.json").write_text('{"step": 4, "run": "earlier"}')
    final = save_checkpoint(_OneProcess(), model, tmp_path, 4, {"step": 4, "run": "this"}, "recipe: tiny\n", 2)
    assert sorted(p.name for p in root.iterdir()) == ["step_4"]
    assert final == root / "step_4" and read_trainer_state(final) == {"step": 4, "run": "this"}
    assert (final / "config.yaml").read_text() == "recipe: tiny\n" and (final / "drafter" / "config.json").is_file()


class _TwoProcesses:
    """Rank ``rank`` of two threads standing in for two processes: a real barrier, and accelerate's
    ``save_state`` shape (every rank creates the folder, then writes its own RNG state file into it).

    Rank 1 is the slow one: it writes its file only once rank 0 waits for it at a barrier after the
    one that follows ``tmp.mkdir`` (or has gone on without waiting), the order a loaded node gives."""

    def __init__(self, rank: int, barrier, rank0_waits):
        self.rank, self.barrier, self.rank0_waits, self.calls = rank, barrier, rank0_waits, 0
        self.is_main_process = rank == 0

    def wait_for_everyone(self):
        self.calls += 1
        if self.rank == 0 and self.calls >= 2:
            self.rank0_waits.set()
        self.barrier.wait()

    def get_state_dict(self, model):
        return model.state_dict()

    def unwrap_model(self, model):
        return model

    def save_state(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            (Path(path) / "model.safetensors").write_bytes(b"state")
        else:
            self.rank0_waits.wait(timeout=5)
        (Path(path) / f"random_states_{self.rank}.pkl").write_bytes(b"rng")


def test_the_main_process_renames_a_checkpoint_only_once_every_process_has_written_into_it(tmp_path):
    """accelerate's save_state writes ``random_states_<rank>.pkl`` on every process with no barrier after:
    a main process that renamed ``step_N.tmp`` as soon as its own files were written left a slower rank
    writing into a folder that was gone ("Parent directory .../step_3.tmp/state does not exist", its
    torchrun job failed after the training itself had finished), or into a re-created ``step_N.tmp``
    while ``step_N`` lacked that rank's RNG state."""
    import threading

    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel
    from train.checkpoint import save_checkpoint

    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=300, num_target_layers=8,
                       target_layer_ids=[1, 3, 5], mask_token_id=290, block_size=4, torch_dtype="float32")
    model = DFlashDraftModel(cfg)
    barrier, rank0_waits, errors = threading.Barrier(2, timeout=20), threading.Event(), {}

    def rank(r):
        try:
            save_checkpoint(_TwoProcesses(r, barrier, rank0_waits), model, tmp_path, 3, {"step": 3}, "x: 1\n", 2)
        except Exception as e:  # noqa: BLE001 - reported below, by rank
            errors[r] = e
            barrier.abort()  # the other rank's barrier fails at once instead of waiting out its timeout

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_3"]  # no step_3.tmp re-created by the slow rank
    assert sorted(p.name for p in (root / "step_3" / "state").iterdir()) == [
        "model.safetensors", "random_states_0.pkl", "random_states_1.pkl"]


def test_a_damaged_checkpoint_falls_back_to_the_newest_one_before_it(tmp_path):
    from train.checkpoint import _fallback

    for step in (1, 2, 4, 5):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    assert _fallback(tmp_path / "checkpoints" / "step_4").endswith(f"to resume from {tmp_path}/checkpoints/step_2")
    assert _fallback(tmp_path / "checkpoints" / "step_1").endswith("to start over: it is the only checkpoint")


def test_a_final_written_in_the_same_clock_tick_as_the_last_checkpoint_is_a_finished_run(tmp_path):
    """File times are coarse on some file systems (1-2 s): equal times mean final/ was written after."""
    import os

    from train.checkpoint import clear_for_fresh_start

    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 2}')
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.yaml").write_text("recipe: tiny\n")
    for path in (step / "trainer_state.json", tmp_path / "final" / "config.yaml"):
        os.utime(path, (1_700_000_000, 1_700_000_000))
    clear_for_fresh_start(tmp_path, lambda *_: None, _OneProcess())
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_readers_error_is_cut_to_its_first_sentence_and_200_characters():
    from train.checkpoint import _reason

    long = "x" * 150 + " y" * 40
    assert _reason(RuntimeError(long + ". Then more.\nA second line")) == long[:200]
    assert len(long) == 230 and _reason(RuntimeError(f"{'z' * 120}. rest")) == "z" * 120


def test_only_listed_keys_or_sections_are_harmless_on_resume():
    """A key that merely starts like a harmless one (a setting added later) is refused by default."""
    from train.checkpoint import is_harmless

    assert is_harmless("train.compile") and is_harmless("logging.every") and is_harmless("recipe")
    assert not is_harmless("train.compile_mode") and not is_harmless("train.attention_dropout")
    assert not is_harmless("recipes") and not is_harmless("train.lr")


def _tiny_model():
    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel

    return DFlashDraftModel(DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=300,
                                         num_target_layers=8, target_layer_ids=[1, 3, 5], mask_token_id=290,
                                         block_size=4, torch_dtype="float32"))


def test_keep_last_removes_the_oldest_checkpoints_and_ctrl_c_mid_save_removes_only_the_half_written_one(tmp_path):
    """keep_last=2 keeps the two newest steps (by number, past step 9); 0 keeps them all. A Ctrl-C while the state
    is written leaves no step_N.tmp and the earlier checkpoints as they were."""
    from train.checkpoint import save_checkpoint

    model, root = _tiny_model(), tmp_path / "checkpoints"
    for step in (8, 9, 10, 11):
        save_checkpoint(_OneProcess(), model, tmp_path, step, {"step": step}, "x: 1\n", 2)
    assert sorted(p.name for p in root.iterdir()) == ["step_10", "step_11"]
    for step in (12, 13):
        save_checkpoint(_OneProcess(), model, tmp_path, step, {"step": step}, "x: 1\n", 0)
    assert sorted(p.name for p in root.iterdir()) == ["step_10", "step_11", "step_12", "step_13"]

    class Interrupted(_OneProcess):
        def save_state(self, path):
            super().save_state(path)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(Interrupted(), model, tmp_path, 14, {"step": 14}, "x: 1\n", 2)
    assert sorted(p.name for p in root.iterdir()) == ["step_10", "step_11", "step_12", "step_13"]


def test_only_the_main_process_writes_the_drafter_folder_in_the_dtype_asked(tmp_path):
    from safetensors.torch import load_file

    from train.checkpoint import save_drafter

    class Rank1(_OneProcess):
        is_main_process = False

    model = _tiny_model()
    save_drafter(Rank1(), model, tmp_path / "rank1")
    assert not (tmp_path / "rank1").exists()
    save_drafter(_OneProcess(), model, tmp_path / "bf16", dtype=torch.bfloat16)
    weights = load_file(tmp_path / "bf16" / "model.safetensors")
    assert weights.keys() == model.state_dict().keys()
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights["fc.weight"], model.fc.weight.detach().to(torch.bfloat16))


def test_resume_changes_sorted_into_harmless_and_refused(tmp_path):
    """Harmless: the listed keys (a dict value such as target.max_memory is one key, not a section), and a path
    key (features.store) spelled another way for the same folder. Refused: any other key, and a path that does
    not exist compared as text. A checkpoint without config.yaml is said to be unchecked."""
    from train.checkpoint import check_resume_config, config_changes

    (tmp_path / "store").mkdir()
    saved = {"target": {"path": "gone/target", "max_memory": {"0": "10GiB"}},
             "data": {"rebuild": False}, "features": {"store": str(tmp_path / "store")},
             "train": {"ce_chunk": 1024, "lr": 6e-4}}
    now = {"target": {"path": "./gone/target", "max_memory": {"0": "20GiB"}},
           "data": {"rebuild": True}, "features": {"store": str(tmp_path) + "/./store"},
           "train": {"ce_chunk": 2048, "lr": 6e-4}}
    refused, harmless = config_changes(saved, now, {})
    assert refused == ["target.path: 'gone/target' -> './gone/target'"]
    assert harmless == ["data.rebuild: False -> True", "target.max_memory: {'0': '10GiB'} -> {'0': '20GiB'}",
                        "train.ce_chunk: 1024 -> 2048"]
    from train.config import RunConfig

    cfg, ckpt = RunConfig(), tmp_path / "step_2"  # a checkpoint that predates train.kl_topk: its default there
    ckpt.mkdir()
    older = cfg.to_dict()
    del older["train"]["kl_topk"]
    (ckpt / "config.yaml").write_text(yaml.safe_dump(older))
    said = []
    check_resume_config(ckpt, cfg, said.append)
    assert said == []
    said = []  # a checkpoint without its config.yaml cannot be compared: said so, not silently passed
    check_resume_config(tmp_path / "step_3", None, said.append)
    assert said == [f"warning: {tmp_path / 'step_3' / 'config.yaml'} is missing: cannot check that the settings "
                    "match the checkpoint"]


def test_fresh_start_over_no_earlier_run_says_nothing_and_an_unfinished_run_names_its_step(tmp_path):
    """No checkpoint: nothing to clear, nothing logged. A checkpoint newer than final/ (or no final/) is an
    unfinished run, refused with its step; a checkpoint without trainer_state.json under a final/ is finished."""
    import os

    from train.checkpoint import ResumeConfigError, clear_for_fresh_start, refuse_unfinished_run

    said = []
    clear_for_fresh_start(tmp_path, said.append, _OneProcess())
    assert said == []
    step = tmp_path / "checkpoints" / "step_7"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 70}')
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.yaml").write_text("recipe: tiny\n")
    os.utime(tmp_path / "final" / "config.yaml", (1_700_000_000, 1_700_000_000))
    os.utime(step / "trainer_state.json", (1_700_000_100, 1_700_000_100))
    with pytest.raises(ResumeConfigError, match="holds an unfinished run .*step_7, step 70\\)"):
        refuse_unfinished_run(tmp_path)
    (step / "trainer_state.json").unlink()
    assert refuse_unfinished_run(tmp_path) is True


@pytest.mark.parametrize("attention, device, flex", [("flex", "cpu", True), ("auto", "cuda", True),
                                                     ("auto", "cpu", False), ("dense", "cuda", False)])
def test_flex_attention_where_asked_or_with_auto_on_cuda(attention, device, flex):
    from train.config import load_config
    from train.loop import Run

    accelerator = types.SimpleNamespace(device=torch.device(device))
    cfg = load_config(["recipe=tiny", f"train.attention={attention}"])
    assert Run(cfg, accelerator, Path("run"), "", "no", print).use_flex == flex


def test_an_older_checkpoints_loop_state_loads_with_the_keys_it_lacks_at_their_defaults():
    """Older trainer_state.json files carry keys the loop no longer keeps (total_steps, seed) and lack
    world_size: such a run was trained by one process, so its data shards are one process's."""
    from train.loop import LoopState

    state = LoopState.from_dict({"step": 6, "epoch": 1, "step_in_epoch": 2, "tokens_seen": 900, "total_steps": 10,
                                 "seed": 0})
    assert (state.step, state.epoch, state.step_in_epoch, state.tokens_seen) == (6, 1, 2, 900)
    assert (state.world_size, state.rows, state.wandb_run_id) == (1, None, None)


def test_the_rows_that_do_not_fill_a_micro_batch_are_left_out_of_the_epoch():
    """5 rows in micro-batches of 2: 2 micro-batches per epoch (the fifth row waits for another epoch's
    order), not 3 with a short last one."""
    from train.config import load_config
    from train.plan import make_schedule

    cfg = load_config(["recipe=tiny", "train.batch_size=2", "train.grad_accum=1", "train.epochs=1"])
    schedule = make_schedule(cfg, 5, 1, 0)
    assert (schedule.micro_per_epoch, schedule.steps_per_epoch, schedule.total_steps) == (2, 2, 2)


def test_a_step_takes_batch_size_rows_per_micro_batch_and_draws_its_anchors_from_the_epoch():
    """Micro-batch k of a step is rows k*batch .. (k+1)*batch of the order, and the same rows are given
    new anchors in another epoch (their generators are seeded by the epoch, as in the paper)."""
    from train.config import load_config
    from train.loop import LoopState, draw_step
    from train.plan import make_schedule

    cfg = load_config(["recipe=tiny", "train.batch_size=2", "train.grad_accum=2", "train.anchors=2"])
    rows = [{"input_ids": list(range(i, i + 32)), "loss_mask": [0] + [1] * 31, "doc_ids": [0] * 32,
             "position_ids": list(range(32))} for i in range(8)]
    run_ = types.SimpleNamespace(cfg=cfg, device=torch.device("cpu"))
    order, sched = [5, 2, 7, 0, 1, 3, 4, 6], make_schedule(cfg, len(rows), 1, 0)
    drafter_cfg = types.SimpleNamespace(block_size=4, mask_token_id=0)
    epochs = [draw_step(run_, rows, order, LoopState(epoch=e, step_in_epoch=1), sched, drafter_cfg) for e in (0, 1)]
    assert [m.rows for m in epochs[0]] == [m.rows for m in epochs[1]] == [[1, 3], [4, 6]]
    assert any(not torch.equal(a.blocks.anchors, b.blocks.anchors) for a, b in zip(*epochs))


def test_files_a_run_writes_are_readable_by_the_group_under_the_usual_umask(tiny, tmp_path):
    """safetensors writes through a private temp file: the weights of every checkpoint and of final/ came out 0600,
    while the rest of the run (and every export) is 0644 under umask 022."""
    import os
    import stat

    umask = os.umask(0o022)
    try:
        run(tmp_path, *tiny, *FAST, "train.max_steps=1", "eval.batches=1")
    finally:
        os.umask(umask)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")
             if p.is_file() and p.name != ".draftsmith.lock"}
    assert "final/drafter/model.safetensors" in modes and "checkpoints/step_1/state/model.safetensors" in modes
    assert {f: oct(m) for f, m in modes.items() if m != 0o644} == {}
    target = Path(tiny[0].split("=", 1)[1])  # the tiny target training builds (recipe=tiny), under this umask
    assert stat.S_IMODE((target / "model.safetensors").stat().st_mode) == 0o666 & ~umask


def test_the_default_output_folders_are_git_ignored():
    """A first run from a checkout left exports/ and validate-report/ (validate's default --out) as untracked
    folders next to the code; runs/ (training's default out_dir) already was ignored."""
    from inference.validate import parse_args
    from train.config import RunConfig

    ignored = set((Path(__file__).parents[2] / ".gitignore").read_text().split())
    assert RunConfig().out_dir.split("/")[0] + "/" in ignored
    assert parse_args(["--target", "t", "--draft", "d"]).out + "/" in ignored
    assert "exports/" in ignored  # the folder every export example in the README and docs writes to


def test_processes_stop_for_a_sigterm_after_the_same_step():
    """A SIGTERM reaches each process at its own moment: they stop after the step at whose start any of them had
    one (the flag rides the step's collective), or after an eval by one collective of their own; one process
    decides alone, and outside the loop a SIGTERM stops at once as Ctrl-C does."""
    from train.interrupt import Preempted, StopRequest
    from train.loop import Run, StepStats, stop_due

    class TwoProcesses:
        num_processes, device = 2, torch.device("cpu")

        def __init__(self, other_signalled):
            self.other = other_signalled

        def reduce(self, t, op):
            return t + float(self.other)

    zero = torch.zeros(())
    for other in (False, True):
        run = Run(None, TwoProcesses(other), Path("run"), "", "no", print)
        assert stop_due(run, StepStats(zero, zero, zero, stop=other)) is other
        assert stop_due(run) is other  # after an eval: this process had none, the other one maybe
    alone = Run(None, types.SimpleNamespace(num_processes=1), Path("run"), "", "no", print)
    assert not stop_due(alone)
    stop = StopRequest()
    stop.deferring = True
    stop.handle(15, None)  # noted, acted on at the end of the step
    assert stop.signalled
    with pytest.raises(Preempted) as e:
        stop.handle(15, None)  # a second one: at once
    assert e.value.exit_status == 143 and isinstance(e.value, KeyboardInterrupt)
    with pytest.raises(Preempted):
        StopRequest().handle(15, None)  # before the loop: at once
