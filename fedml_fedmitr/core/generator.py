"""Image generators and generator-based synthesizers for the DENSE / Co-Boosting / FedFTG baselines.

Kept independent of the server methods (in the style of Fast-Datafree): a *synthesizer* owns a
generator and its optimiser; ``synthesize()`` trains the generator for one epoch and (for the
DENSE-style synthesizer) adds the resulting batch to an :class:`ImagePool`; ``sample()`` draws new
images. What the generator is trained to do comes from a loss callable the method passes in, so
the methods only supply losses and the knowledge-distillation loop.

ViT adaptation (not in the papers, whose generators feed CNNs trained on [0, 1] or normalised
CIFAR images): the generator ends in a sigmoid, i.e. an image in [0, 1], which is then mapped into
the model's *normalised* pixel space with the context's per-channel mean and std, so every output
is a valid image for the ViT. Its size is the ViT's ``img_size``; for large inputs (224 px) extra
upsampling stages keep the first feature map small (DENSE's single Linear to 128 x 56 x 56 would
hold 100M weights).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

# the DENSE generator upsamples twice (s = H / 4); larger inputs get more stages until the first
# feature map is at most this many pixels on a side
MAX_FIRST_MAP = 16


def upsampling_stages(height: int, width: int, max_first: int = MAX_FIRST_MAP) -> int:
    """Number of x2 upsampling stages: 2 (DENSE), more while the first map would exceed ``max_first``."""
    if height % 4 or width % 4:
        raise ValueError(f"the generator needs an image height and width that are multiples of 4, "
                         f"got {height} x {width}")
    stages = 2
    while (max(height, width) >> stages) > max_first and height % (2 ** (stages + 1)) == 0 \
            and width % (2 ** (stages + 1)) == 0:
        stages += 1
    return stages


def pixel_bounds(mean: Sequence[float], std: Sequence[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Normalised values of pixel 0 and pixel 1 per channel, each shaped (1, C, 1, 1)."""
    m = torch.tensor([float(v) for v in mean]).view(1, -1, 1, 1)
    s = torch.tensor([float(v) for v in std]).view(1, -1, 1, 1)
    return (0.0 - m) / s, (1.0 - m) / s


class Generator(nn.Module):
    """The DENSE generator: Linear(nz -> 2*ngf*s*s) -> BN -> [Upsample -> conv3x3 -> BN -> LeakyReLU] x n
    -> conv3x3 -> sigmoid, then normalised with ``mean`` / ``std`` (see the module docstring)."""

    def __init__(self, nz: int, img_shape: Sequence[int], mean: Sequence[float], std: Sequence[float],
                 ngf: int = 64):
        super().__init__()
        c, h, w = (int(v) for v in img_shape)
        if len(mean) != c or len(std) != c:
            raise ValueError(f"mean/std have {len(mean)}/{len(std)} channels, the image has {c}")
        self.nz, self.img_shape, self.ngf = int(nz), (c, h, w), int(ngf)
        stages = upsampling_stages(h, w)
        self.first_map = (h >> stages, w >> stages)
        self.project = nn.Linear(self.nz, 2 * ngf * self.first_map[0] * self.first_map[1])
        layers: List[nn.Module] = [nn.BatchNorm2d(2 * ngf)]
        for i in range(stages):
            out = ngf if i == stages - 1 else 2 * ngf
            layers += [nn.Upsample(scale_factor=2), nn.Conv2d(2 * ngf, out, 3, padding=1, bias=False),
                       nn.BatchNorm2d(out), nn.LeakyReLU(0.2)]
        layers += [nn.Conv2d(ngf, c, 3, padding=1), nn.Sigmoid()]
        self.body = nn.Sequential(*layers)
        self.register_buffer("mean", torch.tensor([float(v) for v in mean]).view(1, c, 1, 1))
        self.register_buffer("std", torch.tensor([float(v) for v in std]).view(1, c, 1, 1))

    def latent(self, z: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        return z

    def unit_images(self, z: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Images in [0, 1], shaped (B, C, H, W)."""
        h = self.project(self.latent(z, labels))
        h = h.view(z.shape[0], 2 * self.ngf, self.first_map[0], self.first_map[1])
        return self.body(h)

    def forward(self, z: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Images in the model's normalised pixel space."""
        return (self.unit_images(z, labels) - self.mean) / self.std

    @torch.no_grad()
    def reset(self, gen: torch.Generator) -> "Generator":
        """DCGAN initialisation (weights N(0, 0.02), BN scales N(1, 0.02), biases 0, fresh BN
        statistics), drawn on the CPU from ``gen`` so it is reproducible on any device."""
        def normal(p: torch.Tensor, mean: float, std: float) -> None:
            p.copy_(torch.empty(p.shape).normal_(mean, std, generator=gen).to(p.device, p.dtype))

        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                normal(m.weight, 0.0, 0.02)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                normal(m.weight, 1.0, 0.02)
                m.bias.zero_()
                m.reset_running_stats()
            elif isinstance(m, nn.Embedding):
                normal(m.weight, 0.0, 1.0)
        return self


class ConditionalGenerator(Generator):
    """FedFTG's conditional generator: the DENSE generator on ``z * embedding(y)`` (the label
    embedding multiplies the latent code, as in ACGAN-style conditional generators)."""

    def __init__(self, nz: int, img_shape: Sequence[int], mean: Sequence[float], std: Sequence[float],
                 num_classes: int, ngf: int = 64):
        super().__init__(nz, img_shape, mean, std, ngf)
        self.num_classes = int(num_classes)
        self.label_embedding = nn.Embedding(self.num_classes, self.nz)

    def latent(self, z: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if labels is None:
            raise ValueError("the conditional generator needs the labels of the images to generate")
        return z * self.label_embedding(labels)


def random_shift_flip(x: torch.Tensor, gen: torch.Generator, pad: Optional[int] = None,
                      flip: bool = True) -> torch.Tensor:
    """Per image: a random crop after zero padding by ``pad`` pixels (default side // 8) and a random
    horizontal flip; differentiable with respect to ``x``; random numbers drawn on the CPU from
    ``gen``. The padding is 0 in normalised space (the mean colour)."""
    b, c, h, w = x.shape
    pad = max(1, h // 8) if pad is None else int(pad)
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
    flips = torch.rand(b, generator=gen) < 0.5
    padded = F.pad(x, (pad, pad, pad, pad))
    rows = (torch.arange(h).view(1, h) + dy.view(b, 1)).to(x.device)
    cols = torch.arange(w).view(1, w) + dx.view(b, 1)
    if flip:
        cols = torch.where(flips.view(b, 1), cols.flip(1), cols)
    cols = cols.to(x.device)
    return padded[torch.arange(b, device=x.device).view(b, 1, 1, 1),
                  torch.arange(c, device=x.device).view(1, c, 1, 1),
                  rows.view(b, 1, h, 1), cols.view(b, 1, 1, w)]


class ImagePool:
    """Generated images (normalised, on the CPU) with their target labels and any per-image extras
    (for example cached teacher logits), batch by batch. The DENSE pool grows every epoch."""

    def __init__(self) -> None:
        self.batches: List[Dict[str, torch.Tensor]] = []

    def add(self, images: torch.Tensor, labels: torch.Tensor, **extras: torch.Tensor) -> None:
        batch = {"images": images.detach().cpu(), "labels": labels.detach().cpu()}
        for key, value in extras.items():
            if value.shape[0] != images.shape[0]:
                raise ValueError(f"extra {key!r} has {value.shape[0]} rows for {images.shape[0]} images")
            batch[key] = value.detach().cpu()
        self.batches.append(batch)

    def __len__(self) -> int:
        return sum(int(b["labels"].shape[0]) for b in self.batches)

    def get(self, key: str) -> torch.Tensor:
        """All rows of ``key`` (``images``, ``labels`` or an extra), concatenated over batches."""
        if not self.batches:
            raise ValueError("the image pool is empty")
        return torch.cat([b[key] for b in self.batches])

    def state(self) -> dict:
        return {"batches": [dict(b) for b in self.batches]}

    @classmethod
    def from_state(cls, state: dict) -> "ImagePool":
        pool = cls()
        pool.batches = [dict(b) for b in state["batches"]]
        return pool


# loss_fn(images, labels, z) -> (loss, parts): images in normalised space (after any augmentation)
GeneratorLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, Dict[str, float]]]


class AdversarialSynthesizer:
    """DENSE-style synthesis (also Co-Boosting's): every epoch the generator is re-initialised, the
    latent codes ``z`` and the generator are optimised together for ``steps`` Adam steps
    (betas 0.5, 0.999, as in DENSE / Co-Boosting) on ``loss_fn``, and the batch of lowest loss seen
    during the epoch is added to ``self.pool`` (with its labels and what ``extras_fn`` computes)."""

    def __init__(self, generator: Generator, loss_fn: GeneratorLoss, num_classes: int, batch_size: int,
                 steps: int, lr: float, device, augment: bool = False, grad_clip: Optional[float] = None,
                 extras_fn: Optional[Callable[[torch.Tensor], Dict[str, torch.Tensor]]] = None):
        self.device = torch.device(device)
        self.generator = generator.to(self.device)
        self.loss_fn = loss_fn
        self.num_classes, self.batch_size = int(num_classes), int(batch_size)
        self.steps, self.lr = int(steps), float(lr)
        self.augment, self.grad_clip, self.extras_fn = augment, grad_clip, extras_fn
        self.pool = ImagePool()

    def synthesize(self, seed: int) -> Dict[str, object]:
        """One epoch: reset, train, keep the best batch. Deterministic given ``seed`` on the CPU."""
        gen = torch.Generator().manual_seed(int(seed))
        self.generator.reset(gen).train()
        z = torch.randn(self.batch_size, self.generator.nz, generator=gen).to(self.device).requires_grad_(True)
        labels = torch.randint(0, self.num_classes, (self.batch_size,), generator=gen).to(self.device)
        opt = torch.optim.Adam([{"params": self.generator.parameters()}, {"params": [z]}], lr=self.lr,
                               betas=(0.5, 0.999))
        best_loss, best_images, best_parts = float("inf"), None, {}
        for _ in range(self.steps):
            images = self.generator(z)
            seen = random_shift_flip(images, gen) if self.augment else images
            loss, parts = self.loss_fn(seen, labels, z)
            if best_images is None or loss.item() < best_loss:
                best_loss, best_images, best_parts = loss.item(), images.detach().clone(), parts
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if self.grad_clip is not None:
                nn.utils.clip_grad_norm_(self.generator.parameters(), self.grad_clip)
            opt.step()
        extras = self.extras_fn(best_images) if self.extras_fn is not None else {}
        self.pool.add(best_images, labels, **extras)
        return {"images": best_images, "labels": labels.detach(), "loss": best_loss, "parts": best_parts}


class ConditionalSynthesizer:
    """FedFTG-style synthesis: one conditional generator kept (not reset) across epochs and trained
    ``steps`` Adam steps per epoch on fresh latent codes and labels drawn with ``label_probs``;
    ``sample()`` then draws new labelled images from it."""

    def __init__(self, generator: ConditionalGenerator, loss_fn: GeneratorLoss, label_probs: torch.Tensor,
                 batch_size: int, steps: int, lr: float, device):
        self.device = torch.device(device)
        self.generator = generator.to(self.device)
        self.loss_fn = loss_fn
        probs = torch.as_tensor(label_probs, dtype=torch.float64).cpu()
        if probs.ndim != 1 or probs.numel() != generator.num_classes or not bool((probs >= 0).all()) \
                or float(probs.sum()) <= 0:
            raise ValueError("label_probs must be num_classes non-negative numbers, not all zero")
        self.label_probs = (probs / probs.sum()).float()
        self.batch_size, self.steps = int(batch_size), int(steps)
        self.opt = torch.optim.Adam(self.generator.parameters(), lr=float(lr))
        self.generated = 0          # images drawn by sample(): what the global model was fitted on

    def sample_labels(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """``n`` labels drawn independently in proportion to ``label_probs``."""
        return torch.multinomial(self.label_probs, int(n), replacement=True, generator=gen)

    def _draw(self, n: int, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        labels = self.sample_labels(n, gen).to(self.device)
        z = torch.randn(n, self.generator.nz, generator=gen).to(self.device)
        return z, labels

    def synthesize(self, seed: int) -> Dict[str, object]:
        """Train the generator ``steps`` steps; returns the mean loss and loss parts."""
        gen = torch.Generator().manual_seed(int(seed))
        self.generator.train()
        total, parts_sum = 0.0, {}
        for _ in range(self.steps):
            z, labels = self._draw(self.batch_size, gen)
            loss, parts = self.loss_fn(self.generator(z, labels), labels, z)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            total += loss.item() / self.steps
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0.0) + v / self.steps
        return {"loss": total, "parts": parts_sum}

    @torch.no_grad()
    def sample(self, n: int, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        """``n`` new (images, labels). BatchNorm uses the batch's statistics, as during training."""
        self.generator.train()
        z, labels = self._draw(n, gen)
        self.generated += int(n)
        return self.generator(z, labels), labels
