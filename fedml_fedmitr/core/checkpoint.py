"""Files a server run writes: atomic (never half-written), never through a planted symlink, and
private where they hold weights.

:func:`atomic_write` writes through a temporary file created with ``O_CREAT | O_EXCL | O_NOFOLLOW``
(a symlink or file planted at the temporary name is removed first, never followed) and renames it
over the target: a rename replaces a symlink at the target itself, it never writes to where the
symlink points. ``private=True`` creates the file 0600 (saved uploads, checkpoints: every client's
weights); otherwise it is created as the user's umask allows (summaries, pictures, the global
model).
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO, Any, Callable, Optional

import torch

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def atomic_write(path, write: Callable[[IO[bytes]], None], private: bool = False) -> Path:
    """Call ``write(binary_file)`` on a fresh temporary file, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        os.unlink(tmp)   # a leftover of a killed run, or a planted symlink: removed, not followed
    except FileNotFoundError:
        pass
    fd = os.open(tmp, _FLAGS, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_text(path, text: str, private: bool = False) -> Path:
    return atomic_write(path, lambda fh: fh.write(text.encode("utf-8")), private)


def write_bytes(path, data: bytes, private: bool = False) -> Path:
    return atomic_write(path, lambda fh: fh.write(data), private)


def save_atomic(obj: Any, path: Path, private: bool = True) -> None:
    """torch.save to ``path`` atomically (see :func:`atomic_write`); private (0600) by default."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    write_bytes(path, buf.getvalue(), private)


def load_if_exists(path: Optional[Path]) -> Optional[Any]:
    """A checkpoint written by :func:`save_atomic`, read with ``weights_only=True`` (tensors and plain
    containers only: a planted file cannot run code); None when there is none."""
    if path is None or not Path(path).is_file():
        return None
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read as weights only ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else 'truncated or corrupt'}); "
                              "delete it, or run with resume: false") from exc


class CheckpointError(ValueError):
    """A saved checkpoint that cannot be read (truncated, corrupt, or not weights-only); names the file."""
