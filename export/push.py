"""Publish an exported drafter folder to the Hugging Face Hub, with a generated model card.

    python -m export.push --folder exports/qwen3-8b-dflash --repo me/Qwen3-8B-DFlash-b16 --dry-run
    python -m export.push --folder exports/qwen3-8b-dflash --repo me/Qwen3-8B-DFlash-b16 --report report.json
    python -m export.push --folder exports/qwen3-8b-dflash-mlx-4bit --repo me/Qwen3-8B-DFlash-b16-mlx-4bit --private

Checks the folder first (a DFlash drafter passing the engine schema, weights readable), writes
``README.md`` (``export/card.py``: YAML metadata with ``base_model``, usage for vLLM / SGLang /
transformers / MLX, the training recipe, and the ``inference.validate`` report's numbers with
``--report``), then ``HfApi.create_repo`` (+ ``create_branch`` for a ``--revision`` other than
main) and ``HfApi.upload_folder`` of the export's files only (``EXPORT_FILES``; any other file is refused),
deleting in the same commit the weights an earlier push left (``STALE``). A README.md that draftsmith did
not write is uploaded as it is.

The token comes from the usual places (``HF_TOKEN``, ``hf auth login``); it is never printed or
written into the folder. ``--dry-run`` prints the operations and the card and uploads nothing
(no token needed). ``HF_ENDPOINT`` points the client at another Hub.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Callable

import huggingface_hub  # get_token looked up at each call (tests stand in for it)
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

from export.card import MARKER, render_card
from export.check import raise_if, schema_problems, weight_problems
from export.report import load_report
from export.source import NotADrafterError, is_drafter_dir, training_output
from models.config import DFlashConfig
from models.config_keys import MODELING_FILE
from models.config_layout import describe_quantization
from models.hub import INDEX, is_hub_id, repo_id_problem
from models.weights import (check_finite, folder_tensors, norm_signature, same_signature, weight_hash_differences,
                            weight_hashes)

IGNORE = [".*", "**/.*", "__pycache__/*", "*.tmp"]
# What export.hf / export.mlx (and the card) write: all a push uploads. Any other file in the folder is refused,
# never uploaded: notes, reports or data kept beside the weights would go public with them.
EXPORT_FILES = ["config.json", "model.safetensors", "model-*-of-*.safetensors", INDEX, f"{MODELING_FILE}.py",
                "README.md"]
# An earlier push's weights, index or modeling file that this export does not replace are deleted in the same
# commit: a single-file export pushed over a sharded one left the old index, which loaders follow to the old
# shards (the repo served the old weights under the new config).
STALE = ["*.safetensors", "*.safetensors.index.json", f"{MODELING_FILE}.py"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m export.push", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", required=True, help="an export folder (python -m export.hf / export.mlx)")
    p.add_argument("--repo", required=True, help="Hub repo id, user/name or org/name")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default="main", help="branch to upload to (created when missing; default main)")
    p.add_argument("--report", default=None, help="report.json of `python -m inference.validate` to show on the card")
    p.add_argument("--license", default=None, help="license id for the card metadata (e.g. apache-2.0)")
    p.add_argument("--commit-message", default=None, help="default: 'Upload DFlash drafter (draftsmith)'")
    p.add_argument("--dry-run", action="store_true", help="print the operations and the card; upload nothing")
    return p.parse_args(argv)


def check_repo_id(repo: str) -> str:
    if problem := repo_id_problem(repo):
        said = ":" if repo.count("/") != 1 else " is not a valid Hub repo id:"
        raise ValueError(f"--repo {repo!r}{said} {problem}")
    return repo


def check_revision(revision: str) -> str:
    """A branch name git (and so the Hub) accepts; a dry run once passed names the upload then refused."""
    bad = (not revision or revision.startswith(("-", "/", ".")) or revision.endswith(("/", ".", ".lock"))
           or any(s in revision for s in ("..", "@{", "//")) or any(c in revision for c in " ~^:?*[\\")
           or any(ord(c) < 32 or ord(c) == 127 for c in revision))
    if bad:
        raise ValueError(f"--revision {revision!r} is not a valid branch name (no spaces, '..', '~^:?*[\\', "
                         "leading '-', '/' or '.'): use a name like main or v1")
    return revision


def check_license(license: str | None) -> str | None:
    """The Hub's license ids are lowercase, without spaces (apache-2.0, mit, llama3.1, other). ``MIT`` or
    ``Apache 2.0`` passed the dry run and was refused by the Hub's card check only during the upload, after the
    repo had been created."""
    if license is not None and (not license or license != license.lower() or any(c.isspace() for c in license)):
        raise ValueError(f"--license {license!r} is not a Hub license id: those are lowercase, without spaces "
                         f"(e.g. {license.strip().lower().replace(' ', '-') or 'apache-2.0'!r}, or 'other' for a "
                         "license of your own)")
    return license


def check_folder(folder: Path) -> DFlashConfig:
    """The folder is a drafter export that passes the engine schema and whose weights are readable."""
    if not folder.is_dir():
        raise FileNotFoundError(f"--folder {folder} is not a folder: pass the output of export.hf or export.mlx")
    if not is_drafter_dir(folder):
        raise NotADrafterError(f"--folder {folder} is not a DFlash drafter export (no config.json naming "
                               "DFlashDraftModel): run python -m export.hf (or export.mlx) first")
    run = training_output(folder)
    if run is not None:  # fp32, never through the export checks, its target maybe a local path
        raise ValueError(f"--folder {folder} is a training run's drafter, not an export: export it first "
                         f"(python -m export.hf --checkpoint {run} --out DIR --target ORG/NAME: bf16, checked for "
                         "the engines, the target named for the card), then push DIR")
    d = json.loads((folder / "config.json").read_text())
    hf = "quantization" not in d
    fix = "Nothing was uploaded: export the drafter again (python -m export.hf / export.mlx) and push that folder"
    raise_if(schema_problems(d, folder, hf=hf), f"{folder}/config.json fails the engine schema", fix)
    config = DFlashConfig.from_dict(d)
    raise_if(weight_problems(folder, config), f"{folder} weights", fix)
    check_finite(folder_tensors(folder), f"--folder {folder}", "Nothing was uploaded: export an earlier checkpoint "
                 "(python -m export.hf --checkpoint runs/NAME/checkpoints/step_N) and push that")
    return config


def sort_files(folder: Path) -> tuple[list[str], list[str]]:
    """(the files an export writes, every other file) in ``folder``, as relative paths; hidden, cache and temp
    files are in neither. Both lists come from huggingface_hub's own filter with the patterns ``upload_folder``
    gets, so the dry run lists exactly what the upload sends (``export.folder`` reads the same lists)."""
    every = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    seen = list(filter_repo_objects(every, ignore_patterns=IGNORE + list(DEFAULT_IGNORE_PATTERNS)))
    files = list(filter_repo_objects(seen, allow_patterns=EXPORT_FILES))
    return files, [f for f in seen if f not in files]


def export_files(folder: Path) -> list[str]:
    """The files a push uploads (relative paths), after refusing any file an export does not write."""
    files, other = sort_files(folder)
    if other:
        shown = ", ".join(other[:8]) + (f" (+{len(other) - 8} more)" if len(other) > 8 else "")
        raise ValueError(f"--folder {folder} holds files an export does not write: {shown}. A push uploads the "
                         f"export only ({', '.join(EXPORT_FILES)}): move the others out of the folder. Nothing "
                         "was uploaded")
    return files


def check_report_matches(report: dict[str, Any], config: DFlashConfig, path: str | Path,
                         folder: Path | None = None) -> None:
    """A report measured with another drafter (other block size, mask id or weights) must not go on this card.

    The weights are compared exactly by ``models.weights.weight_hashes`` (``fc``'s first rows and the norms, in the
    two folders' common dtype): the same drafter in any export format matches, another checkpoint of the same run
    does not (the ``norm_signature`` tolerance, 1e-2, is wider than two checkpoints differ). Reports that predate
    the hashes are compared by their ``norm_signature``; older ones skip that part.
    """
    theirs = {"block size": report.get("trained_block_size"), "mask token id": report.get("mask_token_id")}
    ours = {"block size": config.block_size, "mask token id": config.mask_token_id}
    wrong = [f"{k} {theirs[k]} (this folder: {ours[k]})" for k in ours
             if theirs[k] is not None and theirs[k] != ours[k]]
    if "draft_quantization" in report:  # reports that predate it skip this: the signature agrees across formats

        if report["draft_quantization"] != describe_quantization(config.quantization):
            wrong.append(f"drafter quantization {report['draft_quantization'] or 'none'} (this folder: "
                         f"{describe_quantization(config.quantization) or 'none'})")
    signature, hashes = report.get("draft_signature"), report.get("draft_hashes")
    differ = (weight_hash_differences(hashes, weight_hashes(folder))
              if folder is not None and isinstance(hashes, dict) else None)
    if differ:
        shown = ", ".join(differ[:3]) + (f" (+{len(differ) - 3} more)" if len(differ) > 3 else "")
        wrong.append(f"other weights (its drafter {report.get('draft')!r} differs from this folder in {shown}, "
                     "compared exactly: another drafter, e.g. another checkpoint of the run)")
    elif differ is None and folder is not None and isinstance(signature, dict) and \
            not same_signature(signature, norm_signature(folder)):
        wrong.append(f"other weights (its drafter {report.get('draft')!r} has other norm weights than this folder)")
    if wrong:
        raise ValueError(f"--report {path} was measured with another drafter: " + ", ".join(wrong) +
                         ". Validate this folder and pass that report")


def plan(folder: Path, repo: str, private: bool, revision: str, message: str) -> list[dict[str, Any]]:
    """The Hub operations, in order, as the keyword arguments HfApi receives."""
    ops: list[dict[str, Any]] = [{"op": "create_repo", "repo_id": repo, "repo_type": "model", "private": private,
                                  "exist_ok": True}]
    if revision != "main":
        ops.append({"op": "create_branch", "repo_id": repo, "branch": revision, "repo_type": "model",
                    "exist_ok": True})
    ops.append({"op": "upload_folder", "repo_id": repo, "folder_path": str(folder), "repo_type": "model",
                "revision": revision, "commit_message": message, "allow_patterns": EXPORT_FILES,
                "ignore_patterns": IGNORE, "delete_patterns": STALE})
    return ops


def push(folder: str | Path, repo: str, private: bool = False, revision: str = "main", report: str | None = None,
         license: str | None = None, commit_message: str | None = None, dry_run: bool = False,
         log: Callable[[str], None] = print) -> dict[str, Any]:
    """Check, write the card, upload (or print what would be uploaded). Returns the plan and the card text."""
    folder = Path(folder)
    check_repo_id(repo)
    check_revision(revision)
    check_license(license)
    config = check_folder(folder)
    files = export_files(folder)
    loaded = load_report(report) if report else None
    if loaded is not None:
        check_report_matches(loaded, config, report, Path(folder))
    target = (json.loads((folder / "config.json").read_text()).get("draftsmith") or {}).get("target")
    if not is_hub_id(target):
        log(f"note: the recorded target is {target!r}, not a Hub id, so the card has no base_model; re-export with "
            "--target ORG/NAME to name it")
    card = str(render_card(folder, repo, report=loaded, license=license))
    readme = folder / "README.md"
    ours = not readme.is_file() or MARKER in readme.read_text(errors="replace")
    ops = plan(folder, repo, private, revision, commit_message or "Upload DFlash drafter (draftsmith)")
    if dry_run:
        log("dry run: nothing is uploaded. Operations:")
        for op in ops:
            log("  " + json.dumps(op))
        log(f"  files: {sorted(set(files) | {'README.md'})}")
        log(f"  removed from the repo unless uploaded now (an earlier push's weights): {STALE}")
        log(("README.md (generated):" if ours else "README.md exists and was not written by draftsmith; it would be "
             "uploaded as it is. The card draftsmith would write:") + "\n" + card)
        return {"ops": ops, "card": card, "uploaded": False}
    if huggingface_hub.get_token() is None:
        raise PermissionError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (it is read, never printed "
                              "or saved), or use --dry-run")
    if ours:
        readme.write_text(card)
    else:
        log(f"{readme} was not written by draftsmith: uploading it as it is (delete it to get the generated card)")
    from huggingface_hub import HfApi  # start-up time: the Hub client (export.push --help does not load it)

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)  # read now: the client's constant is set at import
    url = None
    for op in ops:
        kwargs = {k: v for k, v in op.items() if k != "op"}
        log(f"{op['op']} {repo}" + (f" ({revision})" if op["op"] != "create_repo" else ""))
        try:
            result = getattr(api, op["op"])(**kwargs)
        except Exception as e:  # the hub client raises HTTP, network and validation errors of many types
            raise OSError(f"{op['op']} on {repo} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}"
                          "). Check the repo id, your token's write access and HF_ENDPOINT") from None
        if op["op"] == "create_repo" and private:
            refuse_public(api, repo)
        if op["op"] == "upload_folder":
            url = getattr(result, "commit_url", None) or str(result)
    log(f"pushed {folder} to {repo}@{revision}" + (f": {url}" if url else ""))
    return {"ops": ops, "card": card, "uploaded": True, "url": url}


def refuse_public(api, repo: str) -> None:
    """``--private`` for a repo that already exists and is public: ``create_repo(exist_ok=True)`` leaves an existing
    repo's visibility as it is, so the weights the user meant to keep private were published."""
    try:
        private = getattr(api.repo_info(repo_id=repo, repo_type="model"), "private", None)
    except Exception as e:  # the hub client raises HTTP, network and validation errors of many types
        raise OSError(f"repo_info on {repo} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}): "
                      "nothing was uploaded. Check the repo id, your token's access and HF_ENDPOINT") from None
    if private is False:
        raise PermissionError(f"--private but {repo} already exists and is public (pushing to it does not change its "
                              "visibility): nothing was uploaded. Make it private in the repo's settings on the Hub "
                              "and push again, or drop --private to publish it")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    return push(args.folder, args.repo, private=args.private, revision=args.revision, report=args.report,
                license=args.license, commit_message=args.commit_message, dry_run=args.dry_run)


def cli() -> None:
    """The ``draftsmith-push`` console script: ``main`` with one-line user errors, as ``python -m`` runs it."""
    from models.support import run_cli

    run_cli(main, interrupted=("no commit was made (the upload commits once, at its end): rerun the "
                                    "same command"))


if __name__ == "__main__":
    cli()
