"""Training modes end to end on the tiny inputs: gradient accumulation, offline features, packed rows,
KL distillation, wandb logging. The tiny target and data are shared with tests/train/test_run.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.helpers import assert_close, tiny_drafter_config
from tests.helpers.tiny_run import FAST, losses, metrics, run, tiny_input_dirs

STEPS = ["logging.every=1", "eval.batches=2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tiny_input_dirs(tmp_path_factory)
    return {**d, "args": [f"target.path={d['target']}", f"data.prepared={d['data']}"]}


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    """A bf16 store of the tiny prepared data with top-8 log-probs, through the data.extract CLI,
    tapping the layers the tiny recipe's drafter taps (default ids for its 3 taps)."""
    import json

    from data.extract import main as extract_main
    from models.config import default_layer_ids
    from train.config import load_config

    layers = json.loads((tiny["target"] / "config.json").read_text())["num_hidden_layers"]
    ids = default_layer_ids(layers, load_config(["recipe=tiny"]).drafter.num_taps)
    out = tmp_path_factory.mktemp("store") / "feats"
    extract_main(["--target", str(tiny["target"]), "--data", str(tiny["data"]), "--out", str(out), "--dtype", "bf16",
                  "--topk", "8", "--layers", *map(str, ids), "--target-dtype", "float32", "--device", "cpu",
                  "--no-progress"])
    return out, ids


def drafter_weights(out_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out_dir / "final" / "drafter" / "model.safetensors"))


def test_grad_accumulation_is_exact(tiny, tmp_path):
    """2 rows x 1 micro-batch and 1 row x 2 micro-batches take the same optimizer steps.

    8 anchors per row (fewer than most rows' candidates) so the anchor draw subsamples: a row's
    blocks must not depend on which micro-batch it lands in. Before the fix (mean of per-micro-batch
    means, anchors per micro-batch) the step-2 losses were 4.689 vs 4.483 and the weights 9e-3 apart.
    Measured after: losses within 1e-6, weights within 3e-6 (Adam divides each gradient element by
    its own magnitude in the first steps, so rounding-level gradient differences of different batch
    shapes show up as ~1e-6 in the weights).
    """
    # eval.batches counts optimizer-step batches: 3 x 2 rows either way (it once counted micro-batches, so the
    # accumulating run evaluated half the rows; covering all of them with eval.batches=32 hid it).
    common = [*tiny["args"], *FAST, *STEPS, "train.max_steps=2", "train.anchors=8", "eval.batches=3"]
    run(tmp_path / "bs2", *common, "train.batch_size=2", "train.grad_accum=1")
    run(tmp_path / "ga2", *common, "train.batch_size=1", "train.grad_accum=2")
    a, b = losses(tmp_path / "bs2"), losses(tmp_path / "ga2")
    assert sorted(a) == sorted(b) == [1, 2]
    assert_close([b[1], b[2]], [a[1], a[2]], atol=1e-5, what="losses, batch 2 vs 1 x accumulation 2")
    assert_close(losses(tmp_path / "ga2", "grad_norm")[1], losses(tmp_path / "bs2", "grad_norm")[1], atol=1e-4,
                 what="first step's gradient norm")
    wa, wb = drafter_weights(tmp_path / "bs2"), drafter_weights(tmp_path / "ga2")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert_close(wb[k], wa[k], atol=2e-5, what=f"drafter weight {k} after 2 steps")
    # The logged CE and tau are the whole step's, not its last micro-batch's.
    for key in ("ce", "tau"):
        assert_close(list(losses(tmp_path / "ga2", key).values()), list(losses(tmp_path / "bs2", key).values()),
                     atol=1e-4, what=f"logged {key}, batch 2 vs 1 x accumulation 2")
    # Held-out blocks are drawn per row too: the simulated tau does not depend on the batch size.
    tau = [losses(tmp_path / name, "eval_tau_sim")[2] for name in ("bs2", "ga2")]
    assert abs(tau[0] - tau[1]) <= 5e-3, tau
    assert losses(tmp_path / "bs2", "eval_blocks")[2] == losses(tmp_path / "ga2", "eval_blocks")[2]


def test_logged_tau_adds_up_every_micro_batch(tiny, tmp_path, monkeypatch):
    """A step's logged tau is its micro-batches' summed tau over their summed blocks. The barely trained
    drafter scores tau 1 on every block, so the first micro-batch's sums are set to tau 3 here: keeping
    only the last micro-batch's would log 1."""
    import train.loop

    real, seen = train.loop.simulated_acceptance, []

    def first_of_step_at_tau_3(*args):
        out = real(*args)
        if len(seen) % 2 == 0:
            out = {**out, "tau_sum": 3 * out["blocks"]}
        seen.append(out)
        return out

    monkeypatch.setattr(train.loop, "simulated_acceptance", first_of_step_at_tau_3)
    run(tmp_path / "ga2", *tiny["args"], *FAST, *STEPS, "train.max_steps=1", "train.anchors=8",
        "train.batch_size=1", "train.grad_accum=2")
    assert len(seen) == 2 and float(seen[0]["blocks"]) > 0 and float(seen[1]["blocks"]) > 0
    want = float(sum(s["tau_sum"] for s in seen) / sum(s["blocks"] for s in seen))
    assert want > 1.5
    assert_close(losses(tmp_path / "ga2", "tau")[1], want, atol=1e-5, what="logged tau of a 2-micro-batch step")


def test_two_processes_take_the_same_step_as_one(tiny, tmp_path):
    """DDP (2 CPU processes, gloo) with 1 row each == 1 process with 2 rows: the step's weight sum is
    reduced over processes and gradients are scaled by the world size (DDP averages them).
    Measured: losses within 1e-6, weights within 3e-6."""
    import os
    import subprocess
    from pathlib import Path

    common = [*tiny["args"], *FAST, *STEPS, "train.max_steps=2", "train.anchors=8"]
    run(tmp_path / "one", *common, "train.batch_size=2")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(root / "train" / "distill.py"), "recipe=tiny", f"out_dir={tmp_path / 'two'}", *common,
           "train.batch_size=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 processes on cpu" in proc.stdout + proc.stderr
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert_close([b[1], b[2]], [a[1], a[2]], atol=1e-5, what="losses, 2 processes x 1 row vs 1 process x 2 rows")
    wa, wb = drafter_weights(tmp_path / "one"), drafter_weights(tmp_path / "two")
    for k in wa:
        assert_close(wb[k], wa[k], atol=2e-5, what=f"drafter weight {k} after 2 steps")


def test_offline_features_train_like_online(tiny, store, tmp_path, capsys):
    """Same first losses from a bf16 store as from the fp32 target in the step.

    The store rounds every feature to bf16 (relative error <= 2^-9 per element); the first loss
    averages ~20k scored slots of a smooth function of them, so the errors average out: measured
    |online - offline| = 1.8e-5 at step 1 (2.4e-6 relative), 1.5e-4 at step 2 (training amplifies
    it). The tolerances leave ~50x / ~10x margin and are still far below what a misaligned or
    wrong-layer feature would cost (the loss moves by ~3 between steps 1 and 2).
    """
    path, ids = store
    run(tmp_path / "online", *tiny["args"], *FAST, *STEPS, "train.max_steps=2")
    capsys.readouterr()
    run(tmp_path / "offline", *tiny["args"], *FAST, *STEPS, "train.max_steps=2", "features.mode=offline",
        f"features.store={path}")
    assert "embedding and LM head only" in capsys.readouterr().out  # no true tau: no decoder layers loaded
    import json

    dflash = json.loads((tmp_path / "online" / "final" / "drafter" / "config.json").read_text())["dflash_config"]
    assert dflash["target_layer_ids"] == ids, "the store taps the recipe drafter's layers"
    on, off = losses(tmp_path / "online"), losses(tmp_path / "offline")
    print(f"online {on} offline {off}")
    assert_close(off[1], on[1], atol=1e-3, what="first loss, offline bf16 store vs online fp32")
    assert_close(off[2], on[2], atol=2e-3, what="second loss, offline bf16 store vs online fp32")


def test_offline_run_with_true_tau_loads_the_whole_target_for_it(tiny, store, tmp_path, capsys):
    """Offline features with true-tau eval: the main process loads the decoder layers to generate."""
    path, _ = store
    capsys.readouterr()
    run(tmp_path, *tiny["args"], *FAST, *STEPS, "train.max_steps=1", "features.mode=offline",
        f"features.store={path}", "eval.true_tau_prompts=2", "eval.true_tau_max_new_tokens=12")
    assert "embedding and LM head only" not in capsys.readouterr().out
    assert 1.0 <= metrics(tmp_path)[-1]["eval_tau_true"] <= 8.0


def test_mismatched_store_is_refused_before_training(tiny, store, tmp_path):
    """A store with other layer ids, or from another target, fails with a clear error before any step."""
    from data.extract import extract
    from data.prepare import load_prepared
    from data.store import StoreMismatch
    from models.target import TargetModel
    from models.tiny import save_tiny_target

    _, ids = store
    target = TargetModel.from_pretrained(str(tiny["target"]), dtype=torch.float32)
    rows = load_prepared(tiny["data"], tokenizer=target.tokenizer)[0].select(range(4))
    other_layers = [ids[0], ids[1], ids[2] + 1]
    extract(target, rows, tmp_path / "layers", layer_ids=other_layers, progress=False)
    other = TargetModel.from_pretrained(str(save_tiny_target(tmp_path / "other_target", seed=1, num_layers=6)),
                                        dtype=torch.float32)
    extract(other, rows, tmp_path / "other", layer_ids=ids, progress=False)
    for name, why in (("layers", f"layer ids: store {other_layers}, training asks {ids}"),
                      ("other", "target: store was extracted from")):
        out = tmp_path / f"run_{name}"
        with pytest.raises(StoreMismatch, match=why.replace("[", r"\[").replace("]", r"\]")):
            run(out, *tiny["args"], *FAST, "train.max_steps=2", "features.mode=offline",
                f"features.store={tmp_path / name}")
        assert not (out / "metrics.jsonl").exists() and not (out / "final").exists(), "refused before training"


def test_a_store_of_other_rows_is_refused_before_the_first_eval_and_the_same_rows_prepared_again_train(
        tiny, store, tmp_path):
    """A store of other prepared data with as many rows passed every check until the first training batch:
    the step-0 eval had run on the wrong rows. The same rows prepared again have another fingerprint (the
    tokenize pass gets a new one each time): their rows are compared, and they train."""
    import shutil

    from datasets import load_from_disk

    path, _ = store
    ds = load_from_disk(str(tiny["data"]))

    def replace_rows(folder, rows):  # the prepared folder's rows replaced, its draftsmith_data.json kept
        rows.save_to_disk(str(tmp_path / "rows"))
        for name in ("data-00000-of-00001.arrow", "dataset_info.json", "state.json"):
            shutil.copy(tmp_path / "rows" / name, folder / name)
        shutil.rmtree(tmp_path / "rows")

    # Same rows prepared again (a new fingerprint), relabelled as newer labelling rules may: every first label
    # of a row moved to context. The features cover every token, so the store stays valid for them.
    again = shutil.copytree(tiny["data"], tmp_path / "again")
    replace_rows(again, ds.map(lambda r: {"loss_mask": [0] + list(r["loss_mask"][1:])}))
    other = shutil.copytree(tiny["data"], tmp_path / "other")  # as many rows, in another order
    replace_rows(other, ds.select(list(reversed(range(len(ds))))).flatten_indices())
    store_args = ["features.mode=offline", f"features.store={path}", "eval.at_start=true"]
    with pytest.raises(ValueError, match="holds other tokens than the prepared data"):
        run(tmp_path / "run_other", f"target.path={tiny['target']}", f"data.prepared={other}", *FAST, *STEPS,
            "train.max_steps=1", *store_args)
    assert not (tmp_path / "run_other" / "metrics.jsonl").exists(), "refused before the step-0 eval"
    result = run(tmp_path / "run_again", f"target.path={tiny['target']}", f"data.prepared={again}", *FAST, *STEPS,
                 "train.max_steps=1", *store_args)
    assert result["steps"] == 1


def test_a_store_provider_gives_the_prepared_rows_labels_and_refuses_other_tokens(tiny, store):
    """Training drew its anchors from the prepared rows' labels but the held-out eval read the store's: a store
    extracted before the rows were relabelled evaluated on the old labels. Every batch now carries the prepared
    rows' labels, and any batch (not only the first) of other tokens is refused."""
    import torch
    from datasets import load_from_disk

    from data.store import FeatureStore
    from train.setup import _Subset

    path, _ = store
    ds = load_from_disk(str(tiny["data"]))
    relabelled = ds.map(lambda r, i: {"loss_mask": [0] * len(r["loss_mask"]) if i == 1 else r["loss_mask"]},
                        with_indices=True)
    feats = FeatureStore(path, dtype=torch.float32)
    raw = feats.get_batch([0, 1])
    got = _Subset(feats, 0, relabelled, str(path)).get_batch([0, 1])
    assert int(raw.loss_mask[1].sum()) > 0 and int(got.loss_mask[1].sum()) == 0  # row 1's labels: the prepared ones
    assert torch.equal(got.loss_mask[0], raw.loss_mask[0]) and torch.equal(got.features, raw.features)
    shifted = ds.map(lambda r, i: {"input_ids": [(t + 1) % 64 for t in r["input_ids"]] if i == 3 else r["input_ids"]},
                     with_indices=True)
    _Subset(feats, 0, shifted, str(path)).get_batch([0, 1])  # rows 0 and 1 are the same tokens
    with pytest.raises(ValueError, match="holds other tokens than the prepared data"):
        _Subset(feats, 0, shifted, str(path)).get_batch([2, 3])


def test_packed_rows_train_and_learn(tiny, tmp_path, capsys):
    """data.pack=true rows (several documents per row) train, and held-out simulated tau improves."""
    import json

    meta = json.loads((tiny["packed"] / "draftsmith_data.json").read_text())
    assert meta["packed"]
    with pytest.raises(ValueError, match="prepared with pack=True, the recipe says data.pack=False"):
        run(tmp_path / "unflagged", f"target.path={tiny['target']}", f"data.prepared={tiny['packed']}", *FAST)
    said = "".join(capsys.readouterr())  # training's log goes to stdout (tqdm.write)
    assert "data.prepared" in said and "pack: True" not in said, "a refused pack is not also warned about"
    run(tmp_path, f"target.path={tiny['target']}", f"data.prepared={tiny['packed']}", "data.pack=true",
        *FAST, "eval.at_start=true", *STEPS, "train.max_steps=12")
    tau = losses(tmp_path, "eval_tau_sim")
    print(f"packed: held-out tau {tau[0]:.3f} -> {tau[12]:.3f}")
    assert tau[12] >= 1.1 * tau[0]  # measured 1.004 -> 1.18


def test_packed_context_never_crosses_documents(tiny):
    """Through the real data path (packed prepared rows -> online features -> blocks -> mask), no block
    sees a token of another document, and each block's drafter output equals the one computed on its
    document alone."""
    from data.features import OnlineFeatures
    from data.packing import document_bounds
    from data.prepare import load_prepared
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from train.blocks import build_blocks, dense_mask, draw_blocks
    from train.objective import drafter_forward

    target = TargetModel.from_pretrained(str(tiny["target"]), dtype=torch.float32)
    ds, _ = load_prepared(tiny["packed"], tokenizer=target.tokenizer)
    rows = [i for i in range(len(ds)) if max(ds[i]["doc_ids"]) >= 2][:2]
    assert len(rows) == 2
    cfg = tiny_drafter_config(target, num_taps=3)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg).eval()
    drafter.bind_target(target.embed_tokens, target.lm_head)
    provider = OnlineFeatures(target, cfg.target_layer_ids, ds)
    batch = provider.get_batch(rows)
    doc, pos = batch.doc_ids.long(), batch.position_ids
    B = cfg.block_size
    gens = [torch.Generator().manual_seed(r) for r in rows]
    blocks = draw_blocks(batch.input_ids, batch.loss_mask, doc, pos, 64, B, cfg.mask_token_id, gens)
    b, n = blocks.anchors.shape
    s = doc.shape[1]
    assert int(blocks.valid.sum()) > 20 and len(set(blocks.doc[blocks.valid].tolist())) >= 3
    mask = dense_mask(blocks, doc)
    ctx = mask[:, 0, :, :s].view(b, n, B, s)
    assert not (ctx & (doc[:, None, None, :] != blocks.doc[:, :, None, None])).any(), "context from another document"
    assert not (ctx & (torch.arange(s) >= blocks.anchors[:, :, None, None])).any(), "context at or after the anchor"
    lab_pos = (blocks.anchors[:, :, None] + torch.arange(1, B)).clamp(max=s - 1)
    lab_doc = doc.gather(1, lab_pos.flatten(1)).view_as(lab_pos)
    assert not (blocks.label_mask & (lab_doc != blocks.doc[:, :, None])).any(), "label from another document"

    with torch.no_grad():
        hidden = drafter_forward(drafter, target.embed_tokens, blocks, batch.features, pos, mask).view(b, n, B, -1)
        checked = 0
        for r in range(b):
            real = int(batch.lengths[r])
            for start, end in document_bounds(doc[r, :real].tolist()):
                sel = blocks.valid[r] & (blocks.anchors[r] >= start) & (blocks.anchors[r] < end)
                if not sel.any():
                    continue
                alone = provider.batch_from_rows([{
                    "input_ids": batch.input_ids[r, start:end], "loss_mask": batch.loss_mask[r, start:end],
                    "doc_ids": torch.zeros(end - start, dtype=torch.int32),
                    "position_ids": torch.arange(end - start, dtype=torch.int32)}])
                anchors = (blocks.anchors[r][sel] - start)[None]
                own = build_blocks(alone.input_ids, alone.loss_mask, alone.doc_ids.long(), alone.position_ids, anchors,
                                   torch.ones_like(anchors, dtype=torch.bool), B, cfg.mask_token_id)
                assert torch.equal(own.label_mask[0], blocks.label_mask[r][sel])
                assert torch.equal(own.labels[0][own.label_mask[0]], blocks.labels[r][sel][own.label_mask[0]])
                h = drafter_forward(drafter, target.embed_tokens, own, alone.features, alone.position_ids,
                                    dense_mask(own, alone.doc_ids.long()))
                assert_close(hidden[r][sel], h.view(1, -1, B, h.shape[-1])[0], atol=1e-5,
                             what=f"row {rows[r]} document [{start}, {end}): packed vs alone")
                checked += 1
    assert checked >= 3


@pytest.mark.parametrize("loss", ["ce+kl", "kl"])
@pytest.mark.parametrize("mode", ["online", "offline"])
def test_kl_distillation_reduces_kl(tiny, store, tmp_path, loss, mode):
    """train.loss=ce+kl / kl with the target's top-k from the step (online) or from a --topk store."""
    features = ["train.kl_topk=8"] if mode == "online" else ["features.mode=offline", f"features.store={store[0]}"]
    run(tmp_path, *tiny["args"], *FAST, *STEPS, "train.max_steps=4", f"train.loss={loss}", *features)
    kl = losses(tmp_path, "kl")
    print(f"{loss} {mode}: kl {kl}")
    assert sorted(kl) == [1, 2, 3, 4]
    assert kl[4] < 0.6 * kl[1]  # measured 6.62 -> 2.71 (ce+kl), 6.62 -> 2.75 (kl), online and offline alike
    if loss == "kl":  # no CE term: the loss is the slot-weighted KL
        assert_close(losses(tmp_path)[1], kl[1], atol=0.05 * kl[1], what="kl-only loss vs its KL term")


def test_wandb_logging_with_a_stand_in_module(tiny, tmp_path, monkeypatch):
    """logging.wandb=true: init with the mode, every metrics row logged, finish once."""
    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class Run:
        def log(self, data, step=None):
            calls["log"].append((dict(data), step))

        def finish(self):
            calls["finish"].append(True)

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: (calls["init"].append(kw), Run())[1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run(tmp_path, *tiny["args"], *FAST, *STEPS, "train.max_steps=2", "logging.wandb=true",
        "logging.wandb_mode=offline", "logging.wandb_project=draftsmith-test")
    assert len(calls["init"]) == 1 and len(calls["finish"]) == 1
    init = calls["init"][0]
    assert init["mode"] == "offline" and init["project"] == "draftsmith-test"
    assert init["config"]["train"]["max_steps"] == 2
    keys = set().union(*(d for d, _ in calls["log"]))
    assert {"loss", "tau", "ce", "lr", "eval_tau_sim", "eval_loss"} <= keys, keys
    assert [step for _, step in calls["log"]] == [r["step"] for r in metrics(tmp_path)]


def test_wandb_missing_falls_back_to_console_and_jsonl(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.warns(UserWarning, match="wandb is not importable"):
        run(tmp_path, *tiny["args"], *FAST, *STEPS, "train.max_steps=2", "logging.wandb=true",
            "logging.wandb_mode=offline")
    assert sorted(losses(tmp_path)) == [1, 2] and losses(tmp_path, "eval_tau_sim")
    out = capsys.readouterr().out
    assert "warning: logging.wandb=true but wandb is not importable" in out
    lines = out.splitlines()
    assert [x.split("  epoch")[0] for x in lines if x.startswith("step ")] == ["step  1/2", "step  2/2"]
    assert any(x.startswith("eval  2/2  held-out loss") for x in lines)


# ------------------------------------------------------------------ gpt-oss and Gemma 4 (issue 46)
@pytest.fixture(scope="module")
def family_inputs(tmp_path_factory):
    """Per family: its tiny target folder (harmony-like / Gemma-like chat template) and tiny chat prepared with it
    (as written, no regeneration: the pipeline, not the drafter's quality, is under test)."""
    from data.prepare import prepare
    from data.tiny_chat import write
    from models.tiny import save_tiny_target

    built = {}

    def get(family):
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            target = save_tiny_target(root / "target", family)
            source = write(root / "tiny_chat.jsonl", n=24, seed=0)
            prepare(str(target), str(source), root / "data", thinking=False, max_length=256, progress=False)
            built[family] = (target, root / "data")
        return built[family]

    return get


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_the_new_families_run_the_whole_pipeline(family_inputs, family, tmp_path, capsys):
    """extract -> train on the offline store, online, and online against the 4-bit MLX target -> export (HF and
    MLX) -> generate on both backends, lossless: gpt-oss (sinks, sliding windows, YaRN, harmony-like template) and
    the Gemma 4 multimodal checkpoint (scaled embedding in both backends, soft-capped logits, text tower)."""
    from data.extract import main as extract_main
    from export.hf import export_hf
    from export.mlx import export_mlx
    from inference.generate import main as generate
    from models.config import default_layer_ids

    target, data = family_inputs(family)
    ids = default_layer_ids(8, 3)
    store = tmp_path / "feats"
    extract_main(["--target", str(target), "--data", str(data), "--out", str(store), "--layers", *map(str, ids),
                  "--target-dtype", "float32", "--device", "cpu", "--no-progress"])
    args = [f"target.path={target}", f"data.prepared={data}", *FAST, *STEPS, "train.max_steps=2", "train.anchors=8",
            "train.batch_size=2", "eval.batches=1", "data.eval_rows=4"]
    run(tmp_path / "offline", *args, "features.mode=offline", f"features.store={store}")
    run(tmp_path / "online", *args)
    run(tmp_path / "q4", *args, "target.quantization=mlx-4bit-g32")
    on, off, q4 = (losses(tmp_path / name) for name in ("online", "offline", "q4"))
    assert_close(off[1], on[1], atol=1e-3, what=f"{family}: first loss, offline bf16 store vs online fp32")
    assert abs(q4[1] - on[1]) > 1e-6 and abs(q4[1] - on[1]) < 0.5  # another target (4-bit), the same objective
    assert "mlx-4bit-g32" in capsys.readouterr().out
    quiet = lambda *_: None  # noqa: E731
    export_hf(tmp_path / "online" / "final" / "drafter", tmp_path / "hf", dtype="fp32", log=quiet)
    export_mlx(tmp_path / "online" / "final" / "drafter", tmp_path / "mlx", dtype="fp32", log=quiet)
    prompt = ["--prompt", "What is 2 plus 3?", "--chat", "--max-new-tokens", "16", "--json"]
    torch_report = generate(["--backend", "torch", "--target", str(target), "--draft", str(tmp_path / "hf"),
                             *prompt, "--baseline"])
    mlx_report = generate(["--backend", "mlx", "--target", str(target), "--draft", str(tmp_path / "mlx"), *prompt])
    capsys.readouterr()
    assert torch_report["matches_baseline"] is True and torch_report["tokens"]
    assert mlx_report["tokens"] == torch_report["tokens"]
