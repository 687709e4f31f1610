"""The lab: experiments, ablations and sweeps, run from a checkout and never installed.

    python -m lab.small_target --out runs/small-target   # a small trained target to experiment on
    python -m lab.ablate --list                          # the recipe ablation
    python -m lab.quant_experiment --out runs/qx         # the four-tau quantized-target experiment
    python -m lab.flex_sweep --e2e qwen35-9b             # flex backward tiles (CUDA)

The lab may import every product folder (models, data, train, export, inference, recipes); nothing of
the product imports the lab (tests/test_layering.py checks both). pyproject.toml's package list leaves it
out of the wheel, so ``pip install .`` ships what a user runs and nothing else.
"""
