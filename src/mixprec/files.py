"""Writing a file whole: a reader, another thread or another process writing the same path
sees the old file or a new one, never half of one."""

from __future__ import annotations

import io
import os
import secrets
import stat
from pathlib import Path
from typing import Any

__all__ = ["write_atomically", "write_figure"]


def write_atomically(path: str | os.PathLike[str], text: str | bytes) -> Path:
    """Write `text` (UTF-8 as given, or bytes: an image) to `path` through a temporary file
    of its own in the same folder, then rename it over `path` in one step. Each call's
    temporary name is unique (two writers of one path in one process no longer take each
    other's), a file written over keeps its permissions (a new one gets the umask's), and a
    symbolic link keeps pointing at the file it names, which is the one replaced. Returns
    the path written (the link's target)."""
    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # (the umask applies)
        if isinstance(text, bytes):
            with os.fdopen(fd, "wb") as f:
                f.write(text)
        else:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:  # (written as given)
                f.write(text)
        try:
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        except FileNotFoundError:
            pass
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def write_figure(path: str | os.PathLike[str], fig: Any, dpi: int) -> Path:
    """Write the matplotlib figure ``fig`` as the PNG at ``path`` whole (`write_atomically`:
    rendered in memory first, never half an image on disk) and close it."""
    import matplotlib.pyplot as plt

    image = io.BytesIO()
    try:
        fig.savefig(image, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return write_atomically(path, image.getvalue())
