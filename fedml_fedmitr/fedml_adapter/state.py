"""The server's saved state under ``<output_dir>/state/``: received uploads and run fingerprints.

* ``uploads.pt``: every client upload the server received, saved atomically as soon as they are all
  in (or the server proceeded without the missing ones), before the server method runs. It holds
  ``{"version", "uploads": [payload, ...], "missing_clients", "expected_clients", "client_settings",
  "saved_at"}``; a payload is :meth:`ClientUpload.to_payload` plus ``train_s``. With
  ``fedmitr_args.resume: true`` the runner starts from it instead of asking clients again, and
  :mod:`fedml_fedmitr.server_only` reruns the server from it with any method or settings.
* ``<Method>_run.json``: what the method's own checkpoints (``<Method>_pool.pt``,
  ``<Method>_distill.pt``) were made from: the server settings that shape the result and a digest of
  the uploads. A resumed run with other settings or uploads is refused (:class:`StateError`) instead
  of silently mixing two runs; a fresh run (``resume: false``) deletes the method's old checkpoints
  first, so a later resume can never pick up checkpoints of an earlier run.

FedML-free.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from ..core.checkpoint import save_atomic, write_text
from .errors import StateError

log = logging.getLogger("fedml_fedmitr")

STATE_DIR = "state"
UPLOADS_NAME = "uploads.pt"
UPLOADS_VERSION = 1
# fedmitr_args that do not change the global model (run control and reporting)
RUN_CONTROL_KEYS = ("output_dir", "resume", "progress", "tensorboard", "save_images", "client_timeout_s",
                    "min_clients", "server_lost_s", "eval_every")
# the FedML keys that shape what the clients upload
CLIENT_KEYS = ("dataset", "npz_path", "partition_method", "partition_alpha", "classes_per_client",
               "partition_min_size", "test_fraction", "client_num_in_total", "random_seed", "model", "img_size",
               "patch_size", "in_chans", "pretrained", "pretrained_path", "checkpoint", "client_models", "epochs",
               "batch_size", "learning_rate", "client_optimizer", "weight_decay", "momentum", "client_augment",
               "client_flip", "label_smoothing", "client_feature_stats", "client_class_feature_stats", "interpolation", "input_mean", "input_std")


def state_dir(output_dir) -> Path:
    return Path(output_dir) / STATE_DIR


def uploads_path(output_dir) -> Path:
    return state_dir(output_dir) / UPLOADS_NAME


def client_settings(args) -> Dict[str, Any]:
    """The FedML settings that determine the clients' uploads (recorded with them)."""
    out = {}
    for key in CLIENT_KEYS:
        value = getattr(args, key, None)
        out[key] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    return out


def save_uploads(path, payloads: Sequence[Mapping[str, Any]], missing_clients: Sequence[int] = (),
                 expected_clients: Optional[int] = None, settings: Optional[Mapping[str, Any]] = None) -> Path:
    blob = {"version": UPLOADS_VERSION, "uploads": [dict(p) for p in payloads],
            "missing_clients": sorted(int(c) for c in missing_clients),
            "expected_clients": expected_clients, "client_settings": dict(settings or {}),
            "saved_at": time.time()}
    save_atomic(blob, Path(path))
    log.info("server: saved %d client upload(s) to %s", len(payloads), path)
    return Path(path)


def load_uploads(path) -> Dict[str, Any]:
    """The saved uploads; StateError naming the file if it is missing or not an uploads file."""
    path = Path(path)
    if not path.is_file():
        raise StateError(f"no saved client uploads at {str(path)!r} (the server saves them to "
                         f"<output_dir>/{STATE_DIR}/{UPLOADS_NAME} once every upload arrived)")
    try:
        blob = torch.load(str(path), map_location="cpu", weights_only=True)  # a planted file cannot run code
    except Exception as exc:
        raise StateError(f"saved client uploads {str(path)!r} cannot be read: {exc}") from exc
    if not isinstance(blob, dict) or blob.get("version") != UPLOADS_VERSION or not isinstance(blob.get("uploads"), list):
        raise StateError(f"{str(path)!r} is not a fedml_fedmitr uploads file (version {UPLOADS_VERSION})")
    for i, payload in enumerate(blob["uploads"]):
        if not isinstance(payload, dict) or not {"client_id", "state_dict", "num_samples", "label_counts"} <= set(payload):
            raise StateError(f"{str(path)!r}: upload #{i} lacks client_id / state_dict / num_samples / label_counts")
    return blob


def settings_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> List[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def uploads_digest(uploads) -> str:
    """A digest of the uploads' ids, counts, weights and feature statistics (bytes of every tensor)."""
    h = hashlib.sha256()

    def tensor(value) -> None:
        t = value.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")

    for u in uploads:
        h.update(json.dumps([int(u.client_id), int(u.num_samples), [int(c) for c in u.label_counts]]).encode())
        for key in sorted(u.state_dict):
            value = u.state_dict[key]
            h.update(key.encode())
            if torch.is_tensor(value):
                tensor(value)
            else:
                h.update(repr(value).encode())
        if getattr(u, "feature_stats", None) is not None:
            h.update(b"feature_stats")
            tensor(u.feature_stats)
        if getattr(u, "class_feature_stats", None) is not None:
            h.update(b"class_feature_stats")
            tensor(u.class_feature_stats)
    return h.hexdigest()


def method_fingerprint(method_name: str, config, uploads, seed: int, mean, std, input_shape) -> Dict[str, Any]:
    cfg = {k: v for k, v in config.to_dict().items() if k not in RUN_CONTROL_KEYS}
    return {"method": method_name, "fedmitr_args": cfg, "seed": int(seed),
            "mean": [float(v) for v in mean], "std": [float(v) for v in std],
            "input_shape": [int(v) for v in input_shape], "uploads": uploads_digest(uploads)}


def prepare_method_state(directory, method_name: str, fingerprint: Mapping[str, Any], resume: bool) -> None:
    """Check (resume) or reset (fresh run) the method's checkpoints in ``directory``; see the module doc."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fp_path = directory / f"{method_name}_run.json"
    checkpoints = sorted(p for p in directory.glob(f"{method_name}_*") if p.name != fp_path.name)
    fp = json.loads(json.dumps(fingerprint))  # JSON-normalised, as it is stored
    if resume and fp_path.is_file():
        try:
            saved = json.loads(fp_path.read_text())
        except ValueError:
            saved = None
        if saved != fp:
            saved = saved or {}
            diff = [k for k in ("method", "seed", "mean", "std", "input_shape", "uploads") if saved.get(k) != fp.get(k)]
            diff += [f"fedmitr_args.{k}" for k in settings_diff(saved.get("fedmitr_args") or {}, fp["fedmitr_args"])]
            raise StateError(
                f"fedmitr_args.resume is true but the checkpoints of {method_name} in {str(directory)!r} were "
                f"made with other settings or uploads (differs in: {', '.join(diff) or 'format'}); set "
                f"resume: false to start {method_name} over, or use another output_dir")
        if checkpoints:
            log.info("server: resuming %s from %s", method_name, ", ".join(p.name for p in checkpoints))
        return
    if resume and checkpoints:
        log.warning("server: %s has checkpoints without a %s; resuming from them", method_name, fp_path.name)
    elif not resume:
        for p in checkpoints:
            p.unlink()
            log.info("server: fresh run (resume: false): removed the old checkpoint %s", p)
    write_text(fp_path, json.dumps(fp, indent=1), private=True)


PREVIOUS_DIR = "state.previous"
LOCK_NAME = ".fedmitr.lock"
_held_locks: Dict[str, Any] = {}


def set_aside_previous_state(output_dir) -> Optional[Path]:
    """A fresh run (``resume: false``) in an output_dir that holds a previous run's saved state moves
    that state to ``state.previous/`` (replacing an older one) instead of overwriting it, with one
    warning line; returns where it went."""
    import shutil

    src = state_dir(output_dir)
    if not src.is_dir() or not any(src.iterdir()):
        return None
    dst = Path(output_dir) / PREVIOUS_DIR
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.is_dir():
        shutil.rmtree(dst)
    os.replace(src, dst)
    log.warning("server: fresh run (resume: false): the previous run's saved uploads and checkpoints moved "
                "to %s (set resume: true to continue a run instead)", dst)
    return dst


def _lock_key(output_dir) -> str:
    return str(Path(os.path.expanduser(str(output_dir))).resolve())


def lock_output_dir(output_dir) -> bool:
    """An exclusive lock on ``output_dir`` until :func:`release_output_dir`. A second run on the same
    folder gets a :class:`StateError` naming the PID that holds it. True when this call took the lock,
    False when this process already held it."""
    import fcntl

    key = _lock_key(output_dir)
    out = Path(key)
    if key in _held_locks:
        return False
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise StateError(f"fedmitr_args.output_dir {str(output_dir)!r} is in use by another run (PID {holder}); "
                         "wait for it to finish, or give this run another output_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held_locks[key] = fd
    return True


def release_output_dir(output_dir) -> None:
    fd = _held_locks.pop(_lock_key(output_dir), None)
    if fd is not None:
        os.close(fd)   # closing the descriptor releases the flock
