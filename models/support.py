"""What every command and stage leans on, none of it a model: the ``draftsmith`` command, one-line user errors,
one writer per output folder, host-to-GPU copies, main-process-only work, and the benches' profiler.

    draftsmith --help                              # the commands, one line each
    draftsmith train recipe=tiny                   # = python -m train.distill recipe=tiny
    accelerate launch --no_python --num_processes 8 draftsmith train recipe=qwen3-8b

The ground floor (``models/``) imports nothing of ours from above it: the command names its modules as strings
and imports only the one it runs (``draftsmith --help`` then starts in a blink, and the floors stay apart).
torch, too, is imported inside the functions that need it, for the same start-up time.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.metadata
import importlib.util
import os
import select
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


# ----------------------------------------------------------------------------- user errors: one line, not a traceback
class UserError(Exception):
    """Base of every draftsmith error that means "your input is wrong; here is the fix".

    Project error types inherit from it *and* from the builtin type they behave like
    (``class ConfigKeyError(UserError, KeyError)``), so existing ``except KeyError`` still works.
    """


# A *user error* ends a command with one line: one of the project's own error types, a ValueError (the project's
# checks raise it for bad values everywhere, and a library's almost always comes from a value the user passed), or a
# clear OS error (missing file, no permission, unreachable host). TypeError, KeyError, IndexError... are nearly
# always bugs in draftsmith or a library: they keep their traceback, so they get reported and fixed.
USER_ERRORS: tuple[type[BaseException], ...] = (
    UserError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
    PermissionError, ConnectionError, TimeoutError,
)


def is_user_error(e: BaseException) -> bool:
    """True for errors that end a command with one line (see ``USER_ERRORS``)."""
    if isinstance(e, USER_ERRORS):
        return True
    # A bare OSError raised by our own checks (hub fetch, data set download) carries its message;
    # OSError subclasses not listed above (BrokenPipe, ChildProcessError...) are environment
    # trouble too, and their message names the file or host.
    return type(e) is OSError and bool(e.args)


# The dtype names every command takes: torch's and MLX's own (float32, bfloat16, float16) and the short
# ones training's keys and the exports spell (fp32, bf16, fp16). One table, so `--dtype bf16` works
# wherever `target.dtype=bf16` does (it was getattr(torch, "bf16"): an AttributeError traceback).
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16"}


def parse_dtype(name: str | None, flag: str = "--dtype", auto: bool = False) -> str | None:
    """A dtype flag's value as torch and MLX name it (``bf16`` -> ``bfloat16``); None stays None, and
    ``auto`` too where the command has it (``auto=True``)."""
    if name is None or (auto and name == "auto"):
        return name
    canonical = DTYPE_NAMES.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"{flag} {name!r} is not a compute dtype draftsmith runs in: use one of float32, bfloat16, "
                         f"float16 (or fp32, bf16, fp16){' or auto' if auto else ''}")
    return canonical


class DeviceNameError(UserError, ValueError):
    """A ``--device`` value that names no device at all (a typo), as opposed to one this machine lacks."""


def check_device(device: str | None, flag: str = "--device", kinds: tuple[str, ...] = ("cpu", "cuda", "mps"),
                 auto: bool = False) -> str | None:
    """A torch ``--device`` checked before any weights load: a malformed name (:class:`DeviceNameError`), CUDA or
    MPS that torch does not see, or a GPU index past the last one is one line, not torch's RuntimeError
    traceback after the target loaded. None stays None (the command's default), and ``auto`` where the
    command has it."""
    if device is None or (auto and device == "auto"):
        return device
    kind, colon, index = str(device).partition(":")
    if kind not in kinds or (colon and not (kind == "cuda" and index.isdigit())):
        names = [k + (" (cuda:N for another GPU)" if k == "cuda" else "") for k in kinds] + (["auto"] if auto else [])
        choices = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise DeviceNameError(f"{flag} {device!r}: use {choices}, or leave it out")
    import torch  # start-up time (module docstring)

    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{flag} {device} but torch sees no CUDA device: use {flag} cpu (or leave {flag} out)")
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"{flag} {device}: torch sees {torch.cuda.device_count()} CUDA device(s), numbered from 0")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{flag} mps but torch sees no MPS (Apple GPU) device: use {flag} cpu (or leave {flag} out)")
    return device


def run_cli(main: Callable[[], object], interrupted: str | None = None) -> None:
    """Run ``main``; user errors exit with ``error: <message>`` (DRAFTSMITH_TRACEBACK=1 shows the traceback).

    Ctrl-C exits with status 130 after ``interrupted: <what happens on a rerun>`` when the command says
    (training prints its own resume command)."""
    try:
        main()
        sys.stdout.flush()  # inside the try: a closed pipe shows up here when the output was buffered
    except KeyboardInterrupt as e:  # Ctrl-C: 130; a stop by SIGTERM (train.interrupt.Preempted) carries its own, 143
        if interrupted:
            print(f"interrupted: {interrupted}", file=sys.stderr, flush=True)
        raise SystemExit(getattr(e, "exit_status", 130)) from None
    except Exception as e:
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            # `draftsmith train --help | head`: the reader has gone. Quiet, as shell tools are; devnull
            # takes what is still buffered so the interpreter's own flush at exit does not complain either.
            # (Another broken pipe, a regeneration server's socket, is an error like any other below.)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(1) from None
        if not is_user_error(e) or os.environ.get("DRAFTSMITH_TRACEBACK"):
            raise
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise SystemExit(f"error: {message}\n(set DRAFTSMITH_TRACEBACK=1 to see where it came from)") from None


def _stdout_closed() -> bool:
    """True when nobody reads our standard output any more (the far end of its pipe was closed)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    if not hasattr(select, "poll"):  # Windows: no way to ask; a broken pipe there is stdout's in practice
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


# ----------------------------------------------------------------------------- one writer per output folder
@contextlib.contextmanager
def hold(folder: str | Path, name: str, flag: str, fix: str,
         log: Callable[[str], None] | None = None, output: Path | None = None) -> Iterator[Path]:
    """Create ``folder`` and lock ``folder/name`` for the ``with`` block: a second run into the same folder (the
    same command in two terminals, a requeued job while the old one runs) is refused with the holder's pid.
    ``flag`` names the folder's setting in the errors (``--out``, ``out_dir``); ``fix`` ends the refusal.
    ``output`` is the one file guarded, when that is what the command writes (``--out answers.jsonl``): the
    errors name it, and the lock goes at the end if it was never written.

    The OS drops the lock when the process ends, however it ends, so a crashed run never blocks the next; the
    file itself stays (removing it would race a run that just opened it), unless the command created the folder
    and wrote nothing else there, never wrote ``output``, or created the lock file and ended in an error (a
    refusal of a folder that is not its own): a mistake leaves nothing behind. POSIX only (Linux, macOS);
    elsewhere, and on file systems without ``flock`` (some cluster mounts), a note says runs are not kept apart.
    """
    folder = Path(folder)
    what = f"{flag} {output or folder}"
    created = not folder.exists()
    fresh = created or not (folder / name).exists()  # this command's own lock file, not one an earlier run left
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / name, "a+")
    except OSError as e:  # a file in the path, a read-only mount: said now, not after the models load
        raise ValueError(f"{what}: cannot write there ({e.strerror or e}); give a folder you can write "
                         "to") from None
    with handle:
        try:
            import fcntl  # POSIX only: elsewhere runs are not kept apart
        except ImportError:
            fcntl = None
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                raise ValueError(f"{what} is in use by another run (pid {holder}): {fix}") from None
            except OSError as e:
                if log:
                    log(f"note: {folder / name} cannot be locked on this file system ({e.strerror or e}): a second "
                        "run into the same folder is not refused")
            else:
                handle.seek(0)
                handle.truncate()
                handle.write(f"{os.getpid()}\n")
                handle.flush()
        failed = False
        try:
            yield folder
        except BaseException:
            failed = True
            raise
        finally:  # a command refused before it wrote anything leaves no folder holding only the lock, and a
            # refusal of someone else's folder (not prepared data, not a store) leaves no lock file in it
            if (output is not None and not output.exists()) or (failed and fresh):
                (folder / name).unlink(missing_ok=True)
            if created and not [p for p in folder.iterdir() if p.name != name]:
                (folder / name).unlink(missing_ok=True)
                folder.rmdir()


KEEP_OLD = 5  # set-aside files kept: NAME.old (the newest), .old.1, ... .old.4 (the oldest)


def set_aside(path: Path) -> Path:
    """Move ``path`` to ``<name>.old``, first shifting earlier ones to ``.old.1``, ``.old.2``, ...: an earlier
    set-aside file (hours of measurements, maybe) is never overwritten; only the oldest beyond ``KEEP_OLD`` goes."""
    olds = [path.with_name(f"{path.name}.old" + (f".{i}" if i else "")) for i in range(KEEP_OLD)]
    olds[-1].unlink(missing_ok=True)
    for newer, older in zip(reversed(olds[:-1]), reversed(olds[1:])):
        if newer.is_file():
            newer.replace(older)
    path.replace(olds[0])
    return olds[0]


# ----------------------------------------------------------------------------- a full disk, said once
DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded")


class DiskFullError(UserError, OSError):
    """The disk (or quota) an output folder is on is full; the command's partial work is kept for a rerun."""


def disk_full(e: BaseException | None) -> BaseException | None:
    """The full-disk error in ``e``'s chain (its causes and contexts): an ``OSError`` with ENOSPC / EDQUOT, or a
    writer's own error that only says so in words (safetensors, pyarrow); None for any other error."""
    import errno

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or \
                any(w in str(e) for w in DISK_FULL_WORDS):
            return e
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def full_disk_named(folder: str | Path, rerun: str) -> Iterator[None]:
    """Turn a full disk inside the block into one line naming the folder written (the file's, when the writer
    named one elsewhere), the space left there and what a rerun keeps: the bare "[Errno 28] No space left on
    device" named neither."""
    import shutil

    try:
        yield
    except Exception as e:
        full = disk_full(e)
        if full is None or isinstance(e, DiskFullError):
            raise
        where = Path(folder)
        written = getattr(full, "filename", None)
        if written and not Path(written).absolute().is_relative_to(where.absolute()):
            where = Path(written).parent  # another disk than the output's (a cache, a temp folder)
        try:
            room = shutil.disk_usage(next(p for p in (where, *where.parents) if p.exists())).free
            left = f" ({room / 2**30:.1f} GiB left there)"
        except (OSError, StopIteration):
            left = ""
        raise DiskFullError(f"no space left on the disk of {where}{left}: free space there and rerun the same "
                            f"command: {rerun}") from e


def share_like_umask(folder: Path) -> None:
    """Give every file under ``folder`` the permissions a plain write gets (0644 under the usual umask 022): safetensors
    writes through a private temp file, so weights came out 0600, unreadable by the group that reads a run."""
    mask = os.umask(0)
    os.umask(mask)
    for f in Path(folder).rglob("*"):
        if f.is_file() and not f.is_symlink():
            f.chmod(0o666 & ~mask)


# ----------------------------------------------------------------------------- host-to-GPU copies that do not wait
def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``, queued without the host waiting (a host tensor bound for a GPU goes through
    pinned memory; anything else is ``t.to(device, non_blocking=True)``).

    A copy from pageable host memory makes the host wait for every kernel already queued on the stream,
    ``non_blocking=True`` or not (the driver stages it through its own pinned buffer and may synchronize to do
    so): in the training step, the same bubble as a read back. From pinned memory the copy is queued like a
    kernel; PyTorch's caching host allocator keeps the pinned block until the copy has run.
    """
    import torch  # start-up time (module docstring)

    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


# ----------------------------------------------------------------------------- work only the main process does
class MainProcessFailed(UserError, RuntimeError):
    """Raised on the other processes when the main process failed (its own error is raised there)."""


def _process_group():
    import torch.distributed as dist  # start-up time (module docstring)

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def run_on_main(fn: Callable[[], T], accelerator=None, what: str = "the main process's work") -> T | None:
    """Run ``fn`` on the main process only; returns its result there (None elsewhere).

    Under ``accelerate launch`` the other processes wait at a collective; if the main process failed before it,
    they would wait forever. So the main process always reaches the collective, carrying "done" or its error
    (Ctrl-C included): it re-raises its error, and every other process raises :class:`MainProcessFailed`.
    One process needs no collective; gloo and NCCL groups both work (``broadcast_object_list``).
    """
    dist = _process_group()
    is_main = accelerator.is_main_process if accelerator is not None else (dist is None or dist.get_rank() == 0)
    result, error = None, None
    if is_main:
        try:
            result = fn()
        except BaseException as e:  # reach the collective first, then raise
            error = e
    if dist is not None:
        message = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(message, src=0)
        if error is None and message[0] is not None:
            raise MainProcessFailed(f"{what} failed on the main process ({message[0]}); see its output for details")
    if error is not None:
        raise error
    return result


# ----------------------------------------------------------------------------- where a bench's time goes (--profile)
def top_ops(fn: Callable[[], object], n: int = 15, calls: int = 1) -> dict:
    """Run ``fn`` ``calls`` times under ``torch.profiler``; the ``n`` ops of most self time, per call: which
    kernels take a bench's time, without a trace viewer.

    On CUDA only device events count (kernels, memcpy, memset, CUDA-graph replays included): an aten op's row
    repeats the time of the kernels it launched, so summing both would count it twice. On the CPU, operators'
    self time.
    """
    import torch  # start-up time (module docstring)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        self_us = lambda e: e.self_device_time_total
    else:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU]
        self_us = lambda e: e.self_cpu_time_total
    total = sum(self_us(e) for e in events)
    ranked = sorted(events, key=self_us, reverse=True)[:n]
    return {"clock": "device" if cuda else "cpu", "calls": calls, "total_ms_per_call": round(total / calls / 1e3, 4),
            "ops": [{"name": e.key[:120], "ms_per_call": round(self_us(e) / calls / 1e3, 4),
                     "share": round(self_us(e) / total, 4) if total else 0.0, "count_per_call": e.count / calls}
                    for e in ranked]}


# ----------------------------------------------------------------------------- the draftsmith command
# Subcommand: (module whose cli() -- or main() -- it runs, one line of help). Modules by name: only the chosen
# one is imported, after the shadow check (the ground floor must not import the floors above it).
COMMANDS = {
    "train": ("train.distill", "train a drafter: recipe=NAME [key=value ...]; --dry-run shows the plan"),
    "prepare": ("data.prepare", "chat data -> tokens with assistant-only loss masks (optionally regenerated)"),
    "regenerate": ("data.regenerate", "regenerate every assistant answer with the target itself, resumably"),
    "extract": ("data.extract", "extract target features once, to an offline feature store"),
    "generate": ("inference.generate", "generate with a drafter: the text, acceptance length and speed"),
    "validate": ("inference.validate", "a drafter's acceptance, speed and losslessness on prompt sets"),
    "bench": ("", "speed, one JSON line per result: bench train | data | inference | export"),
    "export-hf": ("export.hf", "export a drafter as a Hugging Face folder (vLLM, SGLang, transformers)"),
    "export-mlx": ("export.mlx", "export a drafter as an MLX folder (optionally 4/8-bit) for the MLX loop"),
    "push": ("export.push", "publish an exported folder to the Hugging Face Hub, with a model card"),
}
BENCHES = {
    "train": ("train.bench", "training-step speed (random weights; --e2e RECIPE for a recipe's shapes)"),
    "data": ("data.bench", "the feature path: target forward, feature store reads"),
    "inference": ("inference.bench", "decode speed of the DFlash loop against the target alone"),
    "export": ("export.bench", "export.hf / export.mlx at real drafter shapes: wall time and parity"),
}
PACKAGES = ("models", "data", "train", "export", "inference", "recipes")


def listing(title: str, table: dict[str, tuple[str, str]]) -> str:
    width = max(map(len, table)) + 2
    return title + "\n" + "\n".join(f"  {name:<{width}}{line}" for name, (_, line) in table.items())


def usage() -> str:
    return "\n\n".join([
        "usage: draftsmith <command> [arguments]    (draftsmith <command> --help: that command's own help)\n\n"
        "Train, export and validate DFlash block-diffusion drafters for speculative decoding.",
        listing("commands:", COMMANDS),
        "several GPUs (one node):  accelerate launch --no_python --num_processes 8 draftsmith train recipe=NAME\n"
        "each command is also `python -m <module>` (draftsmith train = python -m train.distill); --version",
    ])


def version() -> str:
    try:
        return importlib.metadata.version("draftsmith")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a checkout)"


def shadowing_problem() -> str | None:
    """None when each of our packages resolves inside the folder this module was imported from; else one line
    naming the file or folder that shadows one (a ``train.py`` in the current folder under ``python -m``, or on
    ``PYTHONPATH``) and the fix. Checked before any of them is imported: the shadow would run instead."""
    home = Path(__file__).resolve().parent.parent
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None and spec is not None and spec.submodule_search_locations:  # a folder without __init__.py
            found = Path(list(spec.submodule_search_locations)[0]).resolve()
        elif origin is not None:
            found = Path(origin).resolve()
            found = found.parent if found.name.startswith("__init__.") else found
        else:
            return f"draftsmith's {name} package is missing from {home}: reinstall draftsmith"
        if found == home / name:
            continue
        where = found.parent
        fixes = [f"rename {found.name}"]
        if where == Path.cwd().resolve() and ("" in sys.path or os.curdir in sys.path or str(where) in sys.path):
            fixes.append("run from another folder")
        if any(p and Path(p).resolve() == where for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            fixes.append(f"drop {where} from PYTHONPATH")
        elif len(fixes) == 1:
            fixes.append(f"take {where} off the module search path")
        return (f"{found} shadows draftsmith's {name} package ({home / name}): " + ", ".join(fixes[:-1])
                + f" or {fixes[-1]}")
    return None


def refuse_unknown(what: str, name: str, table: dict) -> NoReturn:
    """A mistyped command: one line with the closest name, exit status 2 (a usage error, as argparse's)."""
    close = difflib.get_close_matches(name, list(table), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    print(f"error: unknown {what} {name!r}{hint}: one of {', '.join(table)}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    """The ``draftsmith`` console script: ``draftsmith <command> [arguments]`` runs that command's own ``cli``
    (the ``draftsmith-*`` scripts' and ``python -m``'s entry), with the arguments after the command's name."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help", "-V", "--version"):
        # through run_cli: `draftsmith --help | head` ends quietly, as every command's own --help does
        run_cli(lambda: print(usage() if not argv or argv[0] not in ("-V", "--version")
                              else f"draftsmith {version()}"))
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        refuse_unknown("command", name, COMMANDS)
    module = COMMANDS[name][0]
    if name == "bench":
        if not rest or rest[0] in ("-h", "--help"):
            run_cli(lambda: print("usage: draftsmith bench {" + ",".join(BENCHES) + "} [arguments]    "
                                  "(draftsmith bench STAGE --help)\n\n" + listing("benches (python -m <stage>.bench):",
                                                                                    BENCHES)))
            return
        if rest[0] not in BENCHES:
            refuse_unknown("bench", rest[0], BENCHES)
        module, rest = BENCHES[rest[0]][0], rest[1:]
    if problem := shadowing_problem():
        raise SystemExit(f"error: {problem}")
    sys.argv = [sys.argv[0], *rest]  # the commands read their arguments from sys.argv, as under python -m
    command = importlib.import_module(module)
    entry = getattr(command, "cli", None)
    if entry is not None:
        entry()
    else:  # a bench: its main under the one-line error convention, as its `python -m` runs it
        run_cli(command.main)


if __name__ == "__main__":
    main()
