"""Atomic checkpoints of a server run under its state directory (never a half-written file)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to ``path`` via a temporary file and a rename, so a kill never corrupts it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, str(tmp))
    os.replace(tmp, path)


def load_if_exists(path: Optional[Path]) -> Optional[Any]:
    """A checkpoint written by :func:`save_atomic`, read with ``weights_only=True`` (tensors and plain
    containers only: a planted file cannot run code); None when there is none."""
    if path is None or not Path(path).is_file():
        return None
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"checkpoint {str(path)!r} cannot be read as weights only ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}); delete it, or run without resume") from exc
