"""CIFAR-100 (the python folder, fine labels, read without running any code a pickle carries) and
image folders (train/<class>, test/ or val/, decoded lazily, resized, class names kept): loaded
through the plugin's data path, checked up front with one line naming what is wrong."""
import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from fedml_fedmitr.data import DataError, load_data, preflight
from fedml_fedmitr.data_sources import LazyImages


def args_for(dataset, root, **kw):
    base = dict(dataset=dataset, data_cache_dir=str(root), img_size=8, client_num_in_total=2,
                partition_method="homo", batch_size=16, random_seed=0, partition_min_size=1)
    base.update(kw)
    return SimpleNamespace(**base)


def write_cifar100(root, per_class_train=2, per_class_test=1):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class_train), ("test", per_class_test)):
        labels = [c for c in range(100) for _ in range(n)]
        data = rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)
        with open(folder / split, "wb") as fh:
            pickle.dump({b"data": data, b"fine_labels": labels, b"coarse_labels": [c // 5 for c in labels]}, fh)
    with open(folder / "meta", "wb") as fh:
        pickle.dump({b"fine_label_names": [f"class{c:02d}".encode() for c in range(100)]}, fh)
    return root


def write_imagefolder(root, classes=("cat", "dog", "fox"), train=4, test=2, split="test"):
    rng = np.random.default_rng(1)
    for part, n in (("train", train), (split, test)):
        for c, name in enumerate(classes):
            (root / part / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                side = 10 + 3 * i   # images of several sizes
                pixels = rng.integers(0, 256, size=(side, side + 2, 3), dtype=np.uint8)
                pixels[..., c % 3] = 255   # a class-coloured channel
                Image.fromarray(pixels).save(root / part / name / f"{i}.png")
    return root


def test_cifar100_folder_fine_labels_and_names(tmp_path):
    args = args_for("cifar100", write_cifar100(tmp_path))
    preflight(args)
    dataset, classes = load_data(args)
    assert classes == 100 and dataset[0] == 200 and dataset[1] == 100
    x, y = next(iter(dataset[3]))
    assert x.shape[1:] == (3, 8, 8) and int(y.max()) <= 99
    info = args.fedmitr_data_info
    assert info.class_names[:2] == ["class00", "class01"] and len(info.class_names) == 100
    assert abs(float(dataset[2].dataset.tensors[0].mean())) < 0.05   # normalised with its own mean


def test_a_cifar100_pickle_that_runs_code_is_refused(tmp_path):
    root = write_cifar100(tmp_path)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    with open(root / "cifar-100-python" / "train", "wb") as fh:
        pickle.dump({b"data": Evil(), b"fine_labels": [0]}, fh)
    with pytest.raises(DataError, match="cifar-100-python/train: not a readable CIFAR-100 python file"):
        preflight(args_for("cifar100", root))
    assert not marker.exists()


def test_cifar100_missing_files_are_named(tmp_path):
    with pytest.raises(DataError, match=r"lacks \['train', 'test', 'meta'\].*never downloads"):
        preflight(args_for("cifar100", tmp_path))


def test_imagefolder_is_lazy_resized_and_keeps_class_names(tmp_path):
    args = args_for("imagefolder", write_imagefolder(tmp_path), img_size=16)
    preflight(args)
    dataset, classes = load_data(args)
    assert classes == 3 and dataset[0] == 12 and dataset[1] == 6
    local = dataset[5][0].dataset
    assert isinstance(local.dataset, LazyImages)          # file names, decoded on demand
    assert all(isinstance(p, str) for p, _ in local.dataset.samples)
    x, y = next(iter(dataset[3]))
    assert x.shape == (6, 3, 16, 16) and sorted(y.tolist()) == [0, 0, 1, 1, 2, 2]
    info = args.fedmitr_data_info
    assert info.class_names == ["cat", "dog", "fox"] and info.input_shape == (3, 16, 16)
    # the class-coloured channel survives decoding, resizing and normalisation
    red = x[y == 0][:, 0].mean() - x[y == 0][:, 1].mean()
    assert float(red) > 0.5


def test_imagefolder_given_normalisation_grayscale_and_val_split(tmp_path):
    root = write_imagefolder(tmp_path, split="val")
    args = args_for("imagefolder", root, in_chans=1, input_mean=[0.5], input_std=[0.25], interpolation="bicubic")
    dataset, _ = load_data(args)
    x, _ = next(iter(dataset[3]))
    assert x.shape[1:] == (1, 8, 8)
    assert args.fedmitr_data_info.mean == [0.5] and args.fedmitr_data_info.std == [0.25]
    pixels = x * 0.25 + 0.5
    assert float(pixels.min()) >= -1e-4 and float(pixels.max()) <= 1 + 1e-4
    with pytest.raises(DataError, match="input_mean / input_std have 1 / 1 values but dataset 'imagefolder' has 3"):
        load_data(args_for("imagefolder", root, input_mean=[0.5], input_std=[0.25]))


@pytest.mark.parametrize("damage,words", [
    ("no_test", "no test/ or val/ folder"),
    ("no_train", "no {root}/train folder"),
    ("class_mismatch", "only in train: ['fox']"),
    ("empty_class", "class folder(s) ['fox'] hold no image file"),
])
def test_imagefolder_problems_are_one_clear_error(tmp_path, damage, words):
    import shutil
    root = write_imagefolder(tmp_path / "data")
    if damage == "no_test":
        shutil.rmtree(root / "test")
    elif damage == "no_train":
        shutil.rmtree(root / "train")
    elif damage == "class_mismatch":
        shutil.rmtree(root / "test" / "fox")
    else:
        for f in (root / "train" / "fox").iterdir():
            f.unlink()
    with pytest.raises(DataError) as err:
        preflight(args_for("imagefolder", root))
    assert words.format(root=root) in str(err.value), str(err.value)


def test_a_partition_of_an_image_folder_follows_its_labels(tmp_path):
    args = args_for("imagefolder", write_imagefolder(tmp_path, train=6), partition_method="pathological",
                    classes_per_client=1, client_num_in_total=3)
    dataset, _ = load_data(args)
    for idx in range(3):
        labels = {int(t) for _, t in (dataset[5][idx].dataset[i] for i in range(len(dataset[5][idx].dataset)))}
        assert len(labels) == 1
    assert torch.tensor(args.fedmitr_data_info.client_label_counts).sum() == 18


def test_in_memory_images_are_resized_with_the_chosen_interpolation():
    from fedml_fedmitr.data import resize_images
    x = torch.zeros(1, 1, 4, 4)
    x[..., :, 2:] = 1.0   # a vertical edge
    up = {m: resize_images(x, 8, m)[0, 0, 0] for m in ("bilinear", "bicubic", "nearest")}
    assert set(up["nearest"].tolist()) == {0.0, 1.0}                 # no in-between values
    assert 0.0 < float(up["bilinear"][3]) < 1.0 and not torch.equal(up["bilinear"], up["bicubic"])
