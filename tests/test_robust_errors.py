"""Bad input gets a clear error before any long work: exit status 2, one line
``fedml_fedmitr: error: ...`` naming the key / file / client and what was expected, no stack trace.

Configuration, data and process-count errors are found before FedML is imported, so they are run
in-process through the CLI's ``main`` (the process-level exit status is covered by
``test_fedml_config.test_cli_exits_nonzero_fast``); errors found inside a server's aggregation run
in a real process (``server_only`` on crafted uploads here; a NaN upload over MPI in
``test_robust_clients.py``)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from fedml_fedmitr import cli, server_only

from conftest import PYTHON, child_env, error_lines, tiny_config, write_yaml


def _npz(path, n_train=40, classes=3, drop=(), labels=None):
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.integers(0, 256, (n_train, 8, 8), dtype=np.uint8),
              "y_train": np.asarray(labels if labels is not None else np.arange(n_train) % classes),
              "x_test": rng.integers(0, 256, (12, 8, 8), dtype=np.uint8), "y_test": np.arange(12) % classes}
    np.savez(path, **{k: v for k, v in arrays.items() if k not in drop})
    return path


def _expect_user_error(capfd, rc, words):
    out, err = capfd.readouterr()
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    lines = error_lines(err)
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _cases(tmp_path):
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"this is not a zip archive" * 10)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    npz = {"dataset": "npz", "partition_method": "homo", "data_cache_dir": None}
    small = {"img_size": 8, "patch_size": 4}
    return {
        "unknown_optimizer": ({"train_args": {"federated_optimizer": "FedMagic"}},
                              ["federated_optimizer", "'FedMagic'", "FedMITR"]),
        "mistyped_key": ({"fedmitr_args": {"num_synthtic": 10}},
                         ["unknown key 'num_synthtic'", "did you mean 'num_synthetic'"]),
        "out_of_range_min_clients": ({"fedmitr_args": {"min_clients": 0}},
                                     ["fedmitr_args.min_clients = 0", "expected an integer >= 1"]),
        "out_of_range_timeout": ({"fedmitr_args": {"client_timeout_s": -5}},
                                 ["fedmitr_args.client_timeout_s = -5", "expected a finite number >= 0"]),
        "min_clients_above_clients": ({"fedmitr_args": {"min_clients": 3}},
                                      ["fedmitr_args.min_clients = 3", "client_num_in_total = 2"]),
        "missing_dataset_file": ({"data_args": {**npz, "npz_path": str(tmp_path / "nope.npz")}, "model_args": small},
                                 ["data_args.npz_path", "nope.npz", "no such file"]),
        "unreadable_npz": ({"data_args": {**npz, "npz_path": str(corrupt)}, "model_args": small},
                           ["corrupt.npz", "not a readable .npz archive"]),
        "npz_missing_arrays": ({"data_args": {**npz, "npz_path": str(_npz(tmp_path / "m.npz", drop=("x_test", "y_test")))},
                                "model_args": small}, ["m.npz", "missing array(s) ['x_test', 'y_test']", "x_train"]),
        "class_num_disagrees": ({"data_args": {"class_num": 5}},
                                ["data_args.class_num = 5", "labels 0..9", "10 classes"]),
        # 2 classes, one of them with a single sample shared by 2 of the 4 clients: one gets nothing
        "empty_client_shard": ({"data_args": {**npz, "partition_method": "pathological", "classes_per_client": 1,
                                              "npz_path": str(_npz(tmp_path / "e.npz", labels=[0] + [1] * 39))},
                                "model_args": small, "train_args": {"client_num_in_total": 4, "client_num_per_round": 4}},
                               ["cannot partition", "4 clients", "got no samples"]),
        "more_workers_than_clients": ({"common_args": {"training_type": "cross_silo", "scenario": "horizontal"},
                                       "comm_args": {"backend": "GRPC", "grpc_ipconfig_path": "x.csv"},
                                       "device_args": {"worker_num": 3}},
                                      ["device_args.worker_num = 3", "client_num_in_total = 2"]),
        "unwritable_output_dir": ({"fedmitr_args": {"output_dir": str(a_file / "out")}},
                                  ["fedmitr_args.output_dir", "a_file", "is a file, not a folder"]),
    }


CASES = ["unknown_optimizer", "mistyped_key", "out_of_range_min_clients", "out_of_range_timeout",
         "min_clients_above_clients", "missing_dataset_file", "unreadable_npz", "npz_missing_arrays",
         "class_num_disagrees", "empty_client_shard", "more_workers_than_clients", "unwritable_output_dir"]


@pytest.mark.parametrize("case", CASES)
def test_user_error_is_one_clear_line(case, tmp_path, tmp_home, capfd):
    sections, words = _cases(tmp_path)[case]
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "bad.yaml", tiny_config(out, **sections))
    start = time.time()
    rc = cli.main(["--cf", str(cfg)])
    _expect_user_error(capfd, rc, words)
    assert not out.exists()  # nothing ran
    assert not (tmp_home / ".fedml").exists()  # FedML was never initialised
    assert time.time() - start < 30


def test_more_mpi_processes_than_clients(tmp_path, tmp_home, capfd, monkeypatch):
    """Under mpirun (MPICH's PMI_SIZE) every rank finds it before FedML starts; rank 0 says it."""
    cfg = write_yaml(tmp_path / "mpi.yaml", tiny_config(tmp_path / "out", comm_args={"backend": "MPI"}))
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("PMI_RANK", "0")
    _expect_user_error(capfd, cli.main(["--cf", str(cfg)]),
                       ["mpirun started 4 processes", "client_num_in_total = 2", "mpirun -n 3"])
    monkeypatch.setenv("PMI_RANK", "2")
    rc = cli.main(["--cf", str(cfg)])
    assert rc == 2 and error_lines(capfd.readouterr().err) == []  # the other ranks exit quietly


def test_server_only_user_errors(tmp_path, tmp_home, capfd):
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path / "out"))
    _expect_user_error(capfd, server_only.main(["--cf", str(cfg), "--optimizer", "FedMagic"]),
                       ["federated_optimizer = 'FedMagic'", "FedMITR"])
    _expect_user_error(capfd, server_only.main(["--cf", str(cfg), "--set", "distil_epochs=3"]),
                       ["unknown key 'distil_epochs'", "did you mean 'distill_epochs'"])
    _expect_user_error(capfd, server_only.main(["--cf", str(cfg)]),
                       ["no saved client uploads", str(tmp_path / "out" / "state" / "uploads.pt")])


def _crafted_uploads(path, args_cfg, bad_client=None, bad="shape", label_counts=None):
    """Uploads of 2 clients of the tiny config's model; client ``bad_client`` is of another architecture;
    ``label_counts`` (one row per client) replaces the default of 10 images of every class."""
    from types import SimpleNamespace

    import torch

    from fedml_fedmitr.data import load_data
    from fedml_fedmitr.fedml_adapter.model import create_model
    from fedml_fedmitr.fedml_adapter.state import save_uploads

    flat = {}
    for section in args_cfg.values():
        flat.update(section or {})
    args = SimpleNamespace(**flat)
    _, classes = load_data(args)
    model = create_model(args, classes)
    payloads = []
    for cid in range(2):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if cid == bad_client:
            state["pos_embed"] = torch.zeros(1, 5, state["pos_embed"].shape[-1])  # a 2x2-patch model
        # feature statistics of the right shape (blocks, mean and variance, embed_dim), as clients send
        stats = torch.stack([torch.zeros(len(model.blocks), model.embed_dim),
                             torch.ones(len(model.blocks), model.embed_dim)], dim=1)
        payloads.append({"client_id": cid, "state_dict": state, "num_samples": 100,
                         "label_counts": label_counts[cid] if label_counts else [10] * classes,
                         "train_s": 0.0, "feature_stats": stats})
    save_uploads(path, payloads, expected_clients=2)


def test_single_class_clients_are_named_in_a_warning(tmp_path, tmp_home, procs):
    """Clients that each trained on one class carry nothing that tells the classes apart: the server says
    so, naming each client and its class, and still runs; clients of two classes get no such warning."""
    from types import SimpleNamespace

    from fedml_fedmitr.fedml_adapter.checks import single_class_warning

    cfg_dict = tiny_config(tmp_path / "out")
    cfg = write_yaml(tmp_path / "c.yaml", cfg_dict)
    uploads = tmp_path / "uploads.pt"
    one_class = [[0, 0, 0, 10, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 10, 0, 0]]
    _crafted_uploads(uploads, cfg_dict, label_counts=one_class)
    p = procs.start([PYTHON, "-m", "fedml_fedmitr.server_only", "--cf", cfg, "--uploads", uploads],
                    child_env(tmp_home))
    assert p.wait(timeout=180) == 0, p.output()[-4000:]
    warned = [line for line in p.output().splitlines() if "every client trained on one class only" in line]
    assert len(warned) == 1, p.output()[-4000:]
    assert "client 0: class 3, client 1: class 7" in warned[0] and "classes_per_client" in warned[0]
    two_classes = [SimpleNamespace(client_id=0, label_counts=[5, 5, 0]), SimpleNamespace(client_id=1, label_counts=[0, 0, 9])]
    assert single_class_warning(two_classes) is None


def test_upload_of_another_architecture_names_the_client(tmp_path, tmp_home, procs):
    """The server refuses a client model whose shapes differ from its own, before any synthesis: with
    min_clients 2 the one good upload left is not enough (exit 2, one line naming the client); with
    the default min_clients 1 that client is dropped and named in summary.json, the run goes on."""
    out = tmp_path / "out"
    cfg_dict = tiny_config(out)
    cfg = write_yaml(tmp_path / "c.yaml", cfg_dict)
    uploads = tmp_path / "uploads.pt"
    _crafted_uploads(uploads, cfg_dict, bad_client=1)
    p = procs.start([PYTHON, "-m", "fedml_fedmitr.server_only", "--cf", cfg, "--uploads", uploads,
                     "--set", "min_clients=2"], child_env(tmp_home))
    rc = p.wait(timeout=120)
    assert rc == 2, p.output()[-4000:]
    lines = error_lines(p.stderr)
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    for word in ("the model of client 1", "another architecture", "'pos_embed'", "(1, 5, 96)", "(1, 17, 96)",
                 "min_clients = 2"):
        assert word in lines[0], (word, lines[0])
    record = json.loads((out / "error.json").read_text())
    assert record["user_error"] and "client 1" in record["error"] and record["exit_status"] == 2
    assert not (out / "state" / "FedMITR_pool.pt").exists()  # refused before any synthesis
    p = procs.start([PYTHON, "-m", "fedml_fedmitr.server_only", "--cf", cfg, "--uploads", uploads],
                    child_env(tmp_home))
    assert p.wait(timeout=180) == 0, p.output()[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "another architecture" in summary["clients_refused"]["1"] and summary["client_ids"] == [0]
