"""Where logged metrics go: a CSV file (always available) and TensorBoard event files.

Both loggers write into one run directory, ``<save_dir>/<name>/version_<n>``, and open their
files on the first write, so a logger can be built, pickled to another process, and used
there. The Trainer calls them on rank 0 only.

A version is chosen (the next free one, its directory created at once so that no other run
takes it) when it is first needed, not when the logger is built. A CSV logger given the
version of an existing run appends to that run's ``metrics.csv``: resuming a run with its
own version continues its log, and nothing written before is lost.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import os
import re
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import IO, Any

from mixprec.files import write_atomically

__all__ = [
    "CSVLogger",
    "Logger",
    "TensorBoardLogger",
]

log = logging.getLogger("mixprec")


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

    _resumed_at: int | None = None  # the step a resumed fit goes on from (`resume_at`)
    _chosen = False  # the version was chosen here, not given (`new_run`)
    # whether `resume_at` drops what the logger held past the step (a resume from an
    # epoch's last batch then hands it that step's rows again: `StepLog.replay`)
    drops_resumed_rows = False

    def __init__(
        self, save_dir: str | os.PathLike[str], name: str = "logs", version: int | None = None
    ) -> None:
        self.save_dir = Path(save_dir)
        self.name = name
        self._version = version
        self._version_of: Logger | None = None  # share another logger's version (defaults)
        self._chosen = False  # the version was chosen here, not given

    @property
    def version(self) -> int:
        """The run's version number, chosen on first use as the next free one (and its
        directory created, so that another run does not choose it too)."""
        if self._version is None:
            if self._version_of is not None:
                self._version = self._version_of.version
            else:
                self._version = next_version(self.save_dir / self.name)
                self.log_dir.mkdir(parents=True, exist_ok=True)
            self._chosen = True
        return self._version

    @version.setter
    def version(self, version: int) -> None:
        self._version = version

    def new_run(self) -> None:
        """A new fit begins (a Trainer's second, not a resume): a version this logger chose
        is let go, so that the fit logs into the next free one, as a fresh process would,
        rather than over the last fit's steps; a version given is kept (its log goes on)."""
        self.finalize()
        if self._chosen:
            self._version, self._chosen, self._resumed_at = None, False, None

    @property
    def log_dir(self) -> Path:
        """The run directory this logger writes into."""
        return self.save_dir / self.name / f"version_{self.version}"

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at optimizer step ``step``."""

    def resume_at(self, step: int) -> None:
        """A fit resumes from a checkpoint at optimizer step ``step``: it logs the steps after
        it again, so a log this logger continues drops what an earlier run (killed later)
        logged past it, rather than holding those steps twice."""
        self._resumed_at = step

    def flush(self) -> None:  # noqa: B027 (optional for loggers that write through)
        """Push buffered records to disk."""

    def finalize(self) -> None:
        """Flush and close files; the logger may be used again afterwards (files reopen)."""
        self.flush()


class CSVLogger(Logger):
    """Append one row per ``log_metrics`` call to ``<log_dir>/metrics.csv`` (UTF-8).

    Columns are ``step`` then metric names in order of first appearance. When a new name shows
    up the file is rewritten once with the wider header (rows are kept in memory for that;
    the rewrite replaces the file atomically); otherwise rows are appended, and the file is
    flushed every ``flush_every`` rows (the Trainer flushes it too at each epoch's end, and
    before it writes a checkpoint). A file already there (a run resumed with its version)
    is continued: its rows are kept, but those past the step the fit resumes from (a run
    killed after its checkpoint logged them; the resumed fit logs them again), and new
    ones follow.
    """

    drops_resumed_rows = True

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
        self._read_existing = False

    @property
    def path(self) -> Path:
        """The CSV file."""
        return self.log_dir / "metrics.csv"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_file"] = state["_writer"] = None
        return state

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._read_existing:
            self._continue_existing()
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

    def new_run(self) -> None:
        super().new_run()
        # (the rows held are the last run's file's: a version kept is read again at the
        # next write, one set by the processes' agreement is another run's)
        self._columns, self._rows, self._read_existing = ["step"], [], False

    def resume_at(self, step: int) -> None:
        if not self._read_existing:  # the file is read at the first write, and cut then
            super().resume_at(step)
            return
        # (this logger's rows are held already, an earlier fit's in this process: cut now;
        # the next write rewrites the file)
        kept = [r for r in self._rows if not _past(r.get("step"), step)]
        if len(kept) < len(self._rows):
            self._rows = kept
            self.finalize()

    def _continue_existing(self) -> None:
        self._read_existing = True
        resumed, self._resumed_at = self._resumed_at, None
        if self._rows or not self.path.is_file():
            return
        with open(self.path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns, rows = list(reader.fieldnames or []), list(reader)
        if columns[:1] != ["step"]:
            raise ValueError(
                f"{self.path} exists but is not a metrics file this logger wrote (its header "
                f"is {columns[:5]}); give the CSVLogger another version or save_dir"
            )
        if resumed is not None:  # (rewritten without them at the first write)
            rows = [r for r in rows if not _past(r.get("step"), resumed)]
        self._columns, self._rows = columns, rows
        log.info("CSVLogger: continuing %s after its %d rows", self.path, len(rows))

    def _rewrite(self) -> None:
        if self._file is not None:
            self._file.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self._columns, restval="")
        writer.writeheader()
        writer.writerows(self._rows)
        write_atomically(self.path, text.getvalue())  # the rows before are never half-lost
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 (kept open)
        self._writer = csv.DictWriter(self._file, fieldnames=self._columns, restval="")
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


def _read_last(open_writer: Any, log_dir: Path) -> Any:
    """A TensorBoard writer of ``log_dir`` whose event file sorts after those already there.
    TensorBoard reads a directory's files in name order, and a name holds the second it was
    made and a per-process count: a writer made in the same second as an earlier one of its
    process, after the count passed 9 (or 99...), sorted first, so a resumed fit's purge was
    read before the events it drops. Such a writer is made again in the next second."""
    made_before = {p.name for p in log_dir.glob("events.out.tfevents.*")}
    for _ in range(3):
        writer = open_writer(str(log_dir))
        writer.flush()
        mine = [p for p in log_dir.glob("events.out.tfevents.*") if p.name not in made_before]
        if len(mine) != 1 or all(old < mine[0].name for old in made_before):
            return writer
        writer.close()
        mine[0].unlink()
        time.sleep(1.0 - time.time() % 1.0)
    return open_writer(str(log_dir))


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write event files here."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardLogger(Logger):
    """Write scalars to a TensorBoard event file in the run directory, one event per call
    (all of a step's values together: a third of the cost of one event per value)."""

    drops_resumed_rows = True

    def __init__(
        self, save_dir: str | os.PathLike[str], name: str = "logs", version: int | None = None
    ) -> None:
        if not tensorboard_available():
            raise ImportError(
                "TensorBoardLogger needs the tensorboard package: pip install 'tensorboard>=2.14' "
                "'torch==2.13.0' (the tensorboard extra); CSVLogger needs nothing extra"
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
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            from torch.utils.tensorboard.writer import FileWriter

            self._writer = _read_last(FileWriter, self.log_dir)
            if self._resumed_at is not None:
                # TensorBoard's purge: events of earlier files from this step on are
                # dropped when read (a resumed fit logs them again); once, by the first
                # writer after the resume (a later stage's writer must not purge its events)
                purge, self._resumed_at = self._resumed_at + 1, None
                self._writer.add_event(Event(step=purge, file_version="brain.Event:2"))
                start = SessionLog(status=SessionLog.START)
                self._writer.add_event(Event(step=purge, session_log=start))
        values = [Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self._writer.add_summary(Summary(value=values), global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = None


def _past(step: Any, resumed: int) -> bool:
    """Whether a CSV row's ``step`` lies after the step a fit resumed from."""
    try:
        return float(step) > resumed
    except (TypeError, ValueError):
        return False


def make_loggers(logger: Any, root: Path) -> list[Logger]:
    """The run's loggers from the Trainer's ``logger`` flag (True: CSV, and TensorBoard when
    installed, in the next free version directory under ``<root>/logs``)."""
    if logger is False or logger is None:
        return []
    if logger is True:  # the version is chosen when the run starts, shared by both
        csv_logger = CSVLogger(root)
        found: list[Logger] = [csv_logger]
        if tensorboard_available():
            tb = TensorBoardLogger(root)
            tb._version_of = csv_logger
            found.append(tb)
        return found
    items = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    for item in items:
        if not isinstance(item, Logger):
            raise ValueError(
                "logger must be True, False, a mixprec Logger (CSVLogger, TensorBoardLogger) "
                f"or a list of them, got {type(item).__name__}"
            )
    return items
