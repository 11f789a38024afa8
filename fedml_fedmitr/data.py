"""Datasets for FedML runs of the plugin, in FedML's dataset format, partitioned by the core.

:func:`load_data(args)` mirrors ``fedml.data.load(args)``: it returns ``(dataset, class_num)``
with ``dataset = [train_data_num, test_data_num, train_data_global, test_data_global,
train_data_local_num_dict, train_data_local_dict, test_data_local_dict, class_num]`` (client
indices 0-based, counts in samples). It also stores a :class:`DataInfo` in
``args.fedmitr_data_info`` (input shape, normalisation mean/std, per-client label counts), which
the server needs for the valid pixel range of its synthetic images.

Datasets (``data_args.dataset``):

* ``digits``: scikit-learn's 8x8 digits (1,797 images, installed with scikit-learn, no download),
  one channel, values 0..16 scaled to [0, 1], resized to ``model_args.img_size``, split into
  train/test by a stratified split seeded by ``random_seed`` (``data_args.test_fraction``, 0.2).
* ``npz``: ``data_args.npz_path``, an archive with ``x_train, y_train, x_test, y_test``; images
  uint8 NHWC (or NHW grayscale), or floats in [0, 1].
* ``cifar10``: the torchvision ``cifar-10-batches-py`` folder in ``data_args.data_cache_dir``,
  read by FedML's own CIFAR-10 loading (``fedml.data.cifar10.data_loader.load_cifar10_data``),
  which never downloads when the files are present; the plugin checks they are there first.
* ``cifar100``: the torchvision ``cifar-100-python`` folder in ``data_args.data_cache_dir``, fine
  labels, read by the plugin (FedML's loader insists on a download offline; see
  :mod:`fedml_fedmitr.data_sources`).
* ``imagefolder``: ``data_cache_dir/train/<class>/*`` and ``test/<class>/*`` (or ``val/``) image files,
  decoded lazily with torchvision (never all in memory), resized to ``img_size`` with
  ``data_args.interpolation`` (bilinear), ``model_args.in_chans`` channels (3), normalised with
  ``data_args.input_mean`` / ``input_std`` or else the mean/std of 256 training images; the class
  names (sorted folder names) are recorded in ``summary.json``.

Every dataset is resized to ``img_size`` with ``data_args.interpolation`` (bilinear, bicubic or nearest).

``class_num`` (optional, in any section, e.g. ``data_args``) must equal the number of classes of the
data (labels ``0..class_num-1``) when it is given. :func:`preflight` checks the files, arrays,
``class_num`` and the partition (no client without samples) cheaply, before FedML starts.

Images are normalised per channel with the training set's mean and std (CIFAR-10: the published
ones) and resized to ``img_size`` when they differ. The training set is split among
``client_num_in_total`` clients by :func:`fedml_fedmitr.core.partition.partition`
(``partition_method``: ``hetero`` with ``partition_alpha``, ``pathological`` with
``classes_per_client``, ``homo``), always seeded by ``random_seed``. A client's local test set
holds the test images of the classes it trained on.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from . import data_sources as sources
from .core.partition import label_counts, partition
from .data_sources import NPZ_KEYS, DataError, _to_nchw_unit, load_npz_arrays, npz_labels  # noqa: F401

log = logging.getLogger("fedml_fedmitr")

CIFAR10_MEAN = (0.49139968, 0.48215827, 0.44653124)
CIFAR10_STD = (0.24703233, 0.24348505, 0.26158768)
TEST_BATCH_SIZE = 256


@dataclass
class DataInfo:
    name: str
    num_classes: int
    input_shape: Tuple[int, int, int]          # (C, H, W) after resizing
    mean: List[float]
    std: List[float]
    num_train: int
    num_test: int
    partition_method: str
    partition_alpha: Optional[float]
    classes_per_client: Optional[int]
    client_label_counts: List[List[int]] = field(default_factory=list)
    class_names: Optional[List[str]] = None    # label i is class_names[i] (cifar100, imagefolder)

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["input_shape"] = list(self.input_shape)
        return out


# ---------------------------------------------------------------------------------------------
# Raw arrays: (x_train, y_train, x_test, y_test) with x float32 NCHW in [0, 1]
# ---------------------------------------------------------------------------------------------
def digits_arrays(seed: int, test_fraction: float):
    """scikit-learn's 8x8 digits as (x_train, y_train, x_test, y_test), a stratified split seeded by ``seed``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = d.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, stratify=y, random_state=seed)
    return x_tr, y_tr, x_te, y_te


def _cifar10_folder(root: str) -> str:
    root = os.path.expanduser(root)
    folder = os.path.join(root, "cifar-10-batches-py")
    needed = ["data_batch_%d" % i for i in range(1, 6)] + ["test_batch"]
    missing = [f for f in needed if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise DataError(f"data_args.data_cache_dir = {root!r}: {folder} lacks {missing} (the torchvision "
                        "CIFAR-10 python files); put them there, the plugin never downloads")
    return folder


def check_class_num(args, y_train, y_test, name: str, where: str = "class_num") -> int:
    """The number of classes of the data; DataError if ``args.class_num`` says otherwise or a label is < 0."""
    low = int(min(y_train.min(), y_test.min()))
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    if low < 0:
        raise DataError(f"dataset {name!r} has a negative label ({low}): labels must be 0..class_num-1")
    given = getattr(args, "class_num", None)
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < 1:
            raise DataError(f"{where} = {given!r} is invalid: expected a positive integer")
        if given != num_classes:
            raise DataError(f"{where} = {given} disagrees with the data: dataset {name!r} has labels 0..{num_classes - 1}"
                            f" ({num_classes} classes); set class_num: {num_classes} or remove it")
    return num_classes


def check_shards(shards, name: str, method: str) -> None:
    empty = [i for i, shard in enumerate(shards) if len(shard) == 0]
    if empty:
        raise DataError(f"data_args: client(s) {empty} get an empty training shard of {name} with partition_method "
                        f"{method!r}: every client needs training data (use fewer clients or another partition)")


def _partition(args, y_tr, name: str):
    k = int(args.client_num_in_total)
    method = getattr(args, "partition_method", "hetero")
    try:
        shards = partition(y_tr, k, method, int(getattr(args, "random_seed", 0)),
                           alpha=float(getattr(args, "partition_alpha", 0.5)),
                           classes_per_client=int(getattr(args, "classes_per_client", 2)),
                           min_size=int(getattr(args, "partition_min_size", 10)))
    except ValueError as exc:
        raise DataError(f"data_args: cannot partition {name} ({len(y_tr)} training images) among "
                        f"{k} clients: {exc}") from exc
    check_shards(shards, name, method)
    return shards


def preflight(args, class_num_key: str = "class_num") -> None:
    """Cheap checks of the data before FedML starts (no image is loaded): the dataset files are there
    and readable with the arrays they need, ``class_num`` agrees with the labels, and the partition
    gives every client samples. Raises DataError naming the file, key or clients."""
    from .fedml_adapter.config import check_data_args
    from .fedml_adapter.model import apply_pretrained_input

    check_data_args(args)
    apply_pretrained_input(args)   # a pretrained model's input size, mean/std, interpolation
    name = args.dataset
    if name == "digits":
        _, y_tr, _, y_te = digits_arrays(int(getattr(args, "random_seed", 0)), float(getattr(args, "test_fraction", 0.2)))
    elif name == "npz":
        y_tr, y_te = npz_labels(args.npz_path)
        if len(y_tr) == 0 or len(y_te) == 0:
            raise DataError(f"{args.npz_path}: y_train or y_test is empty")
    elif name == "cifar100":
        y_tr, y_te = sources.cifar100_labels(args.data_cache_dir)
    elif name == "imagefolder":
        _, train_samples, test_samples = sources.imagefolder_index(args.data_cache_dir)
        y_tr = np.asarray([t for _, t in train_samples], dtype=np.int64)
        y_te = np.asarray([t for _, t in test_samples], dtype=np.int64)
    else:
        _cifar10_folder(args.data_cache_dir)
        given = getattr(args, "class_num", None)
        if given is not None and given != 10:
            raise DataError(f"{class_num_key} = {given!r} disagrees with the data: cifar10 has 10 classes")
        return
    check_class_num(args, y_tr, y_te, name, class_num_key)
    _partition(args, y_tr, name)


def _cifar10(root: str):
    root = os.path.expanduser(root)
    _cifar10_folder(root)
    from fedml.data.cifar10.data_loader import load_cifar10_data  # FedML's loading, not its partition

    x_tr, y_tr, x_te, y_te = load_cifar10_data(root)
    return (_to_nchw_unit(np.asarray(x_tr), "cifar10 train"), np.asarray(y_tr, dtype=np.int64),
            _to_nchw_unit(np.asarray(x_te), "cifar10 test"), np.asarray(y_te, dtype=np.int64))


def resize_images(x: torch.Tensor, size: int, mode: str = "bilinear") -> torch.Tensor:
    """Resize NCHW images to ``size`` x ``size`` (``mode``: bilinear, bicubic or nearest; antialiased when
    shrinking), in chunks."""
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    smooth = mode in ("bilinear", "bicubic")
    out = []
    for start in range(0, len(x), 4096):
        out.append(F.interpolate(x[start:start + 4096], size=(size, size), mode=mode,
                                 align_corners=False if smooth else None, antialias=smooth and size < x.shape[-1]))
    return torch.cat(out).clamp_(0.0, 1.0)


# ---------------------------------------------------------------------------------------------
def load_data(args) -> Tuple[list, int]:
    """FedML-format dataset of ``args.dataset`` partitioned by the core; see the module doc."""
    from .fedml_adapter.config import check_data_args
    from .fedml_adapter.model import apply_pretrained_input

    check_data_args(args)
    apply_pretrained_input(args)   # a pretrained model's input size, mean/std, interpolation
    name = args.dataset
    seed = int(getattr(args, "random_seed", 0))
    img_size = int(getattr(args, "img_size", 16))
    if name == "imagefolder":
        train_ds, test_ds, y_tr, y_te, mean, std, in_chans, class_names = _imagefolder(args, img_size, seed)
    else:
        train_ds, test_ds, y_tr, y_te, mean, std, in_chans, class_names = _in_memory(args, name, img_size, seed)
    num_classes = check_class_num(args, y_tr, y_te, name)
    want_chans = getattr(args, "in_chans", None)
    if want_chans is not None and int(want_chans) != in_chans:
        raise DataError(f"model_args.in_chans = {want_chans!r} but dataset {name!r} has {in_chans} channel(s)")

    k = int(args.client_num_in_total)
    method = getattr(args, "partition_method", "hetero")
    alpha = float(getattr(args, "partition_alpha", 0.5))
    cpc = int(getattr(args, "classes_per_client", 2))
    shards = _partition(args, y_tr, name)

    batch_size = int(getattr(args, "batch_size", 32))
    train_local_num: Dict[int, int] = {}
    train_local: Dict[int, DataLoader] = {}
    test_local: Dict[int, DataLoader] = {}
    counts = []
    for idx, shard in enumerate(shards):
        shard_t = torch.from_numpy(shard)
        gen = torch.Generator().manual_seed(seed * 1000 + idx)
        train_local[idx] = DataLoader(_subset(train_ds, shard_t), batch_size=batch_size,
                                      shuffle=True, generator=gen)
        train_local_num[idx] = int(len(shard))
        c = label_counts(y_tr[shard], num_classes)
        counts.append(c)
        own = torch.from_numpy(np.isin(y_te, np.flatnonzero(np.asarray(c) > 0)))
        test_local[idx] = DataLoader(_subset(test_ds, torch.nonzero(own).flatten()), batch_size=TEST_BATCH_SIZE)
    train_global = DataLoader(train_ds, batch_size=batch_size, shuffle=True,
                              generator=torch.Generator().manual_seed(seed))
    test_global = DataLoader(test_ds, batch_size=TEST_BATCH_SIZE)

    info = DataInfo(name=name, num_classes=num_classes, input_shape=(in_chans, img_size, img_size),
                    mean=[float(v) for v in mean], std=[float(v) for v in std], num_train=len(y_tr),
                    num_test=len(y_te), partition_method=method,
                    partition_alpha=alpha if method == "hetero" else None,
                    classes_per_client=cpc if method == "pathological" else None,
                    client_label_counts=counts, class_names=class_names)
    args.fedmitr_data_info = info
    log.info("data: %s, %d train / %d test images of shape %s, %d classes, %d clients (%s), "
             "samples per client %s", name, len(y_tr), len(y_te), info.input_shape, num_classes, k,
             method, [train_local_num[i] for i in range(k)])
    dataset = [len(y_tr), len(y_te), train_global, test_global, train_local_num, train_local, test_local,
               num_classes]
    return dataset, num_classes


def _in_memory(args, name: str, img_size: int, seed: int):
    """digits, npz, cifar10, cifar100: all images as one normalised tensor per split."""
    class_names = None
    if name == "digits":
        x_tr, y_tr, x_te, y_te = digits_arrays(seed, float(getattr(args, "test_fraction", 0.2)))
        mean = std = None
    elif name == "npz":
        x_tr, y_tr, x_te, y_te = load_npz_arrays(args.npz_path)
        mean = std = None
    elif name == "cifar100":
        x_tr, y_tr, x_te, y_te, class_names = sources.cifar100_arrays(args.data_cache_dir)
        mean = std = None
    else:
        x_tr, y_tr, x_te, y_te = _cifar10(args.data_cache_dir)
        mean, std = list(CIFAR10_MEAN), list(CIFAR10_STD)
    mode = getattr(args, "interpolation", "bilinear")
    xt_tr = resize_images(torch.from_numpy(x_tr), img_size, mode)
    xt_te = resize_images(torch.from_numpy(x_te), img_size, mode)
    if getattr(args, "input_mean", None) is not None and getattr(args, "input_std", None) is not None:
        mean, std = list(args.input_mean), list(args.input_std)   # the YAML's normalisation wins
    if mean is None:
        mean = xt_tr.mean(dim=(0, 2, 3)).tolist()
        std = xt_tr.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist()
    _check_stats(mean, std, int(xt_tr.shape[1]), name)
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    train = TensorDataset((xt_tr - m) / s, torch.from_numpy(y_tr))
    test = TensorDataset((xt_te - m) / s, torch.from_numpy(y_te))
    return train, test, y_tr, y_te, mean, std, int(xt_tr.shape[1]), class_names


def _imagefolder(args, img_size: int, seed: int):
    """An image folder, decoded lazily: the datasets hold file names, not pixels."""
    class_names, train_samples, test_samples = sources.imagefolder_index(args.data_cache_dir)
    in_chans = int(getattr(args, "in_chans", None) or 3)
    mean, std = getattr(args, "input_mean", None), getattr(args, "input_std", None)
    if mean is None or std is None:
        mean, std = sources.estimate_pixel_stats(train_samples, img_size, in_chans, seed=seed)
    _check_stats(mean, std, in_chans, "imagefolder")
    interpolation = getattr(args, "interpolation", "bilinear")
    train = sources.LazyImages(train_samples, img_size, in_chans, mean, std, interpolation)
    test = sources.LazyImages(test_samples, img_size, in_chans, mean, std, interpolation)
    y_tr = np.asarray(train.targets, dtype=np.int64)
    y_te = np.asarray(test.targets, dtype=np.int64)
    return train, test, y_tr, y_te, list(mean), list(std), in_chans, class_names


def _subset(dataset, index: torch.Tensor):
    """The rows ``index`` of ``dataset``: sliced tensors for an in-memory one, a Subset of a lazy one."""
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t[index] for t in dataset.tensors))
    from torch.utils.data import Subset
    return Subset(dataset, index.tolist())


def _check_stats(mean, std, channels: int, name: str) -> None:
    if len(mean) != channels or len(std) != channels:
        raise DataError(f"data_args.input_mean / input_std have {len(mean)} / {len(std)} values but dataset "
                        f"{name!r} has {channels} channel(s): give one value per channel")
