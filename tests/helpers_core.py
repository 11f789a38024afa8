"""Small shared builders for the core tests (tiny ViTs, digits data)."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fedml_fedmitr.core.ensemble import Ensemble, client_weights
from fedml_fedmitr.core.models import create_vit, token_moments


def tiny_vit(seed=0, img=16, patch=4, in_chans=1, classes=10, depth=2):
    torch.manual_seed(seed)
    return create_vit("fedmitr_vit_micro", img_size=img, num_classes=classes, in_chans=in_chans,
                      patch_size=patch, depth=depth).eval()


def tiny_ensemble(k=3, batched="loop", **kw):
    models = [tiny_vit(seed=i, **kw) for i in range(k)]
    return Ensemble(models, client_weights("mean", [1] * k, [[1] * 10] * k, 10), batched=batched,
                    feature_stats=[stats_of(m) for m in models])


def digits(img=16, seed=0):
    """scikit-learn's digits (real data), upsampled to img x img, normalised, split 80/20."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=img, mode="bilinear", align_corners=False)
    x = (x - 0.3) / 0.35
    y = torch.tensor(d.target).long()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(y))
    return (x[perm[:n_train]], y[perm[:n_train]]), (x[perm[n_train:]], y[perm[n_train:]])


def loader(x, y, batch=64, shuffle=False, seed=0):
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(seed))


def stats_of(model, n=32):
    """Feature statistics of the shape a client uploads with ``model``: its token moments on n fixed
    random images of its input size (what the tests need is their shape and a fixed value)."""
    g = torch.Generator().manual_seed(0)
    h, w = (int(v) for v in model.patch_embed.img_size)
    x = torch.randn(n, int(model.patch_embed.proj.in_channels), h, w, generator=g)
    return token_moments(model, loader(x, torch.zeros(n, dtype=torch.long)), "cpu")
