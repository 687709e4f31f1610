"""Checks shared by the torch and MLX loops and by the ``generate`` / ``validate`` commands.

Framework-free on purpose: the loops call the same checks (prompt, token budget, temperature,
proposer binding, draft-cache length) so they refuse the same things with the same words, and the
commands run the pre-flight checks (``preflight``) on the two ``config.json`` files before any
weights load, so a swapped ``--target``/``--draft``, a drafter for another target, a block size
above the trained one or a prompt id outside the vocabulary end in one line, not a traceback
minutes later.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from inference.stats import resolve_block_size, warn_if_mask_is_emitted
from models import hub
from models.config import DFlashConfig
from models.config_keys import ARCHITECTURES
from models.config_layout import drafter_inside_hint, is_drafter_config, read_json_file

log = logging.getLogger("inference")


def check_dtype(name: str | None) -> str | None:
    """A ``--dtype`` name as both backends spell it, for ``getattr(torch, name)`` / ``getattr(mx, name)``
    (``bf16`` -> ``bfloat16``: ``models.support.DTYPE_NAMES``; None: the backend's default)."""
    from models.support import parse_dtype

    return parse_dtype(name)


LOOPS = ("auto", "eager", "static", "compiled")  # --loop: the torch loop a session runs (inference.session)


def check_loop(backend: str, loop: str) -> None:
    """``--loop`` names a torch loop; the MLX backend has its own (auto and eager stand for it)."""
    if loop not in LOOPS:
        raise ValueError(f"--loop {loop!r}: use one of {', '.join(LOOPS)}")
    if backend == "mlx" and loop not in ("auto", "eager"):
        raise ValueError(f"--loop {loop} is a torch loop; the MLX backend runs its own (drop --loop, or use "
                         "--backend torch)")


# ------------------------------------------------------------------ loop checks
def check_generation_args(prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0) -> None:
    """What both loops refuse before the first forward."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: ask for at least one token")
    check_temperature(temperature)


def check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature {temperature}: use 0 for greedy (lossless) decoding or a positive value "
                         "to sample")


def check_proposer_binding(config: DFlashConfig, target: Any) -> None:
    """Before a drafter is bound to a loaded target (either backend's ``TargetModel``): same hidden size,
    vocabulary and depth; warn when the mask id is a token the tokenizer emits."""
    config.check_target(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_layers=target.num_layers)
    warn_if_mask_is_emitted(config.mask_token_id, target.tokenizer)


def check_draft_context(held: int, committed: int) -> None:
    """After a verify pass the drafter must have seen exactly the committed context (-1: not tracked)."""
    if held not in (committed, -1):
        raise RuntimeError(f"draft cache holds {held} positions but {committed} are committed: the drafter's "
                           "context fell out of step with the target (a bug in the proposer, please report it)")


# ------------------------------------------------------------------ pre-flight (commands)
@dataclass
class TargetFacts:
    """What a target's ``config.json`` says, read without loading any weights."""

    path: str
    model_type: str
    hidden_size: int | None
    vocab_size: int | None
    num_layers: int | None
    quantization: dict | None


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        hint = drafter_inside_hint(path.parent)
        raise FileNotFoundError(f"{path} not found: a {what} folder needs config.json{hint}")
    return read_json_file(path)


def drafter_kind(d: dict) -> str:
    """What a drafter's config.json calls it: its DFlash architecture (v1 or DFlash2), else its dflash_config."""
    return next((a for a in d.get("architectures") or [] if a in ARCHITECTURES.values()), "dflash_config")


def read_target_facts(directory: str | Path, name: str = "") -> TargetFacts:
    path = Path(directory) / "config.json"
    d = _read_json(path, "target")
    if is_drafter_config(d):
        raise ValueError(f"--target {name or directory} is a DFlash drafter ({path} names {drafter_kind(d)}), not a "
                         "target model: did you swap --target and --draft?")
    text = d.get("text_config") or d  # multimodal checkpoints (Qwen3.5 / 3.6) keep the text tower's sizes here
    q = d.get("quantization") or d.get("quantization_config")
    return TargetFacts(path=str(path), model_type=str(d.get("model_type", text.get("model_type", ""))),
                       hidden_size=text.get("hidden_size"), vocab_size=text.get("vocab_size", d.get("vocab_size")),
                       num_layers=text.get("num_hidden_layers"), quantization=q or None)


def read_drafter_config(directory: str | Path, name: str = "") -> tuple[DFlashConfig, dict]:
    """The drafter's canonical config, or one line saying the folder is not a DFlash drafter at all."""
    path = Path(directory) / "config.json"
    d = _read_json(path, "drafter")
    if not is_drafter_config(d):
        kind = ", ".join(d.get("architectures") or []) or d.get("model_type", "unknown")
        raise ValueError(f"--draft {name or directory} is not a DFlash drafter: {path} describes a {kind} model "
                         f"(no {' or '.join(ARCHITECTURES.values())} architecture, no dflash_config). Did you swap "
                         "--target and --draft?")
    return DFlashConfig.from_dict(d), d


def recorded_target(directory: str | Path, raw: dict) -> str | None:
    """The target a drafter says it was trained for: config.json keys (the ``draftsmith`` provenance block
    that ``export.hf`` writes first), else the model card's ``base_model``."""
    nested = raw.get("dflash_config") or {}
    prov = raw.get("draftsmith") if isinstance(raw.get("draftsmith"), dict) else {}
    for value in (prov.get("target"), nested.get("target_model"), raw.get("target_model"), raw.get("base_model")):
        if isinstance(value, str) and value:
            return value
    card = Path(directory) / "README.md"
    if card.is_file():
        text = card.read_text(errors="replace")
        if text.startswith("---"):
            try:
                meta = yaml.safe_load(text.split("---", 2)[1])
            except yaml.YAMLError:  # metadata that is not YAML records no target
                return None
            base = meta.get("base_model") if isinstance(meta, dict) else None
            if isinstance(base, list):  # the list form the Hub's card editor writes: one item is the target,
                base = base[0] if len(base) == 1 else None  # several (a merge) name no single one
            return base if isinstance(base, str) and base else None
    return None


def check_pair(cfg: DFlashConfig, facts: TargetFacts, draft_name: str) -> None:
    """A drafter only works with the target it was trained for: compare the two configs."""
    fix = "use a drafter trained for this target"
    if facts.hidden_size is not None and cfg.hidden_size != facts.hidden_size:
        raise ValueError(f"drafter {draft_name} has hidden_size {cfg.hidden_size} but the target's is "
                         f"{facts.hidden_size} ({facts.path}): {fix}")
    if facts.vocab_size is not None and cfg.vocab_size != facts.vocab_size:
        raise ValueError(f"drafter {draft_name} has vocab_size {cfg.vocab_size} but the target's is "
                         f"{facts.vocab_size} ({facts.path}): {fix}")
    if facts.num_layers is not None:
        bad = [i for i in cfg.target_layer_ids if not 0 <= i < facts.num_layers]
        if bad:
            raise ValueError(f"drafter {draft_name} taps target layers {bad} but the target has only "
                             f"{facts.num_layers} decoder layers: {fix}")
        if cfg.num_target_layers != facts.num_layers:
            raise ValueError(f"drafter {draft_name} was trained on a {cfg.num_target_layers}-layer target; this "
                             f"target has {facts.num_layers} layers: {fix}")
    if facts.vocab_size is not None and not 0 <= cfg.mask_token_id < facts.vocab_size:
        raise ValueError(f"drafter {draft_name} has mask_token_id {cfg.mask_token_id}, outside the target's "
                         f"{facts.vocab_size}-row embedding: {fix}")


def check_prompt_ids(ids: Iterable[int], vocab_size: int | None, flag: str = "--prompt-ids") -> list[int]:
    ids = list(ids)
    if not ids:
        raise ValueError(f"{flag} is empty: give at least one token id")
    bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        limit = f"0..{vocab_size - 1}" if vocab_size is not None else "non-negative"
        raise ValueError(f"{flag} has ids outside the target's vocabulary ({limit}): {bad[:5]}")
    return ids


@dataclass
class Preflight:
    target: TargetFacts
    drafter: DFlashConfig
    block_size: int
    recorded_target: str | None


def check_target_tokenizer(facts: TargetFacts, target: str, fix: str) -> None:
    """The target folder has tokenizer files when the command needs them: a folder without was found only after
    the target had loaded (minutes for a large one). Same rule as the load (``tokenizer*`` files)."""
    hub.require_tokenizer_files(Path(facts.path).parent, target, fix)


def check_draft_weights(draft: str, folder: str | Path | None = None) -> None:
    """A local drafter folder holds its weights, and they are finite (a Hub id's come with the load: the commands
    call this again with the fetched ``folder``): missing ones were found only after the target had loaded
    (minutes for a large one), and a drafter with NaN weights ran at tau 1.00 without a word."""
    # here, not at the top: the commands' start-up time (models.weights imports torch)
    from models.weights import check_finite, folder_tensors, weight_files

    path = Path(folder if folder is not None else draft).expanduser()
    if not path.is_dir():
        return
    try:
        weight_files(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--draft {draft}: {e}: pass the whole drafter folder (an export, or a run's "
                                "final/drafter)") from None
    check_finite(folder_tensors(path), f"--draft {draft}", "Its drafts would all be rejected (tau 1.00): use an "
                 "earlier checkpoint's drafter (runs/NAME/checkpoints/step_N/drafter) or another export")


def check_fetched_draft_weights(draft: str) -> None:
    """``check_draft_weights`` for a Hub id, once the session has fetched it (a local folder was checked before)."""
    if not Path(draft).expanduser().is_dir():
        check_draft_weights(draft, hub.resolve_model_dir(draft, what="drafter"))


def check_drafter_backend(cfg: DFlashConfig, backend: str, draft: str) -> None:
    """A quantized MLX drafter runs on the MLX backend only: on torch it was refused after the target had loaded
    (minutes for a large one), though its config.json says so."""
    if backend != "mlx" and cfg.quantization:
        q = cfg.quantization
        raise ValueError(f"--draft {draft} is a quantized MLX export ({q.get('bits')}-bit, group "
                         f"{q.get('group_size')}): only the MLX backend runs it (--backend mlx); with PyTorch use the "
                         "full-precision drafter (its HF export or the run's final/drafter)")


THINKING = {True: "on", False: "off", "on": "on", "off": "off"}


def recorded_thinking(cfg: DFlashConfig) -> str | None:
    """``on`` / ``off``: the thinking switch the drafter's training data was rendered with (its provenance block's
    ``data.thinking``); None when it records none (the template's default, or a drafter from elsewhere)."""
    data = (cfg.draftsmith or {}).get("data") if isinstance(cfg.draftsmith, dict) else None
    value = data.get("thinking") if isinstance(data, dict) else None
    return THINKING.get(value) if isinstance(value, (bool, str)) else None


def resolve_thinking(flag: str | None, cfg: DFlashConfig, default: str | None, say) -> str | None:
    """The thinking switch to render prompts with: ``--thinking`` when given (a warning when the drafter was trained
    with the other one), else the drafter's recorded one (said in one line), else ``default``. Prompts rendered
    with the other switch than training's measure the drafter on text it never saw."""
    recorded = recorded_thinking(cfg)
    if flag is None:
        if recorded is not None:
            say(f"thinking {recorded}: as the drafter was trained (its recorded data.thinking; --thinking on|off "
                "overrides)")
            return recorded
        return default
    if recorded is not None and flag != recorded:
        say(f"warning: --thinking {flag}, but the drafter was trained with thinking {recorded} (its recorded "
            "data.thinking): expect lower acceptance than it gets as trained; leave --thinking out to use its own")
    return flag


def preflight(target: str, draft: str, block_size: int | None = None, temperature: float = 0.0) -> Preflight:
    """Everything that can be checked from the two ``config.json`` files, before any weights load.

    Hub ids fetch only the small files here (``*.json``, ``*.md``); the weights come with the load.
    """
    check_temperature(temperature)
    small = ["*.json", "*.md"]
    tdir = hub.resolve_model_dir(target, what="target", allow_patterns=small)
    ddir = hub.resolve_model_dir(draft, what="drafter", allow_patterns=small)
    tpath, dpath = tdir / "config.json", ddir / "config.json"
    if tpath.is_file() and dpath.is_file():
        t_raw, d_raw = _read_json(tpath, "target"), _read_json(dpath, "drafter")  # a truncated file is named
        if is_drafter_config(t_raw) and not is_drafter_config(d_raw):
            raise ValueError(f"--target {target} is a DFlash drafter ({tpath} names {drafter_kind(t_raw)}) and --draft "
                             f"{draft} is not: swap them (--target {draft} --draft {target})")
    cfg, raw = read_drafter_config(ddir, draft)
    facts = read_target_facts(tdir, target)
    check_pair(cfg, facts, draft)
    b = resolve_block_size(block_size, cfg.block_size)
    rec = recorded_target(ddir, raw)
    prov = raw.get("draftsmith") if isinstance(raw.get("draftsmith"), dict) else {}
    copy = prov.get("quantized_target")  # target.quantization=mlx:DIR: trained against DIR, a copy of the target
    if rec is not None and not hub.same_model(rec, target) and not (isinstance(copy, str) and
                                                                    hub.same_model(copy, target)):
        log.warning("the drafter %s records its target as %s, but --target is %s: acceptance will suffer unless they "
                    "are the same weights", draft, rec, target)
    return Preflight(target=facts, drafter=cfg, block_size=b, recorded_target=rec)
