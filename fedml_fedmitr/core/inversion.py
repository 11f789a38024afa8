"""Stage 1: sparse model inversion of the client ensemble (dense inversion = pruning off).

:class:`SparseModelInversion` is a synthesizer: ``synthesize(labels, batch_index)`` optimises one
batch of images and returns a :class:`SyntheticBatch` (images, labels, keep masks). The pool it
fills, :class:`SyntheticPool`, is consumed by the distillation loop (``distill.py``).

Per batch (the paper's stage 1, as SMI does it): x ~ N(0, 1) in normalised pixel space, Adam on x; at each prune
point the patches are ranked by the ensemble's last-block CLS-to-patch attention (un-augmented
forward on the kept tokens) and the low-attention ones leave the forward pass and are halted: their
pixels stay bit-identical to the end. Loss: CE(E(jitter(x) on kept tokens), y) + tv * TV_l2(x).
With ``color_shift`` the jittered view's channels are also scaled and offset at random (a pointwise
change, so the kept tokens are the same); the image itself stays unshifted. With ``competition_weight``
w > 0 the loss adds w * (1 - JS(ensemble, start)) on the same view and tokens, where ``start`` is the
student before distillation (frozen): the images become ones the ensemble labels y and the start does
not, i.e. the knowledge distillation has to add (Adaptive DeepInversion's competition term). With
``boundary_fraction`` f > 0 a share f of each batch is inverted towards a soft target of two classes
(:meth:`SparseModelInversion.soft_targets`) instead of its one label. With ``feature_weight`` w > 0
the loss adds w * :func:`feature_stats_loss`: the mean and variance of the (kept) patch tokens entering
each block of each client's ViT, on the batch, pulled towards what that client measured on its own
data and uploaded (DeepInversion's BatchNorm-statistics prior, for a ViT, which has no BatchNorm).
With ``feature_tokens: all`` the halted patches count too once pruning starts: at each prune point a
full forward (no gradient) measures their block inputs, and the moments pool them with the kept ones.
With ``feature_prior: per_class`` the prior is class-conditional (:func:`class_feature_stats_loss`):
the batch's images of each class are matched to what the clients that hold the class measured on
their images of it.

Two choices beyond the paper decide which patches are the foreground. ``attention_weighting:
class_share`` ranks the patches by the clients' attention weighted by each client's share of the
image's target class (its label count over all clients' count of the class; the clients' mean for a
class no client holds), instead of the clients' mean: the patches that matter are judged by the clients
that know the class. ``final_mask: recompute`` recomputes the keep mask once inversion ends, on the
final image with every token in the forward pass, keeping as many patches as the last prune point
kept; by default (``last_prune``) the mask is the set the last prune point left to be inverted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import FedMITRConfig, resolve_augmentation
from .ensemble import Ensemble, client_weights
from .models import autocast, forward_tokens, group_moments, patch_token_sums, pooled_moments


@dataclass
class SyntheticBatch:
    images: torch.Tensor   # (B, C, H, W) in normalised pixel space
    labels: torch.Tensor   # (B,) synthesis targets
    masks: torch.Tensor    # (B, N) bool: True = kept (foreground) patch


class SyntheticPool:
    """The synthetic images made so far, with their labels and keep masks."""

    def __init__(self) -> None:
        self.batches: List[SyntheticBatch] = []

    def add(self, batch: SyntheticBatch) -> None:
        self.batches.append(SyntheticBatch(batch.images.detach().cpu(), batch.labels.detach().cpu(),
                                           batch.masks.detach().cpu()))

    def __len__(self) -> int:
        return sum(len(b.labels) for b in self.batches)

    def tensors(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.batches:
            raise ValueError("the synthetic pool is empty")
        return (torch.cat([b.images for b in self.batches]), torch.cat([b.labels for b in self.batches]),
                torch.cat([b.masks for b in self.batches]))

    def state(self) -> dict:
        return {"batches": [(b.images, b.labels, b.masks) for b in self.batches]}

    @classmethod
    def from_state(cls, state: dict) -> "SyntheticPool":
        pool = cls()
        pool.batches = [SyntheticBatch(*t) for t in state["batches"]]
        return pool


def tv_l2(x: torch.Tensor) -> torch.Tensor:
    """l2 total variation: sum of the Frobenius norms of the four directional differences."""
    d1 = x[:, :, :, :-1] - x[:, :, :, 1:]
    d2 = x[:, :, :-1, :] - x[:, :, 1:, :]
    d3 = x[:, :, 1:, :-1] - x[:, :, :-1, 1:]
    d4 = x[:, :, :-1, :-1] - x[:, :, 1:, 1:]
    return torch.norm(d1) + torch.norm(d2) + torch.norm(d3) + torch.norm(d4)


def js_divergence(logits_a: torch.Tensor, logits_b: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of the Jensen-Shannon divergence (nats, in [0, ln 2]) of two softmaxes."""
    log_p, log_q = F.log_softmax(logits_a.float(), 1), F.log_softmax(logits_b.float(), 1)
    log_m = torch.logsumexp(torch.stack([log_p, log_q]), 0) - math.log(2.0)
    return 0.5 * (F.kl_div(log_m, log_p, reduction="batchmean", log_target=True)
                  + F.kl_div(log_m, log_q, reduction="batchmean", log_target=True))


def feature_stats_loss(moments: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor:
    """DeepInversion's feature prior on token moments: per client, sum over blocks of the l2 distances
    between the batch's token mean and variance at the block's input and the client's own (both
    (depth, 2, embed_dim)), averaged over the clients."""
    total = 0.0
    for m, t in zip(moments, targets):
        total = total + (m - t.to(m.dtype)).norm(dim=2).sum()
    return total / len(targets)


def class_feature_stats_loss(per_image: Sequence[torch.Tensor], labels: torch.Tensor,
                             targets: Sequence[torch.Tensor], shares: torch.Tensor) -> torch.Tensor:
    """The class-conditional feature prior: for each class y in the batch, the sum over the clients k that
    hold it, weighted by their share of its images (``shares`` (K, C), columns summing to 1), of
    :func:`feature_stats_loss`'s distance between the token moments of the batch's images of class y and
    those client k measured on its own images of class y (``targets``, K tensors (C, depth, 2, D));
    averaged over the classes in the batch. ``per_image``: K tensors (B, depth, 2, D), see
    :func:`~fedml_fedmitr.core.models.run_blocks`."""
    num_classes = shares.shape[1]
    present = None
    total = 0.0
    for k, (m, t) in enumerate(zip(per_image, targets)):
        moments, counts = group_moments(m, labels, num_classes)             # (C, depth, 2, D), (C,)
        present = counts > 0
        dist = (moments - t.to(moments.dtype)).norm(dim=-1).sum(dim=(1, 2))  # (C,)
        total = total + (dist * shares[k].to(dist.dtype) * present).sum()
    return total / present.sum().clamp_min(1)


def balanced_labels(batch_size: int, num_classes: int, batch_index: int) -> torch.Tensor:
    """Labels cycling over the classes, continuing from batch to batch so the pool stays balanced."""
    start = batch_index * batch_size
    return (torch.arange(start, start + batch_size) % num_classes).long()


def patch_mask_to_pixels(mask: torch.Tensor, grid: Tuple[int, int], patch: Tuple[int, int],
                         image_hw: Tuple[int, int]) -> torch.Tensor:
    """(B, N) patch mask -> (B, 1, H, W) pixel mask (pixels outside the patch grid: False)."""
    b = mask.shape[0]
    gh, gw = grid
    m = mask.view(b, 1, gh, gw).float()
    m = m.repeat_interleave(patch[0], dim=2).repeat_interleave(patch[1], dim=3)
    h, w = image_hw
    out = torch.zeros(b, 1, h, w, device=mask.device)
    out[:, :, :m.shape[2], :m.shape[3]] = m
    return out.bool()


def remap_patches(idx: torch.Tensor, grid: Tuple[int, int], shift_patches: Tuple[int, int],
                  flip: bool) -> torch.Tensor:
    """Patch ids after rolling the image by whole patches (rows, cols) and an optional h-flip."""
    gh, gw = grid
    r, c = idx // gw, idx % gw
    r = (r + shift_patches[0]) % gh
    c = (c + shift_patches[1]) % gw
    if flip:
        c = gw - 1 - c
    return r * gw + c


def indices_of(mask: torch.Tensor) -> torch.Tensor:
    """(B, N) bool mask with the same count per row -> (B, k) sorted patch ids."""
    counts = mask.sum(1)
    if not bool((counts == counts[0]).all()):
        raise ValueError("every image of a batch must keep the same number of patches")
    return mask.nonzero()[:, 1].view(mask.shape[0], -1)


def class_shares(ensemble: Ensemble) -> torch.Tensor:
    """(K, C) each client's share of each class's training images (its label count over all the clients'
    count of the class); 1/K for a class no client holds. A ValueError if the clients sent no label counts."""
    if ensemble.label_counts is None:
        raise ValueError("fedmitr_args.attention_weighting = 'class_share' weights each client's attention by its "
                         "share of the class, but the clients' label counts are not known; use 'mean'")
    counts = ensemble.label_counts.tolist()
    return client_weights("per_class", [0] * len(counts), counts, len(counts[0]))   # the ensemble's per-class weights


class SparseModelInversion:
    """Synthesizer: inverts the ensemble into images, pruning low-attention patches as it goes."""

    def __init__(self, ensemble: Ensemble, cfg: FedMITRConfig, input_shape: Sequence[int],
                 mean: Sequence[float], std: Sequence[float], device, callbacks=None,
                 client_augment: bool = True, client_flip: bool = True, start: Optional[nn.Module] = None):
        self.ensemble = ensemble
        self.cfg = cfg
        # the student before distillation, frozen: what the competition term pushes the images away from
        self.start = None
        if cfg.competition_weight > 0:
            if start is None:
                raise ValueError("competition_weight > 0 needs the student's starting model (start=...)")
            self.start = start.to(device).eval().requires_grad_(False)
        # feature_weight: what each client measured on its data, which the images' token moments must match
        # (feature_prior: per_class, the same per class, with each client's share of each class's images)
        self.feature_stats = self.class_shares = None
        if cfg.feature_weight > 0 and cfg.feature_prior == "per_class":
            self.feature_stats, self.class_shares = ensemble.checked_class_feature_stats()
        elif cfg.feature_weight > 0:
            self.feature_stats = ensemble.checked_feature_stats(f"fedmitr_args.feature_weight = {cfg.feature_weight}")
        self.c, self.h, self.w = (int(v) for v in input_shape)
        vit = ensemble.models[0]
        self.num_classes = int(vit.num_classes)
        self.grid = tuple(int(g) for g in vit.patch_embed.grid_size)
        self.patch = tuple(int(p) for p in vit.patch_embed.patch_size)
        self.num_patches = self.grid[0] * self.grid[1]
        self.device = torch.device(device)
        mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.lo = ((0.0 - mean_t) / std_t).to(self.device)
        self.hi = ((1.0 - mean_t) / std_t).to(self.device)
        self.prune_points = cfg.prune_iterations()
        self.keep_counts = cfg.keep_counts(self.num_patches) if self.prune_points else []
        self.callbacks = callbacks
        self.jitter, self.flip = resolve_augmentation(cfg, min(self.h, self.w), client_augment, client_flip)
        # attention_weighting: class_share, the (K, C) weights of the clients' attention per target class
        self.attention_shares = None
        if cfg.attention_weighting == "class_share":
            self.attention_shares = class_shares(ensemble).to(self.device)

    def _prune(self, x: torch.Tensor, keep: torch.Tensor, count: int,
               labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Keep the ``count`` currently-kept patches of highest ensemble CLS attention."""
        attn = self.attention(x, keep, labels)                       # (B, k_current)
        top = attn.topk(count, dim=1).indices
        return keep.gather(1, top).sort(dim=1).values

    @torch.no_grad()
    def attention(self, x: torch.Tensor, keep: Optional[torch.Tensor] = None,
                  labels: Optional[torch.Tensor] = None, full_precision: bool = False) -> torch.Tensor:
        """(B, k) last-block CLS-to-patch attention of the ensemble on the tokens ``keep`` (all: None): the
        clients' mean, or with ``attention_weighting: class_share`` each client's attention weighted by its
        share of the image's label in ``labels``. The forward runs under ``autocast`` unless ``full_precision``."""
        precision = "off" if full_precision else self.cfg.autocast
        if self.attention_shares is None:
            with autocast(self.device, precision):
                _, attn = self.ensemble(x, keep, return_attn=True)
            return attn.float()
        if labels is None:
            raise ValueError("attention_weighting: class_share weights the clients by their share of each image's "
                             "class: the images' labels are needed")
        with autocast(self.device, precision):
            _, attn = self.ensemble.client_logits(x, keep, return_attn=True)   # (K, B, k)
        w = self.attention_shares[:, labels.to(self.attention_shares.device)]  # (K, B)
        return (attn.float() * w.unsqueeze(-1)).sum(0)

    def _color_shift(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """x * exp(u1) + u2 with u1, u2 ~ U(-s, s) per image and channel (Plug-In Inversion's ColorShift)."""
        s = self.cfg.color_shift
        u = (torch.rand(2, x.shape[0], x.shape[1], 1, 1, generator=gen) * 2 - 1) * s
        u = u.to(x.device, x.dtype)
        return x * torch.exp(u[0]) + u[1]

    def synthesize(self, labels: torch.Tensor, batch_index: int = 0, seed: int = 0,
                   tag: str = "inversion") -> SyntheticBatch:
        """Optimise one batch of images towards ``labels``; deterministic given (seed, batch_index)."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(batch_index))
        b = labels.shape[0]
        labels = labels.to(self.device)
        x = (torch.randn(b, self.c, self.h, self.w, generator=gen) * cfg.inversion_init_std).to(self.device)
        x = torch.max(torch.min(x, self.hi), self.lo).requires_grad_(True)
        targets = self.soft_targets(labels, gen) if cfg.boundary_fraction > 0 else labels
        opt = torch.optim.Adam([x], lr=cfg.inversion_lr, betas=tuple(cfg.inversion_betas))
        keep = torch.arange(self.num_patches, device=self.device).unsqueeze(0).repeat(b, 1)
        kept_mask = torch.ones(b, self.num_patches, dtype=torch.bool, device=self.device)
        frozen_px = torch.zeros(b, 1, self.h, self.w, dtype=torch.bool, device=self.device)
        bar = self.callbacks.progress(f"{tag} batch {batch_index}", cfg.inversion_iters) if self.callbacks else None
        prune_step = {p: j for j, p in enumerate(self.prune_points)}
        halted_sums = None   # per client, the halted patches' block-input sums (feature_tokens: all)
        for it in range(cfg.inversion_iters):
            if it in prune_step:
                keep = self._prune(x.detach(), keep, self.keep_counts[prune_step[it]], labels)
                kept_mask = torch.zeros_like(kept_mask).scatter_(1, keep, True)
                frozen_px = ~patch_mask_to_pixels(kept_mask, self.grid, self.patch, (self.h, self.w))
                if self.feature_stats is not None and cfg.feature_tokens == "all":
                    with autocast(self.device, cfg.autocast):
                        halted_sums = [patch_token_sums(m, x.detach(), ~kept_mask) for m in self.ensemble.models]
            # jitter (roll) + flip; the keep set follows the image, to the nearest whole patch
            dy = int(torch.randint(-self.jitter, self.jitter + 1, (1,), generator=gen))
            dx = int(torch.randint(-self.jitter, self.jitter + 1, (1,), generator=gen))
            flip = bool(self.flip and torch.rand(1, generator=gen).item() < 0.5)
            x_a = torch.roll(x, shifts=(dy, dx), dims=(2, 3))
            if flip:
                x_a = x_a.flip(3)
            if cfg.color_shift > 0:
                x_a = self._color_shift(x_a, gen)
            keep_a = None
            if keep.shape[1] < self.num_patches:
                shift = (int(round(dy / self.patch[0])), int(round(dx / self.patch[1])))
                keep_a = remap_patches(keep, self.grid, shift, flip)
            with autocast(self.device, cfg.autocast):
                if self.feature_stats is None:
                    logits = self.ensemble(x_a, keep_a)
                else:
                    client_logits, moments = self.ensemble.client_logits(
                        x_a, keep_a, return_moments="per_image" if self.class_shares is not None else True)
                    logits = self.ensemble.combine(client_logits)
            ce = F.cross_entropy(logits.float(), targets)
            loss = ce + cfg.tv_weight * tv_l2(x)
            if self.class_shares is not None:
                loss = loss + cfg.feature_weight * class_feature_stats_loss(moments, labels, self.feature_stats,
                                                                            self.class_shares)
            elif self.feature_stats is not None:
                if halted_sums is not None:
                    kept_n, halted_n = b * keep.shape[1], b * (self.num_patches - keep.shape[1])
                    moments = [pooled_moments(m, kept_n, s, halted_n) for m, s in zip(moments, halted_sums)]
                loss = loss + cfg.feature_weight * feature_stats_loss(moments, self.feature_stats)
            if self.start is not None:
                with autocast(self.device, cfg.autocast):
                    start_logits = forward_tokens(self.start, x_a, keep_a)
                loss = loss + cfg.competition_weight * (1.0 - js_divergence(logits, start_logits))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            with torch.no_grad():
                before = x.detach().clone()
                x.grad.masked_fill_(frozen_px.expand_as(x), 0.0)
            opt.step()
            with torch.no_grad():
                x.copy_(torch.where(frozen_px.expand_as(x), before, torch.max(torch.min(x, self.hi), self.lo)))
            if bar is not None:
                bar.update(1)
                if it % 10 == 0 or it == cfg.inversion_iters - 1:
                    bar.set_postfix(loss=f"{loss.item():.3f}", tokens=keep.shape[1])
            if self.callbacks is not None and (it % 10 == 0 or it == cfg.inversion_iters - 1):
                step = batch_index * cfg.inversion_iters + it
                self.callbacks.metric(f"{tag}/loss", float(loss.item()), step)
                self.callbacks.metric(f"{tag}/kept_tokens", float(keep.shape[1]), step)
        if bar is not None:
            bar.close()
        x = x.detach()
        if not self.prune_points or cfg.final_mask == "recompute":
            kept_mask = self.attention_mask(x, self.cfg.keep_fraction(self.num_patches), labels)
        return SyntheticBatch(x, labels, kept_mask)

    def soft_targets(self, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """(B, C) inversion targets: one-hot, except for round(boundary_fraction * B) images at random, whose
        target is lam * e_y + (1 - lam) * e_y2, lam ~ U(0.5, 1), y2 drawn from the other classes."""
        b, c = labels.shape[0], self.num_classes
        targets = F.one_hot(labels, c).float()
        n = int(round(self.cfg.boundary_fraction * b))
        if n == 0 or c < 2:
            return targets
        rows = torch.randperm(b, generator=gen)[:n].to(labels.device)
        other = (labels[rows] + 1 + torch.randint(0, c - 1, (n,), generator=gen).to(labels.device)) % c
        lam = (0.5 + 0.5 * torch.rand(n, generator=gen)).to(targets.device)
        targets[rows] = lam.unsqueeze(1) * targets[rows] + (1 - lam).unsqueeze(1) * F.one_hot(other, c).float()
        return targets

    @torch.no_grad()
    def attention_mask(self, x: torch.Tensor, fraction: float, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Foreground mask from the ensemble's attention on the full images (a dense pool, real images, or
        ``final_mask: recompute``); ``labels`` are the images' classes (needed by ``attention_weighting:
        class_share``)."""
        count = max(1, int(round(self.num_patches * fraction)))
        attn = self.attention(x, None, labels, full_precision=True)
        top = attn.topk(count, dim=1).indices
        return torch.zeros(x.shape[0], self.num_patches, dtype=torch.bool, device=x.device).scatter_(1, top, True)
