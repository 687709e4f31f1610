"""Regenerate tests/golden/train_tiny_2step.json: the tiny recipe's first two step losses.

    python tests/golden/make_train_golden.py

On the seeded tiny target and the tiny chat data as written (``tests.helpers.tiny_run.golden_input_dirs``),
which every CPU computes alike. Run it when the objective, the tiny target/data builders or the tiny recipe
change on purpose, and say why in the commit.
"""

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    torch.set_num_threads(1)  # as tests/conftest.py (the value is the same with 2 threads)
    from tests.helpers.tiny_run import FAST, golden_input_dirs, losses, run

    with tempfile.TemporaryDirectory() as tmp:
        inputs = golden_input_dirs(Path(tmp) / "inputs")
        run(Path(tmp) / "run", *inputs, *FAST, "train.max_steps=2", "logging.every=1")
        got = losses(Path(tmp) / "run")
    out = Path(__file__).with_name("train_tiny_2step.json")
    out.write_text(json.dumps({"losses": [got[1], got[2]], "torch": torch.__version__}, indent=2) + "\n")
    print(out, got)


if __name__ == "__main__":
    main()
