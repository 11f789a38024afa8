"""The client side as a FedML ``ClientTrainer``: train once, upload weights and label counts.

FedML's cross-silo client calls, in order: ``set_model_params(initial global model)`` ->
``update_dataset`` -> ``train`` -> ``get_model_params`` (uploaded) -> later
``set_model_params(global model)`` when the server's one-shot model arrives. This trainer:

* ``train``: :func:`fedml_fedmitr.core.client.train_client` on the local shard, from the shared
  initial weights. A trainer given ``client_indices`` (the MPI simulation with more clients than
  worker processes) trains each of those clients in turn, each from the same initial weights.
* ``get_model_params`` after training returns a plain dict
  ``{"fedmitr_uploads": [ClientUpload.to_payload() + {"train_s": seconds}, ...]}``, which
  every FedML backend pickles as is (a plain ``dict``, so FedML's server does not try to move
  it to its device); before training it returns the state_dict (an OrderedDict).
* ``set_model_params`` after training receives the global model: it loads it, evaluates it on
  the client's own test data, logs the accuracy and writes
  ``<output_dir>/clients/client_<id>.json`` (and ``client_<id>_global_model.pt`` unless the
  runner says not to save copies, as the single-process simulation does).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import torch
from fedml.core import ClientTrainer

from ..core.checkpoint import write_text
from ..core.client import train_client
from ..core.evaluate import evaluate_model
from ..core.methods.base import Callbacks
from ..core.models import ModelError, load_state_checked, save_global_model
from .checks import check_architecture
from .errors import ClientFailure
from .model import client_architecture, create_model

log = logging.getLogger("fedml_fedmitr")

PAYLOAD_KEY = "fedmitr_uploads"


def _cpu_state(model) -> "OrderedDict[str, torch.Tensor]":
    """A CPU copy of the weights, as an OrderedDict: FedML's server treats a plain ``dict`` of
    global parameters as one model per client (``type(params) is dict``)."""
    return OrderedDict((k, v.detach().cpu().clone()) for k, v in model.state_dict().items())


def shard_labels(loader) -> Optional[torch.Tensor]:
    """The labels of a loader over a ``TensorDataset`` (read without iterating the loader, so its
    shuffling generator is untouched); None for other datasets."""
    from torch.utils.data import TensorDataset

    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) >= 2:
        return dataset.tensors[1].view(-1)
    return None


def check_shard(client_id: int, loader, num_classes: int) -> None:
    """A client's shard must hold samples, with labels in ``[0, num_classes)`` (the model's outputs).
    Checked up front for ``TensorDataset`` loaders; other loaders are checked by the training itself."""
    empty = loader is None
    labels = None if empty else shard_labels(loader)
    if labels is not None:
        empty = labels.numel() == 0
    if empty:
        raise ClientFailure(f"client {client_id} has an empty training shard: nothing to train on (check the "
                            "partition: data_args.partition_method / client_num_in_total)",
                            details={"client": int(client_id)})
    if labels is not None:
        low, top = int(labels.min()), int(labels.max())
        if top >= num_classes or low < 0:
            raise ModelError(f"client {client_id} has labels {low}..{top} but the model has {num_classes} outputs: "
                             "class_num disagrees with the data (labels must lie in 0..class_num-1)")


class FedMITRClientTrainer(ClientTrainer):
    def __init__(self, model, args, settings=None, num_classes: Optional[int] = None,
                 client_indices: Optional[Sequence[int]] = None,
                 train_data_local_dict: Optional[dict] = None, test_data_local_dict: Optional[dict] = None,
                 model_meta: Optional[dict] = None, save_received: bool = True):
        super().__init__(model, args)
        from .config import read_settings

        settings = settings or read_settings(args)   # a stock main.py's trainer reads them from its args
        self.train_config = settings.client
        self.fedmitr_config = settings.method
        self.num_classes = int(num_classes if num_classes is not None else model.num_classes)
        self.client_indices = list(client_indices) if client_indices is not None else None
        self.train_data_local_dict = train_data_local_dict
        self.test_data_local_dict = test_data_local_dict
        self.model_meta = model_meta
        self.save_received = save_received
        self.uploads: List[dict] = []
        self.trained = False
        self.received_results: Dict[int, dict] = {}

    # ---- FedML hooks ----
    def get_model_params(self):
        if self.trained:
            return {PAYLOAD_KEY: self.uploads}
        return _cpu_state(self.model)

    def set_model_params(self, model_parameters):
        if isinstance(model_parameters, dict) and PAYLOAD_KEY in model_parameters:
            raise ValueError("a client received client uploads instead of a model")
        if self.trained:
            self.receive_global_model(model_parameters)
        else:
            check_architecture(model_parameters, self.model.state_dict(),
                               f"the server's initial model (received by client process "
                               f"{getattr(self.args, 'rank', '?')})", ours="this client's model")
            load_state_checked(self.model, model_parameters, "the server's initial model")

    def train(self, train_data, device, args):
        torch.manual_seed(int(getattr(args, "random_seed", 0)) + 7919 * (self.id + 1))
        callbacks = Callbacks(progress=self.fedmitr_config.progress)
        if self.client_indices is None:
            jobs = [(int(self.id), train_data)]
        else:
            if self.train_data_local_dict is None:
                raise ValueError("a trainer of several clients needs their train_data_local_dict")
            jobs = [(int(i), self.train_data_local_dict[i]) for i in self.client_indices]
        initial = _cpu_state(self.model)
        self.uploads = []
        for n, (client_id, loader) in enumerate(jobs):
            arch = client_architecture(args, client_id)   # model_args.client_models: a model market
            if arch is not None and arch != getattr(args, "model", None):
                model = create_model(args, self.num_classes, name=arch)   # seeded: one start per architecture
            else:
                model = self.model
                if n:
                    model.load_state_dict(initial)
            torch.manual_seed(int(getattr(args, "random_seed", 0)) + 7919 * (client_id + 1))
            check_shard(client_id, loader, self.num_classes)
            start = time.perf_counter()
            try:
                upload = train_client(client_id, model, loader, self.train_config, device,
                                      self.num_classes, callbacks)
                upload.architecture = arch
            except ValueError as exc:
                if "empty training shard" in str(exc):
                    raise ClientFailure(f"client {client_id} has an empty training shard: nothing to train on",
                                        details={"client": int(client_id)}) from exc
                raise
            if len(upload.label_counts) > self.num_classes:
                raise ModelError(f"client {client_id} has labels up to {len(upload.label_counts) - 1} but the model "
                                 f"has {self.num_classes} outputs: class_num disagrees with the data")
            seconds = time.perf_counter() - start
            payload = upload.to_payload()
            payload["train_s"] = seconds
            self.uploads.append(payload)
            log.info("client %d trained on %d samples in %.1f s", client_id, upload.num_samples, seconds)
        self.trained = True

    def test(self, test_data, device, args):
        if test_data is None:
            return None
        res = evaluate_model(self.model, test_data, device, self.num_classes)
        log.info("client %d: accuracy %.4f on its %d local test images", self.id, res["acc"], res["num_samples"])
        return res

    # ---- receiving the one-shot global model ----
    def receive_global_model(self, state) -> Dict[int, dict]:
        device = getattr(self.args, "device", None) or next(self.model.parameters()).device
        load_state_checked(self.model, state, "the global model from the server")
        self.model.to(device)
        ids = [int(self.id)] if self.client_indices is None else list(self.client_indices)
        out_dir = os.path.join(self.fedmitr_config.output_dir, "clients")
        os.makedirs(out_dir, exist_ok=True)
        for client_id in ids:
            loader = self.local_test_dataset if self.client_indices is None else (
                (self.test_data_local_dict or {}).get(client_id))
            record = {"client_id": client_id, "local_test_acc": None, "local_test_samples": 0}
            if loader is not None:
                res = evaluate_model(self.model, loader, device, self.num_classes)
                record.update(local_test_acc=res["acc"], local_test_samples=res["num_samples"],
                              local_test_loss=res["loss"])
                log.info("client %d: the global model scores %.4f on its %d local test images",
                         client_id, res["acc"], res["num_samples"])
            if self.save_received:
                path = os.path.join(out_dir, f"client_{client_id}_global_model.pt")
                meta = dict(self.model_meta or {})
                save_global_model(path, self.model, meta)
                record["model_path"] = path
            write_text(os.path.join(out_dir, f"client_{client_id}.json"), json.dumps(record, indent=2))
            self.received_results[client_id] = record
        return self.received_results
