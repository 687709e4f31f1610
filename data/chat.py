"""Chat templating and assistant-only loss masks, derived from the target's own template.

No per-family regexes: for every assistant turn ``i`` we ask the template three questions and
diff the answers.

1. ``prompt``  = render(messages[:i], add_generation_prompt=True): what the server feeds the
   target before it answers turn ``i`` (with the thinking switch, e.g. Qwen3's empty
   ``<think></think>`` when thinking is off).
2. ``head`` / ``trailer`` = render(messages[:i] + [assistant: SENTINEL]) split at the sentinel:
   the template's text right before and right after an answer in that position
   (``<|im_start|>assistant\\n`` ... ``<|im_end|>\\n``).
3. ``full`` = render(messages[:i+1]).

The part of the generation prompt that the turn itself also renders is ``lcp(prompt, head)``;
everything of ``full`` after it, minus the trailer, is what the target generated: the answer,
including a ``<think>`` block when thinking is on. The loss mask covers that text plus the first
token of the trailer (the end-of-turn token: ``<|im_end|>``, ``<|eot_id|>``); the rest of the
trailer (a newline) is context. The served text of the turn is ``prompt + generated + trailer``.

Some templates have no end-of-turn token (GLM 4.x: ``...<|assistant|>\n<think></think>\nanswer<|user|>``):
the trailer is empty and the turn ends when the target writes the role token that opens the next turn
(``<|user|>``, or ``<|observation|>`` before a tool result; both are in its generation config's EOS set).
That token, when the template writes a special token right after the answer, is the trailer instead
(a final turn is followed by a user turn), so the drafter learns the stop there too.

Multi-turn: turns are appended to one row while each next prompt extends the text so far. Some
templates re-render history differently from how it was served (Qwen3 drops ``<think>`` blocks of
earlier turns, and its thinking-off prompt adds an empty think block that history lacks); then
the row is split and the next turn starts a new row whose context is exactly its served prompt.
The target is never trained on a context it would not see at serving time.

Segments are tokenized one by one (``add_special_tokens=False``: the template renders BOS
itself), so mask boundaries are exact by construction and the answer's tokens are tokenized
alone, as the server's generated tokens would be.

Templates that read a message's reasoning from ``thinking`` (gpt-oss's harmony, Gemma 4) get it there
whichever name the data uses (``reasoning_content`` or ``thinking``: ``reasoning_field``). Renders are
stable from day to day: the template's ``strftime_now`` (harmony's "Current date:", Llama 3.x's "Today
Date:") answers ``CHAT_DATE`` while draftsmith renders (``pinned_date``), and a template's
``reasoning_effort`` is ``REASONING_EFFORT`` (``template_kwargs``); a server that renders its own date
sees a prompt that differs from ours in that line only.

Regenerated answers carry the ids the target generated (``token_ids`` on the message); those are
used for the answer instead of re-tokenizing its text (decode then encode is not the identity:
BPE merges, invalid UTF-8), when the decoded ids are the answer text the template rendered (or
its end: a template may render an empty think block before the generated text). Otherwise the
text is re-tokenized and the row counts it in ``TokenizedRow.retokenized``.

A regenerated answer cut at the max-token limit (``"cut": true`` on the message, from finish reason
``length``) keeps its answer tokens as labels, but not the end-of-turn token the template appends
after it (its trailer is all context): the target never ended the turn there, and a drafter taught
to would end turns mid-sentence.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass

from transformers.utils import chat_template_utils

SENTINEL = "\u2063DRAFTSMITH\u2063"  # invisible separator: never produced by a template
# Version of the rules above that turn a conversation into labels. Every prepared folder records it, so a
# folder labelled by older rules is rebuilt (its regenerated answers kept) instead of trained as if current.
# 1: a cut answer's end-of-turn token was labelled. 2: it is context. (Labelling the next turn's role token of a
# template without an end-of-turn token changed no version: no family supported before had such a template.)
LABEL_RULES = 2
LABEL_RULES_BEFORE_RECORDED = 1  # folders prepared before the version was recorded


# The date templates read through strftime_now (any fixed day: gpt-oss's release), and gpt-oss's reasoning effort.
CHAT_DATE = datetime.datetime(2025, 8, 5)
REASONING_EFFORT = "medium"
REASONING_FIELDS = ("reasoning_content", "thinking")


class TemplateError(ValueError):
    """The chat template renders a turn in a way the mask derivation cannot follow."""


@dataclass
class Segment:
    text: str
    kind: str  # "context" | "answer" (all loss) | "trailer" (first token loss: end-of-turn) | "cut_trailer" (no loss)
    token_ids: list[int] | None = None  # answer only: the ids the target generated, when known


def require_chat_template(tokenizer, target: str, fix: str = "") -> None:
    """Refuse a tokenizer without a chat template before any work: every conversation would fail to render,
    which prepare reported as "no row has loss tokens ... check --max-length" and regeneration as failed
    conversations to retry (a base model's folder, or a copy that left ``chat_template.jinja`` behind)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise TemplateError(
            f"the tokenizer of {target} has no chat template (neither chat_template.jinja nor a chat_template in "
            "tokenizer_config.json): draftsmith renders conversations with the target's own template; point it at "
            "the chat / instruct model's folder, or copy that model's chat_template.jinja into this one" + fix)


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return " ".join(template.values()) if isinstance(template, dict) else str(template)


@functools.lru_cache(maxsize=32)
def _reads(template: str, name: str) -> bool:
    # any loop variable (message.thinking, m['thinking']); not a name that merely ends in it (enable_thinking)
    return re.search(rf"""\w(\.{name}\b|\[['"]{name}['"]\])""", template) is not None


def reasoning_field(tokenizer) -> str:
    """The message field the template renders reasoning from: ``thinking`` (gpt-oss's harmony, Gemma 4) when it
    reads that one and not ``reasoning_content`` (Qwen3, and the default)."""
    template = _template_text(tokenizer)
    return "thinking" if _reads(template, "thinking") and not _reads(template, "reasoning_content") else \
        "reasoning_content"


def template_kwargs(tokenizer) -> dict:
    """What every render passes besides the thinking switch: for a template that reads it, the pinned reasoning
    effort (gpt-oss)."""
    return {"reasoning_effort": REASONING_EFFORT} if "reasoning_effort" in _template_text(tokenizer) else {}


class _PinnedClock:
    """What a template's ``strftime_now`` asks for the time: ``CHAT_DATE``."""

    @staticmethod
    def now(tz=None) -> datetime.datetime:
        return CHAT_DATE


_CLOCK_LOCK = threading.RLock()


@contextmanager
def pinned_date():
    """Templates rendered inside see ``CHAT_DATE`` as today. transformers gives templates ``strftime_now`` as a
    global of its own (a callable passed as a template variable is replaced by a placeholder), reading the clock
    of its module: that clock is swapped for the call."""
    with _CLOCK_LOCK:
        saved = getattr(chat_template_utils, "datetime", None)
        chat_template_utils.datetime = _PinnedClock
        try:
            yield
        finally:
            chat_template_utils.datetime = saved


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False,
           thinking: bool | None = None) -> str:
    """The target's chat template as text. ``thinking=None`` leaves the template's default. Reasoning goes in the
    field the template reads (``reasoning_field``); date and reasoning effort are pinned (``template_kwargs``)."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    require_chat_template(tokenizer, "the target")
    field = reasoning_field(tokenizer)
    messages = [_reasoning_in(m, field) for m in messages]
    with pinned_date():
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs(tokenizer), **kwargs)


def _reasoning_in(message: dict, field: str) -> dict:
    """The message with its reasoning (under either name) under ``field`` alone."""
    other = next((k for k in REASONING_FIELDS if k != field and k in message), None)
    if other is None:
        return message
    out = {k: v for k, v in message.items() if k != other}
    out.setdefault(field, message[other])
    return out


def _lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prepare_messages(messages: list[dict], thinking: bool | None) -> list[dict]:
    """Messages as the template should see them: thinking off drops reasoning (the server would too)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k in ("role", "content", *REASONING_FIELDS)}
        if thinking is False:
            for k in REASONING_FIELDS:
                m.pop(k, None)
        out.append(m)
    return out


def conversation_segments(tokenizer, messages: list[dict], thinking: bool | None = None) -> list[list[Segment]]:
    """Split a conversation into rows of segments (see the module docstring)."""
    msgs = prepare_messages(messages, thinking)
    rows: list[list[Segment]] = []
    segs: list[Segment] = []
    text = ""
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render(tokenizer, msgs[:i], add_generation_prompt=True, thinking=thinking)
        probe = render(tokenizer, msgs[:i] + [{"role": "assistant", "content": SENTINEL}], thinking=thinking)
        if probe.count(SENTINEL) != 1:
            raise TemplateError("the chat template does not render assistant content verbatim")
        head, trailer = probe.split(SENTINEL)
        full = render(tokenizer, msgs[:i + 1], thinking=thinking)
        start = _lcp(prompt, head)
        if not full.endswith(trailer) or len(full) - len(trailer) <= start:
            raise TemplateError(f"assistant turn {i}: rendered turn does not end with the template's trailer "
                                f"{trailer!r}")
        answer = full[start:len(full) - len(trailer)]
        trailer = trailer or next_turn_token(tokenizer, msgs, i, full, thinking)
        if not prompt.startswith(text):
            rows.append(segs)
            segs, text = [], ""
        segs.append(Segment(prompt[len(text):], "context"))
        segs.append(Segment(answer, "answer", messages[i].get("token_ids")))
        segs.append(Segment(trailer, "cut_trailer" if messages[i].get("cut") else "trailer"))  # cut: no label
        text = prompt + answer + trailer
    rows.append(segs)
    return [r for r in rows if r]


def next_turn_token(tokenizer, msgs: list[dict], i: int, full: str, thinking: bool | None) -> str:
    """The special token a template without an end-of-turn token writes right after assistant turn ``i`` (rendered
    as ``full``) when the conversation goes on: the next message's, else a user turn's. "" when it writes nothing
    there or an ordinary token (then the turn has no stop token to label, as before)."""
    following = msgs[i + 1] if i + 1 < len(msgs) else {"role": "user", "content": SENTINEL}
    after = render(tokenizer, msgs[:i + 1] + [following], thinking=thinking)
    if not after.startswith(full):
        return ""
    ids = encode(tokenizer, after[len(full):])
    special = set(getattr(tokenizer, "all_special_ids", None) or []) | {
        int(k) for k, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if t.special}
    return tokenizer.decode(ids[:1]) if ids and ids[0] in special else ""


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def answer_ids(tokenizer, seg: Segment, end_of_turn: int | None) -> list[int] | None:
    """The generated ids of an answer segment, or None when they do not spell its text."""
    ids = list(seg.token_ids or [])
    if ids and ids[-1] == end_of_turn:  # vLLM includes the stop token; the trailer holds it already
        ids.pop()
    if not ids or any(not isinstance(t, int) or t < 0 for t in ids):  # a negative id is no token (decode overflows)
        return None
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    if tokenizer.pad_token:
        decoded = decoded.replace(tokenizer.pad_token, "")
    if decoded == seg.text:
        return ids
    if decoded and seg.text.endswith(decoded):
        return encode(tokenizer, seg.text[:-len(decoded)]) + ids
    return None


def tokenize_segments(tokenizer, segments: list[Segment]) -> tuple[list[int], list[int], int]:
    """Token ids and the 0/1 loss mask of one row, and how many answers were re-tokenized from text."""
    ids: list[int] = []
    mask: list[int] = []
    retokenized = 0
    for k, seg in enumerate(segments):
        tok = None
        if seg.kind == "answer" and seg.token_ids is not None:
            trailer = encode(tokenizer, segments[k + 1].text) if k + 1 < len(segments) else []
            tok = answer_ids(tokenizer, seg, trailer[0] if trailer else None)
            retokenized += tok is None
        if tok is None:
            tok = encode(tokenizer, seg.text)
        ids += tok
        if seg.kind == "answer":
            mask += [1] * len(tok)
        elif seg.kind == "trailer":
            mask += [1] * min(1, len(tok)) + [0] * max(0, len(tok) - 1)
        else:
            mask += [0] * len(tok)
    return ids, mask, retokenized


@dataclass
class TokenizedRow:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False
    retokenized: int = 0  # regenerated answers whose ids did not spell the rendered text


def tokenize_conversation(tokenizer, messages: list[dict], thinking: bool | None = None,
                          max_length: int | None = None) -> tuple[list[TokenizedRow], int]:
    """Rows of one conversation, truncated to ``max_length``; returns (rows, dropped).

    A row that truncation leaves without loss tokens is dropped (counted), never kept: it would
    cost a target forward and teach nothing.
    """
    if max_length is not None and max_length < 1:  # ids[:-5] kept all but the last 5 tokens, silently
        raise ValueError(f"max_length={max_length}: use 1 or more tokens, or None for no truncation")
    rows, dropped = [], 0
    for segs in conversation_segments(tokenizer, messages, thinking):
        ids, mask, retokenized = tokenize_segments(tokenizer, segs)
        truncated = max_length is not None and len(ids) > max_length
        if truncated:
            ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask) == 0:
            dropped += 1
            continue
        rows.append(TokenizedRow(ids, mask, truncated, retokenized))
    return rows, dropped


def loss_spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` runs of ones: one per assistant turn."""
    spans, start = [], None
    for i, m in enumerate(list(loss_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the vocabulary (token -> id, added tokens included) and the chat template.

    The vocabulary is what token ids mean; the template is how conversations became tokens and
    masks. The offline feature store and the prepared data record it, so a trainer pointed at
    data tokenized by another tokenizer or template fails loudly instead of learning garbage.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    template = getattr(tokenizer, "chat_template", None)
    return hashlib.sha256(json.dumps([vocab, template], ensure_ascii=False).encode()).hexdigest()[:16]
