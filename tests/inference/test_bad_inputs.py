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

from tests.helpers.bad_input import _export_error, _generate, _validate, argparse_error, bench

pytestmark = pytest.mark.bad_input


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

    from inference.torch_loop import DrafterProposer
    from models.drafter import DFlashDraftModel
    from tests.helpers import tiny_drafter_config

    target = infer_dirs["full"]
    cfg = tiny_drafter_config(target)
    cfg.mask_token_id = target.tokenizer.eos_token_id  # as a hand-edited or foreign config.json may say
    with caplog.at_level(logging.WARNING):
        DrafterProposer(DFlashDraftModel(cfg), target)
    assert "mask_token_id" in caplog.text and "eos token" in caplog.text


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
    from tests.helpers.tiny_run import FAST, run, tiny_input_dirs

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
    from models.support import hold

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
    from tests.helpers import ReferenceProposer

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
    from inference import mlx_loop
    from models.target_mlx import TargetModel
    from tests.helpers import ReferenceProposer

    class Lagging(ReferenceProposer):
        def context_length(self) -> int:
            return self.seen - 1  # a proposer that lost a position

    target = TargetModel.from_pretrained(infer_dirs["full_dir"])
    with pytest.raises(RuntimeError, match="draft cache holds .* positions but .* are committed"):
        mlx_loop.dflash_generate(target, Lagging(list(range(200)), [1, 3, 5], 4, 288), [1, 2, 3], max_new_tokens=8)


def test_torch_loop_choice_on_the_mlx_backend(tmp_path):
    """--loop picks among the torch loops: asking the MLX backend for one is refused before anything loads."""
    from inference.session import Session

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
    from models.support import is_user_error
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

    from inference.session import Session
    from models.support import parse_dtype

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

    from inference.session import Session

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


def test_validate_skips_prompts_past_the_targets_positions_with_a_count(capsys):
    """The long set (5k-token prompts) ran on a 4096-position target without a word, then with a warning: its
    numbers described a target beyond its context. Those prompts are skipped with a count by category; the others
    run; none left is an error."""
    from inference.prompt_sets import Prompt
    from inference.validate import skip_too_long

    prompts = [Prompt(f"p{i}", cat, []) for i, cat in enumerate(["long", "code", "long"])]
    ids, kept, skipped = skip_too_long([[1] * 5000, [1] * 100, [1] * 4100], prompts, 64, 4096)
    assert (ids, [p.id for p in kept], skipped) == ([[1] * 100], ["p1"], 2)
    err = capsys.readouterr().err
    assert ("validate: skipped 2 of 3 prompts (long: 2; longest 5000 tokens) plus --max-new-tokens 64 run past the "
            "target's 4096 positions") in err
    assert skip_too_long([[1] * 4032], prompts[:1], 64, 4096) == ([[1] * 4032], prompts[:1], 0)  # fills it exactly
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="--prompts: all 1 of 1 prompts .* lower --max-new-tokens"):
        skip_too_long([[1] * 5000], prompts[:1], 64, 4096)


def test_several_shipped_prompt_sets_are_one_prompts_value():
    """--prompts code,math was taken for a Hub data set id."""
    from inference.prompt_sets import load_prompts

    assert {p.category for p in load_prompts("code,math", n=2)} == {"code", "math"}
    assert len(load_prompts("math,code", n=1)) == 2
    with pytest.raises(FileNotFoundError, match="--prompts code,maths: 'maths' is not a shipped prompt set"):
        load_prompts("code,maths")


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


def test_generate_says_dash_where_a_one_token_run_has_no_tau(tmp_path, capsys):
    """--max-new-tokens 1 has no decode step: it printed tau 0.00 and speedup 0.00x (the JSON said null)."""
    from inference.bench import tiny_folders
    from inference.generate import main

    target, draft = tiny_folders("qwen3", str(tmp_path))
    main(["--target", target, "--draft", draft, "--prompt-ids", "257,85,82", "--max-new-tokens", "1",
          "--baseline", "--backend", "torch", "--device", "cpu"])
    err = capsys.readouterr().err
    assert "tau - | decode - tok/s" in err and "speedup -" in err


def test_a_quantized_mlx_drafter_on_the_torch_backend_says_to_use_mlx(tmp_path, export_drafter):
    """It was refused as weights that do not match config.json, with "re-export" as the fix."""
    pytest.importorskip("mlx.core")
    from export.mlx import export_mlx
    from models.drafter import DFlashDraftModel

    export_mlx(export_drafter, tmp_path / "q4", quantize=4, group_size=32, log=lambda *_: None)
    with pytest.raises(ValueError, match="q4 is a quantized MLX export \\(4-bit, group 32\\): only the MLX backend "
                                         "runs it \\(--backend mlx\\)"):
        DFlashDraftModel.from_pretrained(tmp_path / "q4")


def test_static_loop_bench_with_few_new_tokens_fits_its_warm_up(capsys):
    """The warm-up generates 2 blocks: a static cache sized from --max-new-tokens 8 alone was too short."""
    bench("inference")(["--tiny", "qwen3", "--loop", "static", "--max-new-tokens", "8", "--prompts", "hi"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["bench"] for x in lines] == ["decode", "decode_parts"]
    assert lines[0]["loop"] == "static" and lines[0]["tokens"] == 8


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
    from inference.static_loop import (
        StaticDrafterProposer,
        StaticTarget,
        static_dflash_generate,
        static_target_generate,
    )
    from models.drafter import DFlashDraftModel
    from tests.helpers import ReferenceProposer, tiny_drafter_config

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


def test_inference_bench_random_tiny_target(capsys):
    bench("inference")(["--random-target", "tiny", "--loop", "eager", "--max-new-tokens", "4", "--prompts", "x",
                        "--prompt-tokens", "8"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert lines[0]["bench"] == "decode" and lines[0]["tokens"] == 4 and lines[0]["prompt_tokens"] == 8


@pytest.mark.parametrize("module, flag", [("train", "--e2e"), ("inference", "--random-target")])
def test_a_recipe_without_a_target_shape_names_the_ones_that_work(no_build, module, flag):
    with pytest.raises(ValueError, match=r"recipe 'small' has no random-target shape.*'qwen3-8b'.*'tiny'"):
        bench(module)([flag, "small"])


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


@pytest.mark.parametrize("module, extra", [("data", []), ("inference", ["--tiny", "qwen3"])])
def test_device_cuda_without_cuda_is_one_line(no_cuda, module, extra):
    with pytest.raises(ValueError, match="--device cuda but torch sees no CUDA device: use --device cpu"):
        bench(module)([*extra, "--device", "cuda"])


@pytest.mark.parametrize("module, extra", [("data", []), ("inference", ["--tiny", "qwen3"])])
def test_device_that_is_no_device_is_an_argparse_error(capsys, module, extra):
    assert "--device 'gpu': use cpu or cuda" in argparse_error(capsys, module, [*extra, "--device", "gpu"])


def test_inference_bench_loop_with_the_mlx_backend_is_refused(capsys):
    assert "--loop times the torch loops; the MLX backend runs its own" in argparse_error(
        capsys, "inference", ["--tiny", "qwen3", "--loop", "eager", "--backend", "mlx"])


@pytest.mark.parametrize("loop", [[], ["--loop", "eager"]])
def test_inference_bench_swapped_target_and_draft_says_swap(tmp_path, loop):
    from inference.bench import tiny_folders

    target, draft = tiny_folders("qwen3", str(tmp_path))
    with pytest.raises(ValueError, match=r"swap them \(--target .*target --draft .*draft\)"):
        bench("inference")(["--target", draft, "--draft", target, *loop])


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


@pytest.mark.parametrize("arch, words", [
    ("qwen3_next", "its GatedDeltaNet layers fuse their input projections"),
    ("deepseek_v3", "its multi-head latent attention caches one compressed latent"),
    ("kimi_k25", "its multi-head latent attention caches one compressed latent")])
def test_static_loop_refuses_qwen3_next_and_latent_attention_in_one_line(tiny_targets, arch, words):
    """Qwen3-Next (fused GatedDeltaNet projections the static pass does not read) and latent-attention targets
    (DeepSeek-V3, Kimi: latent caches, not per-head K/V buffers) are refused by name, for --loop static and when
    the static target is built; --loop auto runs them eager. The checks also hold without the family table: a
    GatedDeltaNet of another layout, a config with a KV latent."""
    from types import SimpleNamespace

    from inference.session import choose_loop
    from inference.static_target import StaticLoopUnsupported, StaticTarget, check_static_target

    target = tiny_targets(arch)
    drafter = SimpleNamespace(config=SimpleNamespace(use_sliding_window=False, block_size=8))
    cuda = SimpleNamespace(**{k: getattr(target, k) for k in ("family", "model_type", "layer_types", "is_hybrid",
                                                               "layers", "config", "model")},
                           device=torch.device("cuda"))
    for build in (lambda: StaticTarget(target, [1], max_len=64, block_size=8),
                  lambda: choose_loop("static", cuda, drafter)):
        with pytest.raises(StaticLoopUnsupported, match=f"cannot run {target.model_type}: {words}.*--loop eager"):
            build()
    assert choose_loop("auto", cuda, drafter) == "eager"
    cuda.family = "qwen3"  # a family the table lets through: the layers and the config still refuse
    with pytest.raises(StaticLoopUnsupported, match="Qwen3NextGatedDeltaNet|compressed latent"):
        check_static_target(cuda)


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
    """An empty prompt, a target loaded with flash attention (the static mask of stale slots would be ignored),
    a block of another size and features that do not continue the drafter's cache each get a named error
    instead of wrong drafts or an opaque traceback. (Sliding-window drafters run: test_dflash2_loops.py.)"""
    import torch

    from inference.static_loop import StaticDrafterProposer, StaticLoopUnsupported, StaticTarget, static_dflash_generate
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import tiny_target
    from tests.helpers import tiny_drafter_config

    target = tiny_targets("qwen3")
    torch.manual_seed(0)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=64, block_size=8)
    proposer = StaticDrafterProposer(drafter, target, max_len=64)
    with pytest.raises(ValueError, match="the prompt is empty"):
        static_dflash_generate(st, proposer, [], 8)
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

    from inference.static_loop import build_static_loop, static_dflash_generate, static_target_generate
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer
    from tests.helpers import tiny_drafter_config

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


@pytest.mark.parametrize("key", ["hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"])
def test_a_drafter_config_without_a_shape_key_is_named_by_export_and_validate(tmp_path, export_drafter, infer_dirs,
                                                                               key):
    """config.json without hidden_size (a hand-edited or foreign drafter) was a KeyError traceback in every loader."""
    import json

    from inference.checks import preflight
    from models.config_keys import ConfigError

    d = json.loads((export_drafter / "config.json").read_text())
    del d[key]
    (export_drafter / "config.json").write_text(json.dumps(d))
    said = f"{key}=None: missing from config.json"
    assert said in _export_error("hf", ["--checkpoint", str(export_drafter), "--out", str(tmp_path / "out")])
    with pytest.raises(ConfigError, match=said):
        preflight(infer_dirs["target"], str(export_drafter))


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


# ------------------------------------------------------------------------------------------ DFlash2 folders
@pytest.mark.parametrize("run", [_generate, _validate])
def test_dflash2_folders_swapped_or_for_another_target(infer_dirs, tmp_path, run):
    """A DFlash2 folder (published layout, trained for a 6-layer target) is pre-flighted as a v1 one: given as the
    target it is named by its own architecture, and against the 8-layer target the depth is named."""
    from tests.helpers.dflash2 import published_folder

    draft = str(published_folder(tmp_path / "published"))
    extra = ("--prompt-ids", "1") if run is _generate else ()
    with pytest.raises(ValueError, match=r"is a DFlash drafter \(.*published/config.json names DFlash2DraftModel\) "
                                         "and --draft .* is not: swap them"):
        run(infer_dirs, *extra, target=draft, draft=infer_dirs["target"])
    with pytest.raises(ValueError, match="was trained on a 6-layer target; this target has 8 layers"):
        run(infer_dirs, *extra, draft=draft)


def test_dflash2_folder_without_is_causal_or_a_codebook(infer_dirs, tmp_path):
    """A DFlash2 config.json without ``is_causal: false`` (z-lab's code would make its layers causal) ends in one
    line before any weights load; a folder missing a selector codebook names it when the drafter loads."""
    import json

    from safetensors.torch import load_file, save_file

    from inference.session import Session
    from models.config_keys import ConfigError
    from models.tiny import save_tiny_target
    from tests.helpers.dflash2 import published_folder

    folder = published_folder(tmp_path / "causal")
    config = json.loads((folder / "config.json").read_text())
    del config["is_causal"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="is_causal.*config.json must say is_causal: false"):
        _generate(infer_dirs, "--prompt-ids", "1", draft=str(folder))
    folder = published_folder(tmp_path / "no-codebook")
    state = load_file(str(folder / "model.safetensors"))
    del state["candidate_selector.successor_codebook"]
    save_file(state, str(folder / "model.safetensors"))
    target = save_tiny_target(tmp_path / "target6", num_layers=6)
    with pytest.raises(ValueError, match=r"missing \['candidate_selector.successor_codebook'\]"):
        Session("torch", str(target), str(folder), "cpu", "float32")


def _drafter_copy(infer_dirs, tmp_path, name: str = "draft"):
    import shutil

    return Path(shutil.copytree(infer_dirs["draft"], tmp_path / name))


def test_a_drafter_with_nan_weights_is_refused_before_the_target_loads(infer_dirs, tmp_path):
    """generate / validate ran a NaN drafter at tau 1.00 without a word. Refused naming the tensor, before any
    weights load (the target folder here has none: a load would fail otherwise)."""
    from safetensors.torch import load_file, save_file

    draft = _drafter_copy(infer_dirs, tmp_path)
    state = load_file(str(draft / "model.safetensors"))
    state["hidden_norm.weight"][0] = float("nan")
    save_file(state, str(draft / "model.safetensors"), metadata={"format": "pt"})
    n = state["hidden_norm.weight"].numel()
    said = f"--draft {draft}: weight hidden_norm.weight (1 NaN, 0 Inf of {n} values) is not finite"
    with pytest.raises(ValueError, match=re.escape(said)):
        _generate(infer_dirs, "--prompt-ids", "1,2", draft=str(draft))
    with pytest.raises(ValueError, match=re.escape(said) + ".*tau 1.00"):
        _validate(infer_dirs, draft=str(draft))


def test_a_quantized_mlx_drafter_on_the_torch_backend_is_refused_before_the_target_loads(infer_dirs, tmp_path):
    """It was refused by the drafter's loader, after the target had loaded (minutes for a large one)."""
    d = json.loads((Path(infer_dirs["draft"]) / "config.json").read_text())
    q4 = tmp_path / "q4"
    q4.mkdir()
    d["quantization"] = d["quantization_config"] = {"bits": 4, "group_size": 32, "mode": "affine"}
    (q4 / "config.json").write_text(json.dumps(d))
    (q4 / "model.safetensors").write_bytes((Path(infer_dirs["draft"]) / "model.safetensors").read_bytes())
    said = (f"--draft {q4} is a quantized MLX export (4-bit, group 32): only the MLX backend runs it (--backend mlx); "
            "with PyTorch use the full-precision drafter")
    for run in (_generate, _validate):
        with pytest.raises(ValueError, match=re.escape(said)):
            run(infer_dirs, *(["--prompt-ids", "1,2"] if run is _generate else []), draft=str(q4))


def test_generate_and_validate_render_prompts_with_the_drafters_thinking_setting(infer_dirs, tmp_path, capsys):
    """Both rendered prompts with their own default (validate: off; generate: the template's) whatever the drafter
    was trained with. They take the drafter's recorded data.thinking unless told otherwise, and say so; an explicit
    --thinking that differs gets a warning."""
    from inference.checks import read_drafter_config, resolve_thinking

    draft = _drafter_copy(infer_dirs, tmp_path)
    d = json.loads((draft / "config.json").read_text())
    d["draftsmith"] = {"target": infer_dirs["full_dir"], "data": {"thinking": True}}
    (draft / "config.json").write_text(json.dumps(d))
    cfg = read_drafter_config(draft)[0]
    said = []
    assert resolve_thinking(None, cfg, "off", said.append) == "on" and said == [
        "thinking on: as the drafter was trained (its recorded data.thinking; --thinking on|off overrides)"]
    assert resolve_thinking("off", cfg, "off", said.append) == "off" and said[-1].startswith(
        "warning: --thinking off, but the drafter was trained with thinking on (its recorded data.thinking)")
    assert resolve_thinking("on", cfg, "off", said.append) == "on" and len(said) == 2
    plain = read_drafter_config(infer_dirs["draft"])[0]
    assert resolve_thinking(None, plain, "off", said.append) == "off" and len(said) == 2  # records none: as before

    target = infer_dirs["full_dir"]
    _generate(infer_dirs, "--prompt", "hi", "--chat", "--max-new-tokens", "2", target=target, draft=str(draft))
    assert "thinking on: as the drafter was trained" in capsys.readouterr().err
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    report = _validate(infer_dirs, "--prompts", str(prompts), "--max-new-tokens", "2", target=target,
                       draft=str(draft))
    assert report["thinking"] == "on" and "thinking on: as the drafter was trained" in capsys.readouterr().err


@pytest.mark.parametrize("loop", ["eager", "static", "compiled", "mlx"])
def test_report_md_names_the_loop_that_ran(loop):
    """report.json said which loop ran (eager / static / compiled); report.md, what people read and paste, did not,
    and an MLX run said "eager"."""
    from inference.report import PromptRun, build_report, markdown
    from inference.stats import GenerationResult

    run = PromptRun("p0", "code", 3)
    result = GenerationResult(tokens=[1, 2, 3, 4], acceptance_lengths=[2, 1], position_accepts=[1, 0, 0],
                              block_size=4, prefill_s=0.1, decode_s=0.2)
    run.dflash.append(result)
    run.baseline.append(GenerationResult(tokens=[1, 2, 3, 4], decode_s=0.3, prefill_s=0.1))
    text = markdown(build_report([run], 4, True, {"backend": "mlx" if loop == "mlx" else "torch", "loop": loop,
                                                 "temperature": 0}))
    assert f"Loop: {loop} (DFlash and the baseline both ran it)." in text and f"- loop: {loop}" in text


def test_an_mlx_session_describes_its_loop_as_mlx():
    from inference.session import Session

    session = Session.__new__(Session)
    session.backend, session.loop_kind = "mlx", "eager"
    pytest.importorskip("mlx.core")
    session.target = type("T", (), {"dtype": "mlx.core.bfloat16"})()
    session.proposer = None
    assert session.describe()["loop"] == "mlx"


def test_a_full_disk_in_validate_names_the_folder_and_says_a_rerun_resumes(infer_dirs, tmp_path, monkeypatch):
    """It ended in a bare "[Errno 28] No space left on device". (Fault injection: the prompt recorder raises what a
    full disk raises.)"""
    import errno
    import os

    from inference import partial
    from models.support import run_cli

    def full(self, *a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(partial.Recorder, "__call__", full)
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: _validate(infer_dirs, "--prompts", str(prompts), "--max-new-tokens", "2",
                                  target=infer_dirs["full_dir"]))
    out = infer_dirs["root"] / "out"
    assert str(e.value.code).startswith(f"error: no space left on the disk of {out} (")
    assert "free space there and rerun the same command: it resumes: the prompts measured so far are kept in " \
           "partial.jsonl" in str(e.value.code)
