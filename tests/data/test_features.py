"""Features: offline store vs online provider, fp8 bound and size, corruption, resume, mismatches."""

import shutil
from pathlib import Path

import pytest
import torch

from data.extract import extract
from data.features import OnlineFeatures
from data.prepare import load_prepared, prepare
from data.store import FeatureStore, StoreCorrupt, StoreError, StoreMismatch, fp8_error_bound, quantize_fp8, sha256_file

FIX = Path(__file__).parents[1] / "fixtures" / "data"


LAYERS = [1, 3, 5]
BATCH = 2
SHARD_TOKENS = 150


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from models.target import TargetModel
    from models.tiny import save_tiny_target

    root = tmp_path_factory.mktemp("features")
    target_dir = save_tiny_target(root / "target", "qwen3", num_layers=8)
    src = root / "chats"
    src.mkdir()
    for name in ("openai", "sharegpt", "alpaca", "nemotron"):
        shutil.copy(FIX / f"{name}.jsonl", src)
    prepare(str(target_dir), str(src), root / "plain", progress=False)
    prepare(str(target_dir), str(src), root / "packed", max_length=160, pack=True, progress=False)
    target = TargetModel.from_pretrained(target_dir, dtype=torch.bfloat16)
    stores = {}
    for data in ("plain", "packed"):
        for dtype in ("bf16", "fp8"):
            stores[data, dtype] = root / f"store-{data}-{dtype}"
            extract(target, root / data, stores[data, dtype], layer_ids=LAYERS, dtype=dtype,
                    topk=4 if dtype == "bf16" else 0, batch_size=BATCH, shard_tokens=SHARD_TOKENS, progress=False)
    return {"root": root, "target_dir": target_dir, "target": target, "stores": stores}


def shard_groups(store):
    """The row batches extraction used: BATCH rows at a time inside each shard."""
    for a, b in store.index["plan"]:
        for i in range(a, b, BATCH):
            yield list(range(i, min(i + BATCH, b)))


@pytest.mark.parametrize("data", ["plain", "packed"])
def test_offline_bf16_is_bitwise_the_online_provider(setup, data):
    ds, _ = load_prepared(setup["root"] / data)
    online = OnlineFeatures(setup["target"], LAYERS, ds, topk=4)
    store = FeatureStore(setup["stores"][data, "bf16"])
    assert len(store) == len(online) == len(ds) and len(store.index["plan"]) >= 3
    if data == "packed":
        assert max(max(d) for d in ds["doc_ids"]) >= 1  # some rows really hold several documents
    padded = 0
    for group in shard_groups(store):
        on, off = online.get_batch(group), store.get_batch(group)
        assert on.features.dtype == off.features.dtype == torch.bfloat16
        assert on.features.shape[-1] == 3 * setup["target"].hidden_size
        for name in ("input_ids", "loss_mask", "doc_ids", "position_ids", "lengths", "features", "topk_ids",
                     "topk_logprobs"):  # torch.equal does not compare dtypes: the trainer sees the same types
            assert getattr(on, name).dtype == getattr(off, name).dtype, name
        on_row, off_row = online.row(group[0]), store.row(group[0])  # rows too (positions: collate widens them)
        for name in ("input_ids", "loss_mask", "doc_ids", "features"):
            assert getattr(on_row, name).dtype == getattr(off_row, name).dtype, name
        alone, n = online.get_batch(group[:1]), int(off.lengths[0])  # an online row is its one-row batch's
        for name in ("input_ids", "loss_mask", "doc_ids", "position_ids", "features", "topk_ids", "topk_logprobs"):
            assert torch.equal(getattr(on_row, name), getattr(alone, name)[0, :n]), name
        for name in ("input_ids", "loss_mask", "doc_ids", "position_ids"):  # the prepared row's columns
            assert getattr(on_row, name).tolist() == ds[group[0]][name], name
        for name in ("input_ids", "loss_mask", "doc_ids", "position_ids", "lengths", "features", "topk_ids"):
            assert torch.equal(getattr(on, name), getattr(off, name)), name
        valid = on.doc_ids >= 0
        diff = (on.topk_logprobs[valid] - off.topk_logprobs[valid]).abs().max().item()
        assert diff <= 2 ** -10 * on.topk_logprobs[valid].abs().max().item() + 1e-6  # float16 storage
        assert torch.equal(on.topk_logprobs[~valid], off.topk_logprobs[~valid])  # padding: -inf, no teacher mass
        padded += int((~valid).sum())
    assert data == "packed" or padded > 0  # plain rows of a batch differ in length


def test_packed_documents_get_the_features_of_their_own_forward(setup):
    ds, _ = load_prepared(setup["root"] / "packed")
    store = FeatureStore(setup["stores"]["packed", "bf16"])
    target = setup["target"]
    row = next(i for i in range(len(ds)) if max(ds[i]["doc_ids"]) >= 1)
    r = store.row(row)
    leaky = target.forward(r.input_ids[None], LAYERS, with_logits=False).features[0].float()
    for d in r.doc_ids.unique():
        m = r.doc_ids == d
        solo = target.forward(r.input_ids[m][None], LAYERS, with_logits=False).features[0].float()
        # equal up to bf16 batch-shape rounding (the row ran padded next to the other documents) ...
        assert (solo - r.features[m].float()).abs().max().item() < 0.1
        if d > 0:  # ... and far from what the document would get with the previous one as context
            assert (leaky[m] - r.features[m].float()).abs().max().item() > 1.0


def test_packed_documents_get_the_top_k_of_their_own_forward(setup):
    """Each document of a packed row gets the top-k ids and log-probs of the target run on it alone (a float32
    target: no rounding apart between batch shapes)."""
    from data.features import topk_logprobs
    from models.target import TargetModel

    target = TargetModel.from_pretrained(setup["target_dir"], dtype=torch.float32)
    ds, _ = load_prepared(setup["root"] / "packed")
    r = OnlineFeatures(target, LAYERS, ds, topk=4).row(next(i for i in range(len(ds)) if max(ds[i]["doc_ids"]) >= 1))
    for d in r.doc_ids.unique():
        m = r.doc_ids == d
        ids, lps = topk_logprobs(target.forward(r.input_ids[m][None], LAYERS, with_logits=True).logits[0], 4)
        assert torch.equal(r.topk_ids[m], ids) and (r.topk_logprobs[m] - lps).abs().max().item() < 1e-4


def test_the_online_pad_id_is_the_one_given_else_the_tokenizers_else_0(setup):
    from models.target import TargetModel

    ds, _ = load_prepared(setup["root"] / "plain")
    target, lengths = setup["target"], ds["num_tokens"]
    other = next(j for j in range(len(ds)) if lengths[j] != lengths[0])
    batch = OnlineFeatures(target, LAYERS, ds, pad_id=7).get_batch([0, other])
    pad = batch.doc_ids < 0
    assert pad.any() and batch.input_ids[pad].eq(7).all()
    assert OnlineFeatures(target, LAYERS).pad_id == target.tokenizer.pad_token_id == 256
    assert OnlineFeatures(TargetModel(target.model), LAYERS).pad_id == 0  # a target without a tokenizer


def test_fp8_within_e4m3_bound_and_half_the_bytes(setup):
    bf = FeatureStore(setup["stores"]["plain", "bf16"], dtype=torch.float32)
    f8 = FeatureStore(setup["stores"]["plain", "fp8"], dtype=torch.float32)
    worst = 0.0
    for i in range(len(bf)):
        x, y = bf.row(i).features, f8.row(i).features
        assert x.dtype == y.dtype == torch.float32  # read in the dtype asked for, bf16 and fp8 stores alike
        _, scale = quantize_fp8(x, len(LAYERS))
        err = (x - y).abs()
        assert bool((err <= fp8_error_bound(x, scale)).all()), f"row {i}: fp8 error above the e4m3 bound"
        worst = max(worst, (err / x.abs().clamp_min(1e-3)).max().item())
    assert 0 < worst <= 2 ** -4 * 1.01
    fb = sum(s["feature_bytes"] for s in bf.index["shards"].values())
    f8b = sum(s["feature_bytes"] for s in f8.index["shards"].values())
    assert f8b <= 0.52 * fb, f"fp8 features take {f8b / fb:.4f}x of bf16"
    assert f8b == bf.index["tokens"] * len(LAYERS) * (64 + 2)  # values + one bf16 scale per token per layer


def test_fp8_codec_edge_values():
    x = torch.tensor([[0.0] * 4 + [1e-8, -3e-3, 7.0, -448.0], [1e4, -1e4, 0.5, 0.0] + [0.0] * 4])
    q, scale = quantize_fp8(x, taps=2)
    from data.store import dequantize_fp8

    y = dequantize_fp8(q, scale, torch.float32)
    assert torch.isfinite(y).all() and y[0, :4].eq(0).all()  # all-zero group: scale 1, exact zeros
    assert bool(((x - y).abs() <= fp8_error_bound(x, scale)).all())


def test_fp8_uses_the_whole_e4m3_range_and_its_bound_is_half_an_ulp():
    """Each group's largest value lands on e4m3's largest, 448 (a smaller range wastes mantissa steps); values
    come back as bf16 unless asked otherwise; the bound is 2^-4 of a value, or 2^-10 of the scale near zero, with
    1 + 2^-7 of slack for the bf16 scale."""
    from data.store import dequantize_fp8

    x = torch.tensor([[1000.0, -3.0, 0.5, -0.25], [2.0, -7.0, 1.0, 0.0]])
    q, scale = quantize_fp8(x, taps=2)
    assert q.float().reshape(2, 2, 2).abs().amax(dim=-1).eq(448).all()
    assert dequantize_fp8(q, scale).dtype == torch.bfloat16
    bound = fp8_error_bound(torch.tensor([[16.0, 0.0]]), torch.ones(1, 1, dtype=torch.bfloat16))
    assert bound.tolist() == [[1.0 * (1 + 2 ** -7), 2 ** -10 * (1 + 2 ** -7)]]


def test_truncated_or_tampered_shard_is_a_clear_error(setup, tmp_path):
    store_dir = tmp_path / "store"
    shutil.copytree(setup["stores"]["plain", "bf16"], store_dir)
    shards = sorted(store_dir.glob("shard-*.safetensors"))
    data = bytearray(shards[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[1].write_bytes(bytes(data))
    with open(shards[0], "r+b") as f:
        f.truncate(shards[0].stat().st_size - 100)
    store = FeatureStore(store_dir)
    with pytest.raises(StoreCorrupt,
                       match=r"shard-00000.safetensors: \d+ bytes, index says \d+: the shard is truncated"):
        store.row(0)
    second = store.index["plan"][1][0]
    with pytest.raises(StoreCorrupt, match="shard-00001.safetensors: sha256 .* does not match the index"):
        store.row(second)
    assert store.row(store.index["plan"][2][0]).features.shape[-1] == 192  # intact shards still read
    # re-running the extraction rebuilds exactly the two damaged shards
    report = extract(setup["target"], setup["root"] / "plain", store_dir, layer_ids=LAYERS, dtype="bf16", topk=4,
                     batch_size=BATCH, shard_tokens=SHARD_TOKENS, progress=False)
    assert report.shards_written == 2 and report.shards_skipped == report.shards - 2
    FeatureStore(store_dir).verify_all()


def test_killed_extraction_resumes_without_redoing_finished_shards(setup, tmp_path):
    out = tmp_path / "store"
    kw = dict(layer_ids=LAYERS, dtype="fp8", batch_size=BATCH, shard_tokens=SHARD_TOKENS, progress=False)
    first = extract(setup["target"], setup["root"] / "plain", out, max_shards=2, **kw)
    assert first.shards_written == 2 < first.shards and first.complete is False
    with pytest.raises(StoreError, match="extraction not finished"):
        FeatureStore(out)
    done = {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in out.glob("shard-*.safetensors")}
    assert len(done) == 2
    (out / "shard-00002.safetensors.tmp").write_bytes(b"half a shard")  # what a kill mid-write leaves
    # The same rows named another way (here a copy of the folder): resumed, not refused as "another data".
    import shutil

    copy = shutil.copytree(setup["root"] / "plain", tmp_path / "plain-copy")
    second = extract(setup["target"], copy, out, **kw)
    assert second.shards_skipped == 2 and second.shards_written == second.shards - 2 and second.complete is True
    assert first.tokens_extracted + second.tokens_extracted == second.tokens  # each run counts its own shards
    for name, stamp in done.items():
        p = out / name
        assert (p.stat().st_mtime_ns, p.stat().st_ino) == stamp  # finished shards untouched
    assert not list(out.glob("*.tmp"))
    reference = setup["stores"]["plain", "fp8"]
    assert {p.name: sha256_file(p) for p in out.glob("shard-*")} == \
        {p.name: sha256_file(p) for p in reference.glob("shard-*")}


def test_store_refuses_another_target_layers_or_tokenizer(setup, tmp_path):
    from models.tiny import save_tiny_target, tiny_tokenizer

    store = FeatureStore(setup["stores"]["plain", "bf16"])
    store.check_compatible(target=setup["target"], layer_ids=LAYERS, tokenizer=setup["target"].tokenizer)
    store.check_compatible(target=str(setup["target_dir"]))
    with pytest.raises(StoreMismatch, match=r"layer ids: store \[1, 3, 5\], training asks \[1, 2, 3\]"):
        store.check_compatible(layer_ids=[1, 2, 3])
    with pytest.raises(StoreMismatch, match="tokenizer: store"):
        store.check_compatible(tokenizer=tiny_tokenizer("llama3"))  # same vocabulary, other template
    grown = tiny_tokenizer("chatml")
    grown.add_tokens(["<tool_call>"])
    with pytest.raises(StoreMismatch, match="tokenizer: store"):
        store.check_compatible(tokenizer=grown)
    other = save_tiny_target(tmp_path / "other", "qwen3", seed=1, num_layers=8)  # same shapes, other weights
    with pytest.raises(StoreMismatch, match="target: store was extracted from"):
        store.check_compatible(target=str(other))
    # resuming into a store made with other settings is refused too
    with pytest.raises(StoreMismatch, match="layer_ids"):
        extract(setup["target"], setup["root"] / "plain", setup["stores"]["plain", "bf16"], layer_ids=[1, 2],
                dtype="bf16", topk=4, batch_size=BATCH, shard_tokens=SHARD_TOKENS, progress=False)


def test_extract_cli(setup, tmp_path, capsys):
    import json

    from data.extract import main

    main(["--target", str(setup["target_dir"]), "--data", str(setup["root"] / "packed"), "--out", str(tmp_path / "s"),
          "--layers", "2", "4", "--dtype", "fp8", "--target-dtype", "float32", "--no-progress"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["extract"]
    store = FeatureStore(tmp_path / "s")
    assert line["shards_written"] == line["shards"] == 1 and store.layer_ids == [2, 4]
    assert store.index["tokens"] == line["tokens"] and len(store.index["tokenizer_hash"]) == 16


def test_extract_cli_hands_every_flag_on(setup, tmp_path, monkeypatch):
    """Each flag reaches the target's load or the extraction: one dropped on the way ran with its default."""
    import data.extract
    import models.target
    from data.extract import ExtractReport

    loaded, given = {}, {}
    monkeypatch.setattr(models.target.TargetModel, "from_pretrained", lambda path, **kw: loaded.update(kw))
    monkeypatch.setattr(data.extract, "extract", lambda *a, **kw: given.update(kw) or ExtractReport(complete=True))
    data.extract.main(["--target", str(setup["target_dir"]), "--data", str(setup["root"] / "plain"),
                       "--out", str(tmp_path / "s"), "--layers", "2", "4", "--dtype", "fp8", "--topk", "8",
                       "--batch-size", "3", "--writers", "1", "--shard-mb", "0.5", "--force-target", "--no-progress",
                       "--device-map", "auto", "--max-memory", "cpu=1GiB", "--target-dtype", "float32"])
    assert loaded == {"dtype": "float32", "device_map": "auto", "max_memory": {"cpu": "1GiB"}}
    ranks = given.pop("ranks")
    assert (ranks.rank, ranks.world) == (0, 1)
    assert given == {"layer_ids": [2, 4], "dtype": "fp8", "topk": 8, "batch_size": 3, "shard_mb": 0.5,
                     "progress": False, "writers": 1, "force_target": True}


def test_fp8_scale_is_per_token_per_tap():
    """One scale per token per tapped layer: a layer of small activations next to one of huge ones (deep layers'
    massive activations) keeps its own scale; one scale per token would crush it into e4m3 subnormals."""
    from data.store import E4M3_MAX, dequantize_fp8

    big = torch.tensor([[8000.0, -6000, 7000, 5000, -4000, 3000, 2000, 1000],
                        [1000.0, 2000, -3000, 4000, 5000, 6000, -7000, 7500]])
    small = torch.tensor([[0.1, 0.13, -0.17, 0.2, 0.3, -0.5, 0.7, 1.0],
                          [1.5, -0.9, 0.11, 0.23, -0.37, 0.41, 0.05, 0.6]])
    x = torch.cat([big, small], dim=1)  # [T=2, taps=2 x H=8]: tap 0 ~1000s, tap 1 ~0.1..1.5
    q, scale = quantize_fp8(x, taps=2)
    assert scale.shape == (2, 2) and scale.dtype == torch.bfloat16
    assert torch.equal(scale[:, 1], (small.abs().amax(dim=1) / E4M3_MAX).to(torch.bfloat16))  # tap 1's own absmax
    assert torch.equal(scale[:, 0], (big.abs().amax(dim=1) / E4M3_MAX).to(torch.bfloat16))
    y = dequantize_fp8(q, scale, torch.float32)
    rel = (y - x).abs() / x.abs()
    assert rel[:, 8:].max().item() <= 2 ** -4  # one e4m3 step for tap 1 too (a shared scale gives ~0.31)
    assert rel[:, :8].max().item() <= 2 ** -4


def test_resuming_with_another_shard_plan_is_refused(setup, tmp_path):
    """The shard plan is fixed when the store is created; resuming with another shard size would mix shards of two
    plans (rows missing or stored twice), so it is refused and the finished shard is left alone."""
    out = tmp_path / "store"
    kw = dict(layer_ids=LAYERS, dtype="bf16", batch_size=BATCH, progress=False)
    first = extract(setup["target"], setup["root"] / "plain", out, max_shards=1, shard_tokens=SHARD_TOKENS, **kw)
    assert first.shards_written == 1 < first.shards
    shard = out / "shard-00000.safetensors"
    digest = sha256_file(shard)
    with pytest.raises(StoreMismatch, match="shard plan differs from the existing store's"):
        extract(setup["target"], setup["root"] / "plain", out, shard_tokens=2 * SHARD_TOKENS, **kw)
    assert sha256_file(shard) == digest and not (out / "shard-00001.safetensors").exists()


def test_shard_plan_has_no_empty_range():
    """Every shard holds at least one row, also a row longer than the shard budget (an empty range would be an
    empty shard: nothing to concatenate) and the plan covers every row once, in order."""
    from data.extract import shard_plan

    assert shard_plan([5, 10, 3], 4) == [(0, 1), (1, 2), (2, 3)]  # every row over budget: one row per shard
    assert shard_plan([2, 2, 2, 5, 1], 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert shard_plan([1, 1, 1], 100) == [(0, 3)]
    assert shard_plan([], 4) == []


def test_every_shard_holds_the_rows_of_its_plan(setup, tmp_path):
    """Rows are computed --batch-size at a time inside a shard: each shard holds its planned rows once."""
    report = extract(setup["target"], setup["root"] / "plain", tmp_path / "store", layer_ids=LAYERS, batch_size=1,
                     shard_tokens=SHARD_TOKENS, progress=False)
    store = FeatureStore(tmp_path / "store")
    plan = store.index["plan"]
    assert max(b - a for a, b in plan) > 1  # some shard takes more than one batch
    shards = sorted(store.index["shards"].values(), key=lambda s: s["row_start"])
    assert [(s["row_start"], s["rows"]) for s in shards] == [(a, b - a) for a, b in plan]
    assert store.index["tokens_done"] == store.index["tokens"] == sum(s["tokens"] for s in shards)
    assert report.bytes_written == sum(p.stat().st_size for p in (tmp_path / "store").glob("shard-*.safetensors"))


def test_stored_bytes_per_token():
    """What the shard size (--shard-mb) is divided by: bf16 features, or fp8 + a 2-byte scale per tap; 13 bytes of
    ids, mask, docs and positions; 6 per top-k entry."""
    from data.extract import bytes_per_token

    assert bytes_per_token(64, 3, "bf16") == 3 * 64 * 2 + 13
    assert bytes_per_token(64, 3, "bf16", topk=4) == 3 * 64 * 2 + 13 + 24
    assert bytes_per_token(64, 3, "fp8") == 3 * 64 + 3 * 2 + 13


def test_shard_mb_is_mib_of_stored_bytes(setup, tmp_path):
    """--shard-mb MiB over the bytes per token is the tokens per shard the plan is cut by."""
    import json

    from data.extract import bytes_per_token, shard_plan

    per_token = bytes_per_token(setup["target"].hidden_size, len(LAYERS), "bf16")
    out = tmp_path / "store"
    extract(setup["target"], setup["root"] / "plain", out, layer_ids=LAYERS, shard_mb=(SHARD_TOKENS + 0.5) * per_token
            / 2 ** 20, max_shards=0, progress=False)  # the index holds the plan; no shard is needed
    lengths = load_prepared(setup["root"] / "plain")[0]["num_tokens"]
    plan = [tuple(r) for r in json.loads((out / "index.json").read_text())["plan"]]
    assert plan == shard_plan(lengths, SHARD_TOKENS) and max(b - a for a, b in plan) > 1


def test_the_index_records_the_default_taps_their_width_and_the_datas_meta(setup, tmp_path):
    """No layer ids (None or an empty list) are the drafter's default taps; the index records them, the
    feature width they make and the prepared data's meta."""
    import json

    from models.config import default_layer_ids

    target = setup["target"]
    taps = default_layer_ids(target.num_layers)
    for i, layer_ids in enumerate((None, [])):
        out = tmp_path / f"store{i}"
        extract(target, setup["root"] / "plain", out, layer_ids=layer_ids, max_shards=0, progress=False)
        index = json.loads((out / "index.json").read_text())
        assert index["layer_ids"] == taps and index["feature_dim"] == len(taps) * target.hidden_size
        assert index["data_meta"] == load_prepared(setup["root"] / "plain")[1]


def test_top_k_may_be_the_whole_vocabulary(tiny_targets, tmp_path):
    """--topk up to the vocabulary size: every token's log-prob under the target, largest first."""
    from data.bench import random_data

    target = tiny_targets("qwen3")
    extract(target, random_data(1, 6, 250), tmp_path / "s", layer_ids=[1], topk=target.vocab_size, progress=False)
    row = FeatureStore(tmp_path / "s", dtype=torch.float32).row(0)
    assert sorted(row.topk_ids[0].tolist()) == list(range(target.vocab_size))
    logits = target.forward(row.input_ids[None], [1], with_logits=True).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1).gather(-1, row.topk_ids.long())
    assert (row.topk_logprobs.float() - expected).abs().max().item() <= 2 ** -10 * expected.abs().max().item()
    assert bool((row.topk_logprobs.diff(dim=-1) <= 0).all())


def test_prepared_data_of_another_tokenizer_is_refused(setup, tmp_path):
    """Token ids mean nothing under another vocabulary or template: loading prepared data with another tokenizer
    fails, naming the tokenizer, instead of training on garbage."""
    from data.reuse import DataMismatch
    from models.target import TargetModel
    from models.tiny import tiny_tokenizer

    ds, meta = load_prepared(setup["root"] / "plain", tokenizer=tiny_tokenizer("chatml"))  # the one it was made with
    assert len(ds) > 0 and len(meta["tokenizer_hash"]) == 16
    with pytest.raises(DataMismatch, match="was tokenized for target .* not for this tokenizer .*re-run data.prepare"):
        load_prepared(setup["root"] / "plain", tokenizer=tiny_tokenizer("llama3"))  # same vocabulary, other template
    other = TargetModel(setup["target"].model, tiny_tokenizer("llama3"))  # extraction refuses it too, before a write
    with pytest.raises(DataMismatch, match="not for this tokenizer"):
        extract(other, setup["root"] / "plain", tmp_path / "s", layer_ids=LAYERS, progress=False)
    assert not (tmp_path / "s").exists()


def test_store_rows_outside_the_store_are_an_index_error(setup):
    """Row -1 once would have read through the last shard's plan entry instead of failing."""
    store = FeatureStore(setup["stores"]["plain", "bf16"])
    for i in (-1, len(store)):
        with pytest.raises(IndexError, match=f"row {i} outside the store's {len(store)} rows"):
            store.row(i)
    # the pad id the store recorded, unless the reader names one (0 included)
    assert store.pad_id == 256 and FeatureStore(setup["stores"]["plain", "bf16"], pad_id=0).pad_id == 0


def test_a_store_missing_only_its_last_shard_is_not_complete(setup, tmp_path):
    """Not complete until the last shard; the index counts the rows and tokens written so far, and a
    writer that reopens the store drops leftover temp files, even when it writes no shard."""
    import json

    out = tmp_path / "store"
    kw = dict(layer_ids=LAYERS, dtype="fp8", batch_size=BATCH, shard_tokens=SHARD_TOKENS, progress=False)
    ref = FeatureStore(setup["stores"]["plain", "fp8"]).index
    total = len(ref["plan"])
    report = extract(setup["target"], setup["root"] / "plain", out, max_shards=total - 1, **kw)
    assert report.shards_written == total - 1
    with pytest.raises(StoreError, match=f"extraction not finished \\({total - 1}/{total} shards\\)"):
        FeatureStore(out)
    index = json.loads((out / "index.json").read_text())
    last = ref["shards"][f"shard-{total - 1:05d}.safetensors"]
    assert (index["rows_done"], index["tokens_done"]) == (ref["rows"] - last["rows"], ref["tokens"] - last["tokens"])
    half = out / f"shard-{total - 1:05d}.safetensors.tmp"
    half.write_bytes(b"half a shard")  # a kill mid-write: hundreds of MB of a real shard
    extract(setup["target"], setup["root"] / "plain", out, max_shards=0, **kw)
    assert not half.exists(), "reopening the store drops leftovers of killed writes"
    extract(setup["target"], setup["root"] / "plain", out, **kw)
    assert FeatureStore(out).index["rows_done"] == ref["rows"] and not list(out.glob("*.tmp"))


def test_shard_headers_are_padded_to_8_bytes(setup):
    """The safetensors header is padded with spaces to a multiple of 8 bytes, so the tensor data that
    follows is aligned for readers that map it."""
    import struct

    for store in setup["stores"].values():
        for shard in store.glob("shard-*.safetensors"):
            with open(shard, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                head = f.read(n)
            assert n % 8 == 0 and head.rstrip(b" ").endswith(b"}"), shard.name


def test_top_k_log_probs_are_float32_largest_first_over_any_chunking():
    """bf16 logits: log_softmax runs in float32 (in bf16 the log-probs are off by ~2^-8 of their size); the k
    largest come first, the same whichever chunk of positions each one falls in (9 positions in chunks of 4)."""
    from data.features import topk_logprobs

    logits = (torch.randn(3, 3, 50, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    ids, lps = topk_logprobs(logits, 5, chunk=4)
    expected, expected_ids = torch.log_softmax(logits.float(), dim=-1).topk(5, dim=-1)
    assert ids.dtype == torch.int32 and lps.dtype == torch.float32 and ids.shape == lps.shape == (3, 3, 5)
    assert torch.equal(ids.long(), expected_ids) and (lps - expected).abs().max().item() <= 1e-6


def test_collate_pads_every_column_with_its_own_value():
    """Right padding: pad_id tokens, no loss, document -1, position 0, zero features and a teacher
    with no mass (log-prob -inf), as the online provider pads."""
    from data.features import FeatureRow, collate

    def row(n):
        return FeatureRow(torch.arange(1, n + 1), torch.ones(n, dtype=torch.int8), torch.zeros(n, dtype=torch.int32),
                          torch.arange(n, dtype=torch.int32), torch.ones(n, 4), torch.ones(n, 2, dtype=torch.int32),
                          torch.zeros(n, 2))

    b = collate([row(3), row(1)], pad_id=9)
    assert b.input_ids[1].tolist() == [1, 9, 9] and b.loss_mask[1].tolist() == [1, 0, 0]
    assert b.doc_ids[1].tolist() == [0, -1, -1] and b.position_ids[1].tolist() == [0, 0, 0]
    assert b.lengths.tolist() == [3, 1] and b.attention_mask[1].tolist() == [1, 0, 0]
    assert b.features[1, 1:].eq(0).all() and b.topk_ids[1, 1:].eq(0).all()
    assert b.topk_logprobs[1, 1:].eq(float("-inf")).all() and b.topk_logprobs[0].eq(0).all()


def test_a_store_of_another_format_version_or_a_pre_quantized_shard_for_bf16_is_refused(tmp_path):
    """A reader of version 1 must not read another version's shards as its own; fp8 values handed to a bf16
    store would be written as features of another dtype than the index says."""
    import json

    from data.features import FeatureRow
    from data.store import read_index
    from data.store_writer import StoreWriter

    out = tmp_path / "store"
    header = {"dtype": "bf16", "layer_ids": [1], "topk": 0, "rows": 1}
    w = StoreWriter(out, header, [(0, 1)])
    row = FeatureRow(torch.arange(3), torch.ones(3, dtype=torch.int8), torch.zeros(3, dtype=torch.int32),
                     torch.arange(3, dtype=torch.int32), torch.randn(3, 4))
    with pytest.raises(ValueError, match="pre-quantized features given to a bf16 store"):
        w.write_shard(0, [row], quantized=quantize_fp8(row.features, 1))
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**index, "version": 2}))
    with pytest.raises(StoreError, match="format draftsmith-features v2, this reader reads draftsmith-features v1"):
        read_index(out)


def test_the_target_fingerprint_reads_the_end_of_each_weight_file(tmp_path):
    """A fine-tune may differ only in the last tensors of a shard: the fingerprint hashes each weight file's
    first and last MiB, so two folders alike but for their last byte are two targets."""
    from data.store import target_identity

    body = bytes(range(256)) * (3 << 12)  # 3 MiB: the end is outside the first MiB
    prints = []
    for last in (0, 1):
        folder = tmp_path / f"t{last}"
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "qwen3"}')
        (folder / "model.safetensors").write_bytes(body + bytes([last]))
        prints.append(target_identity(str(folder))["target_fingerprint"])
    assert prints[0] != prints[1]


def test_the_target_fingerprint_is_its_config_then_each_weight_files_name_size_and_ends(tmp_path):
    """Stores record this fingerprint and later runs compare it: the recipe is pinned, so a store made by an
    earlier version still matches. A file under 1 MiB is its own first and last MiB."""
    import hashlib

    from data.store import target_identity

    folder = tmp_path / "t"
    folder.mkdir()
    config, body = b'{"model_type": "qwen3"}', bytes(range(100))
    (folder / "config.json").write_bytes(config)
    (folder / "model.safetensors").write_bytes(body)
    expected = hashlib.sha256(config + b"model.safetensors:100" + body + body).hexdigest()[:16]
    assert target_identity(str(folder)) == {"target": str(folder), "target_revision": None,
                                            "target_fingerprint": expected}


def test_a_target_built_in_memory_is_fingerprinted_by_its_config_wherever_it_runs(tmp_path, monkeypatch):
    """An unnamed target has no folder: its config is its fingerprint. Its name "" once read as the working
    directory, so run from a model's folder it took that model's fingerprint (and that model's stores)."""
    import hashlib
    from types import SimpleNamespace

    from data.store import is_same_target, legacy_hub_fingerprint, target_identity
    from models.target import TargetModel
    from models.tiny import save_tiny_target, tiny_target

    def built(arch):  # a fresh target: the identity is kept on the target once computed
        return TargetModel(tiny_target(arch, seed=0))

    target = built("qwen3")
    ident = target_identity(target)
    config = target.model.config.to_json_string(use_diff=False).encode()
    assert ident == {"target": "", "target_revision": None,
                     "target_fingerprint": hashlib.sha256(config).hexdigest()[:16]}
    assert target.identity == ident and target_identity(built("llama"))["target_fingerprint"] != \
        ident["target_fingerprint"]
    monkeypatch.chdir(save_tiny_target(tmp_path / "cwd", "qwen3", num_layers=2))  # a model's folder
    assert target_identity(built("qwen3")) == ident
    target.identity = {**ident, "target_fingerprint": "kept"}  # computed once per target, then reused
    assert target_identity(target)["target_fingerprint"] == "kept"
    fingerprint = ident["target_fingerprint"]
    assert is_same_target(fingerprint, built("qwen3"), fingerprint)
    assert not is_same_target("0123456789abcdef", built("qwen3"), fingerprint)
    assert legacy_hub_fingerprint(SimpleNamespace(name="org/t")) is None  # a Hub name, no loaded config


def test_the_reader_names_a_missing_shard_and_checks_sizes_even_unverified(setup, tmp_path, monkeypatch):
    """A shard deleted, or absent from the index, is named; verify=False (the index alone is trusted) hashes
    nothing but still refuses a shard of another size, longer or shorter; verify_all checks the first shard too;
    with one shard open at a time, shards are reopened as rows go back and forth."""
    import json

    import data.store

    store_dir = tmp_path / "store"
    shutil.copytree(setup["stores"]["plain", "bf16"], store_dir)
    second = FeatureStore(store_dir).index["plan"][1][0]
    reference = FeatureStore(setup["stores"]["plain", "bf16"])
    one_open = FeatureStore(store_dir, max_open=1)
    for i in (0, second, 0, second):
        assert torch.equal(one_open.row(i).features, reference.row(i).features)
    monkeypatch.setattr(data.store, "sha256_file", lambda f: pytest.fail("hashed with verify=False"))
    shard = store_dir / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes() + b"x")
    with pytest.raises(StoreCorrupt, match=r"shard-00001.safetensors: \d+ bytes, index says \d+: the shard is"):
        FeatureStore(store_dir, verify=False).row(second)
    assert FeatureStore(store_dir, verify=False).row(0).features.shape[-1] == 192
    monkeypatch.undo()
    shard.unlink()
    with pytest.raises(StoreCorrupt, match="shard-00001.safetensors: shard missing; re-run data.extract"):
        FeatureStore(store_dir).row(second)
    first = store_dir / "shard-00000.safetensors"
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(StoreCorrupt, match="shard-00000.safetensors: sha256 .* does not match the index"):
        FeatureStore(store_dir).verify_all()
    index = json.loads((store_dir / "index.json").read_text())
    del index["shards"]["shard-00000.safetensors"]  # a hand-edited index that still says complete
    (store_dir / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreCorrupt, match="shard-00000.safetensors: shard missing"):
        FeatureStore(store_dir).row(0)


def test_a_store_is_compatible_only_with_its_layers_in_their_order_and_its_tokenizer_hash(setup):
    """Features are laid out tap by tap in the store's layer order: the same layers in another order are other
    features. A tokenizer may be given as its fingerprint."""
    store = FeatureStore(setup["stores"]["plain", "bf16"])
    with pytest.raises(StoreMismatch, match=r"layer ids: store \[1, 3, 5\], training asks \[5, 3, 1\]"):
        store.check_compatible(layer_ids=[5, 3, 1])
    store.check_compatible(tokenizer=store.index["tokenizer_hash"])
    with pytest.raises(StoreMismatch, match="tokenizer: store .*, training 0123456789abcdef"):
        store.check_compatible(tokenizer="0123456789abcdef")


def shard_dtypes(shard) -> dict:
    """Each tensor's dtype as the safetensors header of a shard records it."""
    import json
    import struct

    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return {k: v["dtype"] for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


def test_shard_columns_are_stored_in_the_documented_dtypes(setup, tmp_path):
    """The format (module docstring of data.store): ids and positions int32, mask int8, features bf16 (float32
    rows included) or e4m3 with bf16 scales, top-k ids int32 and log-probs float16: what the bytes per token
    and --shard-mb assume. An fp8 shard of rows quantized by the writer equals one of rows quantized beforehand."""
    from data.store_writer import StoreWriter
    from tests.helpers import tiny_store_rows

    ids = {"row_offsets": "I64", "input_ids": "I32", "loss_mask": "I8", "doc_ids": "I32", "position_ids": "I32"}
    assert shard_dtypes(setup["stores"]["plain", "bf16"] / "shard-00000.safetensors") == \
        {**ids, "features": "BF16", "topk_ids": "I32", "topk_logprobs": "F16"}
    assert shard_dtypes(setup["stores"]["plain", "fp8"] / "shard-00000.safetensors") == \
        {**ids, "features": "F8_E4M3", "feature_scales": "BF16"}
    rows = tiny_store_rows()
    assert rows[0].features.dtype == torch.float32
    StoreWriter(tmp_path / "bf16", {"dtype": "bf16", "layer_ids": [1], "topk": 0}, [(0, 2)]).write_shard(0, rows)
    assert shard_dtypes(tmp_path / "bf16" / "shard-00000.safetensors")["features"] == "BF16"
    shards = {}
    for how in ("rows", "quantized"):
        w = StoreWriter(tmp_path / how, {"dtype": "fp8", "layer_ids": [1, 2], "topk": 0}, [(0, 2)])
        whole = torch.cat([r.features for r in rows])
        w.write_shard(0, rows, quantized=quantize_fp8(whole, 2) if how == "quantized" else None)
        shards[how] = (tmp_path / how / "shard-00000.safetensors").read_bytes()
    assert shards["rows"] == shards["quantized"]  # one scale per token per tap (2 taps of 2 here)
