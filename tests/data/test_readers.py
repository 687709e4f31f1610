"""Readers: one fixture per layout, every local source kind, and the bad-row summary."""

import json
from pathlib import Path

import pytest

from data.readers import NoUsableRows, ReadStats, _hub_rows, iter_conversations, load_conversations

FIX = Path(__file__).parents[1] / "fixtures" / "data"


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


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_roles_are_read_case_insensitively(tmp_path):
    """ShareGPT exports write "Human"/"GPT" and OpenAI-style dumps "User"/"Assistant": every such row was
    skipped as "unknown role" if roles were compared as written."""
    src = _write_jsonl(tmp_path / "caps.jsonl", [
        {"conversations": [{"from": "Human", "value": "Hi"}, {"from": "GPT", "value": "Hello"}]},
        {"messages": [{"role": "System", "content": "Be brief."}, {"role": "User", "content": "Q"},
                      {"role": "Assistant", "content": "A"}]}])
    convs, stats = load_conversations(src)
    assert [roles(c) for c in convs] == [["user", "assistant"], ["system", "user", "assistant"]]
    assert stats.skipped.total() == 0


def test_system_prompts_of_alpaca_and_prompt_rows_are_kept(tmp_path):
    """An Alpaca row's ``system`` and a prompts-only row's ``system`` open the conversation: a reader that
    dropped them trained (or regenerated) without the instruction the data set carries."""
    src = _write_jsonl(tmp_path / "sys.jsonl", [
        {"instruction": "Add.", "input": "2 3", "output": "5", "system": "You are a calculator."},
        {"prompt": "Say hi", "system": "Answer in French."}])
    convs, _ = load_conversations(src, need_answers=False)
    assert convs[0]["messages"] == [{"role": "system", "content": "You are a calculator."},
                                    {"role": "user", "content": "Add.\n\n2 3"}, {"role": "assistant", "content": "5"}]
    assert convs[1]["messages"] == [{"role": "system", "content": "Answer in French."},
                                    {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": ""}]


def test_nemotron_system_prompt_is_not_added_twice():
    """``system_prompt`` opens the conversation once; an ``input`` list that already has a system turn keeps
    only its own."""
    from data.readers import to_messages

    row = {"input": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}], "output": "a",
           "system_prompt": "detailed thinking off"}
    assert roles({"messages": to_messages(row, "nemotron")}) == ["system", "user", "assistant"]
    assert to_messages(row, "nemotron")[0]["content"] == "own"


def test_explicit_reasoning_content_is_kept_beside_its_answer(tmp_path):
    """A row that already separates ``reasoning_content`` from ``content`` keeps both as given; splitting
    the content again for a think block dropped the reasoning of every such turn."""
    src = _write_jsonl(tmp_path / "r.jsonl", [{"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two plus two"}]}])
    convs, _ = load_conversations(src)
    assert convs[0]["messages"][1] == {"role": "assistant", "content": "4", "reasoning_content": "two plus two"}


def test_a_folder_reads_its_sub_folders_and_json_files(tmp_path):
    """Hub data sets are laid out as data/<split>/*.jsonl: a folder source reads every level, and a .json
    file holding one conversation (an object, not a list) is one row."""
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "train" / "part-0.jsonl").write_text((FIX / "openai.jsonl").read_text())
    one = {"id": "single", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    (tmp_path / "one.json").write_text(json.dumps(one))
    convs, stats = load_conversations(tmp_path)
    assert [c["source_id"] for c in convs] == ["oa-1", "oa-2", "oa-3", "single"] and stats.kept == 4


def test_a_source_id_of_zero_is_kept(tmp_path):
    """Integer ids start at 0: the first row's id is kept like the others (not treated as missing)."""
    src = _write_jsonl(tmp_path / "ids.jsonl", [
        {"id": i, "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(3)])
    assert [c["source_id"] for c in load_conversations(src)[0]] == ["0", "1", "2"]


def test_trailing_unanswered_turns_are_all_dropped(tmp_path):
    """A conversation that ends with unanswered turns (a user question, then another) ends at its last
    answer: nothing after the last assistant turn is trained on as context without a target."""
    src = _write_jsonl(tmp_path / "tail.jsonl", [{"messages": [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "user", "content": "q3"}]}])
    assert roles(load_conversations(src)[0][0]) == ["user", "assistant"]


def test_an_answer_right_after_the_system_prompt_is_refused(tmp_path):
    """[system, assistant, ...] has no user turn before the first answer: skipped, like [assistant, ...]."""
    src = _write_jsonl(tmp_path / "sys_first.jsonl", [
        {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"},
                      {"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "fine"}]}])
    stats = ReadStats()
    convs = list(iter_conversations(src, stats=stats))
    assert [c["messages"][-1]["content"] for c in convs] == ["fine"]
    assert dict(stats.skipped) == {"assistant turn before any user turn": 1}


def test_conversation_key_depends_on_the_prompts_not_the_answers():
    """Resumed regeneration re-uses an answer by this key: the same prompts with other answers give the same
    key, another prompt another key."""
    from data.readers import conversation_key

    a = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old answer"}]
    b = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]
    c = [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "old answer"}]
    assert conversation_key(a) == conversation_key(b) != conversation_key(c)


def test_an_empty_alpaca_output_is_a_prompt_to_regenerate(tmp_path):
    """``output: ""`` is no answer: kept as a prompt when answers are regenerated, never trained on as an empty
    assistant turn (skipped as "no assistant turn" otherwise)."""
    src = _write_jsonl(tmp_path / "empty_out.jsonl", [{"instruction": "Name a colour.", "output": ""}])
    convs, _ = load_conversations(src, need_answers=False)
    assert convs[0]["messages"] == [{"role": "user", "content": "Name a colour."},
                                    {"role": "assistant", "content": ""}]
    with pytest.raises(NoUsableRows, match="1 no assistant turn"):
        load_conversations(src)


def test_a_prompt_that_does_not_end_with_the_user_is_not_regenerated(tmp_path):
    """need_answers=False appends the turn to generate after the user's last message only: a prompts-only row
    ending with a system turn is skipped (counted as "no user turn"), not answered after the system prompt."""
    src = _write_jsonl(tmp_path / "ends_system.jsonl", [
        {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]},
        {"messages": [{"role": "user", "content": "q"}]}])
    stats = ReadStats()
    convs = list(iter_conversations(src, stats=stats, need_answers=False))
    assert [roles(c) for c in convs] == [["user", "assistant"]] and dict(stats.skipped) == {"no user turn": 1}


def test_skip_reasons_count_every_row_and_name_where_the_first_one_is(tmp_path):
    """The summary counts rows, not reasons, and points at the first undecodable row (the one to look at first),
    which stats.json keeps too."""
    good = (FIX / "openai.jsonl").read_bytes()
    bad = '{"messages": [{"role": "user", "content": "café"}, {"role": "assistant", "content": "oui"}]}\n'
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(bad.encode("latin-1") + good + bad.encode("latin-1") + b'{"text": "x"}\n')
    stats = ReadStats()
    assert len(list(iter_conversations(src, stats=stats))) == 3
    assert stats.summary() == (f"read 6 rows: kept 3 (layouts openai=3); skipped 3: 2 not UTF-8 text "
                               f"(first: {src} line 1), 1 unknown layout")
    assert stats.as_dict() == {"seen": 6, "kept": 3, "skipped": {"not UTF-8 text": 2, "unknown layout": 1},
                               "layouts": {"openai": 3}, "first_at": {"not UTF-8 text": f"{src} line 1"}}
    assert "first_at" not in load_conversations(FIX / "bad_rows.jsonl")[1].as_dict()  # no located reason: no key


def test_rows_that_fit_no_layout_are_counted_as_such(tmp_path):
    """An answer without a question, or a prompt that is not text, fits no layout: skipped under that reason,
    never read as the nearest layout and counted as something else."""
    src = _write_jsonl(tmp_path / "odd.jsonl", [{"output": "an answer alone"}, {"prompt": ["a", "list"]},
                                                 {"prompt": "fine", "id": 1}])
    stats = ReadStats()
    convs = list(iter_conversations(src, stats=stats, need_answers=False))
    assert [c["source_id"] for c in convs] == ["1"] and dict(stats.skipped) == {"unknown layout": 2}


def test_prompts_only_nemotron_rows_are_kept_for_regeneration(tmp_path):
    """A Nemotron row with its ``input`` and no ``output`` yet is a prompt: regeneration answers it."""
    src = _write_jsonl(tmp_path / "nemo.jsonl", [{"input": "What is 2+2?", "system_prompt": "detailed thinking off"}])
    convs, stats = load_conversations(src, need_answers=False)
    assert convs[0]["messages"] == [{"role": "system", "content": "detailed thinking off"},
                                    {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": ""}]
    assert stats.layouts == {"nemotron": 1}


def test_think_blocks_are_split_only_from_answers_and_only_when_closed():
    """Templates that open ``<think>`` themselves leave answers with only the closing tag: what is before it is
    the reasoning. An unclosed block is no reasoning (the text is kept whole), an empty one (thinking off) gives
    no reasoning at all, and a user's turn that quotes think tags is kept as written."""
    from data.readers import split_think, to_messages

    assert split_think("steps</think>\n\nanswer") == ("steps", "answer")
    assert split_think("<think>still thinking") == (None, "<think>still thinking")
    quoted = "Why does <think>x</think> y show up?"
    row = {"messages": [{"role": "user", "content": quoted},
                        {"role": "assistant", "content": "<think>\n\n</think>\n\nA tag."}]}
    assert to_messages(row, "openai") == [{"role": "user", "content": quoted},
                                          {"role": "assistant", "content": "A tag."}]
    row["messages"][1]["reasoning_content"] = "  "  # a blank reasoning given apart is none either
    row["messages"][1]["content"] = "A tag."
    assert to_messages(row, "openai")[1] == {"role": "assistant", "content": "A tag."}


def test_blank_turns_and_answers_that_are_only_reasoning_are_skipped_as_empty(tmp_path):
    """A turn of spaces or an answer that is all think block would train on nothing: "empty content"."""
    src = _write_jsonl(tmp_path / "blank.jsonl", [
        {"messages": [{"role": "user", "content": " \n "}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>\n\n"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "kept"}]}])
    stats = ReadStats()
    assert [c["messages"][-1]["content"] for c in iter_conversations(src, stats=stats)] == ["kept"]
    assert dict(stats.skipped) == {"empty content": 2}


def test_turn_lists_take_either_key_pair_and_refuse_turns_that_are_not_objects():
    """ShareGPT exports also write role/content, OpenAI-style dumps sometimes from/value: both are read the
    same in either layout. A turn that is not an object is a malformed row, with that reason."""
    from data.readers import BadRow, to_messages

    want = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    role_content = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    from_value = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    assert to_messages({"conversations": role_content}, "sharegpt") == want
    assert to_messages({"messages": from_value}, "openai") == want
    with pytest.raises(BadRow, match="malformed turns"):
        to_messages({"messages": ["user: q", {"role": "assistant", "content": "a"}]}, "openai")
    with pytest.raises(BadRow, match="malformed turns"):  # an Alpaca input that is not text
        to_messages({"instruction": "q", "input": ["a", "b"], "output": "a"}, "alpaca")


def test_a_blank_alpaca_input_adds_nothing_to_the_instruction(tmp_path):
    src = _write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Say hi.", "input": "  \n", "output": "hi"}])
    assert load_conversations(src)[0][0]["messages"][0] == {"role": "user", "content": "Say hi."}


def test_blank_and_crlf_lines_are_no_rows(tmp_path):
    """Blank lines (a trailing one, or Windows line ends) between rows are not rows: nothing counted as skipped."""
    lines = (FIX / "openai.jsonl").read_text().splitlines()
    src = tmp_path / "gaps.jsonl"
    src.write_bytes(("\r\n".join(lines[:2]) + "\r\n\r\n  \r\n" + lines[2] + "\n\n").encode())
    convs, stats = load_conversations(src)
    assert len(convs) == 3 and stats.seen == 3 and stats.skipped.total() == 0


def test_a_hub_id_is_read_with_its_subset_split_streaming_and_revision(monkeypatch):
    """A Hub id goes to datasets.load_dataset with every setting (a subset named with a Hub id is not refused as it
    is for a local source); its failure names the data set and how it was asked for."""
    import datasets

    asked = []

    def load_dataset(name, subset, split, streaming, revision):
        asked.append((name, subset, split, streaming, revision))
        if name == "org/missing":
            raise FileNotFoundError("no such repo")
        return [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    convs = list(iter_conversations("org/chats", split="test", subset="code", streaming=True, revision="v2"))
    assert len(convs) == 1 and asked == [("org/chats", "code", "test", True, "v2")]
    with pytest.raises(OSError, match="could not load data set 'org/missing' \\(subset=None, split=train\\): "
                                      "FileNotFoundError: no such repo"):
        list(iter_conversations("org/missing"))


def test_a_hub_layout_folder_read_through_load_dataset_gives_the_split_asked(tmp_path):
    from datasets import Dataset

    (tmp_path / "data").mkdir()
    rows = [json.loads(line) for line in (FIX / "openai.jsonl").read_text().splitlines()]
    Dataset.from_list(rows[:2]).to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))
    Dataset.from_list(rows[2:]).to_parquet(str(tmp_path / "data" / "test-00000-of-00001.parquet"))
    assert [r["id"] for r in _hub_rows(str(tmp_path), split="test", subset=None, streaming=False)] == ["oa-3"]


def test_a_saved_data_set_is_read_as_its_rows_only(tmp_path):
    """A save_to_disk folder is read through datasets: its own state.json / dataset_info.json are not rows too."""
    from datasets import Dataset, DatasetDict

    rows = [json.loads(line) for line in (FIX / "openai.jsonl").read_text().splitlines()]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])}).save_to_disk(
        str(tmp_path / "dict"))
    for folder, split, n in (("one", "train", 3), ("dict", "train", 3), ("dict", "test", 1)):
        stats = ReadStats()
        assert len(list(iter_conversations(tmp_path / folder, split=split, stats=stats))) == n
        assert stats.seen == n and stats.skipped.total() == 0


def test_check_source_takes_what_the_readers_read(tmp_path):
    """The early check passes a folder of named splits (which split is read is decided later), a Hub id with a
    subset and a save_to_disk folder; it refuses a missing local path, a file type no reader reads and an empty
    folder."""
    from data.readers import check_source

    (tmp_path / "hub").mkdir()
    for name in ("train", "test"):
        (tmp_path / "hub" / f"{name}.jsonl").write_text((FIX / "openai.jsonl").read_text())
    check_source(tmp_path / "hub")
    check_source("org/name", subset="code")
    with pytest.raises(FileNotFoundError, match="neither a local file/folder nor a Hub id"):
        check_source(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="neither a local file/folder nor a Hub id"):
        check_source("chats.jsonl")  # relative and missing: no org/name either
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        check_source(tmp_path / "t.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .jsonl/.json/.parquet files"):
        check_source(tmp_path / "empty")


def test_limit_counts_kept_conversations_not_rows_read():
    """limit=2 over rows where five of seven are bad keeps the two good ones, the second read last."""
    convs, stats = load_conversations(FIX / "bad_rows.jsonl", limit=2)
    assert [c["messages"][-1]["content"] for c in convs] == ["fine", "yes"] and stats.seen == 7


def test_a_forced_layout_that_does_not_fit_skips_rows_as_malformed(tmp_path):
    """layout="sharegpt" over OpenAI rows finds no ``conversations``: each row is counted as malformed turns (no
    crash), and no usable row is the usual error."""
    stats = ReadStats()
    assert list(iter_conversations(FIX / "openai.jsonl", layout="sharegpt", stats=stats)) == []
    assert dict(stats.skipped) == {"malformed turns": 3}
    with pytest.raises(ValueError, match="unknown layout 'chatml'"):
        list(iter_conversations(FIX / "openai.jsonl", layout="chatml"))


def test_ids_are_source_positions_and_the_source_id_prefers_id(tmp_path):
    """``id`` is the row's line among all rows read, skipped ones included, so it points into the source; the
    source's own id is taken from ``id`` before ``uuid`` and the others."""
    assert [c["id"] for c in load_conversations(FIX / "bad_rows.jsonl")[0]] == ["0", "6"]
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    src = _write_jsonl(tmp_path / "ids.jsonl", [{"idx": 9, "uuid": "u-1", "id": "row-1", "messages": chat},
                                                 {"idx": 9, "uuid": "u-2", "messages": chat}])
    assert [c["source_id"] for c in load_conversations(src)[0]] == ["row-1", "u-2"]


def test_the_conversation_key_sees_who_said_each_prompt():
    """The same texts said by another role are another conversation: a system prompt turned into a user turn is
    answered anew, not given the old answer."""
    from data.readers import conversation_key

    answer = {"role": "assistant", "content": "a"}
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}, answer]
    as_user = [{"role": "user", "content": "Be brief."}, {"role": "user", "content": "q"}, answer]
    assert conversation_key(as_system) != conversation_key(as_user)


def test_model_is_an_assistant_role_and_limit_zero_reads_nothing(tmp_path):
    """Gemini-style exports name the answering role "model"."""
    src = _write_jsonl(tmp_path / "gemini.jsonl", [
        {"messages": [{"role": "user", "content": "q"}, {"role": "model", "content": "a"}]}])
    assert roles(load_conversations(src)[0][0]) == ["user", "assistant"]
    assert list(iter_conversations(src, limit=0)) == []


def test_no_usable_rows_suggests_regeneration_only_for_prompts_only_data(tmp_path):
    src = _write_jsonl(tmp_path / "text.jsonl", [{"text": "plain"}])
    with pytest.raises(NoUsableRows) as e:
        load_conversations(src)
    assert "1 unknown layout" in str(e.value) and "Prompts-only" not in str(e.value)
