"""Scale-out: data-parallel extraction, a target dispatched over devices, FSDP and two "nodes" on CPU.

Multi-process cases launch 2 CPU processes (gloo) with torchrun / accelerate, the way a GPU node
runs 8; shapes are tiny and runs are 2 steps, so each launch costs a few seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_close

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "data"
LAYERS = [1, 3, 4]
SHARD_MB = 0.03  # ~80 tokens per shard at hidden 64 x 3 taps bf16: 7 shards from the fixtures (7 rows)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}


def launch(*args: str, nproc: int = 2, timeout: int = 300, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N ARGS`` on CPU (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *extra,
           *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def store_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from data.prepare import prepare
    from models.tiny import save_tiny_target

    root = tmp_path_factory.mktemp("scale_out")
    target_dir = save_tiny_target(root / "target", "qwen3", num_layers=6)
    src = root / "chats"
    src.mkdir()
    for name in ("openai", "sharegpt", "alpaca"):
        shutil.copy(FIX / f"{name}.jsonl", src)
    prepare(str(target_dir), str(src), root / "data", progress=False)
    return {"root": root, "target": target_dir, "data": root / "data"}


# ----------------------------------------------------------------------------- data-parallel extraction
def extract_args(prepared, out: Path) -> list[str]:
    return ["--target", str(prepared["target"]), "--data", str(prepared["data"]), "--out", str(out),
            "--layers", *map(str, LAYERS), "--batch-size", "2", "--shard-mb", str(SHARD_MB),
            "--target-dtype", "float32", "--device", "cpu", "--no-progress"]


class Killed(Exception):
    pass


def test_two_processes_extract_the_same_store_and_a_killed_rank_resumes(prepared, tmp_path, monkeypatch):
    """1 process vs 2 (torchrun, gloo) after a run whose rank 1 died: byte-identical stores.

    The killed run is played in this process, rank by rank (a no-op barrier): rank 0 writes its
    share and the index, rank 1 dies right after its first shard, leaving only its sidecar. The
    2-process launch then computes what is missing, split between its ranks, and rank 0 finalises.
    """
    from data import store
    from data.extract import Ranks, extract
    from data.store import FeatureStore
    from models.target import TargetModel

    target = TargetModel.from_pretrained(prepared["target"], dtype=torch.float32)
    kw = dict(layer_ids=LAYERS, batch_size=2, shard_mb=SHARD_MB, progress=False)
    one = tmp_path / "one"
    report = extract(target, prepared["data"], one, **kw)
    assert report.complete and report.shards >= 6

    two = tmp_path / "two"
    rank0 = extract(target, prepared["data"], two, ranks=Ranks(0, 2), **kw)
    assert rank0.shards_written == (report.shards + 1) // 2 and rank0.complete is False
    write = store.StoreWriter.write_shard

    def write_then_die(self, k, rows):
        write(self, k, rows)
        raise Killed

    monkeypatch.setattr(store.StoreWriter, "write_shard", write_then_die)
    with pytest.raises(Killed):
        extract(target, prepared["data"], two, ranks=Ranks(1, 2), **kw)
    monkeypatch.undo()
    assert '"complete": false' in (two / "index.json").read_text()
    assert len(list(two.glob("shard-*.safetensors.json"))) == 1, "rank 1's shard is only in its sidecar"
    assert len(list(two.glob("shard-*.safetensors"))) == rank0.shards_written + 1

    resumed = launch("-m", "data.extract", *extract_args(prepared, two))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    lines = [json.loads(ln)["extract"] for ln in resumed.stdout.splitlines() if ln.startswith('{"extract"')]
    assert sorted(r["rank"] for r in lines) == [0, 1] and all(r["world"] == 2 for r in lines)
    missing = report.shards - rank0.shards_written - 1
    assert sorted(r["shards_written"] for r in lines) == [missing // 2, missing - missing // 2]  # split, no overlap
    assert store_bytes(two) == store_bytes(one)  # same index, same shards, no sidecar left
    FeatureStore(two).verify_all()


# ----------------------------------------------------------------------------- target over several devices
def drafter_loss(target, batch, seed: int = 0) -> torch.Tensor:
    """The training objective on a batch of target features: one seeded drafter, one anchor draw."""
    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel
    from train.objective import attention_masks, block_loss, drafter_forward, draw_blocks

    torch.manual_seed(seed)
    config = DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=target.vocab_size, num_target_layers=6,
                          target_layer_ids=LAYERS, mask_token_id=target.vocab_size - 1, block_size=4,
                          torch_dtype="float32")
    drafter = DFlashDraftModel(config).init_weights()
    ids, lm, doc, pos = batch.input_ids, batch.loss_mask, batch.doc_ids.long(), batch.position_ids
    blocks = draw_blocks(ids, lm, doc, pos, 8, 4, config.mask_token_id, torch.Generator().manual_seed(seed))
    hidden = drafter_forward(drafter, target.embed_tokens, blocks, batch.features, pos,
                             attention_masks(config, blocks, doc, pos, use_flex=False))
    return block_loss(hidden, blocks, target.lm_head.weight, 4.0).loss


def test_target_dispatched_over_devices_gives_the_same_features_and_loss(prepared):
    """device_map plumbing: every module of the target its own dispatch entry, with accelerate's hooks
    moving activations between them as between GPUs (CPU "devices" here; GPU runs: README, Scaling out)."""
    from accelerate import dispatch_model

    from data.features import OnlineFeatures
    from data.prepare import load_prepared
    from models.target import TargetModel

    whole = TargetModel.from_pretrained(prepared["target"], dtype=torch.float32)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" for i in range(6)}}
    spread = TargetModel.from_pretrained(prepared["target"], dtype=torch.float32, device_map=device_map)
    dispatch_model(spread.model, device_map=device_map, force_hooks=True)
    assert all(hasattr(layer, "_hf_hook") for layer in spread.layers), "every layer is dispatched"
    ds, _ = load_prepared(prepared["data"])
    a = OnlineFeatures(whole, LAYERS, ds, topk=4).get_batch(range(4))
    b = OnlineFeatures(spread, LAYERS, ds, topk=4).get_batch(range(4))
    assert torch.equal(a.features, b.features) and torch.equal(a.topk_logprobs, b.topk_logprobs)
    loss_a, loss_b = drafter_loss(whole, a), drafter_loss(spread, b)
    assert 0.5 < float(loss_a.detach()) < 20
    assert_close(loss_b, loss_a, atol=0, rtol=0, what="loss with the dispatched target")

