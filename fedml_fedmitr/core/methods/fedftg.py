"""FedFTG (Zhang et al., CVPR 2022), one-shot use of its server step: a conditional generator kept
across epochs, labels drawn in proportion to the clients' label counts, the global model fitting the
class-level ensemble's soft labels (see :mod:`.baselines` for the shared loop)."""
from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

import torch

from ..client import make_optimizer
from ..distill import kd_kl
from ..ensemble import client_weights
from ..generator import ConditionalSynthesizer
from . import register_method
from .base import ServerContext
from .baseline_losses import class_level_ensemble, fedftg_generator_loss
from .baselines import FEDFTG_KD_STEPS, FEDFTG_KD_TEMPERATURE, GeneratorBaseline, _sync


# =============================================================================================
# FedFTG
# =============================================================================================
@register_method
class FedFTG(GeneratorBaseline):
    """FedFTG's server fine-tuning used once: a conditional generator and class-level ensemble.

    One epoch is one outer iteration of FedFTG's server loop: ``gen_steps`` generator steps, then
    ``gen_kd_steps`` (default 5, FedFTG's I_d) global-model steps, each on a fresh generated batch."""

    name = "FedFTG"

    def setup(self, ctx: ServerContext) -> None:
        cfg = self.config
        counts = [u.label_counts for u in self.uploads]
        # alpha[k, y] = n[k, y] / sum_j n[j, y], FedFTG's class-level ensemble weights
        self.alpha = client_weights("per_class", [u.num_samples for u in self.uploads], counts,
                                    ctx.num_classes).to(ctx.device)
        label_totals = torch.tensor([[float(c) for c in row] for row in counts]).sum(0)

        def loss_fn(images, labels, z):
            teacher = self.teacher(images, labels)
            return fedftg_generator_loss(teacher, self.student(images), labels, images, z,
                                         cfg.gen_adv_weight, cfg.fedftg_div_weight)

        self.synthesizer = ConditionalSynthesizer(self._new_generator(ctx, conditional=True), loss_fn,
                                                  label_totals, cfg.gen_batch_size, cfg.gen_steps, cfg.gen_lr,
                                                  ctx.device)
        self.kd_opt = make_optimizer(self.student.parameters(), cfg.distill_optimizer, cfg.distill_lr,
                                     cfg.distill_weight_decay)
        self._last_batch: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def teacher(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return class_level_ensemble(self.ensemble.calibrated_client_logits(x), self.alpha, labels)

    def images_so_far(self) -> int:
        return self.synthesizer.generated

    def synthesis_epoch(self, epoch: int, ctx: ServerContext) -> Dict[str, Any]:
        return self.synthesizer.synthesize(self._seed(ctx, epoch, 0))

    def last_images(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return self._last_batch

    def kd_epoch(self, epoch: int, ctx: ServerContext) -> Dict[str, float]:
        cfg = self.config
        gen = torch.Generator().manual_seed(self._seed(ctx, epoch, 1))
        steps = cfg.gen_kd_steps or FEDFTG_KD_STEPS
        total = 0.0
        for _ in range(steps):
            t = time.perf_counter()
            x, y = self.synthesizer.sample(cfg.distill_batch_size, gen)
            _sync(ctx.device)
            spent = time.perf_counter() - t        # sampling is synthesis time
            self._synth_s += spent
            self._kd_s -= spent
            with torch.no_grad():
                teacher = self.teacher(x, y)
            loss = kd_kl(teacher, self.student(x), FEDFTG_KD_TEMPERATURE)
            self.kd_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.kd_opt.step()
            total += loss.item() / steps
        self._last_batch = (x.detach().cpu(), y.detach().cpu())
        return {"loss": total}
