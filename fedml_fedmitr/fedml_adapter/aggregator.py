"""The server side as a FedML ``ServerAggregator``: one-shot aggregation with a core method.

``aggregate(model_list)`` receives FedML's ``[(sample_num, params), ...]`` where each ``params``
is a client trainer's payload dict (one or several client uploads), turns them into checked
:class:`~fedml_fedmitr.core.methods.base.ClientUpload` objects (a bad one drops its client), saves
them (``state/uploads.pt``), builds the :class:`~fedml_fedmitr.core.methods.base.ServerContext` and
runs the core's one pipeline, :func:`fedml_fedmitr.core.server.run_one_shot` (the method, each
client's own accuracy, ``global_model.pt`` and ``summary.json``). It returns the global
state_dict, which FedML sends to every client. :func:`finish_round` is FedML's end of the round
around it (hooks, set the model, test), written once for every mode.

FedML's default ``on_before_aggregation`` / ``on_after_aggregation`` (differential privacy,
attacks and defences, FHE) expect state dicts, not one-shot payloads: they are passed through
unchanged here.
"""
from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from fedml.core import ServerAggregator

from ..core.evaluate import evaluate_model
from ..core.methods.base import ClientUpload, ServerContext
from ..core.models import ModelError, load_state_checked
from ..core.report import ReportCallbacks
from ..core.server import RunInfo, run_one_shot
from . import state as saved_state
from .checks import check_upload, single_class_warning
from .errors import ClientFailure, UserError, one_line
from .model import client_models, create_model, input_shape_of, is_pretrained, model_meta
from .tracking import fedml_sink
from .trainer import PAYLOAD_KEY, _cpu_state

log = logging.getLogger("fedml_fedmitr")



def estimate_mean_std(loader, channels: int):
    """Per-channel (mean, std) such that the loader's observed min..max is the [0, 1] pixel range.

    Used when a stock ``main.py`` passes its own normalised data and says nothing about its
    normalisation (``data_args.input_mean`` / ``input_std`` override this).
    """
    lo = torch.full((channels,), float("inf"))
    hi = torch.full((channels,), float("-inf"))
    for x, _ in loader:
        x = x.detach().float().cpu()
        lo = torch.minimum(lo, x.transpose(0, 1).reshape(channels, -1).min(dim=1).values)
        hi = torch.maximum(hi, x.transpose(0, 1).reshape(channels, -1).max(dim=1).values)
    # x = (p - mean) / std maps pixels p in [0, 1] onto [lo, hi]: std = 1 / (hi - lo), mean = -lo * std
    std = 1.0 / (hi - lo).clamp_min(1e-6)
    mean = -lo * std
    return mean.tolist(), std.tolist()


def finish_round(aggregator, model_list, test=None):
    """FedML's end of a round, for every mode: the before-aggregation hook, the one-shot
    aggregation, the after-aggregation hook, the global model set and tested (``test``: FedML's own
    test call of the caller, by default the aggregator's test on its test set). Returns the state."""
    model_list, _ = aggregator.on_before_aggregation(model_list)
    state = aggregator.aggregate(model_list)
    state = aggregator.on_after_aggregation(state)
    aggregator.set_model_params(state)
    if test is None:
        aggregator.test(aggregator.test_data, aggregator._device(), aggregator.args)
    else:
        test()
    return state


class FedMITRServerAggregator(ServerAggregator):
    def __init__(self, model, args, settings=None, device=None, test_data=None,
                 start_time: Optional[float] = None):
        super().__init__(model, args)
        from .config import read_fedmitr_config, read_settings

        self.settings = settings or read_settings(args)
        self.fedmitr_config = read_fedmitr_config(args) if settings is None else settings.method
        self.train_config = self.settings.client
        self.min_clients = int(self.settings.run.min_clients)
        self.method_name = args.federated_optimizer
        self.device = device
        self.test_data = test_data
        self.start_time = time.perf_counter() if start_time is None else start_time
        self.template_state = _cpu_state(model)  # the shared initial weights
        self.model_name = model_meta(model, args)["model"]
        self.client_templates: Dict[str, Any] = {}   # other client architectures: their initial models
        self.summary: Optional[Dict[str, Any]] = None
        self.result = None

    # ---- FedML hooks ----
    def get_model_params(self):
        return _cpu_state(self.model)

    def set_model_params(self, model_parameters):
        load_state_checked(self.model, model_parameters, "the global model")

    def on_before_aggregation(self, raw_client_model_or_grad_list):
        return raw_client_model_or_grad_list, list(range(len(raw_client_model_or_grad_list)))

    def on_after_aggregation(self, aggregated_model_or_grad):
        return aggregated_model_or_grad

    def test(self, test_data, device, args):
        if test_data is None:
            return None
        device = torch.device(device) if device is not None else self._device()
        self.model.to(device)
        res = evaluate_model(self.model, test_data, device, self.model.num_classes)
        log.info("server: global model accuracy %.4f on %d test images", res["acc"], res["num_samples"])
        return res["acc"], res["loss"], None, None

    def test_all(self, train_data_local_dict, test_data_local_dict, device, args) -> bool:
        return True

    # ---- the one-shot aggregation ----
    def _device(self):
        dev = self.device if self.device is not None else getattr(self.args, "device", None)
        return torch.device(dev) if dev is not None else torch.device("cpu")

    def uploads_from(self, model_list) -> List[ClientUpload]:
        """Client uploads out of FedML's model list, checked (architecture, NaN/Inf, empty shard)."""
        uploads, train_s, payloads = [], [], []
        for _sample_num, params in model_list:
            if not isinstance(params, dict) or PAYLOAD_KEY not in params:
                raise UserError(
                    f"federated_optimizer = {self.method_name!r}: a client sent {type(params).__name__} "
                    "instead of a one-shot upload; clients must run FedMITRClientTrainer "
                    "(import fedml_fedmitr in every party's main.py)")
            for payload in params[PAYLOAD_KEY]:
                try:
                    upload = ClientUpload.from_payload(payload)
                    check_upload(upload, self.template_for(upload.architecture))
                except (ModelError, UserError, KeyError, TypeError, ValueError) as exc:
                    # a bad upload drops its client, not the federation (min_clients decides below)
                    cid = payload.get("client_id", "?") if isinstance(payload, dict) else "?"
                    self.refused_clients[str(cid)] = one_line(exc)
                    log.warning("server: dropped the upload of client %s: %s", cid, one_line(exc))
                    continue
                uploads.append(upload)
                payloads.append(payload)
                train_s.append(float(payload.get("train_s", 0.0)))
        order = sorted(range(len(uploads)), key=lambda i: uploads[i].client_id)
        ids = [uploads[i].client_id for i in order]
        if len(set(ids)) != len(ids):
            raise UserError(f"duplicate client uploads: client ids {ids} (two clients used the same id)")
        self.train_seconds = [train_s[i] for i in order]
        self.received_payloads = [payloads[i] for i in order]
        return [uploads[i] for i in order]

    def template_for(self, architecture: Optional[str]) -> Dict[str, torch.Tensor]:
        """The weights an upload of ``architecture`` must fit (model_args.client_models)."""
        if architecture is None or architecture == self.model_name:
            return self.template_state
        allowed = client_models(self.args) or []
        if architecture not in allowed:
            raise UserError(f"uploaded a {architecture!r} model, which is not one of model_args.client_models "
                            f"{allowed} (or the global {self.model_name!r})")
        return self.client_model(architecture).state_dict()

    def client_model(self, architecture: str):
        """The initial model of a client architecture, built once (the upload check and the server's
        context share it)."""
        if architecture not in self.client_templates:
            with torch.random.fork_rng():   # building a model reseeds torch; the server's RNG stays as it was
                self.client_templates[architecture] = create_model(self.args, int(self.model.num_classes),
                                                                   name=architecture).cpu()
        return self.client_templates[architecture]

    # ---- saved state (see .state): uploads as soon as they are in, then the method's fingerprint ----
    uploads_file: Optional[str] = None        # set when the uploads were read from a saved file
    refused_clients: Dict[str, str] = {}       # client id -> why its upload was refused (set per aggregate)
    missing_clients: Sequence[int] = ()        # set by the server manager after a client timeout

    def save_received(self) -> None:
        """Save the received uploads to ``<output_dir>/state/uploads.pt`` (atomically)."""
        if self.uploads_file is not None:
            return  # they came from that file
        path = saved_state.uploads_path(self.fedmitr_config.output_dir)
        saved_state.save_uploads(path, self.received_payloads, self.missing_clients,
                                 int(getattr(self.args, "client_num_in_total", 0) or 0) or None,
                                 saved_state.client_settings(self.args))
        self.uploads_file = str(path)

    def check_saved_state(self, uploads, ctx: ServerContext) -> None:
        fp = saved_state.method_fingerprint(self.method_name, self.fedmitr_config, uploads, ctx.seed, ctx.mean,
                                            ctx.std, ctx.input_shape)
        saved_state.prepare_method_state(ctx.state_dir, self.method_name, fp, self.fedmitr_config.resume)

    def summary_extra(self) -> Dict[str, Any]:
        return {"clients_refused": dict(getattr(self, "refused_clients", {}) or {}),
                "clients_expected": int(getattr(self.args, "client_num_in_total", 0) or 0) or None,
                "clients_missing": [int(c) for c in self.missing_clients], "uploads_file": self.uploads_file}

    def context(self) -> ServerContext:
        device = self._device()
        template = copy.deepcopy(self.model).cpu()
        template.load_state_dict(self.template_state)

        def model_fn():
            return copy.deepcopy(template)

        def client_model_fn(name):
            return copy.deepcopy(self.client_model(name))

        shape = input_shape_of(self.model)
        mean = getattr(self.args, "input_mean", None)
        std = getattr(self.args, "input_std", None)
        info = getattr(self.args, "fedmitr_data_info", None)
        if mean is None or std is None:
            if info is not None:
                mean, std = info.mean, info.std
            elif self.test_data is not None:
                mean, std = estimate_mean_std(self.test_data, shape[0])
                log.info("server: no data_args.input_mean/input_std given; the pixel range observed in "
                         "the test set gives mean %s std %s", [round(v, 4) for v in mean],
                         [round(v, 4) for v in std])
            else:
                mean, std = [0.0] * shape[0], [1.0] * shape[0]
        cfg = self.fedmitr_config
        out = Path(cfg.output_dir)
        pretrained = is_pretrained(self.args)
        vit = self.model
        self.callbacks = ReportCallbacks(out, progress=cfg.progress, tensorboard=cfg.tensorboard,
                                         save_images=cfg.save_images, mean=list(mean), std=list(std),
                                         grid=tuple(int(g) for g in vit.patch_embed.grid_size),
                                         patch=tuple(int(p) for p in vit.patch_embed.patch_size), logger=log,
                                         sink=fedml_sink(self.args))
        return ServerContext(model_fn=model_fn, num_classes=int(self.model.num_classes), input_shape=shape,
                             mean=list(mean), std=list(std), device=device, eval_loader=self.test_data,
                             state_dir=out / "state", callbacks=self.callbacks,
                             seed=int(cfg.seed if cfg.seed is not None else getattr(self.args, "random_seed", 0)),
                             pretrained_state=dict(self.template_state) if pretrained else None,
                             model_name=self.model_name, client_model_fn=client_model_fn,
                             client_augment=bool(self.train_config.augment), client_flip=bool(self.train_config.flip))

    def aggregate(self, raw_client_model_or_grad_list):
        self.refused_clients = {}
        uploads = self.uploads_from(raw_client_model_or_grad_list)
        if self.refused_clients and len(uploads) < max(1, int(self.min_clients)):
            if uploads:
                self.save_received()   # the good uploads are kept (server_only can use them)
            raise ClientFailure(f"{len(self.refused_clients)} client upload(s) refused ("
                                + "; ".join(f"client {c}: {r}" for c, r in self.refused_clients.items())
                                + f"), {len(uploads)} left: fewer than fedmitr_args.min_clients = "
                                f"{self.min_clients}",
                                details={"clients_refused": dict(self.refused_clients)})
        expected = int(getattr(self.args, "client_num_in_total", len(uploads)))
        if len(uploads) != expected:
            log.warning("server: %d client uploads, client_num_in_total is %d", len(uploads), expected)
        log.info("server: %d client uploads (clients %s); running %s", len(uploads),
                 [u.client_id for u in uploads], self.method_name)
        warning = single_class_warning(uploads)
        if warning:
            log.warning("server: %s", warning)
        os.makedirs(self.fedmitr_config.output_dir, exist_ok=True)
        self.save_received()  # before the long work: a killed server resumes from them, no client needed
        ctx = self.context()
        self.check_saved_state(uploads, ctx)
        outcome = run_one_shot(uploads, ctx, self.fedmitr_config, self.run_info())
        self.result, self.summary = outcome.result, outcome.summary
        self.model.load_state_dict(outcome.state)
        return outcome.state

    def run_info(self) -> RunInfo:
        """What the summary records about this FedML run (the core writes it)."""
        args, info = self.args, getattr(self.args, "fedmitr_data_info", None)
        meta = model_meta(self.model, args)
        if info is not None:
            meta.update(mean=info.mean, std=info.std, dataset=info.name)
        partition = ({"method": info.partition_method, "alpha": info.partition_alpha,
                      "classes_per_client": info.classes_per_client} if info is not None else
                     {"method": getattr(args, "partition_method", None), "alpha": getattr(args, "partition_alpha", None),
                      "classes_per_client": getattr(args, "classes_per_client", None)})
        return RunInfo(
            method=self.method_name, output_dir=Path(self.fedmitr_config.output_dir), model_meta=meta,
            run={k: getattr(args, k, None) for k in ("dataset", "backend", "training_type", "random_seed")},
            partition=partition,
            config={"train_args": {k: getattr(self.train_config, k) for k in
                                   ("epochs", "batch_size", "lr", "optimizer", "weight_decay", "momentum",
                                    "augment", "flip", "label_smoothing", "feature_stats",
                                    "class_feature_stats")},
                    "data": info.to_dict() if info is not None else None,
                    "yaml_config_file": getattr(args, "yaml_config_file", None)},
            train_seconds=list(getattr(self, "train_seconds", []) or []), start_time=self.start_time,
            refused=dict(self.refused_clients or {}),
            extra={**self.summary_extra(), "class_names": info.class_names if info is not None else None})
