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
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_close

ROOT = Path(__file__).resolve().parents[2]
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
    """The store's files (not the lock the CLI's process 0 holds there while it writes)."""
    from data.extract import LOCK

    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != LOCK}


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
    from data import store_writer
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
    write = store_writer.StoreWriter.write_shard

    def write_then_die(self, k, rows):
        write(self, k, rows)
        raise Killed

    monkeypatch.setattr(store_writer.StoreWriter, "write_shard", write_then_die)
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


def test_ranks_split_the_missing_shards_read_before_any_is_written_and_only_rank_0_finalises(tiny_targets, tmp_path,
                                                                                            monkeypatch):
    """Rank r of w takes every w-th missing shard, as every rank read them before any shard was written: rank 1
    (a thread here) opening the index as late as rank 0 lets it still take its share. Rank 0 alone finalises: the
    store is the one-process store."""
    import threading

    from data import store_writer
    from data.bench import random_data
    from data.extract import Ranks, extract
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer

    assert [Ranks(r, 3).share([0, 2, 3, 5, 6, 7, 9]) for r in range(3)] == [[0, 5, 9], [2, 6], [3, 7]]
    assert [Ranks(r, 3).is_main for r in range(3)] == [True, False, False]
    target, data = tiny_targets("qwen3"), random_data(8, 40, 250)
    kw = dict(layer_ids=[1, 3], batch_size=2, shard_tokens=80, progress=False)
    assert extract(target, data, tmp_path / "one", **kw).shards == 4

    meet, seen = threading.Barrier(2, timeout=30), threading.Condition()
    count = {"rank 0 barriers": 0, "shards written": 0}

    def rank0_barrier():
        with seen:
            count["rank 0 barriers"] += 1
            seen.notify_all()
        meet.wait()

    write, open_store = store_writer.StoreWriter.write_shard, store_writer.StoreWriter.__init__

    def write_and_count(self, *args, **kwargs):
        info = write(self, *args, **kwargs)
        with seen:
            count["shards written"] += 1
            seen.notify_all()
        return info

    def open_late(self, *args, main=True, **kwargs):  # rank 1 reads the index once rank 0 wrote or waits
        if not main:
            with seen:
                seen.wait_for(lambda: count["shards written"] or count["rank 0 barriers"] >= 2, timeout=30)
        open_store(self, *args, main=main, **kwargs)

    monkeypatch.setattr(store_writer.StoreWriter, "write_shard", write_and_count)
    monkeypatch.setattr(store_writer.StoreWriter, "__init__", open_late)
    reports, twin = {}, TargetModel(tiny_target("qwen3", seed=0), tiny_tokenizer("chatml"))  # a target per thread
    rank1 = threading.Thread(target=lambda: reports.update(
        {1: extract(twin, data, tmp_path / "two", ranks=Ranks(1, 2, meet.wait), **kw)}))
    rank1.start()
    reports[0] = extract(target, data, tmp_path / "two", ranks=Ranks(0, 2, rank0_barrier), **kw)
    rank1.join()
    assert [(r.shards_written, r.complete) for r in (reports[0], reports[1])] == [(2, True), (2, None)]
    assert store_bytes(tmp_path / "two") == store_bytes(tmp_path / "one")


def test_one_process_joins_no_process_group(monkeypatch):
    """No launcher (or a world of one): no process group, and no device preference (--device decides)."""
    import accelerate

    from data.extract import init_ranks

    monkeypatch.setattr(accelerate, "PartialState", lambda *a, **k: pytest.fail("joined a process group"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for world in (None, "1"):
        if world:
            monkeypatch.setenv("WORLD_SIZE", world)
        ranks, device = init_ranks()
        assert (ranks.rank, ranks.world, device) == (0, 1, None)


def test_only_rank_0_fails_the_command_for_an_unfinished_store(tmp_path, monkeypatch):
    """Rank 0 finalises the store and knows whether it is complete; another rank's report says None, and that
    rank ends without an error."""
    import data.extract
    from data.extract import ExtractReport, Ranks

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "draftsmith_data.json").write_text("{}")
    argv = ["--target", "t", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o"), "--device", "cpu"]
    monkeypatch.setattr(data.extract, "init_ranks", lambda: (Ranks(1, 2), None))
    monkeypatch.setattr(data.extract, "_load_and_extract", lambda *a: ExtractReport(rank=1, world=2))
    data.extract.main(argv)
    monkeypatch.setattr(data.extract, "init_ranks", lambda: (Ranks(0, 2), None))
    monkeypatch.setattr(data.extract, "_load_and_extract", lambda *a: ExtractReport(world=2, complete=False))
    with pytest.raises(SystemExit, match="extraction stopped early; re-run the same command to resume"):
        data.extract.main(argv)


# ----------------------------------------------------------------------------- target over several devices
def drafter_loss(target, batch, seed: int = 0) -> torch.Tensor:
    """The training objective on a batch of target features: one seeded drafter, one anchor draw."""
    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel
    from train.blocks import attention_masks, draw_blocks
    from train.objective import block_loss, drafter_forward

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



def test_shipped_deepspeed_config_parses_and_agrees_with_the_trainer():
    """recipes/accelerate/deepspeed_zero2.yaml is not launched here (DeepSpeed needs GPUs): at least accelerate
    reads it as ZeRO-2, and it leaves accumulation to distill.py and clips where train.clip does."""
    from accelerate.commands.config.config_args import load_config_from_file

    from train.config import TrainConfig

    cfg = load_config_from_file(str(ROOT / "recipes" / "accelerate" / "deepspeed_zero2.yaml"))
    assert cfg.distributed_type == "DEEPSPEED" and cfg.deepspeed_config["zero_stage"] == 2
    assert cfg.deepspeed_config["gradient_accumulation_steps"] == 1
    assert cfg.deepspeed_config["gradient_clipping"] == TrainConfig().clip


def test_dry_run_plans_memory_per_device(monkeypatch):
    """qwen35-35b-a3b on 8 x 80 GB: a whole bf16 target per GPU does not fit; spread over the node it does."""
    from train import plan as plan_module
    from train.config import load_config

    monkeypatch.setattr(plan_module, "_fetch_config", lambda cfg: (None, "the recipe's shape facts (test)"))
    whole = plan_module.plan(load_config(["recipe=qwen35-35b-a3b", "devices=8x80"]))["devices"]
    assert whole["count"] == 8 and not whole["fits"] and len(set(whole["per_device_gib"])) == 1
    assert whole["per_device_gib"][0] > 80 and whole["from"] == "devices=8x80"
    spread = plan_module.plan(load_config(["recipe=qwen35-35b-a3b", "devices=8x80", "target.device_map=auto"]))
    per = spread["devices"]["per_device_gib"]
    assert spread["devices"]["fits"] and "warning" not in spread["devices"] and per[0] > per[1]
    assert abs(sum(per) - whole["per_device_gib"][0]) < 0.5  # the target is counted once, spread
    # Every fix is offered, spreading at what the spread plan puts on GPU 0 (its drafter included).
    assert whole["warning"].startswith(f"does not fit: ~{whole['per_device_gib'][0]} GiB needed on GPU 0, which "
                                       "has 80 GiB. Use target.device_map=auto (one process per node spreads the "
                                       f"target over its 8 GPUs: ~{per[0]} GiB on GPU 0); or more or larger GPUs")
    # Already spread and still too large: spreading is not offered again.
    small = plan_module.plan(load_config(["recipe=qwen35-35b-a3b", "devices=8x8", "target.device_map=auto"]))
    assert not small["devices"]["fits"] and "target.device_map" not in small["devices"]["warning"]


# ----------------------------------------------------------------------------- FSDP and two "nodes"
FSDP = ["accelerate.commands.launch", "--config_file", str(ROOT / "recipes" / "accelerate" / "fsdp.yaml"),
        "--mixed_precision", "no"]
SHIM = str(ROOT / "tests" / "helpers" / "fsdp_on_cpu.py")  # accelerate has no FSDP on CPU by itself


def train_args(prepared, out: Path, *extra: str) -> list[str]:
    return ["recipe=tiny", f"out_dir={out}", f"target.path={prepared['target']}", f"data.prepared={prepared['data']}",
            "data.eval_rows=2", "train.max_steps=3", "train.anchors=8", "eval.at_start=false", "eval.batches=1",
            "eval.true_tau_prompts=0", "logging.every=1", "logging.progress=false", "checkpoint.every=1", *extra]


def accelerate(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", *FSDP, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def step_losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "drafter" / "model.safetensors"))


def two_nodes(out: Path, *args: str) -> list[str]:
    """The README's multi-node command shape on one machine: two launches, --num_machines 2,
    --machine_rank 0/1, --main_process_ip 127.0.0.1, one process each, a shared out_dir."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    node = [sys.executable, "-m", *FSDP, "--num_machines", "2", "--num_processes", "2", "--main_process_ip",
            "127.0.0.1", "--main_process_port", port, "--machine_rank"]
    logs_dir = out.parent / f"{out.name}-node-logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    files = [open(logs_dir / f"node{r}.log", "w+") for r in (0, 1)]
    nodes = [subprocess.Popen([*node, str(r), SHIM, *args], cwd=ROOT, env=ENV, stdout=files[r],
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    # A node that fails leaves the other waiting for it (rendezvous, exit barrier): stop it at once.
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in nodes):
            break
        time.sleep(0.2)
    for p in nodes:
        if p.poll() is None:
            p.kill()
            p.wait()
    logs = []
    for f in files:
        f.seek(0)
        logs.append(f.read())
        f.close()
    assert [p.returncode for p in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    return logs


def test_fsdp_on_two_nodes_takes_the_same_steps_and_resumes(prepared, tmp_path):
    """accelerate FSDP (recipes/accelerate/fsdp.yaml: FSDP2, sharded checkpoints) on two "nodes" of one
    CPU process each x 1 row == 1 process x 2 rows, one final drafter; then a 2-process launch resumes
    from the sharded step-2 checkpoint to the same step 3."""
    from train.config import load_config
    from train.distill import train

    one = tmp_path / "one"
    train(load_config(train_args(prepared, one, "train.batch_size=2")))
    fsdp = tmp_path / "fsdp"
    logs = two_nodes(fsdp, *train_args(prepared, fsdp, "train.batch_size=1"))
    assert "fsdp on cpu: version 2" in logs[0] and "2 processes on cpu" in logs[0]
    final = f"  drafter        {fsdp / 'final' / 'drafter'}"  # the closing summary's
    assert final in logs[0].splitlines() and "\ndone: " not in logs[1]  # one writer
    assert list((fsdp / "checkpoints" / "step_3" / "state").glob("pytorch_model_fsdp_0/*.distcp")), "sharded"
    a, b = step_losses(one), step_losses(fsdp)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert_close([b[s] for s in (1, 2, 3)], [a[s] for s in (1, 2, 3)], atol=1e-5, what="losses, FSDP vs 1 process")
    wa, wb = final_weights(one), final_weights(fsdp)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert_close(wb[k], wa[k], atol=2e-5, what=f"drafter weight {k}, FSDP vs 1 process")

    # Resume: drop what step 3 wrote; resume=true continues from the sharded step-2 checkpoint.
    shutil.rmtree(fsdp / "checkpoints" / "step_3")
    shutil.rmtree(fsdp / "final")
    accelerate("--num_processes", "2", SHIM, *train_args(prepared, fsdp, "train.batch_size=1", "resume=true"))
    assert_close(step_losses(fsdp)[3], a[3], atol=1e-5, what="step 3 after resuming under FSDP")
    for k, v in final_weights(fsdp).items():
        assert_close(v, wa[k], atol=2e-5, what=f"drafter weight {k} after resuming under FSDP")


def test_offline_features_plan_the_embedding_and_head_alone(monkeypatch):
    """qwen35-27b offline on 8 x 80 GB: every process holds only the target's embedding and LM head, except
    GPU 0 when it generates for true tau, and the plan names eval.true_tau_prompts=0 as the fix."""
    from train import plan as plan_module
    from train.config import load_config

    monkeypatch.setattr(plan_module, "_fetch_config", lambda cfg: (None, "the recipe's shape facts (test)"))
    common = ["recipe=qwen35-27b", "devices=8x80", "features.mode=offline", "features.store=/unused"]
    online = plan_module.plan(load_config(["recipe=qwen35-27b", "devices=8x80"]))
    mem = online["memory_per_gpu"]
    assert mem["embedding_lm_head_gib"] == round(2 * 248320 * 5120 * 2 / 1024 ** 3, 2)  # untied, bf16
    with_tau = plan_module.plan(load_config(common))["devices"]
    per = with_tau["per_device_gib"]
    assert per[0] == online["devices"]["per_device_gib"][0] and per[0] > 80 >= per[1]
    assert abs((per[0] - per[1]) / 1.15 - (mem["target_weights_gib"] - mem["embedding_lm_head_gib"])) < 0.1
    assert not with_tau["fits"] and "eval.true_tau_prompts=0" in with_tau["warning"]
    assert with_tau["layout"].endswith("(offline features), the whole target on GPU 0 for true tau")
    no_tau = plan_module.plan(load_config([*common, "eval.true_tau_prompts=0"]))["devices"]
    assert no_tau["fits"] and no_tau["per_device_gib"] == [per[1]] * 8
    assert no_tau["layout"].endswith("(offline features)")
    # GPUs too small even for the embedding and head: dropping true tau would not make it fit.
    tiny_gpus = plan_module.plan(load_config([*common, "devices=8x1"]))["devices"]
    assert not tiny_gpus["fits"] and "eval.true_tau_prompts" not in tiny_gpus["warning"]


def test_dry_run_plans_gpt_oss_20b_on_one_gpu_and_gemma_4_31b_spread_over_a_node(monkeypatch, capsys):
    """The shipped gpt-oss-20b and gemma-4-31b recipes plan the published drafters' shapes (gpt-oss: 8 layers,
    block 8, mask 200000, taps [1, 6, 11, 16, 21], ~0.78B parameters as z-lab's 1.46 GiB; Gemma: 5 layers of
    64 x 128 heads, 6 taps, ~1.5B as z-lab's 2.86 GiB). gpt-oss-20b (bf16, its MXFP4 experts dequantized) fits one
    80 GB GPU per process; gemma-4-31B does not, and the plan says target.device_map=auto (or offline features)."""
    from train import plan as plan_module
    from train.config import load_config

    monkeypatch.setattr(plan_module, "_fetch_config", lambda cfg: (None, "the recipe's shape facts (test)"))
    oss = plan_module.plan(load_config(["recipe=gpt-oss-20b", "devices=8x80"]))
    assert oss["target_layer_ids"] == [1, 6, 11, 16, 21] and oss["target_shape"]["model_type"] == "gpt_oss"
    d = oss["drafter"]
    assert (d["layers"], d["block_size"], d["heads"], d["head_dim"], d["rope_theta"]) == (8, 8, 64, 64, 150000.0)
    assert 780 < d["params_m"] < 790 and load_config(["recipe=gpt-oss-20b"]).drafter.mask_token_id == 200000
    assert oss["devices"]["fits"] and max(oss["devices"]["per_device_gib"]) < 80
    gemma = plan_module.plan(load_config(["recipe=gemma-4-31b", "devices=8x80"]))
    assert gemma["target_layer_ids"] == [1, 12, 23, 35, 46, 57] and gemma["objective"]["weighting"].startswith("D-PACE")
    d = gemma["drafter"]
    assert (d["layers"], d["heads"], d["kv_heads"], d["head_dim"], d["intermediate"]) == (5, 64, 8, 128, 10752)
    assert 1500 < d["params_m"] < 1560 and d["rope_theta"] == 1e6
    assert not gemma["devices"]["fits"] and "target.device_map=auto" in gemma["devices"]["warning"]
    spread = plan_module.plan(load_config(["recipe=gemma-4-31b", "devices=8x80", "target.device_map=auto"]))
    assert spread["devices"]["fits"] and spread["devices"]["layout"].startswith("1 process per node")
    offline = plan_module.plan(load_config(["recipe=gemma-4-31b", "devices=8x80", "features.mode=offline",
                                            "features.store=/unused", "eval.true_tau_prompts=0"]))
    assert offline["devices"]["fits"]
    plan_module.print_plan(load_config(["recipe=gemma-4-31b", "devices=8x80"]))
    assert "DOES NOT FIT" in capsys.readouterr().out


def local_target(folder: Path, **text) -> Path:
    """A target folder holding only a multimodal config.json: the text tower nested, without head_dim."""
    text = {"num_hidden_layers": 8, "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16,
            "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096, **text}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "text_config": text}))
    return folder


def test_dry_run_plans_from_a_local_config_and_the_prepared_data(tmp_path):
    """A local target's config.json (a multimodal one nests the text tower, without head_dim) and the prepared
    data's stats.json give the shape, the steps (rows less the eval rows, per batch x grad_accum, x epochs;
    train.max_steps wins) and memory (gradient checkpointing keeps a quarter of the activations)."""
    import math

    from train.config import load_config
    from train.plan import plan

    target = local_target(tmp_path / "target")
    data = tmp_path / "data"
    data.mkdir()
    (data / "stats.json").write_text(json.dumps({"rows": 103, "tokens": 5000}))
    args = ["recipe=tiny", f"target.path={target}", f"data.prepared={data}", "data.eval_rows=3",
            "train.batch_size=2", "train.grad_accum=5", "train.epochs=2", "devices=1x80"]
    p = plan(load_config(args))
    assert p["target_shape_from"] == f"local {target / 'config.json'}"
    shape = p["target_shape"]
    assert (shape["num_hidden_layers"], shape["hidden_size"], shape["vocab_size"]) == (8, 2048, 32000)
    assert shape["head_dim"] == 2048 // 16 and p["drafter"]["head_dim"] == 128
    assert (p["data"]["rows"], p["data"]["tokens"]) == (103, 5000)
    assert p["schedule"]["rows_per_step_per_process"] == 10 and p["schedule"]["steps"] == 2 * 10
    assert plan(load_config([*args, "train.max_steps=7"]))["schedule"]["steps"] == 7
    mem = p["memory_per_gpu"]
    parts = sum(v for k, v in mem.items() if k not in ("total_gib", "embedding_lm_head_gib"))
    assert mem["total_gib"] == round(parts * 1.15, 1)  # the embedding and head are part of the target's weights
    ckpt = plan(load_config([*args, "train.grad_checkpointing=true"]))["memory_per_gpu"]
    assert math.isclose(ckpt["drafter_activations_gib"], mem["drafter_activations_gib"] / 4, abs_tol=0.01)


def test_dry_run_reads_the_stats_of_the_data_prepared_under_out_dir(tmp_path):
    """Without data.prepared the plan reads {out_dir}/data/stats.json, where training prepares the data."""
    from train.config import load_config
    from train.plan import plan

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "stats.json").write_text(json.dumps({"rows": 103, "tokens": 5000}))
    data = plan(load_config(["recipe=tiny", f"out_dir={tmp_path}", "devices=1x80"]))["data"]
    assert (data["prepared"], data["rows"], data["tokens"]) == (str(tmp_path / "data"), 103, 5000)


def test_dry_run_memory_and_compute_figures(tmp_path):
    """Each memory part and the FLOPs per row, from the target's shape and the drafter the resolver gives it:
    bf16 target weights, fp32 drafter weights + grads + two AdamW moments (16 bytes a parameter), bf16
    features of every tap, the LM head's fp32 logits for at most ce_chunk queries; a MoE target's forward
    costs its active parameters. No stats.json: the steps are estimated from the source, per process of the node."""
    from models.config import DFlashConfig
    from models.target_shape import TargetShape
    from train.config import load_config
    from train.plan import plan

    target = local_target(tmp_path / "target", rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    args = ["recipe=tiny", f"target.path={target}", f"data.prepared={tmp_path}", "data.max_length=4096",
            "train.batch_size=2", "target.active_params_b=0.1", "devices=8x80"]
    p = plan(load_config(args))
    draft = DFlashConfig.for_target(TargetShape.from_config(json.loads((target / "config.json").read_text())),
                                    mask_token_id=0, num_hidden_layers=2, num_taps=3, block_size=8)
    L, H, V, inter, S, q, gib = 8, 2048, 32000, 6144, 4096, 48 * 8, 1024 ** 3  # tiny: 48 anchors of block 8
    params_b = (12 * L * H * H + 2 * V * H) / 1e9
    assert p["target_params_b"] == params_b and p["objective"]["query_tokens_per_row"] == q
    assert (p["drafter"]["hidden"], p["drafter"]["intermediate"], p["drafter"]["rope_theta"]) == (H, inter, 5e6)
    mem = p["memory_per_gpu"]
    assert mem == {"target_weights_gib": round(params_b * 1e9 * 2 / gib, 2),
                   "embedding_lm_head_gib": round(2 * V * H * 2 / gib, 2),
                   "drafter_weights_grads_adam_gib": round(draft.num_parameters() * 16 / gib, 2),
                   "features_gib": round(2 * S * 3 * H * 2 / gib, 3),
                   "drafter_activations_gib": round(2 * 2 * q * (12 * H + 3 * inter) * 2 / gib, 2),
                   "lm_head_chunk_gib": round(q * V * 4 * 3 / gib, 2),  # ce_chunk 2048 > q
                   "total_gib": mem["total_gib"]}
    flops = 3 * draft.flops_per_token(S / 2 + 8) * q + 2 * 0.1e9 * S  # drafter fwd+bwd, target fwd (active)
    assert p["tflops_per_row"] == round(flops / 1e12, 2)
    schedule = p["schedule"]
    # no stats.json: estimated from the source's rows (data.tiny_conversations=320, 32 held out, 36 a process)
    assert (schedule["epochs"], schedule["processes"], schedule["steps"]) == (2.5, 8, 45)
    assert not schedule["steps_exact"] and schedule["note"].startswith("estimated from the source's conversations")
    unknown = plan(load_config([*args, "data.source=org/chats"]))["schedule"]  # a Hub data set, offline
    assert unknown["steps"] is None
    assert "steps = epochs x rows / 16 rows per step" in unknown["note"]  # 2 rows x 8 processes


def test_dry_run_fetches_the_hub_config_when_the_hub_resolves_and_reads_a_home_folder(monkeypatch, tmp_path):
    """A resolving Hub host: config.json at the recipe's revision, from the network (not the cache alone).
    A target under ~ is the home folder's; a null fact keeps the recipe's; the model type is the checkpoint's."""
    import socket

    import huggingface_hub

    from train import plan as plan_module
    from train.config import load_config

    asked = []

    def download(repo_id, filename, revision=None, local_files_only=False):
        asked.append((repo_id, filename, revision, local_files_only))
        return str(local_target(tmp_path / "hub") / "config.json")

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    config, source = plan_module._fetch_config(load_config(["recipe=qwen3-8b", "target.path=org/model",
                                                            "target.revision=v2"]))
    assert asked == [("org/model", "config.json", "v2", False)] and config["text_config"]["hidden_size"] == 2048
    assert source == "Hub config.json of org/model (config only, no weights)"

    monkeypatch.setenv("HOME", str(tmp_path))
    local_target(tmp_path / "t", model_type="qwen3_text", vocab_size=None)
    shape, source = plan_module.target_shape(load_config(["recipe=tiny", "target.path=~/t", "target.vocab_size=320"]))
    assert source == f"local {tmp_path / 't' / 'config.json'}"
    assert (shape["hidden_size"], shape["vocab_size"], shape["model_type"]) == (2048, 320, "qwen3")


def test_dry_run_prints_each_gpus_load_and_what_does_not_fit(monkeypatch, capsys):
    """The devices line: one figure when every GPU holds the same, GPU 0 apart from the others when not;
    a layout that does not fit says so, and the warning with its fixes follows."""
    from train import plan as plan_module
    from train.config import load_config

    monkeypatch.setattr(plan_module, "_fetch_config", lambda cfg: (None, "the recipe's shape facts (test)"))

    def printed(*more: str) -> tuple[dict, list[str]]:
        devices = plan_module.print_plan(load_config(["recipe=qwen35-35b-a3b", "devices=8x80", *more]))["devices"]
        lines = [x.strip() for x in capsys.readouterr().out.splitlines()]
        return devices, [x for x in lines if x.startswith(("devices:", "warning:"))]

    whole, lines = printed()
    assert lines == [f"devices: 8 x 80 GiB (devices=8x80): {whole['layout']}: ~{whole['per_device_gib'][0]} GiB each "
                     "(DOES NOT FIT)", f"warning: {whole['warning']}"]
    spread, lines = printed("target.device_map=auto")
    per = spread["per_device_gib"]
    assert lines == [f"devices: 8 x 80 GiB (devices=8x80): {spread['layout']}: GPU 0 ~{per[0]} GiB, GPUs 1-7 "
                     f"~{per[1]} GiB each"]


def test_devices_default_to_this_machines_gpus(monkeypatch):
    """No devices= plans for every GPU of this machine, at the first one's memory; a spec may say GB or GiB."""
    from train.plan import parse_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * 1024 ** 3}))
    assert parse_devices("") == (4, 80.0)
    assert parse_devices("8x141GB") == parse_devices("8x141gib") == (8, 141.0)


def test_which_processes_load_the_whole_target():
    """Online: every process. Offline: only the one(s) that generate for true tau (main; all under FSDP)."""
    from train.config import load_config
    from train.plan import loads_whole_target

    online = load_config(["recipe=tiny"])
    offline = load_config(["recipe=tiny", "features.mode=offline", "features.store=/unused"])
    no_tau = load_config(["recipe=tiny", "features.mode=offline", "features.store=/unused", "eval.true_tau_prompts=0"])
    no_eval_rows = load_config(["recipe=tiny", "features.mode=offline", "features.store=/unused", "data.eval_rows=0"])
    for is_main in (True, False):
        for fsdp in (True, False):
            assert loads_whole_target(online, is_main, fsdp)
            assert loads_whole_target(offline, is_main, fsdp) == (is_main or fsdp)
            assert not loads_whole_target(no_tau, is_main, fsdp)
            assert not loads_whole_target(no_eval_rows, is_main, fsdp)


def test_offline_processes_with_and_without_the_whole_target_take_the_same_steps(prepared, tmp_path):
    """Offline features, 2 processes (torchrun) with true tau on: the main process loads the whole target to
    generate, the other only the embedding and LM head. Same steps as 1 process x 2 rows without true tau
    (every process borrowing), and the true-tau eval ran."""
    from data.extract import extract
    from models.config import default_layer_ids
    from models.target import TargetModel
    from train.config import load_config
    from train.distill import train

    ids = default_layer_ids(6, load_config(["recipe=tiny"]).drafter.num_taps)
    store = tmp_path / "store"
    extract(TargetModel.from_pretrained(prepared["target"], dtype=torch.float32), prepared["data"], store,
            layer_ids=ids, batch_size=2, progress=False)
    offline = ["features.mode=offline", f"features.store={store}", "checkpoint.every=0"]
    train(load_config(train_args(prepared, tmp_path / "one", *offline, "train.batch_size=2")))
    two = launch(str(ROOT / "train" / "distill.py"), *train_args(prepared, tmp_path / "two", *offline,
                 "train.batch_size=1", "eval.true_tau_prompts=1", "eval.true_tau_max_new_tokens=8"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "embedding and LM head only" not in two.stdout  # the main process generates: whole target
    a, b = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert_close([b[s] for s in (1, 2, 3)], [a[s] for s in (1, 2, 3)], atol=1e-5, what="offline, 2 processes vs 1")
    evals = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines() if line]
    assert any("eval_tau_true" in r for r in evals)


@pytest.mark.parametrize("recipe, words", [
    ("glm-4.5-air", ["~199 GiB of weights", "does not fit one 80 GB GPU", "target.device_map=auto spreads it over 5"]),
    ("qwen3-next-80b-a3b", ["~148 GiB of weights", "target.device_map=auto spreads it over 3"]),
    ("kimi-k2.5", ["~554 GiB of weights", "does not fit one node of 8 x 80 GB even spread",
                   "features.mode=offline", "data.extract --device-map auto", "several such nodes"]),
])
def test_dry_run_of_the_large_moe_recipes_says_where_the_target_goes(monkeypatch, recipe, words):
    """GLM-4.5-Air and Qwen3-Next-80B-A3B need a node's GPUs (target.device_map), Kimi K2.5 (554 GiB as stored)
    more than a node of 8 x 80 GB holds beside its drafter: offline features extracted on nodes that hold it. The
    drafters follow the published ones where there is one (Kimi: 6 layers, 64 x 128 heads, 8 KV heads, block 8,
    mask 163838; Qwen3-Coder-Next: 8 layers)."""
    from train import plan as plan_module
    from train.config import load_config

    monkeypatch.setattr(plan_module, "_fetch_config", lambda cfg: (None, "the recipe's shape facts (test)"))
    p = plan_module.plan(load_config([f"recipe={recipe}", "devices=8x80"]))
    for w in words:
        assert w in p["placement"], (w, p["placement"])
    dev = p["devices"]
    if recipe == "kimi-k2.5":
        assert p["target_layer_ids"] == [1, 12, 24, 35, 47, 58] and dev["fits"]  # offline: embedding + head per GPU
        assert (p["drafter"]["heads"], p["drafter"]["kv_heads"], p["drafter"]["head_dim"], p["drafter"]["block_size"]) \
            == (64, 8, 128, 8) and 3400 < p["drafter"]["params_m"] < 3600
        online = plan_module.plan(load_config([f"recipe={recipe}", "devices=8x80", "features.mode=online",
                                               "target.device_map=auto"]))["devices"]
        assert not online["fits"] and "features.mode=offline with the features extracted on nodes" in online["warning"]
    else:
        assert not dev["fits"] and "target.device_map=auto" in dev["warning"]
        spread = plan_module.plan(load_config([f"recipe={recipe}", "devices=8x80", "target.device_map=auto"]))
        assert spread["devices"]["fits"]
    if recipe == "qwen3-next-80b-a3b":
        assert p["drafter"]["layers"] == 8
