"""Checkpoint files: written atomically, read back safely, with the RNG states of a run.

A save goes to a temporary file in the target's own directory, is flushed and fsync'ed, and
only then renamed over the target (``os.replace``, atomic on POSIX and Windows). A process
killed mid-save leaves the previous checkpoint intact and, at worst, a stray ``.tmp`` file.
Files are loaded with ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain
Python values only, so loading one never runs code from the file.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "mixprec.checkpoint"
FORMAT_VERSION = 1


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible (nor needed) on Windows.
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to ``path`` so that readers see the old file or the new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_link(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Make ``dst`` an atomic copy of ``src`` (a hard link where the filesystem allows)."""
    src, dst = Path(src), Path(dst)
    tmp = dst.parent / f".{dst.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        atomic_save(load(src), dst)
        return dst
    os.replace(tmp, dst)
    _fsync_dir(dst.parent)
    return dst


def load(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by `atomic_save`; raise a clear error for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a mixprec checkpoint (expected a dict with format={FORMAT!r}); "
            "save one with Trainer.save_checkpoint or ModelCheckpoint"
        )
    if state.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path} has checkpoint format version {state['format_version']}, newer than this "
            f"mixprec understands ({FORMAT_VERSION}); upgrade mixprec to load it"
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
        torch.cuda.set_rng_state_all(states["cuda"])
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
