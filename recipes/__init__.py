"""Training recipes: one YAML file per target, shipped as package data.

``recipe=NAME`` resolves to ``NAME.yaml`` in this package through ``importlib.resources``
(:func:`train.overrides.recipe_path`), so it works from a checkout, an editable install and a
plain ``pip install .`` alike. ``accelerate/`` holds launcher configs (FSDP, DeepSpeed).
"""
