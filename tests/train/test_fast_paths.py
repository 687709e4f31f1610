"""Speed paths of this stage held to their plain counterparts (same results, CPU): no timing is checked."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from train.block_mask import direct_block_mask, documents_contiguous, tile_states
from train.blocks import draw_blocks, flex_block_mask


def _tiles(bm) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-level ``(partial, full)`` dense maps of a BlockMask."""
    def dense(num, idx):
        out = torch.zeros(*num.shape, bm.kv_indices.shape[-1], dtype=torch.bool)
        for key in torch.cartesian_prod(*[torch.arange(d) for d in num.shape]):
            k = tuple(key.tolist())
            out[k][idx[k][: int(num[k])].long()] = True
        return out
    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


def _packed_rows(b: int, s: int, seed: int):
    """Rows of 1-3 packed documents, a prompt then an answer each, and padding at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 90, (b, s), generator=g)
    lm = torch.zeros(b, s, dtype=torch.long)
    doc = torch.full((b, s), -1, dtype=torch.long)
    pos = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        end = s - int(torch.randint(0, s // 5, (1,), generator=g))
        n_cuts = int(torch.randint(0, 3, (1,), generator=g))
        cuts = sorted(set(torch.randint(end // 4, end - end // 4, (n_cuts,), generator=g).tolist()))
        bounds = [0, *cuts, end]
        for d, (a, z) in enumerate(zip(bounds[:-1], bounds[1:])):
            doc[r, a:z], pos[r, a:z] = d, torch.arange(z - a)
            lm[r, a + (z - a) // 3:z] = 1
    return ids, lm, doc, pos


@pytest.mark.parametrize("s,anchors,block", [(300, 40, 16), (256, 24, 8), (130, 100, 4), (40, 6, 4)])
def test_direct_block_mask_equals_create_block_mask(s, anchors, block):
    """Same partial and full tiles as the generic builder, at tile-aligned and ragged lengths, with
    packed documents, padding and padding blocks (rows with fewer candidates than anchors)."""
    ids, lm, doc, pos = _packed_rows(3, s, seed=s + anchors)
    lm[0] = 0
    lm[0, 2:6] = 1  # row 0 has 3 candidates: padding blocks
    assert documents_contiguous(doc)
    blocks = draw_blocks(ids, lm, doc, pos, anchors, block, 95, torch.Generator().manual_seed(0))
    assert not bool(blocks.valid.all())
    _same_as_create_block_mask(blocks, doc, block)


def test_direct_block_mask_with_anchors_on_tile_edges():
    """Anchors at 127, 128, 255...: a context interval that ends exactly on a 128-key tile edge (a
    query tile whose first anchor is 127 sees keys 0..126, tile 0 partial, not full). Random draws
    almost never put an anchor there."""
    from train.blocks import build_blocks

    s, block = 400, 16
    ids = torch.randint(0, 90, (1, s), generator=torch.Generator().manual_seed(0))
    lm, doc, pos = torch.ones(1, s, dtype=torch.long), torch.zeros(1, s, dtype=torch.long), torch.arange(s)[None]
    anchors = torch.tensor([[127, 128, 129, 130, 131, 132, 133, 134, 255, 256, 257, 1, 0, 383, 384, 126]])
    blocks = build_blocks(ids, lm, doc, pos, anchors, torch.ones_like(anchors, dtype=torch.bool), block, 95)
    _same_as_create_block_mask(blocks, doc, block)


@pytest.mark.parametrize("s,block,anchors,valid,second_doc", [
    # Every block of a query tile has the same anchor: 128 makes context tile 0 full and tile 1
    # empty, 129 makes tile 1 partial (it sees key 128 only), 256 makes tiles 0 and 1 full.
    (400, 16, [128] * 8 + [129] * 8 + [256] * 8, None, None),
    # s = 129 = 1 mod 16, 8 blocks: the last key (129 + 127 = 256) is alone in the last key tile.
    (129, 16, list(range(5, 125, 15)), None, None),
    # Padding blocks (valid False) whose anchors are not 0 see no context at all: only they reach
    # past key 100, so key tiles 1 and 2 stay empty for the first query tile.
    (300, 8, [3, 260, 10, 280, 20, 30, 40, 50, 60, 70, 80, 90, 95, 97, 98, 99],
     [True, False, True, False] + [True] * 12, None),
    # Anchors on the first token of the second document (key 200) see no context: not the first
    # document before it.
    (400, 16, [200] * 8 + [300] * 8, None, 200),
    # A block of 128 is one query tile; its keys 256..355 fill the ragged last key tile, which is
    # still partial (create_block_mask pads with False).
    (100, 128, [50, 90], None, None),
])
def test_direct_block_mask_on_uniform_query_tiles(s, block, anchors, valid, second_doc):
    """Tiles whose state hangs on one key: the end of the context interval (strictly before the
    anchor), the last key of a block, the start of a document and the empty context of padding
    blocks."""
    from train.blocks import build_blocks

    ids = torch.randint(0, 90, (1, s), generator=torch.Generator().manual_seed(0))
    lm, doc, pos = torch.ones(1, s, dtype=torch.long), torch.zeros(1, s, dtype=torch.long), torch.arange(s)[None]
    if second_doc is not None:
        doc[:, second_doc:] = 1
        pos[:, second_doc:] -= second_doc
    a = torch.tensor([anchors])
    v = torch.ones_like(a, dtype=torch.bool) if valid is None else torch.tensor([valid])
    blocks = build_blocks(ids, lm, doc, pos, a, v, block, 95)
    _same_as_create_block_mask(blocks, doc, block)
    partial, full = tile_states(a, v, doc, block)
    if s == 400 and second_doc is None:  # the states themselves, not only agreement with the generic builder
        assert full[0, 0, 0, :3].tolist() == [True, False, False]
        assert partial[0, 0, 1, :3].tolist() == [False, True, False] and full[0, 0, 1, 0]
        assert full[0, 0, 2, :3].tolist() == [True, True, False] and not partial[0, 0, 2, 2]
    if second_doc is not None:  # query tile 0 (anchor 200) sees no context tile, tile 1 (300) sees 200..299
        assert not (partial[0, 0, 0, :3] | full[0, 0, 0, :3]).any()
        assert partial[0, 0, 1, :3].tolist() == [False, True, True] and not full[0, 0, 1, :3].any()
    if block == 128:
        assert partial[0, 0, 1, 2] and not full[0, 0, 1].any()


def _same_as_create_block_mask(blocks, doc, block: int) -> None:
    b, s = doc.shape
    n = blocks.num_blocks
    q_anchor = blocks.anchors.repeat_interleave(block, 1)
    q_doc = blocks.doc.repeat_interleave(block, 1)

    def mask_mod(bi, h, q, kv):
        kc = torch.clamp(kv, max=s - 1)
        ctx = (kv < s) & (kc < q_anchor[bi, q]) & (doc[bi, kc] == q_doc[bi, q])
        return ctx | ((kv >= s) & (torch.clamp(kv - s, min=0) // block == q // block))

    ref = create_block_mask(mask_mod, B=b, H=None, Q_LEN=n * block, KV_LEN=s + n * block, device="cpu")
    fast = direct_block_mask(blocks.anchors, blocks.valid, doc, block, mask_mod)
    for a, z, what in zip(_tiles(fast), _tiles(ref), ("partial", "full")):
        assert torch.equal(a, z), f"{what} tiles differ at {(a != z).nonzero()[:5].tolist()}"
    assert fast.seq_lengths == ref.seq_lengths
    assert torch.equal(fast.to_dense(), ref.to_dense())


def test_block_mask_falls_back_when_documents_repeat():
    """A document id that comes back after another one is not an interval: the generic builder runs."""
    ids, lm, doc, pos = _packed_rows(2, 200, seed=3)
    doc[0, 150:] = 0
    doc[0, 100:150] = 1
    assert not documents_contiguous(doc)
    blocks = draw_blocks(ids, lm, doc, pos, 16, 8, 95, torch.Generator().manual_seed(0))
    assert direct_block_mask(blocks.anchors, blocks.valid, doc, 8, lambda *a: None) is None
    bm = flex_block_mask(blocks, doc)  # still right: built the generic way
    partial, full = tile_states(blocks.anchors, blocks.valid, torch.zeros_like(doc), 8)
    assert bm.kv_num_blocks.shape == partial.sum(-1).shape
    # the trainer's answer from the host copy decides the same way, without looking at doc
    assert torch.equal(flex_block_mask(blocks, doc, contiguous=False).to_dense(), bm.to_dense())


def test_the_trainer_checks_document_runs_on_the_host_and_the_mask_agrees(monkeypatch):
    """draw_step records documents_contiguous of the token batch's host copy; the mask built with it
    equals the one that checks the device copy itself, and that check is not made again."""
    import train.block_mask as bm_module
    from train.blocks import attention_masks

    ids, lm, doc, pos = _packed_rows(2, 200, seed=4)
    assert documents_contiguous(doc)
    blocks = draw_blocks(ids, lm, doc, pos, 16, 8, 95, torch.Generator().manual_seed(0))

    class Cfg:
        use_sliding_window = False

    checked = attention_masks(Cfg, blocks, doc, pos, True)
    calls = []
    real = bm_module.documents_contiguous
    monkeypatch.setattr(bm_module, "documents_contiguous", lambda d: calls.append(1) or real(d))
    given = attention_masks(Cfg, blocks, doc, pos, True, contiguous=True)
    assert calls == [] and torch.equal(given.to_dense(), checked.to_dense())


def test_causal_block_mask_has_no_full_tile_inside_a_block():
    """Blocks of 128 slots fill whole tiles: bidirectional, a block's own tile is full; causal inside the
    block, it is only partial, so flex_block_mask must build the tiles from the causal rule too."""
    ids, lm, doc, pos = _packed_rows(1, 256, seed=5)
    blocks = draw_blocks(ids, lm, doc, pos, 2, 128, 95, torch.Generator().manual_seed(0))
    for causal in (False, True):
        bm = flex_block_mask(blocks, doc, block_causal=causal)
        ref = create_block_mask(bm.mask_mod, B=1, H=None, Q_LEN=2 * 128, KV_LEN=256 + 2 * 128, device="cpu")
        for a, z, what in zip(_tiles(bm), _tiles(ref), ("partial", "full")):
            assert torch.equal(a, z), f"causal={causal}: {what} tiles differ"
        assert bool(_tiles(bm)[1][0, 0, 0, 2]) != causal  # block 0's own keys start at 256: tile 2


@pytest.mark.parametrize("mode,target_compiled", [("online", True), ("offline", False)])
def test_train_compile_compiles_the_target_only_with_online_features(mode, target_compiled):
    from train.compiling import compile_models
    from train.config import load_config

    calls = []

    class Model:
        def __init__(self, name):
            self.name = name

        def compile_layers(self):
            calls.append(self.name)

    cfg = load_config(["recipe=tiny", "train.compile=true", f"features.mode={mode}", "features.store=/unused"])
    compile_models(cfg, "cuda", Model("drafter"), Model("target"))
    assert calls == ["drafter", "target"] if target_compiled else calls == ["drafter"]


@pytest.mark.parametrize("setting,device,compiled", [
    ("auto", "cuda", True), ("auto", "cpu", False), ("auto", "mps", False), ("true", "cuda", True),
    ("false", "cuda", False), (False, "cuda", False), ("no", "cuda", False), ("on", "cuda", True),
])
def test_train_compile_auto_compiles_on_cuda_only(setting, device, compiled):
    from train.compiling import compile_wanted

    assert compile_wanted(setting, device) is compiled


def test_every_recipe_compiles_by_default_and_an_old_false_still_reads():
    """train.compile is auto in the config and in every shipped recipe (none sets it off); a checkpoint's
    config.yaml written when it was a boolean (`compile: false`) still loads, as false."""
    import yaml

    from train.config import load_config
    from train.overrides import recipe_names, recipes_dir

    for name in recipe_names():
        assert "compile" not in (yaml.safe_load((recipes_dir() / f"{name}.yaml").read_text()).get("train") or {}), name
        if name != "small":  # small.yaml names a local folder that is not here: its config loads all the same
            assert load_config([f"recipe={name}"]).train.compile == "auto", name
    assert load_config(["recipe=tiny"], overrides={"train.compile": False}).train.compile == "false"
    assert load_config(["recipe=tiny", "train.compile=yes"]).train.compile == "true"
    with pytest.raises(ValueError, match=r"train.compile='sometimes': use one of \('auto', 'true', 'false'\)"):
        load_config(["recipe=tiny", "train.compile=sometimes"])


def test_resume_takes_a_change_of_train_compile():
    """A speed setting: a checkpoint written with the old boolean default resumes under auto (and any change)."""
    from train.checkpoint import config_changes
    from train.config import RunConfig, load_config

    saved = load_config(["recipe=tiny"]).to_dict()
    saved["train"]["compile"] = False  # as checkpoints wrote it before auto
    refused, harmless = config_changes(saved, load_config(["recipe=tiny"]).to_dict(), RunConfig().to_dict())
    assert refused == [] and harmless == ["train.compile: False -> 'auto'"]


@pytest.mark.parametrize("first_call", ["eval", "step"])
def test_a_failing_compile_falls_back_to_eager_once_with_the_eager_losses(first_call, tmp_path, monkeypatch):
    """A compiler that fails at the first compiled call (the step-0 eval or the first step): one warning, the eager
    layers back, the same call again, and the run ends with the eager run's losses. On the CPU auto never compiles:
    the run is told to, and torch.compile hands back functions whose first call raises dynamo's backend error."""
    import warnings

    import train.compiling
    from tests.helpers.tiny_run import FAST, golden_input_dirs, losses, metrics, run

    inputs = golden_input_dirs(tmp_path / "inputs")
    args = [*inputs, *FAST, "train.max_steps=3", "logging.every=1"]
    if first_call == "eval":
        args.append("eval.at_start=true")
    run(tmp_path / "eager", *args)
    calls = []

    def inductor(*a, **k):
        raise AssertionError("never run")

    def failing_compile(fn, *a, **k):
        def compiled(*args, **kwargs):
            calls.append(fn)
            raise torch._dynamo.exc.BackendCompilerFailed(inductor, RuntimeError("planted: no C++ compiler"), None)
        return compiled

    monkeypatch.setattr(train.compiling, "compile_wanted", lambda setting, device_type: True)
    monkeypatch.setattr(torch, "compile", failing_compile)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = run(tmp_path / "fell_back", *args)
    said = [str(w.message) for w in seen if "train.compile" in str(w.message)]
    assert said == ["train.compile: compiling the layers failed (BackendCompilerFailed: backend='inductor' raised: "
                    "RuntimeError: planted: no C++ compiler); running the eager layers (the same math, slower): set "
                    "train.compile=false to skip the attempt"]
    assert len(calls) == 1  # the first compiled call; every later one ran the eager layers
    assert result["steps"] == 3
    assert losses(tmp_path / "fell_back") == losses(tmp_path / "eager")
    if first_call == "eval":
        assert [r["eval_loss"] for r in metrics(tmp_path / "fell_back") if "eval_loss" in r] == \
            [r["eval_loss"] for r in metrics(tmp_path / "eager") if "eval_loss" in r]
    assert not any("compile_s" in r or "mfu" in r for r in metrics(tmp_path / "fell_back"))  # CPU: no MFU


def test_a_compiled_run_prints_its_one_time_compile_and_logs_it_in_the_first_row(tmp_path, monkeypatch, capsys):
    """A compiled run (here torch.compile hands back the functions as they are) prints one train.compile line
    after its first step, and its first logged row, alone, carries compile_s; the losses are the eager run's."""
    import train.compiling
    from tests.helpers.tiny_run import FAST, golden_input_dirs, losses, metrics, run

    args = [*golden_input_dirs(tmp_path / "inputs"), *FAST, "train.max_steps=3", "logging.every=2"]
    run(tmp_path / "eager", *args)
    monkeypatch.setattr(train.compiling, "compile_wanted", lambda setting, device_type: True)
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **k: fn)
    capsys.readouterr()
    run(tmp_path / "compiled", *args)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train.compile:")]
    assert len(said) == 1 and said[0].startswith("train.compile: drafter and target layers compiled: ")
    assert "first step" in said[0]
    rows = [r for r in metrics(tmp_path / "compiled") if "loss" in r]
    assert [r["step"] for r in rows] == [2, 3] and "compile_s" in rows[0] and "compile_s" not in rows[1]
    assert losses(tmp_path / "compiled") == losses(tmp_path / "eager")


def test_logged_flops_are_the_benchs_count_and_mfu_divides_by_the_cards_peak(monkeypatch):
    """The training log's model FLOPs (train.loop.flop_counter, on the host's blocks) are train.bench's count for
    the same blocks plus the tapped target layers; on CUDA the step row's mfu divides by the bench's peak."""
    from types import SimpleNamespace

    from models.config import DFlashConfig
    from models.target import TargetModel
    from models.tiny import tiny_target
    from train.bench import step_flops
    from train.config import load_config
    from train.flops import PEAK_BF16_TFLOPS, tapped_parameters
    from train.loop import flop_counter, utilisation

    target = TargetModel(tiny_target("qwen3"))
    cfg = DFlashConfig.for_target(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                                  num_target_layers=target.num_layers, mask_token_id=target.vocab_size - 1,
                                  num_hidden_layers=2, num_taps=3, block_size=8)
    ids, lm, doc, pos = _packed_rows(2, 96, seed=3)
    blocks = draw_blocks(ids, lm, doc, pos, 6, 8, cfg.mask_token_id, torch.Generator().manual_seed(0))
    a = SimpleNamespace(hidden=cfg.hidden_size, layers=2, heads=cfg.num_attention_heads,
                        kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate_size,
                        taps=3, vocab=cfg.vocab_size, block=8, seq=96, batch=2)
    drafter_only = step_flops(a, blocks, int(blocks.scored_index.numel()))
    online = flop_counter(load_config(["recipe=tiny"]), cfg, target)
    offline = flop_counter(load_config(["recipe=tiny", "features.mode=offline", "features.store=/unused"]), cfg,
                           target)
    assert offline(blocks, 192) == drafter_only > 0
    assert online(blocks, 192) == drafter_only + 2 * tapped_parameters(target, cfg.target_layer_ids) * 192
    assert tapped_parameters(target, [1, 3]) == sum(p.numel() for p in target.layers[:4].parameters())

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    gpu = SimpleNamespace(device=torch.device("cuda", 0), world=2)
    assert utilisation(gpu, 1.0e15) == {"tflops": 1000.0, "mfu": round(500 / PEAK_BF16_TFLOPS["H100"], 4)}
    assert utilisation(SimpleNamespace(device=torch.device("cpu"), world=1), 1.0e15) == {}


@pytest.mark.parametrize("s,block,anchors", [
    (128, 4, list(range(1, 100, 3))),  # 33 blocks: the last query tile and the last key tile hold one block
    (256, 16, [130, 140, 150, 160, 170, 180, 190, 200, 210]),  # 9 blocks: 16 real queries in the last tile
])
def test_direct_block_mask_on_ragged_tiles(s, block, anchors):
    """A ragged last tile (queries or keys past the end) whose real pairs are all visible is still a
    partial tile for create_block_mask (it pads the mask with False), so the direct mask must not call
    it full. Both cases have such a tile: the last block against its own keys, and a last query tile
    whose one block sees all of context tile 0."""
    from train.blocks import build_blocks

    ids = torch.randint(0, 90, (1, s), generator=torch.Generator().manual_seed(0))
    lm, doc, pos = torch.ones(1, s, dtype=torch.long), torch.zeros(1, s, dtype=torch.long), torch.arange(s)[None]
    a = torch.tensor([anchors])
    blocks = build_blocks(ids, lm, doc, pos, a, torch.ones_like(a, dtype=torch.bool), block, 95)
    _same_as_create_block_mask(blocks, doc, block)


def bench_lines(capsys, module: str, argv: list[str]) -> list[dict]:
    import importlib
    import json

    importlib.import_module(f"{module}.bench").main(argv)
    return [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]


def test_train_bench_profiles_one_more_step(capsys):
    lines = bench_lines(capsys, "train", ["--e2e", "tiny", "--steps", "1", "--warmup", "0", "--seq", "64",
                                          "--anchors", "4", "--profile", "2"])
    assert [x["bench"] for x in lines] == ["train_e2e", "train_parts", "profile"]
    assert lines[-1]["what"] == "train_e2e" and len(lines[-1]["ops"]) == 2
    prof, step_ms = lines[-1], lines[0]["step_s"] * 1e3
    # step_s is rounded to 0.1 ms in its row
    assert prof["busy_share"] == pytest.approx(prof["total_ms_per_call"] / step_ms, rel=0.05)


def test_train_bench_steps_the_optimizer_once_per_grad_accum_micro_batches(capsys, monkeypatch):
    """--grad-accum 3: three forward + backward passes per AdamW step, each with its own blocks (the
    FLOPs and tokens count all three); --e2e takes the recipe's train.grad_accum unless given."""
    import models.random_target
    from models.drafter import DFlashDraftModel

    seen = {"steps": 0, "forwards": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(torch.optim.AdamW, "step", counted("steps", torch.optim.AdamW.step))
    monkeypatch.setattr(DFlashDraftModel, "forward", counted("forwards", DFlashDraftModel.forward))
    argv = ["--e2e", "tiny", "--steps", "2", "--warmup", "0", "--seq", "64", "--anchors", "4"]
    one = bench_lines(capsys, "train", argv)[0]
    assert one["grad_accum"] == 1 and seen == {"steps": 2 + 1, "forwards": 2 + 1}  # + the parts line's one step
    seen.update(steps=0, forwards=0)
    three = bench_lines(capsys, "train", argv + ["--grad-accum", "3"])[0]
    assert three["grad_accum"] == 3 and seen == {"steps": 2 + 1, "forwards": 6 + 1}
    assert three["tflops"] > 0 and three["anchors_per_s"] > 0

    recipe = models.random_target.recipe_spec("tiny")
    recipe["train"]["grad_accum"] = 2
    monkeypatch.setattr(models.random_target, "recipe_spec", lambda name: recipe)
    assert bench_lines(capsys, "train", argv)[0]["grad_accum"] == 2


@pytest.mark.parametrize("mixer,fused", [("fused", True), ("own", False)])
def test_train_bench_compiles_a_hybrid_target_with_the_mixer_asked_for(capsys, monkeypatch, mixer, fused):
    """--target-mixer: the before/after of the fused GatedDeltaNet mixer in one flag, named in the row."""
    import models.random_target
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import tiny_target

    asked = []
    monkeypatch.setattr(models.random_target, "recipe_target", lambda *a, **k: TargetModel(tiny_target("qwen3_5")))
    monkeypatch.setattr(TargetModel, "compile_layers", lambda self, fuse_mixer=True: asked.append(fuse_mixer))
    monkeypatch.setattr(DFlashDraftModel, "compile_layers", lambda self: self)
    lines = bench_lines(capsys, "train", ["--e2e", "tiny", "--steps", "1", "--warmup", "0", "--seq", "64",
                                          "--anchors", "4", "--compile", "--target-mixer", mixer])
    assert asked == [fused] and lines[0]["target_mixer"] == mixer
