"""Ctrl-C held back while a checkpoint is written and recorded: a save that has started ends
complete (file written, ``last.ckpt`` linked, checkpoints beyond ``save_top_k`` removed)
before the ``KeyboardInterrupt`` comes, so an interrupted run never leaves its directory
between two states."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__: list[str] = []


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) back until the block ends, then raise ``KeyboardInterrupt``; a
    second Ctrl-C interrupts at once. Only where Python's default handler is installed, in the
    main thread; nested blocks hold it until the outermost one ends."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield  # another handler is the program's own choice; an enclosing block holds it
        return
    pressed: list[bool] = []

    def hold(signum: int, frame: Any) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt
