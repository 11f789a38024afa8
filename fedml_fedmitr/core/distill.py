"""Stage 2: token relabel distillation of the global model on the synthetic pool.

The loss (``token_relabel_loss``), for images x with label y and keep mask M:
    X_h = CLS + tokens where M      (foreground)
    X_l = CLS + tokens where not M  (background)
    q   = softmax(E(X_l) / T)        the ensemble relabels the background tokens (no grad)
    L   = CE(g(X_h), y) + lambda * T^2 * KL(q || softmax(g(X_l) / T))
Ablations: ``kd_full`` (plain KD on full images, T^2 * KL(E(x) || g(x))) and ``ce_foreground``
(CE on X_h only). ``foreground_target: ensemble`` replaces the foreground CE by
T^2 * KL(softmax(E(X_h) / T) || softmax(g(X_h) / T)): the ensemble relabels the kept tokens too.

Mixup (``distill_mixup``, alpha 1 by default where it applies): every batch is mixed with a shuffled
copy of itself (:func:`mix_batch`); only where every target is the ensemble's prediction on the mixed
input (``FedMITRConfig.mixup_alpha``).

Random-resized crop (``distill_crop_scale: s < 1``, :func:`crop_with_mask`): after the shift and flip,
each image is cropped to a random area in [s, 1] of it and resized back, its keep mask following; the
ensemble answers on the crop, so the student learns its function on more views of each pool image.

Proximal term (``prox_weight: mu > 0``): mu/2 * ||w - w_start||^2 is added to every step, w_start the
student at the start of distillation (FedAvg of the uploads, or the pretrained weights), so a
student that starts above what the synthetic pool can teach stays near that start.

Teacher debiasing (``teacher_debias: pool``, :class:`TeacherBias`): the pool's labels are balanced
over the classes, but a mean of label-skewed clients predicts it unevenly (measured: on 4 clients of
3 classes each, the ensemble put 50% of the background tokens in the one class two clients share,
and the student followed). Before distillation the ensemble's mean softmax over the pool is measured
on each view the loss queries (full images, kept tokens, background tokens); its log is then
subtracted from the ensemble's logits on that view, a prior correction estimated on the pool itself.

Warmup (``distill_warmup_epochs: w > 0``, :func:`distill_schedule`): the learning rate rises linearly
over the first w epochs before the cosine decay, so a student that starts from a good FedAvg model is
not moved far by full-rate steps of a fresh AdamW state.

Weight averaging (``distill_ema_epochs: h > 0``, :func:`make_ema`): timm's ``ModelEmaV3`` keeps an
exponential moving average of the student's weights after every step, decay 1 - 1 / (h x steps per
epoch), so its horizon is h epochs whatever the pool size; the average, not the last step, is
evaluated, watched by the drift guard, checkpointed and returned. It starts at the student's start.

Drift guard (``drift_guard: pool_agreement``): ``guard_fraction`` of the pool (every k-th image,
so each class keeps its share) is held out of training; after every epoch the student's agreement
with the ensemble's prediction on those held-out synthetic images is measured, and the student of
the best epoch (its start counted as epoch 0; ties keep the earlier) is returned. It needs no data:
a student that drifts away from what the ensemble knows, or collapses onto a few classes, agrees
less. The loop (:func:`distill_student`) is deterministic given the seed and can be
resumed from any finished epoch.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.utils import ModelEmaV3
from torch import nn

from .client import make_optimizer
from .config import FedMITRConfig
from .ensemble import Ensemble
from .inversion import indices_of, remap_patches
from .models import autocast, forward_tokens


def kd_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(t / T) || softmax(s / T)), batch mean."""
    t = temperature
    return F.kl_div(F.log_softmax(student_logits / t, dim=1), F.softmax(teacher_logits / t, dim=1),
                    reduction="batchmean") * (t * t)


# the lowest temperature kd_target_confidence may set: below it the loss (scaled by T^2) all but vanishes
KD_MIN_TEMPERATURE = 0.05


@torch.no_grad()
def pool_kd_temperature(ensemble: Ensemble, images: torch.Tensor, cfg: FedMITRConfig, device,
                        chunk: int = 256) -> float:
    """The distillation temperature for this pool: ``cfg.kd_temperature``, or, when
    ``cfg.kd_target_confidence`` > 0 and the ensemble's mean top-class probability on the pool's full
    images at that temperature is below the target, the highest lower temperature that reaches it
    (bisection in log space), or ``KD_MIN_TEMPERATURE`` when none above it does (label-sorted digits:
    five clients of two classes each give no class more than 1/5 of the teacher's mass at T = 1, and
    their margins are too small to reach 0.5 even at the floor). The mean top-class probability falls
    as T rises, so the answer is unique; it depends only on the pool and the ensemble, so a resumed
    run finds the same."""
    t0, target = float(cfg.kd_temperature), float(cfg.kd_target_confidence)
    if target <= 0 or images.shape[0] == 0:
        return t0
    logits = torch.cat([ensemble(images[i:i + chunk].to(device)).float().cpu()
                        for i in range(0, images.shape[0], chunk)])

    def confidence(t: float) -> float:
        return float((logits / t).softmax(1).max(1).values.mean())

    if confidence(t0) >= target:
        return t0
    low, high = KD_MIN_TEMPERATURE, t0
    if low >= high or confidence(low) < target:
        return min(low, high)
    for _ in range(40):        # confidence(low) >= target > confidence(high)
        mid = math.sqrt(low * high)
        if confidence(mid) >= target:
            low = mid
        else:
            high = mid
    return low


def background_targets(ensemble: Ensemble, x: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """The relabel target of the background set: the ensemble's soft prediction on exactly X_l."""
    with torch.no_grad():
        return F.softmax(ensemble(x, indices_of(~mask)) / temperature, dim=1)


class TeacherBias:
    """Log of the ensemble's mean softmax over the pool, per view ("full", "foreground", "background");
    :meth:`teacher` returns the ensemble's logits on a view minus it (``teacher_debias: pool``)."""

    VIEWS = ("full", "foreground", "background")

    def __init__(self, ensemble: Ensemble, images: torch.Tensor, masks: torch.Tensor, device, chunk: int = 256):
        self.ensemble = ensemble
        sums = {v: None for v in self.VIEWS}
        counts = {v: 0 for v in self.VIEWS}
        with torch.no_grad():
            for i in range(0, images.shape[0], chunk):
                x, m = images[i:i + chunk].to(device), masks[i:i + chunk].to(device)
                views = {"full": None, "foreground": indices_of(m)}
                if bool((~m).any(1).all()):
                    views["background"] = indices_of(~m)
                for view, idx in views.items():
                    p = ensemble(x, idx).float().softmax(1).sum(0)
                    sums[view] = p if sums[view] is None else sums[view] + p
                    counts[view] += x.shape[0]
        self.log_prior = {v: (sums[v] / counts[v]).clamp_min(1e-8).log() for v in self.VIEWS if counts[v]}

    def teacher(self, x: torch.Tensor, idx: Optional[torch.Tensor], view: str) -> torch.Tensor:
        logits = self.ensemble(x, idx)
        bias = self.log_prior.get(view)
        return logits if bias is None else logits - bias.to(logits.dtype)


def teacher_logits(ensemble: Ensemble, x: torch.Tensor, idx: Optional[torch.Tensor], view: str,
                   bias: Optional[TeacherBias]) -> torch.Tensor:
    """The distillation target's logits on one view, debiased when ``bias`` is given (no grad)."""
    with torch.no_grad():
        return ensemble(x, idx) if bias is None else bias.teacher(x, idx, view)


def token_relabel_loss(student: nn.Module, ensemble: Ensemble, x: torch.Tensor, y: torch.Tensor,
                       mask: torch.Tensor, cfg: FedMITRConfig,
                       bias: Optional[TeacherBias] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The distillation loss of one batch for ``cfg.distill_mode``; returns (loss, parts)."""
    t = cfg.kd_temperature
    if cfg.distill_mode == "kd_full":
        teacher = teacher_logits(ensemble, x, None, "full", bias)
        kl = kd_kl(teacher, student(x), t)
        return kl, {"kl": kl.item()}
    idx_h = indices_of(mask)
    if cfg.foreground_target == "ensemble" and cfg.distill_mode == "token_relabel":
        h_logits = teacher_logits(ensemble, x, idx_h, "foreground", bias)
        ce = kd_kl(h_logits, forward_tokens(student, x, idx_h), t)
    else:
        ce = F.cross_entropy(forward_tokens(student, x, idx_h), y)
    parts = {"ce": ce.item()}
    loss = ce
    if cfg.distill_mode == "token_relabel" and bool((~mask).any()):
        idx_l = indices_of(~mask)
        q_logits = teacher_logits(ensemble, x, idx_l, "background", bias)
        kl = kd_kl(q_logits, forward_tokens(student, x, idx_l), t)
        loss = ce + cfg.relabel_weight * kl
        parts["kl"] = kl.item()
    return loss, parts


def mix_batch(x: torch.Tensor, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """lambda * x + (1 - lambda) * x[perm], lambda ~ Beta(alpha, alpha), perm a shuffle of the batch
    (both drawn from ``gen``: deterministic). The targets come from the ensemble on the mixed images,
    so a pool of n images teaches the student on the ensemble's function between them too; the keep
    mask stays the first image's."""
    import numpy as np
    lam = float(np.random.default_rng(int(torch.randint(0, 2 ** 31 - 1, (1,), generator=gen))).beta(alpha, alpha))
    perm = torch.randperm(x.shape[0], generator=gen).to(x.device)
    return lam * x + (1.0 - lam) * x[perm]


def augment_with_mask(x: torch.Tensor, mask: torch.Tensor, grid: Tuple[int, int], patch: Tuple[int, int],
                      gen: torch.Generator, allow_flip: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random whole-patch shift (roll, up to one patch) and h-flip of a batch, applied to the images
    and their keep masks together so each mask still marks the same content."""
    gh, gw = grid
    sr = int(torch.randint(-1, 2, (1,), generator=gen)) if gh > 1 else 0
    sc = int(torch.randint(-1, 2, (1,), generator=gen)) if gw > 1 else 0
    flip = bool(torch.rand(1, generator=gen).item() < 0.5) and allow_flip
    x = torch.roll(x, shifts=(sr * patch[0], sc * patch[1]), dims=(2, 3))
    if flip:
        x = x.flip(3)
    ids = torch.arange(gh * gw, device=mask.device)
    new_pos = remap_patches(ids, grid, (sr, sc), flip)          # old patch id -> new patch id
    new_mask = torch.zeros_like(mask)
    new_mask[:, new_pos] = mask[:, ids]
    return x, new_mask


def crop_with_mask(x: torch.Tensor, mask: torch.Tensor, grid: Tuple[int, int], patch: Tuple[int, int],
                   scale: float, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """A random-resized crop of each image of a batch (area a fraction in [``scale``, 1] of the image,
    aspect ratio in [3/4, 4/3] where it fits, position uniform inside the image), resized back to the full size
    (bilinear), with its keep mask. The mask follows the content: each output patch is scored by the
    share of its pixels that came from kept patches, and the same number of patches as before is kept,
    the best covered first (ties to the lower patch id), so a batch still keeps one count per image.
    The crop parameters come from ``gen`` (torchvision's ``RandomResizedCrop.get_params`` draws from
    the global generator, which would make a resumed run differ); the resampling is torch's
    ``affine_grid`` / ``grid_sample``, one call for the batch."""
    b = x.shape[0]
    u = torch.rand(b, 4, generator=gen)
    area = scale + (1.0 - scale) * u[:, 0]
    # the aspect ratio's range is narrowed where the crop would not fit (area 1: a square, the image)
    low, high = torch.log(area.clamp(min=3 / 4)), torch.log((1.0 / area).clamp(max=4 / 3))
    ratio = torch.exp(low + (high - low) * u[:, 1])
    w, h = torch.sqrt(area * ratio), torch.sqrt(area / ratio)   # fractions of the image's width and height
    cx = (1.0 - w) * (2.0 * u[:, 2] - 1.0)            # centre, in grid_sample's [-1, 1] coordinates
    cy = (1.0 - h) * (2.0 * u[:, 3] - 1.0)
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = w, cx, h, cy
    theta = theta.to(device=x.device, dtype=x.dtype)
    sample = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, sample, mode="bilinear", padding_mode="border", align_corners=False)
    gh, gw = grid
    kept = mask.to(x.dtype).view(b, 1, gh, gw)
    kept = kept.repeat_interleave(patch[0], dim=2).repeat_interleave(patch[1], dim=3)
    cover = F.grid_sample(kept, sample, mode="bilinear", padding_mode="border", align_corners=False)
    cover = F.avg_pool2d(cover, kernel_size=patch).view(b, gh * gw)
    n = gh * gw
    cover = cover - torch.arange(n, device=cover.device, dtype=cover.dtype) * (1e-3 / n)
    k = int(mask[0].sum())
    new_mask = torch.zeros_like(mask)
    new_mask.scatter_(1, cover.topk(k, dim=1).indices, True)
    return out, new_mask


def distill_student(student: nn.Module, ensemble: Ensemble, images: torch.Tensor, labels: torch.Tensor,
                    masks: torch.Tensor, cfg: FedMITRConfig, device, seed: int = 0, callbacks=None,
                    eval_fn: Optional[Callable[[nn.Module], float]] = None,
                    checkpoint: Optional[Callable[[dict], None]] = None,
                    resume_state: Optional[dict] = None, flip: bool = True) -> nn.Module:
    """Train ``student`` on the pool for ``cfg.distill_epochs`` epochs.

    ``checkpoint(state)`` is called after every epoch with everything needed to continue
    (``resume_state``; it holds live references, so serialise or copy it at once): student, optimizer and scheduler states and the next epoch. Batches and
    augmentation of epoch e come from a generator seeded by (seed, e), so a resumed run is
    bit-identical on CPU to one never interrupted.
    """
    student.to(device).train()
    # measured on the whole pool (the guard's held-out images included), before any training
    bias = TeacherBias(ensemble, images, masks, device) if cfg.teacher_debias == "pool" else None
    guard = None
    if cfg.drift_guard == "pool_agreement":
        guard = DriftGuard(ensemble, images, cfg.guard_fraction, device)
        keep = guard.train_positions
        images, labels, masks = images[keep], labels[keep], masks[keep]
    n = images.shape[0]
    grid = tuple(int(g) for g in student.patch_embed.grid_size)
    patch = tuple(int(p) for p in student.patch_embed.patch_size)
    steps_per_epoch = (n + cfg.distill_batch_size - 1) // cfg.distill_batch_size
    mixup = cfg.mixup_alpha()
    opt = make_optimizer(student.parameters(), cfg.distill_optimizer, cfg.distill_lr, cfg.distill_weight_decay)
    sched = distill_schedule(opt, cfg, steps_per_epoch)
    ema = make_ema(student, cfg, steps_per_epoch)
    judged = ema.module if ema is not None else student   # the model evaluated, guarded and returned
    start_epoch = 0
    # the proximal term's anchor: the student as it starts (before a resumed state is loaded)
    anchor = ([p.detach().clone() for p in student.parameters()] if cfg.prox_weight > 0 else None)
    if resume_state is not None:
        if anchor is not None and resume_state.get("anchor") is not None:
            anchor = [a.clone() for a in resume_state["anchor"]]
        student.load_state_dict(resume_state["student"])
        opt.load_state_dict(resume_state["optimizer"])
        sched.load_state_dict(resume_state["scheduler"])
        start_epoch = int(resume_state["epoch"])
        if ema is not None:
            ema.module.load_state_dict(resume_state["ema"])
        if guard is not None:
            guard.load_state(resume_state.get("guard"))
    if guard is not None and start_epoch == 0:
        guard.observe(judged, 0)
        student.train()
    bar = callbacks.progress("distillation", cfg.distill_epochs) if callbacks else None
    if bar is not None:
        bar.update(start_epoch)
    for epoch in range(start_epoch, cfg.distill_epochs):
        gen = torch.Generator().manual_seed(int(seed) * 7_919 + epoch)
        order = torch.randperm(n, generator=gen)
        totals: Dict[str, float] = {}
        for s in range(steps_per_epoch):
            idx = order[s * cfg.distill_batch_size:(s + 1) * cfg.distill_batch_size]
            x, y, m = images[idx].to(device), labels[idx].to(device), masks[idx].to(device)
            if cfg.distill_augment:
                x, m = augment_with_mask(x, m, grid, patch, gen, allow_flip=flip)
            if cfg.distill_crop_scale < 1.0:
                x, m = crop_with_mask(x, m, grid, patch, cfg.distill_crop_scale, gen)
            if mixup > 0:
                x = mix_batch(x, mixup, gen)
            with autocast(device, cfg.autocast):
                loss, parts = token_relabel_loss(student, ensemble, x, y, m, cfg, bias)
            loss = loss.float()
            if anchor is not None:
                prox = sum(((p - a) ** 2).sum() for p, a in zip(student.parameters(), anchor))
                loss = loss + 0.5 * cfg.prox_weight * prox
                parts["prox"] = float(prox.item())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if ema is not None:
                ema.update(student)
            for k, v in parts.items():
                totals[k] = totals.get(k, 0.0) + v / steps_per_epoch
            totals["loss"] = totals.get("loss", 0.0) + loss.item() / steps_per_epoch
        if callbacks is not None:
            for k, v in totals.items():
                callbacks.metric(f"distill/{k}", v, epoch)
        if eval_fn is not None and cfg.eval_every and ((epoch + 1) % cfg.eval_every == 0):
            acc = eval_fn(judged)
            student.train()
            if callbacks is not None:
                callbacks.metric("distill/test_acc", acc, epoch)
        if guard is not None:
            agreement = guard.observe(judged, epoch + 1)
            student.train()
            if callbacks is not None:
                callbacks.metric("distill/guard_agreement", agreement, epoch)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{totals.get('loss', 0.0):.3f}")
        if checkpoint is not None:
            checkpoint({"student": student.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch + 1,
                        "guard": guard.state() if guard is not None else None, "anchor": anchor,
                        "ema": ema.module.state_dict() if ema is not None else None})
    if bar is not None:
        bar.close()
    if ema is not None:
        student.load_state_dict(ema.module.state_dict())
    if guard is not None:
        guard.restore_best(student)
        if callbacks is not None:
            callbacks.log(f"drift guard: returning the student of epoch {guard.best_epoch} (agreement with the "
                          f"ensemble {guard.best:.1%} on {len(guard.held_out)} held-out synthetic images)")
    student.eval()
    return student


def make_ema(student: nn.Module, cfg: FedMITRConfig, steps_per_epoch: int):
    """timm's ``ModelEmaV3`` of the student with a horizon of ``cfg.distill_ema_epochs`` epochs, or None
    when it is off (0)."""
    if cfg.distill_ema_epochs <= 0:
        return None
    decay = 1.0 - 1.0 / max(1.0, cfg.distill_ema_epochs * steps_per_epoch)
    return ModelEmaV3(student, decay=decay)


def distill_schedule(opt: torch.optim.Optimizer, cfg: FedMITRConfig, steps_per_epoch: int):
    """Cosine decay over all distillation steps; with ``distill_warmup_epochs`` > 0, a linear rise over
    those epochs first (from 1/warmup-steps of the rate to the full rate), then the cosine over the rest."""
    total = max(1, cfg.distill_epochs * steps_per_epoch)
    warm = cfg.distill_warmup_epochs * steps_per_epoch
    if warm <= 0:
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
    rise = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / warm, end_factor=1.0, total_iters=warm)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, total - warm))
    return torch.optim.lr_scheduler.SequentialLR(opt, [rise, decay], milestones=[warm])


class DriftGuard:
    """Keeps the student that agrees best with the ensemble on held-out synthetic images."""

    def __init__(self, ensemble: Ensemble, images: torch.Tensor, fraction: float, device):
        n = images.shape[0]
        step = max(2, int(round(1.0 / fraction)))
        positions = torch.arange(n)
        held = positions[(positions % step) == step - 1]
        if len(held) == 0 or len(held) == n:
            raise ValueError(f"drift guard: a pool of {n} images cannot hold out a fraction {fraction}")
        self.held_out = images[held]
        self.train_positions = positions[(positions % step) != step - 1]
        self.device = device
        with torch.no_grad():
            self.targets = torch.cat([ensemble(self.held_out[i:i + 256].to(device)).argmax(1).cpu()
                                      for i in range(0, len(held), 256)])
        self.best, self.best_epoch, self.best_state = -1.0, -1, None

    @torch.no_grad()
    def agreement(self, student: nn.Module) -> float:
        student.eval()
        preds = torch.cat([student(self.held_out[i:i + 256].to(self.device)).argmax(1).cpu()
                           for i in range(0, len(self.targets), 256)])
        return float((preds == self.targets).float().mean())

    def observe(self, student: nn.Module, epoch: int) -> float:
        score = self.agreement(student)
        if score > self.best:
            self.best, self.best_epoch = score, epoch
            self.best_state = {k: v.detach().cpu().clone() for k, v in student.state_dict().items()}
        return score

    def restore_best(self, student: nn.Module) -> None:
        if self.best_state is not None:
            student.load_state_dict(self.best_state)

    def state(self) -> dict:
        return {"best": self.best, "best_epoch": self.best_epoch, "best_state": self.best_state}

    def load_state(self, state: Optional[dict]) -> None:
        if state:
            self.best, self.best_epoch, self.best_state = state["best"], state["best_epoch"], state["best_state"]
