"""A stock FedML main.py, unchanged but for ``import fedml_fedmitr``.

    python examples/stock_main/main.py --cf examples/stock_main/fedml_config.yaml

Everything else is what a FedML user already has: ``fedml.init``, ``fedml.device.get_device``,
their own dataset in FedML's 8-item format, their own timm ViT, ``FedMLRunner(...).run()``. The
config says ``federated_optimizer: FedMITR`` and has a ``fedmitr_args:`` section.
"""
import fedml
import numpy as np
import timm
import torch
from fedml import FedMLRunner
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import fedml_fedmitr  # noqa: F401  makes FedMLRunner accept federated_optimizer: FedMITR


def load_my_dataset(args):
    """The user's own data: digits upsampled to img_size, normalised to [-1, 1], IID split."""
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = torch.nn.functional.interpolate(x, size=(args.img_size, args.img_size), mode="bilinear")
    x = (x - 0.5) / 0.5
    y = torch.tensor(d.target, dtype=torch.long)
    rng = np.random.default_rng(args.random_seed)
    order = torch.from_numpy(rng.permutation(len(y)))
    n_test = len(y) // 5
    test_idx, train_idx = order[:n_test], order[n_test:]
    test = DataLoader(TensorDataset(x[test_idx], y[test_idx]), batch_size=256)
    train_local, train_num, test_local = {}, {}, {}
    for i, part in enumerate(np.array_split(train_idx.numpy(), args.client_num_in_total)):
        part = torch.from_numpy(part)
        train_local[i] = DataLoader(TensorDataset(x[part], y[part]), batch_size=args.batch_size, shuffle=True)
        train_num[i] = len(part)
        test_local[i] = test
    train_global = DataLoader(TensorDataset(x[train_idx], y[train_idx]), batch_size=args.batch_size)
    dataset = [len(train_idx), n_test, train_global, test, train_num, train_local, test_local, 10]
    return dataset, 10


if __name__ == "__main__":
    args = fedml.init()
    device = fedml.device.get_device(args)
    dataset, output_dim = load_my_dataset(args)
    # the user's own timm ViT (a small one: 16x16 inputs, 4x4 patches, 3 blocks)
    torch.manual_seed(args.random_seed)
    model = timm.create_model(args.model, pretrained=False, img_size=args.img_size, patch_size=args.patch_size,
                              in_chans=1, num_classes=output_dim, embed_dim=96, depth=3, num_heads=3)
    FedMLRunner(args, device, dataset, model).run()
