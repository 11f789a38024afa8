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
2. **predictions** (only with ``screening_min_ratio > 0``; off by default, see below): a small probe set inverted from the ensemble of the clients that passed
   test 1: ``screening_images`` images with balanced labels, ``screening_iters`` steps each.
   A client's agreement is the fraction of the probe images on which its predicted class is the
   one the *other* clients' ensemble predicts (leave-one-out, so a client never votes for itself).
   A label-flipped model answers with other labels. Dropped when its agreement is below
   ``screening_min_ratio`` x the median client's. Synthetic images transfer weakly between tiny
   from-scratch ViTs (honest agreement was 4-35% on digits): on the 10-client digits benchmark
   it caught both flipped clients on one seed, none on another, and dropped 2-3 honest non-IID
   clients per seed (``benchmarks/results/poison_probe_digits.log``), hence off by default.

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
from .models import ModelError

MAD_SCALE = 1.4826   # MAD -> standard deviation of a normal distribution


@dataclass
class ScreeningReport:
    """What the screen measured and decided (written to summary.json as ``screening``)."""

    client_ids: List[int]
    weight_distance: List[float]
    agreement: List[float]      # NaN for a client the weights test already dropped
    dropped: Dict[int, str] = field(default_factory=dict)   # client id -> reason
    probe_images: int = 0

    @property
    def kept_positions(self) -> List[int]:
        return [i for i, cid in enumerate(self.client_ids) if cid not in self.dropped]

    def to_dict(self) -> dict:
        return {"client_ids": self.client_ids, "weight_distance": self.weight_distance,
                "agreement": [None if a != a else a for a in self.agreement],   # NaN: not probed
                "dropped": {str(k): v for k, v in self.dropped.items()},
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


def probe_agreement(ensemble: Ensemble, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Per client: the fraction of the probe images on which its predicted class equals the
    prediction of the mean of the *other* clients' probabilities (leave-one-out)."""
    hits = []
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            x = images[i:i + batch_size].to(ensemble.device)
            probs = ensemble.client_logits(x).softmax(-1).cpu()          # (K, b, C)
            k = probs.shape[0]
            others = (probs.sum(0, keepdim=True) - probs) / max(1, k - 1)  # (K, b, C) leave-one-out
            hits.append(probs.argmax(-1) == others.argmax(-1))
    return torch.cat(hits, dim=1).float().mean(1)


def screen_clients(ensemble: Ensemble, uploads, cfg: FedMITRConfig, input_shape, mean, std, device,
                   num_classes: int, seed: int = 0, callbacks=None) -> ScreeningReport:
    """Run both tests over the uploads (in the ensemble's order); returns the report."""
    ids = [int(u.client_id) for u in uploads]
    z = cfg.screening_z
    dist = weight_distances([u.state_dict for u in uploads])
    report = ScreeningReport(client_ids=ids, weight_distance=[float(d) for d in dist],
                             agreement=[float("nan")] * len(ids))
    for i in torch.nonzero(robust_z(dist) > z).flatten().tolist():
        report.dropped[ids[i]] = (f"weights: distance {float(dist[i]):.3g} to the median of the uploads "
                                  f"(median distance {float(median(dist)):.3g})")
    survivors = [i for i in range(len(ids)) if ids[i] not in report.dropped]
    if cfg.screening_min_ratio > 0:
        _probe_test(report, ensemble, survivors, cfg, input_shape, mean, std, device, num_classes, seed)
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


def _probe_test(report: ScreeningReport, ensemble: Ensemble, survivors: List[int], cfg: FedMITRConfig,
                input_shape, mean, std, device, num_classes: int, seed: int) -> None:
    """Test 2 (predictions) over the clients that passed test 1; adds to ``report.dropped``."""
    ids = report.client_ids
    # the probe: dense inversion of the mean ensemble of the clients that passed test 1
    probe_cfg = cfg.replace(inversion="dense", inversion_iters=cfg.screening_iters, save_images=False,
                            # the probe has no student start to compete with, and compares the clients'
                            # weights, not the statistics they say they measured
                            competition_weight=0.0, feature_weight=0.0)
    kept = ensemble.subset(survivors)
    inverter = SparseModelInversion(kept, probe_cfg, input_shape, mean, std, device, None)
    images = []
    n, b = cfg.screening_images, cfg.synthesis_batch_size
    for batch_index in range((n + b - 1) // b):
        size = min(b, n - batch_index * b)
        target = balanced_labels(b, num_classes, batch_index)[:size]
        images.append(inverter.synthesize(target, batch_index=10_000 + batch_index, seed=seed).images)
    images = torch.cat(images)
    report.probe_images = int(len(images))
    agree = torch.full((len(ids),), float("nan"))
    agree[survivors] = probe_agreement(kept, images)
    report.agreement = [float(a) for a in agree]
    med = float(median(agree[survivors]))
    for i in range(len(ids)):
        if ids[i] in report.dropped:
            continue
        if float(agree[i]) < cfg.screening_min_ratio * med:
            report.dropped[ids[i]] = (f"predictions: agrees with the other clients on {float(agree[i]):.0%} "
                                      f"of the probe images (median client {med:.0%})")


class ScreeningError(ModelError):
    """Too few clients passed the screen (a user error: the run exits 2 with this one line)."""
