"""A small *trained* Qwen3 target for experiments: fitted on Python standard-library sources.

    python -m lab.small_target --out runs/small-target              # 7.35M params (8 layers, hidden 256)
    python -m lab.small_target --out /tmp/st --steps 40 --hidden 64 # a quick smoke build

Build time of the default (measured): 56 s on an H100 (fit 30 s), ~16 min on 2 CPU cores (1.55 s per
fit step on 2 threads: 220 of the 600 steps in 369 s). Final fit loss 2.75 nats/token; greedy
check on 8 held-out prompts x 64 tokens: distinct-3-gram ratio 0.73, 8 of 8 outputs different.

Acceptance only means something against a target that has learnt something: a random or barely
fitted target's greedy output is noise or one repeated token, and either makes tau meaningless
(noise is unpredictable, a loop is trivially predictable). This one is fitted on real text with
structure -- the Python standard library found on this machine (``sysconfig``'s stdlib folder) --
until its greedy output is plausible, varied code.

What it writes into the folder (an HF repo layout; ``models.target.TargetModel.from_pretrained`` and
``mlx_lm.load`` both read it):

- ``config.json`` + ``model.safetensors`` (Qwen3, fp32) and a byte-level BPE tokenizer trained on the
  training files, with ChatML specials and a chat template (``tokenizer.json`` ...);
- ``chats.jsonl``: conversations from the *training* files (user: a few lines of a file, assistant:
  the lines that follow), the drafter's training data (OpenAI ``messages`` JSONL);
- ``prompts.jsonl``: held-out prompts from *held-out* files (``messages`` without the answer, plus
  the original continuation as ``reference``), for true tau;
- ``small_target.json``: the build settings, a hash of the corpus, the fit log and a greedy sample check.

Deterministic: files are sorted by relative path and split train / held-out by a hash of that path
(not by random draws), the fit uses seeded generators. The corpus differs between Python versions,
so its hash is part of the cache key: a changed setting or a different stdlib rebuilds, the same ones
return the cached folder at once. The target sees every sequence in the chat layout it is later
prompted with, and learns the whole text (user and assistant side).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

BUILD_VERSION = 1  # bump when the procedure changes (invalidates cached folders)
STAMP_FILE = "small_target.json"
MAX_POSITIONS = 2048  # the target's max_position_embeddings
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data",
             "encodings", "ensurepip", "turtledemo", "lib2to3"}  # tests and data tables are not code prose


@dataclass
class SmallTargetSpec:
    """Everything that decides the result (hashed into the cache key)."""

    seed: int = 0
    hidden: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    vocab: int = 2048  # BPE vocabulary incl. the 256 byte symbols and the specials
    spare_rows: int = 8  # embedding rows past the tokenizer: the drafter's mask token goes there
    rope_theta: float = 10000.0
    steps: int = 600
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    max_train_bytes: int = 3_000_000  # corpus cap (the stdlib is ~20 MB): a 7M model sees ~1 pass in 10 min
    held_out_every: int = 10  # one file in N (by path hash) is held out
    chats: int = 2000  # drafter training conversations written to chats.jsonl
    prompts: int = 64  # held-out prompts written to prompts.jsonl


# ----------------------------------------------------------------------------- corpus
def stdlib_files(held_out_every: int, corpus: str | Path | None = None) -> tuple[Path, list[Path], list[Path]]:
    """(corpus root, training files, held-out files), sorted by path; the split is a hash of the path.

    ``corpus`` defaults to this Python's standard library; any folder of ``.py`` files works (a copy
    of another machine's stdlib gives the same target key there, since only contents are hashed).
    """
    root = Path(corpus) if corpus else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"corpus folder {root} not found: pass a folder of .py files (default: the stdlib)")
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]  # pruned, not walked: the test suites are large
        for name in names:
            p = Path(folder) / name
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            try:
                size = p.stat().st_size
            except OSError:
                continue
            if 2_000 <= size <= 80_000:  # tiny stubs teach nothing; huge files are mostly generated tables
                files.append(p)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise FileNotFoundError(f"no usable .py files under {root} (2-80 kB, not tests): the small target needs "
                                "them (default: this Python's lib/pythonX.Y folder)")

    def held(p: Path) -> bool:
        return int(hashlib.sha256(p.relative_to(root).as_posix().encode()).hexdigest()[:8], 16) % held_out_every == 0

    train, held_out = [p for p in files if not held(p)], [p for p in files if held(p)]
    if not train or not held_out:  # the held-out prompts and the training chats both need files
        raise ValueError(f"{root} has {len(files)} usable .py files (2-80 kB, not tests); split one in "
                         f"{held_out_every} by path hash they give {len(train)} training and {len(held_out)} held-out "
                         "files, and both need some: give a larger --corpus folder (dozens of files)")
    return root, train, held_out


def read_texts(files: list[Path], max_bytes: int) -> list[str]:
    texts, total = [], 0
    for p in files:
        if total >= max_bytes:
            break
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        t = t.replace("\t", "    ")
        texts.append(t)
        total += len(t)
    return texts


def corpus_hash(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()[:16]


def conversations(texts: list[str], n: int, seed: int, max_chars: int = 700) -> list[dict]:
    """``n`` (prompt lines, continuation lines) pairs at seeded places of the texts, as chat messages."""
    rng = random.Random(seed)
    out = []
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        lines = rng.choice(texts).splitlines()
        if len(lines) < 24:
            continue
        start = rng.randrange(0, len(lines) - 20)
        k, m = rng.randint(4, 10), rng.randint(6, 14)
        prompt, answer = "\n".join(lines[start:start + k]), "\n".join(lines[start + k:start + k + m])
        if len(prompt.strip()) < 40 or len(answer.strip()) < 40 or len(prompt) + len(answer) > max_chars:
            continue
        out.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return out


# ----------------------------------------------------------------------------- tokenizer, model
def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(spec: SmallTargetSpec, vocab_size: int, tok):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
        tie_word_embeddings=False, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def token_stream(tok, convs: list[dict]) -> list[int]:
    """All conversations rendered with the chat template, tokenized, concatenated."""
    ids: list[int] = []
    for c in convs:
        ids += tok(tok.apply_chat_template(c["messages"], tokenize=False), add_special_tokens=False)["input_ids"]
    return ids


# ----------------------------------------------------------------------------- quality check
def distinct_ngram_ratio(tokens: list[int], n: int = 3) -> float:
    """Distinct n-grams / n-grams of one generation: 1.0 never repeats, a loop drives it to ~0."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@torch.no_grad()
def greedy_samples(model, tok, prompts: list[dict], max_new_tokens: int = 64) -> list[list[int]]:
    """Greedy continuations (new tokens only, stopping at EOS) of chat prompts."""
    outs = []
    model.eval()
    for p in prompts:
        ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        x = torch.tensor([list(ids)], device=model.device)
        y = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
        new = y[0, x.shape[1]:].tolist()
        if tok.eos_token_id in new:
            new = new[:new.index(tok.eos_token_id)]
        outs.append(new)
    return outs


@torch.no_grad()
def heldout_loss(model, tok, prompts: list[dict]) -> float:
    """Mean next-token loss (nats) on the held-out reference continuations, given their prompts.

    Catches what the n-gram ratio cannot: an unfitted model's noise is varied too, but scores
    about ln(vocab) here.
    """
    total, count = 0.0, 0
    for p in prompts:
        ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = tok(p["reference"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        x = torch.tensor([list(ids) + answer], device=model.device)
        logits = model(input_ids=x).logits[0, len(ids) - 1:-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, x[0, len(ids):], reduction="sum"))
        count += len(answer)
    return total / max(count, 1)


def sample_quality(samples: list[list[int]], n: int = 3) -> dict:
    """Mean distinct-n ratio per generation, fraction of distinct generations, mean length."""
    ratios = [distinct_ngram_ratio(s, n) for s in samples if len(s) > n]
    return {f"distinct_{n}gram": round(sum(ratios) / len(ratios), 4) if ratios else 0.0,
            "distinct_outputs": round(len({tuple(s) for s in samples}) / max(len(samples), 1), 4),
            "mean_new_tokens": round(sum(map(len, samples)) / max(len(samples), 1), 1)}


# A loop of period <= 6 tokens stays under 0.1 distinct 3-grams; half the prompts giving the same
# continuation means the prompt is ignored. Either way acceptance measured on it says nothing.
DISTINCT_3GRAM_MIN = 0.1
DISTINCT_OUTPUTS_MIN = 0.5


def degenerate(quality: dict) -> str | None:
    """Why a target's greedy check (``sample_quality``) says it loops, or None when it talks."""
    if quality.get("distinct_3gram", 0.0) <= DISTINCT_3GRAM_MIN:
        return f"distinct-3-gram ratio {quality.get('distinct_3gram')} <= {DISTINCT_3GRAM_MIN} (a loop)"
    if quality.get("distinct_outputs", 0.0) < DISTINCT_OUTPUTS_MIN:
        return f"{quality.get('distinct_outputs')} of the prompts give distinct outputs (< {DISTINCT_OUTPUTS_MIN})"
    return None


# ----------------------------------------------------------------------------- build
def _stamp(spec: SmallTargetSpec, chash: str) -> dict:
    return {"build_version": BUILD_VERSION, "spec": asdict(spec), "corpus_hash": chash}


def build_small_target(directory: str | Path, seed: int = 0, log=print, progress: bool = True,
                       corpus: str | Path | None = None, device: str = "auto", **settings) -> Path:
    """The small trained target folder (built, or the cached one when its settings and corpus match).

    ``settings`` override :class:`SmallTargetSpec` fields (``steps=40, hidden=64`` for a quick build).
    ``device``: auto = CUDA when there is one (the fit is ~50x faster there; results differ from a CPU
    fit in rounding only), else the CPU. The folder stores weights in fp32 either way.
    """
    from tqdm import tqdm

    spec = SmallTargetSpec(seed=seed, **settings)
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file: the small target needs a folder (created if missing)")
    if directory.exists() and not (directory / STAMP_FILE).is_file() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not a small target (no {STAMP_FILE}): building here would "
                              "overwrite what it holds. Pick another folder, or empty it first")
    root, train_files, held_files = stdlib_files(spec.held_out_every, corpus)
    train_texts = read_texts(train_files, spec.max_train_bytes)
    held_texts = read_texts(held_files, spec.max_train_bytes // 4)
    stamp = _stamp(spec, corpus_hash(train_texts + ["\0held\0"] + held_texts))
    marker = directory / STAMP_FILE
    if marker.is_file():
        old = json.loads(marker.read_text())
        if {k: old.get(k) for k in stamp} == stamp:
            return directory
        log(f"{directory}: settings or corpus changed since it was built: rebuilding")
    t0 = time.perf_counter()
    log(f"building small target in {directory}: {len(train_texts)} training files "
        f"({sum(map(len, train_texts)) / 1e6:.1f} MB) and {len(held_texts)} held-out files from {root}")
    directory.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(train_texts, spec.vocab)
    vocab_size = len(tok) + spec.spare_rows
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    model = make_model(spec, vocab_size, tok).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  tokenizer: {len(tok)} tokens (+{spec.spare_rows} spare rows); model: {n_params / 1e6:.2f}M parameters")

    # Fitting data: every training file cut into chat-shaped (prompt lines, continuation) pairs,
    # the layout the target is prompted with later. Random windows of the concatenated stream.
    fit_convs = conversations(train_texts, n=min(max(4 * spec.steps * spec.batch * spec.seq_len // 600, 200), 20000),
                              seed=spec.seed + 1, max_chars=1200)
    stream = torch.tensor(token_stream(tok, fit_convs), device=dev)
    log(f"  fit stream: {len(fit_convs)} conversations, {len(stream) / 1e6:.2f}M tokens")
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, spec.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(max(s - warmup, 0) / max(spec.steps - warmup, 1), 1.0))) * 0.9 + 0.1))
    model.train()
    fit_log = []
    bar = tqdm(range(spec.steps), desc="fit small target", unit="step", disable=not progress, dynamic_ncols=True)
    for step in bar:
        # Drawn on the CPU generator: the same windows on any device.
        starts = torch.randint(0, len(stream) - spec.seq_len - 1, (spec.batch,), generator=gen)
        x = torch.stack([stream[s:s + spec.seq_len] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == spec.steps - 1:
            fit_log.append({"step": step, "loss": round(loss.item(), 4), "seconds": round(time.perf_counter() - t0, 1)})
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if not progress:
                log(f"  fit step {step}: loss {loss.item():.3f} ({fit_log[-1]['seconds']} s)")
    model.eval()
    fit_seconds = round(time.perf_counter() - t0, 1)
    if not math.isfinite(loss.item()):
        raise ValueError(f"the small target's fit diverged (loss {loss.item()}): lower --lr (now {spec.lr})")

    # Held-out prompts and the training chats for the drafter; then a greedy check on held-out prompts.
    held = conversations(held_texts, n=spec.prompts, seed=spec.seed + 2)
    prompts = [{"messages": c["messages"][:1], "reference": c["messages"][1]["content"]} for c in held]
    chats = conversations(train_texts, n=spec.chats, seed=spec.seed + 3)
    quality = {**sample_quality(greedy_samples(model, tok, prompts[:8])),
               "heldout_loss": round(heldout_loss(model, tok, prompts), 4)}
    model.generation_config.do_sample = False
    model.cpu().save_pretrained(directory)
    tok.save_pretrained(directory)
    gen_cfg = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    for name, rows in (("prompts.jsonl", prompts), ("chats.jsonl", chats)):
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    seconds = round(time.perf_counter() - t0, 1)
    info = {**stamp, "stdlib": str(root), "train_files": len(train_texts), "held_out_files": len(held_texts),
            "parameters": n_params, "tokenizer_size": len(tok), "fit_log": fit_log, "greedy_check": quality,
            "build_seconds": seconds, "fit_seconds": fit_seconds, "device": str(dev),
            "threads": torch.get_num_threads()}
    marker.write_text(json.dumps(info, indent=1) + "\n")
    log(f"  small target ready in {seconds} s: final loss {fit_log[-1]['loss']}, greedy check {quality}")
    warn_if_degenerate(directory, log)
    return directory


def warn_if_degenerate(directory: Path, log=print) -> str | None:
    """Say so when the target's greedy check found a loop or prompt-blind output (acceptance on it means
    little: a loop is trivially predictable); returns the reason, or None."""
    info = json.loads((Path(directory) / STAMP_FILE).read_text())
    why = degenerate(info["greedy_check"]) if info.get("greedy_check") else None
    if why:
        spec = info.get("spec") or {}
        log(f"warning: the small target in {directory} does not talk yet ({why}): tau measured against it says "
            f"little about a drafter. Fit it longer or larger (now --steps {spec.get('steps')}, --hidden "
            f"{spec.get('hidden')}; the default build talks)")
    return why


def small_target_prompts(directory: Path, n: int | None = None) -> list[dict]:
    """The first ``n`` (all: None) held-out chats of ``prompts.jsonl``; an empty or malformed file is named
    before anything trains (the experiments found it after training, as a ZeroDivisionError or a bare
    JSONDecodeError)."""
    path = Path(directory) / "prompts.jsonl"
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if len(rows) == n:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {i} is not JSON ({e}): rebuild the folder with python -m "
                             "lab.small_target") from None
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
            raise ValueError(f"{path} line {i} has no \"messages\" turns: each row is one held-out chat "
                             "(python -m lab.small_target writes them)")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no prompts: tau is measured on them; rebuild the folder with python -m "
                         "lab.small_target")
    return rows


def small_target_prompt_ids(directory: Path, n: int) -> list[list[int]]:
    """Token ids of the first ``n`` held-out prompts (the folder's chat template, generation prompt added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    return [list(tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False))
            for r in small_target_prompts(directory, n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lab.small_target", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Re-running with the same settings returns the cached folder at once.")
    p.add_argument("--out", required=True, help="target folder (created; cached by settings and corpus hash)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    defaults = SmallTargetSpec()
    for name in ("hidden", "layers", "intermediate", "vocab", "steps", "batch", "seq_len", "chats", "prompts"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name),
                       help=f"default {getattr(defaults, name)}")
    p.add_argument("--lr", type=float, default=defaults.lr, help=f"default {defaults.lr}")
    p.add_argument("--corpus", default=None, help="folder of .py files (default: this Python's standard library)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto = CUDA when present")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    a = p.parse_args(argv)
    for name in ("hidden", "layers", "intermediate", "vocab", "steps", "batch", "seq_len", "chats", "prompts"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(a, name)})")
    if not 0 < a.lr < math.inf:  # 0 fitted nothing for the whole build; negative or nan failed after the tokenizer
        raise ValueError(f"--lr {a.lr}: use a positive learning rate (default {defaults.lr})")
    if a.hidden % defaults.heads:
        raise ValueError(f"--hidden must be a multiple of {defaults.heads} (the head count), got {a.hidden}")
    if a.seq_len > MAX_POSITIONS:
        raise ValueError(f"--seq-len {a.seq_len} is longer than the target's {MAX_POSITIONS} positions: use at most "
                         f"{MAX_POSITIONS}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device: use --device cpu (or auto)")
    if a.vocab < 300:
        raise ValueError(f"--vocab must be >= 300 (256 byte symbols + specials + merges), got {a.vocab}")
    settings = {k: getattr(a, k) for k in ("hidden", "layers", "intermediate", "vocab", "steps", "batch", "seq_len",
                                           "chats", "prompts", "lr")}
    out = build_small_target(a.out, seed=a.seed, progress=not a.no_progress, corpus=a.corpus, device=a.device,
                             **settings)
    print(out)


if __name__ == "__main__":
    from models.support import run_cli

    run_cli(main)
