"""A small deterministic synthetic chat data set (OpenAI ``messages`` JSONL) for the ``tiny`` recipe.

Templated conversations (arithmetic, counting, spelling, colours, unit conversion), some
multi-turn and some with a system prompt, drawn from a seeded ``random.Random``: the same
``(n, seed)`` always gives the same file, byte for byte. Answers follow fixed patterns, so a
small model can learn them; the ``tiny`` recipe regenerates them with the tiny target anyway.

    python -m data.tiny_chat --out tiny_chat.jsonl --n 256 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

THINGS = ["sky", "grass", "sun", "snow", "coal", "plum", "lemon", "carrot"]
THING_COLOUR = {"sky": "blue", "grass": "green", "sun": "yellow", "snow": "white", "coal": "black",
                "plum": "purple", "lemon": "yellow", "carrot": "orange"}
WORDS = ["cat", "tree", "house", "river", "cloud", "apple", "stone", "light", "music", "paper"]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", "You are a careful tutor."]


def _arith(r: random.Random) -> tuple[str, str]:
    a, b = r.randint(2, 99), r.randint(2, 99)
    if r.random() < 0.5:
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."


def _count(r: random.Random) -> tuple[str, str]:
    start = r.randint(1, 20)
    n = r.randint(3, 6)
    return f"Count from {start}, {n} numbers.", ", ".join(str(start + i) for i in range(n)) + "."


def _spell(r: random.Random) -> tuple[str, str]:
    w = r.choice(WORDS)
    return f"Spell the word {w}.", f"The word {w} is spelled " + "-".join(w) + "."


def _colour(r: random.Random) -> tuple[str, str]:
    t = r.choice(THINGS)
    return f"What colour is the {t}?", f"The {t} is {THING_COLOUR[t]}."


def _convert(r: random.Random) -> tuple[str, str]:
    m = r.randint(1, 50)
    return f"How many centimetres are in {m} metres?", f"There are {m * 100} centimetres in {m} metres."


TOPICS = [_arith, _count, _spell, _colour, _convert]


def conversation(r: random.Random, idx: int) -> dict:
    """One conversation: optional system prompt, 1-2 user/assistant turns."""
    messages = []
    if r.random() < 0.3:
        messages.append({"role": "system", "content": r.choice(SYSTEMS)})
    for _ in range(1 if r.random() < 0.7 else 2):
        q, a = r.choice(TOPICS)(r)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"id": f"tiny-{idx:06d}", "messages": messages}


def build(n: int = 256, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    return [conversation(r, i) for i in range(n)]


def write(path: str | Path, n: int = 256, seed: int = 0) -> Path:
    """Write ``n`` conversations as JSONL (idempotent: same n and seed, same bytes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in build(n, seed))
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(write(a.out, a.n, a.seed))


if __name__ == "__main__":
    main()
