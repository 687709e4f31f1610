"""Export a drafter as a Hugging Face folder that vLLM, SGLang, z-lab's code and transformers load.

    python -m export.hf --checkpoint runs/qwen3-8b/final/drafter --out exports/qwen3-8b-dflash
    python -m export.hf --checkpoint runs/qwen3-8b/checkpoints/step_4000 --out exports/step4000 --dtype fp32
    python -m export.hf --checkpoint runs/tiny --out exports/tiny --target ./my-target   # record / check the target

The folder is the z-lab flat layout: ``config.json`` with every resolved key (both ``block_size``
places, both rope places, ``num_target_layers``, ``dflash_config``, ``layer_types``, ``auto_map``)
plus a ``draftsmith`` block (target id / revision / quantization, recipe, steps, data);
``model.safetensors`` (sharded with ``model.safetensors.index.json`` past ``--max-shard-size``);
``modeling_dflash.py`` so ``AutoModel.from_pretrained(DIR, trust_remote_code=True)`` works with
plain transformers.

It is written to a temporary folder beside ``--out`` and moved into place only after the gate:
the engine schema check, the reloaded config equal to the drafter's, the weights bit-equal, the
drafter's logits on a random block equal after reloading with draftsmith and (unless
``--no-remote-code-check``) with transformers' ``AutoModel`` and the shipped file, and, when the
target folder is on this machine, the target's shape and tokenizer (the mask id must be a row the
tokenizer never emits). Logits go through a seeded stand-in LM head (see ``export/check.py``).
It ends by printing the vLLM and SGLang serve commands.

A DFlash2 drafter (``drafter.variant=dflash2``) is written in the published DFlash2 layout
(``DFlash2DraftModel``, the conv/selector keys in ``dflash_config``, ``is_causal: false``, sliding
layers, codebooks without ``.weight``); the gate also checks its names and shapes against the
published formulas and that its greedy proposals (selector walk) are the same after reloading.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from export.check import (ExportCheckError, check_parity, config_differences, logit_stats, raise_if, random_block,
                          schema_problems, stand_in_head, target_problems, weight_problems)
from export.folder import check_out, staging
from export.source import describe_target_quantization, full_precision_source
from export.usage import engine_requirements, serve_commands
from models.config import DFlashConfig
from models.drafter import DFlashDraftModel
from models.drafter2 import load_drafter, select, unary_logits
from models.weights import check_finite, folder_tensors

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NOT_EXPORTED = "Nothing was exported: export an earlier checkpoint (runs/NAME/checkpoints/step_N), or retrain"


SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([TGMK]I?B|B)?\s*", re.IGNORECASE)
UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1, None: 1,  # decimal, as the Hub writes sizes
         "TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10}


def shard_bytes(value: int | str) -> int:
    """``--max-shard-size`` in bytes: an integer, or a number with TB / GB / MB / KB / B (or GiB ...). Read
    here, before the drafter loads: the writer's own error did not name the flag, and a negative size wrote one
    shard per tensor."""
    size = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := SIZE.fullmatch(value)):
        size = int(float(match[1]) * UNITS[match[2] and match[2].upper()])
    if size is None or size <= 0:
        raise ValueError(f"--max-shard-size {value!r}: give a positive size such as 5GB, 500MB or a number of bytes")
    return size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m export.hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint (runs/NAME/checkpoints/step_N), run folder (runs/NAME) or drafter folder")
    p.add_argument("--out", required=True, help="folder to write (must be new or empty; see --overwrite)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weight dtype of the export (default bf16)")
    p.add_argument("--target", default=None,
                   help="target Hub id or local folder to record (default: the one training used); it is also "
                        "checked against the drafter (a Hub id from its config and tokenizer files only)")
    p.add_argument("--target-revision", default=None, help="target revision to record")
    p.add_argument("--max-shard-size", default="5GB",
                   help="shard the safetensors past this size: 5GB, 500MB, ... or bytes (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier draftsmith export at --out")
    p.add_argument("--no-remote-code-check", action="store_true",
                   help="skip reloading through transformers AutoModel(trust_remote_code=True) in the gate")
    args = p.parse_args(argv)
    try:
        shard_bytes(args.max_shard_size)
    except ValueError as e:
        p.error(str(e))
    return args


def provenance(src_prov: dict[str, Any], target: str | None, revision: str | None,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """The source's provenance with command-line values on top. ``--target`` must be a local folder or a Hub
    id (a mistyped path was once recorded as the target, its check reported as skipped); one that differs
    from the target the run trained against is recorded, with a warning."""
    from models.hub import HUB_ID, same_model

    prov = dict(src_prov)
    if target:
        if not Path(target).expanduser().is_dir() and not HUB_ID.match(target):
            raise FileNotFoundError(f"--target {target}: no such folder, and not a Hub id (org/name): give the "
                                    "target's folder or Hub id (or leave --target out to record the run's)")
        trained = src_prov.get("target")
        if trained and not same_model(trained, target):
            log(f"warning: --target {target} is not the target the drafter was trained against ({trained}): "
                f"recording {target}; acceptance will suffer unless they are the same weights")
        prov["target"] = target
        if Path(target).expanduser().is_dir():  # a local folder says how it is quantized; a Hub id keeps the run's
            prov["target_quantization"] = describe_target_quantization(target)
    if revision:
        prov["target_revision"] = revision
    return {k: v for k, v in prov.items() if v is not None}


def block_outputs(model: torch.nn.Module, inputs: dict, dtype: torch.dtype, head: torch.Tensor) -> torch.Tensor:
    """Logits (through ``head``, in float32) of a drafter forward on the gate's random block."""
    with torch.no_grad():
        hidden = model(torch.from_numpy(inputs["noise"]).to(dtype), torch.from_numpy(inputs["features"]).to(dtype),
                       torch.from_numpy(inputs["positions"]))
    return hidden.float() @ head.T


def proposal_tokens(model: torch.nn.Module, inputs: dict, head: torch.Tensor) -> torch.Tensor:
    """DFlash2: the greedy selector walk of each random block (float32, through the stand-in head), from our
    drafter or the shipped modeling file's ``propose``. Casts ``model`` to float32 in place."""
    model = model.float()
    with torch.no_grad():
        hidden = model(torch.from_numpy(inputs["noise"]), torch.from_numpy(inputs["features"]),
                       torch.from_numpy(inputs["positions"]))[:, 1:]
        bonus = torch.arange(hidden.shape[0]) % head.shape[0]
        if not isinstance(model, DFlashDraftModel):  # the shipped modeling file's class
            return model.propose(hidden, head, bonus)
        c, selector = model.config, model.candidate_selector
        return select(unary_logits(hidden @ head.T, c.output_multiplier, c.final_logit_softcapping),
                      selector.hidden_projection(hidden), selector.predecessor_codebook, selector.successor_codebook,
                      bonus, c.selector_top_k).tokens


def gate(folder: Path, model: DFlashDraftModel, dtype: torch.dtype, remote_code: bool,
         log: Callable[[str], None]) -> dict[str, Any]:
    """Every check on the written folder; raises ``ExportCheckError`` (nothing moved) on the first failure."""
    d = json.loads((folder / "config.json").read_text())
    raise_if(schema_problems(d, folder, hf=True), f"{folder.name}/config.json fails the engine schema")
    again_cfg = DFlashConfig.from_dict(d)
    raise_if(config_differences(model.config, again_cfg), "config.json does not read back as the drafter's config")
    raise_if(weight_problems(folder, again_cfg), "the written weights do not match config.json")
    log("check: engine schema, config round trip and weight names ok")

    again = load_drafter(folder, dtype=dtype)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, again.state_dict()[k])]
    raise_if([f"{k} changed on the way to disk" for k in changed], "the reloaded weights differ")
    inputs = random_block(model.config)
    head = torch.from_numpy(stand_in_head(model.config))
    ref = block_outputs(model, inputs, dtype, head)
    name = str(dtype).removeprefix("torch.")
    stats = {"draftsmith": logit_stats(ref.numpy(), block_outputs(again, inputs, dtype, head).numpy())}
    check_parity(stats["draftsmith"], name, "reloaded with draftsmith")
    log(f"check: reloaded with draftsmith, logits max |diff| {stats['draftsmith']['max_abs']:.2e}")
    if remote_code:
        from transformers import AutoModel

        hf = AutoModel.from_pretrained(str(folder), trust_remote_code=True, dtype=dtype).eval()
        stats["transformers"] = logit_stats(ref.numpy(), block_outputs(hf, inputs, dtype, head).numpy())
        check_parity(stats["transformers"], name, "reloaded with AutoModel(trust_remote_code=True)")
        log(f"check: reloaded with transformers AutoModel, logits max |diff| {stats['transformers']['max_abs']:.2e}")
    if model.config.variant == "dflash2":
        tokens = proposal_tokens(copy.deepcopy(model), inputs, head)
        reloaded = {"draftsmith": again} | ({"transformers": hf} if remote_code else {})
        for what, other in reloaded.items():
            same = (proposal_tokens(other, inputs, head) == tokens).float().mean().item()
            stats[what]["selector_tokens"] = same
            if same < 1:
                raise ExportCheckError(f"reloaded with {what}: the greedy selector walk drafts other tokens "
                                       f"({same:.1%} equal, float32). Nothing was exported: the written folder does "
                                       "not propose what the drafter does")
        log(f"check: the selector walk drafts the same tokens after reloading ({' and '.join(reloaded)})")
    return stats


def export_hf(checkpoint: str | Path, out: str | Path, dtype: str = "bf16", target: str | None = None,
              target_revision: str | None = None, max_shard_size: int | str = "5GB", overwrite: bool = False,
              remote_code_check: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Write, check and place the HF folder; returns a summary (paths, checks, serve commands)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    max_shard_size = shard_bytes(max_shard_size)
    out = Path(out)
    src = full_precision_source(checkpoint, "export.hf")
    check_out(out, overwrite, src.drafter_dir)
    torch_dtype = DTYPES[dtype]
    log(f"source: {src.drafter_dir} ({src.kind})")
    check_finite(folder_tensors(src.drafter_dir), str(src.drafter_dir), NOT_EXPORTED)  # as stored, before any cast
    model = load_drafter(src.drafter_dir, dtype=torch_dtype)
    prov = provenance(src.provenance, target, target_revision, log)
    model.config = model.config.replace(torch_dtype=str(torch_dtype).removeprefix("torch."), draftsmith=prov or None)
    problems, checked = target_problems(model.config, prov.get("target"))
    raise_if(problems, "the drafter does not fit its target")
    log(f"check: {checked}")
    with staging(out, overwrite) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size, dtype=torch_dtype)
        stats = gate(tmp, model, torch_dtype, remote_code_check, log)
    cfg = model.config
    commands = serve_commands(str(out.resolve()), prov.get("target"), cfg.block_size, cfg.variant)
    needs = engine_requirements(cfg.variant, cfg.use_sliding_window)
    log(f"exported {out} ({cfg.architecture}, {dtype}, {sum(p.stat().st_size for p in out.iterdir()) / 1e6:.1f} MB): "
        f"block_size {cfg.block_size}, target_layer_ids {cfg.target_layer_ids}, mask_token_id {cfg.mask_token_id}")
    log("serve with vLLM:\n  " + commands["vllm"] + f"\n  (needs {needs['vllm']})")
    log("serve with SGLang:\n  " + commands["sglang"] + f"\n  (needs {needs['sglang']})")
    if prov.get("quantized_target"):  # target.quantization=mlx:DIR
        log(f"trained against {prov.get('target_quantization') or prov['quantized_target']}, a quantized copy of "
            f"{prov.get('target')}: on a Mac run it with --target {prov['quantized_target']} (vLLM and SGLang serve "
            f"{prov.get('target')})")
    return {"out": str(out), "source": str(src.drafter_dir), "dtype": dtype, "provenance": prov, "parity": stats,
            "commands": commands, "engines": needs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    return export_hf(args.checkpoint, args.out, dtype=args.dtype, target=args.target,
                     target_revision=args.target_revision, max_shard_size=args.max_shard_size,
                     overwrite=args.overwrite, remote_code_check=not args.no_remote_code_check)


def cli() -> None:
    """The ``draftsmith-export-hf`` console script: ``main`` with one-line user errors, as ``python -m`` runs it."""
    from models.support import run_cli

    run_cli(main, interrupted=("--out is untouched (an export is written aside and moved in when complete): "
                                    "rerun the command"))


if __name__ == "__main__":
    cli()
