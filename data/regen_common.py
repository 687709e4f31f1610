"""What both regeneration clients share: errors, one completion, the run report, result rows.

Split from :mod:`data.regenerate` (which re-exports all of it) so the HTTP client
(:mod:`data.regen_http`) and the in-process generator import the same types without a cycle.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from models.support import UserError


class RegenerationError(UserError, RuntimeError):
    """Regeneration could not run or rows failed after all retries; the message says why and what to do."""


class ServerUnavailable(RegenerationError):
    """The regeneration server does not answer, or serves another model."""


@dataclass
class Completion:
    content: str
    reasoning: str | None
    finish_reason: str  # "stop" | "length"
    tokens: int
    token_ids: list[int] | None = None  # generated ids (an end-of-turn id at the end is dropped later)


@dataclass
class RegenReport:
    rows_total: int = 0
    already_done: int = 0  # answered by an earlier run (resumed)
    duplicates: int = 0  # the same prompt as a row before it: answered once, shared
    done: int = 0
    failed: int = 0
    truncated: int = 0  # rows with at least one turn cut at max tokens
    turns: int = 0
    tokens_generated: int = 0
    seconds: float = 0.0
    out: str = ""
    errors: dict = field(default_factory=dict)  # kind -> {"count": n, "first": first message}

    def line(self) -> str:
        return json.dumps({"regenerate": asdict(self)})

    def add_error(self, e: Exception) -> None:
        entry = self.errors.setdefault(type(e).__name__, {"count": 0, "first": str(e)[:500]})
        entry["count"] += 1

    def error_summary(self) -> str:
        return "; ".join(f"{v['count']} x {k} (first: {v['first']})" for k, v in self.errors.items())


def _assistant_message(c: Completion, thinking: bool | None) -> dict:
    msg = {"role": "assistant", "content": c.content}
    if c.reasoning and thinking is not False:
        msg["reasoning_content"] = c.reasoning
    if c.token_ids is not None:
        msg["token_ids"] = c.token_ids
    return msg


def _for_template(messages: list[dict]) -> list[dict]:
    """Messages without draftsmith's own fields (token ids): what a chat template sees."""
    return [{k: v for k, v in m.items() if k != "token_ids"} for m in messages]


def _result_row(conv: dict, messages: list[dict], completions: list[Completion]) -> dict:
    row = {"id": conv["id"], "key": conv.get("key", conv["id"]), "messages": messages}
    if "source_id" in conv:
        row["source_id"] = conv["source_id"]
    row["regen"] = {"turns": len(completions), "tokens": sum(c.tokens for c in completions),
                    "finish_reasons": [c.finish_reason for c in completions]}
    return row
