"""lab/gpu/e2e.py's own parts (its GPU runs are measured, not tested): the synthetic rows fill the recipe's
row as the bench's do, and the run's MFU is set against the bench's as documented."""

from __future__ import annotations

import json

import pytest


def test_synthetic_chats_fill_the_row_with_a_quarter_prompt(tmp_path):
    from data.chat import tokenize_conversation
    from lab.gpu.e2e import write_chats
    from models.tiny import tiny_tokenizer

    path = write_chats(tmp_path / "chats.jsonl", n=3, prompt_chars=3072 // 4 - 24, answer_chars=3072)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3 and len({r["messages"][1]["content"] for r in rows}) == 3
    row = tokenize_conversation(tiny_tokenizer("chatml"), rows[0]["messages"], thinking=False, max_length=3072)[0][0]
    mask = list(row.loss_mask)
    assert len(row.input_ids) == 3072  # cut at the recipe's max length, as every row of the run
    assert 0.2 < mask.index(1) / 3072 < 0.3 and sum(mask) > 0.7 * 3072  # a quarter prompt, the rest answer


def test_the_runs_mfu_is_the_median_of_steps_20_on_against_the_benchs():
    from lab.gpu.e2e import compare

    rows = [{"step": s, "loss": 1.0, "mfu": m, "tokens_per_s": 1e4} for s, m in
            ((10, 0.30), (20, 0.50), (30, 0.51), (40, 0.49), (50, 0.52), (60, 0.50))]
    rows[0]["compile_s"] = 61.0
    out = compare("qwen35-9b", rows + [{"step": 60, "eval_loss": 2.0}], {"mfu": 0.52, "device": "NVIDIA H200"})
    assert out["run_mfu_median"] == 0.50 and out["run_mfu"] == [0.50, 0.51, 0.49, 0.52, 0.50]
    assert out["ratio"] == pytest.approx(0.50 / 0.52, abs=1e-4) and out["within"] is True  # 3.8% under
    assert out["compile_s"] == 61.0 and out["device"] == "NVIDIA H200"
    assert compare("qwen3-8b", rows, {"mfu": 0.60})["within"] is False  # 17% under
    cpu = compare("qwen3-8b", [{"step": 20, "loss": 1.0, "tokens_per_s": 5.0}], {"tokens_per_s": 9.0})
    assert cpu["run_mfu_median"] is None and cpu["within"] is None
