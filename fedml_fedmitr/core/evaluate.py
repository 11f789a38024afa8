"""Top-1 accuracy, loss, per-class accuracy and per-class prediction counts of a model or of the
ensemble on a loader; :func:`missed_classes`, the measure of a collapse (#18)."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def evaluate_logits(logits_fn: Callable[[torch.Tensor], torch.Tensor], loader, device,
                    num_classes: int) -> Dict:
    """Run ``logits_fn`` over ``loader`` of (x, y); return acc, loss, per_class_acc, num_samples and
    predicted_per_class (how many inputs it assigns each class)."""
    correct = torch.zeros(num_classes, dtype=torch.long)
    predicted = torch.zeros(num_classes, dtype=torch.long)
    total = torch.zeros(num_classes, dtype=torch.long)
    loss_sum = 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device).long()
        logits = logits_fn(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        pred = logits.argmax(dim=1)
        total += torch.bincount(y.cpu(), minlength=num_classes)
        correct += torch.bincount(y[pred == y].cpu(), minlength=num_classes)
        predicted += torch.bincount(pred.cpu(), minlength=num_classes)[:num_classes]
    n = int(total.sum())
    if n == 0:
        raise ValueError("the evaluation loader yielded no samples")
    per_class = [float(c) / float(t) if t > 0 else None for c, t in zip(correct.tolist(), total.tolist())]
    return {"acc": float(correct.sum()) / n, "loss": loss_sum / n, "per_class_acc": per_class,
            "num_samples": n, "predicted_per_class": predicted.tolist()}


def known_classes(ensemble_per_class_acc: Sequence[Optional[float]]) -> List[int]:
    """The classes the ensemble gets right at least once (None: a class absent from the test set)."""
    return [c for c, acc in enumerate(ensemble_per_class_acc) if acc is not None and acc > 0]


def missed_classes(predicted_per_class: Optional[Sequence[int]],
                   ensemble_per_class_acc: Optional[Sequence[Optional[float]]]) -> Optional[List[int]]:
    """The classes the ensemble gets right at least once that the global model never predicts: a
    collapse when not empty (issue #18's definition). None when either is unknown."""
    if predicted_per_class is None or ensemble_per_class_acc is None:
        return None
    return [c for c in known_classes(ensemble_per_class_acc) if predicted_per_class[c] == 0]


def evaluate_model(model: nn.Module, loader, device, num_classes: int) -> Dict:
    was_training = model.training
    model.eval()
    try:
        return evaluate_logits(model, loader, device, num_classes)
    finally:
        model.train(was_training)


def evaluate_ensemble(ensemble, loader, device, num_classes: int) -> Dict:
    return evaluate_logits(lambda x: ensemble(x), loader, device, num_classes)
