"""Checkpoint files: written atomically, read back safely, with the RNG states of a run. What
a Trainer checkpoint holds, and how a run resumes from one, is `resume`'s.

Every checkpoint, a file or a sharded one's directory (`sharded`), is written the one way
`atomic_write` says: into a temporary file or directory in the target's own directory,
flushed and fsync'ed, and only then moved over the target (`install`: ``os.replace``,
atomic on POSIX and Windows). A process killed mid-save leaves the previous checkpoint
intact and, at worst, a stray ``.tmp`` entry, which the next save into that directory
removes. Files are loaded with ``torch.load(weights_only=True)``: a checkpoint holds tensors
and plain Python values only, so loading one never runs code from the file.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import glob
import io
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from mixprec.trainer.callbacks import ModelCheckpoint
from mixprec.trainer.interrupt import ctrl_c_deferred

__all__ = [
    "CheckpointError",
]

log = logging.getLogger("mixprec")

FORMAT = "mixprec.checkpoint"
FORMAT_VERSION = 1

_HOST = socket.gethostname().replace(".", "_") or "host"
# .<target name>.<host>.<pid>.<token>.tmp: who wrote it, so that stale ones can be told apart
_TMP = re.compile(r"\.(?P<name>.+)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp")
# .<target name>.<host>.<pid>.<token>.old: a checkpoint `install` moved aside to replace it
_ASIDE = re.compile(r"\.(?P<name>.+)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.[0-9a-f]+\.old")
_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


# -- written atomically -------------------------------------------------------------------------


def new_tmp(target: Path, *, directory: bool = False) -> Path:
    """Create an empty temporary file (or ``directory``) next to ``target``, named
    ``.<name>.<host>.<pid>.<token>.tmp`` (`clean_stale_tmp` tells a killed save's by it);
    mode 0666 (0777) less the umask, like any file (directory)."""
    while True:
        tmp = target.parent / f".{target.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            if directory:
                tmp.mkdir()
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def prepare(path: Path) -> None:
    """Before a save to ``path``: its directory made, a checkpoint a killed save left aside
    put back (`recover_aside`), the leftovers of killed saves there removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_aside(path)
    clean_stale_tmp(path.parent)


def commit(tmp: Path, path: Path) -> None:
    """Flush the complete file or directory ``tmp`` to disk (a directory's files and the
    directory itself), then `install` it at ``path``."""
    if tmp.is_dir():
        for entry in tmp.iterdir():
            if entry.is_file():
                _fsync_file(entry)
        _fsync_dir(tmp)
    else:
        _fsync_file(tmp)
    install(tmp, path)


@contextlib.contextmanager
def atomic_write(path: Path, *, directory: bool = False) -> Iterator[Path]:
    """Write the file (or ``directory``) ``path`` so that readers see the old one or the new
    one, never half: the block writes into the temporary path it is given (`new_tmp`, made
    after `prepare`); when it ends, that is `commit`-ed to ``path``; when it raises, that is
    removed and ``path`` is left as it was. A Ctrl-C is held until the write is complete (a
    second one abandons it). A save spread over processes (`sharded.save`) takes the same
    steps itself."""
    prepare(path)
    with ctrl_c_deferred():
        tmp = new_tmp(path, directory=directory)
        try:
            yield tmp
            commit(tmp, path)
        except BaseException:
            _remove(tmp)
            raise


def _fsync_file(path: Path) -> None:
    # Windows flushes only a file opened for writing; POSIX any
    fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    # Makes a rename in it durable; not possible (nor needed) on Windows.
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _remove(entry: Path) -> None:
    if entry.is_dir():  # a sharded checkpoint's (`mixprec.trainer.sharded`)
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def _left_by_dead_process(m: re.Match[str] | None) -> bool:
    """Whether a temporary or aside name was written on this host by a process gone now."""
    if m is None or m["host"] != _HOST:
        return False
    pid = int(m["pid"])
    return pid != os.getpid() and not _alive(pid)


def clean_stale_tmp(directory: Path) -> list[Path]:
    """Remove what killed saves left in ``directory``: temporary files (and directories)
    and, where the checkpoint they replaced is there again, the old copies moved aside
    (`install`); only those written on this host by a process that no longer runs (a save
    in progress elsewhere is never touched)."""
    removed = []
    for entry in directory.glob(".*.tmp"):
        if _left_by_dead_process(_TMP.fullmatch(entry.name)):
            _remove(entry)
            removed.append(entry)
    for entry in directory.glob(".*.old"):
        m = _ASIDE.fullmatch(entry.name)
        if _left_by_dead_process(m) and (directory / m["name"]).exists():  # type: ignore[index]
            _remove(entry)
            removed.append(entry)
    if removed:
        log.info("removed %d temporary file(s) of interrupted saves in %s", len(removed), directory)
    return removed


def install(tmp: Path, path: Path) -> None:
    """Move the complete file or directory ``tmp`` (named by `new_tmp` or like it) to
    ``path``. A file onto a file, or onto nothing, is one atomic rename. Otherwise (a
    sharded checkpoint's directory, or a file where one is, or the other way round) ``path``
    is first renamed aside to ``.<name>.<host>.<pid>.<token>.old``, then removed: a crash
    between the two renames leaves it complete there, and `recover_aside` puts it back."""
    if path.exists() and (tmp.is_dir() or path.is_dir()):
        aside = tmp.with_name(tmp.name.removesuffix(".tmp") + ".old")
        os.replace(path, aside)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        _remove(aside)
    else:
        os.replace(tmp, path)
        # (a rename onto a hard link of the same file does nothing: the temporary stays)
        tmp.unlink(missing_ok=True)
        _fsync_dir(path.parent)


def recover_aside(path: Path) -> bool:
    """Put a checkpoint back at ``path`` when a save killed between `install`'s two renames
    left it aside (complete: a file, or a directory with DCP's ``.metadata``), written on
    this host by a process that no longer runs; the newest such one if several. Returns
    whether it did; safe to call from several processes at once."""
    if path.exists() or not path.parent.is_dir():
        return False
    asides = []
    for entry in path.parent.glob(f".{glob.escape(path.name)}.*.old"):
        m = _ASIDE.fullmatch(entry.name)
        complete = entry.is_file() or (entry / ".metadata").is_file()
        if _left_by_dead_process(m) and m["name"] == path.name and complete:  # type: ignore[index]
            asides.append(entry)
    if not asides:
        return False
    newest = max(asides, key=lambda e: e.stat().st_mtime)
    try:
        os.replace(newest, path)
    except OSError:  # another process put it back first
        return False
    _fsync_dir(path.parent)
    log.warning(
        "restored the checkpoint %s from %s, where a save killed between its two renames had "
        "left it",
        path,
        newest.name,
    )
    return True


def _cause(exc: BaseException) -> BaseException:
    """The first exception of the chain torch builds when a write fails half-way (it then
    fails again finishing the archive, with an opaque 'inline_container' message)."""
    seen = exc
    while seen.__context__ is not None:
        seen = seen.__context__
    return seen


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to ``path`` with `atomic_write`: readers see the old file or the new
    one, never half.

    An ``obj`` holding values other than containers, numbers, strings and tensors (a
    callback's numpy number) has its file read back (``torch.load(weights_only=True)``,
    tensors mapped, not read) before it replaces anything: one `load` would refuse raises
    ``TypeError`` naming the value (every resume from it would fail). Stale temporary files
    of killed saves in that directory are removed first. A full disk raises ``OSError``
    naming the path; Ctrl-C during the save lets it finish, then raises
    ``KeyboardInterrupt`` (a second Ctrl-C abandons the save, leaving the old file).
    """
    path = Path(path)
    unusual = list(unusual_parts(obj))
    try:
        with atomic_write(path) as tmp:
            with open(tmp, "wb") as f:
                torch.save(obj, f)
            reason = refusal(tmp) if unusual else None
            if reason is not None:  # (the temporary file is removed; the target untouched)
                raise unreadable_error(unusual, reason)
    except BaseException as exc:
        cause = _cause(exc)
        if isinstance(cause, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        if isinstance(cause, OSError) and cause.errno in _FULL:
            raise OSError(
                cause.errno,
                f"cannot write the checkpoint {path}: disk full or file too large "
                f"({os.strerror(cause.errno)}); the previous file, if any, is intact. "
                "Free space or save elsewhere",
            ) from None
        raise
    return path


def atomic_link(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Make ``dst`` an atomic copy of the checkpoint ``src``, a file or a sharded one's
    directory, with `atomic_write`: hard links where the filesystem allows, else copies."""
    src, dst = Path(src), Path(dst)
    if _same_entry(src, dst):  # (a link of a file onto itself would leave its temporary)
        return dst
    with atomic_write(dst, directory=src.is_dir()) as tmp:
        if src.is_dir():
            for entry in src.iterdir():
                _link_or_copy(entry, tmp / entry.name)
        else:
            tmp.unlink()  # the link takes its name
            _link_or_copy(src, tmp)
    return dst


def _same_entry(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file or directory (the same path, or hard links)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # (either is missing)
        return False


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # no hard links on this filesystem (or across these two)
        shutil.copy2(src, dst)


# -- read back safely ----------------------------------------------------------------------------


# what `torch.load(weights_only=True)` surely reads: a state of only these needs no check
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.nn.Parameter)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple)


def unusual_parts(
    value: Any, where: tuple[Any, ...] = (), walked: set[int] | None = None
) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(where, part) of each part of ``value`` that is neither a container (walked once,
    its keys too: a container held twice, or holding itself, is not walked again) nor a
    plain value (`_PLAIN`): a numpy number, a Path, a dataclass, a set..., which
    ``torch.load(weights_only=True)`` may refuse. Nothing is pickled. Nested past Python's
    recursion limit, the whole is reported unusual (the file is then read back)."""
    kind = type(value)
    if kind in _PLAIN:
        return
    if kind not in _CONTAINERS:
        yield where, value
        return
    walked = set() if walked is None else walked
    if id(value) in walked:
        return
    walked.add(id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value)
    try:
        for key, item in items:
            if type(key) not in _PLAIN:
                yield (*where, key), key
            yield from unusual_parts(item, (*where, key), walked)
    except RecursionError:
        yield where, value


def refusal(source: Path | io.BytesIO) -> str | None:
    """Why ``torch.load(weights_only=True)`` refuses the file (what torch's unpickler said),
    or None when it reads it. Tensors are mapped, not read, from a file."""
    try:
        torch.load(source, map_location="cpu", weights_only=True, mmap=isinstance(source, Path))
    except pickle.UnpicklingError as err:
        return unpickler_reason(err, first_sentence=True)
    except (OSError, RuntimeError):  # (a file system without mmap: the check cannot tell)
        return None
    return None


def unpickler_reason(err: BaseException, first_sentence: bool = False) -> str:
    """The line of a failed ``torch.load(weights_only=True)`` that says what it refused
    (torch's own message wraps it in general advice), without terminal escapes; with
    ``first_sentence``, without torch's advice on allowing it either."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    marker = "WeightsUnpickler error:"
    found = [line.split(marker, 1)[1] for line in text.splitlines() if marker in line]
    if not found:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return f"{type(err).__name__}: {lines[0] if lines else ''}"
    reason = found[0].strip()
    return reason.split(". ", 1)[0] if first_sentence else reason


def _refused_alone(part: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` refuses ``part`` saved alone."""
    buffer = io.BytesIO()
    torch.save(part, buffer)
    buffer.seek(0)
    return refusal(buffer) is not None


def _owner(where: tuple[Any, ...]) -> str:
    """Whose state holds the part at ``where`` in a Trainer checkpoint, and where in it."""
    inside = "".join(f"[{key!r}]" for key in where[2:])
    if len(where) >= 2 and where[0] == "callbacks":
        return f"state_dict(){inside} of callback {where[1]!r}"
    if len(where) >= 2 and where[0] == "schedulers":
        return f"state_dict(){inside} of scheduler {where[1]}"
    return "the checkpoint's " + "".join(f"[{key!r}]" for key in where)


def unreadable_error(parts: list[tuple[tuple[Any, ...], Any]], reason: str) -> TypeError:
    """The error of a save whose file ``torch.load(weights_only=True)`` refuses (``reason``,
    torch's), naming the first of the unusual ``parts`` refused alone."""
    where, part = next(((w, p) for w, p in parts if _refused_alone(p)), parts[0])
    kind = type(part)
    return TypeError(
        f"cannot checkpoint: {_owner(where)} is a {kind.__module__}.{kind.__qualname__}, "
        f"which torch.load(weights_only=True) does not read back ({reason}), so no resume "
        "could load the checkpoint. Keep Python numbers (float(x), int(x)), strings, lists, "
        "dicts and tensors in state_dict, or allow the type with "
        "torch.serialization.add_safe_globals. The previous checkpoint, if any, is intact"
    )


class CheckpointError(ValueError):
    """A file is not a readable mixprec checkpoint, or does not fit the run loading it."""


# what every checkpoint the Trainer writes holds; a sharded one's run state (`resume.run_state`)
# holds RUN_KEYS, its weights and optimizer state are in DCP shards (`sharded`)
RUN_KEYS = ("loop", "schedulers", "precision", "callbacks", "rng")
_KEYS = ("loop", "model", "optimizers", "schedulers", "precision", "callbacks", "rng")


def load(
    path: str | os.PathLike[str], map_location: Any = "cpu", *, required: tuple[str, ...] = _KEYS
) -> dict[str, Any]:
    """Read a checkpoint written by `atomic_save`; raise `CheckpointError` for anything else
    (truncated, empty, garbage, text, a pickled model, another program's checkpoint), or one
    lacking a ``required`` key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    hint = "save one with Trainer.save_checkpoint or ModelCheckpoint"
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} is not a readable mixprec checkpoint: it holds Python objects that "
            f"torch's safe load does not read ({unpickler_reason(err)}), and loading them "
            "would run code from the file. A whole model saved with "
            "torch.save(model) holds such objects, and so does a checkpoint whose callback "
            f"state held one (a numpy number); {hint}"
        ) from None
    except Exception as err:  # torch raises many kinds for a damaged file
        detail = (str(err).strip().splitlines() or [""])[0][:120]
        raise CheckpointError(
            f"{path} is not a readable mixprec checkpoint ({path.stat().st_size} bytes): it "
            f"is truncated, empty or not a file torch.save wrote ({type(err).__name__}: "
            f"{detail}); {hint}"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a readable mixprec checkpoint (expected a dict with "
            f"format={FORMAT!r}); {hint}"
        )
    if state.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {state['format_version']}, newer than this "
            f"mixprec understands ({FORMAT_VERSION}); upgrade mixprec to load it"
        )
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(
            f"{path} is not a readable mixprec checkpoint: it lacks {', '.join(missing)}"
        )
    return state


def rng_states() -> dict[str, Any]:
    """The state of every random generator a training step may draw from.

    numpy's state is stored as tensors and ints so that the file loads with weights_only.
    """
    states: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
        # the GPU this process trains on (each DDP rank has set its own): rank 0's list holds
        # the other ranks' GPUs as this process never moved them
        states["cuda_current"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return states
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states["numpy"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` returned."""
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        # one state per GPU of the saving machine: a resume on fewer GPUs restores those it
        # has (torch.cuda.set_rng_state_all would index past default_generators)
        for index, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, index)
        if "cuda_current" in states:
            # every rank resumes its own GPU from the saving rank's, as every rank's CPU
            # generator resumes from the saving rank's (ranks seeded alike draw alike)
            torch.cuda.set_rng_state(states["cuda_current"])
    if "numpy" in states:
        import numpy as np

        s = states["numpy"]
        np.random.set_state(
            (
                s["kind"],
                s["keys"].numpy().astype(np.uint32),
                s["pos"],
                s["has_gauss"],
                s["cached_gaussian"],
            )
        )


def resolve_path(
    ckpt_path: str | os.PathLike[str] | None,
    callback: ModelCheckpoint | None,
    run_dir: Callable[[], Path],
) -> Path | None:
    """The file a ``ckpt_path`` argument names: a path, or ``"best"`` / ``"last"`` of the
    run's ModelCheckpoint. ``"last"`` in a Trainer whose ModelCheckpoint saved none yet (a
    new process resuming a crashed run) is the ``last.ckpt`` in its directory (``dirpath``,
    else ``run_dir()/checkpoints``: asked only then, since a logger makes its version's
    directory when first asked), where one exists."""
    if ckpt_path in ("best", "last"):
        found = ""
        if callback is not None:
            found = callback.best_model_path if ckpt_path == "best" else callback.last_model_path
        where = "(a new Trainer knows no best one before it saves)"
        if not found and ckpt_path == "last":
            directory = callback.dirpath if callback is not None else None
            on_disk = (directory or run_dir() / "checkpoints") / "last.ckpt"
            found = str(on_disk) if on_disk.exists() else ""
            where = f"and there is no {on_disk}"
        if not found:
            raise ValueError(
                f"ckpt_path={ckpt_path!r}, but this Trainer's ModelCheckpoint has saved no "
                f"{ckpt_path} checkpoint {where}: pass the checkpoint's path (for 'last', "
                "ModelCheckpoint(save_last=True) writes last.ckpt)"
            )
        return Path(found)
    return Path(ckpt_path) if ckpt_path is not None else None
