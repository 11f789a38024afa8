"""Messages are read without running anyone's code (FedML's GRPC loop unpickles whatever reaches
the port): FedML's own messages with model payloads pass, anything else is refused unexecuted."""
from __future__ import annotations

import io
import os
import pickle
import textwrap

import numpy as np
import pytest
import torch

from fedml_fedmitr.fedml_adapter.safe_pickle import RefusedMessage, safe_loads

from conftest import PYTHON, child_env, free_ports


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_fedml_messages_with_model_payloads_pass():
    from fedml.core.distributed.communication.message import Message

    from helpers_core import tiny_vit

    msg = Message("upload", 1, 0)
    state = tiny_vit().state_dict()
    msg.add_params("model_params", {"fedmitr_uploads": [{"client_id": 1, "state_dict": state, "num_samples": 7,
                                                         "label_counts": [1, 6], "train_s": 0.5}]})
    msg.add_params("extra", {"array": np.arange(4, dtype=np.float32), "scalar": np.float64(2.5),
                             "param": torch.nn.Parameter(torch.ones(3)), "half": torch.ones(2, dtype=torch.bfloat16),
                             "misc": (1, 2.0, "x", None, True, b"raw", {3, 4})})
    got = safe_loads(pickle.dumps(msg))
    up = got.get("model_params")["fedmitr_uploads"][0]
    for k, v in state.items():
        assert torch.equal(up["state_dict"][k], v), k
    extra = got.get("extra")
    assert np.array_equal(extra["array"], np.arange(4, dtype=np.float32)) and extra["scalar"] == 2.5
    assert torch.equal(extra["param"], torch.ones(3)) and extra["misc"][-1] == {3, 4}


def test_code_in_a_message_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(RefusedMessage, match="names posix.system|names os.system"):
        safe_loads(pickle.dumps({"payload": _Evil(marker)}))
    # the same payload hidden in a torch storage's nested archive (torch reads it with weights_only=False)
    inner = io.BytesIO()
    pickle.dump(_Evil(marker), inner)
    storage_trick = pickle.dumps(_StorageBytes(inner.getvalue()))
    with pytest.raises(RefusedMessage):
        safe_loads(storage_trick)
    with pytest.raises(RefusedMessage, match="not a readable message"):
        safe_loads(pickle.dumps({"a": 1})[:-3])
    with pytest.raises(RefusedMessage, match="expected the bytes"):
        safe_loads("not bytes")
    assert not marker.exists()


class _StorageBytes:
    """Pickles as torch.storage._load_from_bytes(data), as a tensor's storage does."""

    def __init__(self, data):
        self.data = data

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.data,))


RECEIVER = textwrap.dedent(r'''
    import pickle, sys, time, threading, logging, os
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_comm_manager_pb2_grpc
    from fedml.core.distributed.communication.grpc.grpc_comm_manager import GRPCCommManager
    from fedml.core.distributed.communication.message import Message
    from fedml_fedmitr.fedml_adapter import fedml_patches

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    csv, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    fedml_patches.fix_grpc_loop()

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    class Observer:
        def __init__(self):
            self.got = []
        def receive_message(self, msg_type, msg):
            self.got.append((msg_type, msg.get("payload")))

    mgr = GRPCCommManager(csv, client_rank=1, client_num=2)
    obs = Observer()
    mgr.add_observer(obs)
    th = threading.Thread(target=mgr.message_handling_subroutine)
    th.start()
    # an attacker who can reach the port: raw gRPC, a pickle that runs a command, then garbage
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = grpc_comm_manager_pb2_grpc.gRPCCommManagerStub(channel)
    for payload in (pickle.dumps(Evil()), b"\x80\x04garbage", pickle.dumps({"not": "a message"})):
        stub.sendMessage(grpc_comm_manager_pb2.CommRequest(client_id=0, message=payload))
    # the honest party's message still arrives after them
    sender = GRPCCommManager(csv, client_rank=0, client_num=2)
    msg = Message("ping", 0, 1)
    msg.add_params("payload", "hello")
    sender.send_message(msg)
    deadline = time.time() + 20
    while not obs.got and time.time() < deadline:
        time.sleep(0.02)
    mgr.stop_receive_message()
    sender.stop_receive_message()
    th.join(10)
    print("GOT", obs.got, "PWNED", os.path.exists(marker), flush=True)
''')


def test_running_receiver_refuses_a_malicious_pickle_and_keeps_serving(tmp_path, tmp_home, procs):
    ports = free_ports(2)
    csv = tmp_path / "ip.csv"
    csv.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" +
                   "".join(f"{r},{r},127.0.0.1,{p}\n" for r, p in enumerate(ports)))
    script = tmp_path / "receiver.py"
    script.write_text(RECEIVER)
    marker = tmp_path / "pwned"
    p = procs.start([PYTHON, script, csv, ports[1], marker], child_env(tmp_home))
    rc = p.wait(timeout=120)
    out = p.output()
    assert rc == 0, out[-4000:]
    assert "GOT [('ping', 'hello')] PWNED False" in out, out[-4000:]
    assert not marker.exists()
    refused = [line for line in out.splitlines() if "refused a message from" in line]
    assert len(refused) == 3, out[-4000:]
    assert "names posix.system" in refused[0] or "names os.system" in refused[0], refused[0]
    assert "claims client_0" in refused[0] and "127.0.0.1" in refused[0], refused[0]


def test_planted_files_are_refused_without_running(tmp_path):
    """Saved uploads, resume checkpoints, pretrained_path and global models load with weights_only."""
    from fedml_fedmitr.core.checkpoint import load_if_exists
    from fedml_fedmitr.core.models import ModelError, load_global_model, load_pretrained_file
    from fedml_fedmitr.fedml_adapter.state import StateError, load_uploads

    from helpers_core import tiny_vit

    marker = tmp_path / "pwned"
    planted = tmp_path / "planted.pt"
    torch.save({"version": 1, "uploads": [_Evil(marker)], "state_dict": _Evil(marker), "meta": _Evil(marker)},
               str(planted))
    with pytest.raises(StateError, match="cannot be read"):
        load_uploads(planted)
    with pytest.raises(ValueError, match="planted.pt' cannot be read as weights only"):
        load_if_exists(planted)
    with pytest.raises(ModelError, match="cannot be read as weights only"):
        load_pretrained_file(tiny_vit(), planted)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_global_model(planted)
    assert not marker.exists()


AUTH_RECEIVER = textwrap.dedent(r'''
    import pickle, sys, time, threading, logging, os
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_comm_manager_pb2_grpc
    from fedml.core.distributed.communication.grpc.grpc_comm_manager import GRPCCommManager
    from fedml.core.distributed.communication.message import Message
    from fedml_fedmitr.fedml_adapter import fedml_patches
    from fedml_fedmitr.fedml_adapter.grpc_security import GrpcSecurity, security_from

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    csv, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    section = {"auth_token": "a-shared-secret-of-some-length"}
    if mode == "tls":
        section.update(tls_cert_file=sys.argv[4], tls_key_file=sys.argv[5], tls_ca_file=sys.argv[4])
    fedml_patches.fix_receive_loops("GRPC", security_from(section))

    class Observer:
        def __init__(self):
            self.got = []
        def receive_message(self, msg_type, msg):
            self.got.append((msg_type, msg.get("payload")))

    mgr = GRPCCommManager(csv, client_rank=1, client_num=2)
    obs = Observer()
    mgr.add_observer(obs)
    th = threading.Thread(target=mgr.message_handling_subroutine)
    th.start()
    forged = Message("ping", 0, 1)
    forged.add_params("payload", "forged")
    for k, v in (("sender_rank", 0), ("sender_ip", "127.0.0.1"), ("sender_port", 1)):
        forged.add_params(k, v)
    body = pickle.dumps(forged)
    wrong = GrpcSecurity(token=b"another-secret-of-some-length").sign(body)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")   # a party without the secret (plain TCP)
    stub = grpc_comm_manager_pb2_grpc.gRPCCommManagerStub(channel)
    for payload in (body, wrong):
        try:
            stub.sendMessage(grpc_comm_manager_pb2.CommRequest(client_id=0, message=payload), timeout=5)
            print("PLAINTEXT_ACCEPTED", flush=True)
        except grpc.RpcError as exc:
            print("PLAINTEXT_REFUSED", exc.code(), flush=True)
    sender = GRPCCommManager(csv, client_rank=0, client_num=2)   # the honest party: same settings
    msg = Message("ping", 0, 1)
    msg.add_params("payload", "hello")
    sender.send_message(msg)
    deadline = time.time() + 20
    while not obs.got and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)
    mgr.stop_receive_message()
    sender.stop_receive_message()
    th.join(10)
    print("GOT", obs.got, flush=True)
''')


def _ipconfig(tmp_path):
    ports = free_ports(2)
    csv = tmp_path / "ip.csv"
    csv.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" +
                   "".join(f"{r},{r},127.0.0.1,{p}\n" for r, p in enumerate(ports)))
    return csv, ports


def test_with_an_auth_token_unsigned_and_wrongly_signed_messages_are_dropped(tmp_path, tmp_home, procs):
    csv, ports = _ipconfig(tmp_path)
    script = tmp_path / "receiver.py"
    script.write_text(AUTH_RECEIVER)
    p = procs.start([PYTHON, script, csv, ports[1], "token"], child_env(tmp_home))
    assert p.wait(timeout=120) == 0, p.output()[-4000:]
    out = p.output()
    assert "GOT [('ping', 'hello')]" in out, out[-4000:]   # the forged ones never reached the observer
    refused = [line for line in out.splitlines() if "refused a message from" in line]
    assert len(refused) == 2, out[-4000:]
    assert "carries no authentication tag" in refused[0] and "authentication tag is wrong" in refused[1]


def _self_signed(tmp_path):
    import shutil
    import subprocess
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_with_tls_a_plaintext_party_cannot_deliver_and_tls_parties_talk(tmp_path, tmp_home, procs):
    cert, key = _self_signed(tmp_path)
    csv, ports = _ipconfig(tmp_path)
    script = tmp_path / "receiver.py"
    script.write_text(AUTH_RECEIVER)
    p = procs.start([PYTHON, script, csv, ports[1], "tls", cert, key], child_env(tmp_home))
    assert p.wait(timeout=120) == 0, p.output()[-4000:]
    out = p.output()
    assert out.count("PLAINTEXT_REFUSED") == 2 and "PLAINTEXT_ACCEPTED" not in out, out[-4000:]
    assert "GOT [('ping', 'hello')]" in out, out[-4000:]


def test_running_federation_with_auth_token_refuses_an_attack_and_finishes(tmp_path, tmp_home, procs):
    """A cross-silo server (auth token from the environment) gets a code-running pickle and a forged
    unsigned message while it waits for its clients: both refused unexecuted, the run finishes."""
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_comm_manager_pb2_grpc

    from conftest import consecutive_free_ports, read_summary, tiny_config, wait_for, write_yaml

    base = consecutive_free_ports(3)
    csv = tmp_path / "ip.csv"
    csv.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" +
                   "".join(f"{r},{r},127.0.0.1,{base + r}\n" for r in range(3)))
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "cs.yaml", tiny_config(
        out, common_args={"training_type": "cross_silo", "scenario": "horizontal", "torch_num_threads": 1},
        comm_args={"backend": "GRPC", "grpc_ipconfig_path": str(csv)}, device_args={"worker_num": 2},
        train_args={"epochs": 2}))
    env = child_env(tmp_home, FEDMITR_AUTH_TOKEN="a-shared-secret-of-some-length")

    def party(rank):
        role = "server" if rank == 0 else "client"
        return procs.start([PYTHON, "-m", "fedml_fedmitr", "--cf", cfg, "--rank", rank, "--role", role, "--run_id",
                            "1"], env, log_path=tmp_path / f"{role}_{rank}.log")

    server = party(0)
    wait_for(lambda: "Started gRPC server" in server.output(), 120, 0.2, "the GRPC server", [server])
    marker = tmp_path / "pwned"
    stub = grpc_comm_manager_pb2_grpc.gRPCCommManagerStub(grpc.insecure_channel(f"127.0.0.1:{base}"))
    from fedml.core.distributed.communication.message import Message
    forged = Message("ping", 1, 0)
    for payload in (pickle.dumps(_Evil(marker)), pickle.dumps(forged)):
        stub.sendMessage(grpc_comm_manager_pb2.CommRequest(client_id=1, message=payload), timeout=10)
    clients = [party(1), party(2)]
    assert server.wait(timeout=300) == 0, server.output()[-6000:]
    for c in clients:
        assert c.wait(timeout=120) == 0, c.output()[-4000:]
    log = server.output()
    refused = [line for line in log.splitlines() if "refused a message from" in line]
    assert len(refused) == 2 and all("no authentication tag" in line for line in refused), log[-4000:]
    assert not marker.exists()
    assert read_summary(out)["client_num"] == 2
