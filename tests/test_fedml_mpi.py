"""MPI simulation with a real ``mpirun`` (FedML's cross-silo managers over the simulation's MPI
communicator): 2 clients on 2 workers, and more clients than workers."""
from __future__ import annotations

import json

import pytest

from conftest import MPIRUN, PYTHON, check_summary, child_env, read_summary, tiny_config, write_yaml

pytestmark = pytest.mark.skipif(MPIRUN is None, reason="no mpirun (pip install mpich)")


def _mpirun(procs, n, cfg, home, log):
    p = procs.start([MPIRUN, "-n", str(n), PYTHON, "-m", "fedml_fedmitr", "--cf", cfg], child_env(home),
                    log_path=log)
    return p, p.wait(timeout=300)


def test_mpi_simulation_two_clients(tmp_path, tmp_home, procs):
    out = tmp_path / "out"
    # the clients also send per-class feature statistics over MPI, and the server's prior matches them
    cfg = write_yaml(tmp_path / "mpi.yaml", tiny_config(out, comm_args={"backend": "MPI"},
                                                        train_args={"client_class_feature_stats": True},
                                                        fedmitr_args={"feature_prior": "per_class"}))
    p, rc = _mpirun(procs, 3, cfg, tmp_home, tmp_path / "mpirun.log")
    assert rc == 0, p.output()[-6000:]
    summary = read_summary(out)
    check_summary(summary, "FedMITR", clients=2)
    assert summary["backend"] == "MPI" and summary["training_type"] == "simulation"
    assert summary["config"]["fedmitr_args"]["feature_prior"] == "per_class"
    assert summary["config"]["train_args"]["class_feature_stats"] is True
    for cid in range(2):  # each client process evaluated and saved the model it received
        rec = json.loads((out / "clients" / f"client_{cid}.json").read_text())
        assert rec["local_test_acc"] is not None
        assert (out / "clients" / f"client_{cid}_global_model.pt").is_file()


def test_mpi_simulation_more_clients_than_workers(tmp_path, tmp_home, procs):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "mpi6.yaml", tiny_config(
        out, comm_args={"backend": "MPI"},
        train_args={"federated_optimizer": "OneShotFedAvg", "client_num_in_total": 6, "client_num_per_round": 6,
                    "epochs": 4}))
    p, rc = _mpirun(procs, 3, cfg, tmp_home, tmp_path / "mpirun.log")
    assert rc == 0, p.output()[-6000:]
    summary = read_summary(out)
    # every one of the 6 clients' models reached the server, from 2 worker processes
    assert summary["client_num"] == 6 and summary["client_ids"] == list(range(6))
    assert len(summary["client_test_acc"]) == 6 and len(summary["partition"]["label_counts"]) == 6
    assert summary["num_synthetic"] == 0 and summary["optimizer"] == "OneShotFedAvg"
    log = p.output()
    assert "client process 1 trains client(s) [0, 2, 4]" in log
    assert "client process 2 trains client(s) [1, 3, 5]" in log
    for cid in range(6):
        assert (out / "clients" / f"client_{cid}.json").is_file()
