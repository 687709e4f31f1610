"""The MLX DFlash loop: lossless against stock mlx_lm, exact acceptance, exact rollback, same as the torch loop.

Tiny HF targets are written by ``models.tiny`` and converted with mlx_lm's own ``convert`` (fp32, and
4-bit with group size 32), once per session. Everything runs on the MLX CPU device in float32, where
the DFlash output is token-exact; no prompt or seed needed special picking.
"""

import json
import types
from collections import Counter

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from inference.mlx_loop import DrafterProposer, dflash_generate, target_generate  # noqa: E402
from inference.rollback_mlx import CacheRollback  # noqa: E402
from models.drafter import DFlashDraftModel as TorchDrafter  # noqa: E402
from models.drafter_mlx import DFlashDraftModel  # noqa: E402
from models.target_mlx import TargetModel, UnsupportedTarget  # noqa: E402
from models.tiny import MOE_FAMILY_ARCHS  # noqa: E402
from tests.helpers import ReferenceProposer, assert_close, expected_acceptance, tiny_drafter_config  # noqa: E402

ARCHS = ["qwen3", "llama", "qwen3_5"]
# gpt-oss, Gemma 4 31B-like, the multimodal 26B-A4B-like, E-model: transformers folders read by draftsmith's loader
FAMILIES = ["gpt_oss", "gemma4_text", "gemma4", "gemma4_e"]
PROMPT = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
NEW, B = 64, 8
MISTAKES = {len(PROMPT) + k for k in (3, 4, 12, 30, 31, 33, 47, 50, 58)}


@pytest.fixture(autouse=True, scope="module")
def _cpu_one_thread():
    # Exactness is claimed in float32 on the CPU (also on a Mac); one torch thread keeps the torch
    # reference fast when the machine is shared.
    old_dev, old_threads = mx.default_device(), torch.get_num_threads()
    mx.set_default_device(mx.cpu)
    torch.set_num_threads(1)
    yield
    mx.set_default_device(old_dev)
    torch.set_num_threads(old_threads)


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """HF and converted MLX folders of the tiny targets, built on first use and kept for the session.

    ``qwen3_5`` is the multimodal Qwen3.5 checkpoint (the layout Qwen3.5 ships in; mlx_lm converts it
    to its text tower). ``qwen3_5_text`` (bare text checkpoint) and ``qwen3_moe`` are loaded straight
    from HF format: their transformers 5 configs need the overrides ``TargetModel`` applies.
    """
    from mlx_lm.convert import convert

    from models.tiny import save_tiny_target

    root = tmp_path_factory.mktemp("mlx_targets")
    made: dict[str, tuple] = {}
    source = {"qwen3": "qwen3", "llama": "llama", "qwen3_5": "qwen3_5_vl", "qwen3_q4": "qwen3",
              "qwen3_5_text": "qwen3_5", "qwen3_moe": "qwen3_moe", "qwen3_5_moe": "qwen3_5_moe",
              **{arch: arch for arch in MOE_FAMILY_ARCHS}, **{f: f for f in FAMILIES}, "gpt_oss_q4": "gpt_oss",
              "gemma4_q4": "gemma4"}

    def get(name: str):
        if name not in made:
            hf = root / f"hf_{source[name]}"
            if not hf.exists():
                save_tiny_target(hf, source[name])
                if name == "qwen3_5_moe":
                    fuse_experts(hf)
            if name in ("qwen3_5_text", "qwen3_moe", "qwen3_5_moe", *MOE_FAMILY_ARCHS, *FAMILIES):  # mlx_lm.convert
                # cannot read these configs (transformers 5's rope_parameters, Gemma 4's per_layer_config, gpt-oss's
                # bf16 experts): TargetModel loads them with its overrides
                made[name] = (hf, hf)
            elif name in ("gpt_oss_q4", "gemma4_q4"):  # quantized as mlx_lm.convert -q, with draftsmith's loader
                from models.quantize import quantize_to_mlx

                made[name] = (hf, quantize_to_mlx(hf, root / f"mlx_{name}", bits=4, group_size=32, dtype="float32",
                                                  log=lambda *_: None))
            else:
                out = root / f"mlx_{name}"
                quant = dict(quantize=True, q_bits=4, q_group_size=32) if name.endswith("_q4") else {}
                convert(str(hf), mlx_path=str(out), dtype="float32", **quant)
                made[name] = (hf, out)
        return made[name]

    return get


def fuse_experts(folder) -> None:
    """Rewrite per-expert MoE weights as published Qwen3.5 MoE checkpoints store them (and mlx_lm reads):
    ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``. transformers 5 saves the
    tiny model one tensor per expert instead."""
    import re

    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state, grouped = load_file(str(path)), {}
    for key in list(state):
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", key)
        if m:
            grouped.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = state.pop(key)
    for prefix, parts in grouped.items():
        stack = {k: torch.stack([v[i] for i in sorted(v)]) for k, v in parts.items()}
        state[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        state[f"{prefix}.down_proj"] = stack["down"]
    save_file(state, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def runs(folders):
    """Per target: the MLX target, its greedy reference (prompt + NEW + slack) and a random drafter."""
    cache = {}

    def get(name: str):
        if name not in cache:
            target = TargetModel.from_pretrained(folders(name)[1])
            ref = target_generate(target, PROMPT, NEW + 2 * B, eos_token_ids=[])
            torch.manual_seed(1)
            cache[name] = (target, PROMPT + ref.tokens, TorchDrafter(tiny_drafter_config(target)).eval())
        return cache[name]

    return get


def mlx_drafter(torch_drafter: TorchDrafter, tmp_path) -> DFlashDraftModel:
    folder = tmp_path / "drafter"
    torch_drafter.save_pretrained(folder)
    return DFlashDraftModel.from_pretrained(folder)


# ------------------------------------------------------------------------------- losslessness
@pytest.mark.parametrize("arch", ARCHS + ["qwen3_moe", "qwen3_5_moe", *MOE_FAMILY_ARCHS, "gpt_oss", "gemma4"])
def test_random_drafter_is_lossless(runs, arch, tmp_path):
    target, seq, drafter = runs(arch)
    res = dflash_generate(target, DrafterProposer(mlx_drafter(drafter, tmp_path), target), PROMPT, NEW,
                          eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + NEW]
    assert 1.0 <= res.tau < 1.5  # a random drafter is (almost) never right
    assert len(res.acceptance_lengths) >= NEW // 2


@pytest.mark.parametrize("arch", ARCHS)
def test_perfect_stand_in_accepts_whole_blocks(runs, arch):
    target, seq, drafter = runs(arch)
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, NEW,
                          eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + NEW]
    *full, last = res.acceptance_lengths  # the last cycle is cut by the token budget: it counts what it emitted
    assert full == [B] * len(full) and last == (NEW - 1) % B == 7 and sum(res.acceptance_lengths) == NEW - 1
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), NEW, B, set())
    assert res.tau == (NEW - 1) / len(res.acceptance_lengths)
    assert res.position_accepts == [len(full) + (k < last) for k in range(B - 1)]


def test_a_cycle_cut_by_eos_counts_only_what_it_emitted(runs):
    """The first EOS inside an accepted block is never emitted nor counted: tau x cycles = tokens decoded."""
    target, seq, drafter = runs("qwen3")
    gen = seq[len(PROMPT):len(PROMPT) + NEW]
    cut = next(i for i in range(B + 4, NEW) if gen[i] not in gen[:i])  # inside the second block or later
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, NEW,
                          eos_token_ids=[gen[cut]])
    assert res.tokens == gen[:cut] and res.stop_reason == "eos"
    *full, last = res.acceptance_lengths
    assert full == [B] * len(full) and last == (cut - 1) - B * len(full) < B
    assert res.tau * len(res.acceptance_lengths) == pytest.approx(cut - 1)
    base = target_generate(target, PROMPT, NEW, eos_token_ids=[gen[cut]])  # its steps count the same way
    assert base.tokens == gen[:cut] and sum(base.acceptance_lengths) == cut - 1 == len(base.acceptance_lengths) - 1


@pytest.mark.parametrize("arch", ARCHS + list(MOE_FAMILY_ARCHS) + ["gpt_oss", "gemma4", "gemma4_e", "gpt_oss_q4",
                                                                "gemma4_q4"])
def test_planted_mistakes_give_exact_acceptance_lengths(runs, arch):
    target, seq, drafter = runs(arch)
    proposer = ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES)
    res = dflash_generate(target, proposer, PROMPT, NEW, eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + NEW]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), NEW, B, MISTAKES)
    assert min(res.acceptance_lengths) < B < max(res.acceptance_lengths) + 1
    # Each draft got the target's features of exactly the positions committed since the last one
    full = np.array(target.forward(mx.array([seq]), drafter.config.target_layer_ids, cache=target.new_cache()).features)
    assert [start for start, _ in proposer.received][:2] == [len(PROMPT), len(PROMPT) + res.acceptance_lengths[0]]
    for start, feats in proposer.received:
        assert_close(np.array(feats), full[:, start - feats.shape[1]:start], 1e-4, f"features handed over at {start}")


@pytest.mark.parametrize("arch", ARCHS)
def test_the_baseline_is_the_cycle_without_a_drafter(runs, arch, monkeypatch):
    """target_generate is this backend's one cycle with NoDrafter: blocks of the bonus token alone, the target's
    greedy tokens (mlx_lm's own generate_step: an independent reference) and one token committed per cycle."""
    from mlx_lm.generate import generate_step

    from inference import mlx_loop

    target, _, _ = runs(arch)
    ref = [int(tok) for tok, _ in generate_step(mx.array(PROMPT), target.model, max_tokens=24)]
    cycles, real = [], mlx_loop.dflash_generate
    monkeypatch.setattr(mlx_loop, "dflash_generate", lambda t, proposer, *a, **k: cycles.append(proposer)
                        or real(t, proposer, *a, **k))
    res = target_generate(target, PROMPT, 24, eos_token_ids=[])
    assert [type(p) for p in cycles] == [mlx_loop.NoDrafter]
    assert res.tokens == ref and len(ref) == 24
    assert res.acceptance_lengths == [1] * 23 and res.block_size == 1 and res.position_accepts == []


def test_quantized_4bit_target_is_lossless(runs, tmp_path):
    target, seq, drafter = runs("qwen3_q4")
    assert target.quantization == "mlx-4bit-g32"
    assert hasattr(target.embed_tokens, "scales") and target.dtype == mx.float32
    full_seq = runs("qwen3")[1]
    assert seq != full_seq  # the reference really is the quantized model's own output
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES),
                          PROMPT, NEW, eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + NEW]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), NEW, B, MISTAKES)
    res = dflash_generate(target, DrafterProposer(mlx_drafter(drafter, tmp_path), target), PROMPT, NEW,
                          eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + NEW]


# ---------------------------------------------------------------------------- capture and scoping
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_5_text", "qwen3_moe", "qwen3_5_moe",
                                  *MOE_FAMILY_ARCHS, *FAMILIES])
def test_captured_features_are_the_torch_hidden_states(folders, arch):
    """MLX features and logits equal the torch target's (GLM's partial rotary, Qwen3-Next's GatedDeltaNet,
    DeepSeek-V3 / Kimi's YaRN latent attention once mlx_lm is given the rope keys transformers 5 folds into
    rope_parameters; measured at most 7.4e-5, Qwen3-Next's chunked vs recurrent GatedDeltaNet), and so do the
    embeddings the drafter's block starts from."""
    from models.target import TargetModel as TorchTarget

    hf, converted = folders(arch)
    target = TargetModel.from_pretrained(converted)
    ids = PROMPT[:12]
    taps = [6, 1, 3]  # config order, not sorted: the features are joined in the order the drafter was trained on
    out = target.forward(mx.array([ids]), taps, cache=target.new_cache())
    model = TorchTarget.from_pretrained(hf, dtype=torch.float32).model  # Kimi K2.5: its text tower
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[i + 1] for i in taps], dim=-1)  # output of decoder layer i
    assert_close(np.array(out.features), expected, 1e-4, f"{arch} tapped layers 6, 1, 3")
    assert_close(np.array(out.logits), ref.logits, 1e-4, f"{arch} logits")
    assert_close(np.array(target.embed(mx.array([ids]))), model.get_input_embeddings()(torch.tensor([ids])), 0,
                 f"{arch} embeddings")


def test_captures_are_scoped_and_independent(runs):
    target, _, _ = runs("qwen3")
    originals = list(target.layers)
    ids = mx.array([PROMPT])
    a = target.forward(ids, [1, 3], cache=target.new_cache()).features
    b = target.forward(ids, [2, 5], cache=target.new_cache()).features
    with target.capture([1, 3]) as outer:
        with target.capture([2, 5], record_inputs=[3]) as inner:
            target.decoder(ids, cache=target.new_cache())
        assert sorted(outer.outputs) == [1, 3] and sorted(inner.outputs) == [2, 5]
    assert np.array_equal(np.concatenate([np.array(outer.outputs[i]) for i in (1, 3)], -1), np.array(a))
    assert np.array_equal(np.concatenate([np.array(inner.outputs[i]) for i in (2, 5)], -1), np.array(b))
    assert np.array_equal(np.array(inner.inputs[3]), np.array(inner.outputs[2]))  # layer 3's input = layer 2's output
    with pytest.raises(RuntimeError, match="boom"):
        with target.capture([4]):
            raise RuntimeError("boom")
    assert all(x is y for x, y in zip(target.layers, originals)) and len(target.layers) == len(originals)


@pytest.mark.parametrize("layer", [-1, 8])
def test_a_layer_id_outside_the_target_is_refused_not_read_from_the_end(runs, layer):
    """Layer ids are checked against the decoder: -1 would otherwise tap the last layer by Python indexing, and
    8 (one past the last of 8) would fail inside the forward."""
    target, _, _ = runs("qwen3")
    assert target.num_layers == 8
    originals = list(target.layers)
    for kw in ({"layer_ids": [1, layer]}, {"record_inputs": [layer]}):
        with pytest.raises(ValueError, match=f"layer id {layer} is outside this target's 8 layers"):
            with target.capture(**kw):
                pass
    with pytest.raises(ValueError, match=f"layer id {layer} is outside"):
        target.forward(mx.array([PROMPT]), [layer], cache=target.new_cache())
    assert all(x is y for x, y in zip(target.layers, originals)) and len(target.layers) == 8


def test_model_is_unmodified_after_generation(runs, tmp_path):
    from mlx.utils import tree_flatten

    target, seq, drafter = runs("qwen3_5")
    layers = list(target.layers)
    params = {k: np.array(v) for k, v in tree_flatten(target.model.parameters())}
    before = target_generate(target, PROMPT, 24, eos_token_ids=[]).tokens
    dflash_generate(target, DrafterProposer(mlx_drafter(drafter, tmp_path), target), PROMPT, 24, eos_token_ids=[])
    dflash_generate(target, ReferenceProposer(seq, [2, 4], B, 288, MISTAKES), PROMPT, 24, eos_token_ids=[])
    assert target_generate(target, PROMPT, 24, eos_token_ids=[]).tokens == before == seq[len(PROMPT):len(PROMPT) + 24]
    assert all(x is y for x, y in zip(target.layers, layers))
    after = dict(tree_flatten(target.model.parameters()))
    assert after.keys() == params.keys() and all(np.array_equal(np.array(after[k]), v) for k, v in params.items())


@pytest.mark.parametrize("broken", [None, "no restore", "no replay", "replays too few", "verified state put back",
                                    "verified conv window put back", "snapshot conv window put back",
                                    "whole block, snapshot put back", "whole block, no conv state",
                                    "whole block, no recurrent state"])
def test_check_sees_a_gated_delta_net_state_left_at_the_wrong_length(runs, broken):
    """Twin of the torch check: a commit that leaves the GatedDeltaNet state at the verified block,
    restores the snapshot without replaying the kept tokens, or replays fewer than it keeps is caught by
    the per-cycle check; so is a state swapped afterwards (the verified one back after a replay, the
    snapshot after a whole block was kept, or either one's conv window beside the replayed recurrent state) or
    one that lost an array."""
    from mlx_lm.models.cache import ArraysCache

    from inference.rollback_mlx import CacheRollback

    target, seq, _ = runs("qwen3_5")
    keep = B if broken and broken.startswith("whole block") else 3
    cache = target.new_cache()
    target.forward(mx.array([PROMPT]), cache=cache)
    rollback = CacheRollback(target)
    with rollback.recording(cache):
        target.forward(mx.array([seq[len(PROMPT):len(PROMPT) + B]]), cache=cache)
    silent = types.SimpleNamespace(input_layernorm=lambda x: x, linear_attn=lambda *a: None)
    rollback.linear = {"no restore": [], "no replay": [(i, silent) for i, _ in rollback.linear]}.get(
        broken, rollback.linear)
    if broken == "replays too few":  # the recorded inputs lost the last kept token
        rollback._inputs = {i: x[:, :keep - 1] for i, x in rollback._inputs.items()}
    rollback.commit(cache, keep=keep, block_len=B)
    i = next(i for i, c in enumerate(cache) if isinstance(c, ArraysCache))
    if broken == "verified state put back":
        cache[i].cache = list(rollback._verified[i])
    elif broken in ("verified conv window put back", "snapshot conv window put back"):  # one array of two
        cache[i].cache[0] = (rollback._verified if broken.startswith("verified") else rollback._snapshots)[i][0]
    elif broken == "whole block, snapshot put back":
        cache[i].cache = list(rollback._snapshots[i])
    elif broken and broken.startswith("whole block, no"):
        cache[i].cache[0 if "conv" in broken else 1] = None
    if broken is None:
        rollback.check(cache, len(PROMPT) + keep)
        return
    message = "has no state" if "no " in broken and "state" in broken else (
        "the snapshot, not replayed" if "snapshot" in broken else
        "the verified block's state" if broken == "no restore" or broken.startswith("verified") else "GatedDeltaNet")
    with pytest.raises(AssertionError, match=message):
        rollback.check(cache, len(PROMPT) + keep)


def test_unsupported_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    with pytest.raises(UnsupportedTarget, match="not supported yet: gemma2"):
        TargetModel.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------------ the torch twin
def biased_drafter(target_hf: TargetModel, token: int, seed: int = 1) -> TorchDrafter:
    """A random drafter whose output leans towards ``token`` (so it is sometimes right, sometimes not).

    Attention and MLP outputs are damped so the block slots stay near the mask embedding, and the
    final norm maps that embedding onto the LM-head row of ``token``.
    """
    torch.manual_seed(seed)
    drafter = TorchDrafter(tiny_drafter_config(target_hf)).eval()
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
        e = target_hf.embed_tokens.weight[drafter.config.mask_token_id]
        drafter.norm.weight.copy_(target_hf.lm_head.weight[token] / (e / e.pow(2).mean().sqrt()))
    return drafter


def test_mlx_proposer_drafts_what_the_torch_proposer_drafts(folders, runs, tmp_path):
    """Cycle by cycle with uneven commits, the same features: the same drafts. A random drafter is
    lossless whatever its positions, and a biased one drafts one token anywhere, so the loop tests
    alone do not see a draft block placed at the wrong positions."""
    from inference import torch_loop
    from models.target import TargetModel as TorchTarget

    target, seq, drafter = runs("qwen3")
    torch_target = TorchTarget.from_pretrained(folders("qwen3")[0], dtype=torch.float32)
    taps = drafter.config.target_layer_ids
    feats = torch_target.forward(torch.tensor([seq]), taps, with_logits=False).features
    ours = DrafterProposer(mlx_drafter(drafter, tmp_path), target)
    theirs = torch_loop.DrafterProposer(drafter, torch_target)
    start, new, differing = len(PROMPT), feats[:, :len(PROMPT)], 0
    for keep in (3, 1, 8, 2, 5, 7):
        a = theirs.propose(seq[start], new, start, B).drafts.tolist()
        b = np.array(ours.propose(seq[start], mx.array(new.numpy()), start, B).drafts).tolist()
        assert a == b, f"drafts at {start}"
        assert ours.context_length() == theirs.context_length() == start
        differing += len(set(a)) > 1
        new, start = feats[:, start:start + keep], start + keep
    assert differing  # the drafts depend on the positions: not one token repeated


@pytest.mark.parametrize("arch,new", [("qwen3", NEW), ("qwen3_5", 24), ("gpt_oss", 24), ("gemma4", 24)])
def test_mlx_loop_equals_torch_loop(folders, runs, arch, new, tmp_path):
    from inference import torch_loop
    from models.target import TargetModel as TorchTarget

    target, seq, _ = runs(arch)
    torch_target = TorchTarget.from_pretrained(folders(arch)[0], dtype=torch.float32)
    token = Counter(seq[len(PROMPT):]).most_common(1)[0][0]
    drafter = biased_drafter(torch_target, token)
    ours = dflash_generate(target, DrafterProposer(mlx_drafter(drafter, tmp_path), target), PROMPT, new,
                           eos_token_ids=[])
    theirs = torch_loop.dflash_generate(torch_target, torch_loop.DrafterProposer(drafter, torch_target), PROMPT,
                                        new, eos_token_ids=[])
    assert ours.tokens == theirs.tokens == seq[len(PROMPT):len(PROMPT) + new]
    assert ours.acceptance_lengths == theirs.acceptance_lengths
    assert ours.position_accepts == theirs.position_accepts
    assert ours.to_json().keys() == theirs.to_json().keys()
    if arch == "qwen3":
        assert max(ours.acceptance_lengths) > 2  # the comparison covers multi-token acceptance


# ------------------------------------------------------------------------------------------ rollback
def test_gated_delta_state_equals_a_fresh_prefill_after_every_cycle(runs):
    from mlx_lm.models.cache import ArraysCache

    target, seq, _ = runs("qwen3_5")
    checked = []

    def compare(cache, committed):
        fresh = target.new_cache()
        target.forward(mx.array([seq[:committed]]), cache=fresh, with_logits=False)
        mx.eval([c.state for c in fresh])
        for i, (c, ref) in enumerate(zip(cache, fresh)):
            if isinstance(c, ArraysCache):
                assert_close(np.array(c[0]), np.array(ref[0]), 1e-5, f"layer {i} conv state")
                assert_close(np.array(c[1]), np.array(ref[1]), 1e-5, f"layer {i} recurrent state")
            else:
                assert c.offset == committed
                k, _ = c.keys_and_values() if c.offset < c.keys.shape[2] else (c.keys, c.values)
                assert_close(np.array(k), np.array(ref.keys[..., :committed, :]), 1e-5, f"layer {i} keys")
        checked.append(committed)

    proposer = ReferenceProposer(seq, [1, 3, 5], B, 288, MISTAKES)
    res = dflash_generate(target, proposer, PROMPT, 40, eos_token_ids=[], on_cycle=compare)
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + 40]
    assert len(checked) == len(res.acceptance_lengths) and min(res.acceptance_lengths) < B  # partial blocks replayed
    assert B in res.acceptance_lengths  # and whole blocks skipped the replay


def test_a_rollback_that_leaves_the_cache_long_stops_the_loop(runs, monkeypatch):
    """The loop checks every cycle that each target cache holds exactly the committed length: a commit that
    trims nothing is an error at the first partly accepted block, not a silently wrong continuation."""
    target, seq, drafter = runs("qwen3")
    monkeypatch.setattr(CacheRollback, "commit", lambda self, cache, keep, block_len: None)
    with pytest.raises(AssertionError, match=f"holds {len(PROMPT) + B} positions, committed length is "
                                             f"{len(PROMPT) + 3}"):
        dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES), PROMPT,
                        NEW, eos_token_ids=[])


def test_rotating_sliding_window_caches_roll_back(folders):
    """Llama with sliding-window layers (mlx_lm ``RotatingKVCache``), the window overrun many times."""
    from mlx_lm.models.cache import RotatingKVCache, trim_prompt_cache
    from mlx_lm.utils import load

    path = folders("llama")[1]
    layer_types = ["sliding_attention", "full_attention"] * 4
    model, tok = load(str(path), model_config={"layer_types": layer_types, "sliding_window": 6})
    target = TargetModel(model, tok, config=json.loads((path / "config.json").read_text()))
    assert isinstance(target.new_cache()[0], RotatingKVCache)
    seq = PROMPT + target_generate(target, PROMPT, 40 + 2 * B, eos_token_ids=[]).tokens
    res = dflash_generate(target, ReferenceProposer(seq, [1, 3, 5], B, 288, MISTAKES), PROMPT, 40, eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + 40]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), 40, B, MISTAKES)

    # Why we trim cache by cache: once a window is full, mlx_lm's trim_prompt_cache trims nothing.
    cache = target.new_cache()
    target.forward(mx.array([PROMPT]), cache=cache)
    assert trim_prompt_cache(cache, 3) == 0 and cache[1].offset == len(PROMPT)
    rollback = CacheRollback(target)
    with rollback.recording(cache):
        target.forward(mx.array([seq[len(PROMPT):len(PROMPT) + B]]), cache=cache)
    rollback.commit(cache, keep=3, block_len=B)
    rollback.check(cache, len(PROMPT) + 3)


def _sliding_llama(folders, window: int):
    """The tiny Llama target with every other layer a sliding-window one of ``window`` positions."""
    from mlx_lm.utils import load

    path = folders("llama")[1]
    model, tok = load(str(path), model_config={"layer_types": ["sliding_attention", "full_attention"] * 4,
                                               "sliding_window": window})
    return TargetModel(model, tok, config=json.loads((path / "config.json").read_text()))


def _one_cycle(target) -> tuple[list, CacheRollback]:
    """A cache after the prompt and one verified block of which 3 tokens were kept (checked)."""
    cache = target.new_cache()
    target.forward(mx.array([PROMPT]), cache=cache)
    rollback = CacheRollback(target)
    with rollback.recording(cache):
        target.forward(mx.array([PROMPT[:B]]), cache=cache)
    rollback.commit(cache, keep=3, block_len=B)
    rollback.check(cache, len(PROMPT) + 3)
    return cache, rollback


def test_rollback_between_verify_and_commit_and_after_commit(folders):
    """Between a verify pass and its commit every cache holds the whole block, and the check says so (the last
    commit's keep is not this pass's); a commit, partial or whole, keeps no recorded input; an attention cache
    shorter than the committed length is named like a longer one."""
    target = TargetModel.from_pretrained(folders("qwen3_5")[1])
    cache, rollback = _one_cycle(target)
    committed = len(PROMPT) + 3
    assert rollback._inputs == {}
    with rollback.recording(cache):
        target.forward(mx.array([PROMPT[:B]]), cache=cache)
    assert rollback._inputs
    rollback.check(cache, committed + B)
    rollback.commit(cache, keep=B, block_len=B)
    assert rollback._inputs == {}
    rollback.check(cache, committed + B)
    for wrong in (committed + B - 1, committed + B + 1):
        with pytest.raises(AssertionError, match=f"holds {committed + B} positions, committed length is {wrong}"):
            rollback.check(cache, wrong)


def test_check_sees_attention_buffers_that_lost_committed_rows(folders):
    """The per-cycle check looks at the buffers, not only at the offsets: a trim that cut more rows than it
    moved the offset by (plain or rotating cache) is caught, not read as stale keys next cycle."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    target = _sliding_llama(folders, 64)
    for kind in (RotatingKVCache, KVCache):
        cache, rollback = _one_cycle(target)
        committed = len(PROMPT) + 3
        c = next(c for c in cache if type(c) is kind)
        c.keys, c.values = c.keys[..., :committed - 2, :], c.values[..., :committed - 2, :]
        if kind is RotatingKVCache:
            c._idx = committed - 2  # write index and buffer agree: only the row count is wrong
        with pytest.raises(AssertionError, match="rows"):
            rollback.check(cache, committed)


def test_check_sees_a_rotating_write_index_out_of_step_with_its_buffer(folders):
    """A rotating cache whose write index disagrees with its buffer (rows and offset right) would write the next
    block over committed rows: the check refuses it."""
    from mlx_lm.models.cache import RotatingKVCache

    cache, rollback = _one_cycle(_sliding_llama(folders, 6))
    c = next(c for c in cache if isinstance(c, RotatingKVCache))
    c._idx -= 1
    with pytest.raises(AssertionError, match="write index"):
        rollback.check(cache, len(PROMPT) + 3)


def test_a_key_buffer_exactly_as_long_as_the_committed_tokens_is_no_error(runs):
    """mlx_lm grows a KVCache buffer 256 rows at a time: a whole block accepted right up to the end of the
    buffer leaves it exactly full, which is a complete cache, not one that lost rows."""
    from mlx_lm.models.cache import KVCache

    target, _, drafter = runs("llama")
    prompt = (PROMPT * 13)[:256 - 2 * B]
    seq = prompt + target_generate(target, prompt, 3 * B, eos_token_ids=[]).tokens
    full = []

    def exactly_full(cache, committed):
        full.extend(committed for c in cache if isinstance(c, KVCache) and c.keys.shape[2] == committed)

    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), prompt, 2 * B + 1,
                          eos_token_ids=[], on_cycle=exactly_full)
    assert res.tokens == seq[len(prompt):len(prompt) + 2 * B + 1] and res.acceptance_lengths == [B, B]
    assert set(full) == {256}  # the case the check must accept was reached


def test_trim_rotating_refuses_a_cache_not_in_temporal_order():
    """After single-token updates a full rotating buffer is circular: cutting its tail would drop the wrong
    rows, so trimming it is refused."""
    from mlx_lm.models.cache import RotatingKVCache

    from inference.rollback_mlx import trim_rotating

    c = RotatingKVCache(max_size=4)
    block = mx.zeros((1, 1, 6, 2))
    c.update_and_fetch(block, block)
    trim_rotating(c, 2)  # right after a multi-token update: exact
    assert c.offset == 4 and c._idx == 4 and c.keys.shape[2] == 4
    one = mx.ones((1, 1, 1, 2))
    c.update_and_fetch(one, one)  # wraps around: the buffer is no longer in temporal order
    with pytest.raises(AssertionError, match="not in temporal order"):
        trim_rotating(c, 1)


# ------------------------------------------------------------------------------- stop rules & knobs
def test_eos_inside_an_accepted_block_ends_generation_without_emitting_it(runs):
    target, seq, drafter = runs("qwen3")
    gen = seq[len(PROMPT):]
    k = 11
    eos = gen[k]
    first = gen.index(eos)
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, NEW,
                          eos_token_ids=[eos])
    assert res.tokens == gen[:first] and eos not in res.tokens and res.stop_reason == "eos"
    base = target_generate(target, PROMPT, NEW, eos_token_ids=[eos])
    assert base.tokens == res.tokens and base.stop_reason == "eos"


@pytest.mark.parametrize("max_new", [1, 2, 13])
def test_max_new_tokens_is_exact(runs, max_new):
    target, seq, drafter = runs("qwen3")
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, max_new,
                          eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + max_new] and res.stop_reason == "max_new_tokens"
    assert len(target_generate(target, PROMPT, max_new, eos_token_ids=[]).tokens) == max_new


def test_chunked_prefill_memory_limit_and_smaller_block(runs, monkeypatch):
    target, seq, drafter = runs("qwen3_5")
    limit = mx.set_memory_limit(mx.device_info().get("memory_size", 2**34))
    mx.set_memory_limit(limit)
    during, cleared = [], []
    clear = mx.clear_cache
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(len(during)) or clear())
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES), PROMPT,
                          30, block_size=4, eos_token_ids=[], prefill_step_size=7, memory_limit_gb=1.5,
                          clear_cache_every=2, on_cycle=lambda cache, committed: during.append(mx.get_memory_limit()))
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + 30]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), 30, 4, MISTAKES)
    assert set(during) == {int(1.5 * 2**30)}  # memory_limit_gb is in GiB, in force for the whole decode
    # MLX's buffer cache is cleared after each prefill chunk but the last (20 = 7 + 7 + 6), then every second cycle
    assert cleared == [0, 0] + list(range(2, len(during) + 1, 2))
    assert mx.set_memory_limit(limit) == limit  # restored after the call


def test_prefill_step_that_divides_the_prompt_exactly(runs):
    """A prompt that is a whole number of prefill chunks: the last chunk still gives the first token's logits."""
    target, seq, drafter = runs("qwen3")
    for step in (5, len(PROMPT)):
        res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES),
                              PROMPT, 12, eos_token_ids=[], prefill_step_size=step)
        assert res.tokens == seq[len(PROMPT):len(PROMPT) + 12]
        assert res.prefill_s > 0 and res.decode_s > 0  # both timers are set (report: ttft_s, tok/s)


def test_the_targets_own_eos_ends_generation_when_none_is_given(runs, monkeypatch):
    """eos_token_ids=None: the target's EOS ids stop both loops (what ``generate`` relies on)."""
    target, seq, drafter = runs("qwen3")
    gen = seq[len(PROMPT):]
    eos = gen[9]
    monkeypatch.setattr(target, "eos_token_ids", lambda: [eos])
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, NEW)
    assert res.tokens == gen[:gen.index(eos)] and res.stop_reason == "eos"
    base = target_generate(target, PROMPT, NEW)
    assert base.tokens == res.tokens and base.stop_reason == "eos"


def test_baseline_sampling_follows_the_seed(runs):
    target, _, _ = runs("qwen3")
    a, b, c = (target_generate(target, PROMPT, 20, temperature=0.8, seed=s, eos_token_ids=[]).tokens
               for s in (5, 5, 6))
    assert a == b and a != c and len(a) == len(c) == 20


def test_sampling_follows_the_tempered_softmax():
    from inference.mlx_loop import sample

    logits = mx.array([2.0, 1.0, 0.0, -1.0])
    draws = np.array(sample(mx.broadcast_to(logits, (40000, 4)), 0.7, mx.random.key(0)))
    freq = np.bincount(draws, minlength=4) / 40000
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=torch.float64) / 0.7, 0)
    assert_close(freq, expected, atol=0.01, what="sample frequencies")
    assert np.array(sample(logits, 0.0)).item() == 0  # greedy


def test_temperature_sampling_is_seeded_and_exact_in_length(runs, tmp_path):
    target, _, drafter = runs("qwen3")
    proposer = DrafterProposer(mlx_drafter(drafter, tmp_path), target)
    a = dflash_generate(target, proposer, PROMPT, 20, temperature=0.8, seed=5, eos_token_ids=[])
    b = dflash_generate(target, proposer, PROMPT, 20, temperature=0.8, seed=5, eos_token_ids=[])
    c = dflash_generate(target, proposer, PROMPT, 20, temperature=0.8, seed=6, eos_token_ids=[])
    assert a.tokens == b.tokens and len(a.tokens) == len(c.tokens) == 20 and a.tokens != c.tokens
    assert all(0 <= t < 288 for t in a.tokens)


def test_every_committed_token_is_a_sample_of_the_tempered_target(runs):
    """At temperature T each committed token is drawn from softmax(target logits / T) at its prefix: both the
    prefill's token and the verify pass's. Over many draws the mean surprisal -log p(token) equals the mean
    entropy of p; a loop that took the argmax instead would sit well below it (printed as ``greedy``)."""
    target, seq, drafter = runs("qwen3")
    T, n_new = 1.0, 8
    gaps: dict[str, list] = {"prefill": [], "verify": []}
    greedy: dict[str, list] = {"prefill": [], "verify": []}
    for s in range(30):
        res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, n_new,
                              temperature=T, seed=s, eos_token_ids=[])
        assert len(res.tokens) == n_new
        ids = PROMPT + res.tokens
        logits = torch.tensor(np.array(target.forward(mx.array([ids]), cache=target.new_cache()).logits[0]),
                              dtype=torch.float64)
        logp = torch.log_softmax(logits[len(PROMPT) - 1:-1] / T, dim=-1)  # row i predicts token i
        entropy = -(logp.exp() * logp).sum(-1)
        for i, tok in enumerate(res.tokens):
            where = "prefill" if i == 0 else "verify"
            gaps[where].append((-logp[i, tok] - entropy[i]).item())
            greedy[where].append((-logp[i].max() - entropy[i]).item())
    for where, gap in gaps.items():
        gap = np.array(gap)
        bound = 4 * gap.std() / np.sqrt(len(gap))  # four standard errors
        assert abs(gap.mean()) < bound < abs(np.mean(greedy[where])), (
            f"{where} tokens: surprisal - entropy {gap.mean():.3f} (bound {bound:.3f}, greedy "
            f"{np.mean(greedy[where]):.3f})")


def test_each_verify_pass_samples_with_fresh_randomness(runs):
    """The key is split anew for every draw: at a temperature where the target is all but uniform, the target's
    tokens of successive cycles (one committed per cycle: the drafts are the greedy ones) are as many different
    ids as draws, not one id drawn again from the same noise each cycle."""
    target, seq, drafter = runs("qwen3")
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, 16,
                          temperature=1e6, seed=0, eos_token_ids=[])
    assert len(res.tokens) == 16 and res.acceptance_lengths == [1] * 15
    assert len(set(res.tokens[1:])) >= 12


def test_drafter_runs_in_the_target_compute_dtype(folders, tmp_path):
    hf, converted = folders("qwen3")
    target = TargetModel.from_pretrained(converted, dtype=mx.bfloat16)
    assert target.dtype == mx.bfloat16
    torch.manual_seed(1)
    drafter = mlx_drafter(TorchDrafter(tiny_drafter_config(target)), tmp_path).quantize(bits=4, group_size=32)
    assert drafter.dtype == mx.float32
    proposer = DrafterProposer(drafter, target)
    assert drafter.dtype == mx.bfloat16 and drafter.fc.scales.dtype == mx.bfloat16
    res = dflash_generate(target, proposer, PROMPT, 12, eos_token_ids=[])
    assert len(res.tokens) == 12


def test_dtype_casts_floating_weights_only_and_keeps_gated_delta_net_decay_in_float32(folders):
    """``dtype`` casts the floating weights: a 4-bit target keeps its packed integers (only scales and biases
    follow), and Qwen3.5's GatedDeltaNet ``A_log`` stays float32 as mlx_lm's ``cast_predicate`` asks."""
    from mlx.utils import tree_flatten

    quantized = dict(tree_flatten(TargetModel.from_pretrained(folders("qwen3_q4")[1], dtype=mx.bfloat16)
                                  .model.parameters()))
    assert quantized["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    assert quantized["model.layers.0.mlp.up_proj.scales"].dtype == mx.bfloat16
    hybrid = TargetModel.from_pretrained(folders("qwen3_5")[1], dtype=mx.bfloat16)
    params = dict(tree_flatten(hybrid.model.parameters()))
    decay = [k for k in params if k.endswith("A_log")]
    assert decay and all(params[k].dtype == mx.float32 for k in decay)
    assert {params[k].dtype for k in params if not k.endswith("A_log")} == {mx.bfloat16}
    assert hybrid.dtype == mx.bfloat16


def test_max_position_embeddings_is_the_configs_or_32768(runs, monkeypatch):
    target, _, _ = runs("qwen3")
    assert target.max_position_embeddings == 4096  # the tiny config's
    monkeypatch.setattr(target.args, "max_position_embeddings", None)
    assert target.max_position_embeddings == 32768  # a config without it: the usual Qwen3 / Llama context


def test_mlx_lm_overrides_fill_what_transformers_5_configs_spell_differently():
    from models.target_mlx import mlx_lm_overrides

    assert mlx_lm_overrides({"model_type": "qwen3_moe", "num_local_experts": 4}) == {
        "num_experts": 4, "mlp_only_layers": []}  # mlx_lm needs both; a transformers 5 config may have neither
    assert mlx_lm_overrides({"model_type": "qwen3_moe", "num_experts": 8, "num_local_experts": 4,
                             "mlp_only_layers": [1]}) == {"mlp_only_layers": [1]}
    assert mlx_lm_overrides({"model_type": "qwen3_5_text", "rope_parameters": {"rope_theta": 5e6}}) == {
        "model_type": "qwen3_5", "rope_theta": 5e6}
    assert mlx_lm_overrides({"model_type": "qwen3", "rope_theta": 1e6, "rope_parameters": {"rope_theta": 5e6}}) == {}
    assert mlx_lm_overrides({"model_type": "qwen3_5", "text_config": {}, "rope_parameters": {"rope_theta": 5e6}}) == {}
    # GLM / Qwen3-Next / DeepSeek-V3 / Kimi: mlx_lm's rope keys from transformers 5's rope_parameters (a YaRN block
    # becomes rope_scaling: without it DeepSeek-V3 runs plain RoPE, silently); a published config keeps its own
    yarn = {"rope_type": "yarn", "factor": 64.0, "rope_theta": 5e4}
    assert mlx_lm_overrides({"model_type": "glm4_moe", "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}}) == {
        "rope_theta": 1e6, "partial_rotary_factor": 0.5, "rope_scaling": None}
    assert mlx_lm_overrides({"model_type": "deepseek_v3", "rope_parameters": yarn}) == {
        "rope_theta": 5e4, "rope_scaling": yarn}
    text = {"model_type": "deepseek_v3", "hidden_size": 8, "rope_parameters": yarn}
    assert mlx_lm_overrides({"model_type": "kimi_k25", "text_config": text}) == {
        "text_config": {**text, "rope_theta": 5e4, "rope_scaling": yarn}}  # the whole text config: mlx_lm replaces it
    published = {"model_type": "deepseek_v3", "rope_theta": 5e4, "rope_scaling": {"type": "yarn", "factor": 64.0}}
    assert mlx_lm_overrides(published) == {} and mlx_lm_overrides({"model_type": "kimi_k25", "text_config":
                                                                    published}) == {}


def test_a_kimi_folder_as_transformers_writes_it_loads_in_mlx_lm(tmp_path):
    """transformers 5.24 saves Kimi K2.5's text layers as language_model.model.blocks.N and its projector under
    model.mm_projector, which mlx_lm refuses ("parameters not in model"): the loader renames them."""
    from models.target import TargetModel as TorchTarget
    from models.tiny import tiny_target, tiny_tokenizer

    full = tiny_target("kimi_k25", num_layers=4)
    full.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    target = TargetModel.from_pretrained(tmp_path)
    ids = PROMPT[:12]
    ref = TorchTarget.from_pretrained(tmp_path, dtype=torch.float32).forward(torch.tensor([ids]), [1])
    out = target.forward(mx.array([ids]), [1], cache=target.new_cache())
    assert_close(np.array(out.logits), ref.logits, 1e-4, "logits")
    assert_close(np.array(out.features), ref.features, 1e-4, "layer 1")


def test_logits_slice_gives_only_the_requested_positions(runs):
    """The prefill asks for the last position's logits only (a long prompt's full logits are prompt x vocab)."""
    target, _, _ = runs("qwen3")
    full = target.forward(mx.array([PROMPT]), cache=target.new_cache()).logits
    last = target.forward(mx.array([PROMPT]), [1], cache=target.new_cache(), logits_slice=slice(-1, None))
    assert full.shape == (1, len(PROMPT), 288) and last.logits.shape == (1, 1, 288)
    assert np.array_equal(np.array(last.logits[0, 0]), np.array(full[0, -1]))
    assert last.features.shape == (1, len(PROMPT), target.hidden_size)  # features still cover every position
    assert target.forward(mx.array([PROMPT]), [1], cache=target.new_cache(), with_logits=False).logits is None


def test_layer_types_name_each_decoder_layer(runs, folders):
    from mlx_lm.utils import load

    assert runs("qwen3")[0].layer_types == ["full_attention"] * 8 and not runs("qwen3")[0].is_hybrid
    hybrid = runs("qwen3_5")[0]
    linear = [i for i, _ in hybrid.linear_attention_layers()]
    assert hybrid.is_hybrid and 0 < len(linear) < hybrid.num_layers
    assert [i for i, kind in enumerate(hybrid.layer_types) if kind == "linear_attention"] == linear
    assert {kind for i, kind in enumerate(hybrid.layer_types) if i not in linear} == {"full_attention"}
    path = folders("llama")[1]
    model, tok = load(str(path), model_config={"layer_types": ["sliding_attention", "full_attention"] * 4,
                                               "sliding_window": 6})
    sliding = TargetModel(model, tok, config=json.loads((path / "config.json").read_text()))
    assert sliding.layer_types == ["sliding_attention", "full_attention"] * 4 and not sliding.is_hybrid


def test_eos_ids_come_from_the_wrapper_then_the_tokenizer_then_the_config(runs, monkeypatch):
    """mlx_lm's tokenizer wrapper knows every EOS (tokenizer and generation_config); without it the HF tokenizer's
    EOS, then ``eos_token_id`` of the config or of its ``text_config`` (multimodal checkpoints). Sorted ids."""
    target, _, _ = runs("qwen3")
    wrapper = target.tokenizer_wrapper
    assert target.eos_token_ids() == [258]
    monkeypatch.setattr(wrapper, "eos_token_ids", {258, 7})  # as a generation_config listing two
    assert target.eos_token_ids() == [7, 258]
    bare = TargetModel(target.model, target.tokenizer, config={})  # a bare HF tokenizer: itself, not its Rust core
    assert bare.tokenizer is target.tokenizer and bare.tokenizer("ab")["input_ids"] == [64, 65]
    assert bare.eos_token_ids() == [258]
    assert TargetModel(target.model, None, config={"eos_token_id": 5}).eos_token_ids() == [5]
    nested = {"text_config": {"eos_token_id": [9, 4]}}
    assert TargetModel(target.model, None, config=nested).eos_token_ids() == [4, 9]
    assert TargetModel(target.model, None, config={}).eos_token_ids() == []


def test_load_gives_a_ready_target_and_drafter(folders, runs, tmp_path):
    from inference.mlx_loop import load

    _, seq, drafter = runs("qwen3")
    drafter.save_pretrained(tmp_path / "drafter")
    target, proposer = load(str(folders("qwen3")[1]), str(tmp_path / "drafter"))
    res = dflash_generate(target, proposer, PROMPT, 16, eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + 16]
    assert json.loads(json.dumps(res.to_json()))["num_tokens"] == 16
    assert target.tokenizer("ab")["input_ids"] == [64, 65]  # the HF tokenizer, callable like the torch one
    assert target.eos_token_ids() == [258]
    target, proposer = load(str(folders("qwen3")[1]), str(tmp_path / "drafter"), dtype="bfloat16")
    assert target.dtype == proposer.drafter.dtype == mx.bfloat16


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v3", "kimi_k25"])
def test_new_family_caches_roll_back_to_what_the_committed_tokens_give(runs, arch):
    """Qwen3-Next: its GatedDeltaNet (ArraysCache) is restored from the snapshot and the kept tokens are replayed
    through the layer's own mixer (trimming an ArraysCache does nothing: 4.4 off); latent attention (DeepSeek-V3,
    Kimi): its KVCache holds one latent and one rope key per position and is trimmed. Either way the cache equals
    feeding only the committed tokens, and the next token's logits agree."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    target, seq, _ = runs(arch)
    block, keep = seq[len(PROMPT):len(PROMPT) + B], 3
    rolled, ref = target.new_cache(), target.new_cache()
    for cache in (rolled, ref):
        target.forward(mx.array([PROMPT]), cache=cache)
    rollback = CacheRollback(target)
    assert bool(rollback.linear) == (arch == "qwen3_next")
    with rollback.recording(rolled):
        target.forward(mx.array([block]), cache=rolled)
    rollback.commit(rolled, keep=keep, block_len=B)
    rollback.check(rolled, len(PROMPT) + keep)
    target.forward(mx.array([block[:keep]]), cache=ref)
    for i, (a, b) in enumerate(zip(rolled, ref)):
        if isinstance(a, ArraysCache):
            for j, what in enumerate(("conv window", "recurrent state")):
                assert_close(np.array(a.cache[j]), np.array(b.cache[j]), 1e-4, f"layer {i} {what}")
        else:
            assert isinstance(a, KVCache) and a.offset == b.offset == len(PROMPT) + keep
            n = a.offset
            for x, y, what in ((a.keys, b.keys, "keys"), (a.values, b.values, "values")):
                assert_close(np.array(x[..., :n, :]), np.array(y[..., :n, :]), 1e-5, f"layer {i} {what}")
    step = mx.array([[seq[len(PROMPT) + keep]]])
    assert_close(np.array(target.forward(step, cache=rolled).logits), np.array(target.forward(step, cache=ref).logits),
                 1e-4, "next-token logits")


# ------------------------------------------------------------------------------------------ DFlash2
def dflash2_pair(folders, runs, arch: str, tmp_path, kind: str = "random"):
    """The MLX target, the torch target of the same folder, its greedy continuation, and a DFlash2 drafter (random:
    convs off identity, the selector on, sliding window 24; or the bigram walk) in torch and as MLX loads it."""
    from models.drafter2_mlx import load_drafter
    from models.target import TargetModel as TorchTarget
    from tests.helpers.dflash2 import bigram_dflash2, random_dflash2, tiny_v2_config

    target, seq, _ = runs(arch)
    torch_target = TorchTarget.from_pretrained(folders(arch)[0], dtype=torch.float32)
    if kind == "random":
        drafter = random_dflash2(tiny_v2_config(torch_target), seed=0)
    else:
        drafter = bigram_dflash2(torch_target, seq)
    drafter.save_pretrained(tmp_path / f"v2-{kind}")
    return target, torch_target, seq, drafter, load_drafter(tmp_path / f"v2-{kind}")


def recorded_cycles(monkeypatch) -> list:
    from inference.stats import GenerationResult

    seen, real = [], GenerationResult.record_cycle
    monkeypatch.setattr(GenerationResult, "record_cycle", lambda self, drafts, tokens, *a, **k: seen.append(
        (list(drafts), list(tokens))) or real(self, drafts, tokens, *a, **k))
    return seen


@pytest.mark.parametrize("kind", ["random", "bigram"])
@pytest.mark.parametrize("arch", ARCHS)
def test_dflash2_mlx_loop_equals_the_torch_loop(folders, runs, arch, kind, tmp_path, monkeypatch):
    """Greedy with a DFlash2 drafter (the selector walk in ``propose_block``): the MLX loop drafts, verifies and
    accepts what the torch eager loop does, cycle by cycle, and is lossless; the bigram walk accepts several
    tokens a cycle."""
    from inference import torch_loop
    from models.drafter2_mlx import DFlash2DraftModel

    target, torch_target, seq, drafter, mlx_v2 = dflash2_pair(folders, runs, arch, tmp_path, kind)
    assert isinstance(mlx_v2, DFlash2DraftModel)
    new = 32
    mine = recorded_cycles(monkeypatch)
    ours = dflash_generate(target, DrafterProposer(mlx_v2, target), PROMPT, new, eos_token_ids=[])
    monkeypatch.undo()
    theirs_cycles = recorded_cycles(monkeypatch)
    theirs = torch_loop.dflash_generate(torch_target, torch_loop.DrafterProposer(drafter, torch_target), PROMPT, new,
                                        eos_token_ids=[])
    assert ours.tokens == theirs.tokens == seq[len(PROMPT):len(PROMPT) + new]
    assert mine == theirs_cycles and ours.acceptance_lengths == theirs.acceptance_lengths
    if kind == "bigram":
        assert max(ours.acceptance_lengths) >= 3


def test_dflash2_mlx_loop_with_a_smaller_block_equals_the_torch_loop(folders, runs, tmp_path):
    """A block shorter than the trained one is one shorter block for the convs, as in torch: same tokens and
    acceptance lengths, lossless."""
    from inference import torch_loop

    target, torch_target, seq, drafter, mlx_v2 = dflash2_pair(folders, runs, "qwen3", tmp_path, "bigram")
    ours = dflash_generate(target, DrafterProposer(mlx_v2, target), PROMPT, 24, block_size=3, eos_token_ids=[])
    theirs = torch_loop.dflash_generate(torch_target, torch_loop.DrafterProposer(drafter, torch_target), PROMPT, 24,
                                        block_size=3, eos_token_ids=[])
    assert ours.tokens == theirs.tokens == seq[len(PROMPT):len(PROMPT) + 24]
    assert ours.acceptance_lengths == theirs.acceptance_lengths and max(ours.acceptance_lengths) >= 2


def test_mlx_dflash2_proposer_drafts_what_the_torch_proposer_drafts(folders, runs, tmp_path):
    """Cycle by cycle with uneven commits (the window of 24 cutting the context): the same walk."""
    from inference import torch_loop

    target, torch_target, seq, drafter, mlx_v2 = dflash2_pair(folders, runs, "qwen3", tmp_path)
    feats = torch_target.forward(torch.tensor([seq]), drafter.config.target_layer_ids, with_logits=False).features
    ours, theirs = DrafterProposer(mlx_v2, target), torch_loop.DrafterProposer(drafter, torch_target)
    start, new = len(PROMPT), feats[:, :len(PROMPT)]
    for keep in (3, 1, 8, 2, 5, 8, 4):
        a = theirs.propose(seq[start], new, start, B)
        b = ours.propose(seq[start], mx.array(new.numpy()), start, B)
        assert a.drafts.tolist() == np.array(b.drafts).tolist(), f"drafts at {start}"
        assert ours.context_length() == theirs.context_length() == start
        new, start = feats[:, start:start + keep], start + keep


def test_mlx_rejection_sampling_commits_the_targets_distribution():
    """The MLX ``accept`` with a q on the hand-made block of the torch test, 10,000 cycles (an MLX call costs more):
    the same checks, whose tolerances scale with the sample size."""
    from inference.mlx_loop import Proposal, accept
    from tests.helpers.dflash2 import REJECTION_P, REJECTION_T, check_rejection_trials, rejection_trials

    logits = mx.array((REJECTION_T * np.log(REJECTION_P)).astype(np.float32))
    keys = iter(mx.random.split(mx.random.key(0), 10000))

    def accept_block(drafts, q, candidates):
        proposal = Proposal(mx.array(drafts), mx.array(q.astype(np.float32)), mx.array(candidates))
        return accept(logits, proposal, REJECTION_T, next(keys)).tolist()

    check_rejection_trials(rejection_trials(accept_block, n=10000))


def test_sampled_dflash2_generation_in_mlx_is_seeded_and_lossless_in_distribution(folders, runs, tmp_path):
    """At T = 0.7 the bigram walk's drafts are sampled (its q kept) and verified by rejection sampling: a seed fixes
    the output, drafts are both accepted and rejected, and each committed token is a draw from the tempered
    target at its prefix (mean surprisal minus entropy 0 within 4 standard errors over 20 generations)."""
    target, _, _, _, mlx_v2 = dflash2_pair(folders, runs, "qwen3", tmp_path, "bigram")
    proposer = DrafterProposer(mlx_v2, target)
    T, n_new, gaps, lengths = 0.7, 12, [], []
    a = dflash_generate(target, proposer, PROMPT, n_new, temperature=T, seed=3, eos_token_ids=[])
    assert a.tokens == dflash_generate(target, proposer, PROMPT, n_new, temperature=T, seed=3, eos_token_ids=[]).tokens
    for s in range(20):
        res = dflash_generate(target, proposer, PROMPT, n_new, temperature=T, seed=s, eos_token_ids=[])
        lengths += res.acceptance_lengths
        ids = PROMPT + res.tokens
        logits = torch.tensor(np.array(target.forward(mx.array([ids]), cache=target.new_cache()).logits[0]),
                              dtype=torch.float64)
        logp = torch.log_softmax(logits[len(PROMPT) - 1:-1] / T, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        gaps += [(-logp[i, tok] - entropy[i]).item() for i, tok in enumerate(res.tokens[1:], 1)]
    gaps = np.array(gaps)
    bound = 4 * gaps.std() / np.sqrt(len(gaps))
    assert abs(gaps.mean()) < bound, f"surprisal - entropy {gaps.mean():.3f} (bound {bound:.3f})"
    assert max(lengths) >= 3 and lengths.count(1) >= 20  # drafts accepted, and rejected


def test_mlx_sessions_load_the_published_dflash2_layout(tmp_path):
    """``--backend mlx`` with a folder laid out as z-lab publishes DFlash2 drafters: the DFlash2 class, lossless."""
    from inference.session import Session
    from models.drafter2_mlx import DFlash2DraftModel
    from models.tiny import save_tiny_target
    from tests.helpers.dflash2 import published_folder

    target = save_tiny_target(tmp_path / "target6", num_layers=6)  # the fixture's target depth
    session = Session("mlx", str(target), str(published_folder(tmp_path / "published")), dtype="float32")
    assert isinstance(session.proposer.drafter, DFlash2DraftModel)
    result, base = session.run(PROMPT, baseline=True, max_new_tokens=16, eos_token_ids=[])
    assert result.tokens == base.tokens and len(result.tokens) == 16


# ------------------------------------------------------------------------- gpt-oss and Gemma 4 (issue 46)
@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4"])
def test_gemma_embedding_scale_and_soft_capped_logits_match_torch(folders, arch):
    """mlx_lm scales Gemma's embedding in the model's forward, not in embed_tokens: the adapter's embed_tokens
    (what the drafter's block is embedded with) is the scaled one, as in torch; logits are soft-capped in both,
    and the LM head stays the raw (tied) table."""
    from models.target import TargetModel as TorchTarget

    hf = folders(arch)[0]
    target, ref = TargetModel.from_pretrained(hf), TorchTarget.from_pretrained(hf, dtype=torch.float32)
    ids = PROMPT[:12]
    assert_close(np.array(target.embed_tokens(mx.array([ids]))), ref.embed(torch.tensor([ids])), 1e-6,
                 f"{arch} block embedding, MLX vs torch")
    h = np.random.default_rng(0).standard_normal((1, 3, target.hidden_size)).astype(np.float32) * 4
    assert_close(np.array(target.logits(mx.array(h))), ref.logits(torch.from_numpy(h)), 1e-4, "soft-capped logits")
    raw = np.array(target.lm_head(mx.array(h)))
    assert target.softcap == 30.0 and np.abs(raw - np.array(target.logits(mx.array(h)))).max() > 1e-2
    assert target.layer_types == ref.layer_types and target.vocab_size == ref.vocab_size == 288


def test_gpt_oss_yarn_is_transformers_unrounded_one(folders, monkeypatch):
    """gpt-oss ships YaRN with truncate: false; mlx_lm's rope rounds the correction range whatever the config
    says, which moved the tiny target's logits by ~1e-2 (0.12 on another seed; every layer after the first): the
    loader sets the unrounded frequencies, and MLX then matches torch to float32 rounding (~7e-6)."""
    import models.target_mlx
    from models.target import TargetModel as TorchTarget

    hf = folders("gpt_oss")[0]
    ids = PROMPT[:12]
    ref = TorchTarget.from_pretrained(hf, dtype=torch.float32).forward(torch.tensor([ids]), [1]).logits
    fixed = TargetModel.from_pretrained(hf).forward(mx.array([ids]), [1], cache=None).logits
    assert_close(np.array(fixed), ref, 1e-4, "gpt-oss logits, MLX vs torch")
    monkeypatch.setattr(models.target_mlx, "fix_after_load", lambda model, config: None)
    rounded = TargetModel.from_pretrained(hf).forward(mx.array([ids]), [1], cache=None).logits
    assert np.abs(np.array(rounded) - ref.numpy()).max() > 1e-3


def test_gpt_oss_experts_load_from_transformers_layout_and_from_mlx_lms(folders, tmp_path):
    """transformers saves gpt-oss's experts in bf16 as one [E, H, 2I] gate/up tensor (interleaved) and [E, I, H]
    down, which mlx_lm's sanitize does not read; the loader converts them, and a folder written by mlx_lm (split
    experts) loads as it is, to the same model."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_model

    from models.target_mlx import gpt_oss_from_transformers

    hf = folders("gpt_oss")[0]
    a = TargetModel.from_pretrained(hf)
    saved = mx.load(str(hf / "model.safetensors"))
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 128)
    assert gpt_oss_from_transformers({"x": saved["model.norm.weight"]}).keys() == {"x"}  # other layouts pass
    save_model(tmp_path, a.model)
    for f in hf.glob("*.json"):
        (tmp_path / f.name).write_text(f.read_text())
    b = TargetModel.from_pretrained(tmp_path)
    assert "model.layers.0.mlp.experts.gate_proj.weight" in mx.load(str(next(tmp_path.glob("model*.safetensors"))))
    pa, pb = dict(tree_flatten(a.model.parameters())), dict(tree_flatten(b.model.parameters()))
    assert pa.keys() == pb.keys() and all(np.array_equal(np.array(pa[k]), np.array(pb[k])) for k in pa)


@pytest.mark.parametrize("arch", ["gpt_oss_q4", "gemma4_q4"])
def test_quantized_new_families_read_back_in_torch(folders, arch):
    """mlx_lm quantizes both families (4-bit, group 32); torch reads the folder back (gpt-oss's split experts
    re-interleaved and transposed, Gemma's switch_glu experts re-fused) to what MLX runs."""
    from models.target import TargetModel as TorchTarget

    q = folders(arch)[1]
    target, ref = TargetModel.from_pretrained(q), TorchTarget.from_pretrained(q, dtype=torch.float32)
    assert target.quantization == ref.quantization == "mlx-4bit-g32"
    ids = PROMPT[:12]
    out = target.forward(mx.array([ids]), [1, 3], cache=target.new_cache())
    theirs = ref.forward(torch.tensor([ids]), [1, 3])
    assert_close(np.array(out.features), theirs.features, 1e-4, f"{arch} features, MLX vs torch")
    assert_close(np.array(out.logits), theirs.logits, 1e-4, f"{arch} logits, MLX vs torch")
