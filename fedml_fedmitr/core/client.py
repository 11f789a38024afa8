"""Client side: local supervised training of one client's ViT on its shard."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ClientTrainConfig
from .methods.base import Callbacks, ClientUpload
from .models import class_token_moments, token_moments


def make_optimizer(params, name: str, lr: float, weight_decay: float, momentum: float = 0.9):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"optimizer {name!r} is invalid: expected 'adamw', 'adam' or 'sgd'")


def augment_batch(x: torch.Tensor, flip: bool = True, pad: Optional[int] = None) -> torch.Tensor:
    """Random crop after zero padding (``pad`` default side // 8) and optional horizontal flip,
    drawn per image from torch's global generator (seeded by the caller)."""
    b, _, h, w = x.shape
    pad = max(1, h // 8) if pad is None else pad
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b,))
    dx = torch.randint(0, 2 * pad + 1, (b,))
    rows = (torch.arange(h).view(1, h) + dy.view(b, 1)).to(x.device)        # (B, H)
    cols = (torch.arange(w).view(1, w) + dx.view(b, 1)).to(x.device)        # (B, W)
    out = padded[torch.arange(b, device=x.device).view(b, 1, 1, 1),
                 torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1),
                 rows.view(b, 1, h, 1), cols.view(b, 1, 1, w)]
    if flip:
        mask = (torch.rand(b) < 0.5).to(x.device)
        out = torch.where(mask.view(b, 1, 1, 1), out.flip(3), out)
    return out


def train_local(model: nn.Module, loader, cfg: ClientTrainConfig, device,
                callbacks: Optional[Callbacks] = None, desc: str = "client training") -> nn.Module:
    """Supervised training of ``model`` on ``loader`` of (x, y) for ``cfg.epochs`` epochs."""
    cfg.validate()
    callbacks = callbacks or Callbacks(progress=False)
    model.to(device).train()
    opt = make_optimizer(model.parameters(), cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.momentum)
    steps = cfg.epochs * max(1, len(loader))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    bar = callbacks.progress(desc, steps)
    step = 0
    for epoch in range(cfg.epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device).long()
            if cfg.augment:
                x = augment_batch(x, flip=cfg.flip)
            loss = F.cross_entropy(model(x), y, label_smoothing=cfg.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}")
        callbacks.metric(f"{desc}/loss", float(loss.item()), epoch)
    bar.close()
    model.eval()
    return model


def label_counts_of(loader, num_classes: int) -> list:
    counts = torch.zeros(num_classes, dtype=torch.long)
    for _, y in loader:
        counts += torch.bincount(y.long().view(-1).cpu(), minlength=num_classes)
    return counts.tolist()


def train_client(client_id: int, model: nn.Module, loader, cfg: ClientTrainConfig, device,
                 num_classes: int, callbacks: Optional[Callbacks] = None) -> ClientUpload:
    """Train one client and package its upload (weights on CPU, sample and label counts, and, unless
    ``cfg.feature_stats`` is False, the token moments of its trained model on its shard, which the
    server's feature prior matches; with ``cfg.class_feature_stats`` also per class)."""
    counts = label_counts_of(loader, num_classes)
    if sum(counts) == 0:
        raise ValueError(f"client {client_id} has an empty training shard")
    train_local(model, loader, cfg, device, callbacks, desc=f"client {client_id}")
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return ClientUpload(client_id=client_id, state_dict=state, num_samples=int(sum(counts)),
                        label_counts=counts,
                        feature_stats=token_moments(model, loader, device) if cfg.feature_stats else None,
                        class_feature_stats=(class_token_moments(model, loader, device, num_classes)
                                             if cfg.class_feature_stats else None))
