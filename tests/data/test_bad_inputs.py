"""Bad inputs a user makes at this stage, each ending in a clear error (or a correct rebuild), never silently.

Part of the bad-input table: ``pytest -m bad_input`` runs every stage's cases.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_store_rows
from tests.helpers.bad_input import _DATA_FIX, _generate, _validate, bench

pytestmark = pytest.mark.bad_input


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

    from data.reuse import META_FILE, PARTIAL_FILE, REGEN_FILE, DataMismatch, claim_folder, reusable, row_settings

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
    from models.support import hold

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
    from data.reuse import DataMismatch, NotPreparedFolder

    prepared, mine = tmp_path / "prepared", tmp_path / "mine"
    data.prepare.prepare(str(data_target), str(_DATA_FIX / "openai.jsonl"), prepared, progress=False)
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    monkeypatch.setattr(data.prepare, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
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
    # the refusal leaves no lock file in the user's folder (it did: models.support kept every lock file it made)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert ".prepare.lock" not in {p.name for p in prepared.iterdir()}


def test_prepare_source_that_is_missing_is_named_before_the_regenerating_target_loads(tmp_path, monkeypatch):
    import data.prepare

    monkeypatch.setattr(data.prepare, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
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

    (tmp_path / "chats.csv").write_text((_DATA_FIX / "openai.jsonl").read_text())
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "chats.txt").write_text("hello")
    monkeypatch.setattr(data.prepare, "load_local_target", lambda *_: pytest.fail("the target loaded before the check"))
    with pytest.raises((ValueError, FileNotFoundError), match=said):
        data.prepare.main(["--source", str(tmp_path / source), "--out", str(tmp_path / "data"), "--target",
                           str(data_target), "--regenerate", "local", "--no-progress"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.csv", "notes"]


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


@pytest.mark.parametrize("module, args", [
    ("data.prepare", ["--regenerate", "http://127.0.0.1:9/v1", "--quantization", "mlx-4bit"]),
    ("data.prepare", ["--quantization", "fp8"]),
    ("data.regenerate", ["--server", "http://127.0.0.1:9/v1", "--quantization", "bnb-4bit"]),
])
def test_quantization_flag_without_in_process_generation_is_refused(tmp_path, capsys, module, args):
    """A server generates with the weights it serves: --quantization there would record answers it did not make."""

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit):
        main(["--target", str(tmp_path), "--source", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o"), *args])
    assert "--quantization applies to" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


TOY_DATA = ["--hidden", "64", "--layers", "6", "--taps", "3", "--vocab", "300", "--rows", "2", "--seq", "16",
            "--batch-size", "2", "--repeats", "1", "--shard-rows", "1", "--dtypes", "bf16"]


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

    import data.bench

    def broken(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(data.bench, "FeatureStore", broken)  # after the first store is written
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


def test_data_bench_unknown_store_dtype_is_refused_before_any_forward(capsys):
    with pytest.raises(SystemExit):
        bench("data")(["--dtypes", "bf16", "fp16"])
    out, err = capsys.readouterr()
    assert out == "" and "argument --dtypes: invalid choice: 'fp16'" in err


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


def test_extract_with_no_writer_threads(capsys):
    from data.extract import main

    with pytest.raises(SystemExit):
        main(["--target", "t", "--data", "d", "--out", "o", "--writers", "0"])
    assert "--writers 0: use 1 or more background shard writers" in capsys.readouterr().err


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
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "tokenizer.json").write_text("{}")  # a target with tokenizer files, as far as they go
    argv = ["--target", str(tmp_path / "t"), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o")]
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


def test_a_jsonl_row_that_is_json_but_not_an_object_is_counted_as_such(tmp_path):
    """A `[1, 2, 3]` line is valid JSON: it was counted as "malformed JSON", which sends one looking for a typo."""
    from data.readers import load_conversations

    path = tmp_path / "chats.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    path.write_text(f'{good}\n[1, 2, 3]\n"text"\n{{"messages": \n')
    convs, stats = load_conversations(path)
    assert len(convs) == 1 and dict(stats.skipped) == {"JSON that is not an object": 2, "malformed JSON": 1}


def test_an_extraction_into_a_store_another_extraction_writes_is_refused_before_its_target_loads(tmp_path):
    """A relaunch while the first extraction still ran (its log looked stuck) wrote the same shards and index
    as the first. Refused with the holder's pid before the target loads; a finished run leaves the store free."""
    import os

    from data.extract import LOCK, main
    from models.support import hold

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
    from models.support import hold
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


def test_prepare_and_extract_refuse_a_target_without_tokenizer_files_before_anything_else(data_target, tmp_path):
    """transformers built an empty tokenizer: data.prepare asked for a chat template, then said no row had loss
    tokens. Both commands give the "no tokenizer files" line training and generate give, before anything is read,
    written or loaded."""
    import shutil

    from data.extract import main as extract
    from data.prepare import main as prepare
    from models.support import run_cli

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in Path(data_target).iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, bare / f.name)
    prepared = tmp_path / "data-ready"  # a prepared folder as far as extract checks before loading anything
    prepared.mkdir()
    (prepared / "draftsmith_data.json").write_text("{}")
    said = f"error: --target {bare}: {bare} has no tokenizer files (tokenizer.json, tokenizer_config.json): "
    runs = {"prepare": lambda: prepare(["--target", str(bare), "--source", str(_DATA_FIX / "openai.jsonl"), "--out",
                                        str(tmp_path / "data")]),
            "extract": lambda: extract(["--target", str(bare), "--data", str(prepared), "--out",
                                        str(tmp_path / "feats")])}
    for name, run in runs.items():
        with pytest.raises(SystemExit) as e:
            run_cli(run)
        assert str(e.value.code).startswith(said), e.value.code
        assert "tokenizer files to the folder" in str(e.value.code)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "data-ready"]  # nothing written


def _disk_full(*args, **kwargs):
    import errno
    import os

    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_in_prepare_and_extract_names_the_folder_and_says_a_rerun_resumes(data_target, tmp_path,
                                                                                       monkeypatch):
    """Both ended in a bare "[Errno 28] No space left on device", naming neither the folder nor what a rerun does.
    (Fault injection: the writers raise what a full disk raises.)"""
    import data.rows
    import data.store_writer
    from data.extract import main as extract
    from data.prepare import main as prepare
    from models.support import run_cli

    def error_of(run) -> str:
        with pytest.raises(SystemExit) as e:
            run_cli(run)
        return str(e.value.code)

    prepared, feats = tmp_path / "data", tmp_path / "feats"
    argv = ["--target", str(data_target), "--source", str(_DATA_FIX / "openai.jsonl"), "--out", str(prepared),
            "--no-progress"]
    real = data.rows.tokenize_to_disk
    monkeypatch.setattr(data.rows, "tokenize_to_disk", _disk_full)
    message = error_of(lambda: prepare(argv))
    assert re.match(rf"error: no space left on the disk of {re.escape(str(prepared))} \(\d+\.\d GiB left there\): free "
                    "space there and rerun the same command: it resumes: the regenerated answers are kept", message)
    monkeypatch.setattr(data.rows, "tokenize_to_disk", real)
    prepare(argv)

    argv = ["--target", str(data_target), "--data", str(prepared), "--out", str(feats), "--layers", "0",
            "--no-progress", "--device", "cpu", "--target-dtype", "fp32"]
    real = data.store_writer.write_safetensors
    monkeypatch.setattr(data.store_writer, "write_safetensors", _disk_full)
    message = error_of(lambda: extract(argv))
    assert message.startswith(f"error: no space left on the disk of {feats} (") and message.endswith(
        "free space there and rerun the same command: it resumes: finished shards are kept, the missing ones are "
        "computed\n(set DRAFTSMITH_TRACEBACK=1 to see where it came from)")
    monkeypatch.setattr(data.store_writer, "write_safetensors", real)
    extract(argv)
    assert json.loads((feats / "index.json").read_text())["complete"]
