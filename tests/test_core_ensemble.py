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
    plain.weights, plain.aggregate, plain.offsets, plain.held = torch.full((2, 3), 0.5), "mean", None, None
    assert plain.combine(logits).argmax(1).item() == 0
    calibrated = Ensemble.__new__(Ensemble)
    calibrated.weights, calibrated.aggregate, calibrated.offsets, calibrated.held = (
        torch.full((2, 3), 0.5), "mean", off, None)
    assert calibrated.combine(logits).argmax(1).item() == 1
    assert torch.equal(calibrated.calibrated(logits), logits - off.unsqueeze(1))
    assert FedMITRConfig(ensemble_calibration="label_prior").validate().ensemble_calibration == "label_prior"


def test_held_classes_calibration_gives_a_client_no_say_on_classes_it_never_saw():
    """ensemble_calibration: held_classes turns each client's logits into log-probabilities over the
    classes it trained on and averages each class over its holders only: a loud client that never saw
    the image's class cannot outvote the one that did; gradients stay finite; subset() keeps the mask;
    a robust aggregate is refused."""
    import pytest
    import torch

    from fedml_fedmitr.core.config import ConfigError, FedMITRConfig
    from fedml_fedmitr.core.ensemble import UNHELD_LOG_PROB, Ensemble, held_class_mask

    counts = [[50, 50, 0, 0], [0, 0, 30, 0]]          # class 3 is held by nobody
    held = held_class_mask(counts, 4)
    assert held.tolist() == [[True, True, False, False], [False, False, True, False]]
    # client 0 is sure of class 0 and shouts about class 2 (which it never saw); client 1 only knows class 2
    logits = torch.tensor([[[4.0, 0.0, 9.0, 9.0]], [[1.0, 1.0, 2.0, 1.0]]], requires_grad=True)
    plain = Ensemble.__new__(Ensemble)
    plain.weights, plain.aggregate, plain.offsets, plain.held = torch.full((2, 4), 0.5), "mean", None, None
    assert plain.combine(logits).argmax(1).item() == 2
    ens = Ensemble.__new__(Ensemble)
    ens.weights, ens.aggregate, ens.offsets, ens.held = torch.full((2, 4), 0.5), "mean", None, held
    cal = ens.calibrated(logits)
    assert torch.allclose(cal[0, 0, :2].exp().sum(), torch.tensor(1.0))
    assert cal[0, 0, 2] == UNHELD_LOG_PROB and cal[1, 0, 2] == 0.0     # a lone held class: log 1
    out = ens.combine(logits)
    assert out[0, 3] == UNHELD_LOG_PROB and out[0, 2] == 0.0
    assert torch.allclose(out[0, :2], cal[0, 0, :2])                   # classes 0-1 come from client 0 only
    out[0, :3].sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 2] == 0.0
    with pytest.raises(ValueError, match="ensemble_aggregate"):
        Ensemble([tiny_vit()], torch.ones(1, 10), aggregate="median", held=torch.ones(1, 10, dtype=torch.bool))
    with pytest.raises(ConfigError, match="ensemble_aggregate"):
        FedMITRConfig(ensemble_calibration="held_classes", ensemble_aggregate="median").validate()
    assert FedMITRConfig().calibration() == "held_classes"                       # the default: auto
    assert FedMITRConfig(ensemble_aggregate="median").calibration() == "none"
    assert FedMITRConfig(ensemble_calibration="label_prior").calibration() == "label_prior"
    with pytest.raises(ValueError, match="client\\(s\\) \\[1\\]"):
        held_class_mask([[1, 0, 0, 0], [0, 0, 0, 0]], 4)
