"""The pool measurements FedMITR reports (core/pool_stats.py): counts that add up, fits that equal a
direct computation, background counts only where there are background tokens."""
import torch

from fedml_fedmitr.core.inversion import indices_of
from fedml_fedmitr.core.pool_stats import pool_student_stats, pool_teacher_stats

from helpers_core import tiny_ensemble, tiny_vit


def _pool(n=30, kept=4, patches=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 1, 16, 16, generator=g)
    labels = torch.arange(n) % 10
    masks = torch.zeros(n, patches, dtype=torch.bool)
    for i in range(n):
        masks[i, torch.randperm(patches, generator=g)[:kept]] = True
    return images, labels, masks


def test_teacher_stats_count_every_image_and_match_the_ensemble():
    ens = tiny_ensemble(k=3)
    images, labels, masks = _pool()
    stats = pool_teacher_stats(ens, images, labels, masks, 10, "cpu")
    with torch.no_grad():
        full = ens(images).argmax(1)
        back = ens(images, indices_of(~masks)).argmax(1)
    assert stats["size"] == 30 and stats["labels"] == [3] * 10
    assert stats["ensemble_pred"] == torch.bincount(full, minlength=10).tolist()
    assert stats["background_pred"] == torch.bincount(back, minlength=10).tolist()
    assert abs(stats["fit"] - float((full == labels).float().mean())) < 1e-9
    assert abs(stats["background_fit"] - float((back == labels).float().mean())) < 1e-9
    for c in range(10):
        assert abs(stats["ensemble_fit_per_class"][c] - float((full[labels == c] == c).float().mean())) < 1e-9
    assert stats["foreground_tokens"] == 4
    with torch.no_grad():
        confidence = float(ens(images).softmax(1).max(1).values.mean())
    assert abs(stats["ensemble_confidence"] - confidence) < 1e-6


def test_a_dense_pool_has_no_background_counts_and_a_missing_class_has_no_fit():
    ens = tiny_ensemble(k=2)
    images, labels, _ = _pool(n=20)
    labels = labels % 5                                   # classes 5-9 never synthesised
    stats = pool_teacher_stats(ens, images, labels, torch.ones(20, 16, dtype=torch.bool), 10, "cpu")
    assert stats["background_pred"] is None and stats["background_fit"] is None
    assert stats["ensemble_fit_per_class"][5:] == [None] * 5
    assert sum(stats["ensemble_pred"]) == 20


def test_student_stats_agreement_is_one_for_the_ensemble_member_it_equals():
    student = tiny_vit(seed=0)
    ens = tiny_ensemble(k=1)                              # the same weights as the student
    images, _, _ = _pool(n=25)
    stats = pool_student_stats(student.train(), ens, images, 10, "cpu")
    assert stats["student_agreement"] == 1.0 and sum(stats["student_pred"]) == 25
    assert student.training                               # left as it was
    other = pool_student_stats(tiny_vit(seed=5), ens, images, 10, "cpu")
    with torch.no_grad():
        expected = float((tiny_vit(seed=5)(images).argmax(1) == ens(images).argmax(1)).float().mean())
    assert abs(other["student_agreement"] - expected) < 1e-9
