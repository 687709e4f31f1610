"""The mask token of a drafter's blocks: which embedding row, and why (printed at the start of training).

Resolution order, as the engines resolve it (docs/design.md, "Block and mask token"): an explicit
id; the tokenizer's own mask token; the first embedding row the tokenizer never emits (Qwen3:
151669); a reserved/unused special token (Llama 3.x: 128256 rows = 128000 BPE + 256 reserved
specials, no spare row); else a clear error. Never EOS, pad, BOS, a chat-control token or a token
the chat template or the data produce; never an ordinary text token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from models.config_keys import ConfigError

MASK_NAMES = ("<|mask|>", "<mask>", "[mask]", "<|mask_token|>", "<|fim_mask|>")
RESERVED_NAME = re.compile(r"reserved|unused", re.IGNORECASE)


def choose_mask_token(embedding_rows: int, emitted_ids: Iterable[int]) -> int:
    """First embedding row the tokenizer never emits (Qwen3: 151669)."""
    emitted = set(int(i) for i in emitted_ids)
    for row in range(embedding_rows):
        if row not in emitted:
            return row
    raise ConfigError(
        "mask_token_id", None,
        f"every one of the target's {embedding_rows} embedding rows is a token the tokenizer emits, "
        "so there is no spare row to use as the mask token",
        "pass mask_token_id explicitly (a reserved special token the chat template never produces), "
        "or resize the target embedding by one row",
    )


def tokenizer_emitted_ids(tokenizer) -> set[int]:
    """Every id the tokenizer can produce: its vocabulary plus added/special tokens."""
    ids = set(tokenizer.get_vocab().values())
    ids.update(getattr(tokenizer, "all_special_ids", []) or [])
    return ids


@dataclass
class MaskChoice:
    """The resolved mask token and why it was chosen (printed at the start of training)."""

    id: int
    token: str | None  # the tokenizer's name for the id; None for a spare embedding row
    reason: str


def _special_tokens(tokenizer) -> dict[int, str]:
    """Added tokens marked special (id -> content), plus the named special tokens."""
    out = {int(i): t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
           if getattr(t, "special", True)}
    for i in getattr(tokenizer, "all_special_ids", None) or []:
        out.setdefault(int(i), tokenizer.convert_ids_to_tokens(int(i)))
    return out


def forbidden_mask_ids(tokenizer, produced_ids: Iterable[int] = (), allow_unk: bool = False) -> dict[int, str]:
    """Ids a mask token must never be, with the reason: EOS/pad/BOS/UNK, chat-control tokens (named in
    the chat template), tokens a rendered chat produces, and ``produced_ids`` (what the data holds).

    ``allow_unk``: the UNK token is not refused for being UNK (only if the template or the data produce it). A
    byte-level tokenizer never emits its UNK, and z-lab's Kimi-K2.5 drafter masks with Kimi's ``[UNK]`` (163838):
    an explicit id may name it; the automatic choice still passes it over."""
    bad: dict[int, str] = {}
    for name in ("eos_token_id", "pad_token_id", "bos_token_id") + (() if allow_unk else ("unk_token_id",)):
        i = getattr(tokenizer, name, None)
        for j in (i if isinstance(i, list) else [i]):
            if j is not None:
                bad.setdefault(int(j), name.removesuffix("_id").replace("_", " "))
    template = getattr(tokenizer, "chat_template", None) or ""
    template = " ".join(template.values()) if isinstance(template, dict) else str(template)
    for i, content in _special_tokens(tokenizer).items():
        if content and content in template:
            bad.setdefault(i, "a chat-control token (the chat template writes it)")
    convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a"}]
    for messages, prompt in ((convo, False), (convo[:2], True)):
        try:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
        except Exception:  # a tokenizer without a usable template produces nothing here
            continue
        # transformers 5 returns a BatchEncoding: a mapping, but no dict (iterating it gives its keys)
        for j in ids["input_ids"] if hasattr(ids, "keys") else ids:
            bad.setdefault(int(j), "produced by the chat template")
    for j in produced_ids:
        bad.setdefault(int(j), "present in the training data")
    return bad


def mask_problem(tokenizer, mask_id: int) -> str | None:
    """Why ``mask_id`` is a poor mask for this tokenizer (a token it produces), or None: a spare row
    or an unused special token. Inference uses it to warn about a published drafter's choice."""
    if mask_id not in tokenizer_emitted_ids(tokenizer):
        return None
    bad = forbidden_mask_ids(tokenizer, allow_unk=True)
    if mask_id in bad:
        return bad[mask_id]
    return None if mask_id in _special_tokens(tokenizer) else "an ordinary text token"


def resolve_mask_token(embedding_rows: int, tokenizer, explicit: int | None = None,
                       produced_ids: Iterable[int] = ()) -> MaskChoice:
    """The mask token, as the engines resolve it (docs/design.md, "Block and mask token").

    Order: an explicit id; the tokenizer's own mask token; the first embedding row the tokenizer
    never emits (Qwen3: 151669); a reserved/unused special token (Llama 3.x: 128256 rows = 128000
    BPE + 256 reserved specials, no spare row); else a ``ConfigError``. A token the tokenizer knows
    is accepted only if it is special and never EOS/pad/BOS, a chat-control token, or produced by the
    chat template or the data (``produced_ids``): an ordinary text token is always refused.
    """
    emitted = tokenizer_emitted_ids(tokenizer)
    special = _special_tokens(tokenizer)
    forbidden = forbidden_mask_ids(tokenizer, produced_ids)

    def usable(i: int, bad: dict[int, str] = forbidden) -> str | None:
        """None if ``i`` may be the mask token, else why not."""
        if not 0 <= i < embedding_rows:
            return f"outside the target embedding ({embedding_rows} rows)"
        if i not in emitted:
            return None
        if i in bad:
            return f"is {tokenizer.convert_ids_to_tokens(i)!r}, {bad[i]}"
        if i not in special:
            return f"is the ordinary text token {tokenizer.convert_ids_to_tokens(i)!r}"
        return None

    def name(i: int) -> str | None:
        return tokenizer.convert_ids_to_tokens(i) if i in emitted else None

    if explicit is not None:
        why = usable(int(explicit), forbidden_mask_ids(tokenizer, produced_ids, allow_unk=True))
        if why:
            raise ConfigError("mask_token_id", explicit, why,
                              "leave drafter.mask_token_id unset to choose automatically, or give a spare embedding "
                              "row or a reserved special token the chat template and the data never produce")
        kind = "a spare embedding row" if explicit not in emitted else f"the special token {name(explicit)!r}"
        return MaskChoice(int(explicit), name(int(explicit)), f"given explicitly ({kind})")
    own = getattr(tokenizer, "mask_token_id", None)
    candidates = ([own] if own is not None else []) + [i for i, t in sorted(special.items())
                                                       if t.lower() in MASK_NAMES]
    for i in candidates:
        if usable(int(i)) is None:
            return MaskChoice(int(i), name(int(i)), "the tokenizer's own mask token")
    for row in range(embedding_rows):
        if row not in emitted:
            return MaskChoice(row, None, "the first embedding row the tokenizer never emits")
    for i, t in sorted(special.items()):
        if RESERVED_NAME.search(t or "") and usable(i) is None:
            return MaskChoice(i, t, "a reserved special token (no spare embedding row; the chat template and "
                                    "the data never produce it)")
    raise ConfigError(
        "mask_token_id", None,
        f"the target's {embedding_rows} embedding rows are all tokens the tokenizer emits, and it has no mask token "
        "and no reserved special token that the chat template and the data never produce",
        "set drafter.mask_token_id to a special token your chat template never writes, or resize the target "
        "embedding by one row",
    )
