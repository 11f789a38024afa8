"""The GPU path's precision: bf16 autocast of inversion and distillation is on with CUDA under
``autocast: auto``, off on the CPU, and forced by ``autocast: bf16``; forced on the CPU here, a FedMITR
run takes that path and still gives a finite model (the losses stay in float32)."""
import torch

from fedml_fedmitr.core.config import FedMITRConfig
from fedml_fedmitr.core.methods import Callbacks, ClientUpload, ServerContext, get_method
from fedml_fedmitr.core.models import autocast_enabled

from helpers_core import digits, loader, stats_of, tiny_vit

torch.set_num_threads(1)


def test_autocast_is_on_for_cuda_only_unless_forced():
    assert autocast_enabled("cuda", "auto") and not autocast_enabled("cpu", "auto")
    assert autocast_enabled("cpu", "bf16") and not autocast_enabled("cuda", "off")


def _run(mode):
    ups = []
    for i in range(2):
        counts = [3 + (i + j) % 4 for j in range(10)]
        model = tiny_vit(seed=i, depth=1)
        ups.append(ClientUpload(i, {n: v.clone() for n, v in model.state_dict().items()}, sum(counts), counts,
                                feature_stats=stats_of(model)))
    (_, _), (xte, yte) = digits()
    ctx = ServerContext(model_fn=lambda: tiny_vit(seed=9, depth=1), num_classes=10, input_shape=(1, 16, 16),
                        mean=[0.3], std=[0.35], eval_loader=loader(xte[:32], yte[:32]),
                        callbacks=Callbacks(progress=False), seed=0)
    cfg = FedMITRConfig(num_synthetic=16, synthesis_batch_size=8, inversion_iters=6, distill_epochs=2,
                        distill_batch_size=8, autocast=mode)
    return get_method("FedMITR")(cfg).run(ups, ctx)


def test_a_bf16_run_on_the_cpu_is_finite_and_differs_from_float32():
    bf16, fp32 = _run("bf16"), _run("off")
    for result in (bf16, fp32):
        assert all(torch.isfinite(v).all() for v in result.model.state_dict().values())
        assert 0.0 <= result.metrics["test_acc"] <= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(bf16.model.state_dict().values(),
                                                      fp32.model.state_dict().values()))
    assert torch.equal(_run("off").model.state_dict()["head.weight"], fp32.model.state_dict()["head.weight"])
