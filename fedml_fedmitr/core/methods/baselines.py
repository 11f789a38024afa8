"""Generator-based one-shot baselines: DENSE, Co-Boosting and FedFTG (one-shot use of its server step).

Each interleaves synthesis and distillation epoch by epoch (``gen_epochs`` epochs):

- **DENSE** (Zhang et al., NeurIPS 2022): the generator is reset every epoch and trained
  ``gen_steps`` Adam steps on ``dense_generator_loss`` (CE of the ensemble on the generator's
  target labels + the adversarial KL masked to samples where student and ensemble disagree);
  the lowest-loss batch joins a growing pool; the student is distilled over the whole pool
  (``kd_kl`` at ``baseline_kd_temperature``).
- **Co-Boosting** (Dai et al., ICLR 2024): the same generator on ``coboost_generator_loss``
  (hard-sample CE weighted by (1 - p_y) + unmasked adversarial KL at T = 3); the ensemble's
  client weights take one signed-gradient pass over the pool per epoch
  (``coboost_weight_step``); KD at ``coboost_temperature`` on inputs perturbed by
  ``ods_perturb``; SGD with cosine decay.
- **FedFTG** (Zhang et al., CVPR 2022): a conditional generator kept across epochs, trained on
  ``fedftg_generator_loss`` (CE of the class-level ensemble + adversarial KL on samples where
  student and ensemble still agree + diversity), labels drawn in proportion to the clients'
  label counts; the global model (FedAvg init) fits the class-level ensemble's soft labels on
  fresh generated batches.

ViT adaptations, throughout: no BatchNorm-statistics term (ViTs have no BatchNorm, so DENSE's
and Co-Boosting's BN loss weight is 0); the generator makes images of the ViT's ``img_size`` in
its normalised pixel space (see ``core/generator.py``). The student starts from
``config.student_init`` (FedAvg of the clients by default; DENSE and Co-Boosting trained a fresh
student).

Timings: ``synthesis_s`` accumulates generator training and sampling, ``distill_s`` the KD
steps (plus Co-Boosting's weight update, which is part of its teacher fitting).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..client import make_optimizer
from ..distill import kd_kl
from ..evaluate import evaluate_model
from ..generator import (
    AdversarialSynthesizer,
    ConditionalGenerator,
    Generator,
    random_shift_flip,
)
from . import register_method
from .base import ServerContext, ServerMethod, ServerResult
from .baseline_losses import (  # noqa: F401  (re-exported: the losses were defined here)
    class_level_ensemble,
    coboost_generator_loss,
    coboost_weight_step,
    dense_generator_loss,
    diversity_loss,
    fedftg_generator_loss,
    masked_adversarial_loss,
    ods_perturb,
    per_sample_kl,
    weighted_ensemble,
)

# ---- constants of the papers that have no config key (yet) ----
GENERATOR_WIDTH = 64            # ngf of the DENSE generator
COBOOST_WEIGHT_DECAY_RATE = 0.99  # mu_epoch = coboost_mu * 0.99 ** epoch
COBOOST_KD_LR = 0.01            # Co-Boosting: SGD, lr 0.01 (its paper), momentum 0.9, cosine
COBOOST_KD_MOMENTUM = 0.9
COBOOST_KD_WEIGHT_DECAY = 1e-4  # Co-Boosting code default
COBOOST_GRAD_CLIP = 10.0        # Co-Boosting clips generator and student gradients at norm 10
FEDFTG_KD_STEPS = 5             # FedFTG: I_d = 5 global-model steps per outer iteration
FEDFTG_KD_TEMPERATURE = 1.0     # FedFTG fits the ensemble's plain softmax


class _LoopState:
    """What ``synthesize()`` hands to ``distill()``: the interleaved loop runs in ``distill``."""

    def __init__(self) -> None:
        self.num_images = 0

    def __len__(self) -> int:
        return self.num_images


class GeneratorBaseline(ServerMethod):
    """Base of the three: ``distill`` runs ``gen_epochs`` epochs of (synthesis, KD) and keeps the two
    times apart; ``run`` reports them as ``synthesis_s`` and ``distill_s``."""

    generator_width: int = GENERATOR_WIDTH
    progress_name = "generator synthesis + KD"
    sections = ServerMethod.sections + ("student", "generator")
    # a "generator" key only DeepInversion reads: a generator distils on fresh batches, with no pool to
    # measure the teacher's confidence on
    forced = ("baseline_kd_target_confidence",)

    # ---- life cycle ----
    def run(self, uploads, ctx: ServerContext) -> ServerResult:
        self._synth_s = 0.0
        self._kd_s = 0.0
        result = super().run(uploads, ctx)
        # the base class timed synthesize() (nothing) and distill() (the whole loop): replace with ours
        self.timings["synthesis_s"] = self._synth_s
        self.timings["distill_s"] = self._kd_s
        n = result.metrics["num_synthetic"]
        result.metrics["images_per_s"] = n / self._synth_s if n and self._synth_s > 0 else 0.0
        result.metrics["timings"] = dict(self.timings)
        return result

    def synthesize(self, ctx: ServerContext) -> _LoopState:
        return _LoopState()

    def num_synthetic(self, pool: Any) -> int:
        return 0 if pool is None else len(pool)

    def distill(self, state: _LoopState, ctx: ServerContext) -> nn.Module:
        cfg = self.config
        self._synth_s = getattr(self, "_synth_s", 0.0)
        self._kd_s = getattr(self, "_kd_s", 0.0)
        self.setup(ctx)
        bar = ctx.callbacks.progress(f"{self.name} {self.progress_name}", cfg.gen_epochs)
        for epoch in range(cfg.gen_epochs):
            t = time.perf_counter()
            self.student.eval()
            self.student.requires_grad_(False)      # the generator's losses must not touch the student
            try:
                gen_info = self.synthesis_epoch(epoch, ctx)
            finally:
                self.student.requires_grad_(True)
            _sync(ctx.device)
            self._synth_s += time.perf_counter() - t
            t = time.perf_counter()
            self.student.train()
            kd_info = self.kd_epoch(epoch, ctx)
            _sync(ctx.device)
            self._kd_s += time.perf_counter() - t
            state.num_images = self.images_so_far()
            ctx.callbacks.metric(f"{self.name}/generator_loss", float(gen_info["loss"]), epoch)
            for k, v in gen_info.get("parts", {}).items():
                ctx.callbacks.metric(f"{self.name}/generator_{k}", float(v), epoch)
            ctx.callbacks.metric("distill/loss", float(kd_info["loss"]), epoch)
            if ctx.eval_loader is not None and cfg.eval_every and (epoch + 1) % cfg.eval_every == 0:
                acc = evaluate_model(self.student, ctx.eval_loader, ctx.device, ctx.num_classes)["acc"]
                ctx.callbacks.metric("distill/test_acc", acc, epoch)
            bar.update(1)
            bar.set_postfix(gen=f"{gen_info['loss']:.3f}", kd=f"{kd_info['loss']:.3f}", pool=state.num_images)
        bar.close()
        shown = self.last_images()
        if shown is not None:
            ctx.callbacks.images(f"{self.name}_last_batch", shown[0], shown[1], None)
        ctx.callbacks.log(f"{self.name}: {cfg.gen_epochs} epochs, {state.num_images} generated images, "
                          f"synthesis {self._synth_s:.1f}s, distillation {self._kd_s:.1f}s")
        self.student.eval()
        return self.student

    # ---- per method ----
    def setup(self, ctx: ServerContext) -> None:
        raise NotImplementedError

    def synthesis_epoch(self, epoch: int, ctx: ServerContext) -> Dict[str, Any]:
        raise NotImplementedError

    def kd_epoch(self, epoch: int, ctx: ServerContext) -> Dict[str, float]:
        raise NotImplementedError

    def images_so_far(self) -> int:
        raise NotImplementedError

    def last_images(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The last generated batch (normalised images, labels) on the CPU, for ``callbacks.images``."""
        pool = getattr(getattr(self, "synthesizer", None), "pool", None)
        if pool is None or not pool.batches:
            return None
        return pool.batches[-1]["images"], pool.batches[-1]["labels"]

    # ---- helpers ----
    def _seed(self, ctx: ServerContext, epoch: int, stream: int) -> int:
        """A distinct, reproducible seed per (run seed, epoch, stream)."""
        return (int(ctx.seed) * 1_000_003 + epoch * 16 + stream) % (2 ** 63)

    def _new_generator(self, ctx: ServerContext, conditional: bool = False) -> Generator:
        args = (self.config.gen_nz, ctx.input_shape, ctx.mean, ctx.std)
        if conditional:
            g = ConditionalGenerator(*args, num_classes=ctx.num_classes, ngf=self.generator_width)
        else:
            g = Generator(*args, ngf=self.generator_width)
        return g.reset(torch.Generator().manual_seed(self._seed(ctx, 0, 15)))

    def _pool_batches(self, n: int, gen: torch.Generator, one_pass: bool = False) -> List[torch.Tensor]:
        """Index batches for one KD epoch over a pool of ``n``: one shuffled pass, or ``gen_kd_steps``
        batches cycling through shuffled passes."""
        b = self.config.distill_batch_size
        steps = (n + b - 1) // b if (one_pass or not self.config.gen_kd_steps) else self.config.gen_kd_steps
        order = torch.randperm(n, generator=gen)
        out = []
        pos = 0
        for _ in range(steps):
            if pos >= n:
                order, pos = torch.randperm(n, generator=gen), 0
            out.append(order[pos:pos + b])
            pos += b
        return out


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _chunked(fn, x: torch.Tensor, device, chunk: int = 256) -> torch.Tensor:
    return torch.cat([fn(x[i:i + chunk].to(device)).cpu() for i in range(0, x.shape[0], chunk)])


# =============================================================================================
# DENSE
# =============================================================================================
@register_method
class DENSE(GeneratorBaseline):
    """DENSE: a reset-every-epoch generator, a growing pool, KD over the whole pool every epoch."""

    name = "DENSE"

    def setup(self, ctx: ServerContext) -> None:
        cfg = self.config

        def loss_fn(images, labels, z):
            teacher = self.ensemble(images)
            return dense_generator_loss(teacher, self.student(images), labels, cfg.gen_adv_weight)

        # teacher logits of each pool image are cached when KD sees the images unaugmented
        extras = None if cfg.distill_augment else (lambda x: {"teacher": _chunked(self.ensemble, x, ctx.device)})
        # DENSE augments the generated images (random crop + flip) before the models see them;
        # distill_augment switches it off for data where a flip changes the meaning (digits)
        self.synthesizer = AdversarialSynthesizer(
            self._new_generator(ctx), loss_fn, ctx.num_classes, cfg.gen_batch_size, cfg.gen_steps, cfg.gen_lr,
            ctx.device, augment=cfg.distill_augment, extras_fn=extras)
        # DENSE's code: SGD with a constant lr; here the shared distill_* optimiser settings (AdamW by default,
        # better suited to ViTs), constant lr as in DENSE
        self.kd_opt = make_optimizer(self.student.parameters(), cfg.distill_optimizer, cfg.distill_lr,
                                     cfg.distill_weight_decay)

    def synthesis_epoch(self, epoch: int, ctx: ServerContext) -> Dict[str, Any]:
        return self.synthesizer.synthesize(self._seed(ctx, epoch, 0))

    def images_so_far(self) -> int:
        return len(self.synthesizer.pool)

    def kd_epoch(self, epoch: int, ctx: ServerContext) -> Dict[str, float]:
        cfg = self.config
        pool = self.synthesizer.pool
        images = pool.get("images")
        cached = None if cfg.distill_augment else pool.get("teacher")
        gen = torch.Generator().manual_seed(self._seed(ctx, epoch, 1))
        batches = self._pool_batches(images.shape[0], gen)
        total = 0.0
        for idx in batches:
            x = images[idx].to(ctx.device)
            if cfg.distill_augment:
                x = random_shift_flip(x, gen)
                with torch.no_grad():
                    teacher = self.ensemble(x)
            else:
                teacher = cached[idx].to(ctx.device)
            loss = kd_kl(teacher, self.student(x), cfg.baseline_kd_temperature)
            self.kd_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.kd_opt.step()
            total += loss.item() / len(batches)
        return {"loss": total}


# =============================================================================================
# Co-Boosting
# =============================================================================================
@register_method
class CoBoosting(GeneratorBaseline):
    """Co-Boosting: hard-sample synthesis, per-epoch re-weighting of the clients, ODS-perturbed KD."""

    name = "CoBoosting"

    def setup(self, ctx: ServerContext) -> None:
        cfg = self.config
        # client weights w (K,), starting from the configured ensemble weights (1/K for "mean")
        self.client_weight = self.ensemble.weights.mean(1).detach().clone()
        self.client_weight = self.client_weight / self.client_weight.sum()
        self.weight_history: List[torch.Tensor] = [self.client_weight.cpu().clone()]

        def loss_fn(images, labels, z):
            teacher = self.teacher(images)
            return coboost_generator_loss(teacher, self.student(images), labels, cfg.gen_adv_weight)

        def extras(x):  # per-client logits of each pool image, for the weight update
            return {"client_logits": _chunked(lambda b: self.ensemble.calibrated_client_logits(b).transpose(0, 1),
                                              x, ctx.device)}

        # Co-Boosting's synthesizer does not augment the generated images
        self.synthesizer = AdversarialSynthesizer(
            self._new_generator(ctx), loss_fn, ctx.num_classes, cfg.gen_batch_size, cfg.gen_steps, cfg.gen_lr,
            ctx.device, augment=False, grad_clip=COBOOST_GRAD_CLIP, extras_fn=extras)
        self.kd_opt = torch.optim.SGD(self.student.parameters(), lr=COBOOST_KD_LR, momentum=COBOOST_KD_MOMENTUM,
                                      weight_decay=COBOOST_KD_WEIGHT_DECAY)
        self.kd_sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.kd_opt, T_max=max(1, cfg.gen_epochs))
        std = torch.tensor([float(s) for s in ctx.std]).view(1, -1, 1, 1)
        self.ods_eps = (cfg.coboost_eps / std).to(ctx.device)   # pixel units of [0, 1] -> normalised

    def teacher(self, x: torch.Tensor) -> torch.Tensor:
        """The ensemble with the current client weights (weighted mean of logits)."""
        return weighted_ensemble(self.ensemble.calibrated_client_logits(x), self.client_weight.to(x.device))

    def images_so_far(self) -> int:
        return len(self.synthesizer.pool)

    def synthesis_epoch(self, epoch: int, ctx: ServerContext) -> Dict[str, Any]:
        return self.synthesizer.synthesize(self._seed(ctx, epoch, 0))

    def update_client_weights(self, epoch: int, ctx: ServerContext) -> None:
        """One signed-gradient pass over the pool as it was before this epoch's batch (as in the
        Co-Boosting code, where the weights move before the new batch joins the pool)."""
        old = self.synthesizer.pool.batches[:-1]
        if epoch == 0 or not old:
            return
        logits = torch.cat([b["client_logits"] for b in old]).transpose(0, 1)  # (K, N, C)
        labels = torch.cat([b["labels"] for b in old])
        mu = self.config.coboost_mu * COBOOST_WEIGHT_DECAY_RATE ** epoch
        gen = torch.Generator().manual_seed(self._seed(ctx, epoch, 3))
        w = self.client_weight.cpu()
        for idx in self._pool_batches(labels.shape[0], gen, one_pass=True):
            w = coboost_weight_step(w, logits[:, idx], labels[idx], mu)
        self.client_weight = w.to(ctx.device)
        self.weight_history.append(w.clone())
        for i, v in enumerate(w.tolist()):
            ctx.callbacks.metric(f"{self.name}/client_weight_{i}", v, epoch)

    def kd_epoch(self, epoch: int, ctx: ServerContext) -> Dict[str, float]:
        cfg = self.config
        self.update_client_weights(epoch, ctx)       # timed as distillation (teacher fitting)
        images = self.synthesizer.pool.get("images")
        gen = torch.Generator().manual_seed(self._seed(ctx, epoch, 1))
        batches = self._pool_batches(images.shape[0], gen)
        total = 0.0
        for idx in batches:
            x = images[idx].to(ctx.device)
            if cfg.distill_augment:
                x = random_shift_flip(x, gen)
            x = ods_perturb(x, self.teacher, self.ods_eps, cfg.coboost_temperature, gen)
            with torch.no_grad():
                teacher = self.teacher(x)
            loss = kd_kl(teacher, self.student(x), cfg.coboost_temperature)
            self.kd_opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.student.parameters(), COBOOST_GRAD_CLIP)
            self.kd_opt.step()
            total += loss.item() / len(batches)
        self.kd_sched.step()
        return {"loss": total}
