"""Bad inputs a user makes at this stage, each ending in a clear error (or a correct rebuild), never silently.

Part of the bad-input table: ``pytest -m bad_input`` runs every stage's cases.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.bad_input import _DATA_FIX

pytestmark = pytest.mark.bad_input


def stand_in_small_target(folder, chats: int | None = 3, prompts: int | None = 16):
    """A folder with the small target's stamp, chats.jsonl and prompts.jsonl (None: left out), no model:
    enough for the ablation's checks that come before any model is loaded."""
    from lab.small_target import STAMP_FILE

    folder.mkdir()
    (folder / STAMP_FILE).write_text("{}")
    for name, n in (("chats.jsonl", chats), ("prompts.jsonl", prompts)):
        if n is not None:
            (folder / name).write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * n)
    return folder


def test_ablation_cell_name_that_does_not_exist():
    from lab.ablate import main

    with pytest.raises(ValueError, match="unknown cell 'loss=kll'; did you mean 'loss=kl'"):
        main(["--grid", "paper,loss=kll"])


def test_ablation_budget_larger_than_the_chats_of_the_target(tmp_path):
    from lab.ablate import main

    target = stand_in_small_target(tmp_path / "target")
    with pytest.raises(ValueError, match="has 3 conversations, the budget needs 10: use fewer --steps"):
        main(["--grid", "paper", "--steps", "10", "--target", str(target), "--out", str(tmp_path / "abl")])


def test_ablation_target_folder_not_from_small_target(tmp_path):
    from lab.ablate import main

    target = stand_in_small_target(tmp_path / "target", chats=None, prompts=None)
    with pytest.raises(FileNotFoundError, match="chats.jsonl not found: the target folder must come from"):
        main(["--grid", "paper", "--target", str(target), "--out", str(tmp_path / "abl")])


def test_ablation_cell_named_twice_in_the_grid_runs_once(tmp_path, monkeypatch):
    """--grid gamma=1,lr=2e-3,gamma=1 queued gamma=1's runs twice: with --workers 2, two processes trained into
    the same folder at once."""
    import lab.ablate as ab

    target = stand_in_small_target(tmp_path / "target")
    queued = []
    monkeypatch.setattr(ab, "prepare_data", lambda variant, t, out, **k: ab.variant_folder(variant, out, 3))
    monkeypatch.setattr(ab, "run_all", lambda todo, *a: queued.extend(todo))
    ab.main(["--grid", "gamma=1,lr=2e-3,gamma=1", "--steps", "3", "--seeds", "1", "--workers", "2",
             "--target", str(target), "--out", str(tmp_path / "abl")])
    assert [p.parent.name for p in queued] == ["paper", "gamma=1", "lr=2e-3"]


def test_ablation_target_that_does_not_exist_is_not_built(tmp_path, monkeypatch):
    """A mistyped --target started a ~45-minute build of a new small target there; as lab.quant_experiment,
    only the default folder is built when missing."""
    import lab.small_target
    from lab.ablate import main

    def build(*a, **k):
        raise AssertionError("built a small target")

    monkeypatch.setattr(lab.small_target, "build_small_target", build)
    with pytest.raises(FileNotFoundError, match="--target .*typo is not a small target .*leave --target out"):
        main(["--grid", "paper", "--target", str(tmp_path / "typo"), "--out", str(tmp_path / "abl")])
    assert list(tmp_path.iterdir()) == []


def test_ablation_asking_for_more_prompts_than_the_target_holds(tmp_path):
    """The table once said "true tau on 16 held-out prompts" when the target had 2."""
    from lab.ablate import main

    target = stand_in_small_target(tmp_path / "target", prompts=2)
    with pytest.raises(ValueError, match="--prompts 16 but .*prompts.jsonl holds 2 held-out prompts: use --prompts 2"):
        main(["--grid", "paper", "--target", str(target), "--out", str(tmp_path / "abl")])
    # A blank line counted as a prompt, and a cut last line was a bare JSONDecodeError after every cell trained
    with (target / "prompts.jsonl").open("a") as f:
        f.write('\n{"messages": [{"role": "user", "content": "hi"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl line 4 is not JSON"):
        main(["--grid", "paper", "--target", str(target), "--out", str(tmp_path / "abl"), "--prompts", "3"])


@pytest.mark.parametrize("key", ["target_key", "code_key"])
def test_ablation_run_of_a_rebuilt_target_or_by_other_code_is_trained_again(tmp_path, monkeypatch, key):
    """A finished training (trained.json, same argv) was reused after the target was rebuilt: its argv
    names the target's folder, not its build, so the old drafter was evaluated and labelled as new. The
    same for a training finished before the code changed: not reused for an evaluation now."""

    import train.distill
    from lab.ablate import run_one

    class Trained(Exception):
        pass

    def distill(argv):
        raise Trained

    monkeypatch.setattr(train.distill, "main", distill)
    run_dir = tmp_path / "paper" / "seed0"
    run_dir.mkdir(parents=True)
    spec = {"run_dir": str(run_dir), "argv": ["train.max_steps=8"], "target_key": "t", "code_key": "c"}
    (run_dir / "spec.json").write_text(json.dumps({**spec, key: "new"}))
    (run_dir / "trained.json").write_text(json.dumps({**spec, key: "old"}))
    with pytest.raises(Trained):
        run_one(run_dir / "spec.json")


def test_ablation_table_marks_runs_of_other_code():
    """Results of two code versions in one table, unmarked, read as one experiment; now the cell says so."""
    from lab.ablate import summarize

    run = lambda tau, code: {"tau_pooled": tau, "tau_per_prompt": tau, "code_key": code}  # noqa: E731
    table, rows = summarize({"paper": [run(1.0, "now"), run(1.2, "now")], "gamma=1": [run(1.5, "now"), run(1.3, None)]},
                            "budget", code="now")
    assert "| paper | 1.100 +/- 0.200 | +0.0% |" in table
    assert "| gamma=1 (other code) | 1.400 +/- 0.200 | +27.3% |" in table
    assert [r["other_code_runs"] for r in rows] == [0, 1]
    assert table.splitlines()[-1].startswith("(other code): 1 run(s) were trained and evaluated by another version")
    assert "--rerun-other-code" in table
    clean, _ = summarize({"paper": [run(1.0, "now")]}, "budget", code="now")
    assert "other code" not in clean


def test_ablation_finished_run_of_other_code_counts_unless_asked(tmp_path):

    from lab.ablate import finished

    spec = {"argv": ["x"], "prompts": 2, "max_new_tokens": 8, "target_key": "t", "data_key": "d", "code_key": "now"}
    (tmp_path / "result.json").write_text(json.dumps({**spec, "code_key": "before"}))
    assert finished(tmp_path, spec) and not finished(tmp_path, spec, same_code=True)
    (tmp_path / "result.json").write_text(json.dumps(spec))
    assert finished(tmp_path, spec, same_code=True)


def test_ablation_result_or_training_record_cut_by_a_kill_runs_that_run_again(tmp_path, monkeypatch):
    """A result.json cut short by a kill stopped every rerun (--table-only too) with a bare JSON error naming no
    file; a cut trained.json failed the run the same way on each retry."""

    import train.distill
    from lab.ablate import finished, main, run_one

    target = stand_in_small_target(tmp_path / "target")
    run_dir = tmp_path / "abl" / "paper" / "seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text('{"tau_pooled": 1.2, "ar')
    assert not finished(run_dir, {"argv": ["x"]})
    assert main(["--table-only", "--steps", "3", "--target", str(target), "--out", str(tmp_path / "abl")])["rows"] == []

    class Trained(Exception):
        pass

    def distill(argv):
        raise Trained

    monkeypatch.setattr(train.distill, "main", distill)
    (run_dir / "spec.json").write_text(json.dumps({"run_dir": str(run_dir), "argv": ["train.max_steps=8"]}))
    (run_dir / "trained.json").write_text('{"argv": ["train.max')
    with pytest.raises(Trained):  # trained again, not a JSON error
        run_one(run_dir / "spec.json")


def test_ablation_code_key_follows_the_source(tmp_path):
    from lab.ablate import code_key

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "loop.py").write_text("lr = 1\n")
    (tmp_path / "train" / "notes.txt").write_text("not code")
    before = code_key(tmp_path)
    assert code_key(tmp_path) == before and len(before) == 16
    (tmp_path / "train" / "notes.txt").write_text("changed, still not code")
    assert code_key(tmp_path) == before
    (tmp_path / "train" / "loop.py").write_text("lr = 2\n")
    assert code_key(tmp_path) != before
    assert code_key() != before  # the real package


def test_ablation_table_only_builds_nothing_and_keeps_the_table(tmp_path):
    """--table-only ("run nothing") once built a missing target (16 min), prepared data and replaced
    table.md with an empty table when no run matched its flags."""
    from lab.ablate import main

    out = tmp_path / "abl"
    with pytest.raises(FileNotFoundError, match="--table-only: .*nosuch is not a small target"):
        main(["--table-only", "--target", str(tmp_path / "nosuch"), "--out", str(out)])
    assert not (tmp_path / "nosuch").exists() and not out.exists()
    target = stand_in_small_target(tmp_path / "target")
    out.mkdir()
    (out / "table.md").write_text("the table of earlier runs\n")
    assert main(["--table-only", "--steps", "9", "--target", str(target), "--out", str(out)])["rows"] == []
    assert (out / "table.md").read_text() == "the table of earlier runs\n"
    assert sorted(p.name for p in out.iterdir()) == ["table.md"]  # no data variant, no run folder


def test_ablation_and_small_target_out_naming_a_file(tmp_path):
    """--out naming a file once ended in a bare "[Errno 17] File exists"."""
    from lab.ablate import main
    from lab.small_target import build_small_target

    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="--out .*f is a file: give a folder"):
        main(["--grid", "paper", "--out", str(tmp_path / "f"), "--target", str(tmp_path / "t")])
    with pytest.raises(NotADirectoryError, match="f is a file: the small target needs a folder"):
        build_small_target(tmp_path / "f", steps=1)


def test_small_target_refuses_to_build_over_another_folder(tmp_path):
    """--target / --out naming an existing model folder once had it overwritten by a small target."""
    from lab.small_target import build_small_target

    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="my-model exists and is not a small target .*Pick another folder"):
        build_small_target(folder, steps=1)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]


def test_ablation_on_cuda_without_a_gpu(monkeypatch):

    from lab.ablate import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda but torch sees no CUDA device"):
        main(["--grid", "paper", "--device", "cuda"])


@pytest.mark.parametrize("argv, message", [
    (["--corpus", "/nonexistent/corpus"], "corpus folder /nonexistent/corpus not found"),
    (["--hidden", "66"], "--hidden must be a multiple of 4"),
    (["--vocab", "100"], "--vocab must be >= 300"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--lr", "0"], "--lr 0.0: use a positive learning rate"),  # fitted nothing, then warned the target loops
    (["--lr=-1e-3"], "--lr -0.001: use a positive learning rate"),  # torch's error after the tokenizer trained
    (["--lr", "nan"], "--lr nan: use a positive learning rate"),
    (["--seq-len", "3000"], "--seq-len 3000 is longer than the target's 2048 positions"),
    (["--corpus", str(_DATA_FIX)], "usable .py files"),  # a folder without enough sources: once an IndexError
])
def test_small_target_bad_settings(tmp_path, argv, message):
    from lab.small_target import main

    with pytest.raises((ValueError, FileNotFoundError), match=message):
        main(["--out", str(tmp_path / "t"), *argv])


def test_quant_experiment_refuses_a_negative_seed_before_any_work(tmp_path, capsys):
    """--seed -1 was refused by train.seed only after the small target and the first drafter were built."""
    from lab.quant_experiment import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "out"), "--budget", "smoke", "--seed", "-1"])
    assert "--seed must be in [0, 2**32)" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, said", [
    (["--loss-threshold", "10"], "--loss-threshold 10.0 is a share of tau"),  # never met: the narrowest width
    (["--loss-threshold", "0"], "--loss-threshold 0.0 is a share of tau"),  # always met: the widest
    (["--bits", "0"], "--sweep/--bits: 0 bits is not an MLX affine width"),  # ignored: the sweep chose
    (["--corpus", "src", "--target", "runs/small-target"], "--corpus builds the small target"),  # ignored
    (["--out", "FILE"], "--out FILE is a file: give a folder"),  # a bare "[Errno 17] File exists"
])
def test_quant_experiment_misread_or_ignored_flags_and_an_out_file_are_refused_first(tmp_path, monkeypatch, capsys,
                                                                                     argv, said):
    import lab.quant_experiment as qx
    import lab.small_target

    monkeypatch.setattr(lab.small_target, "build_small_target", lambda *a, **k: pytest.fail("the experiment ran"))
    (tmp_path / "FILE").write_text("x")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    with pytest.raises((SystemExit, ValueError, OSError)) as e:
        qx.main(["--out", str(tmp_path / "out"), *argv])
    assert said.replace("FILE", str(tmp_path / "FILE")) in (str(e.value) + capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_quant_experiment_drafter_trained_against_another_target_build_group_or_budget_is_trained_again(
        tmp_path, monkeypatch):
    """The cached drafter's folder is named by bits, epochs and seed only: one trained against an earlier build
    of the target, a quantized folder of another group size, or another budget of the same epochs was reused
    and its tau reported as this run's."""
    import shutil

    import train.distill
    from lab.quant_experiment import train_drafter
    from lab.small_target import STAMP_FILE

    run, target, calls, said = tmp_path / "drafter-mlx-3bit-e3-s0", tmp_path / "target", [], []

    def distill(argv):
        calls.append(argv)
        (run / "final" / "drafter").mkdir(parents=True, exist_ok=True)
        (run / "final" / "drafter" / "config.json").write_text("{}")

    monkeypatch.setattr(train.distill, "main", distill)
    target.mkdir()
    budget, q64 = {"train": {"train.epochs": 3, "data.limit": 80}}, f"mlx:{tmp_path / 'target-mlx-3bit-g64'}"
    changes = {"rebuilt target": (q64, budget), "group size": (f"mlx:{tmp_path / 'target-mlx-3bit-g32'}", budget),
               "budget": (q64, {"train": {"train.epochs": 3, "data.limit": 160}})}
    for what, (quantization, other_budget) in changes.items():
        shutil.rmtree(run, ignore_errors=True)
        (target / STAMP_FILE).write_text(json.dumps({"spec": {"steps": 600}}))
        train_drafter(run, target, q64, budget, 0, said.append)
        train_drafter(run, target, q64, budget, 0, said.append)
        assert len(calls) == 1, what  # the same: reused
        if what == "rebuilt target":
            (target / STAMP_FILE).write_text(json.dumps({"spec": {"steps": 40}}))
        train_drafter(run, target, quantization, other_budget, 0, said.append)
        assert len(calls) == 2, what
        assert "trained against another target build or budget" in said[-2] and "from the start" in said[-2], what
        calls.clear()


def test_quant_experiment_report_of_another_group_size_or_budget_is_kept_not_overwritten(tmp_path, monkeypatch):
    """report-<bits>bit-e<epochs>-s<seed>.json names neither the group size nor the budget: a rerun at another
    --group-size (or a budget of the same epochs) overwrote the earlier run's only record of its four taus."""

    import models.quantize
    import lab.quant_experiment as qx
    import lab.small_target

    target = stand_in_small_target(tmp_path / "target")
    monkeypatch.setattr(models.quantize, "quantize_to_mlx", lambda t, folder, **k: folder)
    monkeypatch.setattr(lab.small_target, "small_target_prompt_ids", lambda t, n: [[1, 2]] * n)
    monkeypatch.setattr(qx, "train_drafter", lambda out_dir, *a, **k: out_dir)
    monkeypatch.setattr(qx, "measure_tau", lambda t, d, p, n: {"tau": 2.0 if "g64" in str(t) else 1.5})
    out, name = tmp_path / "qx", "report-3bit-e3-s0.json"
    run = lambda group: qx.run(out, "smoke", sweep_bits=(3,), bits=3, group_size=group,  # noqa: E731
                               target_dir=str(target), log=lambda *_: None)
    run(64)
    run(64)  # the same settings: measured again in place
    assert not (out / f"{name}.old").exists()
    run(32)
    assert json.loads((out / f"{name}.old").read_text())["group_size"] == 64
    assert json.loads((out / name).read_text())["group_size"] == 32


def test_quant_experiment_refuses_a_target_that_loops(tmp_path):
    """Four taus measured on a target whose greedy output is a loop say nothing: stop before any work."""

    from lab.quant_experiment import run

    target = tmp_path / "target"
    target.mkdir()
    (target / "chats.jsonl").write_text("")
    (target / "prompts.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (target / "small_target.json").write_text(json.dumps({"greedy_check": {"distinct_3gram": 0.0685,
                                                                          "distinct_outputs": 0.5}}))
    with pytest.raises(ValueError, match="does not talk: .*distinct-3-gram ratio 0.0685 .*fit it longer"):
        run(tmp_path / "out", "test", sweep_bits=(3,), bits=3, target_dir=str(target), log=lambda *_: None)
    assert not list((tmp_path / "out").glob("target-mlx-*"))

    with pytest.raises(FileNotFoundError, match="is not a small-target folder"):  # a path typed wrong
        run(tmp_path / "out2", "test", target_dir=str(tmp_path / "typo"), log=lambda *_: None)
    assert not (tmp_path / "out2").exists()  # and no empty experiment folder left behind


@pytest.mark.parametrize("prompts, said", [
    ("", "holds no prompts: tau is measured on them"),  # a ZeroDivisionError after drafter A had trained
    ("\n  \n", "holds no prompts"),
    ('{"messages": [{"role": "user"\n', "line 1 is not JSON"),
    ('{"text": "hi"}\n', 'line 1 has no "messages" turns'),
])
def test_quant_experiment_target_without_usable_prompts_is_refused_before_any_work(tmp_path, monkeypatch, prompts,
                                                                                   said):
    import models.quantize
    from lab.quant_experiment import run

    monkeypatch.setattr(models.quantize, "quantize_to_mlx", lambda *a, **k: pytest.fail("the experiment ran"))
    target = tmp_path / "target"
    target.mkdir()
    (target / "chats.jsonl").write_text("")
    (target / "prompts.jsonl").write_text(prompts)
    with pytest.raises(ValueError, match=said):
        run(tmp_path / "out", "smoke", sweep_bits=(3,), bits=3, target_dir=str(target), log=lambda *_: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, said", [
    (["64,64,64,64,2,4", "64,64"], "flex backward setting '64,64'"),
    (["auto"], "auto is not a candidate: give tiles"),
    (["--heads", "8"], "--heads with --e2e: the attention takes the recipe target's shape"),
    (["--head-dim", "15"], "--head-dim 15: use an even size"),
    (["--steps", "0"], "--steps 0: use 1 or more"),
])
def test_flex_sweep_refuses_bad_tiles_and_flags_before_building(capsys, no_build, argv, said):
    from lab.flex_sweep import main

    with pytest.raises(SystemExit) as e:
        main(["--e2e", "qwen35-9b", *argv])
    assert e.value.code == 2 and said in capsys.readouterr().err.strip().splitlines()[-1]


def test_flex_sweep_unknown_recipe_is_one_line(no_build):
    from lab.flex_sweep import main

    with pytest.raises(ValueError, match="no recipe 'qwen9'"):
        main(["--e2e", "qwen9"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_flex_sweep_without_a_gpu_says_it_needs_one(no_build):
    from lab.flex_sweep import main

    with pytest.raises(ValueError, match="lab.flex_sweep times compiled flex attention kernels: it needs a CUDA GPU"):
        main(["--e2e", "qwen35-9b"])
