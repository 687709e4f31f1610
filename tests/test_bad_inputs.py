"""Bad inputs a user actually makes, each ending in a clear error (or a correct rebuild), never silently.

One module so none of them regresses. Each section belongs to one part of the pipeline; a case is
a plain test function (or a parametrized table) named after the mistake it guards against.
"""

from __future__ import annotations

import pytest  # noqa: F401  (used by the sections below)

# ---------------------------------------------------------------- config, resume, data re-use (train/, data/)


# ---------------------------------------------------------------- mask token


# ---------------------------------------------------------------- generate / validate (inference/)


# ---------------------------------------------------------------- export and push (export/)


# ---------------------------------------------------------------- quantized targets


# ---------------------------------------------------------------- scale-out
