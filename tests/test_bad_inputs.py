"""Bad inputs a user actually makes, each ending in a clear error (or a correct rebuild), never silently.

One module so none of them regresses. Each section belongs to one part of the pipeline; a case is
a plain test function (or a parametrized table) named after the mistake it guards against.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest  # noqa: F401  (used by the sections below)
from conftest import tiny_store_rows

# ---------------------------------------------------------------- config, resume, data re-use (train/, data/)
# data re-use and preparation (data/reuse.py, data/prepare.py, data/regenerate.py, models/cli.py)
_DATA_FIX = __import__("pathlib").Path(__file__).parent / "fixtures" / "data"


@pytest.fixture(scope="module")
def data_target(tmp_path_factory):
    from models.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("reuse") / "target", "qwen3", num_layers=2)


def test_prepared_folder_that_is_not_prepared_data_is_never_written_into(data_target, tmp_path):
    from data.prepare import prepare
    from data.reuse import NotPreparedFolder

    drafter = tmp_path / "my-drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    with pytest.raises(NotPreparedFolder, match="not empty and is not a prepared-data folder"):
        prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), drafter, progress=False, reuse=True)
    assert sorted(p.name for p in drafter.iterdir()) == ["config.json"]  # untouched


def test_a_prepared_folder_whose_record_is_unreadable_is_named_and_rebuilt_on_request(tmp_path):
    """A draftsmith_data.json cut short or broken by hand was refused as "not a prepared-data folder (no
    draftsmith_data.json)", naming a file that is there and offering no way to rebuild the folder."""
    import json

    from data.reuse import (META_FILE, PARTIAL_FILE, REGEN_FILE, DataMismatch, claim_folder, reusable,
                            row_settings)

    wanted = row_settings(source=str(_DATA_FIX / "openai.jsonl"), split="train", subset=None, limit=None,
                          regenerate="local", thinking=None, max_length=None, pack=False, tokenizer_hash="t")
    out = tmp_path / "data"
    out.mkdir()
    (out / META_FILE).write_text(json.dumps(wanted)[:40])
    (out / REGEN_FILE).write_text('{"key": "k"}\n')
    (out / "data-00000-of-00001.arrow").write_text("rows")
    assert not reusable(out, wanted)
    with pytest.raises(DataMismatch, match=f"{META_FILE} is not readable JSON .*: rebuild it with the new settings "
                                           "\\(data.rebuild=true"):
        claim_folder(out, wanted, rebuild=False)
    claim_folder(out, wanted, rebuild=True)  # answers of unknown settings are not kept
    assert sorted(p.name for p in out.iterdir()) == [PARTIAL_FILE]


@pytest.mark.parametrize("change, named", [
    ({"source": "sharegpt.jsonl"}, "source: "), ({"max_length": 64}, "max_length: None -> 64"),
    ({"thinking": True}, "thinking: None -> True"), ({"limit": 1}, "limit: None -> 1"),
])
def test_changed_data_settings_against_a_prepared_folder_are_refused_or_rebuilt(data_target, tmp_path, change,
                                                                                  named):
    import json

    from data.prepare import prepare
    from data.reuse import DataMismatch

    out = tmp_path / "data"
    base = {"source": "openai.jsonl", "max_length": None, "thinking": None, "limit": None}
    run = lambda s, **kw: prepare(str(data_target), str(_DATA_FIX / s["source"]), out, max_length=s["max_length"],
                                  thinking=s["thinking"], limit=s["limit"], progress=False, reuse=True, **kw)
    first = run(base)
    assert run(base) == first  # same settings: re-used as it is
    new = {**base, **change}
    with pytest.raises(DataMismatch, match=f"other settings \\(.*{named}.*data.rebuild=true"):
        run(new)
    run(new, rebuild=True)
    meta = json.loads((out / "draftsmith_data.json").read_text())
    assert meta["source"].endswith(new["source"])
    keys = ("max_length", "thinking", "limit")
    assert [meta[k] for k in keys] == [new[k] for k in keys]
    assert run(new) == json.loads((out / "stats.json").read_text())  # and re-used from then on


def test_changed_settings_under_out_dir_data_are_refused_by_training(data_target, tmp_path):
    from data.prepare import ensure_prepared
    from data.reuse import DataMismatch

    out = tmp_path / "run" / "data"
    ensure_prepared(str(data_target), str(_DATA_FIX / "openai.jsonl"), out, progress=False, log=lambda *_: None)
    with pytest.raises(DataMismatch, match="source: .*openai.jsonl.* -> .*alpaca.jsonl"):
        ensure_prepared(str(data_target), str(_DATA_FIX / "alpaca.jsonl"), out, progress=False, log=lambda *_: None)
    warned = []  # a folder the user named is used as it is, with a warning naming the difference
    ensure_prepared(str(data_target), str(_DATA_FIX / "alpaca.jsonl"), out, explicit=True, progress=False,
                    log=warned.append)
    assert "alpaca.jsonl" in warned[0] and "using it as it is" in warned[0]


def test_a_named_folder_is_used_as_prepared_unless_rebuilt_and_an_empty_source_takes_it_as_it_is(data_target,
                                                                                                  tmp_path):
    """data.prepared=DIR: a thinking switch the recipe leaves unset is not checked when the rows load, so its
    difference is warned about with the others; data.rebuild=true rebuilds the folder from the recipe; an
    empty data.source trains on whatever folder is there."""
    import json

    from data.prepare import ensure_prepared

    out = tmp_path / "named"
    quiet = dict(progress=False, log=lambda *_: None)
    ensure_prepared(str(data_target), str(_DATA_FIX / "openai.jsonl"), out, thinking=True, **quiet)
    warned = []
    ensure_prepared(str(data_target), str(_DATA_FIX / "openai.jsonl"), out, explicit=True, progress=False,
                    log=warned.append)
    assert len(warned) == 1 and "thinking: True -> None" in warned[0]
    ensure_prepared(str(data_target), "", out, **quiet)  # no source: the folder there is the data
    ensure_prepared(str(data_target), str(_DATA_FIX / "alpaca.jsonl"), out, explicit=True, rebuild=True, **quiet)
    meta = json.loads((out / "draftsmith_data.json").read_text())
    assert meta["source"].endswith("alpaca.jsonl") and meta["thinking"] is None


def test_regenerate_none_is_no_regeneration_and_a_rerun_of_the_cli_rebuilds(data_target, tmp_path):
    """"none" (the training key's off value) must not reach the regeneration step; python -m data.prepare run
    again with the same settings rebuilds the folder (a damaged one too), while training re-uses it as it is.
    A finished folder keeps no partial marker."""
    from datasets import load_from_disk

    from data.prepare import prepare
    from data.reuse import PARTIAL_FILE

    out = tmp_path / "data"
    run = lambda **kw: prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), out, regenerate="none",
                               progress=False, log=lambda *_: None, **kw)
    first = run()
    assert "regenerate" not in first and first["rows"] == len(load_from_disk(str(out))) > 0
    assert not (out / PARTIAL_FILE).exists()
    for shard in out.glob("data-*-of-*.arrow"):
        shard.unlink()
    assert run(reuse=True) == first and not list(out.glob("data-*.arrow"))  # training: taken as it is
    assert run() == first and len(load_from_disk(str(out))) == first["rows"]  # the CLI: rebuilt


def test_answers_regenerated_through_a_server_are_not_checked_against_the_training_target(tmp_path):
    """A server records no fingerprint of the weights it served: such answers are taken for any target (only
    answers regenerated in-process name the target, and its quantization, that made them)."""
    from types import SimpleNamespace

    from data.prepare import check_regenerated_by
    from data.reuse import DataMismatch

    target = SimpleNamespace(identity={"target": "t", "target_revision": None, "target_fingerprint": "f" * 16},
                             quantization="none")
    check_regenerated_by({"regenerated": True, "regenerate": "server"}, target, tmp_path)
    with pytest.raises(DataMismatch, match="quantization mlx-4bit"):
        check_regenerated_by({"regenerated": True, "regenerated_by_fingerprint": "f" * 16,
                              "regenerated_by_quantization": "mlx-4bit"}, target, tmp_path)


def test_local_regeneration_names_and_loads_the_target_training_holds(data_target, tmp_path, monkeypatch):
    """The settings name the loaded target's own fingerprint and quantization (not the folder it was read
    from); a target holding only its embedding and head (an offline run) is loaded whole to answer, in its
    dtype and on its device."""
    from types import SimpleNamespace

    import torch

    from data.prepare import prepare, wanted_settings
    from models.target import TargetModel

    held = SimpleNamespace(identity={"target": "q", "target_revision": None, "target_fingerprint": "0123456789abcdef"},
                           quantization="mlx-4bit-g32")
    _, wanted = wanted_settings(str(data_target), "src", regenerate="local", thinking=None, max_length=None,
                                pack=False, limit=None, split="train", subset=None, gen_kwargs={}, target_model=held)
    assert wanted["answers_by"] == "0123456789abcdef (quantization mlx-4bit-g32)"
    headless = TargetModel.borrowed_parts(data_target, dtype=torch.float32)
    assert not headless.has_layers
    loads, load = [], TargetModel.from_pretrained
    monkeypatch.setattr(TargetModel, "from_pretrained",
                        classmethod(lambda cls, path, **kw: loads.append(kw) or load(path, **kw)))
    stats = prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), tmp_path / "data", regenerate="local",
                    progress=False, log=lambda *_: None, gen_kwargs={"max_tokens": 4}, target_model=headless)
    assert loads == [{"dtype": torch.float32, "device": headless.device}] and stats["regenerate"]["done"] == 3


def test_a_moved_or_touched_source_is_recognised_by_content_and_an_edited_one_is_refused(data_target, tmp_path):
    """Size and mtime alone once refused a run folder moved elsewhere (the tiny recipe's source lives in it)."""
    import os
    import shutil

    from data.prepare import ensure_prepared
    from data.reuse import DataMismatch

    src = tmp_path / "a" / "chats.jsonl"
    src.parent.mkdir()
    shutil.copy(_DATA_FIX / "openai.jsonl", src)
    out = tmp_path / "run" / "data"
    check = lambda source: ensure_prepared(str(data_target), str(source), out, progress=False, log=lambda *_: None)
    check(src)
    stats = (out / "stats.json").read_text()
    moved = tmp_path / "b" / "chats.jsonl"
    moved.parent.mkdir()
    shutil.copy(src, moved)  # another path, another mtime, the same bytes
    os.utime(src, ns=(1, 1))  # and the original touched
    for same in (moved, src):
        check(same)
        assert (out / "stats.json").read_text() == stats  # re-used, not rebuilt
    src.write_text(src.read_text().replace("a", "b", 1))
    with pytest.raises(DataMismatch, match="source .*chats.jsonl' changed since it was prepared \\(its content "
                                           "differs\\).*data.rebuild=true"):
        check(src)


def test_answers_regenerated_by_another_target_are_not_reused_under_its_name(data_target, tmp_path):
    """data.prepare with local regeneration into a folder another target regenerated once found every answer
    "already done" and recorded the new target as their author (training then accepted them)."""
    import json

    from data.prepare import prepare
    from data.reuse import DataMismatch
    from models.tiny import save_tiny_target

    other = save_tiny_target(tmp_path / "other", "qwen3", num_layers=2, seed=1)  # same shapes and tokenizer
    out = tmp_path / "data"
    run = lambda target, **kw: prepare(str(target), str(_DATA_FIX / "openai.jsonl"), out, regenerate="local",
                                       progress=False, reuse=True, gen_kwargs={"max_tokens": 4}, **kw)
    run(data_target)
    assert run(data_target)["regenerate"]["done"] > 0  # the same target: re-used as it is
    with pytest.raises(DataMismatch, match="other settings \\(regenerating target: .* \\(quantization none\\)' "
                                           "-> .*data.rebuild=true"):
        run(other)
    stats = run(other, rebuild=True)
    assert stats["regenerate"]["already_done"] == 0 and stats["regenerate"]["done"] > 0  # answered anew
    meta = json.loads((out / "draftsmith_data.json").read_text())
    assert meta["regenerated_by"] == str(other)


def test_data_labelled_by_an_older_draftsmith_is_relabelled_not_reused(data_target, tmp_path):
    """A folder prepared before a labelling rule changed (a cut answer's end-of-turn was labelled then) matched
    every recorded setting and trained on the old labels. Now it is refused naming the rules' version, and a
    rebuild relabels it from the answers it holds (none regenerated)."""
    import json

    from data.prepare import ensure_prepared, prepare
    from data.reuse import DataMismatch

    out = tmp_path / "run" / "data"
    kwargs = {"regenerate": "local", "gen_kwargs": {"max_tokens": 4}, "progress": False}
    first = prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), out, **kwargs)
    meta_file = out / "draftsmith_data.json"
    meta = json.loads(meta_file.read_text())
    assert meta["label_rules"] == 2
    meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k != "label_rules"}))  # as older ones wrote
    with pytest.raises(DataMismatch, match=r"labelling rules: version 1 -> 2 \(prepared by an older draftsmith.*"
                                           r"keeps the regenerated answers\).*data.rebuild=true"):
        ensure_prepared(str(data_target), str(_DATA_FIX / "openai.jsonl"), out, log=lambda *_: None, **kwargs)
    warned = []  # a folder the user named is used as it is, with the difference named
    ensure_prepared(str(data_target), str(_DATA_FIX / "openai.jsonl"), out, explicit=True, log=warned.append,
                    **kwargs)
    assert "labelling rules: version 1 -> 2" in warned[0] and "using it as it is" in warned[0]
    stats = prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), out, reuse=True, rebuild=True, **kwargs)
    done = first["regenerate"]["done"]
    assert done > 0 and stats["regenerate"]["already_done"] == done and stats["regenerate"]["done"] == 0
    assert json.loads(meta_file.read_text())["label_rules"] == 2


def test_extracting_with_another_target_than_the_one_that_answered_is_refused(data_target, tmp_path):
    """Training refuses such a store, but only after the hours of extraction; data.extract now says so first."""
    from data.extract import extract
    from data.prepare import prepare
    from data.reuse import DataMismatch
    from models.tiny import save_tiny_target

    other = save_tiny_target(tmp_path / "other", "qwen3", num_layers=2, seed=1)
    prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), tmp_path / "data", regenerate="local",
            progress=False, gen_kwargs={"max_tokens": 4})
    with pytest.raises(DataMismatch, match="holds answers regenerated by .*: prepare the data with this target, or "
                                           "pass --force-target"):
        extract(str(other), tmp_path / "data", tmp_path / "feats", layer_ids=[0], progress=False)
    assert not (tmp_path / "feats").exists()
    assert extract(str(other), tmp_path / "data", tmp_path / "feats", layer_ids=[0], progress=False,
                   force_target=True).complete


def test_a_target_that_answers_nothing_is_named_not_no_conversation_to_tokenize(data_target, tmp_path, monkeypatch):
    """A barely fitted target ends every turn at once: all answers are empty and dropped, which surfaced as
    "no conversation to tokenize"."""
    import data.regenerate
    from data.prepare import prepare

    eos_first = lambda target, prompts, *a, **kw: [([], True)] * len(prompts)
    monkeypatch.setattr(data.regenerate, "generate_batch", eos_first)
    with pytest.raises(ValueError, match="no regenerated answer is usable \\(read 3 rows: kept 0 .*\\): the target "
                                         "answered every prompt with nothing .*regenerated.jsonl"):
        prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), tmp_path / "data", regenerate="local",
                progress=False, gen_kwargs={"max_tokens": 4})


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


def test_prompts_only_data_is_refused_without_regeneration_and_used_with_it(data_target, tmp_path):
    import json

    from data.prepare import prepare
    from data.readers import NoUsableRows

    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "Name a colour."}, {"messages": [{"role": "user", "content": "Count to 3"}]},
        {"instruction": "Spell cat."}]))
    with pytest.raises(NoUsableRows, match="Prompts-only data .* usable when the answers are regenerated"):
        prepare(str(data_target), str(src), tmp_path / "plain", progress=False)
    stats = prepare(str(data_target), str(src), tmp_path / "regen", regenerate="local", progress=False,
                    gen_kwargs={"max_tokens": 4, "batch_size": 3})
    assert stats["regenerate"]["done"] == 3 and stats["conversations"] == 3 and stats["loss_tokens"] > 0


def test_failed_prepare_leaves_no_empty_out_folder(data_target, tmp_path):
    from data.prepare import prepare
    from data.readers import NoUsableRows
    from data.regenerate import ServerUnavailable

    out = tmp_path / "new" / "data"
    src = tmp_path / "no_answers.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(NoUsableRows):
        prepare(str(data_target), str(src), out, progress=False)
    assert not out.exists()
    with pytest.raises(ServerUnavailable):  # nothing regenerated: nothing worth keeping
        prepare(str(data_target), str(src), out, regenerate=f"http://127.0.0.1:{_closed_port()}/v1", progress=False)
    assert not out.exists()


@pytest.mark.parametrize("module, argv, said", [
    ("prepare", ["--max-length", "-5"], "--max-length -5: use 1 or more tokens"),  # cut the last 5 tokens of every row
    ("prepare", ["--max-length", "0", "--pack"], "--max-length 0: use 1 or more tokens"),  # "--pack needs --max-length"
    ("prepare", ["--limit", "0"], "--limit 0: use 1 or more conversations"),  # "no usable conversations"
    ("regenerate", ["--limit", "-1"], "--limit -1: use 1 or more conversations"),
    ("regenerate", ["--batch-size", "0"], "--batch-size 0: use 1 or more conversations"),  # "read 0 rows"
    # each failed every conversation after the target loaded, and said to rerun to retry them
    ("regenerate", ["--max-tokens", "0"], "--max-tokens 0: use 1 or more new tokens"),
    ("prepare", ["--max-tokens", "-3"], "--max-tokens -3: use 1 or more new tokens"),
    ("regenerate", ["--concurrency", "0"], "--concurrency 0: use 1 or more conversations in flight"),
    ("regenerate", ["--retries", "-1"], "--retries -1: use 0 or more retries"),  # "AssertionError: unreachable"
    ("regenerate", ["--temperature", "-0.5"], "--temperature -0.5: use 0 for greedy"),  # in-process: greedy
    ("prepare", ["--temperature", "nan"], "--temperature nan: use 0 for greedy"),
])
def test_prepare_and_regenerate_counts_below_one_name_the_flag(module, argv, said, tmp_path, capsys):
    import importlib

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"data.{module}").main(["--target", "t", "--source", "s.jsonl", "--out", str(out),
                                                        *argv])
    assert e.value.code == 2 and said in capsys.readouterr().err
    assert not out.exists()


def test_a_max_length_below_one_is_refused_not_counted_from_the_end(data_target, tmp_path):
    """ids[:-5] kept all but the last 5 tokens of every row, without a word."""
    from data.chat import tokenize_conversation
    from data.prepare import prepare
    from models.tiny import tiny_tokenizer

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(ValueError, match="max_length=-5: use 1 or more tokens"):
        tokenize_conversation(tiny_tokenizer("chatml"), chat, max_length=-5)
    with pytest.raises(ValueError, match="max length 0: use 1 or more tokens"):  # training's data.max_length too
        prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), tmp_path / "data", max_length=0, progress=False)
    with pytest.raises(ValueError, match="--pack needs --max-length"):  # no budget to pack rows up to
        prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), tmp_path / "data", pack=True, progress=False)
    assert not (tmp_path / "data").exists()


def test_local_regeneration_takes_training_dtype_names_and_checks_the_device_first(data_target):
    """--dtype bf16 was getattr(torch, "bf16") (AttributeError), --device foo torch's RuntimeError after the
    weights loaded: data.prepare --regenerate local and data.regenerate both load through here."""
    import argparse

    import torch

    from data.regenerate import load_local_target

    flags = dict(quantization="none", device_map=None, max_memory=None, out=None)
    target = load_local_target(argparse.Namespace(**flags, dtype="bf16", device="cpu"), str(data_target))
    assert target.dtype == torch.bfloat16
    for dtype, device, said in (("auto", "foo", r"--device 'foo': use cpu, cuda \(cuda:N for another GPU\), mps or "
                                                r"auto"),
                                ("float64", "auto", "--dtype 'float64' is not a compute dtype draftsmith runs in")):
        with pytest.raises(ValueError, match=said):  # before the (missing) target is looked for
            load_local_target(argparse.Namespace(**flags, dtype=dtype, device=device), "no-such-target")


def test_a_row_that_is_not_utf8_is_skipped_counted_and_located(tmp_path):
    """One Latin-1 row aborted the whole read ("'utf-8' codec can't decode byte 0xe9 in position 4384", no
    file named), where a malformed JSON row is skipped and counted."""
    from data.readers import ReadStats, iter_conversations

    good = (_DATA_FIX / "openai.jsonl").read_bytes()
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(good + '{"messages": [{"role": "user", "content": "café"}, {"role": "assistant", "content": '
                           '"oui"}]}\n'.encode("latin-1"))
    stats = ReadStats()
    kept = list(iter_conversations(str(src), stats=stats))
    assert len(kept) == len(good.splitlines()) and stats.skipped == {"not UTF-8 text": 1}
    assert f"1 not UTF-8 text (first: {src} line {len(good.splitlines()) + 1})" in stats.summary()
    doc = tmp_path / "doc.json"  # one document: nothing to skip, so it is named
    doc.write_bytes('[{"prompt": "café"}]'.encode("latin-1"))
    with pytest.raises(ValueError, match="doc.json is not a UTF-8 JSON document"):
        list(iter_conversations(str(doc)))


def test_items_of_a_json_file_that_are_not_objects_are_skipped_as_such(tmp_path):
    """A .json list holding strings or numbers beside the rows skipped them as "malformed turns", pointing at the
    turns of rows that have none; a .jsonl line that is not an object already said what it is."""
    import json

    from data.readers import ReadStats, iter_conversations

    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    src = tmp_path / "mixed.json"
    src.write_text(json.dumps([row, "user messages: q", 7, ["nested"], row]))
    stats = ReadStats()
    assert len(list(iter_conversations(str(src), stats=stats))) == 2
    assert dict(stats.skipped) == {"JSON that is not an object": 3}


def test_a_parquet_file_cut_short_is_named(tmp_path):
    """In a folder of Parquet shards, one cut short by an interrupted download ended the read with pyarrow's "Parquet
    magic bytes not found in footer", naming no file."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.readers import load_conversations

    rows = [json.loads(line) for line in (_DATA_FIX / "openai.jsonl").read_text().splitlines()]
    for name in ("a", "b"):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
    assert len(load_conversations(str(tmp_path))[0]) == 2 * len(rows)
    whole = (tmp_path / "b.parquet").read_bytes()
    (tmp_path / "b.parquet").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=f"{tmp_path / 'b.parquet'} is not a readable Parquet file \\(.*\\): it may "
                                         "be cut short"):
        load_conversations(str(tmp_path))


def test_a_folder_source_of_named_splits_reads_the_split_asked(tmp_path):
    """A data set downloaded as it is (train.jsonl beside test.jsonl) was read whole: --split was ignored and the
    test conversations were trained on with the training ones."""
    from data.readers import SplitNotFound, load_conversations

    train, test = (_DATA_FIX / "openai.jsonl").read_text(), (_DATA_FIX / "sharegpt.jsonl").read_text()
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train.jsonl").write_text(train)
    (tmp_path / "hub" / "test.jsonl").write_text(test)
    count = lambda **kw: load_conversations(str(tmp_path / "hub"), **kw)[1].layouts  # noqa: E731
    assert count() == {"openai": len(train.splitlines())}  # the default split, train
    assert count(split="test") == {"sharegpt": len(test.splitlines())}
    assert count(split="train+test") == {"openai": len(train.splitlines()), "sharegpt": len(test.splitlines())}
    with pytest.raises(SplitNotFound, match=r"split 'validation' not in .*hub \(its files hold splits \['test', "
                                            r"'train'\]"):
        count(split="validation")
    (tmp_path / "mine").mkdir()  # files that name no split: the folder is read whole, whatever the split
    (tmp_path / "mine" / "a.jsonl").write_text(train)
    (tmp_path / "mine" / "b.jsonl").write_text(test)
    assert load_conversations(str(tmp_path / "mine"), split="test")[1].kept == len((train + test).splitlines())


def test_a_drafter_folder_as_the_data_target_is_named(tmp_path):
    """Its tokenizer has no chat template, so this surfaced as "no row has loss tokens after tokenization"."""
    import json

    from data.prepare import prepare

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "model_type": "qwen3"}))
    with pytest.raises(ValueError, match="--target .*drafter is a DFlash drafter .*not a target model"):
        prepare(str(drafter), str(_DATA_FIX / "openai.jsonl"), tmp_path / "data", progress=False)
    assert not (tmp_path / "data").exists()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_regeneration_without_a_server_fails_at_once_with_the_command_to_start_one():
    from data.regenerate import ServerUnavailable, make_generator

    port = _closed_port()
    with pytest.raises(ServerUnavailable) as e:  # no retry loop: one request
        make_generator(f"http://127.0.0.1:{port}/v1", model="Qwen/Qwen3-8B", retries=5, backoff=30.0)
    message = str(e.value)
    assert "\n" not in message and f"vllm serve Qwen/Qwen3-8B --port {port}`" in message  # the URL's port
    assert "sglang.launch_server --model-path Qwen/Qwen3-8B" in message and "local" in message


def test_regeneration_server_serving_another_model_is_refused(data_target):
    from data.regenerate import HTTPGenerator, ServerUnavailable
    from data.serve import start_server
    from models.target import TargetModel

    srv, url = start_server(TargetModel.from_pretrained(data_target), model_name="/models/Qwen3-8B")
    try:
        with pytest.raises(ServerUnavailable, match="serves \\['/models/Qwen3-8B'\\], not the target 'Llama-3-8B'"):
            HTTPGenerator(url, "Llama-3-8B").preflight()
        gen = HTTPGenerator(url, "Qwen/Qwen3-8B")
        with pytest.warns(UserWarning, match="same name, other path"):
            gen.preflight()
        assert gen.model == "/models/Qwen3-8B"
    finally:
        srv.shutdown()


# regeneration against a server that misbehaves, and resume with other settings (data/regen_http.py,
# data/regenerate.py, data/chat.py, data/prepare.py)
_GOOD = {"choices": [{"message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop",
                      "token_ids": [1, 2]}], "usage": {"completion_tokens": 2}}


def _fake_server(replies, models=None):
    """An OpenAI-compatible server answering /v1/models with ``models`` (default: model "m") and each chat
    request with the next of ``replies`` (an int: that HTTP error; bytes or a JSON value: a 200 with that body;
    the last one repeats); returns (server, url, requests list)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    requests = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, body: bytes):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(json.dumps({"data": [{"id": "m"}]} if models is None else models).encode())

        def do_POST(self):
            requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            reply = replies[min(len(requests), len(replies)) - 1]
            if isinstance(reply, int):
                return self.send_error(reply)
            self._send(reply if isinstance(reply, bytes) else json.dumps(reply).encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/v1", requests


_ONE_CONV = [{"id": "0", "key": "k0", "messages": [{"role": "user", "content": "hi"},
                                                   {"role": "assistant", "content": "old"}]}]


@pytest.mark.parametrize("garbage, quoted", [
    (b'{"choices": [{"message": {"content": "cut', "not JSON: '{\"choices"),
    (b"<html><body>502 Bad Gateway</body></html>", "502 Bad Gateway"),
    ({"choices": []}, "no choices"),
    ({"error": {"message": "model overloaded", "code": 503}}, "model overloaded"),
    ({"choices": [{"message": {"role": "assistant", "content": None}, "finish_reason": "stop"}]}, "content null"),
    ({"choices": [{"message": {"role": "assistant", "content": [{"type": "text"}]}}]}, "content that is not text"),
])
def test_a_200_without_an_answer_is_retried_and_the_server_message_quoted(garbage, quoted, tmp_path):
    """A cut body, an HTML page, no choices or an error object once failed at the first try with a bare
    JSONDecodeError / IndexError / KeyError; null content was stored as a finished empty answer, never retried."""
    from data.regenerate import HTTPGenerator, regenerate

    srv, url, requests = _fake_server([garbage, _GOOD])
    try:
        out = tmp_path / "rg.jsonl"
        report = regenerate(_ONE_CONV, out, HTTPGenerator(url, "m", retries=2, backoff=0.01), progress=False)
        assert report.done == 1 and report.failed == 0 and len(requests) == 2  # retried like a 5xx
        assert '"fine"' in out.read_text()
        srv2, url2, _ = _fake_server([garbage])
        try:
            report = regenerate(_ONE_CONV, tmp_path / "bad.jsonl", HTTPGenerator(url2, "m", retries=1, backoff=0.01),
                                progress=False)
        finally:
            srv2.shutdown()
        assert report.failed == 1 and (tmp_path / "bad.jsonl").read_text() == ""  # not stored: a rerun retries it
        assert quoted in report.errors["RegenerationError"]["first"] and "2 times" in report.errors[
            "RegenerationError"]["first"]
    finally:
        srv.shutdown()


def test_a_long_body_is_quoted_cut_with_an_ellipsis():
    from data.regen_http import _start

    assert _start(b"x" * 400) == repr("x" * 300 + "...") and _start("short") == "'short'"


def test_rate_limits_are_retried_and_other_client_errors_are_not(tmp_path):
    """HTTP 429 (too many requests) is retried like a 5xx; a 404 fails the row at once, quoting the code."""
    from data.regenerate import HTTPGenerator, regenerate

    for code, done, sent in ((429, 1, 2), (404, 0, 1)):
        srv, url, requests = _fake_server([code, _GOOD])
        try:
            report = regenerate(_ONE_CONV, tmp_path / f"{code}.jsonl", HTTPGenerator(url, "m", retries=2,
                                                                                      backoff=0.01), progress=False)
        finally:
            srv.shutdown()
        assert (report.done, report.failed, len(requests)) == (done, 1 - done, sent)
    assert f"HTTP 404 from {url}/chat/completions" in report.errors["RegenerationError"]["first"]


def test_a_server_that_refuses_the_token_ids_field_is_asked_again_without_it(monkeypatch):
    """A strict OpenAI-compatible server answers 400 to vLLM's return_token_ids: the same request goes again
    without it (not counted as a retry), and later requests leave it out."""
    import io
    import urllib.error

    from data.regenerate import HTTPGenerator

    gen = HTTPGenerator("http://h", "m", retries=0)
    sent = []

    def post(payload):
        sent.append(dict(payload))
        if "return_token_ids" in payload:
            raise urllib.error.HTTPError(gen.url, 400, "Bad Request", {},
                                         io.BytesIO(b'{"error": "extra field return_token_ids not permitted"}'))
        return _GOOD

    monkeypatch.setattr(gen, "_post", post)
    assert gen.complete([{"role": "user", "content": "hi"}]).content == "fine"
    gen.complete([{"role": "user", "content": "again"}])
    assert ["return_token_ids" in p for p in sent] == [True, False, False] and gen.ask_token_ids is False


def test_generated_ids_that_are_not_integers_are_dropped_with_one_warning():
    import warnings

    from data.regenerate import HTTPGenerator

    gen = HTTPGenerator("http://h", "m")
    bad = {"choices": [{"message": {"content": "ok"}, "token_ids": [1, "2"]}]}
    with pytest.warns(UserWarning, match="does not return generated token ids"):
        assert gen._parse(bad).token_ids is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per run, not once per answer
        assert gen._parse(bad).token_ids is None


@pytest.mark.parametrize("models, served", [({"object": "list", "data": None}, []), ({"object": "list"}, []),
                                            ({"data": [{"id": "/a/Qwen3-8B"}, {"id": "/b/Qwen3-8B"}]},
                                             ["/a/Qwen3-8B", "/b/Qwen3-8B"])])
def test_a_server_listing_no_model_or_two_of_the_targets_name_is_refused(models, served):
    """No model list (or an empty one) is "serves [], not the target", not a TypeError; two models that both
    end in the target's name are ambiguous: neither is taken to be the target."""
    from data.regenerate import HTTPGenerator, ServerUnavailable

    srv, url, requests = _fake_server([_GOOD], models=models)
    try:
        gen = HTTPGenerator(url, "Qwen/Qwen3-8B")
        with pytest.raises(ServerUnavailable, match=f"serves {re.escape(str(served))}, not the target "
                                                    "'Qwen/Qwen3-8B'"):
            gen.preflight()
    finally:
        srv.shutdown()
    assert gen.model == "Qwen/Qwen3-8B" and requests == []


def test_negative_generated_ids_are_re_tokenized_not_an_overflow(data_target):
    """Ids above the vocabulary were re-tokenized from the text; negative ones crashed data.prepare with
    "OverflowError: number too small to fit in target type"."""
    from data.chat import tokenize_conversation
    from data.prepare import load_tokenizer

    tok = load_tokenizer(str(data_target))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "token_ids": [-3, 5]}]
    rows, dropped = tokenize_conversation(tok, messages, thinking=False)
    assert dropped == 0 and rows[0].retokenized == 1 and min(rows[0].input_ids) >= 0


def test_an_answer_cut_at_max_tokens_does_not_teach_ending_the_turn(data_target, tmp_path):
    """finish_reason "length": the template's end-of-turn token after the cut answer was a label, so the
    drafter learned to end turns mid-sentence."""
    from collections import Counter

    from data.chat import tokenize_conversation
    from data.prepare import load_tokenizer, regenerated_conversations
    from data.readers import ReadStats

    path = tmp_path / "regenerated.jsonl"
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one two"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "three"}]
    path.write_text(json.dumps({"id": "0", "key": "k", "messages": msgs,
                                "regen": {"turns": 2, "tokens": 9, "finish_reasons": ["stop", "length"]}}) + "\n")
    answers = Counter()
    [conv] = regenerated_conversations(path, ["k"], ReadStats(), answers)
    assert [m.get("cut") for m in conv["messages"] if m["role"] == "assistant"] == [None, True]
    assert answers["truncated"] == 1
    tok = load_tokenizer(str(data_target))
    whole = sum(sum(r.loss_mask) for r in tokenize_conversation(tok, msgs, thinking=False)[0])
    rows, _ = tokenize_conversation(tok, conv["messages"], thinking=False)
    assert sum(sum(r.loss_mask) for r in rows) == whole - 1  # only the cut turn's end-of-turn token left out
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    last = rows[-1]
    assert last.input_ids[-2] == eot and last.loss_mask[-2] == 0  # the trailer: <|im_end|> then a newline


def test_regenerated_answers_keep_their_ids_without_finish_reasons_and_only_cut_ones_count_as_truncated(tmp_path):
    """A row that records fewer finish reasons than answers (or none) still hands every answer its generated
    ids; a row whose answers all stopped is not counted as truncated."""
    import json
    from collections import Counter

    from data.prepare import regenerated_conversations
    from data.readers import ReadStats

    path = tmp_path / "regenerated.jsonl"
    turn = lambda text, ids: [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": text, "token_ids": ids}]
    rows = [{"key": "a", "messages": turn("one", [7, 8]) + turn("two", [9]),
             "regen": {"turns": 2, "tokens": 3, "finish_reasons": ["stop"]}},
            {"key": "b", "messages": turn("three", [4]), "regen": {"turns": 1, "tokens": 1}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    answers = Counter()
    convs = list(regenerated_conversations(path, ["a", "b"], ReadStats(), answers))
    assert [m.get("token_ids") for c in convs for m in c["messages"] if m["role"] == "assistant"] == [[7, 8], [9], [4]]
    assert (answers["rows"], answers["truncated"], answers["turns"], answers["tokens_generated"]) == (2, 0, 3, 4)


def test_standalone_regenerate_resumed_with_other_settings_is_refused_naming_each(tmp_path):
    """data.regenerate rerun on the same --out with other settings resumed silently ("already_done"), mixing
    the answers of two settings in one file."""
    from data.regenerate import RegenerationError, main, settings_path

    srv, url, requests = _fake_server([_GOOD])
    try:
        out = tmp_path / "rg.jsonl"
        base = ["--source", str(_DATA_FIX / "openai.jsonl"), "--out", str(out), "--server", url, "--model", "m",
                "--no-progress"]
        main(base + ["--thinking", "off", "--max-tokens", "64"])
        sent = len(requests)
        assert sent > 0 and json.loads(settings_path(out).read_text())["max_tokens"] == 64
        main(base + ["--thinking", "off", "--max-tokens", "64"])  # the same settings: resumed, nothing asked
        assert len(requests) == sent
        with pytest.raises(RegenerationError, match=r"other settings \(thinking: False -> True; max_tokens: 64 -> "
                                                    r"4096; temperature: 0.0 -> 0.7\).* new --out, or delete "):
            main(base + ["--thinking", "on", "--max-tokens", "4096", "--temperature", "0.7"])
        assert len(requests) == sent
    finally:
        srv.shutdown()


def test_local_regenerate_with_other_settings_is_refused_before_the_target_loads(data_target, tmp_path,
                                                                                    monkeypatch):
    """In-process regeneration loaded the target (minutes for a large one) before refusing an --out made with
    other settings."""
    import data.regenerate as rg

    out = tmp_path / "rg.jsonl"
    base = ["--source", str(_DATA_FIX / "openai.jsonl"), "--out", str(out), "--target", str(data_target),
            "--no-progress", "--limit", "1"]
    rg.main(base + ["--max-tokens", "2"])
    assert out.stat().st_size > 0 and json.loads(rg.settings_path(out).read_text())["max_tokens"] == 2
    monkeypatch.setattr(rg, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
    with pytest.raises(rg.RegenerationError, match=r"other settings \(max_tokens: 2 -> 3\)"):
        rg.main(base + ["--max-tokens", "3"])


@pytest.mark.parametrize("out, said", [
    ("source", "is the --source file"), ("other data", "holds other data, not answers written by data.regenerate"),
    ("folder", "is a folder: give the JSONL"),
])
def test_regenerate_out_that_is_the_source_other_data_or_a_folder_is_refused_untouched(tmp_path, monkeypatch, out,
                                                                                       said):
    """--out naming the source cut its last conversation (no newline at the end: taken for a row killed
    mid-write) and appended the answers to it; a folder failed only after the target loaded."""
    import data.regenerate as rg

    source = tmp_path / "chats.jsonl"
    source.write_text((_DATA_FIX / "openai.jsonl").read_text().rstrip("\n"))  # as editors often save it
    other = tmp_path / "mine.jsonl"
    other.write_text('{"messages": [{"role": "user", "content": "q"}]}\n{"messages": []}')
    (tmp_path / "folder").mkdir()
    before = {p: p.read_bytes() for p in (source, other)}
    path = {"source": source, "other data": other, "folder": tmp_path / "folder"}[out]
    monkeypatch.setattr(rg, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
    with pytest.raises(OSError, match=said):
        rg.main(["--source", str(source), "--out", str(path), "--target", "t", "--no-progress"])
    assert {p: p.read_bytes() for p in (source, other)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl", "folder", "mine.jsonl"]


@pytest.mark.parametrize("source, said", [("chatz.jsonl", "is neither a local file/folder nor a Hub id"),
                                          ("unknown.jsonl", "no usable conversations")])
def test_regenerate_source_that_is_missing_or_unusable_is_named_before_the_target_loads(tmp_path, monkeypatch,
                                                                                         source, said):
    """The source is streamed: a mistyped --source was read only after the target had loaded (minutes for a
    large one), leaving an empty --out and its settings file behind."""
    import data.regenerate as rg

    (tmp_path / "unknown.jsonl").write_text('{"foo": 1}\n')
    monkeypatch.setattr(rg, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
    with pytest.raises((FileNotFoundError, ValueError), match=said):
        rg.main(["--source", str(tmp_path / source), "--out", str(tmp_path / "rg.jsonl"), "--target", "t",
                 "--no-progress"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unknown.jsonl"]


def test_a_regenerate_into_an_out_another_run_is_writing_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    """Two standalone runs appending to one answers file regenerated the same conversations twice. The second
    is refused, naming the holder's pid, and writes nothing; a run that never wrote its --out leaves no lock."""
    import os

    import data.regenerate as rg
    from models.lock import hold

    out = tmp_path / "answers.jsonl"
    argv = ["--source", str(tmp_path / "missing.jsonl"), "--out", str(out), "--target", "t", "--no-progress"]
    monkeypatch.setattr(rg, "load_local_target", lambda *_: pytest.fail("the target loaded"))
    with hold(tmp_path, "answers.jsonl.lock", "--out", "-", output=out):
        with pytest.raises(ValueError, match=f"--out {out} is in use by another run \\(pid {os.getpid()}\\): wait"):
            rg.main(argv)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):  # the lock is free again: the source is read
        rg.main(argv)
    assert list(tmp_path.iterdir()) == []


def test_prepare_out_that_is_foreign_or_of_other_settings_is_refused_before_the_regenerating_target_loads(
        data_target, tmp_path, monkeypatch):
    """With --regenerate local the target loaded (minutes for a large one) before an --out holding other files or
    data prepared with other settings, or --pack without --max-length, was refused."""
    import data.prepare
    import data.regenerate as rg
    from data.reuse import DataMismatch, NotPreparedFolder

    prepared, mine = tmp_path / "prepared", tmp_path / "mine"
    data.prepare.prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), prepared, progress=False)
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    monkeypatch.setattr(rg, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
    run = lambda out, *extra: data.prepare.main(["--target", str(data_target), "--source",  # noqa: E731
                                                 str(_DATA_FIX / "openai.jsonl"), "--out", str(out), "--regenerate",
                                                 "local", "--no-progress", *extra])
    with pytest.raises(DataMismatch, match=r"other settings \(regenerate: None -> 'local'; .*max_length: None -> 9\)"):
        run(prepared, "--max-length", "9")
    with pytest.raises(NotPreparedFolder, match="is not empty and is not a prepared-data folder"):
        run(mine)
    with pytest.raises(ValueError, match="--pack needs --max-length"):
        run(tmp_path / "new", "--pack")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "prepared"]
    # the refusal leaves no lock file in the user's folder (it did: models.lock kept every lock file it made)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert ".prepare.lock" not in {p.name for p in prepared.iterdir()}


def test_prepare_source_that_is_missing_is_named_before_the_regenerating_target_loads(tmp_path, monkeypatch):
    import data.prepare
    import data.regenerate as rg

    monkeypatch.setattr(rg, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
    with pytest.raises(FileNotFoundError, match="'./chatz.jsonl' is neither a local file/folder nor a Hub id"):
        data.prepare.main(["--source", "./chatz.jsonl", "--out", str(tmp_path / "data"), "--target", "t",
                           "--regenerate", "local", "--no-progress"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("source, said", [("chats.csv", "chats.csv: unsupported file type '.csv' \\(use .jsonl"),
                                          ("notes", "notes holds no .jsonl/.json/.parquet files")])
def test_prepare_source_no_reader_reads_is_named_before_the_regenerating_target_loads(data_target, tmp_path,
                                                                                      monkeypatch, source, said):
    """A .csv source, or a folder of other files, was found only when the rows were first read: after the
    regenerating target had loaded (minutes for a large one)."""
    import data.prepare
    import data.regenerate as rg

    (tmp_path / "chats.csv").write_text((_DATA_FIX / "openai.jsonl").read_text())
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "chats.txt").write_text("hello")
    monkeypatch.setattr(rg, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
    with pytest.raises((ValueError, FileNotFoundError), match=said):
        data.prepare.main(["--source", str(tmp_path / source), "--out", str(tmp_path / "data"), "--target",
                           str(data_target), "--regenerate", "local", "--no-progress"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.csv", "notes"]


def test_a_subset_with_a_local_source_is_refused_before_any_target_loads(data_target, tmp_path, monkeypatch):
    """--subset / data.subset name a Hub data set's configuration: with a local file it was ignored, yet recorded in
    the prepared folder's settings, so correcting it later was refused as "other settings"."""
    import data.prepare
    import data.regenerate as rg
    import train.setup
    from data.readers import iter_conversations
    from train.distill import main

    src = tmp_path / "chats.jsonl"
    src.write_text((_DATA_FIX / "openai.jsonl").read_text())
    said = f"subset 'en' names a configuration of a Hub data set, and {src} is local"
    with pytest.raises(ValueError, match=said):
        next(iter_conversations(src, subset="en"))
    monkeypatch.setattr(rg, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
    with pytest.raises(ValueError, match=said):
        data.prepare.main(["--source", str(src), "--subset", "en", "--out", str(tmp_path / "data"), "--target",
                           str(data_target), "--regenerate", "local", "--no-progress"])
    monkeypatch.setattr(train.setup, "load_target", lambda *a, **k: pytest.fail("the target loaded first"))
    with pytest.raises(ValueError, match=said):
        main(["recipe=tiny", f"out_dir={tmp_path / 'run'}", f"data.source={src}", "data.subset=en"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]
    assert next(iter_conversations(src))["messages"]  # without the subset the file reads as before


def test_a_hung_server_request_ends_at_the_request_timeout(capsys):
    """A server that accepts and never answers held each request for a fixed 600 s (x 6 tries); the flag
    sets it, and a value that is not a positive number of seconds is refused."""
    import socket

    from data.regen_common import RegenerationError
    from data.regenerate import main, make_generator

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen()  # connections queue and are never answered
    try:
        gen = make_generator(f"http://127.0.0.1:{hung.getsockname()[1]}/v1", model="m", retries=0,
                             request_timeout=0.3, preflight=False)
        with pytest.raises(RegenerationError, match="unreachable after 1 tries: .*timed out"):
            gen.complete([{"role": "user", "content": "hi"}])
    finally:
        hung.close()
    with pytest.raises(SystemExit):
        main(["--source", "s.jsonl", "--out", "o.jsonl", "--server", "http://x/v1", "--request-timeout", "0"])
    assert "--request-timeout 0.0: use a positive number of seconds" in capsys.readouterr().err


def test_interrupted_http_regeneration_does_not_wait_for_retries(tmp_path):
    """Ctrl-C with a failing server waited for every running row's retries (up to 6 x 600 s each): the
    pool's shutdown waited for them."""
    import time

    from data.regenerate import HTTPGenerator

    srv, url, requests = _fake_server([503])
    gen = HTTPGenerator(url, "m", retries=3, backoff=4.0, concurrency=2)

    def convs():
        yield _ONE_CONV[0]
        time.sleep(0.3)  # the row's first request fails and waits to retry
        raise KeyboardInterrupt

    try:
        start = time.time()
        with pytest.raises(KeyboardInterrupt):
            list(gen.run(convs()))
        assert time.time() - start < 1.5 and len(requests) == 1
    finally:
        srv.shutdown()


@pytest.mark.parametrize("error, one_line", [
    (KeyError("input_ids"), False), (TypeError("forward() got an unexpected keyword"), False),
    (IndexError("list index out of range"), False), (AttributeError("x"), False),
    (ValueError("data.max_length=0: must be > 0"), True), (FileNotFoundError("no such file: x"), True),
    (PermissionError("denied: /x"), True),
])
def test_cli_keeps_the_traceback_of_bugs_and_one_line_for_user_errors(error, one_line, monkeypatch):
    from models.cli import run_cli

    monkeypatch.delenv("DRAFTSMITH_TRACEBACK", raising=False)

    def main():
        raise error

    if one_line:
        with pytest.raises(SystemExit, match="^error: "):
            run_cli(main)
    else:
        with pytest.raises(type(error)):
            run_cli(main)


def test_every_project_error_type_is_a_user_error():
    import importlib
    import inspect
    import pkgutil

    from models.cli import USER_ERRORS

    found = []
    for pkg in ("models", "data", "train", "inference", "export"):
        for info in pkgutil.iter_modules(importlib.import_module(pkg).__path__):
            if info.name in ("bench", "hf_dflash") or info.name.endswith("_mlx"):
                continue
            try:
                module = importlib.import_module(f"{pkg}.{info.name}")
            except ImportError:
                continue
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if (issubclass(cls, Exception) and cls.__module__ == module.__name__
                        and not cls.__name__.startswith("_")):
                    found.append(cls)
    assert len(found) >= 10
    not_user = [f"{cls.__module__}.{cls.__qualname__}" for cls in found if not issubclass(cls, USER_ERRORS)]
    assert not not_user, f"project error types the CLI would show as bugs: {not_user}"


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
    from test_train_run import FAST, losses, run, tiny_input_dirs
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
                                              r"device\): the newest complete one, .*step_1, is intact: free space "
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
    with pytest.raises(CheckpointError, match=r"could not write the final drafter to .*final \(Disk quota exceeded\): "
                                              r"the checkpoint of the last step, .*step_3, holds the same weights"):
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
    from test_train_run import FAST, run, tiny_input_dirs
    from train.checkpoint import CheckpointError

    d = tiny_input_dirs(tmp_path_factory)
    args = [f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "checkpoint.every=1",
            "train.max_steps=2", "train.batch_size=4", "train.anchors=8", "eval.batches=1"]
    run(tmp_path, *args)
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

    from conftest import tiny_drafter_config
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer
    from train.config import load_config
    from train.distill import build_drafter

    target = TargetModel(tiny_target("qwen3"), tiny_tokenizer())
    run = SimpleNamespace(cfg=load_config(["recipe=tiny", "train.compile=true"]), device=torch.device("cpu"))
    with pytest.raises(ValueError, match="train.compile=true .* this run is on cpu: drop train.compile"):
        build_drafter(run, tiny_drafter_config(target), target)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_compiling_a_target_twice_changes_nothing(arch):
    """A second ``compile_layers`` wrapped the compiled wrappers again: compiles of compiled code, and a
    fall-back that called the first wrapper."""
    from models.target import TargetModel
    from models.tiny import tiny_target

    target = TargetModel(tiny_target(arch)).compile_layers(backend="eager")  # lazy: nothing compiles until a call
    forwards = [layer.forward for layer in target.layers]
    joined = [m.in_proj_joined for _, m in target.linear_attention_modules()]
    assert target.compile_layers(backend="eager") is target
    assert [layer.forward for layer in target.layers] == forwards
    again = [m.in_proj_joined for _, m in target.linear_attention_modules()]
    assert len(again) == len(joined) and all(a is b for a, b in zip(again, joined))  # the same buffers
    assert (len(joined) > 0) == target.is_hybrid


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


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("head_dim", 0), ("num_key_value_heads", 0),
                                        ("intermediate_size", 0), ("rope_theta", 0), ("rms_norm_eps", 0),
                                        ("target_layer_ids", []), ("max_position_embeddings", 0)])
def test_drafter_shape_zero_from_code_is_refused_not_replaced_by_the_targets(key, value):
    """DFlashConfig.for_target read 0 (and []) as "not given": a caller's num_attention_heads=0 silently became
    the target's. rms_norm_eps 0 and max_position_embeddings 0 were accepted outright."""
    from models.config import ConfigError, DFlashConfig, TargetShape
    from models.tiny import tiny_target

    target = TargetShape.from_config(tiny_target("qwen3").config)
    for shape, facts in ((target, {}), (None, {"hidden_size": 64, "vocab_size": 300, "num_target_layers": 4})):
        with pytest.raises(ConfigError, match=f"^{key}="):
            DFlashConfig.for_target(shape, mask_token_id=1, num_taps=1, **facts, **{key: value})
        DFlashConfig.for_target(shape, mask_token_id=1, num_taps=1, **facts)  # not given: the target's (or default)
    # explicit taps on a target too shallow for the default 5: the default is not computed (and refused)
    assert DFlashConfig.for_target(target, mask_token_id=1, target_layer_ids=[1]).target_layer_ids == [1]
    # a target shape that does not say (None): the defaults, not a refusal
    unsaid = TargetShape(hidden_size=64, vocab_size=300, num_layers=8, num_attention_heads=4, rms_norm_eps=None,
                         max_position_embeddings=None)
    config = DFlashConfig.for_target(unsaid, mask_token_id=1, num_taps=2)
    assert (config.rms_norm_eps, config.max_position_embeddings) == (1e-6, 40960)


@pytest.mark.parametrize("edit, problem", [
    ({"block_size": 16.5}, "block_size=16.5: must be a whole number"),  # was cut to 16 without a word
    ({"dflash_config": {"target_layer_ids": [1, 8.5, 17]}}, "target_layer_ids=8.5: must be a whole number"),
    ({"mask_token_id": True, "dflash_config": {"mask_token_id": True}}, "mask_token_id=True: must be a whole number"),
    # runtimes that read is_causal make full-attention layers causal too; without sliding layers it was
    # accepted and the drafter run bidirectionally, drafting other tokens than those runtimes
    ({"is_causal": True}, "is_causal=True: makes every layer causal inside the block"),
])
def test_a_drafter_config_with_a_fractional_number_or_is_causal_true_is_refused(edit, problem):
    import copy
    import json

    from models.config import ConfigError, DFlashConfig

    d = json.loads((Path(__file__).parent / "fixtures" / "config_flat.json").read_text())
    assert "sliding_attention" not in (d.get("layer_types") or [])
    edited = copy.deepcopy(d)
    for key, value in edit.items():
        if isinstance(value, dict):
            edited[key] = {**edited[key], **value}
        else:
            edited[key] = value
    with pytest.raises(ConfigError, match=re.escape(problem)):
        DFlashConfig.from_dict(edited)
    assert DFlashConfig.from_dict({**d, "block_size": 16.0, "is_causal": False}).block_size == 16  # 16.0 is 16


# ---------------------------------------------------------------- mask token
@pytest.mark.parametrize("mask_id, problem", [
    (264, "'<|eot_id|>', eos token"),  # EOS
    (256, "'<|endoftext|>', pad token"),  # pad
    (261, "'<|begin_of_text|>', a chat-control token"),  # BOS, written by the chat template
    (262, "'<|start_header_id|>', a chat-control token"),
    (39, "the ordinary text token 'H'"),  # a byte of text
    (0, "the ordinary text token '!'"),  # the first row is inside the embedding
    (72, "'i', produced by the chat template"),  # a byte the rendered template writes ("assistant")
    (288, "outside the target embedding (288 rows)"),
    (-1, "outside the target embedding"),
])
def test_explicit_mask_token_that_the_target_produces_is_refused(mask_id, problem):
    from models.config import ConfigError
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    with pytest.raises(ConfigError, match="mask_token_id") as e:
        resolve_mask_token(288, tiny_tokenizer("llama3", reserved=23), explicit=mask_id)
    assert problem in str(e.value) and "Fix:" in str(e.value)


def test_mask_token_present_in_the_data_is_refused():
    from models.config import ConfigError
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3", reserved=23)
    with pytest.raises(ConfigError, match="present in the training data"):
        resolve_mask_token(288, tok, explicit=265, produced_ids={10, 265})
    # The automatic choice skips it and takes the next reserved token.
    assert resolve_mask_token(288, tok, produced_ids={265}).id == 266


def test_a_bos_the_chat_template_never_writes_is_still_not_the_mask():
    # The tiny tokenizers' BOS is also a template token, so only that rule was ever exercised.
    from models.config import ConfigError
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3", reserved=23)
    tok.bos_token = "<|reserved_special_token_0|>"  # id 265: a spare special, nowhere in the template
    assert tok.bos_token_id == 265
    with pytest.raises(ConfigError, match="bos token"):
        resolve_mask_token(288, tok, explicit=265)
    assert resolve_mask_token(288, tok).id == 266  # the automatic choice passes over it


def test_an_added_token_that_is_not_special_is_never_the_mask():
    """A token added as ordinary text, even one named like a reserved token, is text the tokenizer writes: no
    automatic choice takes it and giving it explicitly is refused."""
    from models.config import ConfigError
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3")
    tok.add_tokens(["<|reserved_text|>"])  # 265, not special, the last row
    with pytest.raises(ConfigError, match="no reserved special token"):
        resolve_mask_token(len(tok), tok)
    with pytest.raises(ConfigError, match=re.escape("is the ordinary text token '<|reserved_text|>'")):
        resolve_mask_token(len(tok), tok, explicit=265)


def test_no_spare_row_and_no_reserved_token_is_a_clear_error():
    from models.config import ConfigError
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3")  # 265 tokens, every one a byte, a template token or EOS/pad
    with pytest.raises(ConfigError, match="set drafter.mask_token_id to a special token your chat template never"):
        resolve_mask_token(len(tok), tok)




def test_inference_warns_about_a_mask_the_target_produces_but_not_a_reserved_special(caplog):
    """A Llama-3-style drafter whose mask is a reserved special token once drew a spurious warning."""
    import logging

    from inference.stats import warn_if_mask_is_emitted
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3", reserved=4)
    reserved = tok.convert_tokens_to_ids("<|reserved_special_token_0|>")
    cases = {reserved: None, tok.eos_token_id: "eos token", tok.convert_tokens_to_ids("H"): "ordinary text token",
             tok.convert_tokens_to_ids("a"): "produced by the chat template",  # "assistant"
             10_000: None}  # 10_000: a spare row past the tokenizer
    for mask_id, warned in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            warn_if_mask_is_emitted(mask_id, tok)
        text = " ".join(r.getMessage() for r in caplog.records)
        assert (warned in text) if warned else not text, (mask_id, text)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_if_mask_is_emitted(tok.eos_token_id, None)  # no tokenizer to judge by: nothing to say
    assert not caplog.records


# ---------------------------------------------------------------- generate / validate (inference/)
def test_validate_partial_file_of_other_settings_or_cut_short(tmp_path):
    """A partial.jsonl written with other settings is set aside (never mixed into this report); a line cut
    short by the interruption is dropped, the complete ones are kept."""
    import json

    from inference import partial
    from inference.report import PromptRun
    from inference.stats import GenerationResult

    run = PromptRun("code-00", "code", 12, [GenerationResult([1, 2, 3], [2, 1], [1], 8, 0.1, 0.2)],
                    [GenerationResult([1, 2, 3], [1, 1], [0], 1, 0.1, 0.3)])
    rec = partial.Recorder(tmp_path, "key-a")
    rec(0, run, {"peak_memory_bytes": None, "baseline_peak_memory_bytes": None})
    with open(tmp_path / partial.PARTIAL, "a") as f:
        f.write('{"index": 1, "id": "code-01", "categ')  # the run stopped while writing this line
    notes: list[str] = []
    done = partial.load(tmp_path, "key-a", notes.append)
    assert list(done) == [0] and done[0][0] == run and notes == []
    assert partial.load(tmp_path, "key-b", notes.append) == {}
    assert notes == [f"note: {tmp_path / partial.PARTIAL} was measured with other settings: set aside as "
                     "partial.jsonl.old, starting over"]
    assert not (tmp_path / partial.PARTIAL).exists() and (tmp_path / "partial.jsonl.old").is_file()
    assert json.loads((tmp_path / "partial.jsonl.old").read_text().splitlines()[0]) == {"settings": "key-a"}


def _partial_run(i: int):
    from inference.report import PromptRun
    from inference.stats import GenerationResult

    return PromptRun(f"code-{i:02d}", "code", 12, [GenerationResult([1, 2, i], [2, 1], [1], 8, 0.1, 0.2)],
                     [GenerationResult([1, 2, i], [1, 1], [0], 1, 0.1, 0.3)])


def test_validate_partial_file_keeps_every_complete_row_by_its_position(tmp_path):
    """partial.jsonl maps each row to its prompt's position (not to its line number), keeps its peak memory,
    keeps the complete rows after a cut one, and a second Recorder (the resumed run) appends, never
    truncating what the first one measured."""
    from inference import partial

    peaks = {"peak_memory_bytes": 123, "baseline_peak_memory_bytes": 45}
    partial.Recorder(tmp_path, "key-a")(2, _partial_run(2), peaks)
    with open(tmp_path / partial.PARTIAL, "a") as f:
        f.write('{"index": 1, "id": "code-01", "categ\n')  # a line cut short, then a complete one
    rec = partial.Recorder(tmp_path, "key-a")  # the resumed run
    rec(0, _partial_run(0), dict.fromkeys(peaks))
    done = partial.load(tmp_path, "key-a", print)
    assert sorted(done) == [0, 2] and done[2] == (_partial_run(2), peaks)
    assert done[0] == (_partial_run(0), dict.fromkeys(peaks))


def test_validate_partial_row_written_after_a_cut_line_is_kept(tmp_path):
    """BUG (fails on the current code): a run killed mid-write leaves partial.jsonl without its final newline;
    the resumed run's first row is appended onto that fragment, so it never parses and that prompt's
    measurement is lost again at the next resume."""
    from inference import partial

    peaks = {"peak_memory_bytes": None, "baseline_peak_memory_bytes": None}
    partial.Recorder(tmp_path, "key-a")(0, _partial_run(0), peaks)
    with open(tmp_path / partial.PARTIAL, "a") as f:
        f.write('{"index": 1, "id": "code-01", "categ')  # the first run stopped while writing this line
    assert sorted(partial.load(tmp_path, "key-a", print)) == [0]
    rec = partial.Recorder(tmp_path, "key-a")  # the resumed run measures prompts 1 and 2, then stops again
    rec(1, _partial_run(1), peaks)
    rec(2, _partial_run(2), peaks)
    done = partial.load(tmp_path, "key-a", print)
    assert sorted(done) == [0, 1, 2] and done[1][0] == _partial_run(1)


def test_validate_partial_file_empty_or_not_an_object_is_set_aside_and_five_old_ones_kept(tmp_path):
    """A partial.jsonl left empty (killed while it was created) or whose first line is not an object is set aside
    with a note, not a traceback; a setting only one side recorded is named; set-aside files shift down to
    .old.4, and only the one beyond that goes."""
    from inference import partial

    path = tmp_path / partial.PARTIAL
    for text in ("", "[1, 2]\n"):
        path.write_text(text)
        notes: list[str] = []
        assert partial.load(tmp_path, "key-a", notes.append) == {}
        assert len(notes) == 1 and "set aside as partial.jsonl.old" in notes[0] and not path.exists()
        assert (tmp_path / "partial.jsonl.old").read_text() == text
    assert partial.differing({"seed": 0}, {"seed": 0, "draftsmith_version": "1"}) == ["draftsmith_version"]
    assert partial.differing({"seed": 0}, None) == []  # settings not given: nothing to name
    for i in range(7):
        path.write_text(f"run {i}\n")
        partial.set_aside(path)
    kept = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert kept == {"partial.jsonl.old": "run 6\n", **{f"partial.jsonl.old.{k}": f"run {6 - k}\n" for k in range(1, 5)}}


@pytest.mark.parametrize("requested", [0, 1, 9])
def test_block_size_outside_two_to_trained_is_refused(requested):
    """0 is not "the trained size", and 1 leaves no draft slot: both are refused like a size above the trained one."""
    from inference.stats import resolve_block_size

    with pytest.raises(ValueError, match=f"--block-size {requested} must be between 2 and the drafter's trained"):
        resolve_block_size(requested, 8)
    assert resolve_block_size(2, 8) == 2 and resolve_block_size(None, 8) == 8
    assert resolve_block_size(8, 8) == 8  # the trained size itself, asked for explicitly


def test_recorded_target_prefers_the_provenance_block_and_unquotes_the_card(tmp_path):
    """export.hf's ``draftsmith.target`` wins over a ``base_model`` key; a model card's quoted ``base_model``
    is read without its quotes (else every pre-flight warned about a target that matches)."""
    from inference.checks import recorded_target

    raw = {"draftsmith": {"target": "Qwen/Qwen3-8B"}, "base_model": "Qwen/Qwen3-8B-Base"}
    assert recorded_target(tmp_path, raw) == "Qwen/Qwen3-8B"
    (tmp_path / "README.md").write_text("---\nlicense: mit\nbase_model: \"Qwen/Qwen3-4B\"\n---\n# card\n")
    assert recorded_target(tmp_path, {}) == "Qwen/Qwen3-4B"


def test_recorded_target_reads_every_key_a_drafter_may_carry_and_skips_what_names_no_model(tmp_path):
    """z-lab drafters name their target under dflash_config or at the top level; a ``draftsmith`` key that is
    not the provenance block, or a key that holds no name, must not stop the search (nor crash it)."""
    from inference.checks import recorded_target

    assert recorded_target(tmp_path, {"dflash_config": {"target_model": "a/B"}, "base_model": "c/D"}) == "a/B"
    assert recorded_target(tmp_path, {"target_model": "a/C", "base_model": "c/D"}) == "a/C"
    assert recorded_target(tmp_path, {"draftsmith": "0.3.0", "base_model": "c/D"}) == "c/D"
    assert recorded_target(tmp_path, {"draftsmith": {"target": None}, "target_model": ["a/B"],
                                      "base_model": "c/D"}) == "c/D"
    card = tmp_path / "README.md"
    card.write_text("# card\nbase_model: a/B\n")  # no front matter: prose, not metadata
    assert recorded_target(tmp_path, {}) is None


@pytest.mark.parametrize("front, recorded", [
    ("base_model:\n- Qwen/Qwen3-8B\nlicense: mit\n", "Qwen/Qwen3-8B"),  # the Hub editor's list form
    ("base_model:\n  - 'Qwen/Qwen3-8B'\n", "Qwen/Qwen3-8B"),
    ("base_model:\n- Qwen/Qwen3-8B\ntags:\n- dflash\n", "Qwen/Qwen3-8B"),  # the next key's list is not its
    ("base_model:\n- a/B\n- c/D\n", None),  # a merge: no single target to compare with
    ("base_model:\nlicense: mit\n", None),
])
def test_a_cards_base_model_list_names_its_one_target(tmp_path, front, recorded):
    """A card listing its base model as a YAML list was read as no recorded target, so a drafter for another
    target ran without the warning."""
    from inference.checks import recorded_target

    (tmp_path / "README.md").write_text(f"---\n{front}---\n# card\n")
    assert recorded_target(tmp_path, {}) == recorded


def test_draft_cache_ahead_of_the_target_is_an_error_too():
    """The drafter must have seen exactly the committed context: one position too many is as wrong as one
    too few (-1: a proposer that does not track it)."""
    from inference.checks import check_draft_context

    for held in (11, 13):
        with pytest.raises(RuntimeError, match=f"draft cache holds {held} positions but 12 are committed"):
            check_draft_context(held, 12)
    check_draft_context(12, 12)
    check_draft_context(-1, 12)


def test_binding_a_drafter_whose_mask_the_target_emits_warns(infer_dirs, caplog):
    """Generation stays lossless with such a mask, so binding warns instead of refusing; without the warning
    a low acceptance had no visible cause."""
    import logging

    from conftest import tiny_drafter_config
    from inference.torch_loop import DrafterProposer
    from models.drafter import DFlashDraftModel

    target = infer_dirs["full"]
    cfg = tiny_drafter_config(target)
    cfg.mask_token_id = target.tokenizer.eos_token_id  # as a hand-edited or foreign config.json may say
    with caplog.at_level(logging.WARNING):
        DrafterProposer(DFlashDraftModel(cfg), target)
    assert "mask_token_id" in caplog.text and "eos token" in caplog.text


# Every case here ends before any weights load: the target folders below hold config.json and the
# tokenizer only, so a check that ran after loading would fail differently.


@pytest.fixture(scope="module")
def infer_dirs(tmp_path_factory):
    """A config-only tiny target, a drafter config for it, and a full tiny target (for the loops)."""
    import shutil

    import torch

    from conftest import tiny_drafter_config
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import save_tiny_target

    root = tmp_path_factory.mktemp("infer_bad")
    full = save_tiny_target(root / "full", "qwen3")
    target = TargetModel.from_pretrained(full)
    torch.manual_seed(0)
    DFlashDraftModel(tiny_drafter_config(target)).save_pretrained(root / "draft")
    (root / "target").mkdir()
    for f in full.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, root / "target" / f.name)
    return {"root": root, "target": str(root / "target"), "draft": str(root / "draft"), "full": target,
            "full_dir": str(full)}


def _drafter_variant(infer_dirs, name: str, **changes) -> str:
    """A copy of the drafter's config.json with some keys changed (no weights: pre-flight must stop first)."""
    import json

    d = json.loads((infer_dirs["root"] / "draft" / "config.json").read_text())
    for key, value in changes.items():
        if key in d.get("dflash_config", {}):
            d["dflash_config"][key] = value
        d[key] = value
    out = infer_dirs["root"] / name
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(d))
    return str(out)


def _generate(infer_dirs, *extra, target=None, draft=None):
    from inference.generate import main

    return main(["--backend", "torch", "--target", target or infer_dirs["target"], "--draft",
                 draft or infer_dirs["draft"], *extra])


def _validate(infer_dirs, *extra, target=None, draft=None):
    from inference.validate import main

    return main(["--backend", "torch", "--target", target or infer_dirs["target"], "--draft",
                 draft or infer_dirs["draft"], "--no-progress", "--out", str(infer_dirs["root"] / "out"), *extra])


@pytest.mark.parametrize("ids, shown", [("5,288", "288"), ("5,-3", "-3"), ("1,999999", "999999")])
def test_generate_prompt_ids_outside_the_vocabulary(infer_dirs, ids, shown):
    with pytest.raises(ValueError, match=rf"outside the target's vocabulary \(0\.\.287\): \[{shown}\]"):
        _generate(infer_dirs, f"--prompt-ids={ids}")


def test_prompt_ids_empty_or_just_below_zero_are_refused():
    from inference.checks import check_prompt_ids

    with pytest.raises(ValueError, match="--prompt-ids is empty: give at least one token id"):
        check_prompt_ids([], 288)
    with pytest.raises(ValueError, match=r"outside the target's vocabulary \(0\.\.287\): \[-1\]"):
        check_prompt_ids([0, -1, 287], 288)
    with pytest.raises(ValueError, match=r"\(non-negative\): \[-1\]"):
        check_prompt_ids([5, -1], None)  # a target config without vocab_size still refuses negatives
    assert check_prompt_ids(iter([0, 287]), 288) == [0, 287]


@pytest.mark.parametrize("ids", ["1,,2", "a,b", "1, x"])
def test_generate_prompt_ids_that_are_not_integers(infer_dirs, ids):
    """"1,,2" was read as [1, 2]; "a,b" ended without the one-line "error:" form."""
    with pytest.raises(ValueError, match="--prompt-ids must be comma-separated integers"):
        _generate(infer_dirs, f"--prompt-ids={ids}")


def test_generate_thinking_without_chat(infer_dirs, capsys):
    """--thinking on with a raw --prompt was silently ignored."""
    with pytest.raises(SystemExit):
        _generate(infer_dirs, "--prompt", "hi", "--thinking", "on")
    assert "--thinking sets the chat template's switch: add --chat" in capsys.readouterr().err


def test_generate_negative_temperature(infer_dirs, capsys):
    with pytest.raises(SystemExit):
        _generate(infer_dirs, "--prompt-ids", "1", "--temperature", "-1")
    assert "--temperature -1.0: use 0 for greedy" in capsys.readouterr().err


def test_validate_negative_temperature(infer_dirs):
    with pytest.raises(ValueError, match="--temperature -1.0: use 0 for greedy"):
        _validate(infer_dirs, "--temperature", "-1")


@pytest.mark.parametrize("run", [_generate, _validate])
def test_swapped_target_and_draft(infer_dirs, run):
    extra = ("--prompt-ids", "1") if run is _generate else ()
    with pytest.raises(ValueError, match=r"is a DFlash drafter \(.*draft/config.json names DFlashDraftModel\) and "
                                         "--draft .* is not: swap them"):
        run(infer_dirs, *extra, target=infer_dirs["draft"], draft=infer_dirs["target"])


def test_a_drafter_as_target_beside_a_drafter_is_named_not_compared(infer_dirs):
    """Both folders drafters: nothing to swap, and a drafter's config has the target's sizes, so only this
    check keeps the pair from passing every comparison."""
    with pytest.raises(ValueError, match=r"--target .*draft is a DFlash drafter \(.*draft/config.json names "
                                         r"DFlashDraftModel\), not a target model"):
        _generate(infer_dirs, "--prompt-ids", "1", target=infer_dirs["draft"])


def test_draft_that_is_a_target_names_the_file(infer_dirs):
    with pytest.raises(ValueError, match=r"is not a DFlash drafter: .*target/config.json describes a "
                                         r"Qwen3ForCausalLM model .* Did you swap --target and --draft\?"):
        _generate(infer_dirs, "--prompt-ids", "1", draft=infer_dirs["target"])


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": 96}, "has hidden_size 96 but the target's is 64"),
    ({"vocab_size": 512, "mask_token_id": 300}, "has vocab_size 512 but the target's is 288"),
    ({"num_target_layers": 60, "target_layer_ids": [1, 5, 50]}, r"taps target layers \[50\] but the target has only 8"),
    ({"num_target_layers": 12, "target_layer_ids": [1, 3, 5]}, "trained on a 12-layer target; this target has 8"),
    ({"num_target_layers": 12, "target_layer_ids": [1, 5, 8]}, r"taps target layers \[8\] but the target has only 8"),
    # taps that exist in the deeper target, from a drafter trained on a shallower one
    ({"num_target_layers": 4, "target_layer_ids": [0, 1, 2]}, "trained on a 4-layer target; this target has 8"),
])
def test_drafter_for_another_target(infer_dirs, changes, message):
    draft = _drafter_variant(infer_dirs, "variant-" + "-".join(changes), **changes)
    for run in (_generate, _validate):
        extra = ("--prompt-ids", "1") if run is _generate else ()
        with pytest.raises(ValueError, match=message):
            run(infer_dirs, *extra, draft=draft)


@pytest.mark.parametrize("run", [_generate, _validate])
def test_a_drafter_folder_without_its_weights_is_named_before_the_target_loads(infer_dirs, monkeypatch, run):
    """A drafter folder holding only config.json (a partial copy) passed every check and failed only once the
    target had loaded (minutes for a large one)."""
    from models.target import TargetModel

    draft = _drafter_variant(infer_dirs, "config-only")
    monkeypatch.setattr(TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("the target loaded first"))
    extra = ("--prompt-ids", "1") if run is _generate else ()
    with pytest.raises(FileNotFoundError, match=r"--draft .*config-only: no \*.safetensors weights in "):
        run(infer_dirs, *extra, draft=draft)


@pytest.mark.parametrize("run", [_generate, _validate])
def test_a_target_folder_without_a_tokenizer_is_named_before_the_target_loads(infer_dirs, monkeypatch, run):
    """generate --prompt and validate need the target's tokenizer: a folder without one failed only once the
    target had loaded. generate --prompt-ids needs none and still goes on to the load."""
    import shutil

    from models.target import TargetModel

    bare = infer_dirs["root"] / "no-tokenizer"
    bare.mkdir(exist_ok=True)
    shutil.copy(infer_dirs["root"] / "target" / "config.json", bare / "config.json")
    monkeypatch.setattr(TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("the target loaded first"))
    extra = ("--prompt", "hello") if run is _generate else ()
    with pytest.raises(ValueError, match=r"--target .*no-tokenizer: .* has no tokenizer files \(tokenizer.json"):
        run(infer_dirs, *extra, target=str(bare))
    if run is _generate:
        loaded = "the target loaded first"
        with pytest.raises(pytest.fail.Exception, match=loaded):
            run(infer_dirs, "--prompt-ids", "1", target=str(bare))


def test_a_target_with_only_a_sentencepiece_tokenizer_passes_the_tokenizer_check(infer_dirs, tmp_path):
    """Older Llama / Mistral folders ship tokenizer.model and tokenizer_config.json, no tokenizer.json: the
    load reads them, so the pre-flight must not refuse them."""
    import shutil

    from inference.checks import check_target_tokenizer, read_target_facts

    shutil.copy(Path(infer_dirs["target"]) / "config.json", tmp_path / "config.json")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    check_target_tokenizer(read_target_facts(tmp_path), str(tmp_path), "add them")


def test_mask_id_outside_the_target_embedding(infer_dirs):
    draft = _drafter_variant(infer_dirs, "mask-out-of-range", mask_token_id=999)
    for run in (_generate, _validate):
        extra = ("--prompt-ids", "1") if run is _generate else ()
        with pytest.raises(ValueError, match="mask_token_id=999"):
            run(infer_dirs, *extra, draft=draft)


def test_block_size_above_trained(infer_dirs):
    for run in (_generate, _validate):
        extra = ("--prompt-ids", "1") if run is _generate else ()
        with pytest.raises(ValueError, match="--block-size 32 must be between 2 and the drafter's trained block "):
            run(infer_dirs, *extra, "--block-size", "32")



def test_preflight_gives_the_block_size_asked_for_or_the_trained_one(infer_dirs):
    from inference.checks import preflight

    assert preflight(infer_dirs["target"], infer_dirs["draft"], block_size=4).block_size == 4
    assert preflight(infer_dirs["target"], infer_dirs["draft"]).block_size == 8


def test_preflight_fetches_the_model_cards_of_hub_ids_but_no_weights(infer_dirs, monkeypatch):
    """The recorded target may live only in a Hub drafter's README.md: without it no warning could come."""
    import models.hub
    from inference.checks import preflight

    asked = {}

    def resolve(name, what="model", allow_patterns=None, **_):
        asked[what] = allow_patterns
        return Path(infer_dirs["target"] if what == "target" else infer_dirs["draft"])

    monkeypatch.setattr(models.hub, "resolve_model_dir", resolve)
    preflight("org/target", "org/drafter")
    for patterns in asked.values():
        assert "*.md" in patterns and "*.json" in patterns
        assert not any("safetensors" in p or p == "*" for p in patterns)


def test_recorded_target_differs_warns(infer_dirs, caplog):
    from inference.checks import preflight

    draft = _drafter_variant(infer_dirs, "recorded")
    (infer_dirs["root"] / "recorded" / "README.md").write_text("---\nbase_model: Qwen/Qwen3-8B\n---\n# card\n")
    with caplog.at_level("WARNING", logger="inference"):
        pre = preflight(infer_dirs["target"], draft)
    assert pre.recorded_target == "Qwen/Qwen3-8B"
    assert "records its target as Qwen/Qwen3-8B" in caplog.text


def test_a_base_or_instruct_sibling_of_the_recorded_target_warns_and_a_quantized_copy_does_not(infer_dirs, tmp_path,
                                                                                            caplog):
    """A drafter trained against Qwen3-8B, run against Qwen3-8B-Base: the name contains the recorded one, and
    containment once counted as the same model, so no warning came although the weights differ; a 4-bit copy of
    the same model is still the same model."""
    from inference.checks import preflight

    draft = _drafter_variant(infer_dirs, "recorded-8b")
    (infer_dirs["root"] / "recorded-8b" / "README.md").write_text("---\nbase_model: Qwen/Qwen3-8B\n---\n# card\n")
    for name, warns in (("Qwen3-8B-Base", True), ("Qwen3-8B-MLX-4bit", False), ("qwen3-8b", False)):
        target = tmp_path / name
        target.symlink_to(Path(infer_dirs["target"]).resolve(), target_is_directory=True)
        caplog.clear()
        with caplog.at_level("WARNING", logger="inference"):
            preflight(str(target), draft)
        assert ("records its target as Qwen/Qwen3-8B" in caplog.text) == warns, name


def test_exported_provenance_target_differs_warns(infer_dirs, caplog):
    """export.hf records the target in config.json's ``draftsmith`` block; pre-flight once ignored it."""
    from inference.checks import preflight

    draft = _drafter_variant(infer_dirs, "exported", draftsmith={"target": "meta-llama/Llama-3.1-8B-Instruct"})
    with caplog.at_level("WARNING", logger="inference"):
        pre = preflight(infer_dirs["target"], draft)
    assert pre.recorded_target == "meta-llama/Llama-3.1-8B-Instruct"
    assert "records its target as meta-llama/Llama-3.1-8B-Instruct" in caplog.text


def test_a_trained_drafter_names_its_target_and_another_folder_of_the_same_name_warns(tmp_path_factory, tmp_path,
                                                                                   caplog, monkeypatch):
    """final/drafter (and each checkpoint's drafter) once recorded no target, so validating it against another
    target gave no warning; and targets were compared by their folder's last name only."""
    import json
    import shutil
    from pathlib import Path

    from inference.checks import preflight
    from test_train_run import FAST, run, tiny_input_dirs

    d = tiny_input_dirs(tmp_path_factory)
    run(tmp_path / "run", f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "train.max_steps=1",
        "train.batch_size=4", "train.anchors=8", "eval.batches=1", "data.max_length=77")
    draft = tmp_path / "run" / "final" / "drafter"
    recorded = json.loads((draft / "config.json").read_text())["draftsmith"]
    assert recorded["target"] == str(Path(d["target"]).resolve()) and recorded["recipe"] == "tiny"
    # The data trained on is the prepared folder's (data.prepared is used as it is), not the recipe's keys.
    meta = json.loads((Path(d["data"]) / "draftsmith_data.json").read_text())
    assert recorded["data"]["source"] == meta["source"] and recorded["data"].get("max_length") == meta["max_length"]
    assert meta["max_length"] != 77
    from export.source import resolve_source

    assert resolve_source(tmp_path / "run").provenance["data"] == recorded["data"]  # what an export records
    twin = tmp_path / "elsewhere" / Path(d["target"]).name  # another folder with the same name (and weights)
    shutil.copytree(d["target"], twin)
    monkeypatch.chdir(Path(d["target"]).parent)
    for target, warns in ((Path(d["target"]).name, False), (twin, True)):  # a relative path to the same folder
        caplog.clear()
        with caplog.at_level("WARNING", logger="inference"):
            assert preflight(str(target), str(draft)).recorded_target == recorded["target"]
        assert ("records its target as" in caplog.text) == warns, caplog.text


def test_validate_empty_or_missing_prompt_set(infer_dirs, capsys):
    import json

    empty = infer_dirs["root"] / "empty.jsonl"
    empty.write_text(json.dumps({"messages": [{"role": "assistant", "content": "no user turn"}]}) + "\n")
    with pytest.raises(ValueError, match="no usable prompts"):
        _validate(infer_dirs, "--prompts", str(empty))
    with pytest.raises(FileNotFoundError, match="--prompts nope.jsonl: no such file or folder \\(the shipped sets: "
                                                "code, math, chat, long or all\\)"):
        _validate(infer_dirs, "--prompts", "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="'cod' is not a shipped prompt set"):  # the names are listed
        _validate(infer_dirs, "--prompts", "cod")
    with pytest.raises(SystemExit):
        _validate(infer_dirs, "--n", "0")
    assert "--n 0: give at least 1 prompt" in capsys.readouterr().err


def test_a_second_validate_into_the_same_out_sets_the_first_report_aside(infer_dirs, tmp_path, capsys):
    """Two runs into the same --out (the default ./validate-report, say the bf16 target and then the 4-bit one):
    the second overwrote the first's report.json without a word, and --compare had nothing left to compare."""
    import json

    from inference.validate import main

    out = tmp_path / "val"
    for tokens in ("2", "3"):
        main(["--backend", "torch", "--target", infer_dirs["full_dir"], "--draft", infer_dirs["draft"], "--prompts",
              "chat", "--n", "1", "--max-new-tokens", tokens, "--no-progress", "--out", str(out)])
    assert f"{out / 'report.json'} of an earlier run set aside as report.json.old" in capsys.readouterr().err
    assert json.loads((out / "report.json.old").read_text())["max_new_tokens"] == 2
    assert json.loads((out / "report.json").read_text())["max_new_tokens"] == 3
    assert len(main(["--compare", str(out / "report.json.old"), str(out), "--out", str(tmp_path / "cmp")])["rows"])


def test_a_validate_into_an_out_another_run_is_writing_is_refused_before_the_models_load(infer_dirs, tmp_path):
    """Two runs into the same --out at once shared partial.jsonl: the second set the first's rows aside (or both
    appended to one file) and the first to finish deleted it. The second is refused, naming the holder's pid; a
    run that ended (even by an error) leaves the folder free. An --out that cannot be created fails before the
    models load, not after."""
    import os

    from inference import partial
    from inference.validate import main
    from models.lock import hold

    out = tmp_path / "val"
    args = ["--backend", "torch", "--target", infer_dirs["full_dir"], "--draft", infer_dirs["draft"], "--prompts",
            "chat", "--n", "1", "--max-new-tokens", "2", "--no-progress", "--out", str(out)]
    with hold(out, partial.LOCK, "--out", "-"):
        (out / partial.PARTIAL).write_text("the other run's rows\n")
        with pytest.raises(ValueError, match=f"--out {out} is in use by another run \\(pid {os.getpid()}\\): wait"):
            main(args)
        assert (out / partial.PARTIAL).read_text() == "the other run's rows\n"
    with pytest.raises(FileNotFoundError):  # a run that fails inside its hold lets the next one in
        main(args[:7] + ["nope.jsonl"] + args[8:])
    with pytest.raises(FileNotFoundError):  # and leaves no folder of its own behind
        main(args[:7] + ["nope.jsonl"] + args[8:-1] + [str(tmp_path / "fresh")])
    assert not (tmp_path / "fresh").exists()
    (out / partial.PARTIAL).unlink()
    assert main(args)["num_prompts"] == 1
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="--out .*afile/val: cannot write there .*give a folder you can write to"):
        main(args[:-1] + [str(tmp_path / "afile" / "val")])


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


def test_unknown_dtype(infer_dirs):
    for run in (_generate, _validate):
        extra = ("--prompt-ids", "1") if run is _generate else ()
        with pytest.raises(ValueError, match="--dtype 'float64' .* use one of float32, bfloat16, float16"):
            run(infer_dirs, *extra, "--dtype", "float64")
        # before the folders are read (a Hub id would be fetched first)
        with pytest.raises(ValueError, match="--dtype 'float64' .* use one of float32, bfloat16, float16"):
            run(infer_dirs, *extra, "--dtype", "float64", target="/no/such/target", draft="/no/such/drafter")


def test_compare_needs_reports(infer_dirs, capsys):
    from inference.validate import main

    other = infer_dirs["root"] / "other.json"
    other.write_text("{}")
    with pytest.raises(ValueError, match="is not a report.json written by python -m inference.validate"):
        main(["--compare", str(other), str(other)])
    with pytest.raises(SystemExit):
        main(["--compare", str(other)])
    assert "at least two report.json" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_loops_refuse_the_same_things(infer_dirs, backend):
    """Both loops share inference.checks: the same refusals, the same words."""
    from conftest import ReferenceProposer

    if backend == "mlx":
        pytest.importorskip("mlx_lm")
        from inference import mlx_loop as loop
        from models.target_mlx import TargetModel

        target = TargetModel.from_pretrained(infer_dirs["full_dir"])
    else:
        from inference import torch_loop as loop

        target = infer_dirs["full"]
    prop = ReferenceProposer(list(range(100)), [1, 3, 5], 4, 288)
    for kw, message in [({"prompt_ids": []}, "the prompt is empty"),
                        ({"max_new_tokens": 0}, "max_new_tokens=0: ask for at least one token"),
                        ({"temperature": -1.0}, "--temperature -1.0: use 0 for greedy")]:
        args = {"prompt_ids": [1, 2, 3], **kw}
        with pytest.raises(ValueError, match=message):
            loop.dflash_generate(target, prop, **args)
        with pytest.raises(ValueError, match=message):
            loop.target_generate(target, **args)


def test_mlx_loop_draft_cache_out_of_step_is_an_error_not_an_assert(infer_dirs):
    pytest.importorskip("mlx_lm")
    from conftest import ReferenceProposer
    from inference import mlx_loop
    from models.target_mlx import TargetModel

    class Lagging(ReferenceProposer):
        def context_length(self) -> int:
            return self.seen - 1  # a proposer that lost a position

    target = TargetModel.from_pretrained(infer_dirs["full_dir"])
    with pytest.raises(RuntimeError, match="draft cache holds .* positions but .* are committed"):
        mlx_loop.dflash_generate(target, Lagging(list(range(200)), [1, 3, 5], 4, 288), [1, 2, 3], max_new_tokens=8)


def test_torch_loop_choice_on_the_mlx_backend(tmp_path):
    """--loop picks among the torch loops: asking the MLX backend for one is refused before anything loads."""
    from inference.generate import Session

    with pytest.raises(ValueError, match="--loop static is a torch loop; the MLX backend runs its own"):
        Session("mlx", str(tmp_path / "t"), str(tmp_path / "d"), loop="static")
    with pytest.raises(ValueError, match="--loop 'graphs': use one of auto, eager, static, compiled"):
        Session("torch", str(tmp_path / "t"), str(tmp_path / "d"), loop="graphs")


def test_validate_mistake_prints_one_line(infer_dirs, tmp_path):
    import subprocess
    import sys

    # --out under tmp_path: the default ./validate-report was left in the checkout (validate claims it first)
    out = subprocess.run([sys.executable, "-m", "inference.validate", "--target", infer_dirs["draft"], "--draft",
                          infer_dirs["target"], "--out", str(tmp_path / "report")], capture_output=True, text=True)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "error: --target" in out.stderr and "swap them" in out.stderr



def test_mlx_rollback_of_an_unsupported_cache_is_a_user_error():
    """Once a bare TypeError (a traceback, as for a bug); now one line naming the supported caches."""
    pytest.importorskip("mlx.core")
    from inference.rollback_mlx import CacheRollback
    from models.cli import is_user_error
    from models.target import UnsupportedTarget

    class FixedCache:  # an mlx_lm cache kind that cannot be trimmed
        def is_trimmable(self) -> bool:
            return False

    class NoLinear:
        def linear_attention_layers(self):
            return []

    with pytest.raises(UnsupportedTarget, match="cannot roll back a FixedCache cache") as err:
        CacheRollback(NoLinear()).commit([FixedCache()], keep=1, block_len=4)
    assert is_user_error(err.value)


@pytest.mark.parametrize("run", [_generate, _validate])
def test_device_that_is_no_device_before_any_weights_load(infer_dirs, run):
    """torch's "Expected one of cpu, cuda, ... device type at start of device string: foo" traceback came after
    the target loaded (the target here has no weights: a later check would fail differently)."""
    extra = ("--prompt-ids", "1") if run is _generate else ()
    with pytest.raises(ValueError, match=r"--device 'foo': use cpu, cuda \(cuda:N for another GPU\) or mps, or "
                                         "leave it out"):
        run(infer_dirs, *extra, "--device", "foo")


def test_short_dtype_names_are_the_ones_training_takes(infer_dirs):
    import torch

    from inference.generate import Session
    from models.cli import parse_dtype

    assert [parse_dtype(n) for n in ("bf16", "fp16", "half", "fp32", "BFloat16")] == \
        ["bfloat16", "float16", "float16", "float32", "bfloat16"]
    session = Session("torch", infer_dirs["full_dir"], infer_dirs["draft"], device="cpu", dtype="bf16")
    assert session.target.dtype == torch.bfloat16


def test_generate_prompt_that_is_not_utf8(infer_dirs, capsys):
    """$'caf\\xe9' in a UTF-8 shell reaches Python surrogate-escaped: the tokenizer raised a TypeError."""
    with pytest.raises(SystemExit):
        _generate(infer_dirs, "--prompt", "caf\udce9")
    assert "--prompt is not UTF-8 text (an undecodable byte at character 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the text around the byte, from the start when it is near the start
        _generate(infer_dirs, "--prompt", "caf\udce9 au lait, merci beaucoup")
    assert "character 3: 'caf\\udce9 au lait,')" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_truncated_config_json_is_named(infer_dirs, tmp_path, which):
    """It said "error: Expecting value: line 6 column 23 (char 100)": no file."""
    import shutil

    folder = shutil.copytree(infer_dirs[which], tmp_path / which)
    config = folder / "config.json"
    config.write_text(config.read_text()[:100])
    with pytest.raises(ValueError, match=f"{re.escape(str(config))} is not valid JSON"):
        _generate(infer_dirs, "--prompt-ids", "1", **{which: str(folder)})


def test_a_truncated_tokenizer_json_is_named(infer_dirs, tmp_path):
    import shutil

    from data.prepare import prepare
    from models.target import TargetModel

    folder = shutil.copytree(infer_dirs["full_dir"], tmp_path / "target")
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text()[:200])
    said = f"{re.escape(str(tokenizer))} is not valid JSON"
    with pytest.raises(ValueError, match=said):  # generate, validate, extract, training
        TargetModel.from_pretrained(folder)
    with pytest.raises(ValueError, match=said):
        prepare(str(folder), str(_DATA_FIX / "openai.jsonl"), tmp_path / "data", progress=False)


def test_validate_prompts_that_are_not_utf8_name_the_file_and_line(tmp_path, capsys):
    from inference.prompt_sets import load_prompts

    rows = tmp_path / "latin1.jsonl"
    rows.write_bytes('{"messages": [{"role": "user", "content": "café"}]}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=f"no usable prompts .*; skipped not UTF-8 text: 1, first at {rows} line 1"):
        load_prompts(str(rows))
    with rows.open("a") as f:
        f.write('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert len(load_prompts(str(rows))) == 1
    assert f"skipped 1 row(s) (not UTF-8 text: 1, first at {rows} line 1)" in capsys.readouterr().err


def test_compare_given_a_json_list_or_a_report_folder(tmp_path, monkeypatch, capsys):
    """A JSON list was an AttributeError traceback; validate's --out folder said "no such file"."""
    import json

    import inference.validate
    from inference.validate import main

    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json is not a report.json written by python -m inference.validate"):
        main(["--compare", str(listed), str(listed), "--out", str(tmp_path / "cmp")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty is a folder without report.json"):
        main(["--compare", str(tmp_path / "empty"), str(listed), "--out", str(tmp_path / "cmp")])
    for name in ("bf16", "q4"):  # what validate --out writes: the folder stands for its report.json
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps({"schema": "draftsmith.validate/1", "tau": 4.0}))
    monkeypatch.setattr(inference.validate, "write_plot", lambda *a: None)
    rows = main(["--compare", str(tmp_path / "bf16"), str(tmp_path / "q4"), "--out", str(tmp_path / "cmp")])["rows"]
    assert rows[0] == ["metric", "bf16", "q4", "q4/bf16"]
    (tmp_path / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")  # a file that is not text at all
    with pytest.raises(ValueError, match="--compare .*plot.png is not valid JSON"):
        main(["--compare", str(tmp_path / "plot.png"), str(tmp_path / "q4"), "--out", str(tmp_path / "cmp")])
    with pytest.raises(FileNotFoundError, match="--compare .*nope.json: no such file"):
        main(["--compare", str(tmp_path / "nope.json"), str(tmp_path / "q4"), "--out", str(tmp_path / "cmp")])


# ---------------------------------------------------------------- export and push (export/)
@pytest.fixture
def export_drafter(tmp_path):
    """A small drafter folder (HF layout, fp32) as training writes final/drafter."""
    import torch

    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel

    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=300, num_target_layers=8,
                       target_layer_ids=[1, 3, 5], mask_token_id=290, block_size=4, torch_dtype="float32")
    torch.manual_seed(0)
    return DFlashDraftModel(cfg).save_pretrained(tmp_path / "drafter")


def _export_error(module: str, argv: list[str]) -> str:
    """The one line an export command ends with on a user mistake."""
    import importlib

    from models.cli import run_cli

    main = importlib.import_module(f"export.{module}").main
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main(argv))
    message = str(e.value.code)
    assert message.startswith("error: ") and "Traceback" not in message
    return message


def _export_case(case: str, root, drafter) -> list[str]:
    """Set up the mistake ``case`` under ``root``; returns the command's arguments."""
    import json

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
    from export.hf import main as export_hf

    import os
    import time

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


@pytest.mark.parametrize("module, argv, said", [
    ("generate", ["--target", "t", "--draft", "d", "--prompt", "hi", "--seed", "-5"], "--seed -5: use 0 to 2**64 - 1"),
    ("validate", ["--target", "t", "--draft", "d", "--seed", "-5"], "--seed -5: use 0 to 2**64 - 1"),
    # past 64 bits: MLX's TypeError or torch's ValueError once the models had loaded
    ("generate", ["--target", "t", "--draft", "d", "--prompt", "hi", "--seed", str(2**64)], f"--seed {2**64}: use 0"),
    ("validate", ["--target", "t", "--draft", "d", "--seed", str(2**64)], f"--seed {2**64}: use 0"),
    ("validate", ["--target", "t", "--draft", "d", "--out", "FILE"], "is a file: give a folder for the report"),
    # one token comes from the prefill: tau and speeds were reported as 0 (undefined)
    ("validate", ["--target", "t", "--draft", "d", "--max-new-tokens", "1"], "validate needs at least 2"),
    ("validate", ["--target", "t", "--draft", "d", "--repeats", "0"], "--repeats must be at least 1"),
    ("validate", ["--target", "t"], "give --target and --draft (or --compare A.json B.json ...)"),
    # "the prompt is empty" once the target had loaded; with --chat, an empty user turn was generated from
    ("generate", ["--target", "t", "--draft", "d", "--prompt", ""], "--prompt is empty: give the text"),
    ("generate", ["--target", "t", "--draft", "d", "--prompt", "  ", "--chat"], "--prompt is empty: give the text"),
    ("generate", ["--target", "t", "--draft", "d", "--prompt", "hi", "--max-new-tokens", "0"],
     "--max-new-tokens must be at least 1"),
    ("generate", ["--target", "t", "--draft", "d", "--prompt", "hi", "--temperature", "inf"],
     "--temperature inf: use 0 for greedy"),
])
def test_generate_and_validate_flags_refused_before_any_model_loads(module, argv, said, tmp_path, capsys):
    """A negative seed was a TypeError from MLX's random key after the models loaded; --out naming a file
    a bare "[Errno 17] File exists" after the whole run."""
    import importlib

    (tmp_path / "FILE").write_text("x")
    argv = [str(tmp_path / "FILE") if a == "FILE" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"inference.{module}").main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_validate_prompts_of_a_set_without_categories_stop_being_read_at_n(tmp_path, monkeypatch):
    """--prompts org/name --n 50 read every row of the data set (thousands) for 50 prompts; a set whose rows name
    their categories is still read whole (a later row may start another category)."""
    import json

    import data.readers
    from inference.prompt_sets import load_prompts

    read = []

    def counting(source, **kwargs):
        for row in real(source, **kwargs):
            read.append(1)
            yield row

    real = data.readers.iter_source_rows
    monkeypatch.setattr(data.readers, "iter_source_rows", counting)
    plain, named = tmp_path / "plain.jsonl", tmp_path / "named.jsonl"
    plain.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(100)))
    named.write_text("".join(json.dumps({"prompt": f"q{i}", "category": "ab"[i >= 90]}) + "\n" for i in range(100)))
    assert [p.messages[0]["content"] for p in load_prompts(str(plain), n=3)] == ["q0", "q1", "q2"]
    assert len(read) == 3
    read.clear()
    assert [p.category for p in load_prompts(str(named), n=3)] == ["a"] * 3 + ["b"] * 3 and len(read) == 100


def test_validate_prompts_missing_file_and_skipped_rows(tmp_path, capsys):
    """A missing prompts file was asked of the Hub (24 s of retries, "Couldn't reach ... on the Hub"); rows
    without a user turn or with broken JSON were dropped without a word."""
    from inference.prompt_sets import load_prompts

    for spec in ("data/nope.jsonl", str(tmp_path / "nope.jsonl"), "./nope"):
        with pytest.raises(FileNotFoundError, match="no such file or folder"):
            load_prompts(spec)
    rows = tmp_path / "mixed.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{broken\n'
                    '{"messages": [{"role": "assistant", "content": "only me"}]}\n')
    assert len(load_prompts(str(rows))) == 1
    assert "skipped 2 row(s) (malformed JSON: 1, no user turn: 1)" in capsys.readouterr().err


@pytest.mark.parametrize("backend, device, said", [
    ("mlx", "cuda", "--device cuda is a torch flag"),  # silently ignored before
    ("torch", "cuda", "--device cuda but torch sees no CUDA device"),  # torch's assertion traceback before
])
def test_session_device_that_cannot_be_used(backend, device, said, monkeypatch):
    import torch

    from inference.generate import Session

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=said):
        Session(backend, "t", "d", device=device)


def test_a_run_or_checkpoint_folder_as_draft_names_the_drafter_inside(tmp_path):
    """--draft runs/NAME/checkpoints/step_N said only "config.json not found"."""
    from inference.checks import preflight

    (tmp_path / "step_3" / "drafter").mkdir(parents=True)
    (tmp_path / "step_3" / "drafter" / "config.json").write_text("{}")
    (tmp_path / "target").mkdir()
    with pytest.raises(FileNotFoundError, match="a training run or checkpoint folder: pass .*step_3/drafter"):
        preflight(str(tmp_path / "target"), str(tmp_path / "step_3"), None)


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


def test_a_checkpoints_state_folder_as_drafter_names_the_drafter_beside_it(tmp_path):
    """--draft checkpoints/step_N/state (the optimizer state) gave no hint; its drafter is step_N/drafter."""
    from models.drafter import DFlashDraftModel

    step = tmp_path / "checkpoints" / "step_8"
    (step / "state").mkdir(parents=True)
    (step / "drafter").mkdir()
    (step / "drafter" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="pass .*step_8/drafter\\)"):
        DFlashDraftModel.from_pretrained(step / "state")


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


def test_validate_warns_of_prompts_past_the_targets_positions(capsys):
    """The long set (5k-token prompts) ran on a 4096-position target without a word."""
    from inference.validate import warn_if_too_long

    assert warn_if_too_long([[1] * 5000, [1] * 100], 64, 4096) == 1
    assert "1 of 2 prompts plus --max-new-tokens 64 run past the target's 4096 positions" in capsys.readouterr().err
    assert warn_if_too_long([[1] * 100], 64, 4096) == 0 and capsys.readouterr().err == ""
    assert warn_if_too_long([[1] * 4032], 64, 4096) == 0 and capsys.readouterr().err == ""  # fills it exactly
    assert warn_if_too_long([[1] * 4100, [1] * 5000, [1] * 10], 64, 4096) == 2
    assert "2 of 3 prompts" in (err := capsys.readouterr().err) and "(longest prompt 5000 tokens)" in err


def test_generate_warns_of_a_prompt_past_the_targets_positions(tmp_path, capsys):
    """A 6000-token prompt on a 4096-position target generated on the eager loop without a word."""
    from inference.bench import tiny_folders
    from inference.generate import main, warn_past_positions

    target, draft = tiny_folders("qwen3", str(tmp_path))
    main(["--target", target, "--draft", draft, "--prompt-ids", ",".join(["85"] * 4100), "--max-new-tokens", "2",
          "--backend", "torch", "--device", "cpu", "--loop", "eager"])
    err = capsys.readouterr().err
    assert "the 4100-token prompt plus --max-new-tokens 2 runs past the target's 4096 positions" in err
    assert "shorten the prompt to under 4096 tokens" in err
    assert warn_past_positions(4000, 200, 4096) and "lower --max-new-tokens to 96" in capsys.readouterr().err
    assert not warn_past_positions(4032, 64, 4096) and capsys.readouterr().err == ""  # fills it exactly
    assert warn_past_positions(4096, 1, 4096) and "shorten the prompt to under 4096 tokens" in capsys.readouterr().err


def _without_chat_template(folder, out):
    import shutil

    copy = shutil.copytree(folder, out)
    (copy / "chat_template.jinja").unlink()
    return copy


def test_a_target_without_a_chat_template_is_named_with_the_fix(data_target, infer_dirs, tmp_path):
    """A base model's folder (no chat template): prepare said "no row has loss tokens ... check --max-length",
    local regeneration failed every conversation and said to rerun, generate --chat quoted transformers."""
    from data.prepare import prepare

    said = "has no chat template .*point it at the chat / instruct model's folder"
    base = _without_chat_template(data_target, tmp_path / "base")
    for regenerate in (None, "local"):
        with pytest.raises(ValueError, match=said):
            prepare(str(base), str(_DATA_FIX / "openai.jsonl"), tmp_path / "data", regenerate=regenerate,
                    progress=False)
        assert not (tmp_path / "data").exists()
    full = _without_chat_template(infer_dirs["full_dir"], tmp_path / "full")
    with pytest.raises(ValueError, match=said + ".*or drop --chat"):
        _generate(infer_dirs, "--prompt", "hi", "--chat", "--max-new-tokens", "2", target=str(full))
    with pytest.raises(ValueError, match=said):
        _validate(infer_dirs, "--prompts", "chat", "--n", "1", "--max-new-tokens", "2", target=str(full))


def test_generate_says_dash_where_a_one_token_run_has_no_tau(tmp_path, capsys):
    """--max-new-tokens 1 has no decode step: it printed tau 0.00 and speedup 0.00x (the JSON said null)."""
    from inference.bench import tiny_folders
    from inference.generate import main

    target, draft = tiny_folders("qwen3", str(tmp_path))
    main(["--target", target, "--draft", draft, "--prompt-ids", "257,85,82", "--max-new-tokens", "1",
          "--baseline", "--backend", "torch", "--device", "cpu"])
    err = capsys.readouterr().err
    assert "tau - | decode - tok/s" in err and "speedup -" in err


@pytest.mark.parametrize("module, said", [
    ("data.prepare", "regenerated answers are kept"), ("data.extract", "finished shards are kept"),
    ("export.hf", "--out is untouched"), ("export.mlx", "--out is untouched"), ("export.push", "no commit was made"),
])
def test_ctrl_c_says_what_a_rerun_does(module, said, monkeypatch, capsys):
    """Ctrl-C in these commands once exited 130 without a word (training printed its resume command)."""
    import importlib

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


def test_a_quantized_mlx_drafter_on_the_torch_backend_says_to_use_mlx(tmp_path, export_drafter):
    """It was refused as weights that do not match config.json, with "re-export" as the fix."""
    pytest.importorskip("mlx.core")
    from export.mlx import export_mlx
    from models.drafter import DFlashDraftModel

    export_mlx(export_drafter, tmp_path / "q4", quantize=4, group_size=32, log=lambda *_: None)
    with pytest.raises(ValueError, match="q4 is a quantized MLX export \\(4-bit, group 32\\): only the MLX backend "
                                         "runs it \\(--backend mlx\\)"):
        DFlashDraftModel.from_pretrained(tmp_path / "q4")


def test_a_drafter_folder_with_an_extra_tensor_names_it(tmp_path, export_drafter):
    """A tensor the config does not account for (a layer more than num_hidden_layers) is named, not loaded
    around or reported as a bare state-dict error."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from models.drafter import DFlashDraftModel

    folder = Path(shutil.copytree(export_drafter, tmp_path / "d"))
    state = load_file(str(folder / "model.safetensors"))
    state["layers.1.mlp.up_proj.weight"] = torch.zeros(64, 32)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['layers.1.mlp.up_proj.weight'\].*"
                                         "fix config.json \\(num_hidden_layers"):
        DFlashDraftModel.from_pretrained(folder)


def test_a_drafter_bound_to_a_smaller_vocabulary_or_fed_narrower_features_is_refused(export_drafter):
    """Both come from pairing the drafter with another target; a smaller embedding or narrower features
    failed deep inside a matmul (or drafted ids the target does not have)."""
    import torch

    from models.drafter import DFlashDraftModel

    drafter = DFlashDraftModel.from_pretrained(export_drafter)
    with pytest.raises(ValueError, match="target embedding has 299 rows but the drafter's vocab_size is 300"):
        drafter.bind_target(torch.nn.Embedding(299, 32), torch.nn.Linear(32, 299, bias=False))
    drafter.bind_target(torch.nn.Embedding(300, 32), torch.nn.Linear(32, 300, bias=False))
    for width in (64, 128):
        with pytest.raises(ValueError, match=f"target_hidden has width {width}, expected taps x hidden = 3 x 32"):
            drafter(torch.zeros(1, 4, 32), torch.zeros(1, 2, width), torch.arange(6)[None])


def test_an_mlx_drafter_fed_features_of_another_width_is_refused(export_drafter):
    mx = pytest.importorskip("mlx.core")
    from models.drafter_mlx import DFlashDraftModel

    drafter = DFlashDraftModel.from_pretrained(export_drafter)
    for width in (64, 128):
        with pytest.raises(ValueError, match=f"target_hidden has width {width}, expected taps x hidden = 3 x 32"):
            drafter(mx.zeros((1, 4, 32)), mx.zeros((1, 2, width)), mx.arange(6)[None])


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
    import json
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
    from models.cli import run_cli

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


# ---------------------------------------------------------------- quantized targets
@pytest.fixture(scope="module")
def mlx_q4_folder(tmp_path_factory):
    """A tiny Qwen3 target and its MLX 4-bit (group 32) folder, written by mlx_lm's own functions."""
    pytest.importorskip("mlx_lm")
    from models.quant import quantize_to_mlx
    from models.tiny import save_tiny_target

    root = tmp_path_factory.mktemp("bad_quant")
    src = save_tiny_target(root / "hf", arch="qwen3", num_layers=2)
    return src, quantize_to_mlx(src, root / "q4", bits=4, group_size=32, log=lambda *_: None)


def test_a_target_retrained_in_place_is_quantized_again(tmp_path):
    """The quantized folder's cache key was the target's path, config and the settings: a target retrained or
    fine-tuned in place (same path, same config.json) trained against its old weights, quantized."""
    pytest.importorskip("mlx_lm")
    from safetensors.torch import load_file

    from models.quant import quantize_to_mlx
    from models.tiny import save_tiny_target

    said = []
    src = save_tiny_target(tmp_path / "hf", arch="qwen3", num_layers=2, seed=0)
    first = load_file(str(quantize_to_mlx(src, tmp_path / "q4", bits=4, group_size=32, log=said.append)
                          / "model.safetensors"))
    assert quantize_to_mlx(src, tmp_path / "q4", bits=4, group_size=32, log=said.append) == tmp_path / "q4"
    cached = len(said)  # the same weights: reused, nothing logged
    save_tiny_target(tmp_path / "hf", arch="qwen3", num_layers=2, seed=1)  # the same config, other weights
    again = load_file(str(quantize_to_mlx(src, tmp_path / "q4", bits=4, group_size=32, log=said.append)
                          / "model.safetensors"))
    assert len(said) > cached
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not (first[name] == again[name]).all()


def _copy_with(folder, dst, drop=(), config_update=None):
    """A copy of an MLX folder with some tensors dropped and the config changed."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dst)
    weights = {k: v for k, v in load_file(str(dst / "model.safetensors")).items() if k not in drop}
    save_file(weights, str(dst / "model.safetensors"))
    if config_update:
        config = json.loads((dst / "config.json").read_text())
        config["quantization"].update(config_update)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_fresh_run_over_an_earlier_one_never_mixes_their_checkpoints(tmp_path_factory, tmp_path, capsys):
    """A run without resume=true in a used out_dir once kept the earlier run's later checkpoints, which a
    later resume=true then picked. A finished earlier run is replaced; an unfinished one is refused."""
    import shutil

    from test_train_run import FAST, run, tiny_input_dirs
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
    from test_train_run import FAST, run, tiny_input_dirs
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
    from test_train_run import FAST, run, tiny_input_dirs

    d = tiny_input_dirs(tmp_path_factory)
    run(tmp_path, f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST, "train.max_steps=1",
        "eval.batches=1", "data.eval_rows=1000")
    assert re.search(r"held out \(data.eval_rows=1000 capped at a fifth of the rows\)", capsys.readouterr().out)


def test_held_out_rows_are_the_last_ones_and_at_most_a_fifth(tmp_path_factory, tmp_path):
    """data.eval_rows rows from the end of the prepared set are held out (at most a fifth of them); the
    rest, in their order, are trained on."""
    from data.prepare import load_prepared
    from models.target import TargetModel
    from test_train_run import tiny_input_dirs
    from train.config import load_config
    from train.setup import held_out_rows, load_data

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
    from test_train_run import FAST, run, tiny_input_dirs
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
    from test_train_run import FAST, run, tiny_input_dirs

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

    from test_train_run import FAST, losses, run, tiny_input_dirs
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

    from train.objective import block_loss, draw_blocks

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

    from train.objective import sample_anchors

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

    cfg = load_config(["recipe=tiny"], overrides={"train.grad_checkpointing": "Yes", "train.compile": "no",
                                                  "train.betas": " [0.8, 0.9]", "drafter.target_layer_ids": (1, 2, 3)})
    assert (cfg.train.grad_checkpointing, cfg.train.compile, cfg.train.betas) == (True, False, [0.8, 0.9])
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
    from models.quant import QuantizationError
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


def test_mlx_prefix_without_a_path_is_refused():
    from models.quant import QuantizationError, parse_quantization

    with pytest.raises(QuantizationError, match="needs a folder or Hub id after 'mlx:'"):
        parse_quantization("mlx:")


def test_group_size_not_dividing_the_hidden_size_is_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, quantize_to_mlx
    from models.tiny import save_tiny_target

    with pytest.raises(QuantizationError, match="group size 128 does not divide the target's hidden size 64.*"
                                                "use group size \\[32, 64\\]"):
        quantize_to_mlx(mlx_q4_folder[0], tmp_path / "q", bits=4, group_size=128)
    # A vision-language config keeps the text tower's hidden size under text_config.
    nested = save_tiny_target(tmp_path / "vl", arch="qwen3_5_vl", num_layers=2)
    with pytest.raises(QuantizationError, match="group size 128 does not divide the target's hidden size 64"):
        quantize_to_mlx(nested, tmp_path / "q", bits=4, group_size=128)
    assert not (tmp_path / "q").exists()


def test_quantizing_to_a_width_or_family_mlx_lm_cannot_take_is_refused_before_it_loads(mlx_q4_folder, tmp_path):
    """A direct call (python API, the quantization experiment) is checked as target.quantization is: a width MLX
    does not pack, or a model family draftsmith does not train for, is named before mlx_lm reads the weights."""
    import json
    import shutil

    from models.quant import QuantizationError, quantize_to_mlx
    from models.target import UnsupportedTarget

    with pytest.raises(QuantizationError, match="7 bits is not an MLX affine width; use one of \\[2, 3, 4, 5, 6, 8\\]"):
        quantize_to_mlx(mlx_q4_folder[0], tmp_path / "q", bits=7, group_size=32)
    other = shutil.copytree(mlx_q4_folder[0], tmp_path / "gpt2")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedTarget, match="not supported yet: gpt2"):
        quantize_to_mlx(other, tmp_path / "q", bits=4, group_size=32)
    assert not (tmp_path / "q").exists()


def test_missing_scales_is_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, load_mlx_target

    bad = _copy_with(mlx_q4_folder[1], tmp_path / "bad", drop=("model.layers.0.mlp.up_proj.scales",))
    with pytest.raises(QuantizationError, match="up_proj.weight is packed .* but model.layers.0.mlp.up_proj.scales "
                                                "is missing"):
        load_mlx_target(bad)


def test_missing_biases_is_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, load_mlx_target

    bad = _copy_with(mlx_q4_folder[1], tmp_path / "bad", drop=("model.layers.1.self_attn.o_proj.biases",))
    with pytest.raises(QuantizationError, match="o_proj: has .scales but no .biases"):
        load_mlx_target(bad)


def test_config_bits_that_do_not_match_the_weights_are_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, load_mlx_target

    bad = _copy_with(mlx_q4_folder[1], tmp_path / "bad", config_update={"bits": 8})
    with pytest.raises(QuantizationError, match="do not fit 8 bits at group size 32.*does not match the weights"):
        load_mlx_target(bad)


def test_dequantize_refuses_scales_and_biases_of_other_shapes():
    """Biases with fewer groups than the scales must not broadcast (every group would get the first bias); nor may
    one row's groups, read at the wrong group size, spread over the rows."""
    import torch

    from models.quant import QuantizationError, dequantize

    packed, scales, biases = torch.zeros(4, 8, dtype=torch.uint32), torch.ones(4, 2), torch.zeros(4, 2)
    assert dequantize(packed, scales, biases, 32, 4).shape == (4, 64)  # 4 rows of 64 4-bit values
    for s, b in ((scales, torch.zeros(4, 1)), (torch.ones(3, 2), torch.zeros(3, 2))):
        with pytest.raises(QuantizationError, match="wrong bits \\(4\\) or group size"):
            dequantize(packed, s, b, 32, 4)
    # One row of 64 4-bit values with one scale: group 64, not 32 (its 64 values would read as two rows of 32).
    assert dequantize(packed[:1], scales[:1, :1], biases[:1, :1], 64, 4).shape == (1, 64)
    with pytest.raises(QuantizationError, match="holds 64 values per row, but scales \\(1, 1\\) .* expect 32"):
        dequantize(packed[:1], scales[:1, :1], biases[:1, :1], 32, 4)


def test_scales_without_their_weight_are_refused():
    import torch

    from models.quant import QuantizationError, dequantize_weights

    weights = {"a.weight": torch.ones(2, 2), "b.scales": torch.ones(2, 1), "b.biases": torch.zeros(2, 1)}
    with pytest.raises(QuantizationError, match="b.scales has no matching .weight"):
        dequantize_weights(weights, {"quantization": {"bits": 4, "group_size": 32}}, torch.float32)


def test_mlx_path_that_is_not_quantized_is_refused(mlx_q4_folder, tmp_path):
    import json

    from models.quant import QuantizationError, load_mlx_target, resolve_target

    with pytest.raises(QuantizationError, match="has no MLX 'quantization' in its config.json"):
        resolve_target(str(mlx_q4_folder[0]), f"mlx:{mlx_q4_folder[0]}", tmp_path)
    with pytest.raises(QuantizationError, match="has no MLX 'quantization: {bits, group_size}'.*not an MLX affine"):
        load_mlx_target(mlx_q4_folder[0])  # never loaded as if quantized, named "mlx-Nonebit-gNone"
    partial = _copy_with(mlx_q4_folder[1], tmp_path / "partial")
    config = json.loads((partial / "config.json").read_text())
    del config["quantization"]["bits"]
    (partial / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="has no MLX 'quantization: {bits, group_size}'"):
        load_mlx_target(partial)


def test_an_mlx_checkpoint_that_does_not_fit_the_model_names_the_tensors(mlx_q4_folder):
    """A tensor missing, left over or of another shape is named with the model's own names (not the bare
    load_state_dict error, nor a model with a tensor of the wrong size)."""
    import json

    import torch

    from models.quant import QuantizationError, build_hf_model, dequantize_weights, read_safetensors, to_hf_state_dict

    folder = mlx_q4_folder[1]
    config = json.loads((folder / "config.json").read_text())
    state = to_hf_state_dict(dequantize_weights(read_safetensors(folder), config, torch.float32), "qwen3")
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(QuantizationError, match="does not map onto Qwen3ForCausalLM: missing \\['model.norm.weight"):
        build_hf_model(config, missing, torch.float32)
    extra = {**state, "model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}
    with pytest.raises(QuantizationError, match="missing \\[\\], unexpected \\['model.layers.2.mlp.up_proj.weight"):
        build_hf_model(config, extra, torch.float32)
    with pytest.raises(QuantizationError, match="^model.norm.weight: checkpoint shape \\(32,\\) != model shape "
                                                "\\(64,\\)"):
        build_hf_model(config, {**state, "model.norm.weight": torch.ones(32)}, torch.float32)


def test_quantizing_into_a_foreign_folder_is_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, quantize_to_mlx

    (tmp_path / "mine.txt").write_text("not yours")
    with pytest.raises(QuantizationError, match="was not written by draftsmith's quantizer"):
        quantize_to_mlx(mlx_q4_folder[0], tmp_path, bits=4, group_size=32)
    (tmp_path / "empty").mkdir()  # an empty folder made beforehand is not foreign
    assert quantize_to_mlx(mlx_q4_folder[0], tmp_path / "empty", bits=4, group_size=32, log=lambda *_: None) == \
        tmp_path / "empty"


@pytest.mark.parametrize("module, args", [
    ("data.prepare", ["--regenerate", "http://127.0.0.1:9/v1", "--quantization", "mlx-4bit"]),
    ("data.prepare", ["--quantization", "fp8"]),
    ("data.regenerate", ["--server", "http://127.0.0.1:9/v1", "--quantization", "bnb-4bit"]),
])
def test_quantization_flag_without_in_process_generation_is_refused(tmp_path, capsys, module, args):
    """A server generates with the weights it serves: --quantization there would record answers it did not make."""
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit):
        main(["--target", str(tmp_path), "--source", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o"), *args])
    assert "--quantization applies to" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_bnb_without_bitsandbytes_says_what_to_install(monkeypatch, tmp_path):
    import importlib.util

    from models.quant import QuantizationError, resolve_target, transformers_quantization_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(QuantizationError, match="bnb-4bit needs bitsandbytes: pip install bitsandbytes"):
        transformers_quantization_config("bnb-4bit")
    with pytest.raises(QuantizationError, match="bnb-4bit needs bitsandbytes"):  # resolved before any weight loads
        resolve_target("Qwen/Qwen3-8B", "bnb-4bit", tmp_path)


def test_fp8_without_cuda_says_so(monkeypatch):
    import torch

    from models.quant import QuantizationError, transformers_quantization_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QuantizationError, match="fp8 needs a CUDA GPU.*use mlx-8bit"):
        transformers_quantization_config("fp8")



# ---------------------------------------------------------------- scale-out
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
    from train.loop import make_schedule

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


@pytest.mark.parametrize("placement, ok", [
    ({"model.embed_tokens": 0, "model.layers.0": 1, "lm_head": "cpu"}, False),  # offloaded beside GPUs
    ({"model.embed_tokens": "disk", "model.layers.0": 0, "lm_head": 0}, False),
    ({"model": 0, "lm_head": "disk"}, False),
    ({"model.embed_tokens": 0, "model.layers.0": "disk", "lm_head": 0}, True),  # a layer offloaded: slow, correct
    ({"model.embed_tokens": "cpu", "model.layers.0": "cpu", "lm_head": "cpu"}, True),  # a CPU-only run
])
def test_device_map_that_offloads_the_embedding_or_lm_head(placement, ok):
    """The drafter borrows the embedding and LM head weights: offloaded, they are empty placeholders."""
    from types import SimpleNamespace

    from models.target import check_borrowed_parts_resident

    model = SimpleNamespace(hf_device_map=placement)
    if ok:
        check_borrowed_parts_resident(model)
    else:
        with pytest.raises(ValueError, match="must stay in device memory .* Raise max_memory for the first GPU"):
            check_borrowed_parts_resident(model)


def test_max_memory_that_is_not_device_size_pairs():
    from models.target import parse_max_memory

    assert parse_max_memory("0=70GiB,1=70GiB,cpu=200GiB") == {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}
    with pytest.raises(ValueError, match="write DEVICE=SIZE pairs separated by commas"):
        parse_max_memory("70GiB")
    with pytest.raises(ValueError, match="device 'gpu0' is not a GPU index, 'cpu' or 'disk'"):
        parse_max_memory("gpu0=70GiB")


@pytest.mark.parametrize("kwargs, message", [
    (dict(device_map="everywhere"), "device_map 'everywhere': use one of auto, balanced"),
    (dict(device_map="auto", device="cpu"), "give either device .* or device_map"),
    (dict(max_memory="0=70GiB"), "max_memory needs device_map"),
])
def test_device_map_mistakes_before_any_weights_load(tmp_path, kwargs, message):
    from models.target import TargetModel
    from models.tiny import save_tiny_target

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=4)
    with pytest.raises(ValueError, match=message):
        TargetModel.from_pretrained(folder, **kwargs)



def test_embedding_and_head_only_from_an_incomplete_checkpoint(tmp_path):
    """Offline training reads only the embedding and LM head: shards without them (an interrupted
    download), or no safetensors at all, are named, never loaded as meta or random weights."""
    from safetensors.torch import load_file, save_file

    from models.target import TargetModel
    from models.tiny import save_tiny_target

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    shard = folder / "model.safetensors"
    tensors = load_file(str(shard))
    save_file({k: v for k, v in tensors.items() if "embed_tokens" not in k}, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no tensor named model.embed_tokens.weight.*incomplete download"):
        TargetModel.borrowed_parts(folder)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        TargetModel.borrowed_parts(folder)


def test_embedding_and_head_from_a_broken_sharded_checkpoint_or_an_unreachable_hub(tmp_path, monkeypatch):
    """A shard index that is truncated, or that names a shard not on disk, is named with the fix; a Hub
    target whose weight spans cannot be read (no network) says so, never fingerprints it from less."""
    from data.store import target_identity
    from fake_hub import FakeHub
    from models.target import TargetModel
    from models.tiny import save_tiny_target

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2, max_shard_size="60KB")
    index = folder / "model.safetensors.index.json"
    weight_map = __import__("json").loads(index.read_text())["weight_map"]
    (folder / weight_map["lm_head.weight"]).unlink()
    with pytest.raises(FileNotFoundError, match=f"{weight_map['lm_head.weight']} \\(named in .*index.json for "
                                                "lm_head.weight\\) is missing: an incomplete download"):
        TargetModel.borrowed_parts(folder)
    # A local folder is never fetched into: the whole load names the missing shard too, not a Hub download.
    with pytest.raises(FileNotFoundError, match=f"{weight_map['lm_head.weight']} is listed in .*index.json but "
                                                "missing: the download or export is incomplete"):
        TargetModel.from_pretrained(folder)
    index.write_text(index.read_text()[:40])
    with pytest.raises(ValueError, match="index.json is not a safetensors shard index .*truncated download"):
        TargetModel.borrowed_parts(folder)

    hub = FakeHub(tmp_path / "cache", monkeypatch)
    hub.add("org/t", save_tiny_target(tmp_path / "remote", "qwen3", num_layers=2, max_shard_size="60KB"))

    class Offline:
        def ls(self, *a, **kw):
            raise ConnectionError("no route to host")

    monkeypatch.setattr("huggingface_hub.HfFileSystem", Offline)
    with pytest.raises(OSError, match="could not read the weight files of 'org/t' .*to fingerprint the target "
                                      ".*ConnectionError: no route to host.*hf download org/t"):
        target_identity("org/t")
    with pytest.raises(FileNotFoundError, match="target 'no/such/folder' is neither a local folder nor a Hub id"):
        target_identity("no/such/folder")  # never the fingerprint of nothing
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="target '.*empty': .*empty has no config.json, so it is not a model "
                                                "folder: give the target model's folder or its Hub id"):
        target_identity(str(tmp_path / "empty"))
    # Offline with only the small files cached: the shards to read are named, with the command that fetches them.
    hub.offline = True
    with pytest.raises(OSError, match=r"target 'org/t': \['model-0000\d-of-0000\d\.safetensors'.*\] not in the "
                                      r"local snapshot .* \(HF_HUB_OFFLINE=1\?, or not in the repo\): download "
                                      r"them \(hf download org/t "):
        TargetModel.borrowed_parts("org/t")


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_truncated_or_garbled_target_shard_is_named_by_every_loader(tmp_path, damage):
    """A target cut short by a copy or download ended in a safetensors / mlx_lm traceback (the drafter's
    own loader already named the file)."""
    import importlib.util

    from models.quant import load_mlx_target, quantize_to_mlx
    from models.target import TargetModel
    from models.tiny import save_tiny_target

    def spoil(path):
        data = path.read_bytes()
        path.write_bytes(data[:-1000] if damage == "truncated" else b"\xff" * 8 + data[8:])

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    loaders = [TargetModel.from_pretrained, TargetModel.borrowed_parts]
    if importlib.util.find_spec("mlx_lm") is not None:  # the CPU suite has it ([dev] extra)
        from models.target_mlx import TargetModel as MLXTarget

        loaders.append(MLXTarget.from_pretrained)
        quantized = quantize_to_mlx(folder, tmp_path / "q", bits=4, group_size=32)
        spoil(quantized / "model.safetensors")
        with pytest.raises(ValueError, match="q/model.safetensors is corrupt or truncated.*re-download"):
            load_mlx_target(quantized)
    spoil(folder / "model.safetensors")
    for load in loaders:
        with pytest.raises(ValueError, match="t/model.safetensors is corrupt or truncated.*re-download"):
            load(folder)


@pytest.mark.parametrize("header, said", [
    (b"[]", "unreadable safetensors header"),  # JSON, but no table of tensors
    (b'{"x": 1}', "unreadable safetensors header"),  # a tensor entry that is no table
    (b'{"x": {"data_offsets": []}}', "unreadable safetensors header"),  # offsets without an end
    (b"", "header length 0 in a file of 8 bytes"),
    (b"{}" + b" " * 28, "header length 30 in a file of 36 bytes"),  # cut inside the header
])
def test_a_garbled_safetensors_header_is_named_as_such(tmp_path, header, said):
    """Every way a header can be wrong ends in the same named error, never a KeyError / TypeError
    traceback; a header length past the end of the file says both sizes. ``load_state_dict`` (no
    up-front check) names a truncated file too."""
    from safetensors.torch import save_file

    from models.weights import check_complete, load_state_dict

    path = tmp_path / "model.safetensors"
    data = len(header).to_bytes(8, "little") + header
    path.write_bytes(data[:36] if len(header) == 30 else data)
    with pytest.raises(ValueError, match=f"model.safetensors is corrupt or truncated \\(.*{re.escape(said)}"):
        check_complete(path)
    save_file({"x": torch.ones(64)}, str(path))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="model.safetensors is corrupt or truncated .*re-download"):
        load_state_dict(tmp_path)


def test_a_missing_relative_folder_that_looks_like_a_hub_id_says_both(tmp_path, monkeypatch):
    """``runs/small-target`` (recipe=small before train.small_target built it) is also an org/name id:
    the error names the Hub failure in one line and the local folder that is not there."""
    from models.hub import resolve_model_dir

    def offline(repo_id, **_):
        raise RuntimeError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened ...")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError) as e:
        resolve_model_dir("runs/small-target", what="target")
    message = str(e.value)
    assert "\n" not in message and "Name or service not known)" in message
    assert f"there is no local folder {tmp_path / 'runs' / 'small-target'}" in message and "build it first" in message


def test_a_file_given_for_a_model_folder_is_named(tmp_path, monkeypatch):
    """``--target runs/t/model.safetensors`` (or its config.json) names the folder to pass instead, also when the
    file's path looks like an org/name Hub id."""
    from models.hub import resolve_model_dir

    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("the Hub was asked"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text("{}")
    for given in ("t/config.json", str(tmp_path / "t" / "config.json")):
        with pytest.raises(NotADirectoryError, match=f"target {re.escape(repr(given))} is a file; pass the folder "
                                                     "that holds config.json"):
            resolve_model_dir(given, what="target")


@pytest.mark.parametrize("given", ["./small-target", "../small-target", "/small-target", "-org/name", ".hidden/name"])
def test_a_missing_path_that_cannot_be_a_hub_id_is_named_without_asking_the_hub(tmp_path, monkeypatch, given):
    """A Hub id starts with a letter or digit: ``./small-target`` (or an absolute path) that is not there is a
    missing folder, said at once, not a repo to look up (retries, then a network error that hides the typo)."""
    from models.hub import is_hub_id, resolve_model_dir

    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("the Hub was asked"))
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id(given)
    with pytest.raises(FileNotFoundError, match=f"target {re.escape(repr(given))} is neither a local folder nor a "
                                                "Hub id of the form org/name"):
        resolve_model_dir(given, what="target")


def test_forward_of_a_target_loaded_without_its_layers():
    from models.target import TargetModel
    from models.tiny import tiny_target

    target = TargetModel(tiny_target("qwen3", num_layers=2))
    target.has_layers = False
    with pytest.raises(RuntimeError, match="without its decoder layers.*python -m data.prepare"):
        target.forward(__import__("torch").tensor([[1, 2]]), [0])


# ---------------------------------------------------------------- recipe (train/ablate.py, train/small_target.py)
def stand_in_small_target(folder, chats: int | None = 3, prompts: int | None = 16):
    """A folder with the small target's stamp, chats.jsonl and prompts.jsonl (None: left out), no model:
    enough for the ablation's checks that come before any model is loaded."""
    from train.small_target import STAMP_FILE

    folder.mkdir()
    (folder / STAMP_FILE).write_text("{}")
    for name, n in (("chats.jsonl", chats), ("prompts.jsonl", prompts)):
        if n is not None:
            (folder / name).write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * n)
    return folder


def test_ablation_cell_name_that_does_not_exist():
    from train.ablate import main

    with pytest.raises(ValueError, match="unknown cell 'loss=kll'; did you mean 'loss=kl'"):
        main(["--grid", "paper,loss=kll"])


def test_ablation_budget_larger_than_the_chats_of_the_target(tmp_path):
    from train.ablate import main

    target = stand_in_small_target(tmp_path / "target")
    with pytest.raises(ValueError, match="has 3 conversations, the budget needs 10: use fewer --steps"):
        main(["--grid", "paper", "--steps", "10", "--target", str(target), "--out", str(tmp_path / "abl")])


def test_ablation_target_folder_not_from_small_target(tmp_path):
    from train.ablate import main

    target = stand_in_small_target(tmp_path / "target", chats=None, prompts=None)
    with pytest.raises(FileNotFoundError, match="chats.jsonl not found: the target folder must come from"):
        main(["--grid", "paper", "--target", str(target), "--out", str(tmp_path / "abl")])


def test_ablation_cell_named_twice_in_the_grid_runs_once(tmp_path, monkeypatch):
    """--grid gamma=1,lr=2e-3,gamma=1 queued gamma=1's runs twice: with --workers 2, two processes trained into
    the same folder at once."""
    import train.ablate as ab

    target = stand_in_small_target(tmp_path / "target")
    queued = []
    monkeypatch.setattr(ab, "prepare_data", lambda variant, t, out, **k: ab.variant_folder(variant, out, 3))
    monkeypatch.setattr(ab, "run_all", lambda todo, *a: queued.extend(todo))
    ab.main(["--grid", "gamma=1,lr=2e-3,gamma=1", "--steps", "3", "--seeds", "1", "--workers", "2",
             "--target", str(target), "--out", str(tmp_path / "abl")])
    assert [p.parent.name for p in queued] == ["paper", "gamma=1", "lr=2e-3"]


def test_ablation_target_that_does_not_exist_is_not_built(tmp_path, monkeypatch):
    """A mistyped --target started a ~45-minute build of a new small target there; as train.quant_experiment,
    only the default folder is built when missing."""
    import train.small_target
    from train.ablate import main

    def build(*a, **k):
        raise AssertionError("built a small target")

    monkeypatch.setattr(train.small_target, "build_small_target", build)
    with pytest.raises(FileNotFoundError, match="--target .*typo is not a small target .*leave --target out"):
        main(["--grid", "paper", "--target", str(tmp_path / "typo"), "--out", str(tmp_path / "abl")])
    assert list(tmp_path.iterdir()) == []


def test_ablation_asking_for_more_prompts_than_the_target_holds(tmp_path):
    """The table once said "true tau on 16 held-out prompts" when the target had 2."""
    from train.ablate import main

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
    import json

    import train.distill
    from train.ablate import run_one

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
    from train.ablate import summarize

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
    import json

    from train.ablate import finished

    spec = {"argv": ["x"], "prompts": 2, "max_new_tokens": 8, "target_key": "t", "data_key": "d", "code_key": "now"}
    (tmp_path / "result.json").write_text(json.dumps({**spec, "code_key": "before"}))
    assert finished(tmp_path, spec) and not finished(tmp_path, spec, same_code=True)
    (tmp_path / "result.json").write_text(json.dumps(spec))
    assert finished(tmp_path, spec, same_code=True)


def test_ablation_result_or_training_record_cut_by_a_kill_runs_that_run_again(tmp_path, monkeypatch):
    """A result.json cut short by a kill stopped every rerun (--table-only too) with a bare JSON error naming no
    file; a cut trained.json failed the run the same way on each retry."""
    import json

    import train.distill
    from train.ablate import finished, main, run_one

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
    from train.ablate import code_key

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
    from train.ablate import main

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
    from train.ablate import main
    from train.small_target import build_small_target

    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="--out .*f is a file: give a folder"):
        main(["--grid", "paper", "--out", str(tmp_path / "f"), "--target", str(tmp_path / "t")])
    with pytest.raises(NotADirectoryError, match="f is a file: the small target needs a folder"):
        build_small_target(tmp_path / "f", steps=1)


def test_small_target_refuses_to_build_over_another_folder(tmp_path):
    """--target / --out naming an existing model folder once had it overwritten by a small target."""
    from train.small_target import build_small_target

    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="my-model exists and is not a small target .*Pick another folder"):
        build_small_target(folder, steps=1)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]


def test_ablation_on_cuda_without_a_gpu(monkeypatch):
    import torch

    from train.ablate import main

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
    from train.small_target import main

    with pytest.raises((ValueError, FileNotFoundError), match=message):
        main(["--out", str(tmp_path / "t"), *argv])


# ---------------------------------------------------------------- speed paths (benches, static loop, writers)
# The three benches refuse bad input up front in one line, before any model is built; toy-sized runs
# that used to crash run. No timing is checked.
import importlib  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

TOY_DATA = ["--hidden", "64", "--layers", "6", "--taps", "3", "--vocab", "300", "--rows", "2", "--seq", "16",
            "--batch-size", "2", "--repeats", "1", "--shard-rows", "1", "--dtypes", "bf16"]


def bench(module: str):
    return importlib.import_module(f"{module}.bench").main


def argparse_error(capsys, module: str, argv: list[str]) -> str:
    """The argparse error line (exit status 2) of ``python -m MODULE.bench ARGV``."""
    with pytest.raises(SystemExit) as e:
        bench(module)(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def no_cuda(monkeypatch):
    """As on a machine without CUDA, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_build(monkeypatch):
    """Building a recipe-shaped target fails the test: refusals must come before it."""
    import data.bench

    def refuse(*a, **k):
        raise AssertionError("a random target was built")
    monkeypatch.setattr(data.bench, "recipe_target", refuse)


# ------------------------------------------------------------------ 1. static cache sized for the warm-up too
def test_static_loop_bench_with_few_new_tokens_fits_its_warm_up(capsys):
    """The warm-up generates 2 blocks: a static cache sized from --max-new-tokens 8 alone was too short."""
    bench("inference")(["--tiny", "qwen3", "--loop", "static", "--max-new-tokens", "8", "--prompts", "hi"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["bench"] for x in lines] == ["decode", "decode_parts"]
    assert lines[0]["loop"] == "static" and lines[0]["tokens"] == 8


# ------------------------------------------------------------------ 2. no model source, empty --prompts
def test_inference_bench_without_a_model_says_which_flags_to_give(capsys):
    assert "give --target and --draft, --tiny ARCH or --random-target RECIPE" in argparse_error(
        capsys, "inference", ["--loop", "eager"])


@pytest.mark.parametrize("argv, said", [
    (["--tiny", "qwen3", "--random-target", "tiny"], "--tiny and --random-target each name the models to time"),
    (["--target", "t", "--draft", "d", "--tiny", "llama"], "--target/--draft and --tiny each name the models"),
    (["--tiny", "qwen3", "--prompt-tokens", "8"], "--prompt-tokens 8 sets the random prompts of --random-target"),
])
def test_inference_bench_flags_that_another_one_silently_overrode(capsys, argv, said):
    """--tiny and --random-target took precedence over the models named beside them, and --prompt-tokens did
    nothing without --random-target; the lines printed did not say so."""
    assert said in argparse_error(capsys, "inference", argv)


@pytest.mark.parametrize("argv", [["--tiny", "qwen3", "--cycle", "both"],
                                  ["--random-target", "tiny", "--loop", "eager", "--cycle", "two-graph"]])
def test_inference_bench_cycle_without_a_static_loop_says_what_to_add(capsys, argv):
    """--cycle chooses the static loops' cycle: with none of them timed it would change nothing."""
    assert "chooses how the static and compiled loops run a cycle: add --loop static" in argparse_error(
        capsys, "inference", argv)


def test_the_device_resident_loops_refuse_what_they_cannot_run(tiny_targets):
    """resident=True with sampling, timed parts or a proposer other than the static drafter would silently
    run the two-graph cycle instead: refused by name."""
    from conftest import ReferenceProposer, tiny_drafter_config
    from inference.static_loop import (StaticDrafterProposer, StaticTarget, static_dflash_generate,
                                       static_target_generate)
    from models.drafter import DFlashDraftModel

    target = tiny_targets("qwen3")
    drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=64, block_size=8)
    proposer = StaticDrafterProposer(drafter, target, max_len=64)
    prompt = [257, 85, 82]
    for kw in ({"temperature": 0.7}, {"parts": {}}):
        with pytest.raises(ValueError, match="the device-resident cycle is greedy, untimed by parts"):
            static_dflash_generate(st, proposer, prompt, 4, resident=True, **kw)
    with pytest.raises(ValueError, match="needs the static drafter"):
        static_dflash_generate(st, ReferenceProposer(prompt * 10, [1, 3, 5], 8, 288), prompt, 4, resident=True)
    with pytest.raises(ValueError, match="the device-resident step is greedy"):
        static_target_generate(st, prompt, 4, temperature=0.7, resident=True)


def test_inference_bench_profile_without_a_torch_loop_says_what_to_add(capsys):
    assert "--profile 5 profiles the torch loops: add --loop" in argparse_error(
        capsys, "inference", ["--tiny", "qwen3", "--profile", "5"])


@pytest.mark.parametrize("module", ["train", "inference"])
def test_bench_negative_profile_is_an_argparse_error(capsys, module):
    assert "--profile -1: use 0 or more" in argparse_error(capsys, module, ["--tiny", "qwen3", "--profile", "-1"]
                                                           if module == "inference" else ["--profile", "-1"])


def test_inference_bench_with_an_empty_prompts_flag(capsys):
    assert "argument --prompts: expected at least one argument" in argparse_error(
        capsys, "inference", ["--tiny", "qwen3", "--prompts"])


# ------------------------------------------------------------------ 3. GPU-only combinations without CUDA
@pytest.mark.parametrize("module, argv, message", [
    ("train", ["--e2e", "qwen3-8b"],
     r"--e2e qwen3-8b builds its 8.2B-parameter target: it needs a CUDA GPU.*--e2e tiny"),
    ("inference", ["--random-target", "qwen3-8b"],
     r"--random-target qwen3-8b builds a full-size target: it needs a CUDA GPU.*--random-target tiny.*--device cpu"),
    ("train", ["--attention", "flex"], r"--attention flex needs a CUDA GPU \(flex attention has no CPU backward\)"),
])
def test_gpu_only_bench_runs_are_refused_without_cuda(no_cuda, no_build, module, argv, message):
    with pytest.raises(ValueError, match=message):
        bench(module)(argv)


def test_random_target_on_an_explicit_cpu_device_is_built(no_cuda, monkeypatch):
    """--device cpu is the user's say-so: the full-size target is built (here: the builder is reached)."""
    import inference.bench

    def reached(recipe, device, **kw):
        raise RuntimeError(f"building {recipe} on {device}")
    monkeypatch.setattr(inference.bench, "random_models", reached)
    with pytest.raises(RuntimeError, match="building qwen3-8b on cpu"):
        bench("inference")(["--random-target", "qwen3-8b", "--device", "cpu"])


def test_random_target_runs_in_the_dtype_asked(no_cuda, monkeypatch):
    """--dtype was accepted and ignored with --random-target: a float16 bench timed float32 (bf16 on CUDA) models,
    and its lines did not say so."""
    import inference.bench

    ran = {}
    monkeypatch.setattr(inference.bench, "torch_runs", lambda target, drafter, *a, **k: ran.update(
        target=target.dtype, drafter=drafter.fc.weight.dtype))
    bench("inference")(["--random-target", "tiny", "--dtype", "fp16"])
    assert ran == {"target": torch.float16, "drafter": torch.float16}
    bench("inference")(["--random-target", "tiny"])
    assert ran == {"target": torch.float32, "drafter": torch.float32}  # the default on a CPU, as before


# ------------------------------------------------------------------ 4. the tiny recipe, and recipes without a shape
def test_train_bench_e2e_tiny_runs_the_tiny_recipe(capsys):
    bench("train")(["--e2e", "tiny", "--steps", "1", "--warmup", "0", "--seq", "64", "--anchors", "4"])
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["bench"] == "train_e2e" and row["recipe"] == "tiny"
    assert (row["hidden"], row["layers"], row["block"]) == (64, 2, 8)  # the tiny target's width, tiny.yaml's drafter


def test_train_bench_e2e_with_drafter_shape_flags_says_they_are_the_targets(capsys, no_build):
    """--e2e tiny --heads 8 --intermediate 512 timed the target's shape and reported hidden, heads... as if asked."""
    said = argparse_error(capsys, "train", ["--e2e", "tiny", "--heads", "8", "--interm", "512"])
    assert "--heads, --intermediate with --e2e: the drafter takes the target's shape" in said


def test_inference_bench_random_tiny_target(capsys):
    bench("inference")(["--random-target", "tiny", "--loop", "eager", "--max-new-tokens", "4", "--prompts", "x",
                        "--prompt-tokens", "8"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert lines[0]["bench"] == "decode" and lines[0]["tokens"] == 4 and lines[0]["prompt_tokens"] == 8


@pytest.mark.parametrize("module, flag", [("train", "--e2e"), ("inference", "--random-target")])
def test_a_recipe_without_a_target_shape_names_the_ones_that_work(no_build, module, flag):
    with pytest.raises(ValueError, match=r"recipe 'small' has no random-target shape.*'qwen3-8b'.*'tiny'"):
        bench(module)([flag, "small"])


# ------------------------------------------------------------------ 5. numeric flags out of range
@pytest.mark.parametrize("module, argv, message", [
    ("train", ["--steps", "0"], "--steps 0: use 1 or more"),
    ("train", ["--anchors", "32", "0"], "--anchors 0: use 1 or more"),
    ("train", ["--batch", "0"], "--batch 0: use 1 or more"),
    ("train", ["--grad-accum", "0"], "--grad-accum 0: use 1 or more"),  # timed steps without an optimizer step
    ("train", ["--vocab", "1"], "--vocab 1: use 2 or more"),
    ("train", ["--head-dim", "15"], "--head-dim 15: use an even size"),
    ("data", ["--rows", "0"], "--rows 0: use 1 or more"),
    ("data", ["--repeats", "0"], "--repeats 0: use 1 or more"),
    ("data", ["--seq", "0"], "--seq 0: use 1 or more"),
    ("data", ["--batch-size", "0"], "--batch-size 0: use 1 or more"),
    ("data", ["--hidden", "30"], "--hidden 30: use a multiple of 4 below 256"),
    ("inference", ["--tiny", "qwen3", "--repeat", "0"], "--repeat 0: use 1 or more"),
    ("inference", ["--tiny", "qwen3", "--max-new-tokens", "0"], "--max-new-tokens 0: use 1 or more"),
])
def test_numeric_flags_out_of_range_are_argparse_errors(capsys, no_build, module, argv, message):
    assert message in argparse_error(capsys, module, argv)


# ------------------------------------------------------------------ 6. --device
@pytest.mark.parametrize("module, extra", [("data", []), ("inference", ["--tiny", "qwen3"])])
def test_device_cuda_without_cuda_is_one_line(no_cuda, module, extra):
    with pytest.raises(ValueError, match="--device cuda but torch sees no CUDA device: use --device cpu"):
        bench(module)([*extra, "--device", "cuda"])


@pytest.mark.parametrize("module, extra", [("data", []), ("inference", ["--tiny", "qwen3"])])
def test_device_that_is_no_device_is_an_argparse_error(capsys, module, extra):
    assert "--device 'gpu': use cpu or cuda" in argparse_error(capsys, module, [*extra, "--device", "gpu"])


# ------------------------------------------------------------------ 7. data.bench's feature stores
def bench_stores(tmp: Path) -> list[Path]:
    """The bench's store folders in the temp dir (torch may put its own caches there, e.g. inductor's)."""
    return [p for p in tmp.iterdir() if p.name.startswith("dsbench-")]


def test_data_bench_removes_its_stores(tmp_path, monkeypatch, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bench("data")(TOY_DATA)
    assert "extract" in capsys.readouterr().out
    assert bench_stores(tmp_path) == []


def test_data_bench_removes_its_stores_on_an_error(tmp_path, monkeypatch):
    import tempfile

    import data.store

    def broken(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(data.store, "FeatureStore", broken)  # after the first store is written
    with pytest.raises(KeyboardInterrupt):
        bench("data")(TOY_DATA)
    assert bench_stores(tmp_path) == []


def test_data_bench_keeps_its_stores_when_asked_and_says_where(tmp_path, monkeypatch, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bench("data")([*TOY_DATA, "--keep-stores"])
    (kept,) = bench_stores(tmp_path)
    assert f"feature stores kept in {kept}" in capsys.readouterr().err
    assert (kept / "bf16" / "index.json").is_file()


def test_data_bench_rows_are_built_where_datasets_cannot_pickle_an_arrow_table(pyarrow_pickled_by_value):
    """The bench's random rows carry a named fingerprint: hashing their in-memory table failed on a node whose
    pyarrow dill pickles by value."""
    from data.bench import random_data

    rows = random_data(2, 8, 50)
    assert len(rows) == 2 and rows._fingerprint == "bench-random-2x8-v50"


# ------------------------------------------------------------------ 8. --dtypes
def test_data_bench_unknown_store_dtype_is_refused_before_any_forward(capsys):
    with pytest.raises(SystemExit):
        bench("data")(["--dtypes", "bf16", "fp16"])
    out, err = capsys.readouterr()
    assert out == "" and "argument --dtypes: invalid choice: 'fp16'" in err


# ------------------------------------------------------------------ 9. --loop with MLX, swapped folders
def test_inference_bench_loop_with_the_mlx_backend_is_refused(capsys):
    assert "--loop times the torch loops; the MLX backend runs its own" in argparse_error(
        capsys, "inference", ["--tiny", "qwen3", "--loop", "eager", "--backend", "mlx"])


@pytest.mark.parametrize("loop", [[], ["--loop", "eager"]])
def test_inference_bench_swapped_target_and_draft_says_swap(tmp_path, loop):
    from inference.bench import tiny_folders

    target, draft = tiny_folders("qwen3", str(tmp_path))
    with pytest.raises(ValueError, match=r"swap them \(--target .*target --draft .*draft\)"):
        bench("inference")(["--target", draft, "--draft", target, *loop])


# ------------------------------------------------------------------ 10. --help
@pytest.mark.parametrize("module, default", [
    ("train", "timed steps (default 10)"), ("data", "timed repeats; the best is reported (default 2)"),
    ("inference", "Default: --random-target times static and eager; otherwise one line per prompt through "
                  "generate's auto loop"),
])
def test_bench_help_names_the_command_and_its_defaults(capsys, module, default):
    with pytest.raises(SystemExit) as e:
        bench(module)(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m {module}.bench") and default in " ".join(text.split())


@pytest.mark.parametrize("module, argv", [
    ("train.bench", ["--e2e", "qwen3-8bb"]),
    ("inference.bench", ["--random-target", "qwen3-8bb"]),
])
def test_bench_with_an_unknown_recipe_shape(module, argv):
    import importlib

    with pytest.raises(ValueError, match="no recipe 'qwen3-8bb': use one of"):
        importlib.import_module(module).main(argv)


def test_static_loop_on_an_unsupported_layer_kind_says_to_use_the_eager_loop():
    """Sliding-window layers, and linear-attention layers of a family other than Qwen3.5 (whose GatedDeltaNet
    is the only one the static loop keeps states for), are refused by name."""
    from inference.static_loop import StaticTarget
    from models.target import TargetModel
    from models.tiny import tiny_target

    target = TargetModel(tiny_target("qwen3", num_layers=2))
    for kinds in (["full_attention", "sliding_attention"], ["full_attention", "linear_attention"]):
        target.layer_types = kinds
        with pytest.raises(ValueError, match="supports full-attention and Qwen3.5 GatedDeltaNet.*use the eager loop"):
            StaticTarget(target, [0], max_len=64, block_size=8)


def test_static_gated_delta_net_pass_outside_its_kept_states(tiny_targets):
    """The GatedDeltaNet rollback picks a kept state: a pass that skips ahead or goes back too far is refused, and
    so is a first pass that does not start at 0 (its message named positions -1 to -1)."""
    import torch

    from inference.static_loop import StaticTarget

    st = StaticTarget(tiny_targets("qwen3_5"), [1, 3], max_len=64, block_size=8)
    with pytest.raises(RuntimeError, match="no state kept yet: a sequence's first pass starts at 0; a pass cannot "
                                           "start at 1"):
        st.forward(torch.tensor([[1]]), 1)
    st.forward(torch.tensor([[1, 2, 3, 4, 5]]), 0)
    st.forward(torch.tensor([[1] * 8]), 5)
    for start in (14, 5):  # past the last kept state; before the first (no position of the last pass committed)
        with pytest.raises(RuntimeError, match=f"kept for positions 5 to 12; a pass cannot start at {start}"):
            st.forward(torch.tensor([[1]]), start)
    st.forward(torch.tensor([[1]]), 13)  # every position of the last pass committed


def test_static_loop_past_its_preallocated_length(tiny_targets):
    import torch

    from inference.static_loop import StaticTarget

    st = StaticTarget(tiny_targets("qwen3"), [1, 3], max_len=16, block_size=8)
    with pytest.raises(ValueError, match="static cache holds 16 positions.*raise max_len"):
        st.forward(torch.zeros(1, 8, dtype=torch.long), start=12)
    st.forward(torch.zeros(1, 8, dtype=torch.long), start=0)
    assert st.forward(torch.zeros(1, 8, dtype=torch.long), start=8)[1].shape[1] == 8  # the last slot fits


def test_static_loop_refuses_what_it_cannot_run_exactly(tiny_targets):
    """An empty prompt, a drafter with sliding-window layers, a target loaded with flash attention (the static
    mask of stale slots would be ignored), a block of another size and features that do not continue the
    drafter's cache each get a named error instead of wrong drafts or an opaque traceback."""
    import torch

    from conftest import tiny_drafter_config
    from inference.static_loop import (StaticDrafterProposer, StaticLoopUnsupported, StaticTarget,
                                       static_dflash_generate)
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import tiny_target

    target = tiny_targets("qwen3")
    torch.manual_seed(0)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=64, block_size=8)
    proposer = StaticDrafterProposer(drafter, target, max_len=64)
    with pytest.raises(ValueError, match="the prompt is empty"):
        static_dflash_generate(st, proposer, [], 8)
    sliding = tiny_drafter_config(target, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                  sliding_block_attention="causal")
    with pytest.raises(StaticLoopUnsupported, match="sliding-window layers: use the eager loop"):
        StaticDrafterProposer(DFlashDraftModel(sliding), target, max_len=64)
    flash = TargetModel(tiny_target("qwen3", num_layers=2))
    flash.model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(StaticLoopUnsupported, match="needs attn_implementation 'sdpa' or 'eager'"):
        StaticTarget(flash, [0], max_len=64, block_size=8)
    with pytest.raises(ValueError, match="the target has 2 decoder layers"):  # a drafter of another target
        StaticDrafterProposer(drafter, flash, max_len=64)
    feats = torch.zeros(1, 5, drafter.config.fc_in_features)
    with pytest.raises(StaticLoopUnsupported, match="built for blocks of 8; got 4"):
        proposer.propose(1, feats, 5, 4)
    proposer.propose(1, feats, 5, 8)
    with pytest.raises(RuntimeError, match="draft cache holds 5 positions but 2 new features end at 9"):
        proposer.propose(1, feats[:, :2], 9, 8)


def test_static_loop_refuses_weights_replaced_after_it_was_built():
    """Casting or moving the drafter or the target after its static loop was built left the loop's fused
    q|k|v and gate|up matrices (and on CUDA its captured graphs) on the old tensors: the static drafts
    silently came from the old weights. An in-place update (an optimizer step, load_state_dict) is fine."""
    import torch

    from conftest import tiny_drafter_config
    from inference.static_loop import build_static_loop, static_dflash_generate, static_target_generate
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer

    target = TargetModel(tiny_target("qwen3"), tiny_tokenizer())  # its own: it gets cast below
    torch.manual_seed(0)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
    st, proposer = build_static_loop(target, drafter, max_len=64)
    first = static_dflash_generate(st, proposer, [5, 6, 7], 8, eos_token_ids=[])
    original = {k: v.clone() for k, v in drafter.state_dict().items()}
    with torch.no_grad():
        drafter.load_state_dict(original)
        drafter.layers[0].self_attn.q_proj.weight.mul_(1.0)
    assert static_dflash_generate(st, proposer, [5, 6, 7], 8, eos_token_ids=[]).tokens == first.tokens
    # other weights loaded as new tensors: the fused q|k|v would have kept the old ones without a word
    other = {k: v + 0.01 for k, v in drafter.state_dict().items()}
    drafter.load_state_dict(other, assign=True)
    with pytest.raises(RuntimeError, match="the drafter's weights were replaced .* build the static loop again"):
        static_dflash_generate(st, proposer, [5, 6, 7], 8, eos_token_ids=[])
    drafter.to(torch.float64)
    with pytest.raises(RuntimeError, match="the drafter's weights were replaced"):
        static_dflash_generate(st, proposer, [5, 6, 7], 8, eos_token_ids=[])
    drafter.load_state_dict({k: v.clone() for k, v in original.items()}, assign=True)
    st, proposer = build_static_loop(target, drafter.to(torch.float32), max_len=64)
    assert static_dflash_generate(st, proposer, [5, 6, 7], 8, eos_token_ids=[]).tokens == first.tokens
    target.model.to(torch.float64)
    with pytest.raises(RuntimeError, match="the target's weights were replaced .* after changing the target"):
        static_target_generate(st, [5, 6, 7], 4, eos_token_ids=[])


def test_extract_default_taps_on_a_shallow_target_name_the_flag(tmp_path):
    """The default 5 taps need 8 layers; the fix once named target_layer_ids, a key data.extract does not have."""
    from data.extract import extract
    from models.tiny import save_tiny_target

    target = save_tiny_target(tmp_path / "t", "qwen3", num_layers=6)
    with pytest.raises(ValueError, match="default 5 taps do not fit a 6-layer target .*pass --layers with the "
                                         "drafter's target_layer_ids, e.g. --layers 1 2 3$"):
        extract(str(target), [], tmp_path / "feats")
    # A negative id once got as far as writing the store's index (then refusing the corrected rerun), and
    # an id past the end was reported as "the last layer cannot be tapped".
    for ids, bad in (([-1, 2], "\\[-1\\]"), ([1, 2, 9], "\\[9\\]"), ([1, 5], "\\[5\\]")):
        with pytest.raises(ValueError, match=f"layer ids {bad} are outside \\[0, 5\\) for a 6-layer target"):
            extract(str(target), [], tmp_path / "feats", layer_ids=ids)
    with pytest.raises(ValueError, match="a layer is tapped twice"):
        extract(str(target), [], tmp_path / "feats", layer_ids=[1, 1])
    assert not (tmp_path / "feats").exists()


def test_extract_layers_past_the_targets_depth_are_refused_before_its_weights_load(infer_dirs, tmp_path,
                                                                                   monkeypatch):
    """--layers 9 on an 8-layer target (a drafter config of another target copied in) was refused only after the
    target had loaded, minutes for a large one: its config.json says the depth."""
    import data.extract
    import models.target

    monkeypatch.setattr(models.target.TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("target loaded"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "draftsmith_data.json").write_text("{}")
    argv = ["--target", infer_dirs["target"], "--data", str(tmp_path / "data"), "--out", str(tmp_path / "feats"),
            "--device", "cpu", "--layers"]
    with pytest.raises(ValueError, match=r"layer ids \[9\] are outside \[0, 7\) for a 8-layer target"):
        data.extract.main([*argv, "1", "4", "9"])
    with pytest.raises(ValueError, match="a layer is tapped twice"):
        data.extract.main([*argv, "1", "1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_extract_layers_of_a_multimodal_target_are_checked_against_its_text_config(tmp_path, monkeypatch):
    """Qwen3.5 checkpoints keep their depth under text_config: --layers past it is refused from there too,
    before the weights load."""
    import json

    import data.extract
    import models.target

    monkeypatch.setattr(models.target.TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("target loaded"))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"model_type": "qwen3_5",
                                                            "text_config": {"num_hidden_layers": 8}}))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "draftsmith_data.json").write_text("{}")
    with pytest.raises(ValueError, match=r"layer ids \[7\] are outside \[0, 7\) for a 8-layer target"):
        data.extract.main(["--target", str(tmp_path / "t"), "--data", str(tmp_path / "data"),
                           "--out", str(tmp_path / "feats"), "--device", "cpu", "--layers", "1", "7"])
    assert not (tmp_path / "feats").exists()


def test_export_mlx_group_size_without_quantize(capsys):
    """It was ignored: a bf16 export when the user asked for a group size."""
    from export.mlx import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", "c", "--out", "o", "--group-size", "32"])
    assert "--group-size applies to quantized exports: add --quantize 4" in capsys.readouterr().err
    assert parse_args(["--checkpoint", "c", "--out", "o", "--quantize", "4"]).group_size == 64


def test_extract_with_no_writer_threads(capsys):
    from data.extract import main

    with pytest.raises(SystemExit):
        main(["--target", "t", "--data", "d", "--out", "o", "--writers", "0"])
    assert "--writers 0: use 1 or more background shard writers" in capsys.readouterr().err


def test_quant_experiment_refuses_a_negative_seed_before_any_work(tmp_path, capsys):
    """--seed -1 was refused by train.seed only after the small target and the first drafter were built."""
    from train.quant_experiment import main

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
    import train.quant_experiment as qx
    import train.small_target

    monkeypatch.setattr(train.small_target, "build_small_target", lambda *a, **k: pytest.fail("the experiment ran"))
    (tmp_path / "FILE").write_text("x")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    with pytest.raises((SystemExit, ValueError, OSError)) as e:
        qx.main(["--out", str(tmp_path / "out"), *argv])
    assert said.replace("FILE", str(tmp_path / "FILE")) in (str(e.value) + capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, said", [
    (["--topk", "-1"], "--topk -1: use 0 (off)"),  # a TypeError traceback mid-extraction
    (["--batch-size", "0"], "--batch-size 0: use 1 or more"),  # "range() arg 3 must not be zero"
    (["--shard-mb", "0"], "--shard-mb 0.0: use a positive shard size"),  # one-row shards, silently
    (["--shard-mb", "-2"], "--shard-mb -2.0: use a positive shard size"),
])
def test_extract_numeric_flags_out_of_range(tmp_path, capsys, argv, said):
    from data.extract import main

    with pytest.raises(SystemExit):
        main(["--target", "t", "--data", "d", "--out", str(tmp_path / "o"), *argv])
    assert said in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_extract_dtype_device_and_topk_checked_before_anything_is_written(tmp_path, tiny_targets, monkeypatch):
    """--target-dtype bf16 was getattr(torch, "bf16"), --device foo torch's RuntimeError after the weights
    loaded, and --topk past the vocabulary "selected index k out of range" mid-extraction."""
    import data.extract
    import models.target

    loaded = {}

    def load(path, **kwargs):
        loaded.update(kwargs)
        raise KeyboardInterrupt  # stop here: the flags got through

    monkeypatch.setattr(models.target.TargetModel, "from_pretrained", load)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "draftsmith_data.json").write_text("{}")  # a prepared folder, as far as the flags go
    argv = ["--target", "t", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o")]
    with pytest.raises(KeyboardInterrupt):
        data.extract.main([*argv, "--target-dtype", "bf16", "--device", "cpu"])
    assert loaded["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="--device 'foo': use cpu, cuda"):
        data.extract.main([*argv, "--device", "foo"])
    target = tiny_targets("qwen3")
    with pytest.raises(ValueError, match=f"--topk 100000: use 0 \\(off\\) up to the target's vocabulary size "
                                         f"{target.vocab_size}"):
        data.extract.extract(target, "no-data", tmp_path / "o", topk=100000)
    with pytest.raises(ValueError, match="--batch-size 0: use 1 or more rows per target forward"):
        data.extract.extract(target, "no-data", tmp_path / "o", batch_size=0)
    with pytest.raises(ValueError, match="--dtype 'fp16': use one of \\('bf16', 'fp8'\\)"):
        data.extract.extract(target, "no-data", tmp_path / "o", dtype="fp16")
    assert not (tmp_path / "o").exists()


def test_a_store_that_failed_before_its_first_shard_takes_the_corrected_rerun(tmp_path):
    """A crash in the first shard left index.json with the bad settings: the rerun was refused ("already holds a
    store with topk=-1 ... delete it"). A store with a shard on disk is still never mixed with other settings."""
    from data.store import StoreMismatch
    from data.store_writer import StoreWriter

    out = tmp_path / "feats"
    StoreWriter(out, {"topk": -1}, [(0, 1)])  # the failed run: its index, no shard
    assert StoreWriter(out, {"topk": 0}, [(0, 2)]).index["topk"] == 0
    (out / "shard-00000.safetensors").write_bytes(b"x")
    with pytest.raises(StoreMismatch, match="already holds a store with topk=0, this run asks for 4"):
        StoreWriter(out, {"topk": 4}, [(0, 2)])
    recorded = tmp_path / "recorded"  # nor is one whose index records a shard, its files deleted by hand
    header = {"topk": 0, "dtype": "bf16", "layer_ids": [1]}
    StoreWriter(recorded, header, [(0, 2)]).write_shard(0, tiny_store_rows())
    for f in recorded.glob("shard-*"):
        f.unlink()
    with pytest.raises(StoreMismatch, match="already holds a store with topk=0, this run asks for 4"):
        StoreWriter(recorded, {**header, "topk": 4}, [(0, 2)])


def test_an_extraction_into_a_folder_that_is_no_store_is_refused_before_its_target_loads(tmp_path, monkeypatch):
    """--out naming the prepared data (or any folder of one's own) got index.json and the shards written among its
    files, and every *.tmp file there deleted as a "leftover of a killed write"; found only after the target loaded."""
    import data.extract
    import models.target
    from data.store import StoreMismatch
    from data.store_writer import StoreWriter

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.tmp").write_text("draft")
    (mine / "keep.txt").write_text("keep")
    monkeypatch.setattr(models.target.TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("target loaded"))
    with pytest.raises(StoreMismatch, match=f"--out {mine} is not empty and is not a feature store \\(no index.json; "
                                            "it holds keep.txt, notes.tmp\\): data.extract does not write into it"):
        data.extract.main(["--target", "t", "--data", "d", "--out", str(mine), "--device", "cpu"])
    with pytest.raises(StoreMismatch, match="is not a feature store"):
        StoreWriter(mine, {"topk": 0}, [(0, 1)])
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt", "notes.tmp"]
    (tmp_path / "empty").mkdir()  # an empty folder, or one a killed run left only its lock in, is a store's
    (tmp_path / "empty" / data.extract.LOCK).write_text("1\n")
    assert StoreWriter(tmp_path / "empty", {"topk": 0}, [(0, 1)]).index["topk"] == 0


def test_an_extraction_from_a_folder_that_is_no_prepared_data_is_refused_before_its_target_loads(tmp_path,
                                                                                                 monkeypatch):
    """A mistyped --data (or the source JSONL instead of the prepared folder) was named only after the target had
    loaded, minutes for a large one."""
    import data.extract
    import models.target

    monkeypatch.setattr(models.target.TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("target loaded"))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'prepped'} is not a prepared data folder \\(no "
                                                "draftsmith_data.json\\); run python -m data.prepare"):
        data.extract.main(["--target", "t", "--data", str(tmp_path / "prepped"), "--out", str(tmp_path / "feats"),
                           "--device", "cpu"])
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_quant_experiment_drafter_trained_against_another_target_build_group_or_budget_is_trained_again(
        tmp_path, monkeypatch):
    """The cached drafter's folder is named by bits, epochs and seed only: one trained against an earlier build
    of the target, a quantized folder of another group size, or another budget of the same epochs was reused
    and its tau reported as this run's."""
    import json
    import shutil

    import train.distill
    from train.quant_experiment import train_drafter
    from train.small_target import STAMP_FILE

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
    import json

    import models.quant
    import train.quant_experiment as qx
    import train.small_target

    target = stand_in_small_target(tmp_path / "target")
    monkeypatch.setattr(models.quant, "quantize_to_mlx", lambda t, folder, **k: folder)
    monkeypatch.setattr(train.small_target, "small_target_prompt_ids", lambda t, n: [[1, 2]] * n)
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
    import json

    from train.quant_experiment import run

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
    import models.quant
    from train.quant_experiment import run

    monkeypatch.setattr(models.quant, "quantize_to_mlx", lambda *a, **k: pytest.fail("the experiment ran"))
    target = tmp_path / "target"
    target.mkdir()
    (target / "chats.jsonl").write_text("")
    (target / "prompts.jsonl").write_text(prompts)
    with pytest.raises(ValueError, match=said):
        run(tmp_path / "out", "smoke", sweep_bits=(3,), bits=3, target_dir=str(target), log=lambda *_: None)
    assert not (tmp_path / "out").exists()


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


def test_a_chat_template_that_fails_on_every_conversation_is_named_not_blamed_on_max_length(tmp_path):
    """A template that does not render assistant content (here: a placeholder) gives no loss mask for any
    conversation; prepare said "no row has loss tokens ... check --max-length and the data"."""
    from data.rows import tokenize_to_disk
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("chatml")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ '[answer]' if m.role == "
                         "'assistant' else m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    with pytest.raises(ValueError, match=r"the chat template failed on every conversation \(2\): the loss mask"):
        tokenize_to_disk(tok, [chat, chat], tmp_path / "out", tmp_path / "scratch", thinking=None, max_length=None,
                         pack=False, progress=False)


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


def test_help_into_a_closed_pipe_ends_quietly():
    # `python -m train.distill --help | head -3`: the reader leaves first. It printed "error: [Errno 32]
    # Broken pipe", as if the command had failed on the user's input.
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # nobody reads: the first write fails, every time
    try:
        done = subprocess.run([sys.executable, "-m", "train.distill", "--help"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == 1  # what Python's own docs advise on EPIPE: not 0, the output was cut

    from models.cli import run_cli

    def server_went_away():  # a broken pipe that is not our output's (a regeneration server's socket)
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(SystemExit, match=r"^error: \[Errno 32\] Broken pipe"):
        run_cli(server_went_away)


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
    from pathlib import Path

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


# ----------------------------------------------------------------------------- store, data fingerprint, validate
# resume and static-loop buffers (one block, kept at the end of the file)
def test_a_damaged_store_index_or_sidecar_is_named(tmp_path, capsys):
    """A cut index.json gave "Unterminated string starting at: line 17 column 20" naming no file, and extraction
    could not repair it; a cut sidecar stopped the rerun the same way instead of computing its shard again."""
    from data.store import FeatureStore, StoreCorrupt
    from data.store_writer import StoreWriter

    out = tmp_path / "feats"
    header = {"dtype": "bf16", "layer_ids": [1], "topk": 0, "rows": 4}
    w = StoreWriter(out, header, [(0, 2), (2, 4)])
    w.write_shard(0, tiny_store_rows())
    w.write_shard(1, tiny_store_rows())
    side = out / "shard-00001.safetensors.json"
    side.write_text(side.read_text()[:40])
    w.index["shards"].pop("shard-00001.safetensors")  # as if killed before the index took it in
    w.flush_index()
    again = StoreWriter(out, header, [(0, 2), (2, 4)])  # the rerun: shard 1 is computed again
    assert again.done(0) and not again.done(1)
    assert f"{side}: damaged or does not match its shard: that shard is computed again" in capsys.readouterr().err
    again.write_shard(1, tiny_store_rows())
    assert again.finalise()
    index = out / "index.json"
    index.write_text(index.read_text()[:300])
    for opener in (lambda: FeatureStore(out), lambda: StoreWriter(out, header, [(0, 2), (2, 4)])):
        with pytest.raises(StoreCorrupt, match=f"{index}: damaged, not readable as JSON .*delete the folder {out} "
                                               "and re-run the same data.extract command"):
            opener()


def test_a_sidecar_whose_shard_was_cut_is_not_adopted(tmp_path, capsys):
    """Another process's shard that no longer has the size its sidecar names is not taken into the index: the
    store stays unfinished and that shard is computed again, instead of a finished store failing on read."""
    from data.store_writer import StoreWriter

    out = tmp_path / "feats"
    header = {"dtype": "bf16", "layer_ids": [1], "topk": 0, "rows": 4}
    main = StoreWriter(out, header, [(0, 2), (2, 4)])
    main.write_shard(0, tiny_store_rows())
    StoreWriter(out, header, [(0, 2), (2, 4)], main=False).write_shard(1, tiny_store_rows())
    shard = out / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    assert not main.finalise() and main.done(0) and not main.done(1)
    assert "shard-00001.safetensors.json: damaged or does not match its shard" in capsys.readouterr().err


def test_sidecars_that_name_another_shard_or_are_not_an_entry_are_not_adopted(tmp_path, capsys):
    """A sidecar copied under another shard's name, or one holding JSON that is no entry (a list, a key missing),
    leaves its shard to be computed again, with a note; a damaged sidecar of a shard the index holds already is
    no news, so no note. Writers that are not the main one leave index.json alone, and a finished store holds
    no sidecar."""
    import json

    from data.store_writer import StoreWriter

    out = tmp_path / "feats"
    header, plan = {"dtype": "bf16", "layer_ids": [1], "topk": 0}, [(0, 2), (2, 4), (4, 6)]
    w = StoreWriter(out, header, plan)
    index = (out / "index.json").read_bytes()
    for k in range(3):
        StoreWriter(out, header, plan, main=False).write_shard(k, tiny_store_rows())
    assert (out / "index.json").read_bytes() == index  # only the main writer writes the index
    assert w.finalise()
    assert sorted(p.name for p in out.iterdir()) == ["index.json", *(f"shard-0000{k}.safetensors" for k in range(3))]
    for k in (1, 2):
        w.index["shards"].pop(f"shard-0000{k}.safetensors")
    w.flush_index()
    entry = w.index["shards"]["shard-00000.safetensors"]
    (out / "shard-00001.safetensors.json").write_text(json.dumps({**entry, "sha256": "0" * 64}))  # names shard 0
    (out / "shard-00002.safetensors.json").write_text("[]")
    (out / "shard-00000.safetensors.json").write_text("{}")  # shard 0 is in the index: its sidecar is not read
    again = StoreWriter(out, header, plan)
    assert again.index["shards"] == {"shard-00000.safetensors": entry}
    err = capsys.readouterr().err
    assert "shard-00001.safetensors.json: damaged or does not match its shard" in err
    assert "shard-00002.safetensors.json: damaged" in err and "shard-00000" not in err


def test_a_store_folder_that_is_a_file_or_holds_much_else_is_named(tmp_path):
    """--out naming a file is refused as a file; a folder of other things names the first three and counts the
    rest (sub-folders included); a folder holding only a killed first run's index.json.tmp is a store's."""
    from data.store import StoreMismatch
    from data.store_writer import check_store_folder

    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="--out .*f is a file: give a new or empty folder"):
        check_store_folder(tmp_path / "f")
    mine = tmp_path / "mine"
    for name in ("a.txt", "b.txt", "c.txt"):
        (mine / name).parent.mkdir(exist_ok=True)
        (mine / name).write_text("x")
    check = lambda: check_store_folder(mine)  # noqa: E731
    with pytest.raises(StoreMismatch, match="it holds a.txt, b.txt, c.txt\\): data.extract"):
        check()
    (mine / "d").mkdir()
    with pytest.raises(StoreMismatch, match="it holds a.txt, b.txt, c.txt \\(\\+1 more\\)\\): data.extract"):
        check()
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "index.json.tmp").write_text('{"form')
    check_store_folder(killed)


def test_writers_of_one_store_agree_on_its_settings_and_data(tmp_path, capsys):
    """A writer that is not the main one, started with other settings, is refused (its shards would join the
    store); only the main writer finalises. The data is the same when named the same or the same folder spelled
    another way; two names without a fingerprint are two data sets. A reopened store
    adopts the shards other writers finished, drops a shard of another size even unhashed, and the leftover temp
    files of killed writes."""
    from data.store import StoreMismatch
    from data.store_writer import StoreWriter

    out = tmp_path / "feats"
    data = tmp_path / "prepared"
    header, plan = {"dtype": "bf16", "layer_ids": [1], "topk": 0, "data": str(data), "data_fingerprint": None}, \
        [(0, 2), (2, 4), (4, 6)]
    main = StoreWriter(out, header, plan)
    with pytest.raises(StoreMismatch, match="already holds a store with layer_ids=\\[1\\], this run asks for \\[2\\]"):
        StoreWriter(out, {**header, "layer_ids": [2]}, plan, main=False)
    other = StoreWriter(out, header, plan, main=False)
    with pytest.raises(RuntimeError, match="only the main writer finalises a store"):
        other.finalise()
    main.write_shard(0, tiny_store_rows())
    other.write_shard(1, tiny_store_rows())
    other.write_shard(2, tiny_store_rows())
    shard = out / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])  # cut after the index recorded it
    (out / "shard-00002.safetensors.json.tmp").write_text("{")  # a kill while writing a sidecar
    for named in (str(data), str(data / ".." / "prepared")):
        again = StoreWriter(out, {**header, "data": named}, plan, verify_existing=False)
        assert (again.done(0), again.done(1), again.done(2)) == (False, True, True)
    assert not list(out.glob("*.tmp"))
    with pytest.raises(StoreMismatch, match="already holds a store with data="):
        StoreWriter(out, {**header, "data": str(tmp_path / "other")}, plan)


def test_the_prepared_fingerprint_is_the_saved_folders_not_the_selections(tmp_path):
    """The training split is a selection with a fingerprint of its own: the store records the folder's, so the
    folder's is what make_features compares before it compares rows (tests/test_train_modes.py)."""
    from datasets import Dataset, load_from_disk

    from data.store import prepared_fingerprint

    for name, first in (("a", 1), ("b", 2)):
        Dataset.from_dict({"input_ids": [[first, 5], [7, 8, 9]]}).save_to_disk(str(tmp_path / name))
    a, b = load_from_disk(str(tmp_path / "a")), load_from_disk(str(tmp_path / "b"))
    assert prepared_fingerprint(a.select(range(1))) == a._fingerprint != prepared_fingerprint(b.select(range(1)))
    assert prepared_fingerprint(Dataset.from_dict({"x": [1]})) is None  # in memory: nothing to compare


def test_a_store_index_recording_no_target_fingerprint_matches_no_target(tmp_path, tiny_targets):
    """A null target_fingerprint in index.json (written by hand, or by another tool) passed for every target not
    named by a Hub id: the legacy fingerprint of those is None too, and None was "in" (fingerprint, None)."""
    import json

    from data.store import FeatureStore, StoreMismatch

    store = tmp_path / "feats"
    store.mkdir()
    index = {"format": "draftsmith-features", "version": 1, "target": "t", "target_revision": None,
             "target_fingerprint": None, "layer_ids": [1], "plan": [], "shards": {}, "complete": True}
    (store / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreMismatch, match="target: store was extracted from 't' \\(fingerprint None\\).*"
                                            "Re-extract with python -m data.extract"):
        FeatureStore(store, verify=False).check_compatible(target=tiny_targets("qwen3"))


def test_a_store_index_of_another_kind_is_named(tmp_path):
    """index.json holding a JSON list, or another tool's format at the same version, is no store of ours."""
    from data.store import StoreCorrupt, StoreError, read_index

    (tmp_path / "index.json").write_text("[]")
    with pytest.raises(StoreCorrupt, match="index.json: not a feature store index \\(a JSON list\\): delete"):
        read_index(tmp_path)
    (tmp_path / "index.json").write_text('{"format": "other-features", "version": 1}')
    with pytest.raises(StoreError, match="format other-features v1, this reader reads draftsmith-features v1"):
        read_index(tmp_path)


def test_validate_resume_takes_the_same_folder_spelled_another_way_and_names_what_differs(tmp_path, monkeypatch):
    """--target T then --target T/ (the same folder) was "measured with other settings: set aside ... starting over"
    (the key hashed the raw strings); the note did not say which setting differed, and a second set-aside file
    overwrote the first partial.jsonl.old."""
    from inference import partial
    from inference.validate import resume_settings

    (tmp_path / "target").mkdir()
    monkeypatch.chdir(tmp_path)
    env = {"target": "target", "draft": "org/drafter", "temperature": 0.0, "seed": 0}
    same = [resume_settings({**env, "target": t}) for t in ("target", "target/", str(tmp_path / "target"), "./target")]
    assert {partial.settings_key(s) for s in same} == {partial.settings_key(same[0])}
    assert same[0]["draft"] == "org/drafter"  # a Hub id stays as given
    (tmp_path / "p.jsonl").write_text("")  # a prompt file, spelled two ways
    assert resume_settings({"prompts": "p.jsonl"}) == resume_settings({"prompts": "./p.jsonl"})
    assert resume_settings({"prompts": "all"}) == {"prompts": "all"}  # a shipped set's name stays as given
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resume_settings({"target": "~/target"})["target"] == same[0]["target"]  # ~ is the home folder
    out = tmp_path / "val"
    partial.Recorder(out, partial.settings_key(same[0]), same[0])(0, _partial_run(0), {})
    assert set(partial.load(out, partial.settings_key(same[1]), print, same[1])) == {0}  # resumed, not set aside
    notes, olds = [], []
    for seed in (1, 2, 3):
        new = {**same[0], "seed": seed, "temperature": 0.5}
        partial.load(out, partial.settings_key(new), notes.append, new)
        olds.append((out / "partial.jsonl.old").read_text())
        partial.Recorder(out, partial.settings_key(new), new)
    assert notes[0] == (f"note: {out / partial.PARTIAL} was measured with other settings (seed, temperature "
                        "differ): set aside as partial.jsonl.old, starting over")
    assert (out / "partial.jsonl.old.2").read_text() == olds[0]  # the measured rows of the first run, kept
    assert (out / "partial.jsonl.old.1").read_text() == olds[1] and (out / "partial.jsonl.old").read_text() == olds[2]


def test_a_jsonl_row_that_is_json_but_not_an_object_is_counted_as_such(tmp_path):
    """A `[1, 2, 3]` line is valid JSON: it was counted as "malformed JSON", which sends one looking for a typo."""
    from data.readers import load_conversations

    path = tmp_path / "chats.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    path.write_text(f'{good}\n[1, 2, 3]\n"text"\n{{"messages": \n')
    convs, stats = load_conversations(path)
    assert len(convs) == 1 and dict(stats.skipped) == {"JSON that is not an object": 2, "malformed JSON": 1}


def test_fp16_mixed_precision_on_a_cpu_is_refused_before_anything_loads(no_cuda, tmp_path):
    """accelerate ignores fp16 on a CPU (float32 autocast-free steps) while the run recorded fp16."""
    from train.distill import main

    with pytest.raises(ValueError, match="train.mixed_precision=fp16 has no effect on the CPU.*auto"):
        main(["recipe=tiny", "train.mixed_precision=fp16", f"out_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"])
def test_a_drafter_config_without_a_shape_key_is_named_by_export_and_validate(tmp_path, export_drafter, infer_dirs,
                                                                               key):
    """config.json without hidden_size (a hand-edited or foreign drafter) was a KeyError traceback in every loader."""
    import json

    from inference.checks import preflight
    from models.config import ConfigError

    d = json.loads((export_drafter / "config.json").read_text())
    del d[key]
    (export_drafter / "config.json").write_text(json.dumps(d))
    said = f"{key}=None: missing from config.json"
    assert said in _export_error("hf", ["--checkpoint", str(export_drafter), "--out", str(tmp_path / "out")])
    with pytest.raises(ConfigError, match=said):
        preflight(infer_dirs["target"], str(export_drafter))


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


def test_validate_prompts_with_a_blank_question_or_first_turn_are_skipped_as_no_user_turn(tmp_path, capsys):
    """A blank gsm8k-like question or mt-bench-like first turn was measured as an empty user turn (a blank
    message was already skipped): the target's answer to nothing counted in tau and speed."""
    from inference.prompt_sets import load_prompts

    rows = tmp_path / "qs.jsonl"
    rows.write_text('{"question": "2 + 2?"}\n{"question": ""}\n{"turns": ["  ", "then"]}\n'
                    '{"messages": [{"role": "user", "content": ""}]}\n')
    assert [p.messages[0]["content"] for p in load_prompts(str(rows))] == ["2 + 2?"]
    assert "skipped 3 row(s) (no user turn: 3)" in capsys.readouterr().err


def test_compare_of_reports_with_other_max_new_tokens_shows_and_notes_it(tmp_path, monkeypatch, capsys):
    """The same prompts generated to 64 and to 512 tokens have other tau and speed: the comparison showed neither
    setting nor a note, so the difference read as the drafter's or the target's."""
    import json

    import inference.validate
    from inference.validate import main

    for name, tokens in (("short", 64), ("long", 512)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(
            {"schema": "draftsmith.validate/1", "tau": 2.0, "prompt_set_hash": "h", "max_new_tokens": tokens}))
    monkeypatch.setattr(inference.validate, "write_plot", lambda *a: None)
    rows = main(["--compare", str(tmp_path / "short"), str(tmp_path / "long"), "--out", str(tmp_path / "cmp")])["rows"]
    assert ["max_new_tokens", "64", "512", ""] in rows
    err = capsys.readouterr().err
    assert "max_new_tokens differs" in err and "different prompt sets" not in err


def test_prompts_saved_with_a_byte_order_mark_lose_no_row(tmp_path, capsys):
    """A JSONL written by a Windows editor starts with a UTF-8 BOM: its first row was skipped as malformed JSON
    (a .json document was refused whole)."""
    from inference.prompt_sets import load_prompts

    bom = "\ufeff".encode()
    (tmp_path / "p.jsonl").write_bytes(bom + b'{"prompt": "first"}\n{"prompt": "second"}\n')
    (tmp_path / "p.json").write_bytes(bom + b'[{"prompt": "first"}, {"prompt": "second"}]')
    for name in ("p.jsonl", "p.json"):
        assert [p.messages[0]["content"] for p in load_prompts(str(tmp_path / name))] == ["first", "second"]
    assert "skipped" not in capsys.readouterr().err


def test_a_checkpoints_drafter_folder_exports_with_the_checkpoints_steps_and_run(tmp_path, export_drafter):
    """--checkpoint runs/NAME/checkpoints/step_N/drafter was exported as a bare drafter folder: the card lost
    the optimizer steps and the run's recipe that the same checkpoint given as step_N records."""
    import json

    from export.hf import export_hf

    ckpt = tmp_path / "run" / "checkpoints" / "step_7"
    ckpt.mkdir(parents=True)
    export_drafter.rename(ckpt / "drafter")
    (ckpt / "trainer_state.json").write_text('{"step": 7}')
    (ckpt / "config.yaml").write_text("recipe: tiny\n")
    out = export_hf(ckpt / "drafter", tmp_path / "out", remote_code_check=False, log=lambda *_: None)
    prov = json.loads((tmp_path / "out" / "config.json").read_text())["draftsmith"]
    assert (prov["steps"], prov["recipe"]) == (7, "tiny") and out["source"] == str(ckpt / "drafter")


def test_a_lock_file_goes_with_a_failed_run_only_when_that_run_made_it(tmp_path):
    """A refusal of someone else's folder left the command's lock file in it; a lock file already there (a killed
    run's) stays, and so does the one of a run that ended well (its folder is its output)."""
    from models.lock import hold

    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError), hold(folder, ".x.lock", "--out", "-"):
        raise RuntimeError("not a folder of ours")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    (folder / ".x.lock").write_text("123\n")  # a killed run's
    with pytest.raises(RuntimeError), hold(folder, ".x.lock", "--out", "-"):
        raise RuntimeError
    assert (folder / ".x.lock").is_file()
    with hold(tmp_path / "new", ".x.lock", "--out", "-") as out:
        (out / "result.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [".x.lock", "result.json"]


def test_a_killed_runs_lock_file_names_only_the_run_holding_it_now(tmp_path):
    """A lock file a killed run left holds its pid: the next holder writes over it, so a refused run names the
    holder, not "<old pid> <pid>"."""
    import os

    from models.lock import hold

    (tmp_path / ".x.lock").write_text("99999999\n")
    with hold(tmp_path, ".x.lock", "--out", "-"):
        assert (tmp_path / ".x.lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(ValueError) as err, hold(tmp_path, ".x.lock", "--out", "wait"):
            pass
    assert str(err.value) == f"--out {tmp_path} is in use by another run (pid {os.getpid()}): wait"


def test_a_file_system_without_locks_runs_with_a_note(tmp_path, monkeypatch):
    """Some cluster mounts refuse flock (ENOLCK): the run goes on, saying that a second run is not kept out,
    instead of failing on an OSError."""
    import errno
    import fcntl

    from models.lock import hold

    def no_locks(handle, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    notes = []
    with hold(tmp_path / "out", ".x.lock", "--out", "-", log=notes.append) as out:
        (out / "result.json").write_text("{}")
    assert len(notes) == 1 and "cannot be locked on this file system (No locks available)" in notes[0]
    assert "a second run into the same folder is not refused" in notes[0]


@pytest.mark.parametrize("resume", ["false", "true"])
def test_a_training_run_into_an_out_dir_another_run_holds_is_refused(tmp_path, resume):
    """The same command in two terminals (or a requeued job while the first still ran, resume=true) trained into
    one out_dir: both wrote metrics.jsonl, the same step_N checkpoints and final/. The second is refused before
    anything loads, naming the holder's pid; a run that ended (here: by an error) leaves the folder free."""
    import os

    from models.lock import hold
    from train.distill import LOCK, main

    out = tmp_path / "run"
    args = ["recipe=tiny", f"out_dir={out}", f"resume={resume}", f"target.path={tmp_path / 'no-target'}"]
    with hold(out, LOCK, "out_dir", "-"):
        with pytest.raises(ValueError, match=f"out_dir {out} is in use by another run \\(pid {os.getpid()}\\): wait"):
            main(args)
        assert sorted(p.name for p in out.iterdir()) == [LOCK]  # no config.yaml, no data: nothing written
    with pytest.raises((FileNotFoundError, ValueError), match="no-target"):  # fails after taking out_dir
        main(args)
    with hold(out, LOCK, "out_dir", "-"):  # and gave it back
        pass


def test_an_extraction_into_a_store_another_extraction_writes_is_refused_before_its_target_loads(tmp_path):
    """A relaunch while the first extraction still ran (its log looked stuck) wrote the same shards and index
    as the first. Refused with the holder's pid before the target loads; a finished run leaves the store free."""
    import os

    from data.extract import LOCK, main
    from models.lock import hold

    store = tmp_path / "feats"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "draftsmith_data.json").write_text("{}")
    args = ["--target", str(tmp_path / "no-target"), "--data", str(tmp_path / "data"), "--out", str(store),
            "--device", "cpu", "--no-progress"]
    with hold(store, LOCK, "--out", "-"):
        with pytest.raises(ValueError, match=f"--out {store} is in use by another run \\(pid {os.getpid()}\\): "
                                             "wait for it to end .*resumes"):
            main(args)
    with pytest.raises(FileNotFoundError, match="no-target"):  # the next one gets as far as loading its target
        main(args)


def test_a_prepare_into_a_folder_another_prepare_writes_is_refused_and_a_finished_one_is_reused(tmp_path):
    """A relaunch while the first prepare still regenerated appended to the same answers file and cleared what
    the first had written. Refused with the holder's pid before the target loads; the lock file a finished
    prepare leaves in the folder does not make it foreign to the next prepare or to training."""
    import os

    from data.prepare import main
    from data.reuse import LOCK
    from models.lock import hold
    from models.tiny import save_tiny_target

    target = save_tiny_target(tmp_path / "target", "qwen3", num_layers=4)
    out = tmp_path / "prepared"
    args = ["--target", str(target), "--source", str(_DATA_FIX / "openai.jsonl"), "--out", str(out), "--no-progress"]
    with hold(out, LOCK, "--out", "-"):
        with pytest.raises(ValueError, match=f"--out {out} is in use by another run \\(pid {os.getpid()}\\): wait"):
            main(args)
    assert not out.exists()  # the test's own hold created it and left nothing
    with pytest.raises((FileNotFoundError, ValueError)):
        main(args[:3] + [str(tmp_path / "nope.jsonl")] + args[4:])
    assert not out.exists()  # a refused prepare leaves no folder behind
    out.mkdir()
    (out / LOCK).write_text("12345\n")  # what a prepare killed before its first write leaves
    main(args)
    assert (out / LOCK).is_file() and (out / "draftsmith_data.json").is_file()
    main(args)  # the finished folder is reused, the lock file in it is the prepare's own


# ------------------------------------------------------------------ flex attention's backward tiles
@pytest.mark.parametrize("setting, said", [
    ("fast", "use auto, torch, or six whole numbers M1,N1,M2,N2,STAGES,WARPS"),
    ("64,64,64,64", "six whole numbers"),
    ("64,64,64,64,2,4,1", "six whole numbers"),
    ("64,64,64,64,-2,4", "six whole numbers"),
    ("48,64,64,64,2,4", "must each be 16, 32, 64 or 128"),
    ("256,256,256,256,1,8", "must each be 16, 32, 64 or 128"),  # past the mask's 128-wide tiles
    ("64,32,64,64,2,4", "N1 must be a multiple of M1"),
    ("64,64,32,64,2,4", "M2 a multiple of N2"),
    ("64,64,64,64,0,4", "STAGES must be 1..6"),
    ("64,64,64,64,2,3", "WARPS one of 1, 2, 4, 8, 16"),
])
def test_a_bad_flex_backward_setting_says_the_accepted_forms(setting, said):
    from models.flex_options import parse_flex_backward

    with pytest.raises(ValueError, match=re.escape(said)):
        parse_flex_backward(setting)


def test_a_flex_backward_typo_fails_when_the_config_loads():
    """It was read only by the first CUDA step of the drafter, after the target and data had loaded."""
    from train.config import load_config

    with pytest.raises(ValueError, match=r"flex backward setting 'fastest'"):
        load_config(["recipe=tiny", "train.flex_backward=fastest"])
    assert load_config(["recipe=tiny", "train.flex_backward=32,64,64,32,2,4"]).train.flex_backward == "32,64,64,32,2,4"


@pytest.mark.parametrize("argv, said", [
    (["--flex-backward", "1,2"], "flex backward setting '1,2': use auto, torch, or six whole numbers"),
    (["--flex-sweep", "64,64,64,64,2,4", "64,64"], "flex backward setting '64,64'"),
    (["--flex-sweep", "auto"], "--flex-sweep auto: give tiles"),
])
def test_train_bench_refuses_bad_flex_tiles_before_building(capsys, no_build, argv, said):
    assert said in argparse_error(capsys, "train", ["--e2e", "qwen35-9b", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_train_bench_flex_sweep_without_a_gpu_says_it_needs_one(no_build):
    with pytest.raises(ValueError, match="--flex-sweep times compiled flex attention kernels: it needs a CUDA GPU"):
        bench("train")(["--e2e", "qwen35-9b", "--flex-sweep"])
