"""FedML's cross-silo server and client managers, made to survive clients that fail.

FedML's ``FedMLServerManager`` waits forever: for every client to come online, then for every
upload, then for every client's FINISHED status. :class:`FedMITRServerManager` (a subclass; nothing
inside FedML is patched) adds, with ``fedmitr_args.client_timeout_s`` > 0:

* a deadline for the client processes to connect, ``client_timeout_s`` after the first one connected
  (or ``NO_CLIENT_FACTOR`` x ``client_timeout_s`` after the server started, if none does), then one
  for every upload, ``client_timeout_s`` after the server sent the initial model (so slow start-ups
  do not eat into training time). The timer thread only puts a message into the backend's receive queue
  (GRPC and MPI backends), so everything runs on FedML's own message loop, one message at a time;
* at a deadline, if the uploads (clients, not processes) that arrived number at least
  ``fedmitr_args.min_clients``, the server proceeds with them: the missing clients are recorded
  (``clients_missing`` in ``summary.json`` and in ``state/uploads.pt``), only the clients that
  uploaded get the global model, and the server waits only for their FINISHED. A client that
  uploads after the deadline, or connects after the server started without it, is told to stop;
* otherwise it saves the uploads it has, tells the clients that did upload that the run failed, and
  raises :class:`~.errors.ClientFailure` naming the missing clients (exit status 2, ``error.json``);
* the clients that got the global model have ``client_timeout_s`` to confirm (FINISHED); the server
  then finishes anyway (its results are written by then);
* under MPI a hung rank can only be ended by ending the job: once the live clients have finished,
  the server aborts the MPI job with status 0 (its results are already written).

An error inside aggregation (an upload of another architecture, NaN/Inf weights, ...) is also
reported to the clients that uploaded before it propagates, so no live client waits forever.
:class:`FedMITRClientManager` ends a client process that the server stopped, with the server's
reason (:class:`~.errors.ServerStopped`, exit status 2). With the GRPC backend it also watches the
server once it has uploaded: a thread tries a TCP connection to the server's port every few seconds,
and when the port has refused (or timed out) for ``fedmitr_args.server_lost_s`` (default 300 s;
0: never) the client ends the same way, saying the server is gone, instead of waiting for a global
model that will never come (FedML's client waits forever). A server that is alive but busy (hours
of synthesis) keeps its port open, so a long server job is never mistaken for a dead one.

With ``client_timeout_s: 0`` (the default) there are no deadlines: the server waits like FedML.
"""
from __future__ import annotations

import logging
import pickle
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence

from fedml.core.distributed.communication.message import Message
from fedml.cross_silo.client.fedml_client_master_manager import ClientMasterManager
from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager
from fedml.cross_silo.server.message_define import MyMessage

from .errors import ClientFailure, ServerStopped, one_line
from .process_end import abort_mpi_job

log = logging.getLogger("fedml_fedmitr")

TIMEOUT_MSG = "fedmitr_deadline"
SERVER_LOST_MSG = "fedmitr_server_lost"
SERVER_CHECK_EVERY_S = 5.0   # at most; shorter for a short server_lost_s
ERROR_KEY = "fedmitr_stop_reason"
TIMEOUT_BACKENDS = ("GRPC", "MPI")
NO_CLIENT_FACTOR = 10  # with no client connected at all, the server gives up after 10 x client_timeout_s


def deliver_to_own_loop(com_manager, backend: str, msg: Message) -> None:
    """Put ``msg`` into this process's own receive queue, so FedML's message loop handles it like a
    received message (GRPC and MPI backends); used by the timer and watcher threads, which never act
    themselves. Raises if the loop is gone."""
    if backend == "GRPC":
        com_manager.grpc_servicer.message_q.put(pickle.dumps(msg))
    elif backend == "MPI":
        com_manager.q_receiver.put(msg)


def _clients_text(ids: Sequence[int]) -> str:
    return ", ".join(str(int(i)) for i in ids) if ids else "none"


class FedMITRServerManager(FedMLServerManager):
    def __init__(self, args, aggregator, comm=None, rank=0, size=0, backend="GRPC",
                 clients_of_rank: Optional[Dict[int, List[int]]] = None, timeout_s: float = 0.0,
                 min_clients: int = 1):
        super().__init__(args, aggregator, comm, rank, size, backend)
        self.clients_of_rank = {int(r): list(c) for r, c in (clients_of_rank or {}).items()}
        for r in self.client_real_ids:
            self.clients_of_rank.setdefault(int(r), [int(r) - 1])
        self.timeout_s = float(timeout_s or 0.0)
        if self.timeout_s > 0 and backend not in TIMEOUT_BACKENDS:
            log.warning("server: client_timeout_s is supported with the %s backends only; %s waits for every "
                        "client", " and ".join(TIMEOUT_BACKENDS), backend)
            self.timeout_s = 0.0
        self.min_clients = int(min_clients)
        self.phase = "connect"          # -> "train" once the initial model went out -> "done"
        self.live_ranks: List[int] = [int(r) for r in self.client_real_ids]
        self.missing_ranks: List[int] = []
        self.silo_of: Dict[int, int] = {}
        self._timer: Optional[threading.Timer] = None
        self._timer_seq = 0

    # ---- deadlines ----
    def run(self):
        self._arm("connect", NO_CLIENT_FACTOR * self.timeout_s)
        try:
            super().run()
        finally:
            self._disarm()

    def _arm(self, phase: str, seconds: Optional[float] = None) -> None:
        self._disarm()
        if self.timeout_s <= 0:
            return
        seconds = self.timeout_s if seconds is None else seconds
        self._timer_seq += 1
        self._timer = threading.Timer(seconds, self._inject_deadline, args=(phase, self._timer_seq))
        self._timer.daemon = True
        self._timer.start()
        log.info("server: waiting up to %.0f s for the clients to %s", seconds,
                 {"connect": "connect", "train": "upload"}.get(phase, "confirm"))

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _inject_deadline(self, phase: str, seq: int) -> None:
        """Timer thread: hand the deadline to the message loop (never act here)."""
        msg = Message(TIMEOUT_MSG, self.rank, self.rank)
        msg.add_params("phase", phase)
        msg.add_params("seq", seq)
        try:
            deliver_to_own_loop(self.com_manager, self.backend, msg)
        except Exception:  # the loop is gone: nothing left to time out
            log.debug("server: could not deliver the deadline", exc_info=True)

    def register_message_receive_handlers(self):
        super().register_message_receive_handlers()
        self.register_message_receive_handler(TIMEOUT_MSG, self.handle_deadline)

    # ---- FedML handlers ----
    def handle_message_connection_ready(self, msg_params):
        super().handle_message_connection_ready(msg_params)
        if not self.silo_of and self.client_id_list_in_this_round is not None:
            self.silo_of = {int(r): int(s) for r, s in zip(self.client_id_list_in_this_round,
                                                          self.data_silo_index_list)}

    def process_online_status(self, client_status, msg_params):
        sender = int(msg_params.get_sender_id())
        first = self.phase == "connect" and not any(self.client_online_mapping.values())
        if self.phase != "connect":
            self.client_online_mapping[str(sender)] = True
            if sender in self.missing_ranks:
                self._stop_client(sender, "the server started without this client (it connected after "
                                          "fedmitr_args.client_timeout_s)")
            return  # FedML would send the initial model again to everyone
        super().process_online_status(client_status, msg_params)
        if self.is_initialized:
            self.phase = "train"
            self._arm("train")
        elif first:  # the clock for the others starts with the first client
            self._arm("connect")

    def handle_message_receive_model_from_client(self, msg_params):
        sender = int(msg_params.get(MyMessage.MSG_ARG_KEY_SENDER))
        if self.phase == "done" or sender not in self.live_ranks:
            log.warning("server: client process %d uploaded after the server proceeded without it; ignored", sender)
            self._stop_client(sender, "its upload came after fedmitr_args.client_timeout_s; the server "
                                      "proceeded without it")
            return
        self.aggregator.add_local_trained_result(self.client_real_ids.index(sender),
                                                 msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS),
                                                 msg_params.get(MyMessage.MSG_ARG_KEY_NUM_SAMPLES))
        if all(self._uploaded(r) for r in self.live_ranks):
            self._aggregate_and_sync()

    def handle_deadline(self, msg_params):
        phase, seq = msg_params.get("phase"), msg_params.get("seq")
        if seq != self._timer_seq:
            return  # an old deadline
        if phase == "finish" and self.phase == "done":
            waiting = [r for r in self.client_id_list_in_this_round
                       if not self.client_finished_mapping.get(str(r), False)]
            log.warning("server: client process(es) %s did not confirm the global model within %.0f s; finishing",
                        _clients_text(waiting), self.timeout_s)
            self.missing_ranks += [r for r in waiting if r not in self.missing_ranks]
            self.finish()
            return
        if phase != self.phase:
            return
        total = len(self.client_real_ids)
        if phase == "connect":
            online = [r for r in self.live_ranks if self.client_online_mapping.get(str(r), False)]
            offline = [r for r in self.live_ranks if r not in online]
            missing = self._clients_of(offline)
            if self._count(online) < self.min_clients:
                waited = (f"within fedmitr_args.client_timeout_s = {self.timeout_s:g} s of the first connection" if online else
                          f"within {NO_CLIENT_FACTOR} x fedmitr_args.client_timeout_s = "
                          f"{NO_CLIENT_FACTOR * self.timeout_s:g} s of the server's start")
                self._fail(f"only {len(online)} of {total} client processes connected {waited} (clients "
                           f"{_clients_text(missing)} never connected); fewer than fedmitr_args.min_clients = "
                           f"{self.min_clients} clients", missing, notify=online)
            log.warning("server: clients %s never connected within %.0f s; starting with the other %d",
                        _clients_text(missing), self.timeout_s, self._count(online))
            self.missing_ranks += offline
            self.live_ranks = online
            self.client_id_list_in_this_round = list(online)
            self.data_silo_index_list = [self.silo_of.get(r, r - 1) for r in online]
            self.send_init_msg()
            self.is_initialized = True
            self.phase = "train"
            self._arm("train")
        elif phase == "train":
            arrived = [r for r in self.live_ranks if self._uploaded(r)]
            late = [r for r in self.live_ranks if r not in arrived]
            missing = self._clients_of(self.missing_ranks + late)
            if self._count(arrived) < self.min_clients:
                self._fail(f"only {self._count(arrived)} of {self._count(self.client_real_ids)} clients uploaded "
                           f"within fedmitr_args.client_timeout_s = {self.timeout_s:g} s (missing clients "
                           f"{_clients_text(missing)}); fedmitr_args.min_clients = {self.min_clients}", missing,
                           arrived)
            log.warning("server: clients %s did not upload within %.0f s; proceeding with the %d clients that did",
                        _clients_text(self._clients_of(late)), self.timeout_s, self._count(arrived))
            self.missing_ranks += late
            self.live_ranks = arrived
            self._aggregate_and_sync()

    # ---- aggregation with the clients that are in ----
    def _uploaded(self, rank: int) -> bool:
        return bool(self.aggregator.flag_client_model_uploaded_dict.get(self.client_real_ids.index(rank), False))

    def _count(self, ranks) -> int:
        return len(self._clients_of(ranks))

    def _clients_of(self, ranks) -> List[int]:
        return sorted(c for r in ranks for c in self.clients_of_rank.get(int(r), []))

    def _model_list(self, ranks):
        idx = [self.client_real_ids.index(r) for r in ranks]
        return [(self.aggregator.sample_num_dict[i], self.aggregator.model_dict[i]) for i in idx]

    def _aggregate_and_sync(self) -> None:
        self._disarm()
        self.phase = "done"
        live = list(self.live_ranks)
        agg = self.aggregator.aggregator
        if hasattr(agg, "missing_clients"):
            agg.missing_clients = self._clients_of(self.missing_ranks)
        try:
            model_list, _ = agg.on_before_aggregation(self._model_list(live))
            params = agg.aggregate(model_list)
            params = agg.on_after_aggregation(params)
            self.aggregator.set_global_model_params(params)
            self.aggregator.test_on_server_for_all_clients(self.args.round_idx)
        except BaseException as exc:
            self._stop_clients(live, f"the server failed: {one_line(exc)}")
            raise
        # only the clients that uploaded get the model; FedML then waits for their FINISHED alone
        self.client_id_list_in_this_round = live
        self.data_silo_index_list = [self.silo_of.get(r, r - 1) for r in live]
        for r in live:
            self.send_message_sync_model_to_client(r, params, self.silo_of.get(r, r - 1))
        self.args.round_idx += 1
        self._arm("finish")

    def _fail(self, message: str, missing_clients: Sequence[int], arrived: Sequence[int] = (),
              notify: Optional[Sequence[int]] = None) -> None:
        self._disarm()
        self.phase = "done"
        agg = self.aggregator.aggregator
        if arrived and hasattr(agg, "save_received"):
            try:  # keep what arrived: python -m fedml_fedmitr.server_only can use it (min_clients permitting)
                agg.uploads_from(self._model_list(arrived))
                agg.missing_clients = list(missing_clients)
                agg.save_received()
                message += f"; the upload(s) that arrived ({self._count(arrived)}) are saved in {agg.uploads_file}"
            except Exception as exc:
                log.warning("server: could not save the uploads that arrived: %s", exc)
        exc = ClientFailure(message, details={"clients_missing": [int(c) for c in missing_clients],
                                              "clients_arrived": self._clients_of(arrived)})
        self._stop_clients(list(arrived if notify is None else notify), f"the server stopped the run: {message}")
        raise exc

    def _stop_clients(self, ranks: Sequence[int], reason: str) -> None:
        for r in ranks:
            self._stop_client(r, reason)
        if self.backend != "MPI":  # MPI: the process's error handler aborts the job
            try:
                self.com_manager.stop_receive_message()
            except Exception:
                pass

    def _stop_client(self, rank: int, reason: str) -> None:
        try:
            message = Message(MyMessage.MSG_TYPE_S2C_FINISH, self.get_sender_id(), int(rank))
            message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_INDEX, str(self.silo_of.get(int(rank), int(rank) - 1)))
            message.add_params(ERROR_KEY, reason)
            self.send_message(message)
        except Exception as exc:  # it may be gone
            log.warning("server: could not tell client process %d to stop: %s", rank, exc)

    def finish(self):
        self._disarm()
        if self.backend == "MPI" and self.missing_ranks:
            # a hung rank never finishes and mpirun waits for every rank: end the job (results are written)
            log.warning("server: done; ending the MPI job, whose client process(es) %s never uploaded",
                        _clients_text(self.missing_ranks))
            abort_mpi_job(0, self.comm)
        super().finish()


def _server_address(com_manager) -> Optional[tuple]:
    """(host, port) of rank 0's GRPC server, as FedML's GRPC comm manager addresses it."""
    try:
        m = com_manager.grpc_mappings[0]
    except Exception:
        return None
    return (m.ingress_ip or m.grpc_server_ip, int(m.grpc_server_port))


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
        address = _server_address(self.com_manager)
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


def run_server(args, device, comm, rank, worker_num, model, train_data_num, train_data_global, test_data_global,
               train_data_local_dict, test_data_local_dict, train_data_local_num_dict, server_aggregator,
               clients_of_rank, timeout_s: float, min_clients: int) -> FedMITRServerManager:
    """FedML's ``init_server`` with :class:`FedMITRServerManager`."""
    from fedml.cross_silo.server.fedml_aggregator import FedMLAggregator

    server_aggregator.set_id(0)
    aggregator = FedMLAggregator(train_data_global, test_data_global, train_data_num, train_data_local_dict,
                                 test_data_local_dict, train_data_local_num_dict, worker_num, device, args,
                                 server_aggregator)
    manager = FedMITRServerManager(args, aggregator, comm, rank, worker_num, args.backend,
                                   clients_of_rank=clients_of_rank, timeout_s=timeout_s, min_clients=min_clients)
    manager.run()
    return manager


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
