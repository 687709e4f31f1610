"""Speed paths of this stage held to their plain counterparts (same results, CPU): no timing is checked."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_background_shard_writers_give_the_same_store(tiny_targets, tmp_path, dtype):
    """1 or 3 writer threads (shards finishing in any order): byte-identical shards and index, and
    each shard's recorded sha256 (hashed from the serialised bytes) is the file's."""
    from data.bench import random_data
    from data.extract import extract
    from data.store import FeatureStore, sha256_file

    target, data = tiny_targets("qwen3"), random_data(12, 40, 250)
    stores = {}
    for writers in (1, 3):
        out = tmp_path / f"w{writers}"
        report = extract(target, data, out, layer_ids=[1, 3], dtype=dtype, batch_size=2, shard_tokens=100,
                         progress=False, writers=writers)
        assert report.shards_written == report.shards >= 4 and report.complete
        stores[writers] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
        for name, info in FeatureStore(out).index["shards"].items():
            assert sha256_file(out / name) == info["sha256"]
        FeatureStore(out).verify_all()
    assert stores[1] == stores[3]


def test_writers_count_the_final_drain_apart():
    """The wait at exit for shards still being written is the job's drain; a report carries it."""
    import time

    from data.extract import ShardWriters

    class SlowWriter:
        def write_shard(self, k, rows):
            time.sleep(0.2)
            return {"tokens": 1, "bytes": 1}

    written = []
    with ShardWriters(SlowWriter(), 2, written.append) as pool:
        pool.submit(0, [], None)
        pool.submit(1, [], None)
        assert pool.drain_seconds == 0.0
    assert len(written) == 2 and pool.drain_seconds >= 0.15  # both writes were still sleeping at exit


def test_writers_hold_at_most_their_count_of_shards():
    """A full pool makes submit wait for the oldest shard: host memory holds ``threads`` shards, not more."""
    from data.extract import ShardWriters

    class Writer:
        def write_shard(self, k, rows):
            return {"tokens": k, "bytes": 1}

    written = []
    with ShardWriters(Writer(), 2, written.append) as pool:
        for k in range(5):
            pool.submit(k, [], None)
            assert len(pool.pending) <= 2
    assert [w["tokens"] for w in written] == [0, 1, 2, 3, 4]


def test_extract_report_drain_is_part_of_its_seconds(tiny_targets, tmp_path):
    from data.bench import random_data
    from data.extract import extract

    report = extract(tiny_targets("qwen3"), random_data(6, 40, 250), tmp_path / "s", layer_ids=[1, 3],
                     batch_size=2, shard_tokens=80, progress=False, writers=2)
    assert 0.0 <= report.drain_seconds <= report.seconds + 1e-3
    assert '"drain_seconds"' in report.line()


def test_data_bench_extract_figures():
    """Overheads against the forward, the tapped forward and whichever ceiling binds, with and without the drain."""
    from data.bench import extract_figures

    f = extract_figures(tokens=1000, seconds=2.0, drain=0.5, forward_tps=1000.0, tapped_tps=800.0, disk_tps=600.0)
    assert f["tokens_per_s"] == 500.0 and f["overhead_pct_vs_forward"] == 100.0
    assert f["overhead_pct_vs_tapped_forward"] == 60.0 and f["drain_s"] == 0.5
    assert f["steady_tokens_per_s"] == 666.7 and f["steady_overhead_pct_vs_tapped_forward"] == 20.0
    assert f["bound"] == "disk" and f["disk_bound_tokens_per_s"] == 600.0
    assert f["steady_overhead_pct_vs_bound"] == -10.0  # faster than this disk's measured write: its cache
    fast_disk = extract_figures(1000, 2.0, 0.0, 1000.0, 800.0, 5000.0)
    assert fast_disk["bound"] == "forward" and fast_disk["steady_overhead_pct_vs_bound"] == 60.0


def test_direct_safetensors_writer_is_read_back_by_safetensors(tmp_path):
    """Shards are written from the rows' memory (no ``save`` copy): any safetensors reader loads the
    same tensors, a list is its parts laid end to end, and the returned size and sha256 are the file's."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from data.store import sha256_file
    from data.store_writer import write_safetensors

    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, 6, generator=g).to(torch.bfloat16) for n in (3, 5, 1)]
    tensors = {"row_offsets": torch.tensor([0, 3, 8, 9]), "input_ids": torch.arange(9, dtype=torch.int32),
               "loss_mask": torch.tensor([0, 1] * 4 + [1], dtype=torch.int8), "features": rows,
               "fp8": torch.randn(9, 6, generator=g).to(torch.float8_e4m3fn), "scales": torch.rand(9, 2).half()}
    with open(tmp_path / "s.safetensors", "wb") as f:
        size, digest = write_safetensors(f, tensors)
    back = load_file(tmp_path / "s.safetensors")
    assert sorted(back) == sorted(tensors)
    assert torch.equal(back["features"], torch.cat(rows))
    for name in ("row_offsets", "input_ids", "loss_mask", "scales"):
        assert back[name].dtype == tensors[name].dtype and torch.equal(back[name], tensors[name])
    assert torch.equal(back["fp8"].view(torch.uint8), tensors["fp8"].view(torch.uint8))
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as h:
        assert h.get_slice("features").get_shape() == [9, 6]
    assert size == (tmp_path / "s.safetensors").stat().st_size and digest == sha256_file(tmp_path / "s.safetensors")


def test_direct_safetensors_writer_bytes_do_not_depend_on_the_order_tensors_are_given(tmp_path):
    """Tensors are written by sorted name, so equal shards are equal bytes (and equal sha256) whichever order a
    writer built them in; a 0-dim tensor keeps its empty shape."""
    from safetensors.torch import load_file

    from data.store_writer import write_safetensors

    tensors = {"b": torch.arange(4, dtype=torch.int32), "a": torch.ones(2, 3), "step": torch.tensor(7)}
    written = []
    for order in (tensors, dict(reversed(tensors.items()))):
        with open(tmp_path / "s.safetensors", "wb") as f:
            written.append((write_safetensors(f, order), (tmp_path / "s.safetensors").read_bytes()))
    assert written[0] == written[1]
    assert load_file(tmp_path / "s.safetensors")["step"].shape == ()
