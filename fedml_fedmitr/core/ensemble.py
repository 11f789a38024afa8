"""The ensemble of the K uploaded client models: ``E(x) = sum_k alpha[k, y] * f_k(x)[y]``.

Weights ``alpha`` (K, C), each column summing to 1:
- ``mean``: 1/K;  ``samples``: n_k / sum_j n_j;  ``per_class``: n[k, y] / sum_j n[j, y] (FedFTG).
Robust aggregates (``median``, ``trimmed_mean``) ignore the weights and reduce over clients per
logit. With ``ensemble_calibration: label_prior`` each client's logits are first shifted by minus the
log of its own (add-one smoothed) label distribution, a post-hoc logit adjustment: a client that
trained on one class no longer votes for it on every image. With ``ensemble_calibration: held_classes``
each client's logits become log-probabilities over the classes it trained on (label count > 0) and
each class is combined over the clients that hold it only (their weights renormalised): a client has
no say on a class it never saw, and its confidence is comparable with the other clients'. All K forwards run in one batched call
(``torch.func.stack_module_state`` + ``vmap``) or a plain loop; ``auto`` picks vmap on GPU and the loop on CPU, where torch has no vmap rule for its
attention kernel and the loop measured faster (see ``benchmarks/bench_speed.py``).
"""
from __future__ import annotations

import copy
import math
from typing import List, Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from .config import FedMITRConfig
from .models import TokenSubsetViT, check_feature_stats, check_finite, check_vit, load_state_checked


def _count_matrix(label_counts: Sequence[Sequence[int]]) -> torch.Tensor:
    """The clients' label counts as a float (K, C) tensor."""
    return torch.tensor([[float(c) for c in row] for row in label_counts])


def client_weights(mode: str, num_samples: Sequence[int], label_counts: Sequence[Sequence[int]],
                   num_classes: int) -> torch.Tensor:
    """The (K, C) ensemble weights; every column sums to 1."""
    k = len(num_samples)
    if mode == "mean":
        return torch.full((k, num_classes), 1.0 / k)
    if mode == "samples":
        n = torch.tensor([float(v) for v in num_samples])
        return (n / n.sum()).unsqueeze(1).expand(k, num_classes).clone()
    if mode == "per_class":
        counts = _count_matrix(label_counts)
        if counts.shape != (k, num_classes):
            raise ValueError(f"label_counts must be {k} x {num_classes}, got {tuple(counts.shape)}")
        totals = counts.sum(0, keepdim=True)
        uniform = torch.full_like(counts, 1.0 / k)
        return torch.where(totals > 0, counts / totals.clamp_min(1.0), uniform)
    raise ValueError(f"ensemble_weighting = {mode!r} is invalid: expected 'mean', 'samples' or 'per_class'")


def label_prior_offsets(label_counts: Sequence[Sequence[int]], num_classes: int) -> torch.Tensor:
    """(K, C) log label priors of the clients, add-one smoothed: subtracted from each client's logits."""
    counts = _count_matrix(label_counts) + 1.0
    if counts.shape[1] != num_classes:
        raise ValueError(f"label_counts must have {num_classes} classes, got {counts.shape[1]}")
    return (counts / counts.sum(1, keepdim=True)).log()


# the log-probability a client is given for a class it never trained on, and the ensemble for a class no
# client holds: finite (so KL and softmax stay well defined), about one in a million
UNHELD_LOG_PROB = math.log(1e-6)


def held_class_mask(label_counts: Sequence[Sequence[int]], num_classes: int) -> torch.Tensor:
    """(K, C) True where client k trained on class c (label count > 0)."""
    counts = _count_matrix(label_counts)
    if counts.dim() != 2 or counts.shape[1] != num_classes:
        raise ValueError(f"label_counts must have {num_classes} classes, got shape {tuple(counts.shape)}")
    if not bool((counts > 0).any(1).all()):
        raise ValueError("ensemble_calibration: held_classes needs every client's label counts, but client(s) "
                         f"{[i for i, row in enumerate(counts) if not (row > 0).any()]} report none")
    return counts > 0


def same_architecture(models: Sequence[nn.Module]) -> bool:
    """True if every model has the parameters of the first, name by name and shape by shape."""
    first = {k: tuple(v.shape) for k, v in models[0].state_dict().items()}
    return all({k: tuple(v.shape) for k, v in m.state_dict().items()} == first for m in models[1:])


class Ensemble:
    """K frozen client ViTs, queried together (optionally on token subsets). The clients may have
    different architectures that share the image size and patch grid (a model market); then the
    ensemble loops over them (vmap stacks one architecture only)."""

    def __init__(self, models: List[nn.Module], weights: torch.Tensor, aggregate: str = "mean",
                 trim_fraction: float = 0.2, batched: str = "auto", device=None,
                 offsets: Optional[torch.Tensor] = None,
                 feature_stats: Optional[List[Optional[torch.Tensor]]] = None,
                 client_ids: Optional[List[int]] = None, held: Optional[torch.Tensor] = None,
                 class_feature_stats: Optional[List[Optional[torch.Tensor]]] = None,
                 label_counts: Optional[torch.Tensor] = None):
        if not models:
            raise ValueError("an ensemble needs at least one model")
        self.device = torch.device(device) if device is not None else next(models[0].parameters()).device
        self.models = [check_vit(m).to(self.device).eval().requires_grad_(False) for m in models]
        self.weights = weights.to(self.device)
        # (K, C) subtracted from each client's logits before they are combined (None: no calibration)
        self.offsets = offsets.to(self.device) if offsets is not None else None
        # (K, C) bool, the classes each client trained on (ensemble_calibration: held_classes; None: off)
        self.held = held.to(self.device) if held is not None else None
        if self.held is not None and self.offsets is not None:
            raise ValueError("an ensemble takes one calibration: label prior offsets or held classes, not both")
        if self.held is not None and aggregate != "mean":
            raise ValueError(f"ensemble_calibration = 'held_classes' combines each class over the clients that "
                             f"hold it; it needs ensemble_aggregate: mean, not {aggregate!r}")
        # per client, the (depth, 2, embed_dim) token moments it measured on its data (None: not uploaded);
        # read through checked_feature_stats()
        self.feature_stats = list(feature_stats) if feature_stats is not None else [None] * len(self.models)
        # per client, the same per class (num_classes, depth, 2, embed_dim), and its label counts (K, C):
        # the class-conditional prior, read through checked_class_feature_stats()
        self.class_feature_stats = (list(class_feature_stats) if class_feature_stats is not None
                                    else [None] * len(self.models))
        self.label_counts = label_counts
        # the clients' ids, for messages (positions when not given)
        self.client_ids = list(client_ids) if client_ids is not None else list(range(len(self.models)))
        self.aggregate = aggregate
        self.trim_fraction = trim_fraction
        mixed = not same_architecture(self.models)
        if batched == "auto":
            batched = "vmap" if self.device.type == "cuda" and len(models) > 1 and not mixed else "loop"
        if batched == "vmap" and mixed:
            raise ValueError("fedmitr_args.ensemble_batched = 'vmap' stacks clients of one architecture; these "
                             "clients have several (model_args.client_models): use 'auto' or 'loop'")
        self.batched = batched
        self._stacked = None
        if batched == "vmap":
            self._build_stacked()

    @classmethod
    def from_uploads(cls, uploads, model_fn, num_classes: int, cfg: FedMITRConfig, device,
                     model_for=None) -> "Ensemble":
        """Rebuild each client's model from its upload (shape and NaN/Inf checked, naming the client):
        ``model_fn()`` builds a fresh model, or ``model_for(upload)`` one of that client's architecture."""
        models = []
        for u in uploads:
            check_finite(u.state_dict, f"client {u.client_id}'s uploaded model")
            fresh = model_for(u) if model_for is not None else model_fn()
            models.append(load_state_checked(fresh, u.state_dict, f"client {u.client_id}'s uploaded model"))
        weights = client_weights(cfg.ensemble_weighting, [u.num_samples for u in uploads],
                                 [u.label_counts for u in uploads], num_classes)
        counts, calibration = [u.label_counts for u in uploads], cfg.calibration()
        offsets = label_prior_offsets(counts, num_classes) if calibration == "label_prior" else None
        held = held_class_mask(counts, num_classes) if calibration == "held_classes" else None
        return cls(models, weights, cfg.ensemble_aggregate, cfg.trim_fraction, cfg.ensemble_batched, device,
                   offsets, [u.feature_stats for u in uploads], [int(u.client_id) for u in uploads], held,
                   [getattr(u, "class_feature_stats", None) for u in uploads], _count_matrix(counts))

    def __len__(self) -> int:
        return len(self.models)

    def subset(self, keep: Sequence[int]) -> "Ensemble":
        """An ensemble of the clients ``keep`` (weights renormalised per class)."""
        keep = list(keep)
        w = self.weights[keep]
        w = w / w.sum(0, keepdim=True).clamp_min(1e-12)
        return Ensemble([self.models[i] for i in keep], w, self.aggregate, self.trim_fraction,
                        self.batched, self.device, None if self.offsets is None else self.offsets[keep],
                        [self.feature_stats[i] for i in keep], [self.client_ids[i] for i in keep],
                        None if self.held is None else self.held[keep],
                        [self.class_feature_stats[i] for i in keep],
                        None if self.label_counts is None else self.label_counts[keep])

    def checked_feature_stats(self, what: str = "fedmitr_args.feature_weight > 0") -> List[torch.Tensor]:
        """Every client's feature statistics on the ensemble's device, checked against its model; a
        ValueError naming the clients that sent none or a misshapen one (``what`` needs them)."""
        missing = [cid for cid, t in zip(self.client_ids, self.feature_stats) if t is None]
        if missing:
            raise ValueError(f"{what} matches each client's feature statistics, but client(s) {missing} uploaded "
                             "none (withheld with train_args.client_feature_stats: false, or clients of an older "
                             "fedml_fedmitr); set feature_weight: 0, or let those clients send them")
        for cid, t, m in zip(self.client_ids, self.feature_stats, self.models):
            check_feature_stats(t, m, f"client {cid}'s feature statistics")
        return [t.to(self.device, torch.float32) for t in self.feature_stats]

    def checked_class_feature_stats(self, what: str = "fedmitr_args.feature_prior = 'per_class'"):
        """Every client's per-class feature statistics, checked against its model, and each client's share
        of each class's images (K, C), on the ensemble's device; a ValueError naming the clients that
        sent none or a misshapen one (``what`` needs them)."""
        missing = [cid for cid, t in zip(self.client_ids, self.class_feature_stats) if t is None]
        if missing or self.label_counts is None:
            raise ValueError(f"{what} matches each client's per-class feature statistics, but client(s) "
                             f"{missing or self.client_ids} uploaded none (sent with train_args."
                             "client_class_feature_stats: true); set feature_prior: global, or let those "
                             "clients send them")
        num_classes = self.label_counts.shape[1]
        for cid, t, m in zip(self.client_ids, self.class_feature_stats, self.models):
            check_feature_stats(t, m, f"client {cid}'s per-class feature statistics", num_classes)
        counts = self.label_counts.to(self.device, torch.float32)
        shares = counts / counts.sum(0, keepdim=True).clamp_min(1.0)
        return [t.to(self.device, torch.float32) for t in self.class_feature_stats], shares

    # ---- forwards ----
    def _build_stacked(self) -> None:
        wrappers = [TokenSubsetViT(m) for m in self.models]
        params, buffers = stack_module_state(wrappers)
        params = {k: v.detach() for k, v in params.items()}
        base = copy.deepcopy(wrappers[0]).to("meta")
        self._stacked = (base, params, buffers)

    def client_logits(self, x: torch.Tensor, keep_idx: Optional[torch.Tensor] = None,
                      return_attn: bool = False, return_moments=False):
        """Per-client logits (K, B, C) [and CLS-to-patch attention (K, B, k)] on the kept tokens; with
        ``return_moments`` also, per client, its block inputs' token moments on ``x`` (a list of K
        (depth, 2, embed_dim) tensors, or (B, depth, 2, embed_dim) with ``return_moments="per_image"``, see
        :func:`~fedml_fedmitr.core.models.run_blocks`)."""
        if self.batched == "vmap":
            base, params, buffers = self._stacked

            def one(p, b, inp):
                return functional_call(base, (p, b), (inp, keep_idx, return_attn, return_moments))

            out = vmap(one, in_dims=(0, 0, None))(params, buffers, x)
            if return_moments:
                out = (*out[:-1], list(out[-1].unbind(0)))
            return out
        from .models import forward_tokens
        outs = [forward_tokens(m, x, keep_idx, return_attn, return_moments) for m in self.models]
        if not (return_attn or return_moments):
            return torch.stack(outs)
        stacked = [torch.stack([o[0] for o in outs])]
        if return_attn:
            stacked.append(torch.stack([o[1] for o in outs]))
        if return_moments:
            stacked.append([o[-1] for o in outs])
        return tuple(stacked)

    def calibrated(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-client logits (K, B, C), calibrated: minus the label prior offsets, or (held classes) each
        client's log-probabilities over the classes it trained on, ``UNHELD_LOG_PROB`` elsewhere;
        unchanged without a calibration."""
        if self.held is not None:
            held = self.held.unsqueeze(1)
            logp = logits.float().masked_fill(~held, float("-inf")).log_softmax(-1)
            return logp.masked_fill(~held, UNHELD_LOG_PROB)
        return logits if self.offsets is None else logits - self.offsets.unsqueeze(1)

    def calibrated_client_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Per-client logits (K, B, C) of ``x``, calibrated: what the baselines that combine the clients
        their own way (Co-Boosting, FedFTG) read."""
        return self.calibrated(self.client_logits(x))

    def combine(self, logits: torch.Tensor) -> torch.Tensor:
        """Reduce per-client logits (K, B, C) to the ensemble's (B, C) (calibrated first, if set)."""
        logits = self.calibrated(logits)
        if self.held is not None:   # each class over the clients that hold it, their weights renormalised
            w = self.weights * self.held
            total = w.sum(0)
            mixed = (logits * (w / total.clamp_min(1e-12)).unsqueeze(1)).sum(0)
            return mixed.masked_fill(total.unsqueeze(0) <= 0, UNHELD_LOG_PROB)
        if self.aggregate == "mean":
            return (logits * self.weights.unsqueeze(1)).sum(0)
        if self.aggregate == "median":
            return logits.median(dim=0).values
        if self.aggregate == "trimmed_mean":
            k = logits.shape[0]
            cut = int(self.trim_fraction * k)
            if k - 2 * cut < 1:
                cut = (k - 1) // 2
            ordered = logits.sort(dim=0).values
            return ordered[cut:k - cut].mean(0)
        raise ValueError(f"ensemble_aggregate = {self.aggregate!r} is invalid")

    def __call__(self, x: torch.Tensor, keep_idx: Optional[torch.Tensor] = None, return_attn: bool = False):
        """Ensemble logits (B, C) [and client-averaged CLS-to-patch attention (B, k)]."""
        if return_attn:
            logits, attn = self.client_logits(x, keep_idx, True)
            return self.combine(logits), attn.mean(0)
        return self.combine(self.client_logits(x, keep_idx))
