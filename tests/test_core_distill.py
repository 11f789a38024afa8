import copy

import torch
import torch.nn.functional as F

from fedml_fedmitr.core.config import FedMITRConfig
from fedml_fedmitr.core.distill import (
    DriftGuard,
    augment_with_mask,
    background_targets,
    crop_with_mask,
    distill_student,
    token_relabel_loss,
)
from fedml_fedmitr.core.ensemble import Ensemble, client_weights
from fedml_fedmitr.core.models import embed_tokens

from helpers_core import tiny_ensemble, tiny_vit


def manual_subset_logits(model, x, mask):
    """Reference: each image on its own, tokens chosen by boolean indexing."""
    outs = []
    for i in range(x.shape[0]):
        tok = embed_tokens(model, x[i:i + 1])
        sel = torch.cat([tok[:, :1], tok[:, 1:][:, mask[i]]], dim=1)
        outs.append(model.forward_head(model.norm(model.blocks(sel))))
    return torch.cat(outs)


def random_mask(b, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(b, n, dtype=torch.bool)
    for i in range(b):
        m[i, torch.randperm(n, generator=g)[:k]] = True
    return m


def test_relabel_target_is_the_ensemble_on_exactly_the_background_tokens():
    ens = tiny_ensemble(3)
    x = torch.randn(4, 1, 16, 16)
    mask = random_mask(4, 16, 5)
    q = background_targets(ens, x, mask, temperature=2.0)
    ref = torch.stack([manual_subset_logits(m, x, ~mask) for m in ens.models]).mean(0)
    torch.testing.assert_close(q, F.softmax(ref / 2.0, dim=1), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(q, F.softmax(ens(x) / 2.0, dim=1), atol=1e-4)  # not the full image


def test_token_relabel_loss_matches_its_definition():
    ens, student = tiny_ensemble(2), tiny_vit(seed=9)
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([1, 2, 3, 4])
    mask = random_mask(4, 16, 4)
    cfg = FedMITRConfig(relabel_weight=0.5, kd_temperature=3.0, foreground_target="label")  # the paper's loss
    loss, parts = token_relabel_loss(student, ens, x, y, mask, cfg)
    ce = F.cross_entropy(manual_subset_logits(student, x, mask), y)
    q = F.softmax(torch.stack([manual_subset_logits(m, x, ~mask) for m in ens.models]).mean(0) / 3, 1)
    kl = F.kl_div(F.log_softmax(manual_subset_logits(student, x, ~mask) / 3, 1), q, reduction="batchmean") * 9
    torch.testing.assert_close(loss, ce + 0.5 * kl, rtol=1e-4, atol=1e-5)
    ce_only, _ = token_relabel_loss(student, ens, x, y, mask, cfg.replace(distill_mode="ce_foreground"))
    torch.testing.assert_close(ce_only, ce, rtol=1e-4, atol=1e-5)


def test_loss_decreases_on_a_fixed_batch():
    ens, student = tiny_ensemble(2), tiny_vit(seed=9)
    student.train()
    x, y = torch.randn(8, 1, 16, 16), torch.arange(8) % 10
    mask = random_mask(8, 16, 4)
    cfg = FedMITRConfig()
    opt = torch.optim.Adam(student.parameters(), lr=1e-3)
    first = None
    for _ in range(25):
        loss, _ = token_relabel_loss(student, ens, x, y, mask, cfg)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_augmentation_moves_image_and_mask_together():
    g = torch.Generator().manual_seed(3)
    x = torch.arange(16.0).view(1, 1, 4, 4).repeat_interleave(4, 2).repeat_interleave(4, 3).repeat(2, 1, 1, 1)
    mask = random_mask(2, 16, 5)
    for _ in range(6):
        xa, ma = augment_with_mask(x, mask, (4, 4), (4, 4), g)
        # the patch ids (pixel values) under the new mask are the ids under the old mask
        for i in range(2):
            ids_new = xa[i, 0, ::4, ::4].reshape(-1)[ma[i]].sort().values
            assert torch.equal(ids_new, mask[i].nonzero().view(-1).float())


def test_random_resized_crop_moves_image_and_mask_together():
    # the image is its own keep mask: 1 on the pixels of kept patches, 0 elsewhere, so the patches the
    # cropped mask keeps must be the ones the cropped image covers most
    mask = random_mask(6, 16, 5, seed=2)
    x = mask.float().view(6, 1, 4, 4).repeat_interleave(4, 2).repeat_interleave(4, 3)
    g = torch.Generator().manual_seed(4)
    moved = 0
    for _ in range(5):
        xc, mc = crop_with_mask(x, mask, (4, 4), (4, 4), 0.3, g)
        assert xc.shape == x.shape and torch.equal(mc.sum(1), mask.sum(1))   # one count per image, as before
        cover = F.avg_pool2d(xc, 4).view(6, 16)
        for i in range(6):
            # every kept patch is covered at least as much as every dropped one
            assert cover[i][mc[i]].min() >= cover[i][~mc[i]].max() - 1e-6
        moved += int((~torch.isclose(xc, x, atol=1e-4)).any())
        assert float(xc.min()) >= -1e-6 and float(xc.max()) <= 1 + 1e-6   # resampled, never extrapolated
    assert moved == 5
    # the same generator state gives the same crops
    a = crop_with_mask(x, mask, (4, 4), (4, 4), 0.3, torch.Generator().manual_seed(9))
    b = crop_with_mask(x, mask, (4, 4), (4, 4), 0.3, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # scale 1 leaves a square of the whole image: the identity
    same = crop_with_mask(x, mask, (4, 4), (4, 4), 1.0, g)
    torch.testing.assert_close(same[0], x, atol=1e-5, rtol=0)
    assert torch.equal(same[1], mask)


def test_crop_scale_changes_distillation_deterministically_and_is_validated():
    import pytest

    from fedml_fedmitr.core.config import ConfigError
    ens = tiny_ensemble(2)
    imgs, labels, masks = torch.randn(16, 1, 16, 16), torch.arange(16) % 10, random_mask(16, 16, 4)
    cfg = FedMITRConfig(distill_epochs=2, distill_batch_size=8)
    plain = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg, "cpu", seed=1).state_dict()
    crop_cfg = cfg.replace(distill_crop_scale=0.5)
    saved = {}
    cropped = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, crop_cfg, "cpu", seed=1,
                              checkpoint=lambda s: saved.setdefault(s["epoch"], copy.deepcopy(s))).state_dict()
    again = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, crop_cfg, "cpu", seed=1).state_dict()
    resumed = distill_student(tiny_vit(seed=123), ens, imgs, labels, masks, crop_cfg, "cpu", seed=1,
                              resume_state=saved[1]).state_dict()
    assert not torch.equal(plain["head.weight"], cropped["head.weight"])
    for k, v in cropped.items():
        assert torch.equal(v, again[k]) and torch.equal(v, resumed[k]), k
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ConfigError, match="distill_crop_scale"):
            FedMITRConfig(distill_crop_scale=bad).validate()


def test_distillation_resumes_bit_identically(tmp_path):
    ens = tiny_ensemble(2)
    imgs, labels, masks = torch.randn(20, 1, 16, 16), torch.arange(20) % 10, random_mask(20, 16, 4)
    cfg = FedMITRConfig(distill_epochs=4, distill_batch_size=8)
    full = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg, "cpu", seed=1)
    saved = {}
    # the checkpoint callback gets live references: copy them at once (FedMITR serialises them)
    distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg, "cpu", seed=1,
                    checkpoint=lambda s: saved.setdefault(s["epoch"], copy.deepcopy(s)))
    state = saved[2]
    resumed = distill_student(tiny_vit(seed=123), ens, imgs, labels, masks, cfg, "cpu", seed=1,
                              resume_state=state)
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k


def test_foreground_target_ensemble_relabels_the_kept_tokens_too():
    ens, student = tiny_ensemble(2), tiny_vit(seed=9)
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([1, 2, 3, 4])
    mask = random_mask(4, 16, 4)
    cfg = FedMITRConfig(relabel_weight=0.5, kd_temperature=3.0, foreground_target="ensemble")
    loss, _ = token_relabel_loss(student, ens, x, y, mask, cfg)

    def kl(on):
        q = F.softmax(torch.stack([manual_subset_logits(m, x, on) for m in ens.models]).mean(0) / 3, 1)
        return F.kl_div(F.log_softmax(manual_subset_logits(student, x, on) / 3, 1), q, reduction="batchmean") * 9
    torch.testing.assert_close(loss, kl(mask) + 0.5 * kl(~mask), rtol=1e-4, atol=1e-5)
    label_loss, _ = token_relabel_loss(student, ens, x, y, mask, cfg.replace(foreground_target="label"))
    assert not torch.allclose(loss, label_loss)


def _one_model_ensemble(model):
    return Ensemble([copy.deepcopy(model)], client_weights("mean", [1], [[1] * 10], 10), batched="loop")


def test_drift_guard_returns_the_start_when_training_only_drifts():
    # the ensemble is the student's own start, so nothing can agree with it better than the start:
    # a destructive learning rate must leave the returned student bit-identical to its start
    start = tiny_vit(seed=7)
    ens = _one_model_ensemble(start)
    imgs, labels, masks = torch.randn(40, 1, 16, 16), torch.arange(40) % 10, random_mask(40, 16, 4)
    cfg = FedMITRConfig(distill_epochs=3, distill_batch_size=8, distill_lr=0.5, drift_guard="pool_agreement")
    guarded = distill_student(copy.deepcopy(start), ens, imgs, labels, masks, cfg, "cpu", seed=1)
    for (k, a), b in zip(start.state_dict().items(), guarded.state_dict().values()):
        assert torch.equal(a, b), k
    unguarded = distill_student(copy.deepcopy(start), ens, imgs, labels, masks, cfg.replace(drift_guard="none"),
                                "cpu", seed=1)
    assert not torch.equal(unguarded.head.weight, start.head.weight)


def test_drift_guard_holds_out_every_kth_image_and_picks_the_best_epoch():
    ens = tiny_ensemble(2)
    imgs = torch.randn(40, 1, 16, 16)
    guard = DriftGuard(ens, imgs, 0.1, "cpu")
    assert guard.train_positions.tolist() == [i for i in range(40) if i % 10 != 9]
    assert len(guard.held_out) == 4
    a, b = tiny_vit(seed=1), tiny_vit(seed=2)
    sa, sb = guard.observe(a, 0), guard.observe(b, 1)
    assert guard.best == max(sa, sb) and guard.best_epoch == (1 if sb > sa else 0)


def test_guarded_distillation_resumes_bit_identically():
    ens = tiny_ensemble(2)
    imgs, labels, masks = torch.randn(30, 1, 16, 16), torch.arange(30) % 10, random_mask(30, 16, 4)
    cfg = FedMITRConfig(distill_epochs=4, distill_batch_size=8, drift_guard="pool_agreement", guard_fraction=0.2)
    full = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg, "cpu", seed=1)
    saved = {}
    distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg, "cpu", seed=1,
                    checkpoint=lambda s: saved.setdefault(s["epoch"], copy.deepcopy(s)))
    resumed = distill_student(tiny_vit(seed=123), ens, imgs, labels, masks, cfg, "cpu", seed=1,
                              resume_state=saved[2])
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k


def test_proximal_term_keeps_the_student_near_its_start_and_resumes_bit_identically():
    ens = tiny_ensemble(2)
    imgs, labels, masks = torch.randn(40, 1, 16, 16), torch.arange(40) % 10, random_mask(40, 16, 4)
    cfg = FedMITRConfig(distill_epochs=3, distill_batch_size=8, distill_lr=0.05)

    def distance(model):
        start = tiny_vit(seed=7)
        return sum(((a - b) ** 2).sum().item() for a, b in zip(model.parameters(), start.parameters()))

    free = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg, "cpu", seed=1)
    held = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg.replace(prox_weight=10.0), "cpu", seed=1)
    assert distance(held) < 0.5 * distance(free)
    saved = {}
    prox = cfg.replace(prox_weight=1.0)
    full = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, prox, "cpu", seed=1,
                           checkpoint=lambda s: saved.setdefault(s["epoch"], copy.deepcopy(s)))
    resumed = distill_student(tiny_vit(seed=123), ens, imgs, labels, masks, prox, "cpu", seed=1,
                              resume_state=saved[1])
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k


def test_mixup_mixes_within_the_batch_deterministically_and_needs_ensemble_targets():
    import pytest

    from fedml_fedmitr.core.config import ConfigError
    from fedml_fedmitr.core.distill import mix_batch
    x = torch.stack([torch.full((1, 4, 4), float(i)) for i in range(6)])
    a = mix_batch(x, 1.0, torch.Generator().manual_seed(3))
    b = mix_batch(x, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and not torch.equal(a, x)
    assert torch.allclose(a.mean(), x.mean())   # a convex mix of a permutation keeps the batch mean
    with pytest.raises(ConfigError, match="distill_mixup"):
        FedMITRConfig(distill_mixup=1.0, foreground_target="label").validate()
    ens = tiny_ensemble(2)
    imgs, labels, masks = torch.randn(24, 1, 16, 16), torch.arange(24) % 10, random_mask(24, 16, 4)
    cfg = FedMITRConfig(distill_epochs=1, distill_batch_size=8, distill_mixup=1.0)
    one = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg, "cpu", seed=1)
    two = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg, "cpu", seed=1)
    plain = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg.replace(distill_mixup=0.0), "cpu", seed=1)
    assert torch.equal(one.head.weight, two.head.weight) and not torch.equal(one.head.weight, plain.head.weight)


def test_mixup_is_on_by_default_only_where_the_ensemble_gives_every_target():
    import pytest

    from fedml_fedmitr.core.config import ConfigError
    from fedml_fedmitr.core.methods import get_method
    assert FedMITRConfig().mixup_alpha() == 1.0                        # token relabel, ensemble foreground
    assert FedMITRConfig(distill_mode="kd_full").mixup_alpha() == 1.0
    assert FedMITRConfig(foreground_target="label").mixup_alpha() == 0.0  # a mixed image has no one label
    assert FedMITRConfig(distill_mixup=0.0).mixup_alpha() == 0.0
    assert FedMITRConfig(distill_mixup=0.4).mixup_alpha() == 0.4
    assert get_method("FedMITR-ce")(FedMITRConfig()).config.mixup_alpha() == 0.0
    assert get_method("DeepInversion")(FedMITRConfig()).config.mixup_alpha() == 1.0
    with pytest.raises(ConfigError, match="distill_mixup"):
        FedMITRConfig.from_dict({"distill_mixup": -0.5})
    # the default run mixes: the same as alpha 1 set by hand, not the same as mixup off
    ens = tiny_ensemble(2)
    imgs, labels, masks = torch.randn(24, 1, 16, 16), torch.arange(24) % 10, random_mask(24, 16, 4)
    cfg = FedMITRConfig(distill_epochs=1, distill_batch_size=8)
    auto = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg, "cpu", seed=1)
    one = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg.replace(distill_mixup=1.0), "cpu", seed=1)
    off = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg.replace(distill_mixup=0.0), "cpu", seed=1)
    assert torch.equal(auto.head.weight, one.head.weight) and not torch.equal(auto.head.weight, off.head.weight)


def test_teacher_debias_balances_a_teacher_that_favours_one_class():
    from fedml_fedmitr.core.distill import TeacherBias
    models = [tiny_vit(seed=i) for i in range(2)]
    offsets = torch.zeros(2, 10)
    offsets[:, 3] = -4.0                       # the combined logits get +4 on class 3: a skewed teacher
    ens = Ensemble(models, client_weights("mean", [1, 1], [[1] * 10] * 2, 10), offsets=offsets)
    x = torch.randn(60, 1, 16, 16)
    mask = random_mask(60, 16, 4, seed=1)
    bias = TeacherBias(ens, x, mask, "cpu")
    assert set(bias.log_prior) == {"full", "foreground", "background"}
    with torch.no_grad():
        plain = ens(x).softmax(1).mean(0)
        fixed = bias.teacher(x, None, "full").softmax(1).mean(0)
        idx_l = torch.nonzero(~mask)[:, 1].view(60, -1)
        plain_bg = ens(x, idx_l).softmax(1).mean(0)
        fixed_bg = bias.teacher(x, idx_l, "background").softmax(1).mean(0)
    assert plain[3] > 0.5                       # skewed before
    for before, after in ((plain, fixed), (plain_bg, fixed_bg)):
        assert after.max() < 0.5 * before.max()
        assert (after - 0.1).abs().max() < (before - 0.1).abs().max()
    # the exact correction: logits minus the log of the mean softmax of that view
    torch.testing.assert_close(bias.log_prior["full"], plain.log(), rtol=1e-5, atol=1e-6)


def test_teacher_debias_changes_distillation_deterministically():
    ens, x = tiny_ensemble(2), torch.randn(40, 1, 16, 16)
    y, mask = torch.arange(40) % 10, random_mask(40, 16, 4, seed=2)
    cfg = FedMITRConfig(num_synthetic=40, distill_epochs=2, distill_batch_size=20, progress=False)
    runs = {}
    for debias in ("none", "pool", "pool"):
        student = distill_student(tiny_vit(seed=7), ens, x, y, mask, cfg.replace(teacher_debias=debias), "cpu", seed=0)
        runs.setdefault(debias, []).append(torch.cat([p.flatten() for p in student.parameters()]))
    assert torch.equal(runs["pool"][0], runs["pool"][1])
    assert not torch.allclose(runs["pool"][0], runs["none"][0])


def test_warmup_raises_the_rate_then_decays_and_resumes_bit_identically():
    import pytest

    from fedml_fedmitr.core.config import ConfigError
    from fedml_fedmitr.core.distill import distill_schedule
    param = [torch.nn.Parameter(torch.zeros(1))]
    rates = {}
    for warm in (0, 2):
        opt = torch.optim.AdamW(param, lr=1e-3)
        sched = distill_schedule(opt, FedMITRConfig(distill_epochs=5, distill_warmup_epochs=warm), 3)
        rates[warm] = []
        for _ in range(15):
            rates[warm].append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    assert rates[0][0] == pytest.approx(1e-3) and all(a > b for a, b in zip(rates[0], rates[0][1:]))
    up, down = rates[2][:7], rates[2][6:]   # 2 warmup epochs of 3 steps: 6 rising steps, peak at step 6
    assert up[0] == pytest.approx(1e-3 / 6) and all(a < b for a, b in zip(up, up[1:]))
    assert down[0] == pytest.approx(1e-3) and all(a > b for a, b in zip(down, down[1:]))
    with pytest.raises(ConfigError, match="distill_warmup_epochs"):
        FedMITRConfig(distill_epochs=3, distill_warmup_epochs=3).validate()

    # a good start moves less in the first epoch with the warmup; a resumed run is bit-identical
    ens = tiny_ensemble(2)
    imgs, labels, masks = torch.randn(40, 1, 16, 16), torch.arange(40) % 10, random_mask(40, 16, 4)
    cfg = FedMITRConfig(distill_epochs=4, distill_batch_size=8, distill_lr=0.01)

    def moved_after_one_epoch(c):
        saved = {}
        out = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, c, "cpu", seed=1,
                              checkpoint=lambda s: saved.setdefault(s["epoch"], copy.deepcopy(s)))
        start = tiny_vit(seed=7).state_dict()
        return out, saved, sum(((saved[1]["student"][k] - start[k]) ** 2).sum().item() for k in start)

    _, _, free = moved_after_one_epoch(cfg)
    warm_cfg = cfg.replace(distill_warmup_epochs=2)
    full, saved, warmed = moved_after_one_epoch(warm_cfg)
    assert warmed < 0.5 * free
    resumed = distill_student(tiny_vit(seed=123), ens, imgs, labels, masks, warm_cfg, "cpu", seed=1,
                              resume_state=saved[1])
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k


def test_weight_average_is_the_ema_of_the_steps_and_resumes_bit_identically():
    import pytest

    from fedml_fedmitr.core.config import ConfigError
    ens = tiny_ensemble(2)
    imgs, labels, masks = torch.randn(16, 1, 16, 16), torch.arange(16) % 10, random_mask(16, 16, 4)
    # one step per epoch (batch >= pool), so the per-epoch checkpoints hold every step's weights
    cfg = FedMITRConfig(distill_epochs=5, distill_batch_size=16, distill_lr=0.01)
    steps = {}
    plain = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, cfg, "cpu", seed=1,
                            checkpoint=lambda s: steps.setdefault(s["epoch"], copy.deepcopy(s["student"])))
    ema_cfg = cfg.replace(distill_ema_epochs=2.0)        # horizon 2 steps: decay 1 - 1/2
    saved = {}
    averaged = distill_student(tiny_vit(seed=7), ens, imgs, labels, masks, ema_cfg, "cpu", seed=1,
                               checkpoint=lambda s: saved.setdefault(s["epoch"], copy.deepcopy(s)))
    # the training path is untouched: the student itself takes the same steps
    for k, v in steps[5].items():
        assert torch.equal(saved[5]["student"][k], v), k
    expected = tiny_vit(seed=7).state_dict()
    for e in range(1, 6):
        expected = {k: 0.5 * expected[k] + 0.5 * steps[e][k] for k in expected}
    out = averaged.state_dict()
    for k, v in expected.items():
        assert torch.allclose(out[k], v, atol=1e-6), k
    assert not torch.allclose(out["head.weight"], plain.state_dict()["head.weight"])

    resumed = distill_student(tiny_vit(seed=123), ens, imgs, labels, masks, ema_cfg, "cpu", seed=1,
                              resume_state=saved[2])
    for (k, a), b in zip(averaged.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(ConfigError, match="distill_ema_epochs"):
        FedMITRConfig(distill_ema_epochs=-1).validate()


class _FixedTeacher:
    """An 'ensemble' that returns given logits for a pool of the same size (what pool_kd_temperature reads)."""

    def __init__(self, logits):
        self.logits = logits

    def __call__(self, x, keep_idx=None):
        return self.logits[:x.shape[0]]


def test_kd_target_confidence_sharpens_only_a_flat_teacher():
    from fedml_fedmitr.core.distill import KD_MIN_TEMPERATURE, pool_kd_temperature
    images = torch.zeros(6, 1, 4, 4)

    def confidence(logits, t):
        return float((logits / t).softmax(1).max(1).values.mean())

    # five disjoint holders of two classes each: every client's top class gets log 0.9, its other
    # class log 0.1, so no class gets more than 0.9 / 5 of the teacher's mass at T = 1
    flat = torch.log(torch.tensor([[0.9, 0.1] * 5] * 6))
    flat[:, 0] += 0.2                       # the holder of class 0 is a little surer: the teacher's argmax
    assert confidence(flat, 1.0) < 0.25
    off = FedMITRConfig(kd_target_confidence=0.0)
    assert pool_kd_temperature(_FixedTeacher(flat), images, off, "cpu") == off.kd_temperature   # 0: off
    cfg = FedMITRConfig(kd_target_confidence=0.5)
    t = pool_kd_temperature(_FixedTeacher(flat), images, cfg, "cpu")
    assert KD_MIN_TEMPERATURE < t < 1.0
    assert confidence(flat, t) >= 0.5 > confidence(flat, t * 1.01)   # the highest T that reaches the target
    # a confident teacher keeps kd_temperature; one whose margins cannot reach the target gets the floor
    sure = torch.zeros(6, 10)
    sure[:, 3] = 8.0
    assert pool_kd_temperature(_FixedTeacher(sure), images, cfg, "cpu") == 1.0
    assert pool_kd_temperature(_FixedTeacher(torch.zeros(6, 10)), images, cfg, "cpu") == KD_MIN_TEMPERATURE
    for key in ("kd_target_confidence", "baseline_kd_target_confidence"):
        for bad in (1.0, -0.1):
            try:
                FedMITRConfig(**{key: bad})
            except ValueError as e:
                assert key in str(e) and "[0, 1)" in str(e)
            else:
                raise AssertionError(f"{key} = {bad} was accepted")
