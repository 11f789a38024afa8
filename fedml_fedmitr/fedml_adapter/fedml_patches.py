"""Every change the plugin makes to FedML 0.9.6, and every read of FedML's private attributes.

Nothing else in the package patches FedML or reaches into its internals. Each patch first checks
the installed FedML version (:func:`check_fedml_version`: another version stops with one line
naming the supported one) and is idempotent:

* **Runner dispatch, for a stock** ``main.py`` (:func:`register`, called by ``import fedml_fedmitr``
  once FedML is imported, or explicitly): ``FedMLRunner._init_simulation_runner`` and
  ``_init_cross_silo_runner`` route the plugin's ``federated_optimizer`` names to
  :class:`~.runner.FedMITRRunner` and every other name to FedML unchanged. The plugin's own CLI does
  not use it: it builds its runner directly.
* **Offline** ``fetch_config``: FedML's ``fedml.core.mlops.init`` always calls ``fetch_config``, which
  POSTs to FedML's cloud (no timeout, 5 tries) even with ``using_mlops: false``, and sets a few local
  ``args`` attributes later code reads. :func:`offline_fetch_config` sets the same attributes without
  the network, only for a run of one of the plugin's methods with ``using_mlops`` false; anything else
  gets FedML's own function. The CLI installs it only around its ``fedml.init``
  (:func:`offline_fetch_config_installed`); :func:`register` installs it for a stock ``main.py``.
* **Receive loops** (:func:`fix_receive_loops`, distributed runs only), each applied only where the
  bug is in FedML's code:

  - GRPC: ``GRPCCommManager.message_handling_subroutine`` busy-spins (``while self.is_running: if
    message_q.qsize() > 0``, its sleep outside the loop), so every idle party burns a core, and it
    calls ``pickle.loads`` on whatever reaches the port. The replacement blocks on
    ``queue.get(timeout=...)``, reads messages with
    :func:`~.safe_pickle.safe_loads` (FedML's message types only) after the HMAC check of
    :mod:`.grpc_security`, and drops a refused message with one line naming the peer (the servicer's
    ``sendMessage`` is patched to queue the peer address with the bytes). FedML's GRPC module is routed
    through :mod:`.grpc_security`'s facade (TLS, signing).
  - MPI: ``MpiCommunicationManager.handle_receive_message`` polls every 0.1 ms and ``_free_q`` calls
    the non-existent ``q.get_no_wait()``; the replacement blocks and fixes the call.
* **Private attributes**: :func:`deliver_to_own_loop` (a manager's receive queue) and
  :func:`grpc_server_address` (rank 0's address in a GRPC manager's mappings).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import platform
import queue
import time
from typing import Optional

from . import grpc_security
from .safe_pickle import RefusedMessage, safe_loads

log = logging.getLogger("fedml_fedmitr")

SUPPORTED_FEDML = ("0.9.6",)


def installed_fedml_version():
    """FedML's version from its package metadata (FedML is not imported); None if not installed."""
    from importlib import metadata
    try:
        return metadata.version("fedml")
    except metadata.PackageNotFoundError:
        return None


def check_fedml_version() -> None:
    """The plugin patches FedML 0.9.6's internals (runner dispatch, receive loops, fetch_config): with
    another version it stops with one line instead of patching code it does not know."""
    from .errors import UserError

    found = installed_fedml_version()
    if found not in SUPPORTED_FEDML:
        raise UserError(f"fedml_fedmitr supports FedML {', '.join(SUPPORTED_FEDML)}, found "
                        f"{found or 'no FedML'}: pip install fedml=={SUPPORTED_FEDML[-1]}")


# ---- runner dispatch (a stock main.py) ----
def is_plugin_method(name) -> bool:
    from ..core.methods import method_names
    return isinstance(name, str) and name in method_names()


def _wrap(original, mode: str):
    @functools.wraps(original)
    def init_runner(self, args, device, dataset, model, client_trainer=None, server_aggregator=None):
        if is_plugin_method(getattr(args, "federated_optimizer", None)):
            from .runner import FedMITRRunner
            return FedMITRRunner(args, device, dataset, model, client_trainer=client_trainer,
                                 server_aggregator=server_aggregator)
        return original(self, args, device, dataset, model, client_trainer, server_aggregator)

    init_runner.__fedmitr_original__ = original
    init_runner.__fedmitr_mode__ = mode
    return init_runner


_REGISTERED = False


def register() -> None:
    """Patch ``FedMLRunner``'s two dispatch methods and install the offline ``fetch_config`` (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    check_fedml_version()
    from fedml.runner import FedMLRunner

    for attr, mode in (("_init_simulation_runner", "simulation"), ("_init_cross_silo_runner", "cross_silo")):
        current = getattr(FedMLRunner, attr)
        if getattr(current, "__fedmitr_original__", None) is None:
            setattr(FedMLRunner, attr, _wrap(current, mode))
    install_offline_fetch_config()
    _REGISTERED = True
    log.debug("fedml_fedmitr registered with FedMLRunner")


def unregister() -> None:
    """Undo :func:`register` (for tests)."""
    global _REGISTERED
    from fedml.runner import FedMLRunner

    for attr in ("_init_simulation_runner", "_init_cross_silo_runner"):
        original = getattr(getattr(FedMLRunner, attr), "__fedmitr_original__", None)
        if original is not None:
            setattr(FedMLRunner, attr, original)
    uninstall_offline_fetch_config()
    _REGISTERED = False


# ---- offline fetch_config ----
_ORIGINAL_FETCH_CONFIG = None


def offline_fetch_config(args, version="release"):
    if getattr(args, "using_mlops", False) or not is_plugin_method(getattr(args, "federated_optimizer", None)):
        return _ORIGINAL_FETCH_CONFIG(args, version)
    from fedml.computing.scheduler.master.server_constants import ServerConstants
    from fedml.computing.scheduler.scheduler_core.account_manager import FedMLAccountManager
    from fedml.computing.scheduler.slave.client_constants import ClientConstants

    setattr(args, "current_running_dir", ClientConstants.get_fedml_home_dir())
    sys_name = platform.system()
    setattr(args, "os_name", "MacOS" if sys_name == "Darwin" else sys_name)
    setattr(args, "version", version)
    if int(getattr(args, "rank", 0) or 0) == 0:
        setattr(args, "log_file_dir", ServerConstants.get_log_file_dir())
        setattr(args, "device_id", FedMLAccountManager.get_device_id(ServerConstants.get_data_dir()))
    else:
        setattr(args, "log_file_dir", ClientConstants.get_log_file_dir())
        setattr(args, "device_id", FedMLAccountManager.get_device_id(ClientConstants.get_data_dir()))
    setattr(args, "config_version", version)
    setattr(args, "cloud_region", "")
    log.debug("fedml_fedmitr: using_mlops is false, skipped FedML's cloud fetch_config")
    return False


def install_offline_fetch_config() -> None:
    global _ORIGINAL_FETCH_CONFIG
    check_fedml_version()
    import fedml.core.mlops as mlops

    if getattr(mlops.fetch_config, "__fedmitr_offline__", False):
        return
    _ORIGINAL_FETCH_CONFIG = mlops.fetch_config
    offline_fetch_config.__fedmitr_offline__ = True
    mlops.fetch_config = offline_fetch_config


def uninstall_offline_fetch_config() -> None:
    import fedml.core.mlops as mlops

    if _ORIGINAL_FETCH_CONFIG is not None and getattr(mlops.fetch_config, "__fedmitr_offline__", False):
        mlops.fetch_config = _ORIGINAL_FETCH_CONFIG


@contextlib.contextmanager
def offline_fetch_config_installed():
    """The offline ``fetch_config`` while the block runs (the CLI's ``fedml.init``), FedML's own after,
    unless :func:`register` had installed it for the process already."""
    import fedml.core.mlops as mlops

    already = getattr(mlops.fetch_config, "__fedmitr_offline__", False)
    install_offline_fetch_config()
    try:
        yield
    finally:
        if not already:
            uninstall_offline_fetch_config()


# ---- receive loops ----
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


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def grpc_loop_needs_fix(original) -> bool:
    """FedML's GRPC loop spins on ``qsize()`` or unpickles unchecked bytes."""
    src = _source(original)
    return "qsize()" in src or "pickle.loads" in src


def mpi_loop_needs_fix(loop, free_q) -> bool:
    """FedML's MPI loop polls with a sleep, or its ``_free_q`` calls ``get_no_wait``."""
    return "time.sleep" in _source(loop) or "get_no_wait" in _source(free_q)


def fix_grpc_loop(security: Optional[grpc_security.GrpcSecurity] = None) -> None:
    check_fedml_version()
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager as gcm
    from fedml.core.distributed.communication.grpc.grpc_server import GRPCCOMMServicer

    manager = gcm.GRPCCommManager
    if not getattr(manager.message_handling_subroutine, "__fedmitr_fix__", False):
        if grpc_loop_needs_fix(manager.message_handling_subroutine):
            manager.__fedmitr_original_subroutine__ = manager.message_handling_subroutine
            manager.message_handling_subroutine = _grpc_message_handling_subroutine
            GRPCCOMMServicer.__fedmitr_original_send__ = GRPCCOMMServicer.sendMessage
            GRPCCOMMServicer.sendMessage = _grpc_send_message
            log.debug("fedml_fedmitr: GRPC receive loop now blocks instead of spinning and refuses foreign pickles")
        else:
            log.debug("fedml_fedmitr: FedML's GRPC receive loop has neither the spin nor the unchecked unpickling")
    security = security or grpc_security.GrpcSecurity()
    grpc_security.set_active(security)
    real = gcm.grpc._grpc if isinstance(gcm.grpc, grpc_security.GrpcFacade) else grpc
    gcm.grpc = grpc_security.GrpcFacade(real, security)


def fix_mpi_loop() -> None:
    check_fedml_version()
    from fedml.core.distributed.communication.mpi.com_manager import MpiCommunicationManager as manager

    if getattr(manager.handle_receive_message, "__fedmitr_fix__", False):
        return
    if mpi_loop_needs_fix(manager.handle_receive_message, manager._free_q):
        manager.handle_receive_message = _mpi_handle_receive_message
        manager._free_q = _mpi_free_q
        log.debug("fedml_fedmitr: MPI receive loop now blocks instead of polling")


def fix_receive_loops(backend: str, security: Optional[grpc_security.GrpcSecurity] = None) -> None:
    """The receive-loop fixes for ``backend`` (GRPC or MPI; other backends are left as they are)."""
    if backend == "GRPC":
        fix_grpc_loop(security)
    elif backend == "MPI":
        fix_mpi_loop()


# ---- FedML's private attributes ----
def deliver_to_own_loop(com_manager, backend: str, msg) -> None:
    """Put ``msg`` into this process's own receive queue, so FedML's message loop handles it like a
    received message (GRPC and MPI backends); used by the timer and watcher threads, which never act
    themselves. Raises if the loop is gone."""
    import pickle

    if backend == "GRPC":
        com_manager.grpc_servicer.message_q.put(pickle.dumps(msg))
    elif backend == "MPI":
        com_manager.q_receiver.put(msg)


def grpc_server_address(com_manager) -> Optional[tuple]:
    """(host, port) of rank 0's GRPC server, as FedML's GRPC comm manager addresses it."""
    try:
        m = com_manager.grpc_mappings[0]
    except Exception:
        return None
    return (m.ingress_ip or m.grpc_server_ip, int(m.grpc_server_port))
