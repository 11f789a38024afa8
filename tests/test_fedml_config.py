"""Fail-fast configuration checks (FedML-free, before any training) and the plugin's data module."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from fedml_fedmitr.cli import validate
from fedml_fedmitr.core.config import ConfigError
from fedml_fedmitr.data import DataError, load_data

from conftest import PYTHON, child_env, tiny_config, write_yaml


def _validate(tmp_path, **sections):
    return validate(str(write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path / "out", **sections))))


def test_valid_tiny_config(tmp_path):
    sections, flat = _validate(tmp_path)
    assert flat.federated_optimizer == "FedMITR" and "fedmitr_args" in sections


@pytest.mark.parametrize("sections, words", [
    ({"fedmitr_args": {"inversion_iters": -3}}, ["fedmitr_args.inversion_iters", "-3"]),
    ({"fedmitr_args": {"distill_mode": "magic"}}, ["fedmitr_args.distill_mode", "token_relabel"]),
    ({"fedmitr_args": {"num_synthtic": 10}}, ["unknown key", "num_synthtic"]),
    ({"fedmitr_args": {"batch_size": 8}}, ["fedmitr_args.batch_size", "train_args.batch_size"]),
    ({"train_args": {"federated_optimizer": "FedMagic"}}, ["federated_optimizer", "FedMagic", "FedMITR"]),
    ({"train_args": {"comm_round": 3}}, ["comm_round", "exactly one"]),
    ({"train_args": {"client_optimizer": "lbfgs"}}, ["client_optimizer", "lbfgs"]),
    ({"train_args": {"epochs": 0}}, ["epochs"]),
    ({"data_args": {"dataset": "mnist"}}, ["data_args.dataset", "digits"]),
    ({"data_args": {"partition_method": "random"}}, ["partition_method", "hetero"]),
    ({"data_args": {"dataset": "npz"}}, ["npz_path"]),
    ({"data_args": {"dataset": "npz", "npz_path": "/nonexistent/x.npz"}}, ["/nonexistent/x.npz"]),
    ({"model_args": {"model": "not_a_model"}}, ["model_args.model", "not_a_model"]),
    ({"comm_args": {"backend": "NCCL"}}, ["backend", "NCCL"]),
    ({"train_args": {"client_feature_stats": "no"}}, ["train_args.client_feature_stats", "true or false"]),
    # clients that withhold their statistics and a server that matches them: refused before training
    ({"train_args": {"client_feature_stats": False}},
     ["train_args.client_feature_stats = false", "fedmitr_args.feature_weight = 0.1", "feature_weight: 0"]),
    # the class-conditional prior, but clients that do not send per-class statistics (off by default)
    ({"fedmitr_args": {"feature_prior": "per_class"}},
     ["fedmitr_args.feature_prior = 'per_class'", "client_class_feature_stats: true", "feature_prior: global"]),
    ({"fedmitr_args": {"feature_prior": "per_class", "feature_tokens": "all"}},
     ["fedmitr_args.feature_prior = 'per_class'", "feature_tokens: all"]),
    ({"train_args": {"client_class_feature_stats": 1}}, ["train_args.client_class_feature_stats", "true or false"]),
])
def test_bad_values_are_named(tmp_path, sections, words):
    with pytest.raises(ConfigError) as err:
        _validate(tmp_path, **sections)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


@pytest.mark.parametrize("sections", [
    {"fedmitr_args": {"feature_weight": 0.0}},              # no feature prior
    {"train_args": {"federated_optimizer": "DENSE"}},        # a method that never reads it
])
def test_withheld_feature_statistics_are_fine_where_nothing_matches_them(tmp_path, sections):
    sections = {**sections, "train_args": {"client_feature_stats": False, **sections.get("train_args", {})}}
    _, flat = _validate(tmp_path, **sections)
    assert flat.fedmitr_settings.client.feature_stats is False


def test_clients_that_send_per_class_statistics_let_the_class_conditional_prior_run(tmp_path):
    _, flat = _validate(tmp_path, fedmitr_args={"feature_prior": "per_class"},
                        train_args={"client_class_feature_stats": True})
    settings = flat.fedmitr_settings
    assert settings.method.feature_prior == "per_class" and settings.client.class_feature_stats is True


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        validate(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize("sections, words", [
    ({"fedmitr_args": {"prune_ratio": 1.5}}, ["fedmitr_args.prune_ratio", "1.5"]),
    ({"train_args": {"federated_optimizer": "FedMagic"}}, ["federated_optimizer", "FedMagic", "FedMITR"]),
])
def test_cli_exits_nonzero_fast(tmp_path, tmp_home, procs, sections, words):
    cfg = write_yaml(tmp_path / "bad.yaml", tiny_config(tmp_path / "out", **sections))
    start = time.time()
    p = procs.start([PYTHON, "-m", "fedml_fedmitr", "--cf", cfg], child_env(tmp_home))
    rc = p.wait(timeout=120)
    assert rc == 2, p.output()[-3000:]
    for word in words:
        assert word in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # nothing ran
    assert not (tmp_home / ".fedml").exists()  # FedML was never initialised
    assert time.time() - start < 60


# ---- the plugin's data module -------------------------------------------------------------------
def _args(**kw):
    base = dict(dataset="digits", random_seed=0, img_size=16, client_num_in_total=4,
                partition_method="hetero", partition_alpha=0.5, batch_size=32)
    base.update(kw)
    return SimpleNamespace(**base)


def test_digits_partition_is_seeded_and_complete():
    a, classes = load_data(_args())
    b, _ = load_data(_args())
    c, _ = load_data(_args(random_seed=1))
    assert classes == 10 and a[7] == 10
    n = [a[4][i] for i in range(4)]
    assert sum(n) == a[0] and a[0] + a[1] == 1797
    assert n == [b[4][i] for i in range(4)] and n != [c[4][i] for i in range(4)]
    x, y = next(iter(a[3]))
    assert tuple(x.shape[1:]) == (1, 16, 16)
    args = _args()
    load_data(args)
    info = args.fedmitr_data_info
    assert info.input_shape == (1, 16, 16) and len(info.mean) == 1 and len(info.client_label_counts) == 4
    assert [sum(c) for c in info.client_label_counts] == n


def test_pathological_partition_and_local_test_sets():
    args = _args(partition_method="pathological", classes_per_client=2, client_num_in_total=5)
    ds, _ = load_data(args)
    for i in range(5):
        held = [c for c in range(10) if args.fedmitr_data_info.client_label_counts[i][c] > 0]
        assert len(held) == 2
        test_labels = set(int(v) for _, y in ds[6][i] for v in y)
        assert test_labels == set(held)


def test_npz_dataset(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    np.savez(path, x_train=rng.integers(0, 256, (60, 8, 8, 3), dtype=np.uint8), y_train=np.arange(60) % 3,
             x_test=rng.integers(0, 256, (12, 8, 8, 3), dtype=np.uint8), y_test=np.arange(12) % 3)
    args = _args(dataset="npz", npz_path=str(path), client_num_in_total=2, partition_method="homo", img_size=8)
    ds, classes = load_data(args)
    assert classes == 3 and ds[0] == 60 and ds[1] == 12
    assert args.fedmitr_data_info.input_shape == (3, 8, 8)
    gray = tmp_path / "g.npz"
    np.savez(gray, x_train=rng.integers(0, 256, (40, 8, 8), dtype=np.uint8), y_train=np.arange(40) % 2,
             x_test=rng.integers(0, 256, (10, 8, 8), dtype=np.uint8), y_test=np.arange(10) % 2)
    args = _args(dataset="npz", npz_path=str(gray), client_num_in_total=2, partition_method="homo", img_size=16)
    load_data(args)
    assert args.fedmitr_data_info.input_shape == (1, 16, 16)
    broken = tmp_path / "b.npz"
    np.savez(broken, x_train=np.zeros((4, 8, 8), np.uint8), y_train=np.zeros(4, np.int64))
    with pytest.raises(DataError, match="x_test"):
        load_data(_args(dataset="npz", npz_path=str(broken), client_num_in_total=2, partition_method="homo"))


def test_cifar10_without_files_names_the_folder(tmp_path):
    with pytest.raises(DataError, match="cifar-10-batches-py"):
        load_data(_args(dataset="cifar10", data_cache_dir=str(tmp_path)))


def test_shipped_configs_validate(tmp_home):
    from conftest import ROOT

    (tmp_home / "fedml_data").mkdir()
    np.savez(tmp_home / "fedml_data" / "cifar10_small.npz", x_train=np.zeros((2, 32, 32, 3), np.uint8),
             y_train=np.zeros(2, np.int64), x_test=np.zeros((2, 32, 32, 3), np.uint8), y_test=np.zeros(2, np.int64))
    configs = sorted((ROOT / "config").rglob("*.yaml"))
    configs = [c for c in configs if c.name != "gpu_mapping.yaml"]
    assert len(configs) >= 7, configs
    for path in configs:
        sections, flat = validate(str(path))
        assert flat.comm_round == 1, path
