"""Prompt sets shipped with draftsmith for ``python -m inference.validate`` (original text, written for it).

One JSONL file per category, one chat per line: ``{"id": ..., "messages": [{"role": "user", ...}]}``.
``code``, ``math`` and ``chat`` hold 30 short prompts each; ``long`` holds 24 questions over four
documents of 350-800 words (an incident report, council minutes, a Python module, a lab notebook),
so the drafter is measured with a long context too.
"""
