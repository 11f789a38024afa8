import json

import pytest
import torch
from PIL import Image
from torchvision.transforms.functional import pil_to_tensor

from fedml_fedmitr.core.report import (
    ReportCallbacks,
    denormalise,
    overlay_masks,
    plot_label_distribution,
    save_synthetic_pictures,
)


def test_overlay_marks_exactly_the_background_patches_of_the_mask():
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(3, 3, 16, 16, generator=g)
    masks = torch.rand(3, 16, generator=g) < 0.4
    over = overlay_masks(pixels, masks, (4, 4), (4, 4))
    changed = (over != pixels).view(3, 3, 4, 4, 4, 4).permute(0, 2, 4, 1, 3, 5).reshape(3, 16, -1).any(-1)
    assert torch.equal(changed, ~masks)


def test_pictures_are_valid_images_with_one_row_per_class(tmp_path):
    imgs = torch.randn(20, 1, 16, 16)
    labels = torch.arange(20) % 4
    masks = torch.zeros(20, 16, dtype=torch.bool)
    masks[:, :5] = True
    paths = save_synthetic_pictures(imgs, labels, masks, [0.3], [0.35], (4, 4), (4, 4), tmp_path, per_class=3,
                                    min_tile=16)
    assert [p.name for p in paths] == ["synthetic_grid.png", "synthetic_masks.png"]
    grid = pil_to_tensor(Image.open(paths[0]))
    # 4 classes x 3 per class, 16 px tiles, padding 1: (4*17+1) x (3*17+1)
    assert tuple(grid.shape) == (3, 4 * 17 + 1, 3 * 17 + 1)
    masked = pil_to_tensor(Image.open(paths[1])).float() / 255
    plain = grid.float() / 255
    # the overlay differs from the plain grid exactly on background patches (row 0 of each tile kept)
    tile_fg = masked[:, 1:5, 1:17]   # first tile, first patch row (patches 0-3 kept)
    assert torch.allclose(tile_fg, plain[:, 1:5, 1:17], atol=1 / 255)
    assert not torch.allclose(masked[:, 9:13, 1:17], plain[:, 9:13, 1:17], atol=1 / 255)


def test_label_distribution_plot(tmp_path):
    path = plot_label_distribution([[5, 0, 1], [0, 7, 2]], tmp_path / "labels.png")
    img = Image.open(path)
    img.verify()
    assert img.size[0] > 100 and img.size[1] > 100


def test_report_callbacks_write_history_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    cb = ReportCallbacks(tmp_path, progress=False, tensorboard=True, mean=[0.3], std=[0.35], grid=(4, 4),
                         patch=(4, 4), per_class=2)
    cb.metric("inversion/loss", 2.5, 0)
    cb.metric("inversion/loss", 1.5, 10)
    cb.scalars({"test_acc": 0.5, "timings": {"total_s": 3.0}, "client_test_acc": [0.1, 0.2], "name": "x"})
    cb.images("b0", torch.randn(6, 1, 16, 16), torch.tensor([0, 0, 0, 1, 1, 2]), torch.ones(6, 16, dtype=torch.bool))
    cb.close()
    hist = json.loads((tmp_path / "metrics_history.json").read_text())
    assert hist["inversion/loss"] == [[0, 2.5], [10, 1.5]]
    assert hist["summary/timings/total_s"] == [[0, 3.0]]
    assert "summary/client_test_acc/1" in hist
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("inversion/loss")] == [2.5, 1.5]
    assert (tmp_path / "synthetic_grid.png").is_file()
    # 3 classes seen, at most 2 per class kept
    assert tuple(pil_to_tensor(Image.open(tmp_path / "synthetic_grid.png")).shape) == (3, 3 * 65 + 1, 2 * 65 + 1)  # tiles enlarged to 64 px


def test_denormalise_makes_three_channels_in_range():
    out = denormalise(torch.randn(2, 1, 4, 4) * 5, [0.3], [0.35])
    assert out.shape == (2, 3, 4, 4) and out.min() >= 0 and out.max() <= 1
