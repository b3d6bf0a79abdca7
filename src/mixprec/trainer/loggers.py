"""Where logged metrics go: a CSV file (always available) and TensorBoard event files.

Both loggers write into one run directory, ``<save_dir>/<name>/version_<n>``, and open their
files on the first write, so a logger can be built, pickled to another process, and used
there. The Trainer calls them on rank 0 only.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any


def next_version(root: str | os.PathLike[str]) -> int:
    """One more than the highest ``version_<n>`` directory under ``root`` (0 if none)."""
    root = Path(root)
    found = [
        int(m.group(1))
        for p in (root.iterdir() if root.is_dir() else ())
        if p.is_dir() and (m := re.fullmatch(r"version_(\d+)", p.name))
    ]
    return max(found, default=-1) + 1


class Logger(ABC):
    """Receives metrics ``{name: float}`` tagged with the optimizer step they belong to."""

    def __init__(
        self, save_dir: str | os.PathLike[str], name: str = "logs", version: int | None = None
    ) -> None:
        self.save_dir = Path(save_dir)
        self.name = name
        self._version = version

    @property
    def version(self) -> int:
        """The run's version number, chosen on first use as the next free one."""
        if self._version is None:
            self._version = next_version(self.save_dir / self.name)
        return self._version

    @property
    def log_dir(self) -> Path:
        """The run directory this logger writes into."""
        return self.save_dir / self.name / f"version_{self.version}"

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at optimizer step ``step``."""

    def flush(self) -> None:  # noqa: B027 (optional for loggers that write through)
        """Push buffered records to disk."""

    def finalize(self) -> None:
        """Flush and close files; the logger may be used again afterwards (files reopen)."""
        self.flush()


class CSVLogger(Logger):
    """Append one row per ``log_metrics`` call to ``<log_dir>/metrics.csv``.

    Columns are ``step`` then metric names in order of first appearance. When a new name shows
    up the file is rewritten once with the wider header (rows are kept in memory for that);
    otherwise rows are appended, and the file is flushed every ``flush_every`` rows.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        name: str = "logs",
        version: int | None = None,
        flush_every: int = 100,
    ) -> None:
        super().__init__(save_dir, name, version)
        self.flush_every = flush_every
        self._columns: list[str] = ["step"]
        self._rows: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None
        self._pending = 0

    @property
    def path(self) -> Path:
        """The CSV file."""
        return self.log_dir / "metrics.csv"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_file"] = state["_writer"] = None
        return state

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        self._rows.append(row)
        new = [k for k in metrics if k not in self._columns]
        if new or self._writer is None:
            self._columns.extend(new)
            self._rewrite()
            return
        self._writer.writerow(row)
        self._pending += 1
        if self._pending >= self.flush_every:
            self.flush()

    def _rewrite(self) -> None:
        if self._file is not None:
            self._file.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", newline="")  # noqa: SIM115 (kept open for appends)
        self._writer = csv.DictWriter(self._file, fieldnames=self._columns, restval="")
        self._writer.writeheader()
        self._writer.writerows(self._rows)
        self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        self._pending = 0

    def finalize(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = self._writer = None
        self._pending = 0


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write event files here."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardLogger(Logger):
    """Write scalars to a TensorBoard event file in the run directory, one event per call
    (all of a step's values together: a third of the cost of one event per value)."""

    def __init__(
        self, save_dir: str | os.PathLike[str], name: str = "logs", version: int | None = None
    ) -> None:
        if not tensorboard_available():
            raise ImportError(
                "TensorBoardLogger needs the tensorboard package: pip install tensorboard "
                "(or mixprec[tensorboard]); CSVLogger needs nothing extra"
            )
        super().__init__(save_dir, name, version)
        self._writer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_writer"] = None
        return state

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self._writer is None:
            from torch.utils.tensorboard.writer import FileWriter

            self._writer = FileWriter(str(self.log_dir))
        values = [Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self._writer.add_summary(Summary(value=values), global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = None


def make_loggers(logger: Any, root: Path) -> list[Logger]:
    """The run's loggers from the Trainer's ``logger`` flag (True: CSV, and TensorBoard when
    installed, in the next free version directory under ``<root>/logs``)."""
    if logger is False or logger is None:
        return []
    if logger is True:
        version = next_version(root / "logs")
        found: list[Logger] = [CSVLogger(root, version=version)]
        if tensorboard_available():
            found.append(TensorBoardLogger(root, version=version))
        return found
    items = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    for item in items:
        if not isinstance(item, Logger):
            raise ValueError(
                "logger must be True, False, a mixprec Logger (CSVLogger, TensorBoardLogger) "
                f"or a list of them, got {type(item).__name__}"
            )
    return items
