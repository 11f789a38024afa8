"""What the synthetic pool teaches, measured without test data (the measurements of a collapse).

:func:`pool_teacher_stats` (before distillation) counts, per class, the synthesis labels, the
ensemble's predictions on the full images and on the background tokens (what the token relabel
loss teaches there), the share of each label's images the ensemble assigns that label, and how confident it is.
:func:`pool_student_stats` (after) counts the student's predictions on the full pool images and how
often they equal the ensemble's. A teacher that sends most of the pool to a few classes, or a
student that does not follow it even on the pool, shows here first. FedMITR puts both in its
metrics (``summary.json``: ``metrics.pool``).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from .inversion import indices_of

CHUNK = 256


def _bincount(t: torch.Tensor, num_classes: int) -> List[int]:
    return [int(v) for v in torch.bincount(t.long().flatten(), minlength=num_classes)[:num_classes]]


@torch.no_grad()
def pool_teacher_stats(ensemble, images: torch.Tensor, labels: torch.Tensor, masks: Optional[torch.Tensor],
                       num_classes: int, device, with_predictions: bool = False):
    """Per class: the synthesis labels, the ensemble's predictions on the full images and on the
    background tokens, and its fit per label; the fit overall and on the background tokens.
    Images without background tokens (a dense pool) are left out of the background counts.
    ``with_predictions``: return (stats, the ensemble's argmax per image) for :func:`pool_student_stats`."""
    full, conf, back, back_labels = [], [], [], []
    for i in range(0, images.shape[0], CHUNK):
        x = images[i:i + CHUNK].to(device)
        probs = ensemble(x).float().softmax(1).cpu()
        full.append(probs.argmax(1))
        conf.append(probs.max(1).values)
        if masks is None:
            continue
        bg = ~masks[i:i + CHUNK]
        counts = bg.sum(1)
        if bool((counts > 0).all()) and bool((counts == counts[0]).all()):
            back.append(ensemble(x, indices_of(bg.to(device))).argmax(1).cpu())
            back_labels.append(labels[i:i + CHUNK])
    full_pred = torch.cat(full) if full else torch.zeros(0, dtype=torch.long)
    hits = full_pred == labels
    fit_per_class = []
    for c in range(num_classes):
        sel = labels == c
        fit_per_class.append(float(hits[sel].float().mean()) if bool(sel.any()) else None)
    stats: Dict[str, object] = {
        "size": int(labels.shape[0]),
        "fit": float(hits.float().mean()) if len(hits) else 0.0,
        "labels": _bincount(labels, num_classes),
        "ensemble_pred": _bincount(full_pred, num_classes),
        "ensemble_fit_per_class": fit_per_class,
        # mean top-class probability of the ensemble (T = 1): near 1, its soft labels are nearly one-hot
        "ensemble_confidence": float(torch.cat(conf).mean()) if conf else None,
        "foreground_tokens": None if masks is None else int(masks[0].sum()),
        "background_pred": None, "background_fit": None}
    if back:
        bp, bl = torch.cat(back), torch.cat(back_labels)
        stats["background_pred"] = _bincount(bp, num_classes)
        stats["background_fit"] = float((bp == bl).float().mean())
    return (stats, full_pred) if with_predictions else stats


@torch.no_grad()
def pool_student_stats(student: nn.Module, ensemble, images: torch.Tensor, num_classes: int, device,
                       teacher_pred: Optional[torch.Tensor] = None) -> Dict[str, object]:
    """The student's predictions on the full pool images and its agreement with the ensemble's
    (``teacher_pred``: the ensemble's argmax per image, when already computed)."""
    was_training = student.training
    student.eval()
    s_pred, e_pred = [], []
    for i in range(0, images.shape[0], CHUNK):
        x = images[i:i + CHUNK].to(device)
        s_pred.append(student(x).argmax(1).cpu())
        if teacher_pred is None:
            e_pred.append(ensemble(x).argmax(1).cpu())
    student.train(was_training)
    s = torch.cat(s_pred)
    e = teacher_pred if teacher_pred is not None else torch.cat(e_pred)
    return {"student_pred": _bincount(s, num_classes), "student_agreement": float((s == e).float().mean())}
