"""The flex-attention backward-tile sweep (a lab experiment): it picks only tiles with torch's gradients."""

from __future__ import annotations


def test_flex_sweep_picks_the_fastest_candidate_with_torchs_gradients():
    from lab.flex_sweep import best, candidates_for

    rows = [{"tiles": "torch", "fwd_bwd_ms": 10.0, "same_grads": True},
            {"tiles": "16,16,16,16,1,4", "fwd_bwd_ms": 5.0, "same_grads": False},  # faster, but wrong
            {"tiles": "32,64,64,32,1,4", "error": "OutOfResources: shared memory"},
            {"tiles": "64,64,64,64,1,8", "fwd_bwd_ms": 8.0, "same_grads": True}]
    assert best(rows) == {"bench": "flex_sweep_best", "tiles": "64,64,64,64,1,8", "fwd_bwd_ms": 8.0,
                          "torch_fwd_bwd_ms": 10.0, "speedup_vs_torch": 1.25}
    assert best(rows[1:3]) is None
    # torch's tiles come first (the gradients' reference), once; given lists replace the built-in ones
    assert candidates_for(128, ["32,64,64,32,3,4", "torch"]) == [None, (32, 64, 64, 32, 3, 4)]
    large, small = candidates_for(256, []), candidates_for(128, [])
    assert large[0] is None and small[0] is None and large != small and len(set(large)) == len(large)


def test_flex_sweep_takes_the_recipe_shape_without_building_its_target():
    """python -m lab.flex_sweep --e2e qwen35-9b needs only the shapes: the 9B target is built on the meta device."""
    import argparse

    from models.random_target import recipe_spec
    from train.bench import e2e_setup

    a = argparse.Namespace(e2e="qwen35-9b", taps=3, target_layers=None, layers=2, seq=256, anchors=[32], block=8,
                           grad_accum=None)
    target = e2e_setup(a, ["--e2e", "qwen35-9b"], recipe_spec("qwen35-9b"), "meta")
    assert next(target.model.parameters()).device.type == "meta"
    assert (a.hidden, a.heads, a.kv_heads, a.head_dim) == (4096, 16, 4, 256)
    assert (a.seq, a.anchors, a.block, a.layers, a.taps, a.grad_accum) == (3072, [512], 16, 5, 5, 4)
