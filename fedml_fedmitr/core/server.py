"""The server's one-shot round once the uploads are in, FedML-free: the one pipeline every mode runs.

:func:`run_one_shot` runs the chosen method on the uploads (it builds the ensemble and the student,
synthesises, distils, evaluates), measures each client's own model, and writes the outputs through
one writer: ``global_model.pt`` (:func:`~.models.save_global_model`), ``summary.json``, the pictures
and the TensorBoard scalars. The single-process simulation, the MPI and cross-silo server, and
``python -m fedml_fedmitr.server_only`` each call it once (through the FedML adapter's aggregator,
which decodes FedML's payloads and builds the :class:`~.methods.base.ServerContext`).

What the outputs record about the run beyond the method's own numbers (dataset, backend, client
settings, who was refused, ...) comes in :class:`RunInfo`, filled by the caller.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from .checkpoint import write_text
from .config import FedMITRConfig, resolve_augmentation
from .evaluate import evaluate_model, missed_classes
from .methods import get_method
from .methods.base import ClientUpload, ServerContext, ServerResult
from .models import load_state_checked, save_global_model

log = logging.getLogger("fedml_fedmitr")

SUMMARY_NAME = "summary.json"
CHECKPOINT_NAME = "global_model.pt"


@dataclass
class RunInfo:
    """What the outputs say about the run besides the method's results (from the caller)."""

    method: str
    output_dir: Path
    model_meta: Dict[str, Any]                                  # what rebuilds the model (load_global_model)
    run: Dict[str, Any] = field(default_factory=dict)           # dataset, backend, training_type, random_seed
    partition: Dict[str, Any] = field(default_factory=dict)     # method, alpha, classes_per_client
    config: Dict[str, Any] = field(default_factory=dict)        # train_args, data, yaml_config_file
    train_seconds: Sequence[float] = ()                          # each client's local training time
    start_time: float = field(default_factory=time.perf_counter)
    refused: Dict[str, str] = field(default_factory=dict)       # client id -> why its upload was refused
    extra: Dict[str, Any] = field(default_factory=dict)         # added to the summary as they are


@dataclass
class OneShotOutcome:
    result: ServerResult
    state: Dict[str, torch.Tensor]       # the global model's state_dict, on the CPU
    client_acc: List[float]
    summary: Dict[str, Any]


def run_one_shot(uploads: Sequence[ClientUpload], ctx: ServerContext, config: FedMITRConfig,
                 info: RunInfo) -> OneShotOutcome:
    """Run ``info.method`` on ``uploads``, evaluate, write the outputs; return the global model."""
    method = get_method(info.method)(config)
    result = method.run(uploads, ctx)
    client_acc = evaluate_clients(uploads, ctx)
    summary = OutputWriter(config, info).write(result, uploads, client_acc, ctx)
    state = {k: v.detach().cpu() for k, v in result.model.state_dict().items()}
    return OneShotOutcome(result=result, state=state, client_acc=client_acc, summary=summary)


def evaluate_clients(uploads: Sequence[ClientUpload], ctx: ServerContext) -> List[float]:
    """Each client's own model's accuracy on the server's test set (empty without one)."""
    if ctx.eval_loader is None:
        return []
    acc = []
    for upload in uploads:
        probe = load_state_checked(ctx.model_for(upload).to(ctx.device), upload.state_dict,
                                   f"the model of client {upload.client_id}")
        acc.append(evaluate_model(probe, ctx.eval_loader, ctx.device, ctx.num_classes)["acc"])
    return acc


def resolved_settings(cfg: FedMITRConfig, model, client_augment: bool, client_flip: bool) -> Dict[str, Any]:
    """The prune points, keep counts and inversion augmentation the defaults resolved to."""
    side = int(model.patch_embed.img_size[0])
    n = int(model.patch_embed.num_patches)
    jitter, flip = resolve_augmentation(cfg, side, bool(client_augment), bool(client_flip))
    points = cfg.prune_iterations()
    return {"prune_iterations": points, "keep_counts": cfg.keep_counts(n) if points else [],
            "num_patches": n, "inversion_jitter": jitter, "flip": flip}


class OutputWriter:
    """The one writer of a run's outputs: checkpoint, ``summary.json``, pictures, TensorBoard scalars,
    and the one result line on stdout."""

    def __init__(self, config: FedMITRConfig, info: RunInfo):
        self.config, self.info = config, info
        self.out = Path(info.output_dir)

    def write(self, result: ServerResult, uploads: Sequence[ClientUpload], client_acc: List[float],
              ctx: ServerContext) -> Dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        ckpt = self.out / CHECKPOINT_NAME
        save_global_model(ckpt, result.model, self.info.model_meta)
        summary = self.summary(result, uploads, client_acc, ctx, ckpt)
        summary["pictures"] = self.write_pictures(uploads)
        callbacks = ctx.callbacks
        if hasattr(callbacks, "scalars"):
            callbacks.scalars({k: summary[k] for k in ("test_acc", "ensemble_acc", "client_test_acc",
                                                       "num_synthetic", "timings", "per_class_acc")})
        if hasattr(callbacks, "close"):
            callbacks.close()
        summary.update(self.info.extra)
        path = self.out / SUMMARY_NAME
        write_text(path, json.dumps(summary, indent=2, default=_json_default))
        log.info("server: wrote %s and %s", path, ckpt)
        print_result_line(f"{self.info.method}: test_acc={_fmt(summary['test_acc'])} "
                          f"ensemble_acc={_fmt(summary['ensemble_acc'])} clients={len(uploads)} "
                          f"num_synthetic={summary['num_synthetic']} total_s={summary['timings']['total_s']:.1f} "
                          f"summary={path}")
        return summary

    def summary(self, result: ServerResult, uploads: Sequence[ClientUpload], client_acc: List[float],
                ctx: ServerContext, ckpt: Path) -> Dict[str, Any]:
        info, metrics = self.info, result.metrics
        timings = dict(metrics.get("timings", {}))
        train_s = list(info.train_seconds) or [0.0]
        summary: Dict[str, Any] = {
            "optimizer": info.method,
            "dataset": info.run.get("dataset"),
            "client_num": len(uploads),
            "client_ids": [u.client_id for u in uploads],
            "client_num_samples": [u.num_samples for u in uploads],
            # each client's architecture (model_args.client_models; the global model's otherwise)
            "client_models": [u.architecture or ctx.model_name for u in uploads],
            "partition": {**info.partition, "label_counts": [u.label_counts for u in uploads]},
            "test_acc": metrics.get("test_acc"),
            "ensemble_acc": metrics.get("ensemble_acc"),
            "client_test_acc": client_acc,
            "num_synthetic": metrics.get("num_synthetic", 0),
            "timings": {
                # clients train in parallel in a real federation: local_train_s is the slowest
                # client's training time; local_train_s_sum adds them all up
                "local_train_s": max(train_s),
                "local_train_s_sum": sum(train_s),
                "synthesis_s": timings.get("synthesis_s"),
                "distill_s": timings.get("distill_s"),
                "server_s": timings.get("server_total_s"),
                # wall time on the server from the run's start to the end of aggregation
                "total_s": time.perf_counter() - info.start_time,
            },
            "metrics": {k: v for k, v in metrics.items() if k != "timings"},
            "device": str(ctx.device),
            "backend": info.run.get("backend"),
            "training_type": info.run.get("training_type"),
            "random_seed": info.run.get("random_seed"),
            "checkpoint": str(ckpt),
            "model": info.model_meta,
            "config": {
                "fedmitr_args": self.config.to_dict(),
                **info.config,
                # what the automatic settings resolved to for this run
                "resolved": resolved_settings(self.config, result.model, ctx.client_augment, ctx.client_flip),
            },
            "per_class_acc": {"global": metrics.get("per_class_acc"),
                              "ensemble": metrics.get("ensemble_per_class_acc")},
            # how many test inputs each assigns to each class
            "predicted_per_class": {"global": metrics.get("predicted_per_class"),
                                    "ensemble": metrics.get("ensemble_predicted_per_class")},
        }
        # a collapse (#18): classes the ensemble gets right at least once that the global model never predicts
        missed = missed_classes(metrics.get("predicted_per_class"), metrics.get("ensemble_per_class_acc"))
        summary["missed_classes"] = missed
        if missed:
            log.warning("server: the global model never predicts class(es) %s, which the ensemble gets right on "
                        "some test inputs (a collapse; per class: summary.json per_class_acc, predicted_per_class)",
                        missed)
        screening = metrics.get("screening")
        # clients the poisoned-upload screen (fedmitr_args.client_screening) left out, with the reason
        summary["screening"] = screening
        summary["clients_dropped"] = dict(screening["dropped"]) if screening else {}
        summary["clients_dropped"].update({c: f"upload refused: {r}" for c, r in info.refused.items()})
        return summary

    def write_pictures(self, uploads: Sequence[ClientUpload]) -> Dict[str, str]:
        """The label distribution plot, plus the synthetic grids the report callbacks wrote."""
        from .report import plot_label_distribution

        pictures: Dict[str, str] = {}
        if not self.config.save_images:
            return pictures
        try:
            path = plot_label_distribution([u.label_counts for u in uploads], self.out / "label_distribution.png")
            pictures["label_distribution"] = str(path)
        except Exception as exc:  # a plot must never cost the run its results
            log.warning("server: could not draw the label distribution: %s", exc)
        for name in ("synthetic_grid", "synthetic_masks"):
            if (self.out / f"{name}.png").is_file():
                pictures[name] = str(self.out / f"{name}.png")
        return pictures


def print_result_line(line: str) -> None:
    """Write one line to the real stdout (FedML's init_logs turns ``sys.stdout.write`` into a logger)."""
    stream = sys.__stdout__
    if stream is None:
        return
    try:
        type(stream).write(stream, line + "\n")  # the class's write, not FedML's replacement
        stream.flush()
    except Exception:  # no usable stdout (daemonised): the log has the numbers
        pass


def _fmt(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _json_default(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)
