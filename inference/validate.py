"""How good is a drafter on the target you run, and how much faster is it? Acceptance, speed, losslessness.

    python -m inference.validate --backend mlx --target Qwen/Qwen3.5-9B --draft ./my-drafter --out runs/val-bf16
    python -m inference.validate --backend mlx --target mlx-community/Qwen3.5-9B-4bit --draft ./my-drafter \\
        --prompts all --n 10 --repeats 3 --out runs/val-4bit
    python -m inference.validate --compare runs/val-bf16/report.json runs/val-4bit/report.json --out runs/cmp
    python -m inference.validate --backend torch --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 \\
        --prompts openai/gsm8k --subset main --split test --n 50

Method (the same for every backend, so numbers compare):

1. Pre-flight on the two ``config.json`` files before any weights load: a swapped ``--target`` /
   ``--draft``, a drafter for another target (hidden size, vocabulary, layer ids vs the target's
   depth, mask id outside the embedding), a block size above the trained one, an empty prompt set,
   ``--n 0``, a negative temperature, a drafter whose weights hold NaN / Inf and a quantized MLX
   drafter on the torch backend each end in one ``error:`` line; a drafter that records a
   different target than ``--target`` gets a warning.
2. Prompts (``inference.prompt_sets``; several shipped sets: ``--prompts code,math``) are rendered
   once with the target's chat template and a thinking switch: ``--thinking``, else the one the
   drafter was trained with (its provenance block's ``data.thinking``, said in one line), else off;
   an explicit ``--thinking`` that differs from the drafter's gets a warning. DFlash and the
   baseline get the identical prompt token ids. Prompts whose tokens plus ``--max-new-tokens`` run
   past the target's positions are skipped, with a count by category (``skipped_too_long``).
3. A warm-up generation of both (not recorded), then for every prompt and every repeat the
   baseline (the target alone through the same backend's loop module, same dtype, stop rules and
   timers: ``inference.session.Session.baseline``) and DFlash (``Session.run``), alternating.
   Timings are the median over ``--repeats``; acceptance comes from the loop's own
   ``GenerationResult`` (``inference.stats``). Peak memory: ``mx.get_peak_memory`` (MLX),
   ``torch.cuda.max_memory_allocated`` (CUDA); null on a torch CPU run.

Outputs in ``--out``: ``report.json``, ``report.md``, ``acceptance.png`` (needs the ``plot`` extra,
matplotlib; skipped with one warning without it), and a table on stdout; an earlier run's
``report.json`` there is kept as ``report.json.old`` (``.old.1`` ... for older ones). While it runs, each
finished prompt is appended to ``--out/partial.jsonl``: an interrupted run (Ctrl-C, a crash)
resumes with the same command, measuring only the missing prompts (``inference.partial``; a file
written with other settings is set aside, never mixed in).

report.json (schema ``draftsmith.validate/1``), flat at the top level; every group key is defined
in ``inference.report``:

- what ran: ``schema``, ``backend``, ``loop`` (eager / static / compiled, or the MLX loop), ``device``
  (with the GPU / Apple chip name), ``platform``, ``machine``,
  ``dtype`` (target compute dtype), ``draft_dtype``, ``target``, ``draft`` (as given),
  ``target_model_type``, ``target_quantization`` (e.g. ``"4-bit affine, group 64"``, from the target
  folder's config; null = not quantized), ``recorded_target``, ``block_size``,
  ``trained_block_size``, ``mask_token_id``, ``draft_quantization`` (None for full precision),
  ``draft_signature`` (first values of the drafter's norm
  weights), ``draft_hashes`` (exact hashes of ``fc``'s first rows and the norms, in each dtype: what
  ``export.push`` matches the report to its folder by), ``temperature``, ``thinking``,
  ``max_new_tokens``, ``repeats``, ``seed``, ``prompts``, ``prompt_set_hash``, ``prompt_tokens_total``,
  ``skipped_too_long`` (prompts past the target's positions, not measured), ``created``,
  ``python_version``, ``torch_version``, ``transformers_version``, ``mlx_version``,
  ``mlx_lm_version``, ``draftsmith_version``;
- overall numbers: ``tau`` (pooled over all cycles: the headline), ``tau_per_prompt_mean``,
  ``speedup``, ``dflash_tok_s``, ``baseline_tok_s``, ``cycle_s``, ``baseline_token_s``,
  ``cycle_cost``, ``ttft_s``, ``baseline_ttft_s``, ``acceptance_histogram`` ({length: cycles}),
  ``position_acceptance`` (list, slot 1..B-1), ``tau_first_quarter``, ``tau_last_quarter``,
  ``identical_share``, ``first_divergence_min``, ``truncated``, ``baseline_truncated``,
  ``num_prompts``, ``num_cycles``, ``num_tokens``, ``peak_memory_bytes``,
  ``baseline_peak_memory_bytes``, ``resumed_prompts`` (prompts measured by an interrupted run);
- ``per_category``: {category: the same group numbers}; ``per_prompt``: a list with each prompt's
  numbers (id, category, tau, timings, first divergence, acceptance lengths...).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from importlib import metadata
from pathlib import Path

import tqdm

from inference import partial
from inference.checks import (
    LOOPS,
    check_draft_weights,
    check_drafter_backend,
    check_dtype,
    check_fetched_draft_weights,
    check_target_tokenizer,
    check_temperature,
    preflight,
    resolve_thinking,
)
from inference.prompt_sets import BUILTIN, load_prompts, prompt_set_hash, render_prompts
from inference.report import (PromptRun, build_report, compare_rows, markdown, table_rows, text_table,
                              write_plot)
from models.config_layout import describe_quantization
from models import hub
from models.support import full_disk_named, hold, set_aside
from models.provenance import refuse_training_output


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model: local folder or Hugging Face Hub id (bf16 or MLX-quantized)")
    p.add_argument("--draft", help="DFlash drafter: local folder or Hub id")
    p.add_argument("--backend", choices=["auto", "torch", "mlx"], default="auto",
                   help="torch (CUDA or CPU), mlx (Metal, or CPU on Linux), auto: mlx on Apple Silicon")
    p.add_argument("--prompts", default="all",
                   help=f"{'|'.join(BUILTIN)}|all (shipped sets; several: code,math), a .jsonl of chat messages, a "
                        "folder, or a Hub data set id (default: all)")
    p.add_argument("--split", default="test", help="data set split for a Hub id or save_to_disk folder (default: test)")
    p.add_argument("--subset", default=None, help="data set config name for a Hub id (e.g. main for openai/gsm8k)")
    p.add_argument("--n", type=int, default=None, help="first N prompts of each category (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per prompt; outputs that hit it are flagged")
    p.add_argument("--block-size", type=int, default=None, help="at most the drafter's trained block size")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs compared token by token)")
    p.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="the chat template's thinking switch (default: the drafter's recorded training setting, "
                        "else off)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and mode; timings are the median")
    p.add_argument("--seed", type=int, default=0, help="sampling seed when --temperature > 0")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, help="compute dtype: float32, bfloat16 or float16 (default: the "
                                                  "backend's: torch bf16 on cuda / fp32 on cpu, mlx the checkpoint's)")
    p.add_argument("--loop", choices=LOOPS, default="auto",
                   help="torch: auto (default) = static caches + CUDA graphs on a GPU for full-attention targets, "
                        "else eager; static / compiled (graphs + torch.compile) / eager force one (static also "
                        "runs Qwen3.5 targets)")
    p.add_argument("--out", default="validate-report",
                   help="folder for report.json, report.md, acceptance.png (--compare: compare.png); "
                        "default ./validate-report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--compare", nargs="+", metavar="REPORT_JSON",
                   help="compare reports side by side (ratios to the first) and write compare.png to --out; a "
                        "validate --out folder stands for its report.json")
    args = p.parse_args(argv)
    if Path(args.out).exists() and not Path(args.out).is_dir():  # found before any model loads
        p.error(f"--out {args.out} is a file: give a folder for the report (created if missing)")
    try:  # a report inside a run's final/ went with the next save of the final drafter
        refuse_training_output(args.out, "report", "validate")
    except ValueError as e:
        p.error(str(e))
    if args.compare:
        if len(args.compare) < 2:
            p.error("--compare needs at least two report.json files")
        return args
    if not (args.target and args.draft):
        p.error("give --target and --draft (or --compare A.json B.json ...)")
    if args.n is not None and args.n < 1:
        p.error(f"--n {args.n}: give at least 1 prompt per category (or leave --n out for all of them)")
    if args.max_new_tokens < 2:  # the first token comes from the prefill: one token has no cycle to measure
        p.error(f"--max-new-tokens {args.max_new_tokens}: validate needs at least 2 (the first token comes from the "
                "prefill, so fewer leave no draft-verify cycle to measure)")
    if not 0 <= args.seed < 2**64:  # the MLX key and torch's generator take 64-bit seeds (a traceback after the
        p.error(f"--seed {args.seed}: use 0 to 2**64 - 1")  # models loaded, for a negative one or a larger one)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def _versions() -> dict:
    out = {"python_version": platform.python_version()}
    for dist, key in (("torch", "torch"), ("transformers", "transformers"), ("mlx", "mlx"), ("mlx-lm", "mlx_lm"),
                      ("draftsmith", "draftsmith")):
        try:
            out[f"{key}_version"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[f"{key}_version"] = None
    return out


def measure(session, ids: list[list[int]], prompts: list, *, repeats: int = 1, block_size: int | None = None,
            max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0, warmup: bool = True,
            progress: bool = True, done: dict | None = None, record=None) -> tuple[list[PromptRun], dict]:
    """Baseline and DFlash on every prompt (alternating, ``repeats`` times each) after a warm-up.

    ``done``: prompts measured by an interrupted run (position -> (run, peaks), ``inference.partial``),
    taken as they are; ``record(position, run, peaks)`` is called as each new prompt finishes.
    """
    # Imported here, not at the top: a CLI's start-up time (the session module imports torch and transformers).
    from inference.session import WARMUP_TOKENS

    done = done or {}
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    todo = [i for i in range(len(ids)) if i not in done]
    if warmup and todo:  # one-time costs (kernel selection, allocation, graph capture) are not timed
        session.run(ids[todo[0]], baseline=True, block_size=block_size,
                    **{**kw, "max_new_tokens": min(WARMUP_TOKENS, max_new_tokens)})
    peaks = {"peak_memory_bytes": None, "baseline_peak_memory_bytes": None}

    def peak(into: dict, key: str, value: int | None) -> None:
        if value is not None:
            into[key] = max(into[key] or 0, value)

    runs = []
    bar = tqdm.tqdm(total=len(ids) * repeats, initial=(len(ids) - len(todo)) * repeats, desc="validate", unit="run",
               file=sys.stderr, disable=not progress)
    for i, (prompt, p_ids) in enumerate(zip(prompts, ids)):
        if i in done:
            run, its = done[i]
        else:
            run, its = PromptRun(prompt.id, prompt.category, len(p_ids)), dict.fromkeys(peaks)
            for _ in range(repeats):
                session.reset_peak_memory()
                run.baseline.append(session.baseline(p_ids, **kw))
                peak(its, "baseline_peak_memory_bytes", session.peak_memory_bytes())
                session.reset_peak_memory()
                run.dflash.append(session.run(p_ids, block_size=block_size, **kw)[0])
                peak(its, "peak_memory_bytes", session.peak_memory_bytes())
                bar.update(1)
            bar.set_postfix(tau=f"{run.dflash[0].tau:.2f}")
            if record is not None:
                record(i, run, its)
        for key, value in its.items():
            peak(peaks, key, value)
        runs.append(run)
    bar.close()
    return runs, peaks


def write_outputs(report: dict, out: str | Path, log=None) -> dict:
    """report.json, report.md and acceptance.png in ``out``. An earlier run's report.json there (the default
    ``--out`` is shared by every run) is set aside as ``report.json.old`` (earlier ones shifted to ``.old.1`` ...)
    instead of overwritten: it was the only record of that measurement, and ``--compare`` reads it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md"}
    if paths["json"].is_file():
        old = set_aside(paths["json"])
        (log or (lambda m: print(m, file=sys.stderr)))(
            f"note: {paths['json']} of an earlier run set aside as {old.name} (--compare {old} reads it); "
            "give each run its own --out to keep them apart")
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["md"].write_text(markdown(report))
    paths["png"] = write_plot([report], [Path(str(report.get("draft"))).name or "drafter"], str(out / "acceptance.png"))
    return paths


def run_compare(files: list[str], out: str | Path) -> dict:
    reports, labels = [], []
    for f in files:
        path = Path(f)
        if path.is_dir():  # validate's --out folder: the report.json it wrote there
            if not (path / "report.json").is_file():
                raise FileNotFoundError(f"--compare {f} is a folder without report.json: give the report.json files "
                                        "(or --out folders) written by python -m inference.validate")
            path = path / "report.json"
        if not path.is_file():
            raise FileNotFoundError(f"--compare {f}: no such file (give report.json files written by validate)")
        try:
            r = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--compare {f} is not valid JSON ({e})") from None
        if not isinstance(r, dict) or not str(r.get("schema", "")).startswith("draftsmith.validate/"):
            raise ValueError(f"--compare {f} is not a report.json written by python -m inference.validate")
        reports.append(r)
        labels.append(path.parent.name or path.stem)
    if len(set(labels)) < len(labels):
        labels = [f"{lb}#{i + 1}" for i, lb in enumerate(labels)]
    if len({r.get("prompt_set_hash") for r in reports}) > 1:
        print("note: the reports used different prompt sets (prompt_set_hash differs): compare with care",
              file=sys.stderr)
    if len({r.get("max_new_tokens") for r in reports}) > 1:  # the same prompts, other lengths: other tau and speed
        print("note: the reports generated up to different numbers of tokens (max_new_tokens differs): compare with "
              "care", file=sys.stderr)
    rows = compare_rows(reports, labels)
    print(text_table(rows))
    Path(out).mkdir(parents=True, exist_ok=True)
    png = write_plot(reports, labels, str(Path(out) / "compare.png"))
    if png:
        print(f"\nwrote {png}", file=sys.stderr)
    return {"rows": rows, "png": png}


def draft_signature(draft: str) -> dict[str, list[float]]:
    """``models.weights.norm_signature`` of the drafter measured (already fetched by the load)."""
    from models.weights import norm_signature  # here, not at the top: a CLI's start-up time (it imports torch)

    return norm_signature(hub.resolve_model_dir(draft, what="drafter"))


def draft_hashes(draft: str) -> dict[str, dict]:
    """``models.weights.weight_hashes`` of the drafter measured: what ``export.push`` matches a report to its folder
    by, exactly."""
    from models.weights import weight_hashes  # here, not at the top: a CLI's start-up time (it imports torch)

    return weight_hashes(hub.resolve_model_dir(draft, what="drafter"))


def skip_too_long(ids: list[list[int]], prompts: list, max_new_tokens: int,
                  positions: int) -> tuple[list[list[int]], list, int]:
    """(ids, prompts) without the prompts whose tokens plus ``--max-new-tokens`` run past the target's positions,
    and how many were skipped (said in one line, by category): their numbers would describe a target beyond its
    context, and a set with a few such prompts (the long set on a short-context target) still runs the others.
    None left is an error."""
    keep = [i for i, x in enumerate(ids) if len(x) + max_new_tokens <= positions]
    skipped = len(ids) - len(keep)
    if not skipped:
        return ids, prompts, 0
    over = [i for i in range(len(ids)) if i not in set(keep)]
    by = Counter(prompts[i].category for i in over)
    longest = max(len(ids[i]) for i in over)
    what = (f"{skipped} of {len(ids)} prompts ({', '.join(f'{c}: {n}' for c, n in sorted(by.items()))}; longest "
            f"{longest} tokens) plus --max-new-tokens {max_new_tokens} run past the target's {positions} positions")
    if not keep:
        raise ValueError(f"--prompts: all {what}: lower --max-new-tokens, or use a set of shorter prompts")
    print(f"validate: skipped {what}: their tau and speed would describe a target beyond its context "
          f"(a lower --max-new-tokens keeps those that fit)", file=sys.stderr)
    return [ids[i] for i in keep], [prompts[i] for i in keep], skipped


def resume_settings(environment: dict) -> dict:
    """The environment an interrupted run is resumed by, local paths resolved: ``--target T`` and then
    ``--target T/`` or ``./T`` (the same folder) were other settings, and the measured prompts were set aside.
    A Hub id (no such local path) stays as given."""
    settings = dict(environment)
    for key in ("target", "draft", "prompts"):
        value = settings.get(key)
        if isinstance(value, str) and value:
            local = Path(value).expanduser()
            if local.exists():
                settings[key] = str(local.resolve())
    return settings


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.compare:
        return run_compare(args.compare, args.out)
    # One run per --out (they would share partial.jsonl); an unwritable one fails here, before the models load.
    with full_disk_named(args.out, f"it resumes: the prompts measured so far are kept in {partial.PARTIAL}"), \
            hold(args.out, partial.LOCK, "--out", "wait for it, or give this run its own --out"):
        return validate(args)


def validate(args: argparse.Namespace) -> dict:
    """One measurement (``main`` without --compare), holding ``--out``."""
    # Imported here, not at the top: a CLI's start-up time (the session imports torch and transformers, seconds
    # that --help, --compare and the pre-flight errors do without).
    from inference.session import Session, pick_backend

    args.dtype = check_dtype(args.dtype)
    check_temperature(args.temperature)
    pre = preflight(args.target, args.draft, args.block_size, args.temperature)  # before any weights load
    check_draft_weights(args.draft)
    check_target_tokenizer(pre.target, args.target, "validate renders its prompts with the target's chat template: "
                           "add the target's tokenizer files to the folder")
    args.thinking = resolve_thinking(args.thinking, pre.drafter, "off", lambda m: print(m, file=sys.stderr))
    prompts = load_prompts(args.prompts, n=args.n, split=args.split, subset=args.subset)
    backend = pick_backend(args.backend)
    check_drafter_backend(pre.drafter, backend, args.draft)  # before the target loads
    session = Session(backend, args.target, args.draft, args.device, args.dtype, loop=args.loop,
                      block_size=pre.block_size)
    check_fetched_draft_weights(args.draft)  # a Hub id's weights, fetched by the session: before any work
    ids = render_prompts(session.tokenizer, prompts, args.thinking)
    ids, prompts, skipped = skip_too_long(ids, prompts, args.max_new_tokens, session.target.max_position_embeddings)
    print(f"validate: {len(prompts)} prompts ({', '.join(sorted({p.category for p in prompts}))}), block size "
          f"{pre.block_size}, {args.repeats} repeat(s), {session.backend} on {session.describe()['device']}",
          file=sys.stderr)
    environment = {
        **session.describe(), "target": args.target, "draft": args.draft, "target_model_type": pre.target.model_type,
        "target_quantization": describe_quantization(pre.target.quantization), "recorded_target": pre.recorded_target,
        "block_size": pre.block_size, "trained_block_size": pre.drafter.block_size,
        "mask_token_id": pre.drafter.mask_token_id, "draft_signature": draft_signature(args.draft),
        "draft_hashes": draft_hashes(args.draft),
        "draft_quantization": describe_quantization(pre.drafter.quantization),  # a 4-bit export's own figures
        "temperature": args.temperature, "thinking": args.thinking,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "seed": args.seed, "prompts": args.prompts,
        "prompt_set_hash": prompt_set_hash(prompts, args.thinking), "prompt_tokens_total": sum(map(len, ids)),
        "skipped_too_long": skipped,
        **_versions(),
    }
    settings = resume_settings(environment)
    key = partial.settings_key(settings)  # an interrupted run with these settings resumes
    done = partial.load(args.out, key, lambda m: print(m, file=sys.stderr), settings)
    if done:
        print(f"validate: resuming: {len(done)} of {len(ids)} prompts measured by an interrupted run with the same "
              f"settings ({Path(args.out) / partial.PARTIAL})", file=sys.stderr)
    recorder = partial.Recorder(args.out, key, settings)
    runs, peaks = measure(session, ids, prompts, repeats=args.repeats, block_size=pre.block_size,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                          progress=not args.no_progress, done=done, record=recorder)
    environment.update(created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), resumed_prompts=len(done),
                       **peaks)
    report = build_report(runs, pre.block_size, args.temperature == 0, environment)
    paths = write_outputs(report, args.out)
    recorder.finish()
    print(text_table(table_rows(report)))
    print(f"\nwrote {', '.join(str(p) for p in paths.values() if p)}", file=sys.stderr)
    return report


def cli() -> None:
    """The ``draftsmith-validate`` console script: ``main`` with one-line user errors, as ``python -m`` runs it."""
    from models.support import run_cli

    run_cli(main)


if __name__ == "__main__":
    cli()
