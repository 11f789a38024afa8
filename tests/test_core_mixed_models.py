"""A model market: clients of two ViT architectures that share the image size and patch grid. The
ensemble loops over them (vmap refuses), FedAvg starts from the clients of the global architecture,
each client is evaluated with its own architecture, and FedMITR runs end to end."""
import pytest
import torch

from fedml_fedmitr.core.config import FedMITRConfig
from fedml_fedmitr.core.ensemble import Ensemble
from fedml_fedmitr.core.methods import Callbacks, ClientUpload, ServerContext, get_method
from fedml_fedmitr.core.models import create_vit
from fedml_fedmitr.core.server import evaluate_clients

from helpers_core import digits, loader, stats_of

torch.set_num_threads(1)
ARCHS = ["fedmitr_vit_micro", "fedmitr_vit_tiny"]


def build(name, seed=0):
    torch.manual_seed(seed)
    return create_vit(name, img_size=16, num_classes=10, in_chans=1, patch_size=4, depth=1)


def uploads():
    out = []
    for i in range(4):
        arch = ARCHS[i % 2]
        counts = [2 + (i + j) % 3 for j in range(10)]
        model = build(arch, seed=i)
        out.append(ClientUpload(i, {k: v.clone() for k, v in model.state_dict().items()}, sum(counts),
                                counts, architecture=arch, feature_stats=stats_of(model)))
    return out


def context(global_name="fedmitr_vit_micro"):
    (_, _), (xte, yte) = digits()
    return ServerContext(model_fn=lambda: build(global_name, seed=9), num_classes=10, input_shape=(1, 16, 16),
                         mean=[0.3], std=[0.35], eval_loader=loader(xte[:32], yte[:32]),
                         callbacks=Callbacks(progress=False), seed=0, model_name=global_name,
                         client_model_fn=lambda name: build(name, seed=9))


def test_the_ensemble_of_two_architectures_loops_and_refuses_vmap():
    ups, ctx = uploads(), context()
    ens = Ensemble.from_uploads(ups, ctx.model_fn, 10, FedMITRConfig(), "cpu", model_for=ctx.model_for)
    assert ens.batched == "loop" and [m.embed_dim for m in ens.models] == [96, 128, 96, 128]
    x = torch.randn(3, 1, 16, 16)
    logits, attn = ens(x, torch.arange(16).repeat(3, 1)[:, :8], return_attn=True)
    assert logits.shape == (3, 10) and attn.shape == (3, 8)
    with pytest.raises(ValueError, match="stacks clients of one architecture"):
        Ensemble.from_uploads(ups, ctx.model_fn, 10, FedMITRConfig(ensemble_batched="vmap"), "cpu",
                              model_for=ctx.model_for)


def test_each_client_is_evaluated_with_its_own_architecture():
    acc = evaluate_clients(uploads(), context())
    assert len(acc) == 4 and all(0.0 <= a <= 1.0 for a in acc)


def test_fedmitr_runs_on_mixed_clients_and_fedavg_uses_the_global_architecture():
    ups, ctx = uploads(), context()
    cfg = FedMITRConfig(num_synthetic=8, synthesis_batch_size=8, inversion_iters=4, distill_epochs=1,
                        distill_batch_size=8)
    method = get_method("FedMITR")(cfg)
    result = method.run(ups, ctx)
    assert result.model.embed_dim == 96 and 0.0 <= result.metrics["test_acc"] <= 1.0
    start = get_method("OneShotFedAvg")(cfg).run(ups, ctx).model.state_dict()
    micro = [u for u in ups if u.architecture == "fedmitr_vit_micro"]
    expected = (micro[0].state_dict["head.weight"] * micro[0].num_samples
                + micro[1].state_dict["head.weight"] * micro[1].num_samples) / (micro[0].num_samples + micro[1].num_samples)
    torch.testing.assert_close(start["head.weight"], expected)
    with pytest.raises(ValueError, match="no client has it"):
        get_method("FedMITR")(cfg).run(ups, context("fedmitr_vit_small"))
    with pytest.raises(ValueError, match="needs one architecture"):
        get_method("OneShotFedAvg")(cfg.replace(client_screening=True)).run(ups, ctx)
