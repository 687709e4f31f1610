"""What ``train/distill.py`` needs before its loop: the target, the prepared data, a feature provider.

Kept out of the entry script so the script reads as the loop. Everything here delegates:
tokenization, loss masks, regeneration and packing to ``data.prepare``, features to
``data.features.OnlineFeatures`` / ``data.store.FeatureStore``, loading to ``models.target``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from data import tiny_chat
from data.engine import offloaded
from data.features import OnlineFeatures, collate
from data.prepare import ensure_prepared, load_prepared
from data.readers import check_source, refuse_local_subset
from data.reuse import META_FILE
from data.store import FORMAT as STORE_FORMAT, INDEX as STORE_INDEX, FeatureStore, prepared_fingerprint
from models.config import DFlashConfig
from models.config_keys import ConfigError
from models.config_layout import is_drafter_config
from models.target_shape import TargetShape
from models.hub import INDEX, is_hub_id, resolve_model_dir
from models.mask_token import resolve_mask_token
from models.provenance import replaced_by_training
from models.quantization import is_mlx_quantized, parse_quantization
from models.quantize import resolve_target
from models.target import TargetModel
from models.target_folder import read_target_config
from models.tiny import TINY_VOCAB, tiny_config
from train.plan import borrows_target, held_out_rows, loads_whole_target
from train.tiny import NUM_LAYERS, build_tiny_target, parse_tiny


# ----------------------------------------------------------------------------- before anything loads
def check_inputs(cfg, out_dir: Path) -> None:
    """Every path the run will read, where it will write, and the drafter's shape against the target's, checked
    before anything is built, loaded or written: a mistyped source was once named only after the tiny target had
    been fitted for minutes, and an ``out_dir`` inside a model folder filled it with checkpoints and a lock."""
    refuse_model_folder_out_dir(cfg, out_dir)
    check_read_paths(cfg, out_dir)
    check_drafter_fits_target(cfg)


# What training writes into must not be (or lie inside) a folder something else owns: its checkpoints, final/,
# metrics.jsonl and lock file would mix with a model's files, and a later download or export replace them.
def model_folder_kind(folder: Path) -> str | None:
    """What ``folder`` is, when it is a folder some other tool owns: a model (config.json beside weights), a DFlash
    drafter, prepared data or a feature store; None otherwise."""
    config = folder / "config.json"
    if config.is_file():
        try:
            d = json.loads(config.read_text())
        except (OSError, ValueError):
            d = None
        if is_drafter_config(d):
            return "a DFlash drafter folder"
        if (folder / INDEX).is_file() or any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")):
            return "a model folder (config.json beside weights)"
    if (folder / META_FILE).is_file():
        return "a prepared data folder"
    index = folder / STORE_INDEX
    if index.is_file():
        try:
            if json.loads(index.read_text()).get("format") == STORE_FORMAT:
                return "a feature store"
        except (OSError, ValueError, AttributeError):
            pass
    return None


def refuse_model_folder_out_dir(cfg, out_dir: Path) -> None:
    """``out_dir`` equal to or inside the target's folder, another input folder, or any model, drafter, prepared
    data or feature store folder is refused (nothing has been written yet)."""
    out = Path(out_dir).expanduser().resolve()
    fix = f"give the run a folder of its own, e.g. out_dir=runs/{Path(cfg.recipe).stem or 'NAME'}"
    inputs = {"the target's folder (target.path)": cfg.target.path,
              "the quantized target's folder (target.quantization)": parse_quantization(cfg.target.quantization).path,
              "the warm start's folder (drafter.init_from)": cfg.drafter.init_from,
              "the feature store (features.store)": cfg.features.store, "data.prepared": cfg.data.prepared}
    for what, path in inputs.items():
        if not path or parse_tiny(path):
            continue
        folder = Path(path).expanduser().resolve()
        if folder.is_dir() and (out == folder or folder in out.parents):
            where = "is" if out == folder else "is inside"
            raise ValueError(f"out_dir={out_dir} {where} {what} {folder}: the run's checkpoints, final/, metrics and "
                             f"lock file would be written among its files; {fix}")
    for folder in (out, *out.parents):
        kind = model_folder_kind(folder) if folder.is_dir() else None
        if kind:
            where = "is" if folder == out else "is inside"
            raise ValueError(f"out_dir={out_dir} {where} {kind}, {folder}: the run's checkpoints, final/, metrics and "
                             f"lock file would be written among its files; {fix}")
    part = replaced_by_training(out)
    if part is not None:
        raise ValueError(f"out_dir={out_dir} is inside {part}, which its own run replaces whole; {fix}")


def check_read_paths(cfg, out_dir: Path) -> None:
    """Each path the run reads exists (and is what it should be): the target folder, an MLX-quantized copy, the
    data source when the data will be prepared, an offline store, a warm start."""
    path = cfg.target.path
    if path and not parse_tiny(path) and not is_hub_id(path):
        read_target_config(path, cfg.target.revision, what="target.path", weights=False)  # a folder with config.json
    quantized = parse_quantization(cfg.target.quantization).path
    if quantized and not is_hub_id(quantized) and not Path(quantized).expanduser().is_dir():
        raise FileNotFoundError(f"target.quantization=mlx:{quantized}: no such folder (and not a Hub id org/name): "
                                "give the folder mlx_lm.convert -q wrote, or target.quantization=mlx-4bit to quantize "
                                "the target into out_dir")
    prepared = Path(cfg.data.prepared).expanduser() if cfg.data.prepared else out_dir / "data"
    source = cfg.data.source
    if cfg.data.rebuild or not (prepared / META_FILE).is_file():  # the source will be read
        if not source:
            raise ValueError(f"data.source is empty and no prepared data set exists at {prepared}: set data.source "
                             "(file, folder, Hub id or tiny)")
        if source != "tiny":
            check_source(source, cfg.data.subset)
    elif cfg.data.subset and source and source != "tiny":
        refuse_local_subset(source, cfg.data.subset)
    if cfg.features.mode == "offline":  # its index alone: it exists and its extraction finished
        FeatureStore(cfg.features.store, verify=False)
    if cfg.drafter.init_from:  # a mistyped folder was named only once the target and the data had loaded
        warm_start_source(cfg.drafter.init_from)


def local_target_config(cfg) -> dict | None:
    """The target's config.json without any download: a tiny target's (fixed in code) or a local folder's; None
    for a Hub id (training checks its drafter's shape once the config has been fetched)."""
    arch = parse_tiny(cfg.target.path or "")
    if arch:
        return tiny_config(arch, TINY_VOCAB, NUM_LAYERS).to_dict()
    if not cfg.target.path or is_hub_id(cfg.target.path):
        return None
    return read_target_config(cfg.target.path, cfg.target.revision, weights=False)[1]


def check_drafter_fits_target(cfg) -> None:
    """The drafter the run would resolve for this target, checked from the target's config alone (taps past its
    layers, heads that do not divide, a mask token outside its embedding), with every key at once in the config
    (``RunConfig._check_drafter``)."""
    config = local_target_config(cfg)
    if config is None:
        return
    d = cfg.drafter
    try:
        DFlashConfig.for_target(
            TargetShape.from_config(config), mask_token_id=0 if d.mask_token_id is None else d.mask_token_id,
            num_hidden_layers=d.num_hidden_layers, num_taps=d.num_taps, target_layer_ids=d.target_layer_ids,
            num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
            intermediate_size=d.intermediate_size, block_size=d.block_size, rope_theta=d.rope_theta, variant=d.variant)
    except ConfigError as e:
        raise ValueError(f"the drafter.* settings do not fit the target {cfg.target.path}: {e}") from None


def load_target(cfg, out_dir: Path, accelerator, log):
    """The frozen target on this process's device (bf16 on CUDA unless target.dtype says otherwise)."""
    path = cfg.target.path
    if not path:
        raise ValueError("target.path is empty: set it to a local folder, a Hub id, or tiny:<arch>")
    arch = parse_tiny(path)
    if arch:
        path = str(out_dir / "tiny_target")
        if accelerator.is_main_process:
            build_tiny_target(path, arch=arch, log=log)
        accelerator.wait_for_everyone()
    # target.quantization: the quantized target replaces the bf16 one for everything downstream
    # (regeneration, features, KL, true tau), because that is what the drafter will run against.
    if accelerator.is_main_process:  # mlx-Nbit quantizes once, into out_dir (cached)
        resolve_target(path, cfg.target.quantization, out_dir, revision=cfg.target.revision, log=log)
    accelerator.wait_for_everyone()
    path, tq = resolve_target(path, cfg.target.quantization, out_dir, revision=cfg.target.revision, log=log)
    dtype = cfg.target.dtype
    if dtype == "auto":
        dtype = torch.bfloat16 if accelerator.device.type == "cuda" else torch.float32
    if cfg.target.device_map:  # spread over this node's GPUs; features and logits come back to the first one
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
            raise ValueError("target.device_map spreads one target over all GPUs of a node: launch one process per "
                             "node (accelerate launch --num_processes <nodes> ...), or drop target.device_map")
        placement = dict(device_map=cfg.target.device_map, max_memory=cfg.target.max_memory)
    else:
        placement = dict(device=accelerator.device)
    if (borrows_target(cfg) and in_safetensors(path, cfg.target.revision)
            and not loads_whole_target(cfg, accelerator.is_main_process, _fsdp(accelerator))):
        target = TargetModel.borrowed_parts(path, dtype=dtype, device=accelerator.device, revision=cfg.target.revision)
    else:
        target = TargetModel.from_pretrained(path, dtype=dtype, revision=cfg.target.revision, quantization=tq,
                                             **placement)
    if target.tokenizer is None:
        raise ValueError(f"target {path} has no tokenizer files: training needs its tokenizer and chat template")
    log(f"target: {path} ({target.model_type}, {target.num_layers} layers, hidden {target.hidden_size}, "
        f"vocab {target.vocab_size}, {target.dtype}, quantization {target.quantization})"
        + ("" if target.has_layers else "; embedding and LM head only: offline features need no decoder layers here"))
    return target, path


def in_safetensors(path: str, revision: str | None) -> bool:
    """A plain (not MLX-quantized) folder with safetensors shards, the two tensors can be read from.
    A Hub id with a shard index is answered from its small files (no shard downloaded here)."""
    directory, _ = read_target_config(path, revision, weights=False)
    if is_mlx_quantized(directory):
        return False
    if (directory / INDEX).is_file() or any(directory.glob("*.safetensors")):
        return True
    directory, _ = read_target_config(path, revision)  # a Hub id without an index: its one file is the model
    return any(directory.glob("*.safetensors"))


def _fsdp(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def load_data(cfg, target_path: str, target, out_dir: Path, accelerator, log):
    """(train rows, held-out rows, meta) of the prepared data set, preparing it first if needed."""
    from models.support import run_on_main

    prepared = Path(cfg.data.prepared) if cfg.data.prepared else out_dir / "data"

    def prepare_data() -> None:  # main process; re-use / refuse / rebuild rules in data.reuse
        source = cfg.data.source
        if source == "tiny":
            source = str(tiny_chat.write(out_dir / "tiny_chat.jsonl", n=cfg.data.tiny_conversations,
                                         seed=cfg.train.seed))
        ensure_prepared(target_path, source, prepared, explicit=bool(cfg.data.prepared), rebuild=cfg.data.rebuild,
                        log=log, regenerate=cfg.data.regenerate, thinking=cfg.data.thinking,
                        max_length=cfg.data.max_length, pack=cfg.data.pack, limit=cfg.data.limit,
                        split=cfg.data.split, subset=cfg.data.subset, progress=cfg.logging.progress,
                        gen_kwargs={"max_tokens": cfg.data.regenerate_max_tokens,
                                    "batch_size": cfg.data.regenerate_batch_size},
                        server_log=out_dir / "regenerate-server.log",
                        # a started vLLM/SGLang gets the GPU (nothing to move when only embedding and head loaded)
                        make_room=lambda: offloaded(target.model) if target.has_layers else contextlib.nullcontext(),
                        target_model=target)  # local regeneration: the loaded (maybe quantized) target, its device

    run_on_main(prepare_data, accelerator, what="data preparation")  # a failure there stops every process
    ds, meta = load_prepared(prepared, tokenizer=target.tokenizer, target=target, force=cfg.data.force_target)
    if cfg.data.thinking is not None and meta.get("thinking") not in (None, cfg.data.thinking):
        raise ValueError(f"{prepared} was prepared with thinking={meta.get('thinking')}, the recipe says "
                         f"data.thinking={cfg.data.thinking}: re-prepare, or point data.prepared elsewhere")
    if bool(meta.get("packed")) != cfg.data.pack:  # else the saved config would misdescribe the rows trained on
        raise ValueError(f"{prepared} was prepared with pack={bool(meta.get('packed'))}, the recipe says "
                         f"data.pack={cfg.data.pack}: set data.pack={str(bool(meta.get('packed'))).lower()}, or point "
                         "data.prepared elsewhere")
    n_eval = held_out_rows(cfg.data.eval_rows, len(ds))
    train_ds = ds.select(range(len(ds) - n_eval))
    # datasets refuses an empty range that starts at len(ds); data.eval_rows=0 means "no held-out rows"
    eval_ds = ds.select(range(len(ds) - n_eval, len(ds))) if n_eval else ds.select([])
    capped = (f" (data.eval_rows={cfg.data.eval_rows} capped at a fifth of the rows)"
              if n_eval < cfg.data.eval_rows else "")
    log(f"data: {prepared}: {len(train_ds)} training rows, {len(eval_ds)} held out{capped}")
    return train_ds, eval_ds, meta


class _Subset:
    """Rows ``offset ..`` of a feature store seen as the provider of one split of the prepared rows.

    Every batch is compared with the prepared rows it stands for (the same tokens), and carries their
    labels: features and top-k log-probs cover every token, so a store stays valid for rows relabelled
    since it was extracted (data prepared again under newer labelling rules), and the labels trained and
    evaluated on are the prepared data's, as online.
    """

    def __init__(self, store, offset: int, rows, name: str | None):
        self.store, self.offset, self.rows, self.name = store, offset, rows, name

    def __len__(self) -> int:
        return len(self.rows)

    def get_batch(self, indices):
        batch = self.store.get_batch([self.offset + int(i) for i in indices])
        tokens = token_batch(self.rows, indices)
        check_same_rows(tokens, batch, self.name)
        return dataclasses.replace(batch, loss_mask=tokens.loss_mask.to(batch.loss_mask.device))


def make_features(cfg, target, layer_ids: list[int], train_ds, eval_ds, device):
    """Providers for the training and held-out rows: online (target in the step) or offline (store)."""
    if cfg.features.mode == "online":
        topk = cfg.train.kl_topk if cfg.train.loss != "ce" else 0
        if topk > target.vocab_size:  # torch.topk's "selected index k out of range" at the first step
            raise ValueError(f"train.kl_topk={topk} is more than the target's {target.vocab_size} tokens: keep "
                             "fewer (default 32)")
        return (OnlineFeatures(target, layer_ids, data=train_ds, topk=topk),
                OnlineFeatures(target, layer_ids, data=eval_ds, topk=0))
    store = FeatureStore(cfg.features.store, dtype=target.dtype, device=device)
    store.check_compatible(target=target, layer_ids=layer_ids, tokenizer=target.tokenizer)
    if len(store) != len(train_ds) + len(eval_ds):
        raise ValueError(f"feature store {cfg.features.store} has {len(store)} rows but the prepared data has "
                         f"{len(train_ds) + len(eval_ds)}: extract features from the same prepared data set")
    if cfg.train.loss != "ce" and not store.index.get("topk"):
        raise ValueError(f"train.loss={cfg.train.loss} needs top-k log-probs in the store: re-extract with --topk")
    name = cfg.features.store
    splits = (_Subset(store, 0, train_ds, name), _Subset(store, len(train_ds), eval_ds, name))
    recorded = store.index.get("data_fingerprint")
    if recorded and recorded != prepared_fingerprint(train_ds):
        # Other prepared data, or the same rows prepared again (a new fingerprint each time): compare the first
        # rows of both splits now, so the step-0 eval never runs on another data set's features; every batch
        # is still compared as it is read.
        for split in splits:
            if len(split):
                split.get_batch([0])
    return splits


def token_batch(ds, indices):
    """The token columns of prepared rows as a right-padded ``FeatureBatch`` (no features): what the
    anchor draw needs, read before any feature is computed or loaded."""
    return collate([ds[int(i)] for i in indices])


def check_same_rows(tokens, batch, store: str | None) -> None:
    """The provider's batch holds the same tokens as the prepared rows the blocks were drawn from."""
    real = tokens.doc_ids >= 0
    same = (tokens.input_ids.shape == batch.input_ids.shape and torch.equal(batch.doc_ids.cpu() >= 0, real)
            and torch.equal(tokens.input_ids[real], batch.input_ids.cpu()[real])
            and torch.equal(tokens.doc_ids, batch.doc_ids.cpu()))  # labels may differ: the prepared rows' are used
    if not same:
        raise ValueError(f"feature store {store} holds other tokens than the prepared data (data.prepared) for the "
                         "same rows: extract features from the same prepared data set")


def data_token_ids(ds, max_rows: int = 2000) -> set[int]:
    """Token ids that occur in (the first ``max_rows`` rows of) a prepared data set."""
    ids: set[int] = set()
    for row in ds.select(range(min(len(ds), max_rows)))["input_ids"]:
        ids.update(int(i) for i in row)
    return ids


def resolve_drafter_config(cfg, target, produced_ids: set[int], mixed_precision: str, log):
    """The drafter's canonical config from the target's shape and the ``drafter.*`` keys, and its mask token.

    One resolver (``DFlashConfig.for_target``) for training, the dry-run plan and the benches; the
    mask token follows ``models.mask_token.resolve_mask_token`` and the choice is printed with its reason.
    """
    d = cfg.drafter
    mask = resolve_mask_token(target.vocab_size, target.tokenizer, explicit=d.mask_token_id, produced_ids=produced_ids)
    shape = TargetShape.from_config(target.config)
    drafter_cfg = DFlashConfig.for_target(
        shape, hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_target_layers=target.num_layers,
        max_position_embeddings=target.max_position_embeddings, mask_token_id=mask.id,
        num_hidden_layers=d.num_hidden_layers, num_taps=d.num_taps,
        target_layer_ids=d.target_layer_ids, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim, intermediate_size=d.intermediate_size,
        block_size=d.block_size, rope_theta=d.rope_theta, variant=d.variant,
        torch_dtype="bfloat16" if mixed_precision == "bf16" else "float32")
    drafter_cfg.check_target(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                             num_layers=target.num_layers)
    named = f" {mask.token!r}" if mask.token else ""
    log(f"mask token: {mask.id}{named}: {mask.reason}")
    kind = "DFlash2, " if drafter_cfg.variant == "dflash2" else ""
    log(f"drafter: {kind}{drafter_cfg.num_hidden_layers} layers, taps {drafter_cfg.target_layer_ids}, block "
        f"{drafter_cfg.block_size}, RoPE base {drafter_cfg.rope_theta:g}, "
        f"{drafter_cfg.num_parameters() / 1e6:.2f}M parameters")
    return drafter_cfg


# A warm start keeps its folder's weights, so it must have the shape the run resolved and take what training
# feeds it (taps, block, mask): a difference is refused, never silently kept (a drafter once trained on the
# run's taps and was saved with the folder's). Layer kinds and norm eps, which no key sets, are the folder's.
WARM_START_TARGET = ("hidden_size", "vocab_size", "num_target_layers")
WARM_START_KEYS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                   "target_layer_ids", "block_size", "mask_token_id", "rope_theta")
# rope_scaling, attention_bias: a published gpt-oss drafter's YaRN block and q/k/v/o biases, its weights' own
WARM_START_KEPT = ("rms_norm_eps", "layer_types", "sliding_window", "sliding_block_attention", "rope_scaling",
                   "attention_bias")
# A DFlash2 run from a DFlash2 folder keeps its conv and selector settings too (no recipe key sets them); from a v1
# folder only the backbone is taken (not its layer kinds: DFlash2's are sliding), with identity convs and a fresh
# selector.
WARM_START_DFLASH2 = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
                      "final_logit_softcapping", "input_embedding_scale")


def warm_start_source(init_from: str):
    """The drafter config of ``drafter.init_from``'s folder; a folder that is missing or no full-precision drafter
    is refused. Training calls it before anything loads, and again when it has the run's config to compare."""
    directory = resolve_model_dir(init_from, what="drafter.init_from")
    try:
        loaded = DFlashConfig.load(directory)
    except ConfigError as e:
        raise ValueError(f"drafter.init_from={init_from}: not a DFlash drafter folder ({e}); give a drafter's "
                         "folder (a run's final/drafter, checkpoints/step_N/drafter or an HF export)") from None
    if loaded.quantization:
        raise ValueError(f"drafter.init_from={init_from} is a quantized MLX export: warm-start from the "
                         "full-precision drafter (its HF export or the run's final/drafter)")
    return loaded


def warm_start_config(init_from: str, drafter_cfg):
    """The run's drafter config for ``drafter.init_from``: checked against the folder's, with the folder's
    layer kinds and norm eps."""
    loaded = warm_start_source(init_from)

    def differing(names):
        return [(n, getattr(loaded, n), getattr(drafter_cfg, n)) for n in names
                if getattr(loaded, n) != getattr(drafter_cfg, n)]

    def listed(rows):
        return "; ".join(f"{n}: {have!r} in the folder, {want!r} in this run" for n, have, want in rows)

    if differing(WARM_START_TARGET):
        raise ValueError(f"drafter.init_from={init_from} was trained for another target "
                         f"({listed(differing(WARM_START_TARGET))}): warm-start from a drafter of this target")
    if loaded.variant == "dflash2" and drafter_cfg.variant != "dflash2":
        raise ValueError(f"drafter.init_from={init_from} is a DFlash2 drafter and this run trains variant "
                         f"{drafter_cfg.variant}: set drafter.variant=dflash2")
    same_variant = loaded.variant == drafter_cfg.variant
    rows = differing(WARM_START_KEYS)
    if rows:
        fix = " ".join(f"drafter.{n}={json.dumps(have).replace(' ', '')}" for n, have, _ in rows)
        raise ValueError(f"drafter.init_from={init_from} does not match the drafter this run resolved "
                         f"({listed(rows)}). To continue from it, add: {fix}")
    kept = (WARM_START_KEPT + (WARM_START_DFLASH2 if loaded.variant == "dflash2" else ())) if same_variant else \
        ("rms_norm_eps",)
    return drafter_cfg.replace(**{n: getattr(loaded, n) for n in kept})
