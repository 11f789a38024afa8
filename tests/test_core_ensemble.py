import pytest
import torch

from fedml_fedmitr.core.ensemble import Ensemble, client_weights

from helpers_core import tiny_ensemble, tiny_vit


@pytest.mark.parametrize("keep", [None, torch.tensor([[0, 2, 5, 7], [1, 3, 8, 15], [4, 6, 9, 10]])])
def test_batched_ensemble_equals_looped_ensemble(keep):
    x = torch.randn(3, 1, 16, 16)
    looped, batched = tiny_ensemble(4, "loop"), tiny_ensemble(4, "vmap")
    torch.testing.assert_close(batched(x, keep), looped(x, keep), rtol=1e-4, atol=1e-5)
    la, aa = looped(x, keep, return_attn=True)
    lb, ab = batched(x, keep, return_attn=True)
    torch.testing.assert_close(ab, aa, rtol=1e-4, atol=1e-6)


def test_batched_ensemble_passes_gradients_to_the_input():
    x = torch.randn(2, 1, 16, 16, requires_grad=True)
    ens = tiny_ensemble(3, "vmap")
    ens(x).sum().backward()
    g_vmap = x.grad.clone()
    x.grad = None
    tiny_ensemble(3, "loop")(x).sum().backward()
    torch.testing.assert_close(g_vmap, x.grad, rtol=1e-4, atol=1e-6)


def test_ensemble_weights():
    counts = [[10, 0], [30, 5]]
    w = client_weights("per_class", [10, 35], counts, 2)
    torch.testing.assert_close(w, torch.tensor([[0.25, 0.0], [0.75, 1.0]]))
    torch.testing.assert_close(client_weights("samples", [10, 30], counts, 2)[:, 0], torch.tensor([0.25, 0.75]))
    assert torch.allclose(client_weights("mean", [1, 1, 1, 1], [[1, 1]] * 4, 2), torch.full((4, 2), 0.25))


def test_mean_ensemble_is_the_mean_of_client_logits():
    models = [tiny_vit(seed=i) for i in range(3)]
    ens = Ensemble(models, client_weights("mean", [1] * 3, [[1] * 10] * 3, 10))
    x = torch.randn(2, 1, 16, 16)
    expected = torch.stack([m(x) for m in models]).mean(0)
    torch.testing.assert_close(ens(x), expected, rtol=1e-5, atol=1e-5)


def test_robust_aggregates_resist_one_outlier():
    logits = torch.zeros(5, 1, 3)
    logits[:, 0, 0] = torch.tensor([1.0, 1.0, 1.0, 1.0, 100.0])
    ens = tiny_ensemble(1)
    ens.aggregate = "median"
    assert ens.combine(logits)[0, 0] == 1.0
    ens.aggregate, ens.trim_fraction = "trimmed_mean", 0.2
    assert ens.combine(logits)[0, 0] == 1.0


def test_label_prior_calibration_stops_a_one_class_client_voting_for_it_everywhere():
    """ensemble_calibration: label_prior subtracts each client's log label prior from its logits before
    they are combined: a client that saw only class 0 (and answers 0 for everything) no longer outvotes
    a client that knows the image's class; the offsets follow the clients through subset()."""
    import torch

    from fedml_fedmitr.core.config import FedMITRConfig
    from fedml_fedmitr.core.ensemble import Ensemble, label_prior_offsets

    counts = [[98, 1, 1], [10, 45, 45]]
    off = label_prior_offsets(counts, 3)
    assert off.shape == (2, 3)
    assert torch.allclose(off.exp().sum(1), torch.ones(2))
    assert off[0, 0] > off[0, 1] and off[1, 1] == off[1, 2]
    # logits (K=2, B=1, C=3): client 0 says "class 0" loudly, client 1 says "class 1"
    logits = torch.tensor([[[5.0, 0.0, 0.0]], [[0.0, 3.0, 0.0]]])
    plain = Ensemble.__new__(Ensemble)
    plain.weights, plain.aggregate, plain.offsets = torch.full((2, 3), 0.5), "mean", None
    assert plain.combine(logits).argmax(1).item() == 0
    calibrated = Ensemble.__new__(Ensemble)
    calibrated.weights, calibrated.aggregate, calibrated.offsets = torch.full((2, 3), 0.5), "mean", off
    assert calibrated.combine(logits).argmax(1).item() == 1
    assert torch.equal(calibrated.calibrated(logits), logits - off.unsqueeze(1))
    assert FedMITRConfig(ensemble_calibration="label_prior").validate().ensemble_calibration == "label_prior"
