"""Top-1 accuracy, loss and per-class accuracy of a model or of the ensemble on a loader."""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def evaluate_logits(logits_fn: Callable[[torch.Tensor], torch.Tensor], loader, device,
                    num_classes: int) -> Dict:
    """Run ``logits_fn`` over ``loader`` of (x, y); return acc, loss, per_class_acc, num_samples."""
    correct = torch.zeros(num_classes, dtype=torch.long)
    total = torch.zeros(num_classes, dtype=torch.long)
    loss_sum = 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device).long()
        logits = logits_fn(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        pred = logits.argmax(dim=1)
        total += torch.bincount(y.cpu(), minlength=num_classes)
        correct += torch.bincount(y[pred == y].cpu(), minlength=num_classes)
    n = int(total.sum())
    if n == 0:
        raise ValueError("the evaluation loader yielded no samples")
    per_class = [float(c) / float(t) if t > 0 else None for c, t in zip(correct.tolist(), total.tolist())]
    return {"acc": float(correct.sum()) / n, "loss": loss_sum / n, "per_class_acc": per_class,
            "num_samples": n}


def evaluate_model(model: nn.Module, loader, device, num_classes: int) -> Dict:
    was_training = model.training
    model.eval()
    try:
        return evaluate_logits(model, loader, device, num_classes)
    finally:
        model.train(was_training)


def evaluate_ensemble(ensemble, loader, device, num_classes: int) -> Dict:
    return evaluate_logits(lambda x: ensemble(x), loader, device, num_classes)
