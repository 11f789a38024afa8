"""FedML's GRPC receive loop busy-spins; the plugin's fix blocks on the queue instead and still
delivers messages (real GRPC servers on loopback)."""
from __future__ import annotations

import textwrap

from conftest import PYTHON, child_env, free_ports

SCRIPT = textwrap.dedent(r'''
    import sys, threading, time
    from fedml.core.distributed.communication.grpc.grpc_comm_manager import GRPCCommManager
    from fedml.core.distributed.communication.message import Message
    from fedml_fedmitr.fedml_adapter import fedml_patches

    csv, seconds = sys.argv[1], float(sys.argv[2])

    class Observer:
        def __init__(self):
            self.got = []
        def receive_message(self, msg_type, msg):
            self.got.append((msg_type, msg.get("payload")))

    def idle_cpu(rank):
        mgr = GRPCCommManager(csv, client_rank=rank, client_num=2)
        obs = Observer()
        mgr.add_observer(obs)
        used = {}
        def loop():
            t0 = time.thread_time()
            mgr.message_handling_subroutine()
            used["cpu"] = time.thread_time() - t0
        th = threading.Thread(target=loop)
        th.start()
        time.sleep(seconds)
        # the loop still handles a real message from another party
        sender = GRPCCommManager(csv, client_rank=0, client_num=2)
        msg = Message("ping", 0, rank)
        msg.add_params("payload", "hello")
        sender.send_message(msg)
        deadline = time.time() + 10
        while not obs.got and time.time() < deadline:
            time.sleep(0.01)
        mgr.stop_receive_message()
        sender.stop_receive_message()
        th.join(10)
        assert obs.got == [("ping", "hello")], obs.got
        return used["cpu"]

    unfixed = idle_cpu(1)
    fedml_patches.fix_grpc_loop()
    fixed = idle_cpu(2)
    print(f"CPU {unfixed:.3f} {fixed:.3f}")
''')


def test_grpc_receive_loop_does_not_spin(tmp_path, tmp_home, procs):
    ports = free_ports(3)
    csv = tmp_path / "ip.csv"
    csv.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" +
                   "".join(f"{r},{r},127.0.0.1,{p}\n" for r, p in enumerate(ports)))
    script = tmp_path / "spin.py"
    script.write_text(SCRIPT)
    seconds = 1.5
    p = procs.start([PYTHON, script, csv, seconds], child_env(tmp_home))
    rc = p.wait(timeout=120)
    assert rc == 0, p.output()[-4000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("CPU ")][0]
    unfixed, fixed = (float(v) for v in line.split()[1:])
    # stock FedML: the idle loop burns (most of) a core; fixed: next to nothing
    assert fixed < 0.1 * seconds, (unfixed, fixed)
    assert unfixed > max(0.25 * seconds, 5 * fixed), (unfixed, fixed)
