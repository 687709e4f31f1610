"""Prepared-folder re-use without a target: the recorded settings, what counts as the same source, and what a
claim, a clear and a failed build leave in the folder."""

import json
import os
import shutil
from pathlib import Path

import pytest

from data.reuse import (
    CACHE_DIR,
    LOCK,
    META_FILE,
    PARTIAL_FILE,
    REGEN_FILE,
    STATS_FILE,
    DataMismatch,
    NotPreparedFolder,
    claim_folder,
    clean_failed,
    clear,
    refuse_folder,
    regenerate_mode,
    reusable,
    row_settings,
    settings_diff,
    source_content,
    source_fingerprint,
)

FIX = Path(__file__).parents[1] / "fixtures" / "data"


def settings(source=FIX / "openai.jsonl", **kw):
    args = dict(source=str(source), split="train", subset=None, limit=None, regenerate=None, thinking=None,
                max_length=None, pack=False, tokenizer_hash="tok-a")
    return row_settings(**{**args, **kw})


def test_regeneration_is_recorded_by_mode_not_by_url():
    assert [regenerate_mode(s) for s in (None, "", "none")] == [None, None, None]
    assert regenerate_mode("http://10.0.0.1:8000/v1") == regenerate_mode("https://host/v1") == "server"
    assert regenerate_mode("vllm") == "vllm"


@pytest.mark.parametrize("change, named", [
    ({"split": "test"}, "split: 'train' -> 'test'"), ({"limit": 5}, "limit: None -> 5"),
    ({"thinking": False}, "thinking: None -> False"), ({"max_length": 64}, "max_length: None -> 64"),
    ({"pack": True, "max_length": None}, "pack: False -> True"), ({"tokenizer_hash": "tok-b"}, "tokenizer_hash"),
    ({"regenerate": "http://h/v1"}, "regenerate: None -> 'server'"),
    ({"source": "org/chats", "subset": "code"}, "subset: None -> 'code'"),
])
def test_each_setting_that_changes_the_rows_is_a_named_difference(change, named):
    base = settings(source=change.get("source", FIX / "openai.jsonl"))
    assert settings_diff(base, settings(source=base["source"])) == []
    diff = settings_diff(base, settings(**change))
    assert diff[0].startswith(named) and len(diff) == (2 if "regenerate" in change else 1)  # + its generation


def test_generation_settings_count_only_when_answers_are_regenerated():
    """A default temperature is 0.0 whether given or not; max_tokens changes regenerated answers, and means
    nothing without regeneration."""
    local = lambda **gen: settings(regenerate="local", gen_kwargs=gen)  # noqa: E731
    assert settings_diff(local(), local(temperature=0.0)) == []
    assert settings_diff(local(max_tokens=4), local(max_tokens=8)) == [
        "generation: {'max_tokens': 4, 'temperature': 0.0} -> {'max_tokens': 8, 'temperature': 0.0}"]
    assert settings_diff(settings(gen_kwargs={"max_tokens": 4}), settings(gen_kwargs={"max_tokens": 8})) == []


def test_a_folder_records_only_the_settings_it_knew_and_labels_newer_than_ours_are_refused():
    """A setting an older folder did not record is not compared; labelling rules are, both ways: a folder labelled
    by a newer draftsmith is not ours to train on either."""
    wanted = settings()
    older = {k: v for k, v in wanted.items() if k not in ("packed", "subset")}
    assert settings_diff(older, wanted) == []
    newer = {**wanted, "label_rules": wanted["label_rules"] + 1}
    assert settings_diff(newer, wanted) == [
        f"labelling rules: version {wanted['label_rules'] + 1} -> {wanted['label_rules']} (prepared by a newer "
        "draftsmith, whose loss labels differ; a rebuild keeps the regenerated answers)"]


def test_a_file_sources_fingerprint_is_its_size_and_mtime(tmp_path):
    src = tmp_path / "a.jsonl"
    shutil.copy(FIX / "openai.jsonl", src)
    before = source_fingerprint(str(src))
    os.utime(src, ns=(1, 1))  # same bytes, touched
    assert source_fingerprint(str(src)) != before
    assert source_fingerprint("org/name") is None and source_content("org/name") is None


def test_a_folder_sources_fingerprint_and_content_see_where_each_file_is(tmp_path):
    """Moving a shard from train/ to test/ changes which rows a split holds: another source, though the names,
    sizes and bytes are the same. Hidden files (.git) do not change the content."""
    src = tmp_path / "src"
    (src / "train").mkdir(parents=True)
    (src / "test").mkdir()
    shutil.copy(FIX / "openai.jsonl", src / "train" / "part.jsonl")
    os.utime(src / "train" / "part.jsonl", ns=(1, 1))
    fingerprint, content = source_fingerprint(str(src)), source_content(str(src))
    (src / "train" / "part.jsonl").rename(src / "test" / "part.jsonl")
    assert source_fingerprint(str(src)) != fingerprint and source_content(str(src)) != content
    (src / "test" / "part.jsonl").rename(src / "train" / "part.jsonl")
    os.utime(src / "train" / "part.jsonl", ns=(2, 2))
    assert source_fingerprint(str(src)) != fingerprint and source_content(str(src)) == content
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert source_content(str(src)) == content


def test_a_source_is_the_same_by_content_wherever_it_lives_and_another_when_edited(tmp_path):
    src = tmp_path / "a" / "chats.jsonl"
    src.parent.mkdir()
    shutil.copy(FIX / "openai.jsonl", src)
    recorded = {**settings(src), "source_content": source_content(str(src))}
    moved = tmp_path / "b" / "chats.jsonl"
    moved.parent.mkdir()
    shutil.copy(src, moved)
    assert settings_diff(recorded, settings(moved)) == []  # moved: the same rows
    src.write_text(src.read_text().replace("a", "b", 1))  # edited in place, same path
    assert settings_diff(recorded, settings(src)) == [f"source {str(src)!r} changed since it was prepared (its "
                                                      "content differs)"]
    shutil.copy(src, moved.parent / "other.jsonl")  # other bytes at another path: the path's own line says it
    assert [d.split(":")[0] for d in settings_diff(recorded, settings(moved.parent / "other.jsonl"))] == ["source"]
    old = {k: v for k, v in recorded.items() if k != "source_content"}  # a folder of before content hashes
    touched = settings(src)
    assert settings_diff(old, touched) == [f"source {str(src)!r} changed since it was prepared (size:mtime "
                                           f"{old['source_fingerprint']} -> {touched['source_fingerprint']})"]


def _prepared(out: Path, wanted: dict, state: str = META_FILE) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / state).write_text(json.dumps(wanted))
    return out


def test_a_folder_is_reused_only_finished_and_with_the_same_settings(tmp_path):
    wanted = settings()
    assert not reusable(tmp_path / "new", wanted)
    assert reusable(_prepared(tmp_path / "same", wanted), wanted)
    assert not reusable(_prepared(tmp_path / "other", settings(limit=3)), wanted)
    assert not reusable(_prepared(tmp_path / "partial", wanted, PARTIAL_FILE), wanted)


def test_a_partly_prepared_folder_of_other_settings_is_refused_as_such(tmp_path):
    out = _prepared(tmp_path / "data", settings(limit=3), PARTIAL_FILE)
    (out / REGEN_FILE).write_text('{"key": "k"}\n')
    with pytest.raises(DataMismatch, match="holds data partly prepared with other settings \\(limit: 3 -> None\\)"):
        refuse_folder(out, settings(), rebuild=False)
    with pytest.raises(DataMismatch, match="holds data prepared with other settings"):
        refuse_folder(_prepared(tmp_path / "done", settings(limit=3)), settings(), rebuild=False)
    assert refuse_folder(out, settings(), rebuild=True)["limit"] == 3


def test_what_a_failed_regeneration_and_the_lock_leave_is_ours_and_anything_else_is_not(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    for name in (REGEN_FILE, REGEN_FILE + ".failed.jsonl", "regenerate-server.log", LOCK):
        (out / name).write_text("x")
    assert refuse_folder(out, settings(), rebuild=False) is None
    (out / "notes.txt").write_text("mine")
    with pytest.raises(NotPreparedFolder, match="not empty and is not a prepared-data folder"):
        refuse_folder(out, settings(), rebuild=True)
    with pytest.raises(NotPreparedFolder, match="is a file, not a folder"):
        refuse_folder(out / "notes.txt", settings(), rebuild=True)


def _build_leftovers(out: Path) -> None:
    for name in (STATS_FILE, "state.json", "dataset_info.json", "data-00000-of-00001.arrow", REGEN_FILE,
                 REGEN_FILE + ".failed.jsonl", "notes.txt"):
        (out / name).write_text("x")
    (out / CACHE_DIR).mkdir()
    (out / CACHE_DIR / "conversations.jsonl").write_text("x")


def test_a_rebuild_clears_what_a_build_wrote_and_keeps_answers_only_for_the_same_generation(tmp_path):
    """Answers of the same regeneration settings are kept (a rebuild for another max length regenerates nothing);
    other generation settings clear them. Files draftsmith did not write stay."""
    regen = lambda gen=None, **kw: settings(regenerate="local", gen_kwargs=gen or {"max_tokens": 4}, **kw)  # noqa: E731
    by_other = {**regen(), "answers_by": "another target"}
    cases = [(regen(max_length=64), [REGEN_FILE]), (settings(regenerate="vllm"), []), (regen(thinking=True), []),
             (regen(tokenizer_hash="tok-b"), []), (regen({"max_tokens": 8}), []), (by_other, [])]
    for i, (wanted, kept) in enumerate(cases):
        out = _prepared(tmp_path / str(i), {**regen(), "answers_by": "this target"})
        wanted = {**wanted, "answers_by": wanted.get("answers_by", "this target")}
        _build_leftovers(out)
        claim_folder(out, wanted, rebuild=True)
        assert sorted(p.name for p in out.iterdir()) == sorted([PARTIAL_FILE, "notes.txt", *kept])
        assert json.loads((out / PARTIAL_FILE).read_text()) == {**wanted, "source_content": source_content(
            wanted["source"])}


def test_clear_keeps_the_answers_only_when_asked(tmp_path):
    for keep in (True, False):
        out = tmp_path / str(keep)
        out.mkdir()
        _build_leftovers(out)
        clear(out, keep_answers=keep)
        assert sorted(p.name for p in out.iterdir()) == (["notes.txt", REGEN_FILE] if keep else ["notes.txt"])


def test_a_failed_build_keeps_only_answers_worth_resuming_and_a_folder_it_did_not_create(tmp_path):
    wanted = settings(regenerate="local")
    out = tmp_path / "answers"
    claim_folder(out, wanted, rebuild=False)
    (out / REGEN_FILE).write_text('{"key": "k"}\n')
    (out / CACHE_DIR).mkdir()
    clean_failed(out, created=True)
    assert sorted(p.name for p in out.iterdir()) == [PARTIAL_FILE, REGEN_FILE]  # a rerun resumes them

    out = tmp_path / "empty-answers"  # an empty answers file is nothing to resume
    claim_folder(out, wanted, rebuild=False)
    for name in (REGEN_FILE, REGEN_FILE + ".failed.jsonl"):
        (out / name).write_text("")
    clean_failed(out, created=True)
    assert not out.exists()

    out = tmp_path / "server-log"  # a created folder that keeps a file of ours (a server log) stays, with it
    claim_folder(out, wanted, rebuild=False)
    (out / "regenerate-server.log").write_text("engine died")
    clean_failed(out, created=True)
    assert sorted(p.name for p in out.iterdir()) == ["regenerate-server.log"]

    mine = tmp_path / "mine"  # a folder the user made stays, empty
    mine.mkdir()
    claim_folder(mine, wanted, rebuild=False)
    clean_failed(mine, created=False)
    assert mine.is_dir() and not any(mine.iterdir())

    done = _prepared(tmp_path / "done", wanted)  # a finished folder (a failed re-use) is left as it is
    (done / CACHE_DIR).mkdir()
    clean_failed(done, created=True)
    assert sorted(p.name for p in done.iterdir()) == [META_FILE]
