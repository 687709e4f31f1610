"""Readers: one fixture per layout, every local source kind, and the bad-row summary."""

import json
from pathlib import Path

import pytest

from data.readers import NoUsableRows, ReadStats, iter_conversations, load_conversations, _hub_rows

FIX = Path(__file__).parent / "fixtures" / "data"


def roles(conv):
    return [m["role"] for m in conv["messages"]]


def test_openai_layout():
    convs, stats = load_conversations(FIX / "openai.jsonl")
    assert [c["id"] for c in convs] == ["0", "1", "2"]
    assert [c["source_id"] for c in convs] == ["oa-1", "oa-2", "oa-3"]
    assert roles(convs[0]) == ["system", "user", "assistant"]
    assert roles(convs[1]) == ["user", "assistant", "user", "assistant"]
    # an inline think block becomes reasoning_content
    assert convs[2]["messages"][1] == {"role": "assistant", "content": "4", "reasoning_content": "add them"}
    assert stats.layouts == {"openai": 3} and stats.skipped.total() == 0


def test_sharegpt_layout():
    convs, stats = load_conversations(FIX / "sharegpt.jsonl")
    assert roles(convs[0]) == ["system", "user", "assistant"]
    assert convs[1]["messages"][3] == {"role": "assistant", "content": "Rome"}
    assert stats.layouts == {"sharegpt": 2}


def test_alpaca_layout():
    convs, _ = load_conversations(FIX / "alpaca.jsonl")
    assert convs[0]["messages"] == [{"role": "user", "content": "Reverse the word.\n\nabc"},
                                    {"role": "assistant", "content": "cba"}]
    assert convs[1]["messages"][0]["content"] == "Write a Python one-liner that prints hello."  # empty input: no blank


def test_nemotron_layout():
    convs, stats = load_conversations(FIX / "nemotron.jsonl")
    assert stats.layouts == {"nemotron": 2}
    assert convs[0]["messages"] == [
        {"role": "system", "content": "detailed thinking on"}, {"role": "user", "content": "What is 3*3?"},
        {"role": "assistant", "content": "9", "reasoning_content": "Three threes."}]
    assert convs[1]["messages"][-1] == {"role": "assistant", "content": "yes"}


def test_bad_rows_are_skipped_and_counted():
    convs, stats = load_conversations(FIX / "bad_rows.jsonl")
    assert [c["messages"][-1]["content"] for c in convs] == ["fine", "yes"]
    assert stats.seen == 7 and stats.kept == 2
    assert dict(stats.skipped) == {"no assistant turn": 1, "empty content": 1, "unknown role": 1,
                                   "unknown layout": 1, "malformed JSON": 1}
    summary = stats.summary()
    assert "kept 2" in summary and "skipped 5" in summary and "1 malformed JSON" in summary


def test_no_usable_rows_is_an_error(tmp_path):
    src = tmp_path / "nothing.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n"
                   + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(NoUsableRows, match="no usable conversations.*1 no assistant turn.*Supported layouts"):
        load_conversations(src)


def test_limit_counts_usable_rows():
    convs, _ = load_conversations(FIX / "bad_rows.jsonl", limit=1)
    assert len(convs) == 1


def test_parquet_datasets_folder_and_load_dataset_paths(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [json.loads(line) for line in (FIX / "sharegpt.jsonl").read_text().splitlines()]
    ds = Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "chats.parquet"))
    got, _ = load_conversations(tmp_path / "chats.parquet")
    assert [c["messages"] for c in got] == [c["messages"] for c in load_conversations(FIX / "sharegpt.jsonl")[0]]

    DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "saved"))
    assert len(load_conversations(tmp_path / "saved")[0]) == 2
    assert [c["source_id"] for c in load_conversations(tmp_path / "saved", split="test")[0]] == ["sg-2"]
    both = load_conversations(tmp_path / "saved", split="train+test")[0]  # "+" joins splits, as on the Hub
    assert [c["source_id"] for c in both] == ["sg-1", "sg-2", "sg-2"] and len({c["id"] for c in both}) == 3
    with pytest.raises(KeyError, match="split 'code' not in"):
        load_conversations(tmp_path / "saved", split="train+code")

    # the Hub path goes through datasets.load_dataset; a local data folder exercises split + streaming offline
    hub_like = tmp_path / "hub_like" / "data"
    hub_like.mkdir(parents=True)
    ds.to_parquet(str(hub_like / "train-00000-of-00001.parquet"))
    streamed = list(_hub_rows(str(tmp_path / "hub_like"), split="train", subset=None, streaming=True))
    assert [r["id"] for r in streamed] == ["sg-1", "sg-2"]


def test_folder_of_jsonl_files(tmp_path):
    for name in ("openai", "alpaca"):
        (tmp_path / f"{name}.jsonl").write_text((FIX / f"{name}.jsonl").read_text())
    stats = ReadStats()
    convs = list(iter_conversations(tmp_path, stats=stats))
    assert len(convs) == 5 and stats.layouts == {"alpaca": 2, "openai": 3}
    assert len({c["id"] for c in convs}) == 5
