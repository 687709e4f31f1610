"""The four-tau experiment at a test budget: a drafter trained against the quantized target beats one trained
against the unquantized target *on the quantized target* (train/quant_experiment.py, README "Quantized targets").

The small target is fitted on one standard-library package (``email``); each drafter learns from answers its
own target regenerated; the taus come from the MLX loop on the MLX-quantized folder and the unquantized folder.

OPT-IN (``DRAFTSMITH_SLOW=1``): two drafter trainings, two regenerations and four MLX validations do not fit
the suite's time budget on 2 shared cores (one run took several minutes on the loaded CI box), and the
ordering at this budget has not been confirmed across seeds: see the README table for the measured numbers.
The assertion is kept as stated; it is not weakened to make it pass.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.skipif(not os.environ.get("DRAFTSMITH_SLOW"),
                                reason="opt-in (DRAFTSMITH_SLOW=1): minutes on 2 cores; ordering not yet confirmed "
                                       "across seeds at this budget (README 'Quantized targets')")

MARGIN = 0.05  # tau (pooled over cycles): quantization-aware minus unquantized-trained, on the quantized target


@pytest.mark.parametrize("seed", [0, 1])
def test_training_against_the_quantized_target_recovers_acceptance_on_it(tmp_path, seed):
    from train.quant_experiment import run

    corpus = Path(sysconfig.get_paths()["stdlib"]) / "email"
    report = run(tmp_path, "test", sweep_bits=(3,), bits=3, group_size=64, seed=seed, corpus=str(corpus),
                 log=lambda *_: None)
    four = {k: v["tau"] for k, v in report["four_tau"].items()}
    assert set(four) == {"unquantized_drafter_on_quantized", "quantized_drafter_on_quantized",
                         "unquantized_drafter_on_unquantized", "quantized_drafter_on_unquantized"}
    assert all(1.0 <= t <= 8.0 for t in four.values()), four  # block 8: 1..8 tokens per cycle
    assert four["quantized_drafter_on_quantized"] >= four["unquantized_drafter_on_quantized"] + MARGIN, four
    assert (tmp_path / f"report-3bit-e3-s{seed}.json").is_file()
