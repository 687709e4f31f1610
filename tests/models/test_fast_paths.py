"""Speed paths of this stage held to their plain counterparts (same results, CPU): no timing is checked."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import assert_close


def test_qwen35_on_cuda_without_fla_warns_once_with_the_install_command(monkeypatch, caplog):
    import importlib.util

    from models.target import warn_if_slow_linear_attention

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real(name, *a))
    warn_if_slow_linear_attention("qwen3_5", torch.device("cuda"))
    warn_if_slow_linear_attention("qwen3", torch.device("cuda"))  # no GatedDeltaNet: nothing to say
    warn_if_slow_linear_attention("qwen3_5", torch.device("cpu"))  # the CPU has no such kernels anyway
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pip install 'draftsmith[cuda]'" in lines[0] and "\n" not in lines[0]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl"])
def test_compiled_target_layers_give_the_eager_taps(arch):
    """train.compile=true compiles the target's layers: the taps are unchanged, one graph serves every
    layer, varying row lengths stop recompiling after the first new length, and passes that fill a
    cache (held-out generation) stay eager."""
    from inference.torch_loop import target_generate
    from models.target import TargetModel
    from models.tiny import tiny_target

    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):  # the graphs dynamo hands to a compiler, run as traced
        graphs.append(gm)
        return gm.forward

    eager = TargetModel(tiny_target(arch))
    compiled = TargetModel(tiny_target(arch)).compile_layers(backend=counting_backend)
    # a whole full-attention layer; a GatedDeltaNet layer's two halves around its chunked kernel
    # (models.gated_deltanet)
    kinds = 3 if compiled.is_hybrid else 1
    joined = [getattr(m, "in_proj_joined", None) is not None for _, m in compiled.linear_attention_modules()]
    assert joined == [True] * len(joined) and (len(joined) > 0) == compiled.is_hybrid
    rows = [torch.randint(0, 250, (2, n), generator=torch.Generator().manual_seed(n)) for n in (17, 29, 40, 33)]
    for i, ids in enumerate(rows):
        for with_logits in (False, True):
            ref = eager.forward(ids, [1, 3, 5], with_logits=with_logits)
            got = compiled.forward(ids, [1, 3, 5], with_logits=with_logits)
            what = f"{arch} compiled taps, length {ids.shape[1]}"
            if not compiled.is_hybrid:
                assert_close(got.features, ref.features, atol=1e-5, what=what)
                if with_logits:
                    assert_close(got.logits, ref.logits, atol=1e-4, what=f"{arch} compiled logits")
                continue
            # The fused GatedDeltaNet conv sums its four taps in another order than the layer's conv (with
            # the layer's conv it is bit-exact): an fp32 rounding that these random layers grow ~2x each,
            # ~1e-4 at the sixth (taps up to |5|). Held to a relative error over the whole tensor
            # (measured <= 5.4e-6); a wrong tap, layer or gate is off by O(1) in that measure.
            pairs = [(got.features, ref.features)] + ([(got.logits, ref.logits)] if with_logits else [])
            for a, e in pairs:
                rel = ((a - e).double().norm() / e.double().norm()).item()
                assert a.shape == e.shape and rel < 3e-5, f"{what}: relative error {rel:.2e}"
        # First length: one static graph per kind of layer; second: one dynamic one; then none.
        assert len(graphs) == kinds * min(i + 1, 2), (arch, i, len(graphs))
    before = len(graphs)
    prompt = rows[0][0, :6].tolist()
    assert (target_generate(compiled, prompt, 6, eos_token_ids=[]).tokens
            == target_generate(eager, prompt, 6, eos_token_ids=[]).tokens)
    assert len(graphs) == before, "a pass with a cache was compiled"


def test_compiled_target_spread_over_devices_runs_each_layers_dispatch_hook(monkeypatch):
    """target.device_map with train.compile=true: accelerate's hook on each layer moves the layer's inputs to
    its GPU, and a fused GatedDeltaNet layer replaces the forward that ran the hook, so it runs the hook
    itself (CPU "devices" here, as in test_scale_out): once per pass and layer, before and after, and the
    taps and logits are the whole target's."""
    from accelerate import dispatch_model

    from models.target import TargetModel
    from models.tiny import tiny_target

    torch._dynamo.reset()
    whole = TargetModel(tiny_target("qwen3_5", num_layers=4))  # three GatedDeltaNet layers, one attention layer
    model = tiny_target("qwen3_5", num_layers=4)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" for i in range(len(model.model.layers))}}
    dispatch_model(model, device_map=device_map, force_hooks=True)
    spread = TargetModel(model).compile_layers(backend=lambda gm, example_inputs: gm.forward)
    seen = []
    for i, _ in spread.linear_attention_modules():  # the attention layers' hooks run inside their compiled forward
        hook = spread.layers[i]._hf_hook
        for when in ("pre_forward", "post_forward"):
            def counted(*args, _real=getattr(hook, when), _tag=(i, when), **kwargs):
                seen.append(_tag)
                return _real(*args, **kwargs)
            monkeypatch.setattr(hook, when, counted)
    ids = torch.randint(0, 250, (2, 23), generator=torch.Generator().manual_seed(3))
    got, ref = spread.forward(ids, [0, 2]), whole.forward(ids, [0, 2])
    fused = [i for i, _ in spread.linear_attention_modules()]
    assert seen == [(i, when) for i in fused for when in ("pre_forward", "post_forward")]
    for a, e in ((got.features, ref.features), (got.logits, ref.logits)):
        rel = ((a - e).double().norm() / e.double().norm()).item()
        assert a.shape == e.shape and rel < 3e-5, f"relative error {rel:.2e}"


def test_top_ops_counts_each_op_once_per_call():
    from models.support import top_ops

    a = torch.randn(64, 64)
    prof = top_ops(lambda: torch.mm(a, a).relu_(), n=2, calls=4)
    assert prof["clock"] == "cpu" and prof["calls"] == 4 and len(prof["ops"]) == 2
    mm = next(op for op in prof["ops"] if op["name"] == "aten::mm")
    assert mm["count_per_call"] == 1.0 and 0 < mm["share"] <= 1
    assert [op["ms_per_call"] for op in prof["ops"]] == sorted((op["ms_per_call"] for op in prof["ops"]), reverse=True)
    assert sum(op["ms_per_call"] for op in prof["ops"]) <= prof["total_ms_per_call"] + 1e-3


def test_flex_backward_settings_become_backward_only_kernel_options(monkeypatch):
    """auto: the measured tiles for (capability, head_dim) where there are some, else torch's; the
    options carry the bwd_ prefix so the forward keeps torch's tiles; a CPU run never gets options."""
    from models import flex_options as fo

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fo, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(fo, "TUNED", {((9, 0), 256): (32, 64, 64, 32, 2, 4)})
    assert fo.resolve_tiles("auto", cuda, 256) == (32, 64, 64, 32, 2, 4)
    assert fo.resolve_tiles("auto", cuda, 128) is None  # not measured: torch's choice
    assert fo.resolve_tiles("torch", cuda, 256) is None
    assert fo.resolve_tiles(fo.parse_flex_backward("64,128,128,64,3,8"), cuda, 256) == (64, 128, 128, 64, 3, 8)
    assert fo.resolve_tiles(fo.parse_flex_backward("64,128,128,64,3,8"), torch.device("cpu"), 256) is None
    assert fo.kernel_options((32, 64, 64, 32, 2, 4)) == {
        "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_stages": 2,
        "bwd_num_warps": 4}
    assert fo.kernel_options(None) is None
    assert fo.format_tiles((32, 64, 64, 32, 2, 4)) == "32,64,64,32,2,4" and fo.format_tiles(None) == "torch"


def test_the_drafter_hands_its_tiles_to_every_attention_layer(monkeypatch):
    from models import flex_options as fo
    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel

    monkeypatch.setattr(fo, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(fo, "TUNED", {((9, 0), 16): (16, 32, 32, 16, 1, 4)})
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=40, num_target_layers=4, target_layer_ids=[1],
                       mask_token_id=39, block_size=4)
    d = DFlashDraftModel(cfg)
    assert d.flex_backward == "auto"
    d._set_flex_tiles(torch.device("cuda", 0))
    assert [layer.self_attn.flex_kernel_options["bwd_BLOCK_N1"] for layer in d.layers] == [32, 32, 32]
    d.set_flex_backward("torch")._set_flex_tiles(torch.device("cuda", 0))
    assert [layer.self_attn.flex_kernel_options for layer in d.layers] == [None, None, None]
    assert d.set_flex_backward("64,64,64,64,2,8").flex_backward == (64, 64, 64, 64, 2, 8)


def test_causal_conv_silu_equals_a_padded_depthwise_conv():
    """The fused mixer's conv (shifted multiply-adds on [batch, time, channels]) against nn.Conv1d's
    own padded depthwise conv on [batch, channels, time], kernel 4 and 2, with and without a bias."""
    import torch.nn.functional as F

    from models.gated_deltanet import causal_conv_silu

    g = torch.Generator().manual_seed(0)
    for kernel, bias in ((4, False), (2, True)):
        conv = torch.nn.Conv1d(12, 12, kernel, groups=12, padding=kernel - 1, bias=bias)
        x = torch.randn(3, 9, 12, generator=g)
        ref = F.silu(conv(x.transpose(1, 2))[:, :, :9]).transpose(1, 2)
        assert_close(causal_conv_silu(x, conv.weight, conv.bias), ref, atol=1e-6, what=f"kernel {kernel}")
        # causal: the first output sees only the first input
        moved = x.clone()
        moved[:, 1:] += 1
        assert_close(causal_conv_silu(moved, conv.weight, conv.bias)[:, 0], ref[:, 0], atol=1e-6, what="causal")


@pytest.mark.parametrize("arch,dtype,atol", [("qwen3_5", torch.float32, 5e-6), ("qwen3_5", torch.bfloat16, 3e-2),
                                             ("qwen3_5_moe", torch.float32, 5e-6)])
def test_fused_gated_deltanet_layer_equals_the_layer(arch, dtype, atol, caplog, monkeypatch):
    """models.gated_deltanet's two halves around the chunked kernel give the transformers decoder layer's
    output, grouped value heads (2 q/k heads for 4 v heads) and a padding mask included, with the four
    input projections separate and joined into one weight; a pass with a cache or packed sequences runs
    the layer's own forward."""
    from models import gated_deltanet as gdn
    from models.tiny import tiny_target

    target = tiny_target(arch).to(dtype)
    layer = target.model.layers[0]
    mixer = layer.linear_attn
    assert mixer.num_v_heads == 2 * mixer.num_k_heads and gdn.fusable(layer)
    x = torch.randn(2, 70, target.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :9] = 0  # left padding
    call = dict(position_embeddings=None)  # a linear-attention layer takes them and ignores them
    refs = {m is not None: layer(x, attention_mask=m, **call) for m in (None, mask)}
    for joined in (False, True):
        if joined:
            assert gdn.join_input_projections(mixer) and mixer.in_proj_joined.shape[0] == sum(
                p.out_features for p in (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a))
            # the layer's own forward (a pass with a cache) reads the same weights, now views of the joined one
            start = mixer.in_proj_joined.data_ptr()
            assert mixer.in_proj_a.weight.data_ptr() > mixer.in_proj_qkv.weight.data_ptr() == start
            assert "in_proj_joined" not in layer.state_dict()
            assert torch.equal(layer(x, attention_mask=mask, **call), refs[True])
        fused = gdn.uncached_forward(layer, gdn.layer_inputs, gdn.layer_output)
        for m in (None, mask):
            got = fused(x, attention_mask=m, use_cache=False, cache=None, position_ids=None)
            assert_close(got.float(), refs[m is not None].float(), atol=atol,
                         what=f"{dtype} fused layer, mask {m is not None}, joined {joined}")
            assert got.dtype == x.dtype
        # with the layer's own conv in place of the shifted sums the rest is the layer's math to the bit; the
        # joined matmul's products are the same, but the CPU's GEMM blocks a wider weight another way
        own = gdn.uncached_forward(layer, _with_conv1d(gdn.layer_inputs), gdn.layer_output)(x, attention_mask=mask)
        if joined:
            assert_close(own.float(), refs[True].float(), atol=atol, what=f"{dtype} joined, the layer's conv")
        else:
            assert torch.equal(own, refs[True])

    calls = []
    layer.forward = lambda *a, **k: calls.append(sorted(k)) or "own"
    fused = gdn.uncached_forward(layer, gdn.layer_inputs, gdn.layer_output)
    monkeypatch.setattr(gdn, "_SAID", set())  # said once per process: this test's own count
    with caplog.at_level(logging.WARNING, logger="models.gated_deltanet"):
        assert fused(hidden_states=x, cache=object()) == "own"
        assert fused(x, past_key_values=object()) == "own"
        assert not caplog.records  # a cached pass is expected to take the layer's own forward: nothing said
        for _ in range(2):
            assert fused(hidden_states=x, cu_seq_lens_q=torch.tensor([0, 70])) == "own"
            assert fused(x, object()) == "own"
    assert len(calls) == 6
    # said once per kind of call, naming what sent it there
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "cu_seq_lens_q" in said[0] and "2 positional arguments" in said[1], said


def test_input_projections_are_joined_only_when_plain_linears():
    """A quantized or biased projection keeps its four matmuls (join_input_projections says False and
    changes nothing); joining twice keeps the first joined weight."""
    from models import gated_deltanet as gdn
    from models.tiny import tiny_target

    mixer = tiny_target("qwen3_5").model.layers[0].linear_attn
    before = mixer.in_proj_b.weight
    mixer.in_proj_b = torch.nn.Linear(before.shape[1], before.shape[0], bias=True)
    assert not gdn.join_input_projections(mixer) and getattr(mixer, "in_proj_joined", None) is None

    class Quantized(torch.nn.Linear):  # a subclass (bitsandbytes' Linear4bit is one) computes its own way
        pass

    mixer = tiny_target("qwen3_5").model.layers[0].linear_attn
    mixer.in_proj_a.__class__ = Quantized
    assert not gdn.join_input_projections(mixer)
    mixer = tiny_target("qwen3_5").model.layers[0].linear_attn
    mixer.in_proj_z.to(torch.bfloat16)
    assert not gdn.join_input_projections(mixer)
    mixer = tiny_target("qwen3_5").model.layers[0].linear_attn
    assert gdn.join_input_projections(mixer)
    first = mixer.in_proj_joined
    assert gdn.join_input_projections(mixer) and mixer.in_proj_joined is first


def _with_conv1d(inputs):
    """``layer_inputs`` whose conv is the layer's own ``F.conv1d`` on the transposed projection."""
    import torch.nn.functional as F

    from models import gated_deltanet as gdn

    def conv(x, weight, bias=None):
        t, k = x.shape[1], weight.shape[-1]
        out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, bias, padding=k - 1, groups=weight.shape[0])
        return F.silu(out[:, :, :t]).transpose(1, 2).to(x.dtype)

    def patched(layer, x, mask):
        original, gdn.causal_conv_silu = gdn.causal_conv_silu, conv
        try:
            return inputs(layer, x, mask)
        finally:
            gdn.causal_conv_silu = original
    return patched


@pytest.mark.parametrize("version,grouped", [("0.6.0", True), ("0.5.1", False), ("0.4", False)])
def test_older_fla_gets_its_q_k_heads_repeated(monkeypatch, version, grouped):
    """flash-linear-attention takes q/k with fewer heads than v from 0.6 on; older versions get them
    repeated per value head, which gives the grouped math (checked on the torch reference)."""
    import sys
    import types

    from models import gated_deltanet as gdn
    from models.tiny import tiny_target

    mixer = tiny_target("qwen3_5").model.layers[0].linear_attn
    reference = gdn.chunk_kernel(mixer)  # CPU: transformers' torch reference
    seen = []

    def kernel(q, k, v, **kwargs):
        seen.append((q.shape[2], k.shape[2], v.shape[2]))
        return reference(q, k, v, **kwargs)

    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__=version))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", types.SimpleNamespace(chunk_gated_delta_rule=kernel))
    fla = gdn.fla_kernel()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 10, 2, 8, generator=g)
    v = torch.randn(1, 10, 4, 8, generator=g)
    gate, beta = -torch.rand(1, 10, 4, generator=g), torch.rand(1, 10, 4, generator=g)
    kw = dict(g=gate, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    got, _ = fla(q, k, v, **kw)
    assert seen == [(2, 2, 4) if grouped else (4, 4, 4)]
    assert_close(got, reference(q, k, v, **kw)[0], atol=1e-6, what=f"fla {version}")


def test_fused_layer_needs_its_parts_and_a_kernel():
    """A layer whose mixer lacks the parts (another transformers layout) or has another activation, a layer
    without its MLP, one offloaded to meta, or an attention layer is not run by models.gated_deltanet."""
    from models import gated_deltanet as gdn
    from models.tiny import tiny_target

    layer = tiny_target("qwen3_5").model.layers[0]
    mixer = layer.linear_attn
    assert gdn.fusable(layer)
    mixer.activation = "gelu"
    assert not gdn.fusable(layer)
    mixer.activation = "silu"
    del mixer.in_proj_z
    assert not gdn.fusable(layer)
    other = tiny_target("qwen3_5").model.layers[0]
    assert gdn.fusable(other)
    other.mlp.to("meta")
    assert not gdn.fusable(other)
    del other.mlp
    assert not gdn.fusable(other)
    attention = tiny_target("qwen3_5").model.layers[3]
    assert not hasattr(attention, "linear_attn") and not gdn.fusable(attention)
