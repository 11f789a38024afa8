"""Targeted fixes of FedML 0.9.6's receive loops (applied by the plugin's runner only).

GRPC busy-spin: ``GRPCCommManager.message_handling_subroutine`` loops on
``while self.is_running: if message_q.qsize() > 0: ...`` with its ``time.sleep`` *outside* the
loop, so every idle party (a client waiting for the global model, the server waiting for
uploads) burns a full core. On a small machine the idle clients starve the server's long
one-shot ``aggregate()``. :func:`apply_grpc_fix` replaces that one method with a blocking
``queue.get(timeout=...)`` loop that handles messages as FedML does (same sender-address
bookkeeping, same observer calls, same lock), with one difference: FedML calls ``pickle.loads``
on whatever reaches the port, which runs any code a crafted message carries. The loop here reads
messages with :func:`fedml_fedmitr.fedml_adapter.safe_pickle.safe_loads` (FedML's message types
only); a refused or malformed message is dropped with one logged line naming the peer that sent
it, and the loop goes on. To name that peer, the servicer's ``sendMessage`` is patched to queue
the gRPC peer address with the bytes.

MPI: ``MpiCommunicationManager.handle_receive_message`` polls its queue every 0.1 ms, and its
``_free_q`` calls ``q.get_no_wait()`` (a typo: ``AttributeError`` if a message is still queued
at shutdown). :func:`apply_mpi_fix` gives the loop a blocking get and fixes the typo.

Both patches are idempotent and change only those methods.
"""
from __future__ import annotations

import logging
import queue
import time

from . import grpc_security
from .safe_pickle import RefusedMessage, safe_loads

log = logging.getLogger("fedml_fedmitr")

POLL_S = 0.05  # how often a blocked loop re-checks its stop flag


def _grpc_message_handling_subroutine(self):
    from fedml.core.distributed.communication.grpc import grpc_comm_manager as gcm
    from fedml.core.mlops.mlops_profiler_event import MLOpsProfilerEvent

    start_listening_time = time.time()
    MLOpsProfilerEvent.log_to_wandb({"ListenStart": start_listening_time})
    message_q = self.grpc_servicer.message_q
    while self.is_running:
        try:
            item = message_q.get(timeout=POLL_S)
        except queue.Empty:
            continue
        peer, msg_pkl = item if isinstance(item, tuple) else ("this process", item)
        try:
            msg = safe_loads(grpc_security.active().verify(msg_pkl))
            if not hasattr(msg, "get_type") or not hasattr(msg, "get_params"):
                raise RefusedMessage(f"it holds a {type(msg).__name__}, not a FedML Message")
            msg_type = msg.get_type()
            sender_id = int(msg.get_sender_id())
            _check_sender_host(self, sender_id, peer)
            mapping = None
            if sender_id not in self.grpc_mappings:
                params = msg.get_params()
                sender_ip = str(params[gcm.GRPCCommManager.MSG_ARG_KEY_SENDER_IP])
                mapping = gcm.GRPCMapping(
                    eid=sender_id,
                    rank=int(params[gcm.GRPCCommManager.MSG_ARG_KEY_SENDER_RANK]),
                    grpc_server_ip=sender_ip,
                    grpc_server_port=int(params[gcm.GRPCCommManager.MSG_ARG_KEY_SENDER_PORT]),
                    ingress_ip=sender_ip)
        except (RefusedMessage, KeyError, TypeError, ValueError) as exc:
            log.warning("refused a message from %s: %s", peer, exc)
            continue
        gcm.lock.acquire()
        try:
            busy_time_start_time = time.time()
            if mapping is not None:
                self.grpc_mappings[sender_id] = mapping
            for observer in list(self._observers):
                observer.receive_message(msg_type, msg)
            MLOpsProfilerEvent.log_to_wandb({"BusyTime": time.time() - busy_time_start_time})
        finally:
            gcm.lock.release()
    MLOpsProfilerEvent.log_to_wandb({"TotalTime": time.time() - start_listening_time})


_grpc_message_handling_subroutine.__fedmitr_fix__ = True


def _check_sender_host(manager, sender_id: int, peer: str) -> None:
    """A rank speaks from one host: a message claiming a rank first heard from another host is refused
    (a second party started with the same rank, or an impostor). Two parties of the same rank on one
    host cannot both listen on its port: the preflight finds that (config.check_grpc_endpoint)."""
    if not peer.startswith(("ipv4:", "ipv6:")):
        return   # this process's own loop
    host = peer.split(" ")[0].rsplit(":", 1)[0]
    hosts = manager.__dict__.setdefault("_fedmitr_sender_hosts", {})
    first = hosts.setdefault(sender_id, host)
    if first != host:
        raise RefusedMessage(f"rank {sender_id} is already connected from {first}")


def _grpc_send_message(self, request, context):
    """FedML's servicer ``sendMessage``, queueing (peer address, bytes) instead of the bytes."""
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2, grpc_server

    peer = f"{context.peer()} (claims client_{request.client_id})"
    with grpc_server.lock:
        self.message_q.put((peer, request.message))
    return grpc_comm_manager_pb2.CommResponse()


_grpc_send_message.__fedmitr_fix__ = True


def apply_grpc_fix() -> None:
    from fedml.core.distributed.communication.grpc.grpc_comm_manager import GRPCCommManager
    from fedml.core.distributed.communication.grpc.grpc_server import GRPCCOMMServicer

    if not getattr(GRPCCommManager.message_handling_subroutine, "__fedmitr_fix__", False):
        GRPCCommManager.__fedmitr_original_subroutine__ = GRPCCommManager.message_handling_subroutine
        GRPCCommManager.message_handling_subroutine = _grpc_message_handling_subroutine
        GRPCCOMMServicer.__fedmitr_original_send__ = GRPCCOMMServicer.sendMessage
        GRPCCOMMServicer.sendMessage = _grpc_send_message
        log.debug("fedml_fedmitr: GRPC receive loop now blocks instead of spinning and refuses foreign pickles")


def remove_grpc_fix() -> None:
    """Restore FedML's original GRPC loop (for tests that demonstrate the bug)."""
    from fedml.core.distributed.communication.grpc.grpc_comm_manager import GRPCCommManager
    from fedml.core.distributed.communication.grpc.grpc_server import GRPCCOMMServicer

    original = GRPCCommManager.__dict__.get("__fedmitr_original_subroutine__")
    if original is not None:
        GRPCCommManager.message_handling_subroutine = original
    send = GRPCCOMMServicer.__dict__.get("__fedmitr_original_send__")
    if send is not None:
        GRPCCOMMServicer.sendMessage = send


def _mpi_handle_receive_message(self):
    from fedml.core.mlops.mlops_profiler_event import MLOpsProfilerEvent

    self._notify_connection_ready()
    start_listening_time = time.time()
    MLOpsProfilerEvent.log_to_wandb({"ListenStart": start_listening_time})
    while not self._stop_running:
        try:
            msg_params = self.q_receiver.get(timeout=POLL_S)
        except queue.Empty:
            continue
        message_handler_start_time = time.time()
        self.notify(msg_params)
        MLOpsProfilerEvent.log_to_wandb({"BusyTime": time.time() - message_handler_start_time})
    MLOpsProfilerEvent.log_to_wandb({"TotalTime": time.time() - start_listening_time})
    logging.info("Handle receive message stopped!")


_mpi_handle_receive_message.__fedmitr_fix__ = True


def _mpi_free_q(self, q):
    if q is None:
        return
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
        q.task_done()


_mpi_free_q.__fedmitr_fix__ = True


def apply_mpi_fix() -> None:
    from fedml.core.distributed.communication.mpi.com_manager import MpiCommunicationManager

    if not getattr(MpiCommunicationManager.handle_receive_message, "__fedmitr_fix__", False):
        MpiCommunicationManager.handle_receive_message = _mpi_handle_receive_message
        MpiCommunicationManager._free_q = _mpi_free_q
        log.debug("fedml_fedmitr: MPI receive loop now blocks instead of polling")


def apply_all(backend: str, security: "grpc_security.GrpcSecurity" = None) -> None:
    if backend == "GRPC":
        apply_grpc_fix()
        grpc_security.install(security or grpc_security.GrpcSecurity())
    elif backend == "MPI":
        apply_mpi_fix()
