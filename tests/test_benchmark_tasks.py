"""The benchmark's data path (benchmarks/fedbench/tasks.py): the plugin's loader, derived archives.

Digits only (installed with scikit-learn); no child process."""
import argparse
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

from fedbench import settings as bench_settings  # noqa: E402
from fedbench import tasks  # noqa: E402


def _settings(tmp_path, *extra):
    args = bench_settings.build_parser().parse_args(
        ["--dataset", "digits", "--clients", "3", "--scale", "tiny", "--cache-dir", str(tmp_path), *extra])
    return bench_settings.build_settings(args)


def test_a_benchmark_setting_gives_the_clients_of_the_cli(tmp_path):
    """Without a derived archive the benchmark hands the plugin the same args a YAML would: the same
    shards, normalisation and test set as `python -m fedml_fedmitr` with those settings."""
    from fedml_fedmitr.data import load_data
    st = _settings(tmp_path)
    dataset, n, info = tasks.load_task(st, 3, tmp_path)
    yaml_like = argparse.Namespace(dataset="digits", random_seed=3, img_size=16, client_num_in_total=3,
                                   client_num_per_round=3, partition_method="hetero", partition_alpha=0.5,
                                   batch_size=32)
    ref, n_ref = load_data(yaml_like)
    assert n == n_ref == 10 and dataset[0] == ref[0] and dataset[1] == ref[1] == 360
    assert info.client_label_counts == yaml_like.fedmitr_data_info.client_label_counts
    assert info.mean == yaml_like.fedmitr_data_info.mean
    for k in range(3):
        assert (dataset[5][k].dataset.tensors[0] == ref[5][k].dataset.tensors[0]).all()


def test_split_backbone_and_validation_archives(tmp_path):
    st = _settings(tmp_path, "--backbone", "pretrained", "--public-classes", "0", "1", "2", "--split", "val")
    paths = tasks.archives(st, tmp_path)
    task, public = np.load(paths["task"]), np.load(paths["public"])
    # the public data: classes 0-2 only, relabelled 0..2; the task: the other 7, relabelled 0..6
    assert sorted(np.unique(public["y_train"])) == [0, 1, 2]
    assert sorted(np.unique(task["y_train"])) == list(range(7)) == sorted(np.unique(task["y_test"]))
    # validation: a fifth of every task class's training images, held out of the clients' data
    n_train_task = sum(int((tasks._source(st)[1] == c).sum()) for c in range(3, 10))
    assert len(task["y_test"]) == pytest.approx(0.2 * n_train_task, abs=7)
    rows = {r.tobytes() for r in task["x_train"].reshape(len(task["x_train"]), -1)}
    assert not any(r.tobytes() in rows for r in task["x_test"].reshape(len(task["x_test"]), -1))
    dataset, n, _ = tasks.load_task(st, 0, tmp_path)
    assert n == 7 and dataset[1] == len(task["y_test"])
    # built once: a second call reuses the files
    mtime = (tmp_path / "tasks").stat().st_mtime_ns
    assert tasks.archives(st, tmp_path) == paths and (tmp_path / "tasks").stat().st_mtime_ns == mtime


def test_public_share_backbone_keeps_every_class(tmp_path):
    st = _settings(tmp_path, "--backbone", "pretrained", "--pretrain", "share", "--public-share", "0.4")
    paths = tasks.archives(st, tmp_path)
    task, public = np.load(paths["task"]), np.load(paths["public"])
    assert sorted(np.unique(public["y_train"])) == sorted(np.unique(task["y_train"])) == list(range(10))
    total = len(public["y_train"]) + len(task["y_train"])
    assert len(public["y_train"]) == pytest.approx(0.4 * total, abs=10)
    assert st["task_classes"] == list(range(10))


def test_bad_settings_are_named(tmp_path):
    with pytest.raises(SystemExit, match="--public-share 1.5"):
        _settings(tmp_path, "--backbone", "pretrained", "--pretrain", "share", "--public-share", "1.5")
    with pytest.raises(SystemExit, match="--time-reference DENSE"):
        _settings(tmp_path, "--budget", "time", "--time-reference", "DENSE", "--methods", "FedMITR")
