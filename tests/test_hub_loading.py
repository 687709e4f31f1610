"""Targets named by Hub id fetch only what they need, from a fake Hub over local folders (offline).

Training on offline features reads the target's embedding and LM head: with a sharded checkpoint
that is one or two shards of many, and its fingerprint (checked against the feature store) is
read from the small files plus 2 MiB ranges of the others, equal to a local copy's.
"""

from __future__ import annotations

import json

import pytest
import torch

from fake_hub import COMMIT, FakeHub
from test_train_run import FAST, losses, run


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
    # A fine-tune with the very same shapes and files (another seed) has another fingerprint.
    hub.add("org/tiny-ft", save_tiny_target(tmp_path / "remote" / "tiny-ft", seed=1, max_shard_size="200KB"))
    assert target_identity("org/tiny-ft")["target_fingerprint"] != ident["target_fingerprint"]


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
    from conftest import tiny_drafter_config
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel

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
