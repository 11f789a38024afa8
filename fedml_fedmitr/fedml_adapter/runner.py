"""The plugin's runner: one-shot FedMITR (or any method of ``method_names()``) on FedML.

``FedMITRRunner(args, device, dataset, model).run()`` is what ``FedMLRunner`` delegates to for the
plugin's names (see :mod:`.registry`). By ``training_type`` / ``backend``:

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

In the distributed modes, FedML's receive loops are fixed first (:mod:`.comm_fix`).
"""
from __future__ import annotations

import json
import logging
import time
from typing import List, Optional

import torch

from ..core.models import check_vit

log = logging.getLogger("fedml_fedmitr")


def assigned_clients(rank: int, workers: int, num_clients: int) -> List[int]:
    """Client indices trained by worker ``rank`` (1-based) of ``workers``: a round-robin share."""
    return list(range(rank - 1, num_clients, workers))


def attach_plugin_logging() -> None:
    """Send the plugin's (and the core's) log records to FedML's log handlers.

    FedML's ``init_logs`` replaces ``logging.root`` with its own logger; a logger created before
    that (as ``fedml_fedmitr`` is) would still point at the old, handler-less root.
    """
    plog = logging.getLogger("fedml_fedmitr")
    root = logging.root
    if plog.handlers or not root.handlers:
        return
    for handler in root.handlers:
        plog.addHandler(handler)
    plog.setLevel(root.level or logging.INFO)
    plog.propagate = False


class FedMITRRunner:
    def __init__(self, args, device, dataset, model, client_trainer=None, server_aggregator=None):
        from .config import check_run_args, client_train_config, read_fedmitr_config
        from ..core.methods import method_names

        self.start_time = time.perf_counter()
        attach_plugin_logging()
        name = getattr(args, "federated_optimizer", None)
        if name not in method_names():
            raise ValueError(f"federated_optimizer = {name!r} is not a one-shot method of fedml_fedmitr: "
                             f"expected one of {', '.join(method_names())}")
        # validate everything before any training starts
        self.fedmitr_config = read_fedmitr_config(args)
        args.fedmitr_config = self.fedmitr_config
        self.train_config = client_train_config(args)
        check_run_args(args)
        args.comm_round = 1
        check_vit(model, getattr(args, "model", None) if isinstance(getattr(args, "model", None), str) else None)
        if not isinstance(dataset, (list, tuple)) or len(dataset) != 8:
            raise ValueError("dataset must be FedML's 8-item list [train_data_num, test_data_num, "
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
                raise ValueError("fedml_fedmitr supports the horizontal cross-silo scenario only")
            return "cross_silo"
        raise ValueError(f"training_type = {t!r} with backend = {backend!r} is not supported by "
                         "fedml_fedmitr: use simulation (sp or MPI) or cross_silo")

    # ------------------------------------------------------------------
    def run(self):
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
        return FedMITRClientTrainer(self.model, self.args, train_config=self.train_config,
                                    fedmitr_config=self.fedmitr_config, num_classes=self.num_classes,
                                    model_meta=model_meta(self.model, self.args), **kw)

    def _aggregator(self, model):
        from .aggregator import FedMITRServerAggregator

        if self.server_aggregator is not None:
            return self.server_aggregator
        return FedMITRServerAggregator(model, self.args, fedmitr_config=self.fedmitr_config, device=self.device,
                                       test_data=self.dataset[3], start_time=self.start_time,
                                       train_config=self.train_config)

    def _run_sp(self):
        import copy

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
        for idx in range(k):
            trainer.trained = False
            trainer.set_model_params(initial)
            trainer.set_id(idx)
            trainer.update_dataset(train_local[idx], test_local.get(idx) if test_local else None, train_num[idx])
            trainer.on_before_local_training(train_local[idx], device, args)
            trainer.train(train_local[idx], device, args)
            trainer.on_after_local_training(train_local[idx], device, args)
            model_list.append((train_num[idx], copy.deepcopy(trainer.get_model_params())))
        model_list, _ = aggregator.on_before_aggregation(model_list)
        global_state = aggregator.aggregate(model_list)
        global_state = aggregator.on_after_aggregation(global_state)
        aggregator.set_model_params(global_state)
        aggregator.test(test_global, device, args)
        for idx in range(k):
            trainer.set_id(idx)
            trainer.update_dataset(train_local[idx], test_local.get(idx) if test_local else None, train_num[idx])
            trainer.trained = True
            trainer.set_model_params(global_state)
        self.result = aggregator.summary
        return self.result

    def _run_distributed(self):
        from . import comm_fix

        args = self.args
        comm_fix.apply_all(args.backend)
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
            raise ValueError("a distributed run needs a server and at least one client process "
                             "(mpirun -n 2 or more)")
        if k < workers:
            raise ValueError(f"client_num_in_total = {k} is smaller than the {workers} client processes: "
                             "every client process must train at least one client")
        rank = int(args.rank)
        args.client_num_per_round = workers  # FedML's plumbing: one upload per client process
        if rank == 0:
            args.client_id_list = json.dumps(list(range(1, workers + 1)))
        else:
            args.client_id_list = json.dumps([rank])
        (train_num, test_num, train_global, test_global, train_local_num, train_local, test_local,
         class_num) = self.dataset
        if rank == 0:
            from fedml.cross_silo.server import server_initializer

            aggregator = self._aggregator(self.model)
            log.info("server: waiting for %d client process(es) with %d clients", workers, k)
            server_initializer.init_server(args, self.device, args.comm, rank, workers, self.model, train_num,
                                           train_global, test_global, train_local, test_local, train_local_num,
                                           aggregator)
            self.result = aggregator.summary
        else:
            from fedml.cross_silo.client import client_initializer

            clients = assigned_clients(rank, workers, k)
            share = None if (k == workers) else clients
            trainer = self._trainer(client_indices=share, train_data_local_dict=train_local,
                                    test_data_local_dict=test_local)
            log.info("client process %d trains client(s) %s", rank, clients)
            client_initializer.init_client(args, self.device, args.comm, rank, workers, self.model, train_num,
                                           train_local_num, train_local, test_local, trainer)
            self.result = trainer.received_results
        return self.result
