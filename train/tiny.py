"""The ``tiny`` recipe's local inputs: a tiny target that talks, and a tiny chat data set.

``target.path=tiny:<arch>`` builds a tiny seeded target (``models.tiny``) and fits it for a few
seconds on the tiny chat data (``data.tiny_chat``). Why fit it: a random-weight byte-level target
regenerates byte soup, and byte soup that is not valid UTF-8 does not survive the text round trip
of regeneration (decode -> re-tokenize changes the ids), so its "own tokens" would not be its own.
A target that has seen the templates answers in ASCII text with structure the drafter can learn,
which is what a real target looks like to a drafter. The folder is cached: a second run reuses it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Kimi_K25ForConditionalGeneration

from data import tiny_chat
from data.chat import tokenize_conversation
from models.tiny import TINY_ARCHS, default_template, save_tiny_target, tiny_tokenizer

FIT_VERSION = 2  # bump when the fitting procedure changes (invalidates cached tiny targets)
NUM_LAYERS = 6  # of the target tiny:<arch> builds


def build_tiny_target(directory: str | Path, arch: str = "qwen3", num_layers: int = NUM_LAYERS, seed: int = 0,
                      fit_steps: int = 100, conversations: int = 512, log=print) -> Path:
    """A tiny target folder (config, safetensors, tokenizer), fitted on tiny chat; cached by its recipe."""
    directory = Path(directory)
    stamp = {"arch": arch, "num_layers": num_layers, "seed": seed, "fit_steps": fit_steps,
             "conversations": conversations, "fit_version": FIT_VERSION}
    marker = directory / "draftsmith_tiny.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return directory
    log(f"building tiny {arch} target in {directory} (fit {fit_steps} steps on tiny chat)")
    save_tiny_target(directory, arch=arch, seed=seed, num_layers=num_layers)
    # Kimi K2.5's multimodal checkpoint (AutoModelForCausalLM refuses it) is fitted whole and saved in its published
    # layout again (models.tiny.kimi_checkpoint_layout)
    cls = Kimi_K25ForConditionalGeneration if arch == "kimi_k25" else AutoModelForCausalLM
    model = cls.from_pretrained(directory, dtype=torch.float32)
    tok = tiny_tokenizer(default_template(arch))
    rows = []
    for conv in tiny_chat.build(conversations, seed=seed + 1000):  # other conversations than the training data
        for row in tokenize_conversation(tok, conv["messages"], thinking=False)[0]:
            rows.append(row.input_ids)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    pad = tok.pad_token_id
    model.train()
    for step in range(fit_steps):
        batch = rng.sample(rows, min(16, len(rows)))
        width = max(len(r) for r in batch)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in batch])
        labels = torch.tensor([r + [-100] * (width - len(r)) for r in batch])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == fit_steps - 1:
            log(f"  tiny target fit step {step}: lm loss {loss.item():.3f}")
    model.eval()
    model.save_pretrained(directory)
    if arch == "kimi_k25":
        from models.tiny import kimi_checkpoint_layout

        kimi_checkpoint_layout(directory)
    marker.write_text(json.dumps(stamp) + "\n")
    from models.support import share_like_umask  # start-up time: train.config reads this module

    share_like_umask(directory)  # safetensors' weights come out 0600
    return directory


def parse_tiny(path: str) -> str | None:
    """``tiny:qwen3`` -> ``qwen3``; anything else -> None; an architecture no tiny target has is refused."""
    if not str(path).startswith("tiny:"):
        return None
    arch = path.split(":", 1)[1] or "qwen3"
    if arch not in TINY_ARCHS:
        raise ValueError(f"target.path={path}: no tiny target {arch!r}; use one of "
                         f"{', '.join('tiny:' + a for a in TINY_ARCHS)}")
    return arch
