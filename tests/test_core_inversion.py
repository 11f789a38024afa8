import math

import pytest
import torch

from fedml_fedmitr.core.config import ConfigError, FedMITRConfig
from fedml_fedmitr.core.inversion import SparseModelInversion, js_divergence, patch_mask_to_pixels, remap_patches, tv_l2

from helpers_core import tiny_ensemble, tiny_vit


class RecordingInversion(SparseModelInversion):
    """Records the image and keep set at every prune point."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.events = []

    def _prune(self, x, keep, count, labels=None):
        new_keep = super()._prune(x, keep, count, labels)
        self.events.append((x.clone(), keep.clone(), new_keep.clone()))
        return new_keep


def make(cfg, k=2):
    ens = tiny_ensemble(k)
    return RecordingInversion(ens, cfg, (1, 16, 16), [0.3], [0.35], "cpu")


def test_prune_schedule_keeps_the_configured_token_counts():
    cfg = FedMITRConfig(inversion_iters=40, prune_at=[4, 8, 16, 24], prune_ratio=0.3, jitter=1)
    assert cfg.keep_counts(16) == [11, 8, 5, 4]  # round(16 * 0.7 ** j)
    inv = make(cfg)
    batch = inv.synthesize(torch.arange(6) % 10, batch_index=0, seed=1)
    assert [e[2].shape[1] for e in inv.events] == [11, 8, 5, 4]
    assert batch.masks.shape == (6, 16)
    assert batch.masks.sum(1).tolist() == [4] * 6
    # every new keep set is a subset of the previous one
    for _, old, new in inv.events:
        for o, n in zip(old.tolist(), new.tolist()):
            assert set(n) <= set(o)


def test_halted_pixels_stay_bit_identical_to_the_end():
    cfg = FedMITRConfig(inversion_iters=30, prune_at=[3, 9, 15], prune_ratio=0.4, jitter=2)
    inv = make(cfg)
    batch = inv.synthesize(torch.arange(4), batch_index=0, seed=0)
    final = batch.images
    for x_at_prune, old, new in inv.events:
        dropped = torch.zeros(4, 16, dtype=torch.bool)
        dropped.scatter_(1, old, True)
        dropped.scatter_(1, new, False)
        px = patch_mask_to_pixels(dropped, (4, 4), (4, 4), (16, 16)).expand_as(final)
        assert px.any()
        assert torch.equal(final[px], x_at_prune[px])  # bit-identical, not close
    # kept pixels did move after the last prune
    kept_px = patch_mask_to_pixels(batch.masks, (4, 4), (4, 4), (16, 16)).expand_as(final)
    assert not torch.equal(final[kept_px], inv.events[-1][0][kept_px])


def test_inversion_fits_the_ensemble_and_stays_in_the_valid_range():
    cfg = FedMITRConfig(inversion_iters=100, prune_fractions=[0.1, 0.2, 0.35, 0.5], inversion_lr=0.1)
    inv = make(cfg)
    for m in inv.ensemble.models:  # random tiny ViTs barely react to their input: sharpen their heads
        m.head.weight.data *= 30
    labels = torch.arange(8) % 10
    batch = inv.synthesize(labels, seed=0)
    assert (batch.images >= inv.lo - 1e-6).all() and (batch.images <= inv.hi + 1e-6).all()
    start = inv.ensemble(torch.randn(8, 1, 16, 16).clamp(inv.lo.item(), inv.hi.item()))
    ce_start = torch.nn.functional.cross_entropy(start, labels)
    keep = batch.masks.nonzero()[:, 1].view(8, -1)
    ce_end = torch.nn.functional.cross_entropy(inv.ensemble(batch.images, keep), labels)
    assert ce_end < 0.8 * ce_start


def test_same_seed_same_images_and_dense_mode_gives_an_attention_mask():
    cfg = FedMITRConfig(inversion_iters=12, prune_at=[2, 4], jitter=1)
    a = make(cfg).synthesize(torch.arange(3), batch_index=2, seed=5)
    b = make(cfg).synthesize(torch.arange(3), batch_index=2, seed=5)
    assert torch.equal(a.images, b.images) and torch.equal(a.masks, b.masks)
    dense = cfg.replace(inversion="dense")
    d = make(dense).synthesize(torch.arange(3), seed=5)
    expected = round(16 * cfg.keep_fraction(16))
    assert d.masks.sum(1).tolist() == [expected] * 3  # background set not empty


def test_remap_patches_follows_roll_and_flip():
    img = torch.arange(16.0).view(1, 1, 4, 4).repeat_interleave(2, 2).repeat_interleave(2, 3)  # patch 2
    ids = torch.arange(16)
    rolled = torch.roll(img, shifts=(2, -2), dims=(2, 3)).flip(3)
    new = remap_patches(ids, (4, 4), (1, -1), True)
    for old_id, new_id in zip(ids.tolist(), new.tolist()):
        r, c = divmod(new_id, 4)
        assert rolled[0, 0, 2 * r, 2 * c] == old_id


def test_tv_is_zero_on_constant_images():
    assert tv_l2(torch.ones(2, 3, 8, 8)) == 0
    assert tv_l2(torch.randn(2, 3, 8, 8)) > 0


def record_views(inv):
    """Spies on the inverter's ensemble; returns the list that collects every view it is shown (the
    attention passes of the prune points, which ask for attention, are not views)."""
    views, ens = [], inv.ensemble
    inner = ens.client_logits

    def spy(x, keep=None, return_attn=False, **kw):
        if not return_attn:
            views.append(x.detach().clone())
        return inner(x, keep, return_attn, **kw)

    ens.client_logits = spy
    return views


def test_color_shift_changes_each_view_per_image_and_channel_but_not_the_stored_image():
    cfg = FedMITRConfig(inversion_iters=6, prune_at=[2], jitter=0, flip=False, color_shift=1.0)
    inv = make(cfg)
    views = record_views(inv)
    batch = inv.synthesize(torch.arange(4), seed=3)
    assert len(views) == 6
    # without the shift (and with no jitter or flip) the first view is the starting image itself
    plain_inv = make(cfg.replace(color_shift=0.0))
    plain_views = record_views(plain_inv)
    plain = plain_inv.synthesize(torch.arange(4), seed=3)
    start, view = plain_views[0], views[0]
    # the first view is an affine change of the starting image's pixels, different per image
    scale = []
    for i in range(4):
        x, v = start[i].flatten(), view[i].flatten()
        a = ((v - v.mean()) * (x - x.mean())).sum() / ((x - x.mean()) ** 2).sum()
        assert torch.allclose(v, a * x + (v.mean() - a * x.mean()), atol=1e-4)
        assert 1 / torch.e - 1e-4 <= a <= torch.e + 1e-4
        scale.append(float(a))
    assert len({round(s, 4) for s in scale}) == 4
    assert not torch.allclose(view, start, atol=1e-3)
    # same seed, same images; without the shift a different image
    assert torch.equal(make(cfg).synthesize(torch.arange(4), seed=3).images, batch.images)
    assert not torch.equal(plain.images, batch.images)


def test_competition_term_makes_images_the_start_disagrees_on():
    # the JS divergence: 0 for equal predictions, ln 2 for opposite certain ones, symmetric
    a, b = torch.tensor([[8.0, -8.0, 0.0]]), torch.tensor([[-8.0, 8.0, 0.0]])
    assert js_divergence(a, a).item() < 1e-6
    assert abs(js_divergence(a, b).item() - math.log(2.0)) < 1e-3
    assert abs(js_divergence(a, b).item() - js_divergence(b, a).item()) < 1e-6
    # the competition term alone (the feature prior off), so its effect is what is measured
    cfg = FedMITRConfig(inversion_iters=40, prune_at=[10], jitter=0, flip=False, competition_weight=5.0,
                        feature_weight=0.0)
    with pytest.raises(ValueError, match="competition_weight > 0 needs the student's starting model"):
        make(cfg)
    start = tiny_vit(seed=7)
    before = {k: v.clone() for k, v in start.state_dict().items()}

    def disagreement(c):
        inv = SparseModelInversion(tiny_ensemble(2), c, (1, 16, 16), [0.3], [0.35], "cpu", start=start)
        batch = inv.synthesize(torch.arange(8), seed=2)
        with torch.no_grad():
            return js_divergence(inv.ensemble(batch.images), start(batch.images)).item(), batch

    with_term, batch = disagreement(cfg)
    without, plain = disagreement(cfg.replace(competition_weight=0.0))
    assert with_term > 1.5 * without   # the tiny random models predict almost uniformly: small values
    assert not torch.equal(batch.images, plain.images)
    # the start is only read, never trained
    assert all(torch.equal(v, before[k]) for k, v in start.state_dict().items())


def test_boundary_fraction_inverts_a_share_of_the_batch_towards_two_classes():
    cfg = FedMITRConfig(inversion_iters=30, prune_at=[10], jitter=0, flip=False, boundary_fraction=0.5)
    inv = make(cfg)
    labels = torch.arange(8) % 10
    targets = inv.soft_targets(labels, torch.Generator().manual_seed(0))
    assert targets.shape == (8, 10)
    assert torch.allclose(targets.sum(1), torch.ones(8))
    soft = (targets > 0).sum(1) == 2
    assert int(soft.sum()) == 4                                   # round(0.5 * 8) images
    for i in range(8):
        assert int(targets[i].argmax()) == int(labels[i])         # the label keeps the larger share
        if soft[i]:
            second = targets[i].clone()
            second[labels[i]] = 0
            assert (targets[i] > 0).sum() == 2 and 0.5 <= float(targets[i, labels[i]]) <= 1.0
            assert float(second.max()) > 0
    # the soft images' ensemble predictions put more mass on their second class than the plain images'
    drawn, soft_targets = [], inv.soft_targets
    inv.soft_targets = lambda *a: drawn.append(soft_targets(*a)) or drawn[-1]   # the targets synthesize() used
    batch = inv.synthesize(labels, seed=4)
    plain = make(cfg.replace(boundary_fraction=0.0)).synthesize(labels, seed=4)
    assert torch.equal(batch.labels, labels) and not torch.equal(batch.images, plain.images)
    assert torch.equal(make(cfg).synthesize(labels, seed=4).images, batch.images)
    used = drawn[0]
    second = used.clone()
    second[torch.arange(8), labels] = 0
    rows = (used > 0).sum(1) == 2
    with torch.no_grad():
        p_soft = inv.ensemble(batch.images).softmax(1)
        p_plain = inv.ensemble(plain.images).softmax(1)
    on_second = (second > 0).float()
    assert float((p_soft * on_second).sum(1)[rows].mean()) > float((p_plain * on_second).sum(1)[rows].mean())
    with pytest.raises(ConfigError,
                       match="fedmitr_args.boundary_fraction = 1.5 is invalid: expected a fraction in \\[0, 1\\]"):
        FedMITRConfig.from_dict({"boundary_fraction": 1.5})
    with pytest.raises(ConfigError, match="boundary_fraction"):
        FedMITRConfig(boundary_fraction=1.5)


def test_inversion_init_std_sets_the_starting_noise():
    """The images start as noise of inversion_init_std (0: the mean pixel), so after two Adam steps of a
    small learning rate an image is within those steps of its start."""
    labels = torch.arange(4)
    base = dict(inversion_iters=2, inversion_lr=0.01)
    flat = make(FedMITRConfig(**base, inversion_init_std=0.0)).synthesize(labels, seed=0).images
    noisy = make(FedMITRConfig(**base)).synthesize(labels, seed=0).images
    assert flat.abs().max() <= 0.03      # two Adam steps of about lr each
    assert noisy.abs().max() > 0.3 and noisy.std() > 10 * flat.std()
    with pytest.raises(ConfigError, match="inversion_init_std"):
        FedMITRConfig(inversion_init_std=-1.0)


def _owned_ensemble():
    """Two tiny clients: client 0 holds only class 0, client 1 only class 1 (label counts known)."""
    from fedml_fedmitr.core.ensemble import Ensemble, client_weights
    counts = [[50, 0] + [5] * 8, [0, 40] + [5] * 8]
    models = [tiny_vit(seed=i) for i in range(2)]
    return Ensemble(models, client_weights("mean", [1, 1], counts, 10), batched="loop",
                    label_counts=torch.tensor(counts, dtype=torch.float32))


def test_class_share_attention_ranks_patches_by_the_clients_that_hold_the_class():
    cfg = FedMITRConfig(inversion_iters=12, prune_at=[3, 6], prune_ratio=0.4, jitter=1, feature_weight=0.0,
                        attention_weighting="class_share")
    inv = RecordingInversion(_owned_ensemble(), cfg, (1, 16, 16), [0.3], [0.35], "cpu")
    labels = torch.tensor([0, 1, 0, 1])
    inv.synthesize(labels, seed=3)
    assert len(inv.events) == 2
    for x, old, new in inv.events:
        _, attn = inv.ensemble.client_logits(x, old, return_attn=True)   # (2, B, k)
        owner = attn[labels, torch.arange(4)]        # image b ranked by the client that holds its class
        expected = old.gather(1, owner.topk(new.shape[1], dim=1).indices).sort(1).values
        assert torch.equal(new, expected)
        mean_rank = old.gather(1, attn.mean(0).topk(new.shape[1], dim=1).indices).sort(1).values
        assert not torch.equal(new, mean_rank)        # the weighting changed which patches stay
    # the shares: a class's column sums to 1; classes 2-9 are held equally
    from fedml_fedmitr.core.inversion import class_shares
    shares = class_shares(inv.ensemble)
    assert torch.allclose(shares[:, :2], torch.eye(2)) and torch.allclose(shares[:, 2:], torch.full((2, 8), 0.5))


def test_class_share_attention_needs_the_label_counts():
    cfg = FedMITRConfig(inversion_iters=8, prune_at=[2], attention_weighting="class_share", feature_weight=0.0)
    ens = tiny_ensemble(2)
    ens.label_counts = None
    with pytest.raises(ValueError, match="attention_weighting"):
        SparseModelInversion(ens, cfg, (1, 16, 16), [0.3], [0.35], "cpu")


def test_final_mask_recompute_takes_the_top_attention_patches_of_the_final_image():
    base = FedMITRConfig(inversion_iters=12, prune_at=[3, 6], prune_ratio=0.4, jitter=1)
    labels = torch.arange(6) % 10
    last = make(base)
    kept = last.synthesize(labels, seed=2)
    assert torch.equal(kept.masks, torch.zeros(6, 16, dtype=torch.bool).scatter_(1, last.events[-1][2], True))
    redo = make(base.replace(final_mask="recompute"))
    batch = redo.synthesize(labels, seed=2)
    assert torch.equal(batch.images, kept.images)     # the images are the same; only the mask is recomputed
    count = base.keep_counts(16)[-1]
    assert batch.masks.sum(1).tolist() == [count] * 6
    _, attn = redo.ensemble(batch.images, None, return_attn=True)
    expected = torch.zeros(6, 16, dtype=torch.bool).scatter_(1, attn.topk(count, dim=1).indices, True)
    assert torch.equal(batch.masks, expected)
    assert not torch.equal(batch.masks, kept.masks)   # halted patches can come back into the foreground


def test_mask_options_are_validated_and_declared_unused_where_there_is_no_mask():
    from fedml_fedmitr.core.methods import get_method
    with pytest.raises(ConfigError, match="attention_weighting"):
        FedMITRConfig.from_dict({"attention_weighting": "per_class"})
    with pytest.raises(ConfigError, match="final_mask"):
        FedMITRConfig.from_dict({"final_mask": "final"})
    keys = ["attention_weighting", "final_mask"]
    assert get_method("FedMITR").unused_keys(keys) == []
    assert get_method("DeepInversion").unused_keys(keys) == keys
    assert get_method("FedMITR-kd").unused_keys(keys) == ["final_mask"]
    assert get_method("FedMITR-dense").unused_keys(keys) == ["final_mask"]
