"""What a researcher looks at after a run: pictures, metric curves and TensorBoard scalars.

:class:`ReportCallbacks` is the server methods' callback object for real runs. It writes, under
``output_dir``:

- ``synthetic_grid.png``: synthetic images, one row per class (torchvision ``make_grid``);
- ``synthetic_masks.png``: the same images with their keep masks overlaid (halted background
  patches tinted red, foreground patches untouched);
- ``metrics_history.json``: every scalar the run reported (inversion loss and kept tokens per
  iteration, distillation losses and test accuracy per epoch);
- ``tensorboard/``: the same scalars as TensorBoard events when ``tensorboard`` is on.

:func:`plot_label_distribution` draws the per-client label counts of the partition
(``label_distribution.png``). Progress bars are tqdm's, quiet off a terminal or when disabled.
"""
from __future__ import annotations

import io
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torchvision.utils import make_grid, save_image

from .checkpoint import write_bytes, write_text
from .methods.base import Callbacks

log = logging.getLogger("fedml_fedmitr")

BACKGROUND_TINT = (1.0, 0.0, 0.0)   # colour mixed into halted background patches
TINT_STRENGTH = 0.6


def denormalise(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Normalised model input -> [0, 1] pixels, always 3 channels (grey images repeated)."""
    m = torch.tensor(mean, dtype=images.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=images.dtype).view(1, -1, 1, 1)
    out = (images.detach().cpu() * s + m).clamp(0, 1)
    return out.repeat(1, 3, 1, 1) if out.shape[1] == 1 else out


def overlay_masks(pixels: torch.Tensor, masks: torch.Tensor, grid: Tuple[int, int],
                  patch: Tuple[int, int]) -> torch.Tensor:
    """Tint the patches where ``masks`` (B, N) is False (halted background); keep the rest as is."""
    b, _, h, w = pixels.shape
    bg = (~masks.bool()).view(b, 1, grid[0], grid[1]).float()
    bg = bg.repeat_interleave(patch[0], 2).repeat_interleave(patch[1], 3)
    full = torch.zeros(b, 1, h, w)
    full[:, :, :bg.shape[2], :bg.shape[3]] = bg
    tint = torch.tensor(BACKGROUND_TINT).view(1, 3, 1, 1).expand_as(pixels)
    tinted = (1 - TINT_STRENGTH) * pixels + TINT_STRENGTH * tint
    return torch.where(full.bool().expand_as(pixels), tinted, pixels)


def class_rows(labels: torch.Tensor, per_class: int) -> List[int]:
    """Indices of up to ``per_class`` samples of each class, class by class."""
    order: List[int] = []
    for c in sorted(set(labels.tolist())):
        order.extend((labels == c).nonzero().view(-1)[:per_class].tolist())
    return order


def save_synthetic_pictures(images: torch.Tensor, labels: torch.Tensor, masks: Optional[torch.Tensor],
                            mean, std, grid, patch, out_dir: Path, per_class: int = 8,
                            min_tile: int = 64) -> List[Path]:
    """Write ``synthetic_grid.png`` (and ``synthetic_masks.png`` when masks are given); tiles are
    enlarged (nearest neighbour) to at least ``min_tile`` pixels so small images stay readable."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    order = class_rows(labels, per_class)
    if not order:
        return []
    pixels = denormalise(images[order], mean, std)
    nrow = min(per_class, max(1, max((labels == c).sum().item() for c in set(labels.tolist()))))
    pad = 1
    scale = max(1, -(-min_tile // pixels.shape[-1]))

    def tiles(x: torch.Tensor) -> torch.Tensor:
        x = x.repeat_interleave(scale, 2).repeat_interleave(scale, 3)
        return make_grid(_pad_classes(x, labels[order], nrow), nrow=nrow, padding=pad)

    written = []
    path = out_dir / "synthetic_grid.png"
    _save_png(tiles(pixels), path)
    written.append(path)
    if masks is not None:
        path = out_dir / "synthetic_masks.png"
        _save_png(tiles(overlay_masks(pixels, masks[order], grid, patch)), path)
        written.append(path)
    return written


def _save_png(grid: torch.Tensor, path: Path) -> None:
    """torchvision's save_image, written atomically and never through a symlink."""
    buf = io.BytesIO()
    save_image(grid, buf, format="png")
    write_bytes(path, buf.getvalue())


def _pad_classes(pixels: torch.Tensor, labels: torch.Tensor, nrow: int) -> torch.Tensor:
    """Fill each class's row up to ``nrow`` with blank tiles, so one row = one class."""
    tiles = []
    for c in sorted(set(labels.tolist())):
        rows = pixels[labels == c][:nrow]
        blank = torch.zeros(nrow - rows.shape[0], *pixels.shape[1:])
        tiles.append(torch.cat([rows, blank]))
    return torch.cat(tiles)


def plot_label_distribution(label_counts: Sequence[Sequence[int]], path: Path,
                            title: str = "label distribution of the partition") -> Path:
    """Stacked bars: one bar per client, one colour per class (matplotlib, no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    counts = np.asarray(label_counts, dtype=float)
    k, c = counts.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * k + 2), 3.2))
    bottom = np.zeros(k)
    cmap = plt.get_cmap("tab10" if c <= 10 else "tab20")
    for j in range(c):
        ax.bar(np.arange(k), counts[:, j], bottom=bottom, color=cmap(j % cmap.N), label=str(j))
        bottom += counts[:, j]
    ax.set_xlabel("client")
    ax.set_ylabel("samples")
    ax.set_title(title)
    ax.set_xticks(np.arange(k))
    ax.legend(title="class", bbox_to_anchor=(1.01, 1), loc="upper left", fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    write_bytes(path, buf.getvalue())
    plt.close(fig)
    return path


class ReportCallbacks(Callbacks):
    """Callbacks of a real run: tqdm bars, logging, metric history, TensorBoard, pictures."""

    def __init__(self, output_dir, progress: bool = True, tensorboard: bool = False, save_images: bool = True,
                 mean: Sequence[float] = (0.5,), std: Sequence[float] = (0.5,),
                 grid: Tuple[int, int] = (1, 1), patch: Tuple[int, int] = (1, 1), per_class: int = 8,
                 logger: Optional[logging.Logger] = None, sink: Optional[Callable[[str, float, int], None]] = None):
        """``sink(name, value, step)``: every metric also goes there (the FedML adapter's tracking)."""
        super().__init__(progress)
        self.sink = sink
        self.output_dir = Path(output_dir)
        self.save_images = save_images
        self.mean, self.std, self.grid, self.patch = list(mean), list(std), tuple(grid), tuple(patch)
        self.per_class = per_class
        self.history: Dict[str, List[Tuple[int, float]]] = defaultdict(list)
        self._images: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = []
        self._seen: Dict[int, int] = defaultdict(int)
        self.logger = logger or log
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))

    def log(self, message: str) -> None:
        self.logger.info(message)

    def metric(self, name: str, value: float, step: int) -> None:
        self.history[name].append((int(step), float(value)))
        if self.writer is not None:
            self.writer.add_scalar(name, float(value), int(step))
        if self.sink is not None:
            try:
                self.sink(name, float(value), int(step))
            except Exception as exc:  # tracking must never cost the run its results
                self.logger.warning("tracking stopped: %s: %s", type(exc).__name__, exc)
                self.sink = None

    def scalars(self, values: Dict, prefix: str = "summary", step: int = 0) -> None:
        """Every number of a (nested) dict, e.g. the run summary, as TensorBoard scalars."""
        for key, value in values.items():
            name = f"{prefix}/{key}"
            if isinstance(value, dict):
                self.scalars(value, name, step)
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        self.metric(f"{name}/{i}", v, step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                self.metric(name, value, step)

    def images(self, name, images, labels, masks) -> None:
        """Keep up to ``per_class`` synthetic images of each class for the pictures."""
        if not self.save_images:
            return
        take = []
        for i, c in enumerate(labels.tolist()):
            if self._seen[c] < self.per_class:
                self._seen[c] += 1
                take.append(i)
        if take:
            idx = torch.tensor(take)
            self._images.append((images[idx].detach().cpu(), labels[idx].detach().cpu(),
                                 None if masks is None else masks[idx].detach().cpu()))
        self.write_pictures()

    def write_pictures(self) -> List[Path]:
        if not self._images:
            return []
        imgs = torch.cat([t[0] for t in self._images])
        labels = torch.cat([t[1] for t in self._images])
        masks = None if any(t[2] is None for t in self._images) else torch.cat([t[2] for t in self._images])
        return save_synthetic_pictures(imgs, labels, masks, self.mean, self.std, self.grid, self.patch,
                                       self.output_dir, self.per_class)

    def close(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_text(self.output_dir / "metrics_history.json", json.dumps({k: v for k, v in self.history.items()}))
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
