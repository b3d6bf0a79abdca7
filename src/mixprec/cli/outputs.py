"""Checks on a tool's output directory, made before any work starts: a benchmark or a
diagnosis that runs for minutes must not fail at the end because of where it writes."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__: list[str] = []


def check_output_dir(path: str | os.PathLike[str], flag: str, keep: Iterable[str] = ()) -> Path:
    """Raise ValueError unless `path` is, or can be made, a writable directory in which none
    of the files named in `keep` exists yet (a previous run's results are never overwritten).
    `flag` names the option in the message (``--out``)."""
    out = Path(path)
    for part in (out, *out.parents):
        if part.exists() and not part.is_dir():
            where = "is a file" if part == out else f"is under the file {part}"
            raise ValueError(f"{flag} {out} {where}: give a directory path")
    existing = next(p for p in (out, *out.parents) if p.exists())
    try:  # a real write: permission bits say nothing to root or on a read-only mount
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ValueError(
            f"{flag} {out}: {existing} is not writable (a file could not be created there: "
            f"{err.strerror})"
        ) from None
    clashes = [name for name in keep if (out / name).exists()]
    if clashes:
        raise ValueError(
            f"{flag} {out} already holds {', '.join(clashes)} from an earlier run; "
            "choose another directory (or move those files) so they are not overwritten"
        )
    return out


def new_output_dir(parent: str | os.PathLike[str], stem: str) -> Path:
    """Make and return a directory ``parent/stem`` that did not exist (``stem-2``, ``stem-3``,
    ... when it did): two runs started in the same second each get their own, where a shared
    timestamped default let the later one overwrite the earlier one's results."""
    base = Path(parent)
    base.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = base / (stem if n == 1 else f"{stem}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
