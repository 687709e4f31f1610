"""`python train/distill.py`: --help explains, mistakes are one clear line, not a traceback."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def distill(*args):
    return subprocess.run([sys.executable, str(ROOT / "train" / "distill.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_help_lists_recipes_and_keys():
    out = distill("--help")
    assert out.returncode == 0
    assert "accelerate launch train/distill.py" in out.stdout and "qwen35-9b" in out.stdout
    assert "train.: epochs" in out.stdout and "features.: mode" in out.stdout


def test_mistakes_are_explained_without_a_traceback():
    typo = distill("recipe=tiny", "train.lrr=1e-3")
    assert typo.returncode != 0 and "did you mean 'train.lr'" in typo.stderr and "Traceback" not in typo.stderr
    bad = distill("recipe=no-such-recipe")
    assert "unknown recipe 'no-such-recipe'" in bad.stderr and "Traceback" not in bad.stderr
    value = distill("recipe=tiny", "train.lr=abc")
    assert "train.lr='abc': expected a number" in value.stderr

