"""FedMITR: sparse model inversion (stage 1) + token relabel distillation (stage 2).

Also the DeepInversion baseline, which is the same pipeline with dense inversion and plain KD on
full images at the DeepInversion/DENSE temperature, and the three ablations: each a subclass that
fixes the keys it names in ``forced``.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from ..checkpoint import load_if_exists, save_atomic
from ..config import FedMITRConfig, resolve_augmentation
from ..distill import distill_student, pool_kd_temperature
from ..evaluate import evaluate_model
from ..inversion import SparseModelInversion, SyntheticPool, balanced_labels
from ..pool_stats import pool_student_stats, pool_teacher_stats
from . import register_method
from .base import ServerContext, ServerMethod


@register_method
class FedMITR(ServerMethod):
    """One-shot FedMITR. Checkpoints: ``pool.pt`` after every synthesis batch, ``distill.pt``
    after every distillation epoch (under ``ctx.state_dir``); ``resume: true`` continues from them."""

    name = "FedMITR"
    sections = ServerMethod.sections + ("inversion", "student", "distillation", "compute")
    # the user's keys behind the config's kd_temperature / kd_target_confidence (for the log)
    temperature_keys = ("kd_temperature", "kd_target_confidence")

    def _state_path(self, ctx: ServerContext, name: str):
        return None if ctx.state_dir is None else ctx.state_dir / f"{self.name}_{name}"

    def synthesize(self, ctx: ServerContext) -> SyntheticPool:
        cfg = self.config
        # competition_weight: a frozen copy of the student's start, which the pool is pushed away from
        start = copy.deepcopy(self.student) if cfg.competition_weight > 0 else None
        inverter = SparseModelInversion(self.ensemble, cfg, ctx.input_shape, ctx.mean, ctx.std, ctx.device,
                                        ctx.callbacks, ctx.client_augment, ctx.client_flip, start=start)
        path = self._state_path(ctx, "pool.pt")
        saved = load_if_exists(path) if cfg.resume else None
        pool = SyntheticPool.from_state(saved) if saved is not None else SyntheticPool()
        if saved is not None:
            ctx.callbacks.log(f"resuming synthesis with {len(pool)} images from {path}")
        num_batches = (cfg.num_synthetic + cfg.synthesis_batch_size - 1) // cfg.synthesis_batch_size
        for b in range(len(pool.batches), num_batches):
            size = min(cfg.synthesis_batch_size, cfg.num_synthetic - b * cfg.synthesis_batch_size)
            labels = balanced_labels(cfg.synthesis_batch_size, ctx.num_classes, b)[:size]
            batch = inverter.synthesize(labels, batch_index=b, seed=ctx.seed)
            pool.add(batch)
            ctx.callbacks.images(f"synthetic_batch_{b}", batch.images, batch.labels, batch.masks)
            if path is not None:
                save_atomic(pool.state(), path)
        return pool

    def distill(self, pool: SyntheticPool, ctx: ServerContext) -> nn.Module:
        images, labels, masks = pool.tensors()
        self._pool = (images, labels, masks)       # measured after distillation (evaluate)
        ctx.callbacks.log(f"synthetic pool: {len(labels)} images, {int(masks[0].sum())}/{masks.shape[1]} "
                          "patches in the foreground")
        path = self._state_path(ctx, "distill.pt")
        resume_state = load_if_exists(path) if self.config.resume else None
        if resume_state is not None:
            ctx.callbacks.log(f"resuming distillation at epoch {resume_state['epoch']} from {path}")
            _set_rng_state(resume_state.get("rng"))
        eval_fn = None
        if ctx.eval_loader is not None:
            def eval_fn(model):
                return evaluate_model(model, ctx.eval_loader, ctx.device, ctx.num_classes)["acc"]
        # with torch's global RNG state, so a student with dropout / drop-path also resumes bit-identically
        checkpoint = (lambda state: save_atomic({**state, "rng": _rng_state()}, path)) if path is not None else None
        cfg = self.config
        self._kd_temperature = pool_kd_temperature(self.ensemble, images, cfg, ctx.device)
        if self._kd_temperature != cfg.kd_temperature:
            t_key, c_key = self.temperature_keys
            ctx.callbacks.log(f"distillation temperature {self._kd_temperature:.4g} instead of {t_key} "
                              f"{cfg.kd_temperature:g}: at {cfg.kd_temperature:g} the ensemble's mean top-class "
                              f"probability on the pool is below {c_key} = {cfg.kd_target_confidence:g}")
            cfg = cfg.replace(kd_temperature=self._kd_temperature)
        return distill_student(self.student, self.ensemble, images, labels, masks, cfg, ctx.device,
                               seed=ctx.seed, callbacks=ctx.callbacks, eval_fn=eval_fn,
                               checkpoint=checkpoint, resume_state=resume_state,
                               flip=resolve_augmentation(self.config, min(ctx.input_shape[1:]), ctx.client_augment,
                                                         ctx.client_flip)[1])

    def evaluate(self, model, ctx):
        metrics = super().evaluate(model, ctx)
        if getattr(self, "_pool", None) is not None:
            images, labels, masks = self._pool
            teacher, teacher_pred = pool_teacher_stats(self.ensemble, images, labels, masks, ctx.num_classes,
                                                       ctx.device, with_predictions=True)
            student = pool_student_stats(model, self.ensemble, images, ctx.num_classes, ctx.device, teacher_pred)
            metrics["pool_ensemble_fit"] = teacher["fit"]
            metrics["kd_temperature"] = getattr(self, "_kd_temperature", self.config.kd_temperature)
            metrics["pool"] = {**teacher, **student}
            ctx.callbacks.log(
                f"synthetic pool: {teacher['fit']:.1%} classified as their target by the ensemble; per class, "
                f"labels {teacher['labels']}, ensemble predictions {teacher['ensemble_pred']}, on the background "
                f"tokens {teacher['background_pred']}, global model {student['student_pred']} (agrees with the "
                f"ensemble on {student['student_agreement']:.1%})")
        return metrics


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Optional[dict]) -> None:
    if not state:
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@register_method
class DeepInversion(FedMITR):
    """DeepInversion for ViTs: dense inversion of the ensemble + KL distillation on full images at
    ``baseline_kd_temperature`` (20 in the SMI/DENSE code), lowered by FedMITR's confidence rule when
    ``baseline_kd_target_confidence`` > 0."""

    name = "DeepInversion"
    forced = ("inversion", "distill_mode", "kd_temperature", "kd_target_confidence", "relabel_weight",
              "foreground_target", "attention_weighting", "final_mask")   # dense, full images: no mask
    temperature_keys = ("baseline_kd_temperature", "baseline_kd_target_confidence")

    def __init__(self, config: Optional[FedMITRConfig] = None):
        cfg = config or FedMITRConfig()
        super().__init__(cfg.replace(inversion="dense", distill_mode="kd_full",
                                     kd_temperature=cfg.baseline_kd_temperature,
                                     kd_target_confidence=cfg.baseline_kd_target_confidence))

    @classmethod
    def used_keys(cls):
        return super().used_keys() + ("baseline_kd_temperature", "baseline_kd_target_confidence")


@register_method
class FedMITRDense(FedMITR):
    """Ablation: dense inversion + token relabel (mask from attention)."""

    name = "FedMITR-dense"
    forced = ("inversion", "final_mask")   # the prune schedule still sizes the foreground of the masks,
                                           # which are always computed on the final images

    def __init__(self, config: Optional[FedMITRConfig] = None):
        super().__init__((config or FedMITRConfig()).replace(inversion="dense"))


@register_method
class FedMITRKD(FedMITR):
    """Ablation: sparse inversion + plain KD on full images."""

    name = "FedMITR-kd"
    forced = ("distill_mode", "relabel_weight", "foreground_target", "final_mask")   # full images: no mask

    def __init__(self, config: Optional[FedMITRConfig] = None):
        super().__init__((config or FedMITRConfig()).replace(distill_mode="kd_full"))


@register_method
class FedMITRCE(FedMITR):
    """Ablation: sparse inversion + CE on the foreground tokens only."""

    name = "FedMITR-ce"
    forced = ("distill_mode", "relabel_weight", "kd_temperature", "kd_target_confidence", "foreground_target")

    def __init__(self, config: Optional[FedMITRConfig] = None):
        super().__init__((config or FedMITRConfig()).replace(distill_mode="ce_foreground", kd_target_confidence=0.0))
