"""Small helpers of the cache and the result files (no torch)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional

ROOT = Path(__file__).resolve().parents[2]     # the repository
SHARED = ROOT.parent / "shared"


def stable_hash(obj: Any, n: int = 12) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def write_json_atomic(path: Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def portable(path: Any) -> Any:
    """``path`` as a result file should hold it: relative to the repository, ``../shared/...`` for the
    shared data, else only its name (no absolute path of the machine that ran it)."""
    if path is None:
        return None
    p = Path(path).resolve()
    for base, prefix in ((ROOT, ""), (SHARED, "../shared/")):
        try:
            return prefix + str(p.relative_to(base))
        except ValueError:
            continue
    return p.name
