"""One interface for "server methods": turn the uploaded client models into a global model.

FedMITR and every one-shot baseline implement :class:`ServerMethod`. The life cycle of one
(one-shot) round on the server, in the order :meth:`ServerMethod.run` goes through it:

1. :meth:`ServerMethod.prepare` receives the uploads (weights, sample counts, label counts) and the
   :class:`ServerContext`; it builds the ensemble of client models and the student.
2. :meth:`ServerMethod.synthesize` makes the synthetic data the method distils on (none for
   FedAvg), checkpointing under ``ctx.state_dir`` as it goes.
3. :meth:`ServerMethod.distill` trains the student on it and returns the global model.
4. :meth:`ServerMethod.evaluate` measures the global model and the ensemble on ``ctx.eval_loader``.

A runtime (the FedML adapter, the benchmark, a test) only calls ``run()``. The arithmetic of each
stage lives in the core modules (``inversion``, ``distill``, ``ensemble``, ``evaluate``), tested
alone; a method only wires them.
"""
from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..config import FedMITRConfig

log = logging.getLogger("fedml_fedmitr")


@dataclass
class ClientUpload:
    """What one client sends once: its trained weights and what it trained on."""

    client_id: int
    state_dict: Dict[str, torch.Tensor]
    num_samples: int
    label_counts: List[int]             # samples per class, length num_classes
    architecture: Optional[str] = None  # the client's timm model name; None: the global model's
    # (depth, 2, embed_dim): mean and variance of the patch tokens entering each block, over the client's
    # own images (core.models.token_moments); what the server's feature prior matches. None: not sent
    feature_stats: Optional[torch.Tensor] = None
    # (num_classes, depth, 2, embed_dim): the same per class of the client's images
    # (core.models.class_token_moments), for the class-conditional prior; None: not sent (the default)
    class_feature_stats: Optional[torch.Tensor] = None

    def to_payload(self) -> Dict[str, Any]:
        """A plain dict (picklable by any FedML backend)."""
        payload = {"client_id": int(self.client_id), "state_dict": self.state_dict,
                   "num_samples": int(self.num_samples), "label_counts": [int(c) for c in self.label_counts]}
        if self.architecture is not None:
            payload["architecture"] = str(self.architecture)
        if self.feature_stats is not None:
            payload["feature_stats"] = self.feature_stats
        if self.class_feature_stats is not None:
            payload["class_feature_stats"] = self.class_feature_stats
        return payload

    @classmethod
    def from_payload(cls, payload: Dict[str, Any]) -> "ClientUpload":
        arch = payload.get("architecture")
        if arch is not None and not isinstance(arch, str):
            raise ValueError(f"architecture must be a model name, got {type(arch).__name__}")
        stats = payload.get("feature_stats")
        if stats is not None and not (isinstance(stats, torch.Tensor) and stats.is_floating_point()
                                      and stats.dim() == 3 and stats.shape[1] == 2):
            raise ValueError("feature_stats must be a float tensor (blocks, 2, embed_dim), got "
                             f"{tuple(stats.shape) if isinstance(stats, torch.Tensor) else type(stats).__name__}")
        class_stats = payload.get("class_feature_stats")
        if class_stats is not None and not (isinstance(class_stats, torch.Tensor) and class_stats.is_floating_point()
                                            and class_stats.dim() == 4 and class_stats.shape[2] == 2
                                            and class_stats.shape[0] == len(payload["label_counts"])):
            raise ValueError("class_feature_stats must be a float tensor (classes, blocks, 2, embed_dim) with one "
                             "row per class of label_counts, got "
                             f"{tuple(class_stats.shape) if isinstance(class_stats, torch.Tensor) else type(class_stats).__name__}")
        return cls(client_id=int(payload["client_id"]), state_dict=payload["state_dict"],
                   num_samples=int(payload["num_samples"]),
                   label_counts=[int(c) for c in payload["label_counts"]], architecture=arch,
                   feature_stats=stats, class_feature_stats=class_stats)


class Callbacks:
    """Progress and metric reporting. The defaults log; subclass to send them elsewhere.

    ``progress(stage, total)`` returns an object with ``update(n)``, ``set_postfix(**kw)`` and
    ``close()`` (a tqdm bar by default, silent when progress is off).
    """

    def __init__(self, progress: bool = True):
        self.show_progress = progress

    def progress(self, stage: str, total: int):
        import sys

        from tqdm.auto import tqdm
        disable = (not self.show_progress) or not getattr(sys.__stderr__, "isatty", lambda: False)()
        return tqdm(total=total, desc=stage, disable=disable, file=sys.__stderr__, leave=False,
                    dynamic_ncols=True)

    def metric(self, name: str, value: float, step: int) -> None:
        """A scalar over time (for example ``inversion/loss`` at iteration ``step``)."""

    def log(self, message: str) -> None:
        log.info(message)

    def images(self, name: str, images: torch.Tensor, labels: torch.Tensor,
               masks: Optional[torch.Tensor]) -> None:
        """A finished synthesis batch (normalised images, labels, keep masks or None)."""

    def close(self) -> None:
        pass


@dataclass
class ServerContext:
    """Everything a server method may use besides the uploads. The server has no training data."""

    model_fn: Callable[[], nn.Module]   # builds a fresh model of the clients' architecture
    num_classes: int
    input_shape: Sequence[int]          # (C, H, W) of the model's input
    mean: Sequence[float]               # per-channel normalisation of the model's input
    std: Sequence[float]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    eval_loader: Optional[Any] = None   # a test DataLoader of (x, y), or None
    state_dir: Optional[Path] = None    # where checkpoints go; None: no checkpoints
    callbacks: Callbacks = field(default_factory=Callbacks)
    seed: int = 0
    pretrained_state: Optional[Dict[str, torch.Tensor]] = None  # for student_init: pretrained
    client_augment: bool = True         # the clients trained with random crops (train_args.client_augment)
    client_flip: bool = True            # ... and horizontal flips (train_args.client_flip)
    model_name: Optional[str] = None    # the global model's timm name (clients of another one: mixed ViTs)
    client_model_fn: Optional[Callable[[str], nn.Module]] = None  # a fresh model of a client architecture

    def model_for(self, upload: "ClientUpload") -> nn.Module:
        """A fresh model of ``upload``'s architecture (the global one unless it names another)."""
        if self.is_global(upload) or self.client_model_fn is None:
            return self.model_fn()
        return self.client_model_fn(upload.architecture)

    def is_global(self, upload: "ClientUpload") -> bool:
        return upload.architecture is None or upload.architecture == self.model_name

    def global_uploads(self, uploads: Sequence["ClientUpload"], what: str) -> List["ClientUpload"]:
        """The uploads of the global architecture (what FedAvg can average), or a ValueError."""
        same = [u for u in uploads if self.is_global(u)]
        if not same:
            raise ValueError(f"{what} averages the clients of the global architecture ({self.model_name}), and no "
                             "client has it (model_args.client_models): add it to client_models, or set "
                             "fedmitr_args.student_init: scratch (or pretrained)")
        return same


@dataclass
class ServerResult:
    """The global model and what the run measured (accuracies, timings, counts)."""

    model: nn.Module
    metrics: Dict[str, Any]


class ServerMethod(abc.ABC):
    """Base class of FedMITR and the baselines. ``name`` is the ``federated_optimizer`` value."""

    name: str = "?"
    needs_synthesis: bool = True
    # the sections of FedMITRConfig (config.SECTIONS) this method reads, and the keys of those sections it
    # sets itself or never reads (a value given for those has no effect)
    sections: Tuple[str, ...] = ("ensemble", "screening", "output")
    forced: Tuple[str, ...] = ()

    @classmethod
    def used_keys(cls) -> Tuple[str, ...]:
        """The ``fedmitr_args`` keys that change what this method does."""
        from ..config import section_keys
        return tuple(k for k in section_keys(cls.sections) if k not in cls.forced)

    @classmethod
    def unused_keys(cls, keys) -> List[str]:
        """Those of ``keys`` that have no effect on this method (another method's settings, or forced)."""
        used = set(cls.used_keys())
        return [k for k in keys if k not in used]

    def __init__(self, config: Optional[FedMITRConfig] = None):
        self.config = (config or FedMITRConfig()).validate()
        self.timings: Dict[str, float] = {}

    # ---- life cycle ----
    def run(self, uploads: Sequence[ClientUpload], ctx: ServerContext) -> ServerResult:
        """Run the whole server side of the one-shot round. Returns the global model and metrics."""
        start = time.perf_counter()
        torch.manual_seed(ctx.seed)
        self.prepare(uploads, ctx)
        t = time.perf_counter()
        pool = self.synthesize(ctx)
        self.timings["synthesis_s"] = time.perf_counter() - t
        t = time.perf_counter()
        model = self.distill(pool, ctx)
        self.timings["distill_s"] = time.perf_counter() - t
        metrics = self.evaluate(model, ctx)
        metrics["num_synthetic"] = int(self.num_synthetic(pool))
        n_images = metrics["num_synthetic"]
        metrics["images_per_s"] = (n_images / self.timings["synthesis_s"]
                                   if n_images and self.timings["synthesis_s"] > 0 else 0.0)
        self.timings["server_total_s"] = time.perf_counter() - start
        metrics["timings"] = dict(self.timings)
        metrics["method"] = self.name
        metrics["clients_used"] = [int(u.client_id) for u in self.uploads]
        if self.screening is not None:
            metrics["screening"] = self.screening.to_dict()
        return ServerResult(model=model, metrics=metrics)

    def prepare(self, uploads: Sequence[ClientUpload], ctx: ServerContext) -> None:
        """Receive the uploads: build ``self.ensemble`` and ``self.student``."""
        from ..ensemble import Ensemble
        from ..models import fedavg_state_dict, load_state_checked

        if not uploads:
            raise ValueError("no client uploads: the server needs at least one client model")
        self.uploads = list(uploads)
        self.ensemble = Ensemble.from_uploads(self.uploads, ctx.model_fn, ctx.num_classes, self.config,
                                              ctx.device, model_for=ctx.model_for)
        self.screening = None
        if self.config.client_screening and len({u.architecture or ctx.model_name for u in self.uploads}) > 1:
            raise ValueError("fedmitr_args.client_screening compares the clients' weights, which needs one "
                             "architecture: these clients have several (model_args.client_models)")
        if self.config.client_screening and len(self.uploads) > 2:
            from ..screening import screen_clients
            self.screening = screen_clients(self.ensemble, self.uploads, self.config, ctx.input_shape, ctx.mean,
                                            ctx.std, ctx.device, ctx.num_classes, ctx.seed, ctx.callbacks)
            keep = self.screening.kept_positions
            if len(keep) < len(self.uploads):
                self.uploads = [self.uploads[i] for i in keep]
                self.ensemble = Ensemble.from_uploads(self.uploads, ctx.model_fn, ctx.num_classes, self.config,
                                                      ctx.device, model_for=ctx.model_for)
        student = ctx.model_fn()
        init = self.config.student_init
        if init == "fedavg":
            load_state_checked(student, fedavg_state_dict(ctx.global_uploads(self.uploads, "student_init: fedavg")),
                               "FedAvg of the client models")
        elif init == "pretrained":
            if ctx.pretrained_state is None:
                raise ValueError("fedmitr_args.student_init = 'pretrained' but no pretrained weights "
                                 "were given (model_args.pretrained / checkpoint)")
            load_state_checked(student, ctx.pretrained_state, "pretrained weights")
        self.student = student.to(ctx.device)

    @abc.abstractmethod
    def synthesize(self, ctx: ServerContext) -> Any:
        """Make the synthetic data to distil on; returns a method-specific pool (or None)."""

    @abc.abstractmethod
    def distill(self, pool: Any, ctx: ServerContext) -> nn.Module:
        """Train ``self.student`` on ``pool``; return the global model."""

    def evaluate(self, model: nn.Module, ctx: ServerContext) -> Dict[str, Any]:
        """Accuracy of the global model and of the ensemble on ``ctx.eval_loader`` (if any)."""
        from ..evaluate import evaluate_ensemble, evaluate_model

        if ctx.eval_loader is None:
            return {}
        res = evaluate_model(model, ctx.eval_loader, ctx.device, ctx.num_classes)
        ens = evaluate_ensemble(self.ensemble, ctx.eval_loader, ctx.device, ctx.num_classes)
        return {"test_acc": res["acc"], "test_loss": res["loss"],
                "per_class_acc": res["per_class_acc"], "predicted_per_class": res["predicted_per_class"],
                "ensemble_acc": ens["acc"], "ensemble_loss": ens["loss"],
                "ensemble_per_class_acc": ens["per_class_acc"],
                "ensemble_predicted_per_class": ens["predicted_per_class"]}

    def num_synthetic(self, pool: Any) -> int:
        return 0 if pool is None else len(pool)
