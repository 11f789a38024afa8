"""FedML's cross-silo client manager, made to end when the server stops it or is gone.

:class:`FedMITRClientManager` (a subclass of FedML's ``ClientMasterManager``; nothing inside FedML
is patched) ends a client process that the server stopped, with the server's reason
(:class:`~.errors.ServerStopped`, exit status 2). With the GRPC backend it also watches the server
once it has uploaded: a thread tries a TCP connection to the server's port every few seconds, and
when the port has refused (or timed out) for ``fedmitr_args.server_lost_s`` (default 300 s; 0:
never) the client ends the same way, saying the server is gone, instead of waiting for a global
model that will never come (FedML's client waits forever). A server that is alive but busy (hours
of synthesis) keeps its port open, so a long server job is never mistaken for a dead one.
The server side is :mod:`.server_manager`.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Optional

from fedml.core.distributed.communication.message import Message
from fedml.cross_silo.client.fedml_client_master_manager import ClientMasterManager

from .errors import ServerStopped
from .fedml_patches import deliver_to_own_loop, grpc_server_address
from .server_manager import ERROR_KEY, SERVER_CHECK_EVERY_S, SERVER_LOST_MSG

log = logging.getLogger("fedml_fedmitr")


def port_answers(address: tuple, timeout_s: float) -> bool:
    """True if a TCP connection to ``address`` opens within ``timeout_s``."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


class FedMITRClientManager(ClientMasterManager):
    """FedML's client manager; a FINISH from the server with a reason ends it with that reason; with
    GRPC, a server whose port stays closed ``server_lost_s`` after the upload ends it too."""

    server_stop_reason: Optional[str] = None

    def __init__(self, args, trainer_dist_adapter, comm=None, rank=0, size=0, backend="MPI",
                 server_lost_s: float = 0.0):
        super().__init__(args, trainer_dist_adapter, comm, rank, size, backend)
        self.server_lost_s = float(server_lost_s or 0.0) if backend == "GRPC" else 0.0
        self._finished = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    def register_message_receive_handlers(self):
        super().register_message_receive_handlers()
        self.register_message_receive_handler(SERVER_LOST_MSG, self.handle_server_lost)

    def send_model_to_server(self, receive_id, weights, local_sample_num):
        super().send_model_to_server(receive_id, weights, local_sample_num)
        self._watch_server()

    def _watch_server(self) -> None:
        if self.server_lost_s <= 0 or self._watcher is not None:
            return
        address = grpc_server_address(self.com_manager)
        if address is None:
            return
        self._watcher = threading.Thread(target=self._watch, args=(address,), daemon=True,
                                         name="fedmitr-server-watch")
        self._watcher.start()

    def _watch(self, address: tuple) -> None:
        """Watcher thread: only hands "server lost" to the message loop (never acts here)."""
        every = max(0.5, min(SERVER_CHECK_EVERY_S, self.server_lost_s / 4))
        last_seen = time.monotonic()
        while not self._finished.wait(every):
            if port_answers(address, every):
                last_seen = time.monotonic()
                continue
            lost_for = time.monotonic() - last_seen
            if lost_for >= self.server_lost_s:
                msg = Message(SERVER_LOST_MSG, self.rank, self.rank)
                msg.add_params("address", f"{address[0]}:{address[1]}")
                msg.add_params("lost_s", lost_for)
                try:
                    deliver_to_own_loop(self.com_manager, self.backend, msg)
                except Exception:  # the loop is gone: nothing left to end
                    log.debug("client: could not deliver 'server lost'", exc_info=True)
                return

    def handle_server_lost(self, msg_params):
        if self._finished.is_set():
            return
        self.server_stop_reason = (
            f"the server at {msg_params.get('address')} has not answered for {float(msg_params.get('lost_s')):.0f} s "
            f"after this client's upload (fedmitr_args.server_lost_s = {self.server_lost_s:g}): it is gone and "
            "no global model will come. Restarted with fedmitr_args.resume: true it continues from its saved "
            "uploads without the clients")
        log.error("client process %s: %s", self.rank, self.server_stop_reason)
        self.finish()

    def finish(self):
        self._finished.set()
        super().finish()

    def handle_message_finish(self, msg_params):
        reason = msg_params.get(ERROR_KEY)
        if reason is None:
            return super().handle_message_finish(msg_params)
        self.server_stop_reason = str(reason)
        log.error("client process %s: stopped by the server: %s", self.rank, reason)
        self.finish()


def run_client(args, device, comm, rank, worker_num, model, train_data_num, train_data_local_num_dict,
               train_data_local_dict, test_data_local_dict, trainer,
               server_lost_s: float = 0.0) -> FedMITRClientManager:
    """FedML's ``init_client`` (horizontal scenario) with :class:`FedMITRClientManager`."""
    from fedml.cross_silo.client.client_initializer import get_trainer_dist_adapter

    adapter = get_trainer_dist_adapter(args, device, rank, model, train_data_num, train_data_local_num_dict,
                                       train_data_local_dict, test_data_local_dict, trainer)
    manager = FedMITRClientManager(args, adapter, comm, rank, worker_num, args.backend, server_lost_s=server_lost_s)
    manager.run()
    if manager.server_stop_reason is not None:
        raise ServerStopped(f"client process {rank}: {manager.server_stop_reason}")
    return manager
