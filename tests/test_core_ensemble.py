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
