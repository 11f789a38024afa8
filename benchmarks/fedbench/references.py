"""Reference rows and probes shared by the benchmarks (torch side).

- ``real_pool_method``: a server method with its synthetic pool replaced by real unlabelled images
  (KD-real and KD-real-plain): same student start, loss and step budget, so a weak teacher or a
  short distillation is told apart from weak synthesis.
- ``attention_probe``: the ensemble's accuracy on real images seen through only k patches, chosen by
  its last-block CLS attention (top), at random, or the lowest (bottom).
- ``CurveRecorder``: the test accuracy per distillation epoch (the learning curve).
"""
from __future__ import annotations

from typing import Any, Dict, List

from fedml_fedmitr.core.methods import Callbacks


def real_pool_method(base_name: str, images):
    """FedMITR's method ``base_name`` with its synthesis replaced by ``images`` (real, unlabelled): each
    image labelled by the ensemble's argmax, its foreground the top attention patches, as many as the
    sparse schedule keeps."""
    import torch

    from fedml_fedmitr.core.inversion import SparseModelInversion, SyntheticBatch, SyntheticPool
    from fedml_fedmitr.core.methods import get_method

    class RealPool(get_method(base_name)):
        def synthesize(self, ctx):
            inv = SparseModelInversion(self.ensemble, self.config, ctx.input_shape, ctx.mean, ctx.std, ctx.device)
            fraction = self.config.keep_fraction(inv.num_patches)
            pool, bs = SyntheticPool(), self.config.synthesis_batch_size
            for i in range(0, len(images), bs):
                x = images[i:i + bs].to(ctx.device)
                with torch.no_grad():
                    y = self.ensemble(x).argmax(1)
                pool.add(SyntheticBatch(x, y, inv.attention_mask(x, fraction, y)))
            return pool

    return RealPool


def attention_probe(ensemble, loader, k: int, seed: int) -> Dict[str, Any]:
    """The ensemble's accuracy on real test images seen through only k patches: the k of highest
    last-block CLS attention (on the full image), k random ones, and the k lowest."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    hits = {"top_k": 0, "random_k": 0, "bottom_k": 0}
    total = 0
    with torch.no_grad():
        for x, y in loader:
            _, attn = ensemble(x, None, return_attn=True)
            n = attn.shape[1]
            order = attn.argsort(dim=1, descending=True)
            rand = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(len(y))])
            for name, idx in (("top_k", order[:, :k]), ("random_k", rand), ("bottom_k", order[:, -k:])):
                hits[name] += int((ensemble(x, idx.sort(dim=1).values).argmax(1) == y).sum())
            total += len(y)
    return dict({name: v / total for name, v in hits.items()}, k=k, num_patches=n)


def real_images(train_dataset, count: int, seed: int):
    """``count`` training images (normalised, as the plugin loaded them) drawn without labels, seeded."""
    import torch
    g = torch.Generator().manual_seed(int(seed))
    pick = torch.randperm(len(train_dataset), generator=g)[:int(count)]
    if hasattr(train_dataset, "tensors"):
        return train_dataset.tensors[0][pick]
    return torch.stack([train_dataset[int(i)][0] for i in pick])


class CurveRecorder(Callbacks):
    """Keeps the test accuracy after every distillation epoch (needs ``eval_every: 1``)."""

    def __init__(self):
        super().__init__(progress=False)
        self.curve: List[float] = []

    def metric(self, name: str, value: float, step: int) -> None:
        if name == "distill/test_acc":
            self.curve.append(float(value))


def probe_k(config, num_patches: int) -> int:
    """The patches FedMITR keeps at the end of its sparse schedule (the probe's k)."""
    return int(config.keep_counts(int(num_patches))[-1])

