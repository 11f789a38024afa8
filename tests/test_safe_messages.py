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

from conftest import PYTHON, child_env, free_ports
from fedml_fedmitr.fedml_adapter.safe_pickle import RefusedMessage, safe_loads


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
    from fedml_fedmitr.fedml_adapter import comm_fix

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    csv, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    comm_fix.apply_grpc_fix()

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
    with pytest.raises(Exception):
        load_global_model(planted)
    assert not marker.exists()
