"""Cross-silo runs: GRPC on loopback with a server and 2 client processes (through
examples/cross_silo/run_local.sh), and FedML's MPI backend under a real mpirun."""
from __future__ import annotations

import json

import pytest

from conftest import (
    MPIRUN,
    PYTHON,
    ROOT,
    check_summary,
    child_env,
    consecutive_free_ports,
    read_summary,
    tiny_config,
    write_yaml,
)


def _cross_silo(out, backend, **extra):
    return tiny_config(out, common_args={"training_type": "cross_silo", "scenario": "horizontal"},
                       comm_args={"backend": backend, **extra}, device_args={"worker_num": 2})


def test_cross_silo_grpc_server_and_two_clients(tmp_path, tmp_home, procs):
    out = tmp_path / "out"
    server_cfg = _cross_silo(out, "GRPC", grpc_ipconfig_path="unused.csv")
    # the feature prior: the server refuses to start synthesis unless every client's feature
    # statistics came through GRPC (and its safe unpickler) with the weights
    server_cfg["fedmitr_args"]["feature_weight"] = 0.1
    server = write_yaml(tmp_path / "server.yaml", server_cfg)
    client_cfg = _cross_silo(out, "GRPC", grpc_ipconfig_path="unused.csv")
    client_cfg["fedmitr_args"] = {"output_dir": str(out), "progress": False}
    client = write_yaml(tmp_path / "client.yaml", client_cfg)
    logs = tmp_path / "logs"
    env = child_env(tmp_home, PYTHON=PYTHON, FEDMITR_GRPC_BASE_PORT=consecutive_free_ports(3),
                    FEDMITR_LOG_DIR=logs, FEDMITR_CLIENT_GRACE_S=60, TMPDIR=tmp_path)
    p = procs.start(["bash", ROOT / "examples" / "cross_silo" / "run_local.sh", "2", server, client], env,
                    log_path=tmp_path / "run_local.log")
    rc = p.wait(timeout=300)
    all_logs = p.output() + "".join(f.read_text(errors="replace") for f in sorted(logs.glob("*.log")))
    assert rc == 0, all_logs[-8000:]
    summary = read_summary(out)
    check_summary(summary, "FedMITR", clients=2)
    assert summary["backend"] == "GRPC" and summary["training_type"] == "cross_silo"
    assert summary["config"]["fedmitr_args"]["feature_weight"] == 0.1
    for cid in range(2):
        rec = json.loads((out / "clients" / f"client_{cid}.json").read_text())
        assert rec["local_test_acc"] is not None
        assert f"client {cid} trained on" in (logs / f"client_{cid + 1}.log").read_text(errors="replace")


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun (pip install mpich)")
def test_cross_silo_mpi_backend(tmp_path, tmp_home, procs):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "cs_mpi.yaml", _cross_silo(out, "MPI"))
    p = procs.start([MPIRUN, "-n", "3", PYTHON, "-m", "fedml_fedmitr", "--cf", cfg], child_env(tmp_home),
                    log_path=tmp_path / "mpirun.log")
    rc = p.wait(timeout=300)
    assert rc == 0, p.output()[-6000:]
    summary = read_summary(out)
    check_summary(summary, "FedMITR", clients=2)
    assert summary["backend"] == "MPI" and summary["training_type"] == "cross_silo"
    for cid in range(2):
        assert (out / "clients" / f"client_{cid}.json").is_file()
