"""Screening of poisoned client uploads before synthesis (``fedmitr_args.client_screening: true``).

A one-shot server cannot ask a client again, and one random or label-flipped model among the
teachers spoils the ensemble every synthetic image and every soft label comes from. The screen
runs in ``ServerMethod.prepare`` and drops the clients that fail either of two data-free tests,
each a robust outlier rule over the K uploads (median and MAD, so a minority of bad clients cannot
move the reference):

1. **weights**: the L2 distance of each client's parameters to the coordinate-wise median of all
   uploads. Honest clients start from one shared initialisation (the server's model) and move a
   similar amount; a random, re-initialised, noised or scaled model lies far away. Dropped when
   ``distance > median + screening_z * 1.4826 * MAD``.
2. **predictions**: a small probe set inverted from the *median-logit* ensemble of the clients
   that passed test 1 (a minority cannot decide it): ``screening_images`` images with balanced
   labels, ``screening_iters`` steps each. A client's agreement is the fraction of the probe
   images it labels as the probe does, counted only over the classes the client says it trained
   on (its ``label_counts``), since a non-IID client cannot know the others. A label-flipped model
   answers the probe of its own classes with other labels. Dropped when its agreement is below
   ``screening_min_ratio`` x the median client's. Synthetic images transfer weakly between tiny
   from-scratch ViTs (honest agreement was 10-30% on digits), so this test is the weaker of the
   two: it separates flipped clients on some federations and not on others (see
   ``benchmarks/results/poison_*.md``).

At least ``min_clients_after_screening`` (default: more than half) must survive, else the server
stops with an error rather than silently trusting a federation it judged compromised.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import torch

from .config import FedMITRConfig
from .ensemble import Ensemble
from .inversion import SparseModelInversion, balanced_labels

MAD_SCALE = 1.4826   # MAD -> standard deviation of a normal distribution


@dataclass
class ScreeningReport:
    """What the screen measured and decided (written to summary.json as ``screening``)."""

    client_ids: List[int]
    weight_distance: List[float]
    agreement: List[float]
    dropped: Dict[int, str] = field(default_factory=dict)   # client id -> reason
    probe_images: int = 0

    @property
    def kept_positions(self) -> List[int]:
        return [i for i, cid in enumerate(self.client_ids) if cid not in self.dropped]

    def to_dict(self) -> dict:
        return {"client_ids": self.client_ids, "weight_distance": self.weight_distance,
                "agreement": self.agreement, "dropped": {str(k): v for k, v in self.dropped.items()},
                "kept": [self.client_ids[i] for i in self.kept_positions], "probe_images": self.probe_images}


def median(values: torch.Tensor) -> torch.Tensor:
    """The true median (the mean of the two middle values for an even count; torch's
    ``median`` takes the lower one, which biases small federations)."""
    return torch.quantile(values.float(), 0.5)


def robust_scale(values: torch.Tensor, rel_floor: float = 0.1) -> tuple:
    """(median, 1.4826 * MAD), the scale floored at ``rel_floor`` x |median| so that honest
    values that happen to be nearly identical do not turn every small difference into an outlier."""
    med = median(values)
    mad = median((values - med).abs()) * MAD_SCALE
    return med, torch.maximum(mad, rel_floor * med.abs().clamp_min(1e-8))


def robust_z(values: torch.Tensor) -> torch.Tensor:
    """(v - median) / (1.4826 * MAD), see :func:`robust_scale`."""
    med, scale = robust_scale(values)
    return (values - med) / scale


def weight_distances(states: Sequence[Dict[str, torch.Tensor]]) -> torch.Tensor:
    """L2 distance of each state dict (float tensors only) to their coordinate-wise median."""
    keys = [k for k, v in states[0].items() if torch.is_floating_point(v)]
    total = torch.zeros(len(states), dtype=torch.float64)
    for k in keys:
        stacked = torch.stack([s[k].detach().float().cpu().reshape(-1) for s in states])
        med = stacked.median(dim=0).values
        total += ((stacked - med) ** 2).sum(1).double()
    return total.sqrt().float()


def probe_agreement(ensemble: Ensemble, images: torch.Tensor, labels: torch.Tensor,
                    label_counts: Sequence[Sequence[int]], batch_size: int = 256) -> torch.Tensor:
    """Per client: the fraction of probe images of the classes it trained on that it labels as
    the probe does (clients with none of the probe's classes get the median of the others)."""
    preds = []
    with torch.no_grad():
        for i in range(0, len(labels), batch_size):
            x = images[i:i + batch_size].to(ensemble.device)
            preds.append(ensemble.client_logits(x).argmax(-1).cpu())      # (K, b)
    preds = torch.cat(preds, dim=1)
    agree = torch.full((len(ensemble),), float("nan"))
    for k, counts in enumerate(label_counts):
        owned = torch.tensor([c > 0 for c in counts])[labels]
        if bool(owned.any()):
            agree[k] = (preds[k][owned] == labels[owned]).float().mean()
    known = agree[~agree.isnan()]
    if len(known):
        agree[agree.isnan()] = median(known)
    return agree


def screen_clients(ensemble: Ensemble, uploads, cfg: FedMITRConfig, input_shape, mean, std, device,
                   num_classes: int, seed: int = 0, callbacks=None) -> ScreeningReport:
    """Run both tests over the uploads (in the ensemble's order); returns the report."""
    ids = [int(u.client_id) for u in uploads]
    z = cfg.screening_z
    dist = weight_distances([u.state_dict for u in uploads])
    report = ScreeningReport(client_ids=ids, weight_distance=[float(d) for d in dist], agreement=[])
    for i in torch.nonzero(robust_z(dist) > z).flatten().tolist():
        report.dropped[ids[i]] = (f"weights: distance {float(dist[i]):.3g} to the median of the uploads "
                                  f"(median distance {float(median(dist)):.3g})")
    # the probe: dense inversion of the median-logit ensemble of the clients that passed test 1
    survivors = [i for i in range(len(ids)) if ids[i] not in report.dropped]
    median_ens = ensemble.subset(survivors)
    median_ens.aggregate = "median"
    probe_cfg = cfg.replace(inversion="dense", inversion_iters=cfg.screening_iters, save_images=False)
    inverter = SparseModelInversion(median_ens, probe_cfg, input_shape, mean, std, device, None)
    images, labels = [], []
    n, b = cfg.screening_images, cfg.synthesis_batch_size
    for batch_index in range((n + b - 1) // b):
        size = min(b, n - batch_index * b)
        target = balanced_labels(b, num_classes, batch_index)[:size]
        batch = inverter.synthesize(target, batch_index=10_000 + batch_index, seed=seed)
        images.append(batch.images)
        labels.append(batch.labels.cpu())
    images, labels = torch.cat(images), torch.cat(labels)
    report.probe_images = int(len(labels))
    agree = probe_agreement(ensemble, images, labels, [u.label_counts for u in uploads])
    report.agreement = [float(a) for a in agree]
    med = float(median(agree[survivors]))
    for i in range(len(ids)):
        if ids[i] in report.dropped:
            continue
        if float(agree[i]) < cfg.screening_min_ratio * med:
            report.dropped[ids[i]] = (f"predictions: agrees with {float(agree[i]):.0%} of the probe images of "
                                      f"its own classes (median client {float(med):.0%})")
    minimum = cfg.min_clients_after_screening or (len(ids) // 2 + 1)
    kept = len(report.kept_positions)
    if callbacks is not None:
        for cid, why in report.dropped.items():
            callbacks.log(f"screening dropped client {cid}: {why}")
        callbacks.log(f"screening kept {kept} of {len(ids)} clients")
    if kept < minimum:
        raise ScreeningError(f"client screening kept only {kept} of {len(ids)} clients "
                             f"(fedmitr_args.min_clients_after_screening = {minimum}); dropped: "
                             + "; ".join(f"client {c}: {w}" for c, w in report.dropped.items()))
    return report


class ScreeningError(ValueError):
    """Too few clients passed the screen."""
