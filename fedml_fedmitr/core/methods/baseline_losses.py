"""The arithmetic of the generator baselines (DENSE, Co-Boosting, FedFTG), apart from their loops in
:mod:`.baselines`: generator losses, the class-level and weighted ensembles, Co-Boosting's weight
step and input perturbation. Pure functions of tensors."""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F

COBOOST_ADV_TEMPERATURE = 3.0   # T of Co-Boosting's adversarial KL
COBOOST_HARD_POWER = 1.0        # exponent of (1 - p_y) in Co-Boosting's hard-sample CE


# =============================================================================================
# Losses (pure functions, tested alone)
# =============================================================================================
def per_sample_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    """T^2 * KL(softmax(t / T) || softmax(s / T)) for each sample, shape (B,)."""
    t = temperature
    return F.kl_div(F.log_softmax(student_logits / t, dim=1), F.softmax(teacher_logits / t, dim=1),
                    reduction="none").sum(1) * (t * t)


def masked_adversarial_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor, where: str,
                            temperature: float = 1.0) -> torch.Tensor:
    """-(KL(teacher || student) * mask).mean(): minimising it pushes the generator towards
    student-teacher disagreement, only on the samples that ``where`` selects:
    ``disagree`` (DENSE: argmax differ), ``agree`` (FedFTG: argmax equal) or ``all`` (Co-Boosting)."""
    kl = per_sample_kl(teacher_logits, student_logits, temperature)
    if where == "all":
        return -kl.mean()
    same = teacher_logits.argmax(1) == student_logits.argmax(1)
    if where == "disagree":
        mask = ~same
    elif where == "agree":
        mask = same
    else:
        raise ValueError(f"where = {where!r}: expected 'disagree', 'agree' or 'all'")
    return -(kl * mask.to(kl.dtype)).mean()


def dense_generator_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor, labels: torch.Tensor,
                         adv_weight: float) -> Tuple[torch.Tensor, Dict[str, float]]:
    """DENSE: CE(E(G(z)), y) + adv * adversarial KL on disagreeing samples (BN term: 0 for ViTs)."""
    ce = F.cross_entropy(teacher_logits, labels)
    adv = masked_adversarial_loss(teacher_logits, student_logits, "disagree")
    return ce + adv_weight * adv, {"ce": ce.item(), "adv": adv.item()}


def coboost_generator_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor, labels: torch.Tensor,
                           adv_weight: float, hard_power: float = COBOOST_HARD_POWER,
                           adv_temperature: float = COBOOST_ADV_TEMPERATURE) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Co-Boosting: mean((1 - p_y)^h * CE) (hard samples weigh more; the weight is not
    differentiated) + adv * adversarial KL at T = 3 on all samples."""
    p_y = F.softmax(teacher_logits, dim=1).gather(1, labels.view(-1, 1)).squeeze(1)
    ce = ((1.0 - p_y.detach()).pow(hard_power) * F.cross_entropy(teacher_logits, labels, reduction="none")).mean()
    adv = masked_adversarial_loss(teacher_logits, student_logits, "all", adv_temperature)
    return ce + adv_weight * adv, {"ce": ce.item(), "adv": adv.item()}


def diversity_loss(z: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """FedFTG's diversity term exp(-mean_{i,j} d(x_i, x_j) * d(z_i, z_j)), d a mean absolute (images)
    or mean squared (latents) difference: small when distinct codes give distinct images."""
    x = images.flatten(1)
    dx = (x.unsqueeze(0) - x.unsqueeze(1)).abs().mean(2)
    dz = (z.unsqueeze(0) - z.unsqueeze(1)).pow(2).mean(2)
    return torch.exp(-(dx * dz).mean())


def class_level_ensemble(client_logits: torch.Tensor, alpha: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """FedFTG's teacher for a sample generated for class y: sum_k alpha[k, y] * f_k(x).
    ``client_logits`` (K, B, C), ``alpha`` (K, C) with columns summing to 1, ``labels`` (B,).
    (Unlike ``Ensemble.combine``, the weight depends on the sample's label, not the output class.)"""
    w = alpha[:, labels]                                    # (K, B)
    return (client_logits * w.unsqueeze(2)).sum(0)


def fedftg_generator_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor, labels: torch.Tensor,
                          images: torch.Tensor, z: torch.Tensor, adv_weight: float,
                          div_weight: float) -> Tuple[torch.Tensor, Dict[str, float]]:
    """FedFTG: CE(class-level ensemble, y) + adv * (-KL) on samples where the global model still
    agrees with the ensemble (hard samples near the boundary) + div * diversity."""
    ce = F.cross_entropy(teacher_logits, labels)
    adv = masked_adversarial_loss(teacher_logits, student_logits, "agree")
    div = diversity_loss(z, images)
    return ce + adv_weight * adv + div_weight * div, {"ce": ce.item(), "adv": adv.item(), "div": div.item()}


def weighted_ensemble(client_logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k w_k f_k(x) / sum_k w_k for client weights ``weights`` (K,) and logits (K, B, C)."""
    w = weights / weights.sum().clamp_min(1e-12)
    return (client_logits * w.view(-1, 1, 1)).sum(0)


def coboost_weight_step(weights: torch.Tensor, client_logits: torch.Tensor, labels: torch.Tensor,
                        mu: float) -> torch.Tensor:
    """One Co-Boosting step on the client weights: w - mu * sign(dCE(E_w(x), y)/dw), clipped to
    [0, 1], then renormalised to sum 1 (uniform if all were clipped to 0)."""
    w = weights.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(weighted_ensemble(client_logits, w), labels)
    (grad,) = torch.autograd.grad(loss, w)
    new = (weights.detach() - mu * grad.sign()).clamp(0.0, 1.0)
    if float(new.sum()) <= 0:
        return torch.full_like(new, 1.0 / new.numel())
    return new / new.sum()


def ods_perturb(x: torch.Tensor, teacher_fn, eps: torch.Tensor, temperature: float,
                gen: torch.Generator) -> torch.Tensor:
    """Co-Boosting's output-diversified perturbation: x + eps * sign(grad_x (r . softmax(E(x) / T)))
    for a random direction r ~ U(-1, 1) over the outputs. ``eps`` is per channel, (1, C, 1, 1), in
    normalised units."""
    x = x.detach().clone().requires_grad_(True)
    out = teacher_fn(x)
    r = (torch.rand(out.shape, generator=gen) * 2.0 - 1.0).to(out.device, out.dtype)
    (grad,) = torch.autograd.grad((r * F.softmax(out / temperature, dim=1)).sum(), x)
    return (x + eps * grad.sign()).detach()


# =============================================================================================
# Shared loop
# =============================================================================================
