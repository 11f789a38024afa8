"""ViT models from timm, the token-subset forward, last-block attention, and weight averaging.

Only class-token ViTs (timm ``VisionTransformer`` and subclasses such as DeiT, with
``global_pool='token'``) are accepted: FedMITR reads the CLS-to-patch attention and runs the model
on subsets of patch tokens.

Small presets for CPU-sized images are registered in timm's own model registry, so
``timm.create_model('fedmitr_vit_micro', img_size=16)`` works once this module is imported.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import timm
import torch
from timm.models import register_model
from timm.models.vision_transformer import VisionTransformer
from torch import nn


class ModelError(ValueError):
    """A model that FedMITR cannot use, or weights that do not fit the model."""


# ---------------------------------------------------------------------------------------------
# Presets: tiny ViTs that train on 2 CPU cores for 8x8 .. 32x32 images (registered in timm).
# ---------------------------------------------------------------------------------------------
PRESETS: Dict[str, Dict] = {
    # 0.45M parameters: the calibration model (16 tokens at 16x16 with patch 4)
    "fedmitr_vit_micro": dict(embed_dim=96, depth=4, num_heads=3, mlp_ratio=2.0),
    # 1.2M parameters
    "fedmitr_vit_tiny": dict(embed_dim=128, depth=6, num_heads=4, mlp_ratio=2.0),
    # 2.7M parameters: 32x32 images on a GPU
    "fedmitr_vit_small": dict(embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0),
}


def _preset_builder(name: str):
    def build(pretrained: bool = False, **kwargs) -> VisionTransformer:
        if pretrained:
            raise ModelError(f"model {name!r} has no published weights: use pretrained_path "
                             "(a local checkpoint) instead")
        args = dict(img_size=16, patch_size=4, in_chans=3, num_classes=10, class_token=True,
                    global_pool="token")
        args.update(PRESETS[name])
        for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):  # timm factory extras
            kwargs.pop(key, None)
        args.update(kwargs)
        return VisionTransformer(**args)
    build.__name__ = name
    build.__module__ = __name__
    return build


for _name in PRESETS:
    register_model(_preset_builder(_name))


def create_vit(name: str, img_size: int, num_classes: int, in_chans: int = 3,
               patch_size: Optional[int] = None, pretrained: bool = False,
               pretrained_path: Optional[str] = None, **kwargs) -> VisionTransformer:
    """Build a class-token ViT by timm name with the given input and head sizes.

    ``pretrained=True`` takes timm's published weights (needs network); ``pretrained_path`` loads a
    local checkpoint file through timm's own loader (head and position embeddings adapted).
    Any model that is not a class-token ViT raises :class:`ModelError`.
    """
    if not isinstance(name, str) or not timm.is_model(name):
        raise ModelError(f"model {name!r} is not a timm model name (e.g. 'fedmitr_vit_micro', "
                         f"'vit_tiny_patch16_224', 'deit_tiny_patch16_224')")
    args = dict(img_size=img_size, num_classes=num_classes, in_chans=in_chans, global_pool="token")
    if patch_size is not None:
        args["patch_size"] = patch_size
    args.update(kwargs)
    if pretrained_path and pretrained:
        raise ModelError("give either pretrained (timm's published weights) or pretrained_path, not both")
    try:
        model = timm.create_model(name, pretrained=pretrained, **args)
    except TypeError as exc:
        raise ModelError(f"model {name!r} cannot be built as a class-token ViT with {args}: {exc}") from exc
    check_vit(model, name)
    if pretrained_path:
        load_pretrained_file(model, pretrained_path)
    return model


def load_pretrained_file(model: VisionTransformer, path) -> VisionTransformer:
    """Load a local checkpoint into ``model``: timm's ViT checkpoint filter resamples position and
    patch embeddings to the model's sizes; a classifier head of another class count is skipped."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"pretrained_path {str(path)!r} does not exist or is not a file")
    try:  # weights_only: a checkpoint from elsewhere cannot run code when it is read
        blob = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelError(f"pretrained_path {str(path)!r} cannot be read as weights only ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}); save it as a plain state_dict "
                         "(torch.save(model.state_dict(), PATH))") from exc
    state = blob
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
            break
    if not isinstance(state, dict):
        raise ModelError(f"pretrained_path {str(path)!r} holds no state_dict")
    state = checkpoint_filter_fn(state, model)
    own = model.state_dict()
    head = {k for k in state if k.startswith("head.") and k in own and state[k].shape != own[k].shape}
    state = {k: v for k, v in state.items() if k not in head}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("head.")]
    if missing or unexpected:
        raise ModelError(f"pretrained_path {str(path)!r} does not fit model: missing {missing[:5]}, "
                         f"unexpected {list(unexpected)[:5]}")
    return model


def check_vit(model: nn.Module, name: Optional[str] = None) -> VisionTransformer:
    """Raise :class:`ModelError` unless ``model`` is a class-token timm ViT; return it."""
    what = name or type(model).__name__
    if not isinstance(model, VisionTransformer):
        raise ModelError(f"model {what!r} ({type(model).__name__}) is not a timm VisionTransformer: "
                         "FedMITR needs a class-token ViT (timm VisionTransformer / DeiT)")
    if getattr(model, "cls_token", None) is None or getattr(model, "global_pool", None) != "token":
        raise ModelError(f"model {what!r} must have a class token and global_pool='token' "
                         f"(has global_pool={getattr(model, 'global_pool', None)!r})")
    if getattr(model, "attn_pool", None) is not None:
        raise ModelError(f"model {what!r} uses attention pooling; FedMITR needs CLS-token pooling")
    return model


def num_patches(model: VisionTransformer) -> int:
    return int(model.patch_embed.num_patches)


def grid_size(model: VisionTransformer) -> Tuple[int, int]:
    return tuple(int(g) for g in model.patch_embed.grid_size)


# ---------------------------------------------------------------------------------------------
# Token-subset forward and last-block attention
# ---------------------------------------------------------------------------------------------
def embed_tokens(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """Patch embedding of the full image, position embeddings (with prefix tokens), norm_pre."""
    tokens = model.patch_embed(x)
    tokens = model._pos_embed(tokens)
    tokens = model.norm_pre(tokens)
    return tokens


def gather_tokens(tokens: torch.Tensor, keep_idx: Optional[torch.Tensor], num_prefix: int) -> torch.Tensor:
    """Every prefix token plus the patch tokens ``keep_idx`` (B, k) indexes (0-based patch ids)."""
    if keep_idx is None:
        return tokens
    prefix, patches = tokens[:, :num_prefix], tokens[:, num_prefix:]
    if keep_idx.dim() == 1:
        keep_idx = keep_idx.unsqueeze(0).expand(tokens.shape[0], -1)
    kept = torch.gather(patches, 1, keep_idx.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))
    return torch.cat([prefix, kept], dim=1)


@contextlib.contextmanager
def last_block_attention(model: VisionTransformer):
    """Capture the softmaxed attention (B, heads, T, T) of the last block's timm ``Attention``.

    timm computes attention fused (``scaled_dot_product_attention``) by default, which exposes no
    map; inside this context the last block takes its non-fused path and a hook on its
    ``attn_drop`` records the map. Yields a list that holds the captured tensor after a forward.
    """
    attn = model.blocks[-1].attn
    captured: List[torch.Tensor] = []
    old = getattr(attn, "fused_attn", False)
    attn.fused_attn = False
    handle = attn.attn_drop.register_forward_hook(lambda _m, inp, _out: captured.append(inp[0]))
    try:
        yield captured
    finally:
        handle.remove()
        attn.fused_attn = old


def run_blocks(model: VisionTransformer, tokens: torch.Tensor, return_moments=False):
    """The transformer blocks on ``tokens``. With ``return_moments`` also the mean and the variance over
    the batch and the patch tokens (prefix tokens left out) of each block's input, (depth, 2, embed_dim),
    in float32: the statistics that :func:`token_moments` measures on a client's data. With
    ``return_moments="per_image"`` instead each image's mean and mean of squares over its own patch tokens,
    (B, depth, 2, embed_dim), from which the moments of any group of images follow
    (:func:`group_moments`)."""
    if not return_moments:
        return model.blocks(tokens), None
    p = model.num_prefix_tokens
    per_image = return_moments == "per_image"
    moments = []
    for block in model.blocks:
        t = tokens[:, p:].float()
        if per_image:
            moments.append(torch.stack([t.mean(dim=1), (t * t).mean(dim=1)], dim=1))   # (B, 2, D)
        else:
            moments.append(torch.stack([t.mean(dim=(0, 1)), t.var(dim=(0, 1), unbiased=False)]))
        tokens = block(tokens)
    return tokens, torch.stack(moments, dim=1 if per_image else 0)


def group_sums(per_image: torch.Tensor, groups: torch.Tensor, num_groups: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per group of images, the sums of :func:`run_blocks`'s per-image moments (B, depth, 2, embed_dim),
    (G, depth, 2, embed_dim), and the number of images (G,). ``groups`` (B,) gives each image's group.
    Sums add over batches, so a loader can be reduced one batch at a time."""
    onehot = torch.nn.functional.one_hot(groups.long(), num_groups).to(per_image.dtype)   # (B, G)
    return torch.einsum("bg,bldx->gldx", onehot, per_image), onehot.sum(0)


def moments_from_sums(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Token mean and variance per group, (G, depth, 2, embed_dim), from :func:`group_sums`'s output;
    a group without images gets zeros."""
    avg = sums / counts.clamp_min(1.0).view(-1, 1, 1, 1)
    mean = avg[:, :, 0]
    var = (avg[:, :, 1] - mean * mean).clamp_min(0.0)
    return torch.stack([mean, var], dim=2)


def group_moments(per_image: torch.Tensor, groups: torch.Tensor, num_groups: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token mean and variance per group of images, (G, depth, 2, embed_dim), from :func:`run_blocks`'s
    per-image moments (B, depth, 2, embed_dim) of images that each hold the same number of patch tokens
    (so every token weighs the same), and the number of images of each group (G,). ``groups`` (B,) gives
    each image's group; a group without images gets zeros."""
    sums, counts = group_sums(per_image, groups, num_groups)
    return moments_from_sums(sums, counts), counts


@torch.no_grad()
def patch_token_sums(model: VisionTransformer, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum and sum of squares, over the batch and the patch tokens that ``mask`` (B, N) selects, of each
    block's input in a forward of every token of ``x``; (depth, 2, embed_dim), float32. What those
    tokens add to :func:`run_blocks`'s moments when they are left out of a sparse forward."""
    tokens = embed_tokens(model, x)
    p = model.num_prefix_tokens
    w = mask.unsqueeze(-1).float()
    sums = []
    for block in model.blocks:
        t = tokens[:, p:].float()
        sums.append(torch.stack([(t * w).sum(dim=(0, 1)), (t * t * w).sum(dim=(0, 1))]))
        tokens = block(tokens)
    return torch.stack(sums)


def pooled_moments(moments: torch.Tensor, count: int, sums: torch.Tensor, other_count: int) -> torch.Tensor:
    """Token mean and variance (depth, 2, embed_dim) of ``count`` tokens with ``moments`` (see
    :func:`run_blocks`) pooled with ``other_count`` tokens whose sums :func:`patch_token_sums` gives."""
    mean, var = moments[:, 0], moments[:, 1]
    n = count + other_count
    pooled_mean = (count * mean + sums[:, 0]) / n
    second = (count * (var + mean * mean) + sums[:, 1]) / n
    return torch.stack([pooled_mean, (second - pooled_mean * pooled_mean).clamp_min(0.0)], dim=1)


def forward_tokens(model: VisionTransformer, x: torch.Tensor, keep_idx: Optional[torch.Tensor] = None,
                   return_attn: bool = False, return_moments=False):
    """Logits of ``model`` on images ``x`` seeing only the patches ``keep_idx`` (B, k) (all if None).

    Dropped tokens never enter a block: the blocks run on ``num_prefix_tokens + k`` tokens. With
    ``return_attn`` also returns the last block's CLS-to-patch attention, mean over heads, (B, k); with
    ``return_moments`` also each block input's token mean and variance (:func:`run_blocks`, which also
    explains ``return_moments="per_image"``), after it.
    """
    tokens = gather_tokens(embed_tokens(model, x), keep_idx, model.num_prefix_tokens)
    if not return_attn:
        feats, moments = run_blocks(model, tokens, return_moments)
        logits = model.forward_head(model.norm(feats))
        return (logits, moments) if return_moments else logits
    with last_block_attention(model) as captured:
        feats, moments = run_blocks(model, tokens, return_moments)
    logits = model.forward_head(model.norm(feats))
    attn_map = captured[-1]  # (B, heads, T, T)
    cls_to_patch = attn_map[:, :, 0, model.num_prefix_tokens:].mean(dim=1)
    return (logits, cls_to_patch, moments) if return_moments else (logits, cls_to_patch)


def check_feature_stats(stats, model: VisionTransformer, what: str, num_classes: Optional[int] = None) -> None:
    """``stats`` must be a finite float tensor (depth, 2, embed_dim) of ``model``'s shape (see
    :func:`token_moments`), or with ``num_classes`` (num_classes, depth, 2, embed_dim) (see
    :func:`class_token_moments`), variances >= 0; otherwise a ValueError naming ``what``."""
    expected = (len(model.blocks), 2, int(model.embed_dim))
    if num_classes is not None:
        expected = (int(num_classes),) + expected
    if not isinstance(stats, torch.Tensor) or not stats.is_floating_point() or tuple(stats.shape) != expected:
        got = tuple(stats.shape) if isinstance(stats, torch.Tensor) else type(stats).__name__
        layout = "(blocks, mean and variance, embed_dim)" if num_classes is None else \
            "(classes, blocks, mean and variance, embed_dim)"
        raise ValueError(f"{what}: expected a float tensor of shape {expected} {layout}, got {got}")
    if not bool(torch.isfinite(stats).all()) or bool((stats.select(-2, 1) < 0).any()):
        raise ValueError(f"{what}: holds NaN/Inf or a negative variance")


@torch.no_grad()
def token_moments(model: VisionTransformer, loader, device) -> torch.Tensor:
    """(depth, 2, embed_dim): the mean and the variance of the patch tokens entering each block of
    ``model``, over every image of ``loader`` (full images, no augmentation). A client measures them
    on its own shard and uploads them with its weights: a ViT's analogue of the BatchNorm statistics
    that DeepInversion matches (a ViT has no BatchNorm to carry them)."""
    model.to(device).eval()
    total, s1, s2 = 0, 0.0, 0.0     # token count, sums of the per-batch first and second moments
    for x, _ in loader:
        x = x.to(device)
        _, m = forward_tokens(model, x, return_moments=True)
        n = x.shape[0] * num_patches(model)
        mean, var = m[:, 0].double(), m[:, 1].double()
        s1 = s1 + mean * n
        s2 = s2 + (var + mean * mean) * n
        total += n
    if not total:
        raise ValueError("token_moments: the loader holds no images")
    mean = s1 / total
    return torch.stack([mean, s2 / total - mean * mean], dim=1).float().cpu()


@torch.no_grad()
def class_token_moments(model: VisionTransformer, loader, device, num_classes: int) -> torch.Tensor:
    """(num_classes, depth, 2, embed_dim): :func:`token_moments` of each class's images of ``loader``
    apart (zeros for a class without images). What a client uploads for the class-conditional feature
    prior (``FedMITRConfig.feature_prior: per_class``)."""
    model.to(device).eval()
    sums, counts = None, None
    for x, y in loader:      # reduced batch by batch: memory does not grow with the client's data
        _, m = forward_tokens(model, x.to(device), return_moments="per_image")
        part, n = group_sums(m.double().cpu(), y.long().view(-1).cpu(), num_classes)
        sums, counts = (part, n) if sums is None else (sums + part, counts + n)
    if sums is None:
        raise ValueError("class_token_moments: the loader holds no images")
    return moments_from_sums(sums, counts).float()


class TokenSubsetViT(nn.Module):
    """A module whose ``forward(x, keep_idx)`` is :func:`forward_tokens` (for functional_call/vmap)."""

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        self.vit = vit

    def forward(self, x: torch.Tensor, keep_idx: Optional[torch.Tensor] = None, return_attn: bool = False,
                return_moments=False):
        return forward_tokens(self.vit, x, keep_idx, return_attn, return_moments)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------
def check_state_fits(state: Mapping[str, torch.Tensor], template: Mapping[str, torch.Tensor], what: str,
                     ours: str = "the model", advice: str = "") -> None:
    """``state`` must hold exactly the keys of ``template`` (the model called ``ours``), each a tensor of
    the same shape; otherwise ModelError names the keys or the parameter (``advice`` is appended)."""
    tail = f"; {advice}" if advice else ""
    missing = sorted(set(template) - set(state))
    extra = sorted(set(state) - set(template))
    if missing or extra:
        raise ModelError(f"{what} does not fit {ours} (another architecture): missing keys {missing[:5]}, "
                         f"unexpected keys {extra[:5]}{tail}")
    for key, expected in template.items():
        got = state[key]
        if not torch.is_tensor(got):
            raise ModelError(f"{what}: parameter {key!r} is a {type(got).__name__}, expected a tensor")
        if tuple(got.shape) != tuple(expected.shape):
            raise ModelError(f"{what} does not fit {ours} (another architecture): parameter {key!r} has shape "
                             f"{tuple(got.shape)}, {ours} has {tuple(expected.shape)}{tail}")


def load_state_checked(model: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> nn.Module:
    """Load ``state`` into ``model`` strictly; a missing key or shape mismatch raises ModelError."""
    check_state_fits(state, model.state_dict(), what, ours="the model")
    model.load_state_dict(state, strict=True)
    return model


def check_finite(state: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise ModelError if any floating tensor of ``state`` holds NaN or Inf."""
    for key, value in state.items():
        if torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
            raise ModelError(f"{what}: parameter {key!r} contains NaN or Inf")


def average_state_dicts(states: Sequence[Mapping[str, torch.Tensor]],
                        weights: Optional[Sequence[float]] = None) -> Dict[str, torch.Tensor]:
    """Weighted average of floating tensors; other tensors are taken from the first state."""
    if not states:
        raise ValueError("no state dicts to average")
    w = torch.tensor([1.0] * len(states) if weights is None else [float(v) for v in weights],
                     dtype=torch.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"averaging weights must be >= 0 with a positive sum, got {w.tolist()}")
    w = w / w.sum()
    out: Dict[str, torch.Tensor] = {}
    for key, first in states[0].items():
        if torch.is_tensor(first) and first.is_floating_point():
            acc = torch.zeros_like(first, dtype=torch.float64)
            for wi, st in zip(w, states):
                acc += wi * st[key].detach().to(torch.float64).cpu()
            out[key] = acc.to(first.dtype)
        else:
            out[key] = first.clone() if torch.is_tensor(first) else first
    return out


def fedavg_state_dict(uploads) -> Dict[str, torch.Tensor]:
    """FedAvg of client uploads, weighted by their sample counts."""
    return average_state_dicts([u.state_dict for u in uploads], [u.num_samples for u in uploads])


def save_global_model(path, model: nn.Module, meta: Mapping) -> None:
    """Save the global model as a plain state_dict plus what rebuilds it (see :func:`load_global_model`)."""
    from .checkpoint import save_atomic
    save_atomic({"state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "meta": dict(meta)},
                path, private=False)   # an output: as readable as the user's umask allows


def load_global_model(path, map_location="cpu") -> VisionTransformer:
    """Rebuild the model saved by :func:`save_global_model`.

    ``meta`` holds the timm name (``model``), ``img_size``, ``num_classes``, ``in_chans``,
    ``patch_size`` and optional ``model_kwargs`` (other timm arguments, e.g. ``depth``)."""
    blob = torch.load(str(path), map_location=map_location, weights_only=True)  # no code runs on load
    meta = blob["meta"]
    model = create_vit(meta["model"], img_size=meta["img_size"], num_classes=meta["num_classes"],
                       in_chans=meta["in_chans"], patch_size=meta.get("patch_size"),
                       **dict(meta.get("model_kwargs") or {}))
    load_state_checked(model, blob["state_dict"], str(path))
    return model.eval()


def autocast(device, mode: str = "auto"):
    """The forward passes' precision (``FedMITRConfig.autocast``): bf16 autocast on CUDA with
    ``"auto"``, on any device with ``"bf16"``, never with ``"off"``. Losses are taken in float32."""
    device = torch.device(device)
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                          enabled=autocast_enabled(device.type, mode))


def autocast_enabled(device_type: str, mode: str) -> bool:
    return mode == "bf16" or (mode == "auto" and device_type == "cuda")
