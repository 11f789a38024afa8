"""The plugin's runner: one-shot FedMITR (or any method of ``method_names()``) on FedML.

``FedMITRRunner(args, device, dataset, model).run()`` is what ``FedMLRunner`` delegates to for the
plugin's names (see :mod:`.fedml_patches`), and what the plugin's CLI builds directly. By ``training_type`` / ``backend``:

* ``simulation`` + ``sp``: an in-process loop: every client trains with
  :class:`~.trainer.FedMITRClientTrainer` from the shared initial weights, then
  :class:`~.aggregator.FedMITRServerAggregator` aggregates (FedML's own single-process simulator
  ignores custom trainers, so it is not used).
* ``simulation`` + ``MPI`` (``mpirun -n W+1``): FedML's cross-silo server and client managers over
  the simulation's MPI communicator (FedML's MPI FedAvg ignores a custom ``aggregate()`` and hangs
  with ``comm_round: 1``). Rank 0 is the server; worker ``r`` (1..W) trains clients
  ``r-1, r-1+W, r-1+2W, ...`` of the ``client_num_in_total``, so a simulation can have more
  clients than processes; every client's upload reaches the server.
* ``cross_silo`` (GRPC, MPI, ... backends): FedML's cross-silo server / client (its FedAvg
  plumbing) with the plugin's trainer and aggregator; each silo trains its own client (or, with
  ``client_num_in_total`` > ``worker_num``, its share as above).

In the distributed modes, FedML's receive loops are fixed first (:mod:`.fedml_patches`) and the server
and clients run the plugin's subclasses of FedML's managers (:mod:`.server_manager`: a deadline
for clients that never upload, ``fedmitr_args.client_timeout_s`` / ``min_clients``).

Resuming (``fedmitr_args.resume: true``): once every upload arrived the server saves them to
``<output_dir>/state/uploads.pt`` (:mod:`.state`) before the long server work, and the method
checkpoints its own progress there. A resumed run that finds saved uploads needs no client: the
single-process simulation skips client training, an MPI run's server aggregates them alone while
the other ranks exit at once, and a cross-silo server started alone does the same (start no
clients). :mod:`fedml_fedmitr.server_only` reruns the server from saved uploads with any method.
"""
from __future__ import annotations

import json
import logging
import time
from typing import List, Optional

from ..core.config import ConfigError
from ..core.models import ModelError, check_vit
from .errors import ClientFailure, StateError

log = logging.getLogger("fedml_fedmitr")


def assigned_clients(rank: int, workers: int, num_clients: int) -> List[int]:
    """Client indices trained by worker ``rank`` (1-based) of ``workers``: a round-robin share."""
    return list(range(rank - 1, num_clients, workers))


def attach_plugin_logging(plog: Optional[logging.Logger] = None) -> None:
    """Send the plugin's (and the core's) log records to FedML's log handlers.

    FedML's ``init_logs`` replaces ``logging.root`` with its own logger; a logger created before
    that (as ``fedml_fedmitr`` is) would still point at the old, handler-less root. A second run in
    the same process (FedML set up its handlers again) moves the plugin to the new ones; handlers
    someone else gave the plugin's logger are left alone.
    """
    plog = plog or logging.getLogger("fedml_fedmitr")
    root = logging.root
    ours = getattr(plog, "_fedmitr_attached", [])
    if not root.handlers or (plog.handlers and not ours):
        return   # configured by someone else before the plugin ever attached: leave it
    for handler in ours:
        plog.removeHandler(handler)
    added = [h for h in root.handlers if h not in plog.handlers]
    for handler in added:
        plog.addHandler(handler)
    plog._fedmitr_attached = added
    plog.setLevel(root.level or logging.INFO)
    plog.propagate = False


class FedMITRRunner:
    def __init__(self, args, device, dataset, model, client_trainer=None, server_aggregator=None,
                 settings=None):
        """``settings``: the :class:`~.config.PluginSettings` the CLI validated; a stock ``main.py``
        passes none and they are read here, once."""
        from ..core.methods import method_names
        from .config import check_run_args, read_settings

        self.start_time = time.perf_counter()
        attach_plugin_logging()
        name = getattr(args, "federated_optimizer", None)
        if name not in method_names():
            raise ConfigError(f"federated_optimizer = {name!r} is not a one-shot method of fedml_fedmitr: "
                             f"expected one of {', '.join(method_names())}")
        # validate everything before any training starts
        if settings is not None:
            args.fedmitr_settings = settings
        self.settings = read_settings(args)
        self.fedmitr_config = self.settings.method
        self.run_control = self.settings.run
        check_run_args(args)
        args.comm_round = 1
        check_vit(model, getattr(args, "model", None) if isinstance(getattr(args, "model", None), str) else None)
        if not isinstance(dataset, (list, tuple)) or len(dataset) != 8:
            raise ConfigError("dataset must be FedML's 8-item list [train_data_num, test_data_num, "
                             "train_data_global, test_data_global, train_data_local_num_dict, "
                             "train_data_local_dict, test_data_local_dict, class_num]")
        from .aggregator import FedMITRServerAggregator
        from .trainer import FedMITRClientTrainer

        for given, cls in ((client_trainer, FedMITRClientTrainer), (server_aggregator, FedMITRServerAggregator)):
            if given is not None and not isinstance(given, cls):
                raise TypeError(f"federated_optimizer = {name!r} runs the plugin's one-shot flow: a custom "
                                f"{type(given).__name__} must subclass fedml_fedmitr's {cls.__name__}")
        self.args, self.device, self.dataset, self.model = args, device, dataset, model
        self.client_trainer, self.server_aggregator = client_trainer, server_aggregator
        self.num_classes = int(dataset[7])
        check_dataset(dataset, model, int(args.client_num_in_total), self.run_control.min_clients)
        if not hasattr(args, "frequency_of_the_test"):
            args.frequency_of_the_test = 1
        self.mode = self._mode()
        self.result = None

    def _mode(self) -> str:
        t = getattr(self.args, "training_type", None)
        backend = getattr(self.args, "backend", None)
        if t == "simulation" and backend == "sp":
            return "sp"
        if t == "simulation" and backend == "MPI":
            return "mpi_simulation"
        if t == "cross_silo":
            if getattr(self.args, "scenario", "horizontal") != "horizontal":
                raise ConfigError("fedml_fedmitr supports the horizontal cross-silo scenario only "
                                  "(common_args.scenario: horizontal)")
            return "cross_silo"
        raise ConfigError(f"training_type = {t!r} with backend = {backend!r} is not supported by "
                         "fedml_fedmitr: use simulation (sp or MPI) or cross_silo")

    # ------------------------------------------------------------------
    def run(self):
        from .state import lock_output_dir, release_output_dir, set_aside_previous_state

        locked = False
        if int(getattr(self.args, "rank", 0) or 0) == 0:   # the server (or the single sp process)
            locked = lock_output_dir(self.fedmitr_config.output_dir)
            if not self.fedmitr_config.resume:
                set_aside_previous_state(self.fedmitr_config.output_dir)
        try:
            return self._run_mode()
        finally:
            if locked:
                release_output_dir(self.fedmitr_config.output_dir)

    def _run_mode(self):
        log.info("fedml_fedmitr: %s, mode %s, %s clients, device %s", self.args.federated_optimizer, self.mode,
                 self.args.client_num_in_total, self.device)
        if self.mode == "sp":
            return self._run_sp()
        return self._run_distributed()

    def _trainer(self, **kw):
        from .model import model_meta
        from .trainer import FedMITRClientTrainer

        if self.client_trainer is not None:
            return self.client_trainer
        return FedMITRClientTrainer(self.model, self.args, settings=self.settings, num_classes=self.num_classes,
                                    model_meta=model_meta(self.model, self.args), **kw)

    def _aggregator(self, model):
        from .aggregator import FedMITRServerAggregator

        if self.server_aggregator is not None:
            return self.server_aggregator
        return FedMITRServerAggregator(model, self.args, settings=self.settings, device=self.device,
                                       test_data=self.dataset[3], start_time=self.start_time)

    def _run_sp(self):
        import copy

        from .aggregator import finish_round

        (_, _, _, test_global, train_num, train_local, test_local, _) = self.dataset
        args, device = self.args, self.device
        args.device = device
        server_model = copy.deepcopy(self.model).cpu()
        aggregator = self._aggregator(server_model)
        aggregator.set_id(0)
        self.model.to(device)
        trainer = self._trainer(save_received=False)
        initial = aggregator.get_model_params()
        model_list = []
        k = int(args.client_num_in_total)
        saved = self._saved_uploads()
        if saved is not None:  # resume: the clients' work is saved, do not redo it
            global_state = aggregate_saved_uploads(aggregator, saved, args)
            return self._deliver_sp(trainer, global_state, aggregator)
        for idx in range(k):
            trainer.trained = False
            trainer.set_model_params(initial)
            trainer.set_id(idx)
            trainer.update_dataset(train_local[idx], test_local.get(idx) if test_local else None, train_num[idx])
            trainer.on_before_local_training(train_local[idx], device, args)
            trainer.train(train_local[idx], device, args)
            trainer.on_after_local_training(train_local[idx], device, args)
            model_list.append((train_num[idx], copy.deepcopy(trainer.get_model_params())))
        global_state = finish_round(aggregator, model_list)
        return self._deliver_sp(trainer, global_state, aggregator)

    def _deliver_sp(self, trainer, global_state, aggregator):
        """Every simulated client receives the global model (and evaluates it on its own test data)."""
        (_, _, _, _, train_num, train_local, test_local, _) = self.dataset
        for idx in range(int(self.args.client_num_in_total)):
            trainer.set_id(idx)
            trainer.update_dataset(train_local[idx], test_local.get(idx) if test_local else None, train_num[idx])
            trainer.trained = True
            trainer.set_model_params(global_state)
        self.result = aggregator.summary
        return self.result

    def _saved_uploads(self) -> Optional[str]:
        """With ``resume: true``, the path of the saved uploads of this output_dir (if any)."""
        from .state import uploads_path

        if not self.fedmitr_config.resume:
            return None
        path = uploads_path(self.fedmitr_config.output_dir)
        if not path.is_file():
            log.warning("server: resume: true but %s holds no saved uploads: the clients train from the start",
                        path)
            return None
        log.info("server: resume: true: resuming from the saved uploads %s", path)
        return str(path)

    def _run_distributed(self):
        from . import fedml_patches

        args = self.args
        rank = int(args.rank)
        saved = self._saved_uploads() if rank == 0 else None
        comm = getattr(args, "comm", None)
        if args.backend == "MPI" and comm is not None and comm.Get_size() > 1:
            saved = comm.bcast(saved, root=0)  # every rank learns whether the server resumes alone
        if saved is not None:
            if rank != 0:
                log.info("client process %d: the server resumes from saved uploads (%s); nothing to train",
                         rank, saved)
                return None
            args.device = self.device
            aggregator = self._aggregator(self.model)
            aggregator.set_id(0)
            log.info("server: resuming from saved uploads %s; no client is contacted", saved)
            aggregate_saved_uploads(aggregator, saved, args)
            self.result = aggregator.summary
            return self.result
        from .grpc_security import security_from
        fedml_patches.fix_receive_loops(args.backend, security_from(self.settings.adapter))
        k = int(args.client_num_in_total)
        if self.mode == "mpi_simulation":
            world = int(args.comm.Get_size())
            workers = world - 1
            args.worker_num = workers
            args.scenario = "horizontal"
            args.n_proc_in_silo = 1
            args.proc_rank_in_silo = 0
        else:
            workers = int(args.worker_num)
        if workers < 1:
            raise ConfigError("a distributed run needs a server and at least one client process "
                             "(mpirun -n 2 or more)")
        if k < workers:
            raise ConfigError(f"train_args.client_num_in_total = {k} is smaller than the {workers} client "
                              "processes: every client process must train at least one client (start at most "
                              f"{k + 1} processes, or raise client_num_in_total)")
        args.client_num_per_round = workers  # FedML's plumbing: one upload per client process
        if rank == 0:
            args.client_id_list = json.dumps(list(range(1, workers + 1)))
        else:
            args.client_id_list = json.dumps([rank])
        (train_num, test_num, train_global, test_global, train_local_num, train_local, test_local,
         class_num) = self.dataset
        from .client_manager import run_client
        from .server_manager import run_server

        if rank == 0:
            aggregator = self._aggregator(self.model)
            cfg = self.run_control
            log.info("server: waiting for %d client process(es) with %d clients", workers, k)
            run_server(args, self.device, getattr(args, "comm", None), rank, workers, self.model, train_num,
                       train_global, test_global, train_local, test_local, train_local_num, aggregator,
                       clients_of_rank={r: assigned_clients(r, workers, k) for r in range(1, workers + 1)},
                       timeout_s=cfg.client_timeout_s, min_clients=cfg.min_clients)
            self.result = aggregator.summary
        else:
            clients = assigned_clients(rank, workers, k)
            share = None if (k == workers) else clients
            trainer = self._trainer(client_indices=share, train_data_local_dict=train_local,
                                    test_data_local_dict=test_local)
            log.info("client process %d trains client(s) %s", rank, clients)
            run_client(args, self.device, getattr(args, "comm", None), rank, workers, self.model, train_num,
                       train_local_num, train_local, test_local, trainer,
                       server_lost_s=self.run_control.server_lost_s)
            self.result = trainer.received_results
        return self.result


def check_dataset(dataset, model, num_clients: int, min_clients: int) -> None:
    """Before any training: the model's outputs match ``class_num`` and no client's shard is empty."""
    class_num = int(dataset[7])
    outputs = getattr(model, "num_classes", None)
    if outputs is not None and int(outputs) != class_num:
        raise ModelError(f"the model has {int(outputs)} outputs but the dataset's class_num is {class_num}: "
                         "build the model with num_classes = class_num")
    counts = dataset[4] or {}
    empty = sorted(int(i) for i, n in counts.items() if n is not None and int(n) <= 0)
    if empty:
        raise ClientFailure(f"client(s) {empty} have an empty training shard (train_data_local_num_dict); "
                            "every client needs training data", details={"clients": empty})
    if min_clients > num_clients:
        raise ConfigError(f"fedmitr_args.min_clients = {min_clients} is more than client_num_in_total = "
                          f"{num_clients}: expected at most {num_clients}")


def aggregate_saved_uploads(aggregator, path, args, check_settings: bool = True):
    """The server's one-shot aggregation from uploads saved by an earlier run (no client needed).

    ``aggregator`` is a :class:`~.aggregator.FedMITRServerAggregator`; returns the global state.
    With ``check_settings`` the clients' FedML settings recorded with the uploads must match ``args``
    (a resumed run); :mod:`fedml_fedmitr.server_only` takes the uploads as they are.
    """
    from .aggregator import finish_round
    from .state import client_settings, load_uploads, settings_diff
    from .trainer import PAYLOAD_KEY

    blob = load_uploads(path)
    recorded = blob.get("client_settings") or {}
    diff = settings_diff(recorded, client_settings(args)) if recorded else []
    if diff and check_settings:
        raise StateError(f"fedmitr_args.resume is true but the uploads saved in {str(path)!r} were trained with "
                         f"other client settings (differs in: {', '.join(diff)}); set resume: false to train the "
                         "clients again, or rerun the server alone on them with python -m fedml_fedmitr.server_only")
    if diff:
        log.warning("server: the saved uploads were trained with other settings than this config (%s)", ", ".join(diff))
    payloads = blob["uploads"]
    if len(payloads) < aggregator.min_clients:
        raise ClientFailure(f"{str(path)!r} holds {len(payloads)} client upload(s), fewer than "
                            f"fedmitr_args.min_clients = {aggregator.min_clients}")
    aggregator.uploads_file = str(path)
    aggregator.missing_clients = list(blob.get("missing_clients") or [])
    log.info("server: %d saved client upload(s) from %s (missing clients: %s)", len(payloads), path,
             aggregator.missing_clients or "none")
    return finish_round(aggregator, [(int(p["num_samples"]), {PAYLOAD_KEY: [p]}) for p in payloads])
