"""CUDA-only checks (skipped without a GPU; run them on a GPU node with ``pytest tests/test_cuda.py -v``).

Flex attention's backward exists on CUDA only: there, flex and the dense SDPA path must give the
same loss *and* the same gradients. The torch DFlash loop must be lossless on CUDA in fp32, and in
bf16 it reports where (if anywhere) it first departs from target-only decoding.

Every test has a time cap (pytest-timeout, the dev extra: 120 s, more for the few that compile several
graphs), so a test that hangs fails alone and the file finishes. Shapes are tiny and each compiled
path is compiled once where one variant says what several did (the whole file is meant to run in one
device session of a few minutes; the first compile of a kind, and flash-linear-attention's autotuning,
dominate it). ``DRAFTSMITH_MEASURE_JSONL``: a file the loop-equality test appends its figures to
(lab/gpu/measure.sh reads them).
"""

import pytest
import torch

from tests.helpers import ReferenceProposer, assert_close, expected_acceptance, reference_drafts, tiny_drafter_config

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def exact_matmuls():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("sliding,head_dim", [(False, 16), (False, 8), (True, 8)])
def test_flex_backward_equals_dense_on_cuda(sliding, head_dim):
    """head_dim 16 takes the compiled flex kernel, 8 the eager fallback (the kernel needs >= 16). Sliding-window
    layers are checked on the fallback: their compiled kernel is the same kernel with another mask rule, one
    more compile for little more cover."""
    from tests.train.test_objective import MASK, B, H, _rows

    from train.blocks import attention_masks, draw_blocks
    from train.objective import block_loss, drafter_forward

    ids, lm, doc, pos = (t.cuda() for t in _rows())
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2)).cuda()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    results = {}
    for use_flex in (False, True):
        d, emb, head = _drafter(["sliding_attention", "full_attention"] if sliding else None, head_dim)
        masks = attention_masks(d.config, blocks, doc, pos, use_flex=use_flex)
        out = block_loss(drafter_forward(d, emb, blocks, feats, pos, masks), blocks, head.weight, 4.0, chunk=7)
        out.loss.backward()
        results[use_flex] = (out.loss.detach(), {n: p.grad.detach().clone() for n, p in d.named_parameters()})
    assert_close(results[True][0], results[False][0], atol=1e-5, what="flex vs dense loss (CUDA)")
    for name, grad in results[False][1].items():
        assert_close(results[True][1][name], grad, atol=1e-5, rtol=1e-4, what=f"flex vs dense grad {name}")


def _drafter(layer_types, head_dim):
    from tests.train.test_objective import MASK, B, H, V

    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel

    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=head_dim, vocab_size=V, num_target_layers=8,
                       target_layer_ids=[1, 3], mask_token_id=MASK, block_size=B, torch_dtype="float32",
                       layer_types=layer_types or [], sliding_window=6 if layer_types else None)
    d = DFlashDraftModel(cfg).cuda()
    emb, head = torch.nn.Embedding(V, H).cuda(), torch.nn.Linear(H, V, bias=False).cuda()
    d.bind_target(emb, head)
    return d, emb, head


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_torch_loop_on_cuda(tiny_targets, arch):
    from inference.torch_loop import dflash_generate, target_generate
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer

    prompt = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
    mistakes = {len(prompt) + k for k in (3, 4, 12, 30, 31, 33, 47, 50, 58)}
    for dtype in (torch.float32, torch.bfloat16):
        target = TargetModel(tiny_target(arch, dtype=dtype).cuda(), tiny_tokenizer())
        ref = target_generate(target, prompt, 80, eos_token_ids=[])
        seq = prompt + ref.tokens
        layer_ids = tiny_drafter_config(target).target_layer_ids
        res = dflash_generate(target, ReferenceProposer(seq, layer_ids, 8, 288, mistakes), prompt, 64, eos_token_ids=[])
        first = next((i for i, (a, b) in enumerate(zip(res.tokens, ref.tokens)) if a != b), None)
        print(f"{arch} {dtype}: first divergence from target-only decoding: {first}")
        if dtype == torch.float32:
            assert first is None and res.acceptance_lengths == expected_acceptance(len(prompt), 64, 8, mistakes)


def assert_same_loop(static, eager, ref_tokens, hybrid):
    """The static loop gives target-only decoding's tokens, and the eager loop's tokens and acceptance lengths.

    A hybrid target's eager loop verifies through flash-linear-attention's chunked GatedDeltaNet kernel,
    whose Triton dots run in TF32 even in fp32, while one-token decoding (fla's recurrent kernel) and the
    static loop's own GatedDeltaNet steps do not: on a near-tie of the random tiny target the eager
    loop may depart from target-only decoding (seen on an H100: token 33 of 64). There the static and
    eager loops are compared over the cycles before that departure.
    """
    assert static.tokens == ref_tokens
    if not hybrid:
        assert eager.tokens == ref_tokens
        assert static.acceptance_lengths == eager.acceptance_lengths
        return
    first = next((i for i, (a, b) in enumerate(zip(eager.tokens, ref_tokens)) if a != b), len(ref_tokens))
    done, cycles = 1, 0  # the prefill emits the first token; cycle k emits acceptance_lengths[k]
    while cycles < len(eager.acceptance_lengths) and done + eager.acceptance_lengths[cycles] <= first:
        done, cycles = done + eager.acceptance_lengths[cycles], cycles + 1
    assert cycles >= 8, f"the eager loop departs from target-only decoding at token {first}: too early to compare"
    assert static.acceptance_lengths[:cycles] == eager.acceptance_lengths[:cycles]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5"])
def test_graph_loop_equals_eager_loop_on_cuda(arch):
    """CUDA graph replay of the static loop (decode, verify, drafter block pass; and the device-resident
    greedy step and cycle) against the eager loop in fp32: same tokens as target-only decoding, same
    acceptance lengths, same drafts. Qwen3.5: the GatedDeltaNet rollback (an index into the kept
    states) inside the graphs."""
    from inference.static_loop import (
        StaticDrafterProposer,
        StaticTarget,
        resident_cycle,
        static_dflash_generate,
        static_target_generate,
    )
    from inference.torch_loop import DrafterProposer, dflash_generate, target_generate
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer

    prompt = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
    mistakes = {len(prompt) + k for k in (3, 4, 12, 30, 31, 33, 47, 50, 58)}
    target = TargetModel(tiny_target(arch).cuda(), tiny_tokenizer())
    ref = target_generate(target, prompt, 80, eos_token_ids=[])
    torch.manual_seed(1)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).cuda().eval()
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=len(prompt) + 100, block_size=8)
    assert st.graphs
    for resident in (True, False):  # one graph a step / cycle (greedy), or the passes' graphs with the host between
        assert static_target_generate(st, prompt, 64, eos_token_ids=[], resident=resident).tokens == ref.tokens[:64]
    res = static_dflash_generate(st, ReferenceProposer(prompt + ref.tokens, drafter.config.target_layer_ids, 8, 288,
                                                       mistakes), prompt, 64, eos_token_ids=[])
    assert res.tokens == ref.tokens[:64]
    assert res.acceptance_lengths == expected_acceptance(len(prompt), 64, 8, mistakes)
    planted = StaticDrafterProposer(drafter, target, st.max_len)
    reference_drafts(planted, prompt + ref.tokens, mistakes)
    res = static_dflash_generate(st, planted, prompt, 64, eos_token_ids=[])  # the device-resident cycle
    assert res.tokens == ref.tokens[:64]
    assert res.acceptance_lengths == expected_acceptance(len(prompt), 64, 8, mistakes)
    eager = dflash_generate(target, DrafterProposer(drafter, target), prompt, 64, eos_token_ids=[])
    proposer = StaticDrafterProposer(drafter, target, st.max_len)
    for resident in (True, False):
        static = static_dflash_generate(st, proposer, prompt, 64, eos_token_ids=[], resident=resident)
        assert_same_loop(static, eager, ref.tokens[:64], target.is_hybrid)
    assert st._passes[1].graph is not None and st._passes[8].graph is not None  # replayed, not eager
    assert proposer._pass.graph is not None
    assert resident_cycle(st, proposer)._graph.graph is not None and resident_cycle(st, None)._graph.graph is not None


def test_compiled_flex_over_varying_row_lengths_equals_dense():
    """Training shapes change every batch (row length, anchor count): the compiled flex kernel, with
    dynamic shapes after the first change, keeps matching the dense path on each new shape."""
    from train.blocks import attention_masks, draw_blocks
    from train.objective import block_loss, drafter_forward

    for s, n in ((40, 6), (56, 9), (72, 12)):  # a static compile, the dynamic one, a shape it serves
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, 60, (2, s), generator=g).cuda()
        lm = torch.ones_like(ids)
        lm[:, : s // 4] = 0
        doc = torch.zeros_like(ids)
        pos = torch.arange(s, device="cuda").expand(2, s)
        feats = torch.randn(2, s, 2 * 32, generator=g).cuda()
        blocks = draw_blocks(ids, lm, doc, pos, n, 4, 63, torch.Generator().manual_seed(0))
        results = {}
        for use_flex in (False, True):
            d, emb, head = _drafter(None, 16)
            masks = attention_masks(d.config, blocks, doc, pos, use_flex=use_flex)
            out = block_loss(drafter_forward(d, emb, blocks, feats, pos, masks), blocks, head.weight, 4.0)
            out.loss.backward()
            results[use_flex] = (out.loss.detach(), [p.grad.clone() for p in d.parameters()])
        assert_close(results[True][0], results[False][0], atol=1e-5, what=f"flex vs dense loss, s={s}")
        for a, b in zip(results[True][1], results[False][1]):
            assert_close(a, b, atol=1e-5, rtol=1e-4, what=f"flex vs dense grad, s={s}")


def test_fused_adamw_step_equals_the_reference_step():
    """distill.py and train.bench use AdamW(fused=True) on CUDA: same update as the for-loop kernel."""
    torch.manual_seed(0)
    params = [torch.randn(64, 32, device="cuda"), torch.randn(32, device="cuda")]
    grads = [torch.randn_like(p) for p in params]
    out = {}
    for fused in (False, True):
        ps = [p.clone().requires_grad_(True) for p in params]
        opt = torch.optim.AdamW(ps, lr=6e-4, weight_decay=0.01, fused=fused, foreach=False if not fused else None)
        for _ in range(3):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
        out[fused] = [p.detach() for p in ps]
    for a, b in zip(out[True], out[False]):
        assert_close(a, b, atol=1e-6, rtol=1e-5, what="fused vs reference AdamW")


def test_compiled_drafter_layers_equal_eager():
    """train.compile=true: the compiled layers give the eager layers' loss and gradients (flex masks,
    with and without gradient checkpointing)."""
    from tests.train.test_objective import MASK, B, H, _rows

    from train.blocks import attention_masks, draw_blocks
    from train.objective import block_loss, drafter_forward

    ids, lm, doc, pos = (t.cuda() for t in _rows())
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2)).cuda()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    for checkpointing in (False, True):
        results = {}
        for compiled in (False, True):
            d, emb, head = _drafter(None, 16)
            d.train().gradient_checkpointing = checkpointing
            if compiled:
                d.compile_layers()
            masks = attention_masks(d.config, blocks, doc, pos, use_flex=True)
            out = block_loss(drafter_forward(d, emb, blocks, feats, pos, masks), blocks, head.weight, 4.0)
            out.loss.backward()
            results[compiled] = (out.loss.detach(), {n: p.grad.detach().clone() for n, p in d.named_parameters()})
        assert_close(results[True][0], results[False][0], atol=1e-5, what=f"compiled loss, ckpt={checkpointing}")
        for n, g in results[False][1].items():
            assert_close(results[True][1][n], g, atol=1e-5, rtol=1e-4, what=f"compiled grad {n}, ckpt={checkpointing}")


@pytest.mark.timeout(240)  # Qwen3.5: two compiled halves per kind of shape and flash-linear-attention's autotuning
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_compiled_target_layers_equal_eager_on_cuda(arch, monkeypatch):
    """train.compile=true with online features: inductor's target layers give the eager taps (fp32), over
    two row lengths (the second compiles the dynamic-shape graph); Qwen3.5 with its GatedDeltaNet layers
    as two inductor halves around flash-linear-attention's chunked kernel (models.gated_deltanet), which
    every GatedDeltaNet layer of every pass calls (no layer fell back to its own forward)."""
    from models import gated_deltanet as gdn
    from models.target import TargetModel
    from models.tiny import tiny_target

    calls, real = [], gdn.chunk_kernel

    def counted(m):
        kernel = real(m)

        def run(*args, **kwargs):
            calls.append(getattr(kernel, "__name__", ""))
            return kernel(*args, **kwargs)
        return run

    monkeypatch.setattr(gdn, "chunk_kernel", counted)
    eager = TargetModel(tiny_target(arch).cuda())
    compiled = TargetModel(tiny_target(arch).cuda()).compile_layers()
    gdn_layers = len(compiled.linear_attention_modules())
    # fla's chunked GatedDeltaNet kernel rounds its dot inputs to TF32 (10-bit mantissa) even in fp32:
    # inductor's fused norms and gates move an input by an ulp across a rounding edge, a 2^-11 relative
    # step that the later layers carry on (seen on an H100: max 5.0e-4 at length 48). The taps reach
    # |5.3| here, so an absolute bound can fail on rounding alone (2^-11 x 5.3 = 2.6e-3; an atol of 2e-3
    # failed on an H200, its message not kept): the hybrid is held to TF32's relative error over the
    # whole tensor instead. A wrong tap or layer is off by O(1) in that measure.
    for n in (48, 80, 64):
        ids = torch.randint(0, 250, (2, n), generator=torch.Generator().manual_seed(n)).cuda()
        ref = eager.forward(ids, [1, 3, 5], with_logits=False).features
        got = compiled.forward(ids, [1, 3, 5], with_logits=False).features
        what = f"{arch} compiled target taps, length {n}"
        if not eager.is_hybrid:
            assert_close(got, ref, atol=1e-4, what=what)
            continue
        assert got.shape == ref.shape, what
        rel = ((got - ref).double().norm() / ref.double().norm()).item()
        assert rel < 2e-3, f"{what}: relative error {rel:.2e}, max abs diff {(got - ref).abs().max().item():.2e}"
    # the eager target's mixers call their own kernel; the taps stop after layer 5 (the sixth layer)
    ran = sum(1 for i, _ in compiled.linear_attention_modules() if i <= 5)
    assert len(calls) == 3 * ran and (gdn_layers == 0) == (ran == 0), (len(calls), ran)
    assert "torch_chunk_gated_delta_rule" not in calls, set(calls)  # flash-linear-attention's, not the reference


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", ["qwen3_5"])
def test_compiled_graph_loop_equals_eager_loop_on_cuda(arch):
    """--loop compiled: torch.compile'd target layers (and GatedDeltaNet steps) and drafter block pass inside
    the CUDA graphs give target-only decoding's tokens and the eager loop's tokens and acceptance lengths
    (fp32). Qwen3's compiled loop is held to the CPU eager loop by the validate test below (a trained drafter)."""
    from inference.static_loop import StaticDrafterProposer, StaticTarget, static_dflash_generate
    from inference.torch_loop import DrafterProposer, dflash_generate, target_generate
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer

    prompt = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
    target = TargetModel(tiny_target(arch).cuda(), tiny_tokenizer())
    ref = target_generate(target, prompt, 64, eos_token_ids=[])
    torch.manual_seed(1)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).cuda().eval()
    eager = dflash_generate(target, DrafterProposer(drafter, target), prompt, 64, eos_token_ids=[])
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=len(prompt) + 100, block_size=8, compile=True)
    proposer = StaticDrafterProposer(drafter, target, st.max_len, compile=True)
    for resident in (True, False):
        static = static_dflash_generate(st, proposer, prompt, 64, eos_token_ids=[], resident=resident)
        assert_same_loop(static, eager, ref.tokens, target.is_hybrid)


@pytest.mark.parametrize("tiles", ["16,32,32,16,1,4"])
def test_flex_backward_tiles_keep_the_loss_and_gradients_on_cuda(tiles):
    """train.flex_backward changes speed only: explicit tiles reach the compiled kernel and give
    torch's tiles' loss and gradients (one set of tiles: each is a compile of its own)."""
    from tests.train.test_objective import MASK, B, H, _rows

    from train.blocks import attention_masks, draw_blocks
    from train.objective import block_loss, drafter_forward

    ids, lm, doc, pos = (t.cuda() for t in _rows())
    feats = torch.randn(2, ids.shape[1], 2 * H, generator=torch.Generator().manual_seed(2)).cuda()
    blocks = draw_blocks(ids, lm, doc, pos, 6, B, MASK, torch.Generator().manual_seed(0))
    results = {}
    for setting in ("torch", tiles):
        torch._dynamo.reset()
        d, emb, head = _drafter(None, 16)
        d.set_flex_backward(setting)
        masks = attention_masks(d.config, blocks, doc, pos, use_flex=True)
        out = block_loss(drafter_forward(d, emb, blocks, feats, pos, masks), blocks, head.weight, 4.0)
        out.loss.backward()
        results[setting] = (out.loss.detach(), {n: p.grad.detach().clone() for n, p in d.named_parameters()})
    assert d.layers[0].self_attn.flex_kernel_options["bwd_BLOCK_M1"] == int(tiles.split(",")[0])
    assert_close(results[tiles][0], results["torch"][0], atol=1e-5, what=f"loss with tiles {tiles}")
    for n, g in results["torch"][1].items():
        assert_close(results[tiles][1][n], g, atol=1e-5, rtol=1e-4, what=f"grad {n} with tiles {tiles}")


def test_flex_sweep_reports_each_candidate_and_the_best_on_cuda(capsys):
    import json

    from lab.flex_sweep import main

    main(["--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--seq", "128", "--anchors", "8", "--block", "8",
          "--steps", "2", "32,32,32,32,1,4"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    rows, win = lines[:-1], lines[-1]
    assert [r["tiles"] for r in rows] == ["torch", "32,32,32,32,1,4"]
    assert all(r["same_grads"] and r["fwd_bwd_ms"] > 0 for r in rows), rows
    assert win["bench"] == "flex_sweep_best" and win["tiles"] in {r["tiles"] for r in rows}


def test_blocks_drawn_on_the_host_equal_blocks_drawn_on_the_gpu():
    """train/loop.py draws on the token batch's host copy and sends the blocks without waiting: the same
    blocks as a draw on the GPU (the keys come from CPU generators either way)."""
    from dataclasses import fields

    from tests.train.test_fast_paths import _packed_rows

    from train.blocks import draw_blocks
    from train.rng import row_generators

    ids, lm, doc, pos = _packed_rows(3, 300, seed=6)
    host = draw_blocks(ids, lm, doc, pos, 24, 8, 95, row_generators(0, 0, [0, 1, 2])).to("cuda")
    gpu = draw_blocks(ids.cuda(), lm.cuda(), doc.cuda(), pos.cuda(), 24, 8, 95, row_generators(0, 0, [0, 1, 2]))
    for f in fields(host):
        assert torch.equal(getattr(host, f.name), getattr(gpu, f.name)), f.name



@pytest.mark.parametrize("features", ["online", "offline"])
def test_a_training_step_on_cuda_waits_for_nothing(features, tmp_path, tmp_path_factory, monkeypatch):
    """CUDA's own detector (``set_sync_debug_mode("error")``) over whole optimizer steps: target forward (online)
    or an fp8 store with top-k (offline: its scales and top-k come from the host), flex drafter, loss, backward,
    acceptance counts, clip and fused AdamW raise on any wait for the GPU. The first step runs unchecked: it
    compiles flex attention and the loss kernel. Packed rows keep one row length, so later steps reuse those
    graphs (tests/train/test_host_reads.py is the CPU side). The layers stay eager (train.compile=false): compiling
    them here would double the test's time for code that inductor writes without reads."""
    import json

    import train.loop
    from data.extract import main as extract_main
    from models.config import default_layer_ids
    from tests.helpers.tiny_run import FAST, run, tiny_input_dirs
    from train.config import load_config

    d = tiny_input_dirs(tmp_path_factory)
    mode = []
    if features == "offline":
        layers = json.loads((d["target"] / "config.json").read_text())["num_hidden_layers"]
        ids = default_layer_ids(layers, load_config(["recipe=tiny"]).drafter.num_taps)
        extract_main(["--target", str(d["target"]), "--data", str(d["packed"]), "--out", str(tmp_path / "feats"),
                      "--dtype", "fp8", "--topk", "8", "--layers", *map(str, ids), "--no-progress"])
        mode = ["features.mode=offline", f"features.store={tmp_path / 'feats'}", "train.loss=ce+kl"]
    real, steps = train.loop.train_step, []

    def checked(*args, **kwargs):
        steps.append(len(steps) + 1)
        if len(steps) == 1:
            return real(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(train.loop, "train_step", checked)
    run(tmp_path / "run", f"target.path={d['target']}", f"data.prepared={d['packed']}", "data.pack=true", *FAST, *mode,
        "train.max_steps=3", "train.grad_accum=2", "train.batch_size=2", "train.anchors=8", "eval.batches=1",
        "logging.every=100", "train.compile=false")
    assert steps == [1, 2, 3]


def test_host_tensors_reach_the_gpu_without_waiting_for_its_queue():
    """``models.support.to_device`` stages a pageable host tensor through pinned memory: the copy is queued
    behind a kernel still running instead of waiting for it (the stream is still busy when it returns), and
    the values arrive."""
    from models.support import to_device

    x = torch.arange(1 << 20, dtype=torch.float32)  # pageable, 4 MiB
    # The first pinned block of a size is a fresh page-locked allocation, which the driver may make wait for
    # the device; PyTorch's caching host allocator then reuses it once its copy has run, as training's
    # steps do (the same sizes every step). The steady state is what is checked.
    to_device(x, "cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e9))  # a kernel that spins for seconds
    y = to_device(x, "cuda")
    assert not torch.cuda.current_stream().query()  # returned while the kernel still runs
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), x) and y.device.type == "cuda"


@pytest.mark.timeout(300)  # a CPU training run, then four validate runs (the compiled one compiles its passes)
def test_validate_gives_the_cpu_eager_loops_acceptance_lengths_in_every_cuda_loop(tmp_path, tmp_path_factory):
    """``inference.validate`` in fp32 with a trained tiny drafter: the eager, static (CUDA graphs) and compiled
    loops on the GPU give the CPU eager loop's acceptance lengths, prompt by prompt, and the target's own tokens.
    The drafter is the tiny recipe's (2.5 epochs, ~115 steps), trained on the CPU in a process of its own (nothing
    to compile, and accelerate keeps one device per process): on the CPU it reached tau ~2.2 (60 steps: ~1.4)."""
    import json
    import os
    import subprocess
    import sys

    from inference.validate import main as validate
    from tests.helpers import ROOT
    from tests.helpers.tiny_run import FAST, tiny_input_dirs

    d = tiny_input_dirs(tmp_path_factory)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-m", "train.distill", "recipe=tiny", f"out_dir={tmp_path / 'run'}",
                    f"target.path={d['target']}", f"data.prepared={d['data']}", *FAST],
                   cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    common = ["--target", str(d["target"]), "--draft", str(tmp_path / "run" / "final" / "drafter"), "--prompts",
              str(d["target"].parent / "tiny_chat.jsonl"), "--n", "8", "--max-new-tokens", "40", "--dtype", "float32",
              "--no-progress"]
    reports = {}
    for device, loop in (("cpu", "eager"), ("cuda", "eager"), ("cuda", "static"), ("cuda", "compiled")):
        reports[f"{device} {loop}"] = validate([*common, "--device", device, "--loop", loop,
                                                "--out", str(tmp_path / f"{device}-{loop}")])
    lengths = {name: [p["acceptance_lengths"] for p in r["per_prompt"]] for name, r in reports.items()}
    figures = {name: {"loop": r["loop"], "device": r["device"], "tau": r["tau"], "tau_uncut": r["tau_uncut"],
                      "num_cycles": r["num_cycles"], "identical_share": r["identical_share"],
                      "same_lengths_as_cpu_eager": lengths[name] == lengths["cpu eager"]}
               for name, r in reports.items()}
    if os.environ.get("DRAFTSMITH_MEASURE_JSONL"):
        with open(os.environ["DRAFTSMITH_MEASURE_JSONL"], "a") as f:
            f.write(json.dumps({"measure": "validate_loops_fp32", "prompts": reports["cpu eager"]["num_prompts"],
                                "max_new_tokens": 40, "loops": figures, "acceptance_lengths": lengths}) + "\n")
    print(json.dumps(figures, indent=1))
    assert reports["cpu eager"]["tau"] > 1.5, "the drafter did not train: the comparison would be of tau ~1"
    for name, r in reports.items():
        assert r["loop"] == name.split()[1] and r["dtype"] == "float32", name
        assert r["identical_share"] == 1.0, f"{name}: not the target's own tokens"
        assert lengths[name] == lengths["cpu eager"], f"{name}: other acceptance lengths than the CPU eager loop"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_graphed_dflash2_pass_equals_the_eager_one_on_cuda(arch):
    """DFlash2 inside the captured draft pass (its two convs per layer, sliding-window masks, the selector walk):
    replayed, greedy and sampled (uniforms from the static buffer, one captured pass per temperature), it proposes
    the eager drafter's drafts, candidates and q cycle by cycle; the resident cycle and the two-graph cycle give
    target-only decoding's tokens and the eager loop's acceptance lengths, with a random and a bigram-walk drafter
    (fp32). Not yet run on a GPU."""
    from inference.static_loop import StaticDrafterProposer, StaticTarget, resident_cycle, static_dflash_generate
    from inference.torch_loop import DrafterProposer, dflash_generate, target_generate
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer
    from tests.helpers.dflash2 import bigram_dflash2, random_dflash2, tiny_v2_config

    prompt = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
    target = TargetModel(tiny_target(arch).cuda(), tiny_tokenizer())
    ref = target_generate(target, prompt, 80, eos_token_ids=[])
    seq = prompt + ref.tokens
    feats = target.forward(torch.tensor([seq], device="cuda"), tiny_v2_config(target).target_layer_ids,
                           with_logits=False).features
    for drafter in (random_dflash2(tiny_v2_config(target)).cuda(), bigram_dflash2(target, seq).cuda().eval()):
        eager = DrafterProposer(drafter, target)
        st = StaticTarget(target, drafter.config.target_layer_ids, max_len=len(prompt) + 100, block_size=8)
        static = StaticDrafterProposer(drafter, target, st.max_len)
        assert static.graphs
        for T in (0.0, 0.7):
            eager.reset(T, torch.Generator("cuda").manual_seed(3))
            static.reset(T, torch.Generator("cuda").manual_seed(3))
            start, new = len(prompt), feats[:, :len(prompt)]
            for keep in (3, 1, 8, 2, 5, 8, 4):
                a, b = eager.propose(seq[start], new, start, 8), static.propose(seq[start], new, start, 8)
                assert torch.equal(a.drafts, b.drafts), (T, start)
                if T > 0:  # candidate order is not part of the contract (ties among K = V bigram candidates)
                    assert torch.equal(a.candidates.sort(-1).values, b.candidates.sort(-1).values)
                    by_id = lambda p: torch.zeros(7, 288, device="cuda").scatter(-1, p.candidates, p.q)  # noqa: E731
                    assert_close(by_id(b), by_id(a), atol=1e-5, what="q of the graphed walk, by token")
                new, start = feats[:, start:start + keep], start + keep
        assert sorted(static._passes) == [0.0, 0.7] and all(p.graph is not None for p in static._passes.values())
        loop = dflash_generate(target, DrafterProposer(drafter, target), prompt, 64, eos_token_ids=[])
        for resident in (True, False):
            res = static_dflash_generate(st, static, prompt, 64, eos_token_ids=[], resident=resident)
            assert_same_loop(res, loop, ref.tokens[:64], target.is_hybrid)
        assert resident_cycle(st, static)._graph.graph is not None
