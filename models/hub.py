"""Local folder or Hugging Face Hub id -> a local folder laid out like a Hub repo.

A Hub id resolves to ``huggingface_hub``'s snapshot folder (``.../snapshots/<commit>/``), fetching
only the files asked for: the small ones (config, tokenizer, chat template, the shard index) are
enough to plan, tokenize and fingerprint a target; weight shards come when a load needs them, and
only those (training on offline features reads the embedding and LM head, one or two shards of a
dozen; a whole load reads the shards the index names, not a consolidated copy beside them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

import huggingface_hub  # its functions are looked up at each call (tests stand a fake Hub in for them)
from huggingface_hub.utils import HFValidationError, validate_repo_id

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SMALL_FILES = ["*.json", "*.py", "*.txt", "*.model", "*.jinja", "*.tiktoken"]  # all a load reads but the weights
WEIGHT_FILES = ["*.safetensors"]
INDEX = "model.safetensors.index.json"  # a sharded folder's index: which shard holds each tensor


def require_tokenizer_files(directory: str | Path, target: str | Path, fix: str) -> None:
    """A target folder has tokenizer files (``tokenizer*``: what the loads read): without them transformers built an
    empty tokenizer (data.prepare then asked for a chat template, then found no row with loss tokens), or the
    folder was found without one only after the target had loaded. One rule and one message for every command."""
    if not any(Path(directory).glob("tokenizer*")):
        raise ValueError(f"--target {target}: {directory} has no tokenizer files (tokenizer.json, "
                         f"tokenizer_config.json): {fix}")


def is_hub_id(path_or_id: str | Path) -> bool:
    """``org/name`` that is not a local path (a local folder of that name wins, as in transformers)."""
    return not Path(str(path_or_id)).expanduser().exists() and bool(HUB_ID.match(str(path_or_id)))


def resolve_model_dir(path_or_id: str | Path, revision: str | None = None, what: str = "model",
                      allow_patterns: list[str] | None = None) -> Path:
    """A local folder is used as is; ``org/name`` is fetched with ``huggingface_hub.snapshot_download``
    (``allow_patterns``: which files; default everything a load reads, weights included)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_id)
    if path.exists():
        raise NotADirectoryError(f"{what} {text!r} is a file; pass the folder that holds config.json")
    if not HUB_ID.match(text):
        raise FileNotFoundError(f"{what} {text!r} is neither a local folder nor a Hub id of the form org/name")
    patterns = allow_patterns or SMALL_FILES + WEIGHT_FILES
    try:
        return Path(huggingface_hub.snapshot_download(text, revision=revision, allow_patterns=patterns))
    except Exception as e:  # the hub client raises many types; all mean "could not get it"
        reason = (str(e).strip().splitlines() or [""])[0]  # the client's messages run over several lines
        raise OSError(f"could not fetch {what} {text!r} from the Hugging Face Hub ({type(e).__name__}: {reason}), "
                      f"and there is no local folder {path.resolve()}. Check the id and your network, or pass "
                      "the folder (build it first if a recipe names one)") from e


def repo_id_problem(repo: str) -> str | None:
    """What is wrong with a Hub repo id (None: nothing); ``export.push --repo`` and training's
    ``export.push_repo`` say it."""
    if repo.count("/") != 1:
        return "use user/name or org/name (one '/')"
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        return str(e).splitlines()[0]
    return None


def shard_index(directory: Path) -> dict[str, str] | None:
    """``weight_map`` (tensor name -> shard file) of a sharded folder; None for a single-file one."""
    path = Path(directory) / INDEX
    if not path.is_file():
        return None
    try:
        return dict(json.loads(path.read_text())["weight_map"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a safetensors shard index ({type(e).__name__}: {e}): a truncated "
                         "download? Re-download or re-export the folder") from None


def fetch_model(path_or_id: str | Path, revision: str | None = None, what: str = "model") -> Path:
    """Everything a full load reads: a local folder as is; a Hub id's small files, then the shards its
    index names (a repo that also ships a consolidated copy or stray ``*.safetensors`` is not downloaded
    twice), or its one ``model.safetensors``."""
    if not is_hub_id(path_or_id):
        return resolve_model_dir(path_or_id, revision=revision, what=what)
    directory = resolve_model_dir(path_or_id, revision=revision, what=what, allow_patterns=SMALL_FILES)
    index = shard_index(directory)
    fetch_files(str(path_or_id), directory, sorted(set(index.values())) if index else ["model.safetensors"], what)
    return directory


# Words a quantized or converted copy adds after the model's name (``Qwen3-8B-MLX-4bit``, ``-AWQ``,
# ``-unsloth-bnb-4bit``); ``Base`` and ``Instruct`` are not among them: those are other weights.
COPY_SUFFIXES = re.compile(r"(?:[-_](?:\d+bit|mlx|bf16|fp16|fp8|fp4|int4|int8|awq|gptq|dwq|bnb|nf4|unsloth|"
                           r"quantized|dynamic|w4a16|w8a8|g\d+|q\d+(?:_\w+)?))+$")


def model_name(path_or_id: str) -> str:
    """The model a folder or Hub id names, lower case, without a copy's suffixes; a Hub cache folder
    (``models--Qwen--Qwen3-8B/snapshots/..``) names its repo."""
    cached = re.search(r"models--[^/]+--([^/]+)/snapshots/", str(path_or_id))
    name = cached.group(1) if cached else str(path_or_id).rstrip("/").split("/")[-1]
    return COPY_SUFFIXES.sub("", name.lower()) or name.lower()


def same_model(recorded: str, given: str) -> bool:
    """Two folders that exist here: the same folder. Otherwise by model name once a quantized copy's
    suffixes are dropped (``Qwen/Qwen3-8B`` and ``mlx-community/Qwen3-8B-4bit``), one name may carry a
    longer family prefix (``Meta-Llama-3.1-8B-Instruct`` and ``Llama-3.1-8B-Instruct``); ``Qwen3-8B-Base``
    is another model than ``Qwen3-8B`` (names that merely contain one another once counted as one)."""
    paths = [Path(str(x)).expanduser() for x in (recorded, given)]
    if all(p.is_dir() for p in paths):
        return paths[0].resolve() == paths[1].resolve()
    a, b = sorted((model_name(recorded), model_name(given)), key=len)
    return a == b or b.endswith("-" + a)


def snapshot_commit(directory: Path) -> str | None:
    """The commit of a ``huggingface_hub`` snapshot folder (``.../snapshots/<commit>``); None for other folders."""
    return directory.name if directory.parent.name == "snapshots" else None


def fetch_files(repo_id: str, directory: Path, files: list[str], what: str = "model") -> None:
    """Download ``files`` of a Hub repo into its snapshot ``directory``, at that snapshot's commit (a repo
    updated since cannot mix two versions); files already there are not fetched again."""
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        got = resolve_model_dir(repo_id, revision=snapshot_commit(directory), what=what, allow_patterns=missing)
        if got != directory:  # the same commit lands in the same snapshot folder
            raise OSError(f"{what} {repo_id!r}: fetched {missing} into {got}, expected {directory}")
        still = [f for f in missing if not (directory / f).is_file()]
        if still:  # HF_HUB_OFFLINE=1 answers with the cached snapshot as it is
            raise OSError(f"{what} {repo_id!r}: {still} not in the local snapshot {directory} and not fetched "
                          "(HF_HUB_OFFLINE=1?, or not in the repo): download them (hf download " + repo_id + " "
                          + " ".join(still) + ") or go online")


def weight_file_spans(directory: Path, repo_id: str | None = None, span: int = 1 << 20):
    """``(file name, size, first span bytes, last span bytes)`` of each weight file, in name order.

    A local folder (or a complete snapshot) is read from disk. A Hub snapshot missing shards (only the
    small files, or the embedding's shard) lists the repo's ``*.safetensors`` at the snapshot's commit
    and reads the absent ones' two spans by ranged requests (2 MiB per shard, not the shard): the
    same bytes, so the same fingerprint as a full download or a local copy.
    """
    local = sorted(directory.glob("*.safetensors")) + sorted(directory.glob("*.bin"))
    if repo_id is None:  # a local folder is read as it is
        complete = True
    elif (index := shard_index(directory)) is not None:
        complete = all((directory / f).is_file() for f in set(index.values()))
    else:
        complete = any(f.suffix == ".safetensors" for f in local)
    if complete:
        for f in local:
            yield (f.name, f.stat().st_size, *_local_spans(f, span))
        return
    yield from _remote_spans(repo_id, directory, span)


def _local_spans(path: Path, span: int) -> tuple[bytes, bytes]:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(span)
        fh.seek(max(size - span, 0))
        return head, fh.read(span)


def _remote_spans(repo_id: str, directory: Path, span: int):
    commit = snapshot_commit(directory)
    try:
        fs = huggingface_hub.HfFileSystem()
        entries = fs.ls(repo_id, detail=True, revision=commit)
        files = sorted((PurePosixPath(e["name"]).name, int(e["size"])) for e in entries
                       if e.get("type") == "file" and e["name"].endswith(".safetensors"))
        for name, size in files:
            if (directory / name).is_file():  # this shard was downloaded (same commit)
                yield (name, size, *_local_spans(directory / name, span))
                continue
            with fs.open(f"{repo_id}/{name}", "rb", revision=commit, block_size=span) as fh:
                head = fh.read(span)
                fh.seek(max(size - span, 0))
                yield name, size, head, fh.read(span)
    except Exception as e:  # the hub client raises many types; all mean "could not read it"
        raise OSError(f"could not read the weight files of {repo_id!r} (commit {commit}) from the Hugging Face Hub "
                      f"to fingerprint the target ({type(e).__name__}: {e}): check your network, or download the "
                      f"whole target (hf download {repo_id}) and pass its folder") from e
