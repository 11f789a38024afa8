import numpy as np
import pytest

from fedml_fedmitr.core.config import ConfigError, FedMITRConfig
from fedml_fedmitr.core.partition import dirichlet_partition, iid_partition, partition, pathological_partition

LABELS = np.repeat(np.arange(10), 100)


def _covers_once(parts, n):
    allidx = np.concatenate(parts)
    return len(allidx) == n and len(np.unique(allidx)) == n


@pytest.mark.parametrize("method", ["hetero", "pathological", "homo"])
def test_every_sample_assigned_exactly_once_and_seeded(method):
    a = partition(LABELS, 7, method, seed=3, alpha=0.3, classes_per_client=2)
    b = partition(LABELS, 7, method, seed=3, alpha=0.3, classes_per_client=2)
    c = partition(LABELS, 7, method, seed=4, alpha=0.3, classes_per_client=2)
    assert _covers_once(a, len(LABELS))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    if method != "pathological" or True:
        assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_dirichlet_minimum_size_and_skew():
    parts = dirichlet_partition(LABELS, 10, 0.1, seed=0, min_size=20)
    assert min(len(p) for p in parts) >= 20

    def skew(alpha):
        ps = dirichlet_partition(LABELS, 10, alpha, seed=1, min_size=10)
        # mean over clients of the largest class share
        return np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in ps])

    assert skew(0.05) > skew(100.0) + 0.3


def test_pathological_one_class_per_client():
    parts = pathological_partition(LABELS, 10, 1, seed=0)
    assert [len(np.unique(LABELS[p])) for p in parts] == [1] * 10
    parts = pathological_partition(LABELS, 20, 2, seed=0)
    assert all(len(np.unique(LABELS[p])) == 2 for p in parts)
    assert _covers_once(parts, len(LABELS))


def test_iid_is_balanced():
    sizes = [len(p) for p in iid_partition(LABELS, 3, seed=0)]
    assert max(sizes) - min(sizes) <= 1


def test_config_rejects_unknown_keys_and_bad_values_by_name():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['num_synthetc'\]"):
        FedMITRConfig.from_dict({"num_synthetc": 10})
    with pytest.raises(ConfigError, match=r"fedmitr_args.prune_ratio = 1.5 is invalid: expected a number in \(0, 1\)"):
        FedMITRConfig.from_dict({"prune_ratio": 1.5})
    with pytest.raises(ConfigError, match="fedmitr_args.distill_mode"):
        FedMITRConfig.from_dict({"distill_mode": "magic"})
    with pytest.raises(ConfigError, match="fedmitr_args.num_synthetic .* expected an integer"):
        FedMITRConfig.from_dict({"num_synthetic": "many"})
    with pytest.raises(ConfigError, match="prune_fractions gives prune iterations"):
        # SMI's fractions given explicitly collide at 20 iterations
        FedMITRConfig.from_dict({"inversion_iters": 20, "prune_fractions": [0.0125, 0.025, 0.05, 0.075]})
    cfg = FedMITRConfig.from_dict({"inversion_iters": 100, "prune_fractions": [0.1, 0.2, 0.35, 0.5]})
    assert cfg.prune_iterations() == [10, 20, 35, 50]
    assert FedMITRConfig(inversion_iters=4000).prune_iterations() == [50, 100, 200, 300]
    assert FedMITRConfig().keep_counts(64) == [54, 46, 39, 33]  # 0.85 ** j: about half of 64 tokens kept


def test_automatic_prune_schedule_fits_every_budget():
    # no prune knob: the schedule scales with inversion_iters and is valid for short runs
    assert FedMITRConfig.from_dict({"inversion_iters": 40}).prune_iterations() == [4, 8, 14, 20]
    assert FedMITRConfig(inversion_iters=60).prune_iterations() == [6, 12, 21, 30]
    assert FedMITRConfig(inversion_iters=5).prune_iterations() == [1, 2]      # coinciding points merge
    assert FedMITRConfig(inversion_iters=5).keep_counts(16) == [14, 12]
    assert FedMITRConfig(inversion_iters=4000).prune_iterations() == [50, 100, 200, 300]  # SMI's
    assert FedMITRConfig(inversion_iters=40, inversion="dense").prune_iterations() == []
    with pytest.raises(ConfigError, match="inversion_iters = 1 leaves no room to prune"):
        FedMITRConfig.from_dict({"inversion_iters": 1})


def test_inversion_augments_as_the_clients_trained():
    from fedml_fedmitr.core.config import resolve_augmentation
    cfg = FedMITRConfig()
    assert resolve_augmentation(cfg, 16, client_augment=True, client_flip=True) == (2, True)
    assert resolve_augmentation(cfg, 16, client_augment=False, client_flip=False) == (0, False)
    assert resolve_augmentation(cfg, 32, client_augment=True, client_flip=False) == (4, False)
    # set explicitly, they win
    assert resolve_augmentation(FedMITRConfig(jitter=1, flip=True), 16, False, False) == (1, True)
    assert FedMITRConfig.from_dict({"flip": None}).flip is None
    with pytest.raises(ConfigError, match="fedmitr_args.flip = 'yes' is invalid: expected true, false or null"):
        FedMITRConfig.from_dict({"flip": "yes"})


def test_color_shift_must_be_a_non_negative_number():
    assert FedMITRConfig.from_dict({"color_shift": 0.5}).color_shift == 0.5
    for bad in (-0.1, float("nan")):
        with pytest.raises(ConfigError, match="fedmitr_args.color_shift .* expected 0 \\(off\\) or a shift amplitude > 0"):
            FedMITRConfig.from_dict({"color_shift": bad})


def test_competition_weight_must_be_a_non_negative_number():
    assert FedMITRConfig.from_dict({"competition_weight": 2}).competition_weight == 2.0
    for bad in (-1.0, float("inf")):
        with pytest.raises(ConfigError, match="fedmitr_args.competition_weight = .* expected a finite number >= 0"):
            FedMITRConfig.from_dict({"competition_weight": bad})
