"""FedML's cross-silo server manager, made to survive clients that fail.

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
The client side (ended by the server's FINISH, or when the server is gone) is :mod:`.client_manager`.

With ``client_timeout_s: 0`` (the default) there are no deadlines: the server waits like FedML.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, List, Optional, Sequence

from fedml.core.distributed.communication.message import Message
from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager
from fedml.cross_silo.server.message_define import MyMessage

from .aggregator import finish_round
from .errors import ClientFailure, one_line
from .fedml_patches import deliver_to_own_loop
from .process_end import abort_mpi_job

log = logging.getLogger("fedml_fedmitr")

TIMEOUT_MSG = "fedmitr_deadline"
SERVER_LOST_MSG = "fedmitr_server_lost"
SERVER_CHECK_EVERY_S = 5.0   # at most; shorter for a short server_lost_s
ERROR_KEY = "fedmitr_stop_reason"
TIMEOUT_BACKENDS = ("GRPC", "MPI")
NO_CLIENT_FACTOR = 10  # with no client connected at all, the server gives up after 10 x client_timeout_s


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
            params = finish_round(agg, self._model_list(live),
                                  test=lambda: self.aggregator.test_on_server_for_all_clients(self.args.round_idx))
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
