"""Targets named by Hub id fetch only what they need, from a fake Hub over local folders (offline).

Training on offline features reads the target's embedding and LM head: with a sharded checkpoint
that is one or two shards of many, and its fingerprint (checked against the feature store) is
read from the small files plus 2 MiB ranges of the others, equal to a local copy's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.fake_hub import COMMIT, FakeHub
from tests.helpers.tiny_run import FAST, losses, run


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from models.tiny import save_tiny_target

    hub = FakeHub(tmp_path / "hf-cache", monkeypatch)
    hub.folder = save_tiny_target(tmp_path / "remote" / "tiny", max_shard_size="200KB")
    hub.add("org/tiny", hub.folder)
    return hub


def weight_map(folder) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def test_fingerprint_of_a_hub_id_reads_no_shard_and_equals_a_local_copy(hub, tmp_path):
    from data.store import target_identity
    from models.hub import weight_file_spans
    from models.tiny import save_tiny_target

    shards = set(weight_map(hub.folder).values())
    ident = target_identity("org/tiny")
    assert hub.downloaded_weights() == set() and "config.json" in hub.downloaded
    assert ident["target_fingerprint"] == target_identity(hub.folder)["target_fingerprint"]
    assert ident["target_revision"] == COMMIT and set(hub.ranged) == shards
    # Two spans per absent shard, never the shard: 2 x 4 KiB of each ~200 KB file.
    hub.ranged.clear()
    snapshot = hub.cache / "models--org--tiny" / "snapshots" / COMMIT
    spans = list(weight_file_spans(snapshot, "org/tiny", span=4096))
    assert [s[0] for s in spans] == sorted(shards) and hub.ranged == {s: 8192 for s in shards}
    assert spans == list(weight_file_spans(hub.folder, span=4096))  # the very bytes a local copy gives
    # A fine-tune with the very same shapes and files (another seed) has another fingerprint.
    hub.add("org/tiny-ft", save_tiny_target(tmp_path / "remote" / "tiny-ft", seed=1, max_shard_size="200KB"))
    assert target_identity("org/tiny-ft")["target_fingerprint"] != ident["target_fingerprint"]


def test_an_unsharded_hub_target_is_fingerprinted_by_ranges_until_its_weights_are_here(hub, tmp_path, monkeypatch):
    """A repo with one model.safetensors and no index: with only the small files fetched its weights are read by
    ranges (never fingerprinted from no weights at all); once downloaded, from disk. Both equal a local copy's."""
    from data.store import target_identity
    from models.hub import fetch_model
    from models.tiny import save_tiny_target

    folder = save_tiny_target(tmp_path / "remote" / "single", num_layers=2, seed=3)
    hub.add("org/single", folder)
    local = target_identity(folder)["target_fingerprint"]
    assert target_identity("org/single")["target_fingerprint"] == local
    assert hub.downloaded_weights() == set() and set(hub.ranged) == {"model.safetensors"}
    hub.ranged.clear()
    fetch_model("org/single")
    assert hub.downloaded_weights() == {"model.safetensors"}

    class Unreachable:  # a complete snapshot is read from disk: the Hub is not even listed (works offline)
        def __init__(self):
            raise ConnectionError("no route to host")

    monkeypatch.setattr("huggingface_hub.HfFileSystem", Unreachable)
    assert target_identity("org/single")["target_fingerprint"] == local and hub.ranged == {}


def test_a_revision_reaches_the_hub_and_the_shards_come_from_the_snapshots_commit(hub, monkeypatch):
    """target.revision=main asks the Hub for main; the shards fetched afterwards are asked for at the commit the
    small files came from (main may have moved on meanwhile); a second load asks for the small files only."""
    import huggingface_hub

    from models.hub import fetch_model

    asked, real = [], huggingface_hub.snapshot_download
    monkeypatch.setattr("huggingface_hub.snapshot_download",
                        lambda repo_id, **kw: asked.append(kw["revision"]) or real(repo_id, **kw))
    folder = fetch_model("org/tiny", revision="main")
    assert asked == ["main", COMMIT] and folder.name == COMMIT
    assert hub.downloaded_weights() == set(weight_map(hub.folder).values())
    asked.clear()
    assert fetch_model("org/tiny") == folder and asked == [None]  # its shards are on disk already


def test_names_of_one_model_are_the_same_model_and_two_folders_are_compared_as_folders(tmp_path):
    """A drafter records its target by the name it was given: a Hub id, a Hub cache folder, a quantized copy's id,
    in any case and with a trailing slash, all name one model, and a base or instruct sibling names another; two
    folders that exist here are the same model only when they are the same folder (not two folders of the same name)."""
    from models.hub import same_model

    cache = "/home/me/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/0123abcd"
    for a, b in (("Qwen/Qwen3-8B", cache), (cache + "/", "qwen/qwen3-8b"),
                 ("Qwen/Qwen3-8B/", "mlx-community/Qwen3-8B-4bit"), ("mlx-community/Qwen3-8B-4bit", "Qwen/Qwen3-8B"),
                 ("Qwen/Qwen3-8B", "lmstudio-community/Qwen3-8B-MLX-8bit"), ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B-FP8"),
                 ("unsloth/Qwen3-8B-unsloth-bnb-4bit", "Qwen/Qwen3-8B"),
                 ("meta-llama/Meta-Llama-3.1-8B-Instruct", "mlx-community/Llama-3.1-8B-Instruct-4bit")):
        assert same_model(a, b), (a, b)
    for a, b in (("Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B"), (cache, "Qwen/Qwen3-14B"),
                 ("Qwen/Qwen3-8B/", "meta-llama/Llama-3.1-8B"), ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B-Base"),
                 ("meta-llama/Llama-3.1-8B", "mlx-community/Llama-3.1-8B-Instruct-4bit"),
                 ("Qwen/Qwen3-1", "Qwen/Qwen3-14B")):
        assert not same_model(a, b), (a, b)
    for name in ("a", "b"):
        (tmp_path / name / "t").mkdir(parents=True)
    assert same_model(str(tmp_path / "a" / "t"), str(tmp_path / "a" / "t" / ".." / "t"))
    assert not same_model(str(tmp_path / "a" / "t"), str(tmp_path / "b" / "t"))


def test_the_spans_of_a_local_folder_are_both_ends_of_each_weight_file_in_name_order(tmp_path):
    """Safetensors shards in name order, then .bin weights; each with its size, first and last ``span`` bytes (a
    file shorter than the span is both), and no other file."""
    from models.hub import weight_file_spans

    files = {"model-00002-of-00002.safetensors": bytes(range(256)) * 40,
             "model-00001-of-00002.safetensors": bytes(reversed(range(256))) * 40,
             "pytorch_model.bin": bytes(range(100)) * 30, "config.json": b"{}"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    spans = list(weight_file_spans(tmp_path, span=4096))
    assert [(name, size) for name, size, _, _ in spans] == [
        ("model-00001-of-00002.safetensors", 10240), ("model-00002-of-00002.safetensors", 10240),
        ("pytorch_model.bin", 3000)]
    for name, _, head, tail in spans:
        assert head == files[name][:4096] and tail == files[name][-4096:], name
    # A local folder is read as it is, even one holding only .bin weights (nothing to complete from the Hub).
    for name in list(files)[:2]:
        (tmp_path / name).unlink()
    assert list(weight_file_spans(tmp_path, span=4096)) == [spans[-1]]


def test_ranged_spans_come_in_name_order_whatever_order_the_hub_lists_them(hub, monkeypatch):
    import huggingface_hub

    from models.hub import SMALL_FILES, resolve_model_dir, weight_file_spans

    class Listed(huggingface_hub.HfFileSystem):  # the fake Hub's, listing the repo backwards
        def ls(self, *args, **kwargs):
            return list(reversed(super().ls(*args, **kwargs)))

    monkeypatch.setattr("huggingface_hub.HfFileSystem", Listed)
    directory = resolve_model_dir("org/tiny", allow_patterns=SMALL_FILES)
    names = [name for name, *_ in weight_file_spans(directory, "org/tiny", span=4096)]
    assert names == sorted(set(weight_map(hub.folder).values()))


def test_shards_that_land_outside_the_snapshot_are_named(hub, monkeypatch):
    """The shards of a Hub target are fetched into the snapshot its small files came from: a fetch that lands in
    another folder (another commit) would mix two versions of the repo, and is refused with both folders."""
    from models.hub import SMALL_FILES, fetch_files, resolve_model_dir

    directory = resolve_model_dir("org/tiny", allow_patterns=SMALL_FILES)
    other = hub.cache / "models--org--tiny" / "snapshots" / "fedcba9876543210"
    other.mkdir(parents=True)
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: str(other))
    shard = sorted(set(weight_map(hub.folder).values()))[0]
    with pytest.raises(OSError, match=f"target 'org/tiny': fetched \\['{shard}'\\] into {other}, expected {directory}"):
        fetch_files("org/tiny", directory, [shard], what="target")


def test_borrowed_parts_of_a_hub_id_download_only_the_shards_of_embedding_and_head(hub):
    from safetensors.torch import load_file

    from models.target import TargetModel

    wm = weight_map(hub.folder)
    need = {wm["model.embed_tokens.weight"], wm["lm_head.weight"]}
    target = TargetModel.borrowed_parts("org/tiny")
    assert hub.downloaded_weights() == need and len(need) < len(set(wm.values())) == 8
    ref = {k: load_file(str(hub.folder / wm[k]))[k] for k in ("model.embed_tokens.weight", "lm_head.weight")}
    assert torch.equal(target.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(target.lm_head.weight, ref["lm_head.weight"])
    assert target.tokenizer is not None and not target.has_layers
    TargetModel.borrowed_parts("org/tiny")  # cached: nothing fetched twice
    assert len(hub.downloaded) == len(set(hub.downloaded))
    # The main process of an offline run with true tau then loads the whole target: the rest of the shards
    # land in the same snapshot, none twice, and the fingerprint stays the local copy's.
    from data.store import target_identity

    whole = TargetModel.from_pretrained("org/tiny")
    assert hub.downloaded_weights() == set(wm.values()) and len(hub.downloaded) == len(set(hub.downloaded))
    assert torch.equal(whole.embed_tokens.weight, target.embed_tokens.weight) and whole.has_layers
    assert target_identity(whole)["target_fingerprint"] == target_identity(hub.folder)["target_fingerprint"]


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_whole_hub_target_downloads_its_index_shards_not_a_consolidated_copy(hub, tmp_path, backend):
    """Some repos ship the sharded checkpoint beside a consolidated one: a full load once fetched every
    ``*.safetensors`` of the repo root, both copies."""
    import shutil

    repo = tmp_path / "remote" / "both"
    shutil.copytree(hub.folder, repo)
    shard = sorted(set(weight_map(repo).values()))[0]
    shutil.copy(repo / shard, repo / "consolidated.safetensors")
    hub.add("org/both", repo)
    if backend == "mlx":
        pytest.importorskip("mlx.core")
        from models.target_mlx import TargetModel as Target
    else:
        from models.target import TargetModel as Target
    Target.from_pretrained("org/both")
    assert hub.downloaded_weights() == set(weight_map(repo).values())


def test_a_local_folder_named_like_a_hub_id_or_under_home_is_used_as_it_is(hub, tmp_path, monkeypatch):
    """As in transformers, a local folder wins over a Hub id of the same name (``org/tiny`` copied here), and
    ``~/...`` is the user's home: both load from disk, nothing is fetched."""
    import shutil

    from models.hub import fetch_model, is_hub_id, resolve_model_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    shutil.copytree(hub.folder, tmp_path / "org" / "tiny")
    shutil.copytree(hub.folder, tmp_path / "home" / "targets" / "tiny")
    assert not is_hub_id("org/tiny") and is_hub_id("org/elsewhere")
    assert fetch_model("org/tiny") == Path("org/tiny")
    home = tmp_path / "home" / "targets" / "tiny"
    assert fetch_model("~/targets/tiny") == resolve_model_dir("~/targets/tiny") == home
    assert hub.downloaded == []


def test_the_small_files_of_a_hub_target_are_all_a_load_reads_but_its_weights(hub):
    """Tokenizers without a tokenizer.json ship merges/vocab .txt, a sentencepiece .model or a .tiktoken file, and
    a repo with its own modeling code ships .py: planning or tokenizing a Hub target fetches all of them (the
    tokenizer would not load without them), and no weights or training leftovers."""
    from models.hub import SMALL_FILES, resolve_model_dir

    extra = ["merges.txt", "vocab.txt", "tokenizer.model", "qwen.tiktoken", "modeling_tiny.py", "training_args.bin",
             "optimizer.pt"]
    for name in extra:
        (hub.folder / name).write_bytes(b"x")
    directory = resolve_model_dir("org/tiny", what="target", allow_patterns=SMALL_FILES)
    small = {f.name for f in hub.folder.iterdir() if not f.name.endswith((".safetensors", ".bin", ".pt"))}
    assert {"config.json", "tokenizer.json", "chat_template.jinja", *extra[:5]} <= small
    assert set(hub.downloaded) == small and sorted(f.name for f in directory.iterdir()) == sorted(small)


def test_a_hub_target_quantized_at_a_pinned_revision_is_quantized_from_that_revision(hub, tmp_path):
    """target.revision reaches the quantizer and its cache key: a folder quantized from the repo's head is not
    handed back for a pinned commit (which may hold other weights), and the pinned one is then reused."""
    pytest.importorskip("mlx_lm")
    from models.quantize import QUANT_MARKER, resolve_target

    said = []
    head, _ = resolve_target("org/tiny", "mlx-4bit-g32", tmp_path, log=said.append)
    pinned, _ = resolve_target("org/tiny", "mlx-4bit-g32", tmp_path, revision=COMMIT, log=said.append)
    assert pinned == head and len(said) == 2
    assert json.loads((tmp_path / "target-mlx-4bit-g32" / QUANT_MARKER).read_text())["revision"] == COMMIT
    assert resolve_target("org/tiny", "mlx-4bit-g32", tmp_path, revision=COMMIT, log=said.append)[0] == pinned
    assert len(said) == 2


def test_preparing_data_for_a_hub_target_downloads_its_tokenizer_not_its_weights(hub, tmp_path):
    """data.prepare without in-process regeneration (none, or a server) needs the tokenizer and chat
    template only: no shard is fetched, and the rows equal those prepared with a local copy."""
    from datasets import load_from_disk

    from data.prepare import prepare
    from data.tiny_chat import write

    source = write(tmp_path / "chat.jsonl", n=12, seed=0)
    prepare("org/tiny", str(source), tmp_path / "hub", thinking=False, max_length=128, progress=False)
    assert hub.downloaded_weights() == set() and "tokenizer.json" in hub.downloaded
    prepare(str(hub.folder), str(source), tmp_path / "local", thinking=False, max_length=128, progress=False)
    a, b = load_from_disk(str(tmp_path / "hub")), load_from_disk(str(tmp_path / "local"))
    assert len(a) == len(b) > 0 and a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]


def test_offline_training_on_a_hub_target_takes_the_local_runs_steps_from_two_shards(hub, tmp_path):
    """A store extracted from a local copy, training by Hub id: the store accepts the target (same
    fingerprint), only the embedding's and head's shards are downloaded, and the losses are the local run's."""
    from data.extract import main as extract_main
    from data.prepare import prepare
    from data.tiny_chat import write

    source = write(tmp_path / "chat.jsonl", n=40, seed=0)
    data, store = tmp_path / "data", tmp_path / "feats"
    prepare(str(hub.folder), str(source), data, thinking=False, max_length=128, progress=False)
    extract_main(["--target", str(hub.folder), "--data", str(data), "--out", str(store), "--layers", "1", "3", "5",
                  "--target-dtype", "float32", "--device", "cpu", "--no-progress"])
    common = [*FAST, f"data.prepared={data}", "features.mode=offline", f"features.store={store}",
              "drafter.target_layer_ids=[1,3,5]", "train.max_steps=2", "train.batch_size=4", "train.anchors=8",
              "logging.every=1", "eval.batches=1"]
    run(tmp_path / "hub-run", "target.path=org/tiny", *common)
    wm = weight_map(hub.folder)
    assert hub.downloaded_weights() == {wm["model.embed_tokens.weight"], wm["lm_head.weight"]}
    run(tmp_path / "local-run", f"target.path={hub.folder}", *common)
    assert losses(tmp_path / "hub-run") == losses(tmp_path / "local-run")


def test_stores_fingerprinted_by_config_before_still_match_their_hub_target(hub, tmp_path):
    """Earlier versions fingerprinted a loaded target named by Hub id by its config alone: a store or
    prepared data recorded so is accepted for that target, and a store of another target still refused."""
    import hashlib

    from data.store import FeatureStore, StoreMismatch, legacy_hub_fingerprint
    from models.target import TargetModel

    target = TargetModel.borrowed_parts("org/tiny")
    legacy = hashlib.sha256(target.model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
    assert legacy_hub_fingerprint(target) == legacy
    assert legacy_hub_fingerprint(TargetModel.borrowed_parts(hub.folder)) is None  # a local folder never was
    store = tmp_path / "feats"
    store.mkdir()
    for fingerprint, ok in ((legacy, True), ("0123456789abcdef", False)):
        index = {"format": "draftsmith-features", "version": 1, "target": "org/tiny", "target_revision": None,
                 "target_fingerprint": fingerprint, "layer_ids": [1], "hidden_size": 64, "dtype": "bf16",
                 "topk": 0, "tokenizer_hash": None, "rows": 0, "tokens": 0, "plan": [], "shards": {},
                 "complete": True}
        (store / "index.json").write_text(json.dumps(index))
        fs = FeatureStore(store, verify=False)
        if ok:
            fs.check_compatible(target=target)
        else:
            with pytest.raises(StoreMismatch, match="store was extracted from 'org/tiny' .*fingerprint 0123"):
                fs.check_compatible(target=target)


def test_fingerprint_after_borrowing_two_shards_reads_the_rest_by_ranges(hub):
    """With only the embedding's and head's shards downloaded, the snapshot is not complete: the absent shards
    are read by ranges at the snapshot's commit, so the fingerprint stays the local copy's (a fingerprint of
    the two local shards alone would refuse every store extracted from the whole target)."""
    from data.store import target_identity
    from models.target import TargetModel

    wm = weight_map(hub.folder)
    TargetModel.borrowed_parts("org/tiny")
    local = {wm["model.embed_tokens.weight"], wm["lm_head.weight"]}
    assert hub.downloaded_weights() == local
    ident = target_identity("org/tiny")
    assert ident["target_fingerprint"] == target_identity(hub.folder)["target_fingerprint"]
    assert set(hub.ranged) == set(wm.values()) - local and ident["target_revision"] == COMMIT


def test_a_hub_drafter_downloads_what_a_load_reads_not_every_file_of_its_repo(hub, tmp_path):
    """A drafter named by Hub id fetches its config, code and safetensors: an optimizer state or a .bin copy
    beside them in the repo is not downloaded."""
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from tests.helpers import tiny_drafter_config

    target = TargetModel.from_pretrained(hub.folder)
    repo = tmp_path / "remote" / "drafter"
    torch.manual_seed(0)
    DFlashDraftModel(tiny_drafter_config(target)).save_pretrained(repo)
    (repo / "optimizer.bin").write_bytes(b"\0" * 4096)
    (repo / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    hub.add("org/drafter", repo)
    hub.downloaded.clear()
    drafter = DFlashDraftModel.from_pretrained("org/drafter")
    assert "model.safetensors" in hub.downloaded and "config.json" in hub.downloaded
    assert not {"optimizer.bin", "pytorch_model.bin"} & set(hub.downloaded)
    assert drafter.config.hidden_size == target.hidden_size


def test_a_loaded_hub_target_is_fingerprinted_from_the_commit_it_was_loaded_at(hub, monkeypatch):
    """A target loaded by Hub id is fingerprinted from its files (never its config alone), asked for at the commit
    its config came from: with main moved on, files of another revision would fingerprint another target."""
    import huggingface_hub

    from data.store import target_identity
    from models.target import TargetModel

    target = TargetModel.borrowed_parts("org/tiny")
    assert target.revision == COMMIT and not target.identity
    asked, real = [], huggingface_hub.snapshot_download
    monkeypatch.setattr("huggingface_hub.snapshot_download",
                        lambda repo_id, **kw: asked.append(kw["revision"]) or real(repo_id, **kw))
    assert target_identity(target) == {"target": "org/tiny", "target_revision": COMMIT,
                                       "target_fingerprint": target_identity(hub.folder)["target_fingerprint"]}
    assert asked == [COMMIT] and TargetModel.from_pretrained("org/tiny").revision == COMMIT  # a whole load too
    assert TargetModel.from_pretrained(hub.folder).revision is None  # a local folder: no commit
