"""The feature prior: clients measure the token moments entering each block of their ViT on their own
data and upload them; inversion with ``feature_weight > 0`` matches them (DeepInversion's BatchNorm
prior carried over to a ViT)."""
import pytest
import torch

from fedml_fedmitr.core.client import train_client
from fedml_fedmitr.core.config import ClientTrainConfig, ConfigError, FedMITRConfig
from fedml_fedmitr.core.ensemble import Ensemble, client_weights
from fedml_fedmitr.core.inversion import SparseModelInversion, class_feature_stats_loss, feature_stats_loss
from fedml_fedmitr.core.methods import ClientUpload
from fedml_fedmitr.core.models import (
    class_token_moments,
    forward_tokens,
    group_moments,
    patch_token_sums,
    pooled_moments,
    run_blocks,
    token_moments,
)
from fedml_fedmitr.core.screening import screen_clients

from helpers_core import digits, loader, tiny_vit


@pytest.fixture(scope="module")
def data():
    (x, y), _ = digits()
    return x[:300], y[:300]


def block_inputs(model, x):
    """The patch tokens entering each block, captured by hooks on a plain forward."""
    seen = []
    hooks = [b.register_forward_pre_hook(lambda _m, inp: seen.append(inp[0][:, model.num_prefix_tokens:]))
             for b in model.blocks]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def test_token_moments_are_the_block_inputs_mean_and_variance_over_the_whole_shard(data):
    x, y = data
    model = tiny_vit(seed=1)
    stats = token_moments(model, loader(x, y, batch=64), "cpu")   # 5 batches, the last one short
    assert stats.shape == (2, 2, model.embed_dim)                 # (blocks, mean / variance, embed_dim)
    for block, tokens in enumerate(block_inputs(model, x)):
        flat = tokens.reshape(-1, tokens.shape[-1])
        torch.testing.assert_close(stats[block, 0], flat.mean(0), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stats[block, 1], flat.var(0, unbiased=False), rtol=1e-4, atol=1e-5)


def test_forward_with_moments_keeps_the_logits_and_reads_only_the_kept_tokens(data):
    x = data[0][:8]
    model = tiny_vit(seed=2)
    keep = torch.tensor([[0, 5, 6, 15]]).repeat(8, 1)
    logits, moments = forward_tokens(model, x, keep, return_moments=True)
    torch.testing.assert_close(logits, forward_tokens(model, x, keep))
    logits_a, attn, moments_a = forward_tokens(model, x, keep, return_attn=True, return_moments=True)
    torch.testing.assert_close(logits_a, logits)
    torch.testing.assert_close(moments_a, moments)
    assert attn.shape == (8, 4)
    first = model.norm_pre(model._pos_embed(model.patch_embed(x)))[:, model.num_prefix_tokens:]
    kept = torch.gather(first, 1, keep.unsqueeze(-1).expand(-1, -1, first.shape[-1])).reshape(-1, first.shape[-1])
    torch.testing.assert_close(moments[0, 0], kept.mean(0))
    torch.testing.assert_close(moments[0, 1], kept.var(0, unbiased=False))


def test_batched_and_looped_ensembles_give_the_same_moments(data):
    x = data[0][:6]
    models = [tiny_vit(seed=i) for i in range(3)]
    w = client_weights("mean", [1] * 3, [[1] * 10] * 3, 10)
    loop = Ensemble(models, w, batched="loop").client_logits(x, None, return_moments=True)
    vmapped = Ensemble(models, w, batched="vmap").client_logits(x, None, return_moments=True)
    torch.testing.assert_close(vmapped[0], loop[0], rtol=1e-4, atol=1e-5)
    assert len(loop[1]) == len(vmapped[1]) == 3
    for a, b in zip(loop[1], vmapped[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_client_uploads_its_moments_and_they_survive_the_payload(data):
    x, y = data
    model = tiny_vit(seed=3)
    up = train_client(4, model, loader(x, y, batch=64, shuffle=True), ClientTrainConfig(epochs=1), "cpu", 10)
    torch.testing.assert_close(up.feature_stats, token_moments(model, loader(x, y), "cpu"))
    back = ClientUpload.from_payload(up.to_payload())
    assert torch.equal(back.feature_stats, up.feature_stats)
    bad = dict(up.to_payload(), feature_stats=[1.0, 2.0])
    with pytest.raises(ValueError, match="feature_stats must be a float tensor"):
        ClientUpload.from_payload(bad)


def uploads_of(models, x, y, stats=True):
    return [ClientUpload(client_id=k, state_dict=m.state_dict(), num_samples=len(y), label_counts=[30] * 10,
                         feature_stats=token_moments(m, loader(x, y), "cpu") if stats else None)
            for k, m in enumerate(models)]


def test_inversion_with_the_prior_matches_the_clients_moments(data):
    x, y = data
    models = [tiny_vit(seed=i) for i in range(2)]
    uploads = uploads_of(models, x, y)
    cfg = FedMITRConfig(inversion_iters=40, prune_at=[20], jitter=0, flip=False, feature_weight=1.0)

    def invert(c):
        ens = Ensemble.from_uploads(uploads, lambda: tiny_vit(seed=9), 10, c, "cpu")
        batch = SparseModelInversion(ens, c, (1, 16, 16), [0.3], [0.35], "cpu").synthesize(torch.arange(10), seed=1)
        with torch.no_grad():   # the finished images' distance to the clients' moments, on every token
            _, moments = ens.client_logits(batch.images, None, return_moments=True)
        return feature_stats_loss(moments, [u.feature_stats for u in uploads]).item(), batch

    with_prior, batch = invert(cfg)
    without, plain = invert(cfg.replace(feature_weight=0.0))
    assert with_prior < 0.5 * without
    assert not torch.equal(batch.images, plain.images)
    assert feature_stats_loss([u.feature_stats for u in uploads], [u.feature_stats for u in uploads]).item() == 0.0


def test_missing_or_misshapen_statistics_are_refused_naming_the_client(data):
    x, y = data
    models = [tiny_vit(seed=i) for i in range(3)]
    cfg = FedMITRConfig(feature_weight=0.1, inversion_iters=4, prune_at=[2])
    uploads = uploads_of(models, x, y)
    uploads[2].client_id = 7

    def inverter(ups, c=cfg):
        ens = Ensemble.from_uploads(ups, lambda: tiny_vit(seed=9), 10, c, "cpu")
        return SparseModelInversion(ens, c, (1, 16, 16), [0.3], [0.35], "cpu")

    uploads[1].feature_stats = None
    with pytest.raises(ValueError, match=r"feature_weight = 0.1 matches .* client\(s\) \[1\] uploaded none"):
        inverter(uploads)
    # without the prior the server does not need them
    inverter(uploads, cfg.replace(feature_weight=0.0)).synthesize(torch.arange(2))
    uploads[1].feature_stats = torch.zeros(3, 2, models[0].embed_dim)
    with pytest.raises(ValueError, match=r"client 1's feature statistics: expected a float tensor of shape \(2, 2, "):
        inverter(uploads)
    uploads[1].feature_stats = uploads[0].feature_stats
    uploads[2].feature_stats = torch.full((2, 2, models[0].embed_dim), -1.0)
    with pytest.raises(ValueError, match="client 7's feature statistics: holds NaN/Inf or a negative variance"):
        inverter(uploads)
    # a sub-ensemble (client screening) keeps its clients' statistics and ids
    ens = Ensemble.from_uploads(uploads, lambda: tiny_vit(seed=9), 10, cfg, "cpu").subset([0, 2])
    assert ens.client_ids == [0, 7] and ens.feature_stats[1] is uploads[2].feature_stats
    with pytest.raises(ConfigError, match="fedmitr_args.feature_weight = -1.0 is invalid"):
        FedMITRConfig.from_dict({"feature_weight": -1.0})


def test_a_client_can_withhold_its_statistics_and_the_server_names_it_and_the_switch(data):
    x, y = data
    withheld = train_client(3, tiny_vit(seed=3), loader(x, y, batch=64, shuffle=True),
                            ClientTrainConfig(epochs=1, feature_stats=False), "cpu", 10)
    assert withheld.feature_stats is None and "feature_stats" not in withheld.to_payload()
    assert ClientUpload.from_payload(withheld.to_payload()).feature_stats is None
    uploads = uploads_of([tiny_vit(seed=4), tiny_vit(seed=5)], x, y) + [withheld]
    cfg = FedMITRConfig(feature_weight=0.1, inversion_iters=4, prune_at=[2], synthesis_batch_size=10,
                        screening_images=10, screening_iters=3, screening_min_ratio=0.5, min_clients_after_screening=1)
    ens = Ensemble.from_uploads(uploads, lambda: tiny_vit(seed=9), 10, cfg, "cpu")
    with pytest.raises(ValueError, match=r"client\(s\) \[3\] uploaded none \(withheld with "
                                         r"train_args.client_feature_stats: false"):
        SparseModelInversion(ens, cfg, (1, 16, 16), [0.3], [0.35], "cpu")
    # the poisoned-upload screen's probe compares weights and predictions only: it runs without them
    report = screen_clients(ens, uploads, cfg, (1, 16, 16), [0.3], [0.35], "cpu", 10)
    assert report.probe_images == 10 and len(report.agreement) == 3


def test_a_client_with_outlandish_statistics_pulls_no_harder_than_any_other():
    """The prior sums l2 distances, not squared ones: each client's term has a gradient of norm 1 per
    block and moment, whatever it sent, so a poisoned client's pull is bounded by w / K like anyone's."""
    torch.manual_seed(0)
    moments = [torch.randn(2, 2, 8, requires_grad=True) for _ in range(3)]
    honest = [torch.rand(2, 2, 8) for _ in range(3)]

    def grads(targets):
        for m in moments:
            m.grad = None
        feature_stats_loss(moments, targets).backward()
        return [m.grad.norm(dim=2) for m in moments]

    poisoned = honest[:2] + [honest[2] * 1e6]
    for g_honest, g_poisoned in zip(grads(honest), grads(poisoned)):
        torch.testing.assert_close(g_honest, torch.full((2, 2), 1 / 3))
        torch.testing.assert_close(g_poisoned, torch.full((2, 2), 1 / 3))


def test_halted_token_sums_pooled_with_the_kept_moments_give_the_whole_image_moments(data):
    """feature_tokens: all pools the kept tokens' moments with the halted ones' sums; on one forward of
    every token that is exactly the moments of all of them."""
    x, _ = data
    model = tiny_vit(seed=2)
    images = x[:6]
    torch.manual_seed(0)
    halted = torch.rand(6, 16) < 0.4
    with torch.no_grad():
        _, everything = forward_tokens(model, images, return_moments=True)
    inputs = block_inputs(model, images)
    for block, t in enumerate(inputs):
        kept_t = t[~halted]                                   # (count, embed_dim)
        kept = torch.stack([kept_t.mean(0), kept_t.var(0, unbiased=False)]).unsqueeze(0)
        sums = patch_token_sums(model, images, halted)[block:block + 1]
        pooled = pooled_moments(kept, kept_t.shape[0], sums, int(halted.sum()))
        torch.testing.assert_close(pooled[0], everything[block], rtol=1e-4, atol=1e-5)
    # with no halted token the sums are zero and the moments stay the kept ones
    none = patch_token_sums(model, images, torch.zeros(6, 16, dtype=torch.bool))
    assert torch.equal(none, torch.zeros_like(none))
    torch.testing.assert_close(pooled_moments(everything, 96, none, 0), everything)
    _, direct = run_blocks(model, model.norm_pre(model._pos_embed(model.patch_embed(images))), True)
    torch.testing.assert_close(direct, everything)


def test_the_prior_over_all_tokens_brings_whole_images_closer_to_the_clients(data):
    """After pruning, ``feature_tokens: kept`` pulls the foreground alone towards statistics measured on
    whole images; ``all`` matches the whole images' moments, which end closer to the clients'."""
    x, y = data
    models = [tiny_vit(seed=i) for i in range(2)]
    uploads = uploads_of(models, x, y)
    cfg = FedMITRConfig(inversion_iters=40, prune_at=[8, 16], prune_ratio=0.5, jitter=0, flip=False,
                        feature_weight=1.0, feature_tokens="all")

    def invert(c):
        ens = Ensemble.from_uploads(uploads, lambda: tiny_vit(seed=9), 10, c, "cpu")
        batch = SparseModelInversion(ens, c, (1, 16, 16), [0.3], [0.35], "cpu").synthesize(torch.arange(10), seed=1)
        with torch.no_grad():
            _, moments = ens.client_logits(batch.images, None, return_moments=True)
        return feature_stats_loss(moments, [u.feature_stats for u in uploads]).item(), batch

    every, batch = invert(cfg)
    kept, kept_batch = invert(cfg.replace(feature_tokens="kept"))
    assert every < kept
    assert int(batch.masks[0].sum()) == 4 and not torch.equal(batch.images, kept_batch.images)
    with pytest.raises(ConfigError, match="fedmitr_args.feature_tokens = 'some' is invalid: expected one of 'kept', 'all'"):
        FedMITRConfig.from_dict({"feature_tokens": "some"})


# ---- the class-conditional prior (feature_prior: per_class) ----

def test_per_class_moments_are_each_class_s_own_token_moments(data):
    x, y = data
    model = tiny_vit(seed=4)
    stats = class_token_moments(model, loader(x[y != 9], y[y != 9], batch=64), "cpu", 10)
    assert stats.shape == (10, 2, 2, model.embed_dim)
    for c in (0, 3):
        torch.testing.assert_close(stats[c], token_moments(model, loader(x[y == c], y[y == c]), "cpu"),
                                   rtol=1e-4, atol=1e-5)
    assert torch.equal(stats[9], torch.zeros_like(stats[9]))    # a class the shard lacks
    # the same moments per group of images from a sparse forward's per-image moments
    keep = torch.tensor([[0, 5, 6, 15]]).repeat(12, 1)
    labels = torch.tensor([0, 1] * 6)
    _, per_image = forward_tokens(model, x[:12], keep, return_moments="per_image")
    grouped, counts = group_moments(per_image, labels, 3)
    assert counts.tolist() == [6.0, 6.0, 0.0]
    for g in (0, 1):
        _, direct = forward_tokens(model, x[:12][labels == g], keep[:6], return_moments=True)
        torch.testing.assert_close(grouped[g], direct, rtol=1e-4, atol=1e-5)


def test_batched_and_looped_ensembles_give_the_same_per_image_moments(data):
    models = [tiny_vit(seed=i) for i in range(2)]
    w = client_weights("mean", [1] * 2, [[1] * 10] * 2, 10)
    loop = Ensemble(models, w, batched="loop").client_logits(data[0][:5], None, return_moments="per_image")
    vmapped = Ensemble(models, w, batched="vmap").client_logits(data[0][:5], None, return_moments="per_image")
    for a, b in zip(loop[1], vmapped[1]):
        assert a.shape == (5, 2, 2, models[0].embed_dim)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_client_sends_per_class_statistics_only_when_asked(data):
    x, y = data
    plain = train_client(1, tiny_vit(seed=3), loader(x, y, batch=64), ClientTrainConfig(epochs=1), "cpu", 10)
    assert plain.class_feature_stats is None and "class_feature_stats" not in plain.to_payload()
    model = tiny_vit(seed=3)
    up = train_client(1, model, loader(x, y, batch=64), ClientTrainConfig(epochs=1, class_feature_stats=True),
                      "cpu", 10)
    torch.testing.assert_close(up.class_feature_stats, class_token_moments(model, loader(x, y), "cpu", 10))
    assert torch.equal(ClientUpload.from_payload(up.to_payload()).class_feature_stats, up.class_feature_stats)
    with pytest.raises(ValueError, match=r"class_feature_stats must be a float tensor \(classes, blocks, 2"):
        ClientUpload.from_payload(dict(up.to_payload(), class_feature_stats=up.class_feature_stats[:4]))


def test_a_client_s_statistics_of_a_class_it_does_not_hold_pull_nothing():
    torch.manual_seed(0)
    per_image = [torch.randn(6, 2, 2, 8, requires_grad=True) for _ in range(2)]
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    honest = [torch.rand(3, 2, 2, 8) for _ in range(2)]
    shares = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5]])   # client 0 holds class 0, client 1 class 1

    def loss(targets):
        return class_feature_stats_loss(per_image, labels, targets, shares)

    poisoned = [honest[0].clone(), honest[1].clone()]
    poisoned[0][1] *= 1e6        # client 0's class-1 statistics, a class it holds no image of
    poisoned[1][0] += 1e6
    torch.testing.assert_close(loss(poisoned), loss(honest))
    loss(honest).backward()
    assert per_image[0].grad[3:].abs().sum() == 0 and per_image[0].grad[:3].abs().sum() > 0


def test_inversion_with_the_per_class_prior_matches_each_class_s_moments(data):
    x, y = data
    models = [tiny_vit(seed=i) for i in range(2)]
    uploads = uploads_of(models, x, y)
    for u, m in zip(uploads, models):
        u.class_feature_stats = class_token_moments(m, loader(x, y), "cpu", 10)
    cfg = FedMITRConfig(inversion_iters=40, prune_at=[20], jitter=0, flip=False, feature_weight=1.0,
                        feature_prior="per_class")
    labels = torch.arange(10).repeat(2)

    def invert(c):
        ens = Ensemble.from_uploads(uploads, lambda: tiny_vit(seed=9), 10, c, "cpu")
        batch = SparseModelInversion(ens, c, (1, 16, 16), [0.3], [0.35], "cpu").synthesize(labels, seed=1)
        with torch.no_grad():   # the finished images' distance to each class's moments, on every token
            _, per_image = ens.client_logits(batch.images, None, return_moments="per_image")
        _, shares = ens.checked_class_feature_stats()
        return class_feature_stats_loss(per_image, labels, [u.class_feature_stats for u in uploads], shares).item()

    assert invert(cfg) < 0.8 * invert(cfg.replace(feature_prior="global"))
    # clients that sent no per-class statistics are named, with the switch that sends them
    uploads[1].class_feature_stats = None
    with pytest.raises(ValueError, match=r"client\(s\) \[1\] uploaded none \(sent with "
                                         r"train_args.client_class_feature_stats: true\)"):
        invert(cfg)
    uploads[1].class_feature_stats = torch.zeros(9, 2, 2, models[0].embed_dim)
    with pytest.raises(ValueError, match=r"client 1's per-class feature statistics: expected a float tensor "
                                         r"of shape \(10, 2, 2, "):
        invert(cfg)
    with pytest.raises(ConfigError, match="fedmitr_args.feature_prior = 'per_class' is invalid: expected 'global' "
                                          "with feature_tokens: all"):
        FedMITRConfig.from_dict({"feature_prior": "per_class", "feature_tokens": "all"})
