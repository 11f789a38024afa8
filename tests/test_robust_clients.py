"""Clients that fail do not hang the federation: real server and client processes, one client
killed, crashed or stalled before its upload (test-only hooks ``FEDMITR_TEST_STALL_RANK`` /
``FEDMITR_TEST_NAN_RANK`` name the client process). The server waits ``client_timeout_s``, then
proceeds with the uploads it has if there are ``min_clients`` of them (the missing clients are in
``summary.json``), or else exits 2 with one clear line; every live process exits."""
from __future__ import annotations

import json

import pytest

from conftest import (
    MPIRUN,
    PYTHON,
    child_env,
    consecutive_free_ports,
    error_lines,
    read_summary,
    tiny_config,
    wait_for,
    write_yaml,
)

TIMEOUT_S = 12
STALL_LINE = "stalls before its upload"


def _grpc(tmp_path, out, n, **fedmitr):
    base = consecutive_free_ports(n + 1)
    csv = tmp_path / "grpc_ipconfig.csv"
    csv.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" +
                   "".join(f"{r},{r},127.0.0.1,{base + r}\n" for r in range(n + 1)))
    return tiny_config(out, common_args={"training_type": "cross_silo", "scenario": "horizontal",
                                         "torch_num_threads": 1},
                       comm_args={"backend": "GRPC", "grpc_ipconfig_path": str(csv)},
                       device_args={"worker_num": n},
                       train_args={"client_num_in_total": n, "client_num_per_round": n, "epochs": 2},
                       fedmitr_args={"client_timeout_s": TIMEOUT_S, **fedmitr})


def _party(procs, tmp_path, home, cfg, rank, **env):
    role = "server" if rank == 0 else "client"
    return procs.start([PYTHON, "-m", "fedml_fedmitr", "--cf", cfg, "--rank", rank, "--role", role, "--run_id", "1"],
                       child_env(home, **env), log_path=tmp_path / f"{role}_{rank}.log")


def _start_grpc(procs, tmp_path, home, server_cfg, client_cfgs, env_of=None):
    server = _party(procs, tmp_path, home, server_cfg, 0)
    wait_for(lambda: "Started gRPC server" in server.output(), 120, 0.2, "the GRPC server", [server])
    clients = [_party(procs, tmp_path, home, cfg, i + 1, **((env_of or {}).get(i + 1, {})))
               for i, cfg in enumerate(client_cfgs)]
    return server, clients


def _no_traceback(*ps):
    for p in ps:
        assert "Traceback" not in p.output(), p.output()[-4000:]


def test_grpc_killed_client_server_proceeds(tmp_path, tmp_home, procs):
    """3 clients, the third killed (SIGKILL) before its upload; min_clients 2: the server proceeds."""
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "cs.yaml", _grpc(tmp_path, out, 3, min_clients=2))
    server, clients = _start_grpc(procs, tmp_path, tmp_home, cfg, [cfg] * 3,
                                  env_of={3: {"FEDMITR_TEST_STALL_RANK": 3}})
    wait_for(lambda: STALL_LINE in clients[2].output(), 180, 0.2, "client process 3 to finish training",
             [server, clients[2]])
    clients[2].kill()  # the client dies before its upload
    assert server.wait(timeout=180) == 0, server.output()[-6000:]
    for c in clients[:2]:
        assert c.wait(timeout=60) == 0, c.output()[-4000:]
    summary = read_summary(out)
    assert summary["clients_missing"] == [2] and summary["clients_expected"] == 3
    assert summary["client_ids"] == [0, 1] and summary["client_num"] == 2
    assert summary["test_acc"] is not None
    for cid in (0, 1):  # the live clients received the global model
        assert json.loads((out / "clients" / f"client_{cid}.json").read_text())["local_test_acc"] is not None
    assert "clients 2 did not upload within" in server.output()
    assert not (out / "error.json").exists()
    _no_traceback(server, *clients[:2])


def test_grpc_too_few_clients_is_a_clear_error(tmp_path, tmp_home, procs):
    """2 clients, the second built with another architecture crashes on the server's initial model
    (its own clear error); min_clients 2: the server exits 2 naming the missing client and stops the
    client that did upload."""
    out = tmp_path / "out"
    server_cfg = _grpc(tmp_path, out, 2, min_clients=2)
    cfg = write_yaml(tmp_path / "cs.yaml", server_cfg)
    other = json.loads(json.dumps(server_cfg))
    other["model_args"]["patch_size"] = 8
    other_cfg = write_yaml(tmp_path / "other.yaml", other)
    server, clients = _start_grpc(procs, tmp_path, tmp_home, cfg, [cfg, other_cfg])
    # the client of another architecture: exit 2, one line naming the mismatch
    assert clients[1].wait(timeout=180) == 2, clients[1].output()[-4000:]
    line = error_lines(clients[1].output())
    assert len(line) == 1 and "the server's initial model (received by client process 2) does not fit this " \
        "client's model (another architecture)" in line[0], line
    assert "'pos_embed'" in line[0] and "same model_args" in line[0]
    # the server: exit 2 after client_timeout_s, one line naming the missing client and min_clients
    assert server.wait(timeout=120) == 2, server.output()[-6000:]
    line = error_lines(server.output())
    assert len(line) == 1, server.output()[-4000:]
    for word in ("only 1 of 2 clients uploaded", f"client_timeout_s = {TIMEOUT_S} s", "missing clients 1",
                 "min_clients = 2"):
        assert word in line[0], (word, line[0])
    record = json.loads((out / "error.json").read_text())
    assert record["clients_missing"] == [1] and record["clients_arrived"] == [0] and record["exit_status"] == 2
    assert not (out / "summary.json").exists()
    # what arrived is kept for server_only
    assert (out / "state" / "uploads.pt").is_file()
    # the live client is told and exits (2, with the server's reason) instead of waiting forever
    assert clients[0].wait(timeout=60) == 2, clients[0].output()[-4000:]
    line = error_lines(clients[0].output())
    assert len(line) == 1 and "the server stopped the run: only 1 of 2 clients uploaded" in line[0], line
    _no_traceback(server, *clients)


def test_grpc_client_ends_when_the_server_dies(tmp_path, tmp_home, procs):
    """The server is killed (SIGKILL) during its synthesis, after the client's upload: with
    server_lost_s 3 the client sees the server's port closed and exits 2 with one line, instead of
    waiting forever for a global model (FedML's client does)."""
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "cs.yaml", _grpc(tmp_path, out, 1, server_lost_s=3, inversion_iters=100000))
    server, clients = _start_grpc(procs, tmp_path, tmp_home, cfg, [cfg])
    wait_for(lambda: "server: 1 client uploads" in server.output(), 180, 0.2, "the client's upload",
             [server, clients[0]])
    server.kill()
    assert clients[0].wait(timeout=60) == 2, clients[0].output()[-4000:]
    line = error_lines(clients[0].output())
    assert len(line) == 1, clients[0].output()[-4000:]
    for word in ("the server at 127.0.0.1:", "has not answered for", "server_lost_s = 3", "resume: true"):
        assert word in line[0], (word, line[0])
    _no_traceback(clients[0])


mpi = pytest.mark.skipif(MPIRUN is None, reason="no mpirun (pip install mpich)")


def _mpirun(procs, tmp_path, home, cfg, **env):
    p = procs.start([MPIRUN, "-n", "3", PYTHON, "-m", "fedml_fedmitr", "--cf", cfg], child_env(home, **env),
                    log_path=tmp_path / "mpirun.log")
    return p, p.wait(timeout=240)


@mpi
def test_mpi_stalled_client_server_proceeds(tmp_path, tmp_home, procs):
    """Under MPI a rank that hangs before its upload: the server proceeds after client_timeout_s and
    ends the job (mpirun exits 0) once the live client has the global model."""
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "mpi.yaml", tiny_config(
        out, common_args={"torch_num_threads": 1}, comm_args={"backend": "MPI"}, train_args={"epochs": 2},
        fedmitr_args={"client_timeout_s": TIMEOUT_S, "min_clients": 1}))
    p, rc = _mpirun(procs, tmp_path, tmp_home, cfg, FEDMITR_TEST_STALL_RANK=2)
    log = p.output()
    assert rc == 0, log[-6000:]
    assert STALL_LINE in log
    summary = read_summary(out)
    assert summary["clients_missing"] == [1] and summary["client_ids"] == [0]
    assert json.loads((out / "clients" / "client_0.json").read_text())["local_test_acc"] is not None
    assert "ending the MPI job" in log
    assert "Traceback" not in log


@mpi
def test_mpi_nan_upload_drops_that_client(tmp_path, tmp_home, procs):
    """A NaN in one upload drops that client, not the federation: the server proceeds with the other
    (min_clients 1), names the dropped client in its log and in summary.json, and saves the good upload."""
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "mpi.yaml", tiny_config(
        out, common_args={"torch_num_threads": 1}, comm_args={"backend": "MPI"}, train_args={"epochs": 1}))
    p, rc = _mpirun(procs, tmp_path, tmp_home, cfg, FEDMITR_TEST_NAN_RANK=2)
    log = p.output()
    assert rc == 0, log[-6000:]
    assert "dropped the upload of client 1" in log and "NaN or Inf" in log
    summary = read_summary(out)
    assert summary["client_ids"] == [0]
    assert "NaN or Inf" in summary["clients_refused"]["1"] and "upload refused" in summary["clients_dropped"]["1"]
    import torch
    saved = torch.load(str(out / "state" / "uploads.pt"), weights_only=True)
    assert [u["client_id"] for u in saved["uploads"]] == [0]
    assert "Traceback" not in log


@mpi
def test_mpi_nan_upload_below_min_clients_ends_with_one_line(tmp_path, tmp_home, procs):
    """With min_clients 2, the one good upload left is not enough: exit 2, one line naming the refused
    client and why, error.json; the good upload is saved first (server_only can use it)."""
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "mpi.yaml", tiny_config(
        out, common_args={"torch_num_threads": 1}, comm_args={"backend": "MPI"}, train_args={"epochs": 1},
        fedmitr_args={"min_clients": 2}))
    p, rc = _mpirun(procs, tmp_path, tmp_home, cfg, FEDMITR_TEST_NAN_RANK=2)
    log = p.output()
    assert rc == 2, log[-6000:]
    server_lines = [line for line in error_lines(log) if "client process" not in line]
    assert len(server_lines) == 1, log[-4000:]
    assert "client 1: the model of client 1: parameter" in server_lines[0] and "NaN or Inf" in server_lines[0]
    assert "min_clients = 2" in server_lines[0]
    record = json.loads((out / "error.json").read_text())
    assert record["user_error"] and "1" in record["clients_refused"]
    assert not (out / "summary.json").exists() and (out / "state" / "uploads.pt").exists()
    assert "Traceback" not in log
