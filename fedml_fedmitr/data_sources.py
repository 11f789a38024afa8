"""Files the plugin reads datasets from (digits come with scikit-learn, CIFAR-10 through FedML).

* ``npz``: an archive of ``x_train, y_train, x_test, y_test`` (checked member by member).
* ``cifar100``: torchvision's ``cifar-100-python`` folder (``train``, ``test``, ``meta``) in
  ``data_args.data_cache_dir``, fine labels (100 classes). FedML 0.9.6's CIFAR-100 loader builds
  torchvision's ``CIFAR100(download=True)``, which checks the published MD5 sums and downloads when
  they differ, so offline it refuses any copy that is not byte-identical. The plugin reads the same
  three files itself, with an unpickler that admits only the arrays, lists and strings they hold.
* ``imagefolder``: ``data_cache_dir/train/<class>/*`` and ``data_cache_dir/test/<class>/*`` (or
  ``val/``) of image files, the layout of OfficeHome domains and Mini-ImageNet exports: the folders
  are listed up front by torchvision's ``ImageFolder`` rules (``make_dataset``: classes in sorted
  order, its image extensions; the same classes in both splits), and the images are decoded one by
  one as a loader asks for them (PIL), resized to ``img_size`` and normalised with torchvision's
  transforms.

Nothing here downloads; a missing folder or file is a :class:`~fedml_fedmitr.data.DataError` naming it.
"""
from __future__ import annotations

import os
import pickle
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .core.config import ConfigError

CIFAR100_FILES = ("train", "test", "meta")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class DataError(ConfigError):
    """A dataset file or array is missing or malformed (the message names it)."""


# ---- npz archives ----
def _to_nchw_unit(x: np.ndarray, where: str) -> np.ndarray:
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4:
        raise DataError(f"{where}: expected images of shape (N, H, W, C) or (N, H, W), got {x.shape}")
    if x.shape[-1] not in (1, 3, 4) and x.shape[1] in (1, 3, 4):
        x = np.transpose(x, (0, 2, 3, 1))  # NCHW given: make NHWC first
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / 255.0
    else:
        x = x.astype(np.float32)
        if x.size and (x.min() < -1e-3 or x.max() > 1.0 + 1e-3):
            raise DataError(f"{where}: float images must lie in [0, 1] (got {x.min():.3g}..{x.max():.3g}); "
                            "store uint8 0..255 instead")
    return np.ascontiguousarray(np.transpose(x, (0, 3, 1, 2)))


def load_npz_arrays(path: str):
    """(x_train, y_train, x_test, y_test) of an .npz archive; DataError naming a missing key."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"data_args.npz_path = {path!r}: no such file")
    try:
        blob = np.load(path, allow_pickle=False)
    except Exception as exc:  # a corrupt or non-npz file
        raise DataError(f"data_args.npz_path = {path!r} is not a readable .npz archive: {exc}") from exc
    with blob:
        missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in blob.files]
        if missing:
            raise DataError(f"{path}: missing array(s) {missing}; an npz dataset needs x_train, y_train, "
                            f"x_test, y_test (has {sorted(blob.files)})")
        arrays = {}
        for k in ("x_train", "y_train", "x_test", "y_test"):
            try:
                arrays[k] = blob[k]
            except Exception as exc:   # a corrupt member: zlib / zip / format errors
                raise DataError(f"data_args.npz_path = {path!r}: array {k} cannot be read "
                                f"({type(exc).__name__}: {exc})") from exc
    x_tr = _to_nchw_unit(arrays["x_train"], f"{path}: x_train")
    x_te = _to_nchw_unit(arrays["x_test"], f"{path}: x_test")
    y_tr = arrays["y_train"].astype(np.int64).reshape(-1)
    y_te = arrays["y_test"].astype(np.int64).reshape(-1)
    for xs, ys, split in ((x_tr, y_tr, "train"), (x_te, y_te, "test")):
        if len(xs) != len(ys):
            raise DataError(f"{path}: x_{split} has {len(xs)} images but y_{split} {len(ys)} labels")
        if len(ys) == 0:
            raise DataError(f"{path}: x_{split} is empty")
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise DataError(f"{path}: x_train images {x_tr.shape[1:]} and x_test images {x_te.shape[1:]} differ")
    return x_tr, y_tr, x_te, y_te


NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def npz_labels(path: str):
    """(y_train, y_test) of an .npz archive, reading only the label arrays; DataError naming what is
    missing or unreadable (the image arrays are checked to be present, not loaded)."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"data_args.npz_path = {path!r}: no such file")
    if not os.access(path, os.R_OK):
        raise DataError(f"data_args.npz_path = {path!r} is not readable (permission denied)")
    try:
        blob = np.load(path, allow_pickle=False)
        if not hasattr(blob, "files"):
            raise ValueError("it holds a single array, not an .npz archive")
    except Exception as exc:
        raise DataError(f"data_args.npz_path = {path!r} is not a readable .npz archive: {exc}") from exc
    with blob:
        missing = [k for k in NPZ_KEYS if k not in blob.files]
        if missing:
            raise DataError(f"{path}: missing array(s) {missing}; an npz dataset needs x_train, y_train, "
                            f"x_test, y_test (has {sorted(blob.files)})")
        try:
            labels = blob["y_train"].astype(np.int64).reshape(-1), blob["y_test"].astype(np.int64).reshape(-1)
        except Exception as exc:
            raise DataError(f"{path}: y_train / y_test cannot be read as integer labels: {exc}") from exc
        bad = _corrupt_members(path, ("x_train", "x_test"))
        if bad:
            raise DataError(f"data_args.npz_path = {path!r}: array {bad} is corrupt (its checksum does not match)")
        return labels


def _corrupt_members(path: str, keys) -> Optional[str]:
    """The first of ``keys`` whose zip member fails its CRC check (read in chunks, never all in memory)."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as z:
            for k in keys:
                try:
                    with z.open(k + ".npy") as fh:
                        while fh.read(1 << 22):
                            pass
                except KeyError:
                    continue
                except Exception:
                    return k
    except zipfile.BadZipFile:
        return None   # np.load opened it, so it is no zip: nothing to check here
    return None


# ---- CIFAR-100 ----
class _ArrayUnpickler(pickle.Unpickler):
    """CIFAR's python pickles hold dicts of bytes, lists and one numpy array: nothing else is built."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not an array, list or string")
        return super().find_class(module, name)


def cifar100_folder(root: str) -> str:
    folder = os.path.join(os.path.expanduser(root), "cifar-100-python")
    missing = [f for f in CIFAR100_FILES if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise DataError(f"data_args.data_cache_dir = {root!r}: {folder} lacks {missing} (the torchvision "
                          "CIFAR-100 python files); put them there, the plugin never downloads")
    return folder


def _read_pickle(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            blob = _ArrayUnpickler(fh, encoding="bytes").load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, AttributeError) as exc:
        raise DataError(f"{path}: not a readable CIFAR-100 python file ({exc})") from exc
    if not isinstance(blob, dict):
        raise DataError(f"{path}: expected a dict, got {type(blob).__name__}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in blob.items()}


def cifar100_labels(root: str) -> Tuple[np.ndarray, np.ndarray]:
    folder = cifar100_folder(root)
    out = []
    for split in ("train", "test"):
        blob = _read_pickle(os.path.join(folder, split))
        if "fine_labels" not in blob:
            raise DataError(f"{os.path.join(folder, split)}: no fine_labels")
        out.append(np.asarray(blob["fine_labels"], dtype=np.int64))
    return out[0], out[1]


def cifar100_arrays(root: str):
    """(x_train, y_train, x_test, y_test, class_names): x float32 NCHW in [0, 1], fine labels."""
    folder = cifar100_folder(root)
    arrays = []
    for split in ("train", "test"):
        path = os.path.join(folder, split)
        blob = _read_pickle(path)
        if "data" not in blob or "fine_labels" not in blob:
            raise DataError(f"{path}: expected the keys data and fine_labels")
        data = np.asarray(blob["data"])
        y = np.asarray(blob["fine_labels"], dtype=np.int64)
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(y):
            raise DataError(f"{path}: data must be N x 3072 uint8 with one label per row, got {data.shape} "
                              f"and {len(y)} labels")
        arrays += [data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0, y]
    meta = _read_pickle(os.path.join(folder, "meta"))
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta.get("fine_label_names", [])]
    return (*arrays, names)


# ---- image folders ----
def imagefolder_splits(root: str) -> Tuple[str, str]:
    """(train folder, test folder) of an image-folder dataset; ``test/`` or else ``val/``."""
    base = os.path.expanduser(root)
    train = os.path.join(base, "train")
    if not os.path.isdir(train):
        raise DataError(f"data_args.data_cache_dir = {root!r}: no {train} folder (expected train/<class>/* and "
                          "test/<class>/* or val/<class>/* image files)")
    for name in ("test", "val"):
        test = os.path.join(base, name)
        if os.path.isdir(test):
            return train, test
    raise DataError(f"data_args.data_cache_dir = {root!r}: no test/ or val/ folder next to {train}")


def list_images(folder: str) -> Tuple[List[str], List[Tuple[str, int]]]:
    """(class names, [(file, label), ...]) of ``folder/<class>/*``, without opening an image. Classes
    are the sub-folders in sorted order (torchvision's ``ImageFolder`` order); a class without images
    is an error."""
    from torchvision.datasets.folder import make_dataset

    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DataError(f"{folder}: no class folders (expected {folder}/<class>/<image>)")
    index = {c: i for i, c in enumerate(classes)}
    try:
        samples = make_dataset(folder, index, extensions=IMAGE_EXTENSIONS, allow_empty=True)
    except (OSError, FileNotFoundError) as exc:
        raise DataError(f"{folder}: {exc}") from exc
    found = {label for _, label in samples}
    empty = [c for c in classes if index[c] not in found]
    if empty:
        raise DataError(f"{folder}: class folder(s) {empty[:5]} hold no image file ({', '.join(IMAGE_EXTENSIONS)})")
    return classes, samples


def imagefolder_index(root: str):
    """(class names, train samples, test samples), with the same classes in both splits."""
    train, test = imagefolder_splits(root)
    classes, train_samples = list_images(train)
    test_classes, test_samples = list_images(test)
    if test_classes != classes:
        only_train = sorted(set(classes) - set(test_classes))
        only_test = sorted(set(test_classes) - set(classes))
        raise DataError(f"data_args.data_cache_dir = {root!r}: {train} and {test} hold other classes (only in "
                          f"train: {only_train[:5]}, only in {os.path.basename(test)}: {only_test[:5]})")
    return classes, train_samples, test_samples


class LazyImages:
    """A torch Dataset of (image, label) decoded from the files as they are asked for: RGB or
    grayscale (``in_chans``), resized to ``size`` x ``size`` with ``interpolation``, normalised."""

    def __init__(self, samples: Sequence[Tuple[str, int]], size: int, in_chans: int, mean, std,
                 interpolation: str = "bilinear"):
        from torchvision import transforms

        self.samples = list(samples)
        self.targets = [label for _, label in self.samples]
        self.in_chans = int(in_chans)
        mode = transforms.InterpolationMode(interpolation)
        self.transform = transforms.Compose([
            transforms.Resize((int(size), int(size)), interpolation=mode, antialias=True),
            transforms.ToTensor(), transforms.Normalize(list(mean), list(std))])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as img:
            img = img.convert("L" if self.in_chans == 1 else "RGB")
            return self.transform(img), label


def estimate_pixel_stats(samples: Sequence[Tuple[str, int]], size: int, in_chans: int, count: int = 256,
                         seed: int = 0):
    """Per-channel (mean, std) in [0, 1] pixel units of up to ``count`` training images (a seeded
    sample): the normalisation of an image folder when neither the YAML nor a pretrained model gives one."""
    import torch

    rng = np.random.default_rng(seed)
    pick = rng.choice(len(samples), size=min(count, len(samples)), replace=False)
    raw = LazyImages([samples[i] for i in pick], size, in_chans, [0.0] * in_chans, [1.0] * in_chans)
    x = torch.stack([raw[i][0] for i in range(len(raw))])
    return x.mean(dim=(0, 2, 3)).tolist(), x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist()
