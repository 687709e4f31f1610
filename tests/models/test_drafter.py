"""The torch drafter against a deliberately naive reference, plus its folders on disk."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import DFlashConfig
from models.drafter import DFlashDraftModel, DraftCache
from tests.helpers import assert_close

H, TAPS, V = 32, 3, 50


def make_config(**kw):
    args = dict(hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=V, num_target_layers=8, target_layer_ids=[1, 3, 5],
                mask_token_id=V - 1, block_size=8, rope_theta=10000.0, torch_dtype="float32")
    args.update(kw)
    return DFlashConfig(**args)


def random_drafter(cfg, seed=0):
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    return model.eval()


# --------------------------------------------------------------------------- naive reference
def naive_forward(sd, cfg, block_emb, ctx_feats, ctx_pos, blk_pos, visible):
    """Explicit loops over positions and heads, float64, no shared code with models/drafter.py.

    visible(t, kind, j) says whether block query t sees context key j (kind 'ctx') or block key j ('blk').
    """
    sd = {k: v.double() for k, v in sd.items()}
    eps, d = cfg.rms_norm_eps, cfg.head_dim

    def rms(x, w):
        return x / math.sqrt(float((x * x).mean()) + eps) * w

    def rope(v, pos):
        out = v.clone()
        half = d // 2
        for i in range(half):
            angle = pos * cfg.rope_theta ** (-2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            out[i] = v[i] * c - v[i + half] * s
            out[i + half] = v[i + half] * c + v[i] * s
        return out

    ctx = [rms(sd["fc.weight"] @ f.double(), sd["hidden_norm.weight"]) for f in ctx_feats]
    h = [e.double() for e in block_emb]
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    for li in range(cfg.num_hidden_layers):
        p = lambda n: sd[f"layers.{li}.{n}"]  # noqa: E731
        x = [rms(v, p("input_layernorm.weight")) for v in h]
        new_h = []
        for t in range(len(h)):
            heads = []
            for hd in range(cfg.num_attention_heads):
                kv = hd // rep
                wq = p("self_attn.q_proj.weight")[hd * d:(hd + 1) * d]
                wk = p("self_attn.k_proj.weight")[kv * d:(kv + 1) * d]
                wv = p("self_attn.v_proj.weight")[kv * d:(kv + 1) * d]
                q = rope(rms(wq @ x[t], p("self_attn.q_norm.weight")), blk_pos[t])
                keys, vals = [], []
                for j in range(len(ctx)):
                    if visible(t, "ctx", j):
                        keys.append(rope(rms(wk @ ctx[j], p("self_attn.k_norm.weight")), ctx_pos[j]))
                        vals.append(wv @ ctx[j])
                for j in range(len(h)):
                    if visible(t, "blk", j):
                        keys.append(rope(rms(wk @ x[j], p("self_attn.k_norm.weight")), blk_pos[j]))
                        vals.append(wv @ x[j])
                scores = torch.stack([q @ k / math.sqrt(d) for k in keys])
                probs = torch.softmax(scores, 0)
                heads.append(sum(pr * v for pr, v in zip(probs, vals)))
            attn = p("self_attn.o_proj.weight") @ torch.cat(heads)
            y = h[t] + attn
            z = rms(y, p("post_attention_layernorm.weight"))
            g = p("mlp.gate_proj.weight") @ z
            mlp = p("mlp.down_proj.weight") @ (g * torch.sigmoid(g) * (p("mlp.up_proj.weight") @ z))
            new_h.append(y + mlp)
        h = new_h
    return torch.stack([rms(v, sd["norm.weight"]) for v in h])


def inputs(c=7, q=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, q, H, generator=g), torch.randn(1, c, TAPS * H, generator=g)


def test_forward_matches_naive_reference():
    cfg = make_config()
    model = random_drafter(cfg)
    emb, feats = inputs()
    pos = torch.arange(15)[None]
    out = model(emb, feats, pos)
    ref = naive_forward(model.state_dict(), cfg, emb[0], feats[0], list(range(7)), list(range(7, 15)),
                        lambda t, kind, j: True)
    assert_close(out[0], ref, atol=1e-5, what="drafter vs naive reference")


def test_block_is_non_causal_and_context_is_injected():
    model = random_drafter(make_config())
    emb, feats = inputs()
    pos = torch.arange(15)[None]
    base = model(emb, feats, pos)
    later = emb.clone()
    later[0, 6] += 1.0  # change a later block token
    assert (model(later, feats, pos)[0, 1] - base[0, 1]).abs().max() > 1e-3, "slot 1 ignores later slots"
    ctx = feats.clone()
    ctx[0, 2] += 1.0
    assert (model(emb, ctx, pos)[0, 0] - base[0, 0]).abs().max() > 1e-3, "context features are not injected"


@pytest.mark.parametrize("layers", ["full", "sliding"])
def test_context_after_the_block_start_is_not_seen(layers):
    """Training layout: the whole sequence is context, a mask hides positions at or after the anchor.
    Sliding layers use the given mask as is (the window here is wider than the row)."""
    kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=64) if layers == "sliding" else {}
    cfg = make_config(**kw)
    model = random_drafter(cfg)
    emb, feats = inputs(c=12)
    anchor = 6
    pos = torch.cat([torch.arange(12), torch.arange(anchor, anchor + 8)])[None]
    mask = torch.zeros(1, 1, 8, 12 + 8, dtype=torch.bool)
    mask[..., :anchor] = True
    mask[..., 12:] = True
    out = model(emb, feats, pos, attention_mask=mask)
    tampered = feats.clone()
    tampered[0, anchor:] = torch.randn(12 - anchor, TAPS * H)
    assert_close(model(emb, tampered, pos, attention_mask=mask), out, atol=0, what="masked-off context")
    short = model(emb, feats[:, :anchor], torch.cat([torch.arange(anchor), torch.arange(anchor, anchor + 8)])[None])
    assert_close(out, short, atol=1e-5, what="masked vs truncated context")


def test_cache_holds_committed_context_and_matches_a_full_pass():
    model = random_drafter(make_config())
    emb, feats = inputs(c=13)
    cache = DraftCache(2)
    model(emb, feats[:, :10], torch.arange(18)[None], cache=cache)  # context 0..9, block at 10..17
    assert cache.lengths() == [10, 10]
    step = model(emb, feats[:, 10:], torch.cat([torch.arange(10, 13), torch.arange(13, 21)])[None], cache=cache)
    assert cache.lengths() == [13, 13]
    full = model(emb, feats, torch.arange(21)[None])
    assert_close(step, full, atol=1e-5, what="cached vs full context")


def test_draft_cache_keeps_every_position_when_it_grows():
    """The cache grows in steps of 256 positions: what it held must survive each growth (a prompt and
    a few cycles stay inside the first step, so the loop tests never grew it)."""
    g = torch.Generator().manual_seed(0)
    cache, chunks = DraftCache(1), []
    for n in (200, 100, 7, 300):  # grows at 300 and at 607 positions
        k, v = torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)
        chunks.append((k, v))
        keys, values = cache.append(0, k, v)
    assert cache.lengths() == [607] and cache.keys[0].shape[-2] == 768
    assert torch.equal(keys, torch.cat([k for k, _ in chunks], dim=-2))
    assert torch.equal(values, torch.cat([v for _, v in chunks], dim=-2))

    model = random_drafter(make_config())  # and a draft through a grown cache is the uncached draft
    emb, feats = inputs(c=300, q=8)
    cache = DraftCache(2)
    model(emb, feats[:, :250], torch.arange(258)[None], cache=cache)
    step = model(emb, feats[:, 250:], torch.arange(250, 308)[None], cache=cache)
    assert cache.lengths() == [300, 300]
    assert_close(step, model(emb, feats, torch.arange(308)[None]), atol=1e-5, what="grown cache vs full context")


def test_draft_cache_grows_only_when_full_and_lengths_are_a_snapshot():
    """Filling the storage exactly to a step leaves it as it is (growing one position early would double
    a long prompt's cache), and ``lengths()`` is a copy a later append does not change."""
    cache = DraftCache(1)
    cache.append(0, torch.zeros(1, 2, 250, 4), torch.zeros(1, 2, 250, 4))
    before, storage = cache.lengths(), cache.keys[0]
    cache.append(0, torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4))
    assert cache.keys[0] is storage and cache.lengths() == [256]  # written in place, not copied
    assert before == [250]
    cache.append(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert cache.keys[0].shape[-2] == 512 and len(cache) == 257


def test_norm_accumulates_in_float32():
    """fp16 activations of a few hundred square past fp16's range (65504): the norm must still scale them to
    unit RMS instead of dividing by infinity."""
    from models.drafter import RMSNorm

    x = torch.full((1, 2, 8), 300.0, dtype=torch.float16)
    x[0, 1] = -500.0
    out = RMSNorm(8).half()(x)
    assert out.dtype == torch.float16
    assert_close(out, torch.tensor([[[1.0] * 8, [-1.0] * 8]]), atol=1e-3, what="fp16 norm of large values")


def test_bf16_drafter_runs_in_bf16_and_matches_fp32():
    """RoPE tables follow the activations' dtype: a bf16 drafter's queries and keys stay bf16."""
    model = random_drafter(make_config())
    emb, feats = inputs()
    pos = torch.arange(15)[None]
    full = model(emb, feats, pos)
    half = model.to(torch.bfloat16)(emb.bfloat16(), feats.bfloat16(), pos)
    assert half.dtype == torch.bfloat16
    assert_close(half, full, atol=0.15, what="bf16 vs fp32 drafter")


def test_rows_of_a_batch_are_drafted_independently_with_sliding_layers():
    """The inference sliding mask is per row (``[b, 1, q, k]``): two rows at once give each row's own result."""
    cfg = make_config(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    model = random_drafter(cfg)
    (e1, f1), (e2, f2) = inputs(seed=1), inputs(seed=2)
    pos = torch.arange(15)[None]
    both = model(torch.cat([e1, e2]), torch.cat([f1, f2]), pos.expand(2, -1))
    assert_close(both[:1], model(e1, f1, pos), atol=1e-5, what="row 0 of a batch")
    assert_close(both[1:], model(e2, f2, pos), atol=1e-5, what="row 1 of a batch")


def test_init_weights_draws_linears_at_the_given_std_and_keeps_norms_at_one():
    cfg = make_config()
    for std in (0.02, 0.1):
        torch.manual_seed(0)
        model = DFlashDraftModel(cfg).init_weights(std) if std != 0.02 else DFlashDraftModel(cfg).init_weights()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                assert torch.equal(p, torch.ones_like(p)), name
            else:
                assert abs(p.std().item() / std - 1) < 0.1 and abs(p.mean().item()) < std / 5, name


def test_compile_layers_compiles_each_decoder_layer(monkeypatch):
    """Each layer, not the model (gradient checkpointing wraps layers); the forward is unchanged."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **kw: compiled.append(fn) or fn)
    model = random_drafter(make_config())
    emb, feats = inputs()
    pos = torch.arange(15)[None]
    eager = model(emb, feats, pos)
    assert model.compile_layers() is model
    assert [fn.__self__ for fn in compiled] == list(model.layers)
    assert_close(model(emb, feats, pos), eager, atol=0, what="compiled layers")


def test_gradient_checkpointing_applies_only_in_training_mode(monkeypatch):
    """An eval forward with gradients on (the simulated-acceptance eval) keeps activations: no recompute."""
    import models.drafter

    model = random_drafter(make_config())
    model.gradient_checkpointing = True
    emb, feats = inputs()
    calls, real = [], models.drafter.checkpoint
    monkeypatch.setattr(models.drafter, "checkpoint", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    model.eval()(emb, feats, torch.arange(15)[None])
    assert calls == []
    model.train()(emb, feats, torch.arange(15)[None])
    assert len(calls) == 2  # one per layer


# Running uncompiled off CUDA is the point here: torch's advice to compile it is expected.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("head_dim", [8, 16])
def test_flex_attention_off_cuda_runs_eager_with_grouped_heads(monkeypatch, head_dim):
    """Off CUDA the BlockMask path runs flex attention eagerly (no compiled kernel), with 4 query heads
    sharing 2 key/value heads, and equals SDPA under the same dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    import models.drafter
    from models.drafter import attend

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, head_dim, generator=g)
    k, v = torch.randn(1, 2, 20, head_dim, generator=g), torch.randn(1, 2, 20, head_dim, generator=g)
    keep = lambda b, h, qi, ki: (ki < 6) | (ki >= 12)  # noqa: E731  (context before the anchor, then the block)
    block_mask = create_block_mask(keep, None, None, 8, 20, device="cpu")
    dense = keep(0, 0, torch.arange(8)[:, None], torch.arange(20)[None])[None, None]
    monkeypatch.setattr(models.drafter, "_COMPILED_FLEX", None)
    assert_close(attend(q, k, v, block_mask), attend(q, k, v, dense), atol=1e-5, what="flex vs dense attention")
    assert models.drafter._COMPILED_FLEX is None, "flex attention compiled off CUDA"


@pytest.mark.parametrize("mode", ["bidirectional", "causal"])
def test_sliding_layers_match_the_reference(mode):
    window = 4
    cfg = make_config(layer_types=["sliding_attention", "sliding_attention"], sliding_window=window,
                      sliding_block_attention=mode)
    model = random_drafter(cfg)
    emb, feats = inputs()
    ctx_pos, blk_pos = list(range(7)), list(range(7, 15))

    def visible(t, kind, j):
        if kind == "ctx":
            return blk_pos[t] - ctx_pos[j] < window
        return mode == "bidirectional" or j <= t

    out = model(emb, feats, torch.arange(15)[None])
    ref = naive_forward(model.state_dict(), cfg, emb[0], feats[0], ctx_pos, blk_pos, visible)
    assert_close(out[0], ref, atol=1e-5, what=f"sliding ({mode})")
    assert cfg.to_dict()["dflash_config"]["sliding_block_attention"] == mode
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg


# --------------------------------------------------------------------------- folders on disk
def test_save_and_reload_is_bit_exact(tmp_path):
    model = random_drafter(make_config())
    model.save_pretrained(tmp_path)
    assert (tmp_path / "modeling_dflash.py").is_file()
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert keys == set(model.state_dict()) and not any("embed" in k or "lm_head" in k for k in keys)
    again = DFlashDraftModel.from_pretrained(tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    assert again.config == model.config


def test_sharded_save_reloads(tmp_path):
    model = random_drafter(make_config())
    model.save_pretrained(tmp_path, max_shard_size=20_000)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    again = DFlashDraftModel.from_pretrained(tmp_path)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


def test_bf16_folder_loads_in_its_dtype(tmp_path):
    model = random_drafter(make_config())
    model.save_pretrained(tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = DFlashDraftModel.from_pretrained(tmp_path)
    assert again.fc.weight.dtype == torch.bfloat16
    assert torch.equal(again.fc.weight, model.fc.weight.to(torch.bfloat16))


def test_load_dtype_is_the_argument_then_config_then_the_tensors(tmp_path):
    model = random_drafter(make_config())
    model.save_pretrained(tmp_path, dtype=torch.bfloat16)
    assert DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float16).fc.weight.dtype == torch.float16
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["torch_dtype"] = "float32"  # bf16 tensors in a folder whose config says float32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert DFlashDraftModel.from_pretrained(tmp_path).fc.weight.dtype == torch.float32
    cfg["torch_dtype"] = "auto"  # no dtype name: the tensors' own
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    again = DFlashDraftModel.from_pretrained(tmp_path)
    assert again.fc.weight.dtype == torch.bfloat16 and not again.training


def test_missing_tensor_is_an_error_listing_it(tmp_path):
    random_drafter(make_config()).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_truncated_file_is_a_clear_error(tmp_path):
    random_drafter(make_config()).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_stray_embedding_and_head_are_dropped_with_a_warning(tmp_path, caplog):
    model = random_drafter(make_config())
    model.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["embed_tokens.weight"] = torch.zeros(V, H)
    state["lm_head.weight"] = torch.zeros(V, H)
    save_file(state, str(tmp_path / "model.safetensors"))
    again = DFlashDraftModel.from_pretrained(tmp_path)
    assert "dropping ['embed_tokens.weight', 'lm_head.weight']" in caplog.text
    assert torch.equal(again.fc.weight, model.fc.weight)


def test_stray_keys_are_the_targets_embedding_and_head_under_any_prefix_only():
    """``model.embed_tokens`` (a prefixed export) is the target's; a name that merely contains the words
    (``old_lm_head``, ``lm_head_gate``) is not, and a state without stray keys is left as it is."""
    from models.weights import drop_stray_keys

    keep = {"fc.weight": 1, "layers.0.old_lm_head.weight": 2, "layers.0.lm_head_gate.weight": 3, "embed_tokens": 4}
    state = {**keep, "model.embed_tokens.weight": 5, "lm_head.weight": 6, "model.lm_head.bias": 7}
    assert drop_stray_keys(state, "here") == keep
    assert drop_stray_keys(dict(keep), "here") == keep


def test_fc_width_mismatch_names_the_taps(tmp_path):
    random_drafter(make_config()).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 3, 5, 6]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="fc input width = taps x hidden = 4 x 32"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_not_a_folder_nor_hub_id():
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a Hub id"):
        DFlashDraftModel.from_pretrained("/no/such/dir")


def test_hub_id_goes_through_snapshot_download(monkeypatch, tmp_path):
    random_drafter(make_config()).save_pretrained(tmp_path)
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision))
        return str(tmp_path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    DFlashDraftModel.from_pretrained("some-org/some-drafter", revision="main")
    assert calls == [("some-org/some-drafter", "main")]


def test_shipped_modeling_file_loads_with_automodel_and_matches(tmp_path):
    from transformers import AutoModel

    model = random_drafter(make_config())
    model.save_pretrained(tmp_path)
    hf = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    emb, feats = inputs()
    pos = torch.arange(15)[None]
    with torch.no_grad():
        assert_close(hf(emb, feats, pos), model(emb, feats, pos), atol=1e-5, what="shipped modeling file")
