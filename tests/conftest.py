"""Session fixtures shared by every stage's tests (plain helpers live in ``tests/helpers``)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # tiny models: thread start-up costs more than it saves, and CI has 2 cores


def pytest_xdist_auto_num_workers(config) -> int:
    """``pytest -n auto``: one worker per core, at most 4 (each builds the session's tiny targets and fixtures
    again, and some tests start two training processes of their own)."""
    return max(1, min(4, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_targets():
    """Tiny targets by architecture, built once per session."""
    from models.target import TargetModel
    from models.tiny import default_template, tiny_target, tiny_tokenizer

    cache = {}

    def get(arch: str):
        if arch not in cache:
            tok = tiny_tokenizer(default_template(arch))
            cache[arch] = TargetModel(tiny_target(arch, seed=0), tok)
        return cache[arch]

    return get


@pytest.fixture
def pyarrow_pickled_by_value(monkeypatch):
    """``datasets`` hashing as on a node whose pyarrow lies outside the interpreter's prefixes and outside any
    ``site-packages`` folder (``pip install --target``, a shared folder on ``PYTHONPATH``): dill then pickles the
    pyarrow module by value, so hashing any in-memory Arrow table fails with "Can't pickle <class
    'MonthDayNano'>", whatever the Python version. A hash failure that ``datasets`` would swallow (a random
    fingerprint and a warning, so its cache and our resume would stop matching) fails the test as well."""
    import datasets.fingerprint
    import dill._dill
    import pyarrow

    builtin = dill._dill._is_builtin_module
    monkeypatch.setattr(dill._dill, "_is_builtin_module", lambda module: module is not pyarrow and builtin(module))

    def no_random_hash(*args, **kwargs):
        raise AssertionError("datasets could not hash a transform or its arguments and fell back to a random hash")
    monkeypatch.setattr(datasets.fingerprint, "generate_random_fingerprint", no_random_hash)


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    """A fitted tiny target and its regenerated, prepared tiny chat data (recipe overrides)."""
    from tests.helpers.tiny_run import tiny_input_dirs

    d = tiny_input_dirs(tmp_path_factory)
    return [f"target.path={d['target']}", f"data.prepared={d['data']}"]


# Fixtures of the bad-input cases that several stages share (tests/<stage>/test_bad_inputs.py).
@pytest.fixture
def export_drafter(tmp_path):
    """A small drafter folder (HF layout, fp32) as training writes final/drafter."""
    import torch

    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel

    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=300, num_target_layers=8,
                       target_layer_ids=[1, 3, 5], mask_token_id=290, block_size=4, torch_dtype="float32")
    torch.manual_seed(0)
    return DFlashDraftModel(cfg).save_pretrained(tmp_path / "drafter")


# Every case here ends before any weights load: the target folders below hold config.json and the
# tokenizer only, so a check that ran after loading would fail differently.
@pytest.fixture(scope="module")
def infer_dirs(tmp_path_factory):
    """A config-only tiny target, a drafter config for it, and a full tiny target (for the loops)."""
    import shutil

    import torch

    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import save_tiny_target
    from tests.helpers import tiny_drafter_config

    root = tmp_path_factory.mktemp("infer_bad")
    full = save_tiny_target(root / "full", "qwen3")
    target = TargetModel.from_pretrained(full)
    torch.manual_seed(0)
    DFlashDraftModel(tiny_drafter_config(target)).save_pretrained(root / "draft")
    (root / "target").mkdir()
    for f in full.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, root / "target" / f.name)
    return {"root": root, "target": str(root / "target"), "draft": str(root / "draft"), "full": target,
            "full_dir": str(full)}


@pytest.fixture
def no_cuda(monkeypatch):
    """As on a machine without CUDA, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_build(monkeypatch):
    """Building a recipe-shaped target fails the test: refusals must come before it."""
    import models.random_target

    def refuse(*a, **k):
        raise AssertionError("a random target was built")
    monkeypatch.setattr(models.random_target, "recipe_target", refuse)


@pytest.fixture(scope="module")
def data_target(tmp_path_factory):
    from models.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("reuse") / "target", "qwen3", num_layers=2)
