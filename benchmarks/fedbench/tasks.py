"""The benchmark's data, through the plugin's own path.

A setting's federated task is loaded by ``fedml_fedmitr.data.load_data`` with FedML-style args (the
YAML of the same run), so the plugin partitions, resizes and normalises it exactly as
``python -m fedml_fedmitr`` does: the same setting gives the same clients here and through the CLI.
Where the task is not an archive the user gave as is (a pretraining split, a validation split), the
benchmark first writes the archive it federates into the cache (numpy only) and hands the plugin
that file (``dataset: npz``).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Optional, Tuple

from .store import SHARED, stable_hash

VAL_SEED = 7       # the stratified validation hold-out (a fifth of every class's training images)
SHARE_SEED = 11    # the stratified public share of --pretrain share


def cifar10_full_archive(cache: Path) -> Path:
    """All of CIFAR-10 as an npz archive in the cache, decoded once from ../shared/data (seconds)."""
    out = Path(cache) / "data" / "cifar10_full.npz"
    if out.is_file():
        return out
    script = SHARED / "data" / "build_cifar10.py"
    if not script.is_file():
        raise SystemExit(f"--dataset cifar10_full: {script} not found (it decodes ../shared/data/cifar10_jpeg.npz); "
                         "use --dataset npz --npz PATH for an archive of your own")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name("cifar10_full.tmp.npz")
    subprocess.run([sys.executable, str(script), str(tmp)], check=True)
    os.replace(tmp, out)
    return out


def _save(path: Path, **arrays) -> None:
    import numpy as np
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + f".tmp{os.getpid()}.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _source(settings: Dict[str, Any]):
    """(x_train, y_train, x_test, y_test) of the setting's data as stored (digits: a fixed split)."""
    import numpy as np
    if settings["dataset"] == "digits":
        from fedml_fedmitr.data import digits_arrays
        return digits_arrays(0, 0.2)
    with np.load(settings["npz"], allow_pickle=False) as z:
        return z["x_train"], z["y_train"], z["x_test"], z["y_test"]


def _stratified(y, share: float, seed: int):
    """A boolean mask picking ``share`` of every class's indices (seeded)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    pick = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        pick[idx[:int(round(share * len(idx)))]] = True
    return pick


def _relabel(y, classes):
    import numpy as np
    remap = np.full(int(max(int(np.max(y)), max(classes))) + 1, -1, dtype=np.int64)
    remap[list(classes)] = np.arange(len(classes))
    return remap[y]


def _channels(x, chans: int):
    """Images converted to ``chans`` channels (RGB -> grey by the mean, grey -> RGB by repeating)."""
    import numpy as np
    nhwc = x if x.ndim == 4 and x.shape[-1] in (1, 3, 4) else (x[..., None] if x.ndim == 3 else x.transpose(0, 2, 3, 1))
    have = nhwc.shape[-1]
    if have == chans:
        return nhwc
    if chans == 1:
        return nhwc.astype(np.float32).mean(-1, keepdims=True).astype(x.dtype)
    return np.repeat(nhwc[..., :1], chans, axis=-1)


def archives(settings: Dict[str, Any], cache: Path) -> Dict[str, Optional[str]]:
    """The archives the setting federates and pretrains on, written into the cache when derived:
    ``task`` (None: the plugin reads the setting's own data as given) and ``public`` (the pretraining
    data of an offline backbone, None otherwise)."""
    import numpy as np
    pre = settings.get("pretrain") or {}
    source = pre.get("source")
    derived = source in ("split", "share", "npz") or settings["split"] == "val"
    out: Dict[str, Optional[str]] = {"task": None, "public": None}
    if not derived:
        return out
    key = stable_hash({"data": settings["dataset"], "npz": settings.get("npz_file"), "pretrain": {
        k: v for k, v in pre.items() if k in ("source", "public_classes", "public_share", "npz")},
        "split": settings["split"], "chans": settings["model"]["in_chans"]})
    d = Path(cache) / "tasks" / key
    task, public = d / "task.npz", d / "public.npz"
    out = {"task": str(task), "public": str(public) if source in ("split", "share", "npz") else None}
    if task.is_file() and (out["public"] is None or public.is_file()):
        return out
    x_tr, y_tr, x_te, y_te = _source(settings)
    y_tr, y_te = np.asarray(y_tr, dtype=np.int64), np.asarray(y_te, dtype=np.int64)
    if source == "split":
        pub, tc = pre["public_classes"], settings["task_classes"]
        p_tr, p_te = np.isin(y_tr, pub), np.isin(y_te, pub)
        _save(public, x_train=x_tr[p_tr], y_train=_relabel(y_tr[p_tr], pub), x_test=x_te[p_te],
              y_test=_relabel(y_te[p_te], pub))
        t_tr, t_te = np.isin(y_tr, tc), np.isin(y_te, tc)
        x_tr, y_tr, x_te, y_te = x_tr[t_tr], _relabel(y_tr[t_tr], tc), x_te[t_te], _relabel(y_te[t_te], tc)
    elif source == "share":
        p = _stratified(y_tr, float(pre["public_share"]), SHARE_SEED)
        _save(public, x_train=x_tr[p], y_train=y_tr[p], x_test=x_te, y_test=y_te)
        x_tr, y_tr = x_tr[~p], y_tr[~p]
    elif source == "npz":
        with np.load(pre["npz"], allow_pickle=False) as z:
            chans = settings["model"]["in_chans"]
            _save(public, x_train=_channels(z["x_train"], chans), y_train=z["y_train"],
                  x_test=_channels(z["x_test"], chans), y_test=z["y_test"])
    if settings["split"] == "val":
        held = _stratified(y_tr, 0.2, VAL_SEED)
        x_tr, y_tr, x_te, y_te = x_tr[~held], y_tr[~held], x_tr[held], y_tr[held]
    _save(task, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
    return out


def plugin_args(settings: Dict[str, Any], seed: int, archive: Optional[str], clients: Optional[int] = None,
                partition: Optional[str] = None, batch_size: Optional[int] = None) -> SimpleNamespace:
    """The FedML args (data_args, model_args, train_args of a YAML) of the setting for ``load_data``."""
    m = settings["model"]
    if archive is None and settings["dataset"] == "digits":
        data = dict(dataset="digits")
    else:
        data = dict(dataset="npz", npz_path=archive or settings["npz"])
    k = int(clients or settings["clients"])
    return SimpleNamespace(**data, random_seed=int(seed), img_size=m["img_size"], in_chans=m["in_chans"],
                           client_num_in_total=k, client_num_per_round=k,
                           partition_method=partition or settings["partition"],
                           partition_alpha=settings["alpha"] or 0.5,
                           classes_per_client=settings["classes_per_client"] or 1,
                           batch_size=int(batch_size or settings["client_train"]["batch_size"]))


def load_task(settings: Dict[str, Any], seed: int, cache: Path) -> Tuple[list, int, Any]:
    """``(dataset, num_classes, info)`` of the federated task for ``seed``: FedML's dataset list from
    the plugin's ``load_data`` (client shards, global train and test loaders) and its DataInfo."""
    from fedml_fedmitr.data import load_data
    args = plugin_args(settings, seed, archives(settings, cache)["task"])
    dataset, n = load_data(args)
    if n != settings["num_classes"]:
        raise SystemExit(f"the task has {n} classes, the setting expected {settings['num_classes']}")
    return dataset, n, args.fedmitr_data_info


def load_public(settings: Dict[str, Any], cache: Path, batch_size: int) -> Tuple[list, int, Any]:
    """The pretraining data of an offline backbone, as one client's dataset (the plugin's loader)."""
    from fedml_fedmitr.data import load_data
    path = archives(settings, cache)["public"]
    if path is None:
        raise SystemExit("this setting has no offline pretraining data")
    args = plugin_args(settings, int(settings["pretrain"]["seed"]), path, clients=1, partition="homo",
                       batch_size=batch_size)
    dataset, n = load_data(args)
    return dataset, n, args.fedmitr_data_info
