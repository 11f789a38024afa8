"""Model factory for FedML runs: a timm class-token ViT from ``model_args``.

``model_args``: ``model`` (a timm name, e.g. ``fedmitr_vit_micro``), ``img_size``, ``patch_size``
(optional: the model's default otherwise), ``pretrained`` (timm's published weights, needs
network), ``checkpoint`` (a local weights file; ``pretrained_path`` is the older name), ``in_chans``
(optional: the data's channels).

A pretrained model (``pretrained: true`` or a ``checkpoint``) is fed the way timm means it: the
input size, mean/std and interpolation of its ``pretrained_cfg`` (``timm.data.resolve_data_config``)
fill ``img_size``, ``data_args.input_mean`` / ``input_std`` and ``data_args.interpolation`` wherever
the YAML leaves them unset (:func:`apply_pretrained_input`, before the data is read), so the data,
and the server's synthetic images, live in that normalisation.

The model is built right after seeding torch with ``random_seed``, so every process of a run
(server and each client) builds the same initial weights: one shared initialisation.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch
from torch import nn

from ..core.models import check_vit, create_vit

log = logging.getLogger("fedml_fedmitr")


def create_model(args, output_dim: int, name: Optional[str] = None) -> nn.Module:
    """The ViT of ``model_args`` with ``output_dim`` classes (ModelError for a non-ViT); ``name``: another
    architecture with the same input (a client's of ``model_args.client_models``), random weights."""
    info = getattr(args, "fedmitr_data_info", None)
    in_chans = getattr(args, "in_chans", None)
    if in_chans is None:
        in_chans = info.input_shape[0] if info is not None else 3
    img_size = int(getattr(args, "img_size", info.input_shape[1] if info is not None else 224))
    torch.manual_seed(int(getattr(args, "random_seed", 0)))
    own = name is None or name == args.model
    model = create_vit(args.model if own else name, img_size=img_size, num_classes=int(output_dim),
                       in_chans=int(in_chans), patch_size=getattr(args, "patch_size", None),
                       pretrained=bool(getattr(args, "pretrained", False)) and own,
                       pretrained_path=checkpoint_path(args) if own else None)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %s, img_size %d, patch %s, %d channels, %d classes, %.2fM parameters",
             args.model if own else name, img_size, model.patch_embed.patch_size[0], in_chans, output_dim,
             n_params / 1e6)
    return model


def checkpoint_path(args) -> Optional[str]:
    """``model_args.checkpoint`` (or its older name ``pretrained_path``), or None."""
    return getattr(args, "checkpoint", None) or getattr(args, "pretrained_path", None) or None


def is_pretrained(args) -> bool:
    return bool(getattr(args, "pretrained", False) or checkpoint_path(args))


def pretrained_input(args) -> Dict[str, Any]:
    """timm's data config of a pretrained ``model_args.model``: ``img_size``, ``input_mean``,
    ``input_std``, ``interpolation`` (empty when the model is not pretrained or timm has no config)."""
    if not is_pretrained(args) or not isinstance(getattr(args, "model", None), str):
        return {}
    from timm.data import resolve_data_config
    from timm.models import get_pretrained_cfg

    from ..core import models as _models  # noqa: F401  (registers the fedmitr_vit_* presets)

    cfg = get_pretrained_cfg(args.model)
    if cfg is None:
        return {}
    data = resolve_data_config(pretrained_cfg=cfg.to_dict())
    return {"img_size": int(data["input_size"][-1]), "input_mean": [float(v) for v in data["mean"]],
            "input_std": [float(v) for v in data["std"]], "interpolation": str(data["interpolation"])}


def apply_pretrained_input(args) -> Dict[str, Any]:
    """Set the keys of :func:`pretrained_input` that ``args`` leaves unset; returns those it set."""
    taken = {k: v for k, v in pretrained_input(args).items() if getattr(args, k, None) is None}
    for key, value in taken.items():
        setattr(args, key, value)
    if taken:
        log.info("model: %s is pretrained: %s from its timm pretrained_cfg", args.model,
                 ", ".join(f"{k} {v}" for k, v in taken.items()))
    return taken


def client_models(args) -> Optional[list]:
    """``model_args.client_models`` (architectures assigned to clients in turn), or None."""
    names = getattr(args, "client_models", None)
    return list(names) if names else None


def client_architecture(args, client_id: int) -> Optional[str]:
    """The architecture of client ``client_id`` (``client_models[client_id % len]``), or None (the global one)."""
    names = client_models(args)
    return None if names is None else str(names[int(client_id) % len(names)])


def check_client_models(args) -> None:
    """Every ``model_args.client_models`` entry is a class-token ViT with the global model's image size
    and patch grid (built on the meta device: no weights). Raises ConfigError naming the entry."""
    from ..core.config import ConfigError

    names = getattr(args, "client_models", None)
    if names is None:
        return
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"model_args.client_models = {names!r} is invalid: expected a list of timm ViT names")

    def grid(name):
        with torch.device("meta"):
            vit = create_vit(name, img_size=int(getattr(args, "img_size", 16)), num_classes=2,
                             in_chans=int(getattr(args, "in_chans", None) or 3),
                             patch_size=getattr(args, "patch_size", None))
        return tuple(int(g) for g in vit.patch_embed.grid_size), int(vit.patch_embed.img_size[0])

    want = grid(args.model)
    for i, name in enumerate(names):
        try:
            got = grid(name)
        except Exception as exc:   # not a timm ViT, or not buildable at this size
            raise ConfigError(f"model_args.client_models[{i}] = {name!r} is invalid: {exc}") from exc
        if got != want:
            raise ConfigError(f"model_args.client_models[{i}] = {name!r} sees a {got[0][0]}x{got[0][1]} patch grid "
                              f"at {got[1]} px, the global model {args.model!r} a {want[0][0]}x{want[0][1]} one at "
                              f"{want[1]} px: every client must share the image size and the patch grid")


def model_meta(model: nn.Module, args=None) -> Dict[str, Any]:
    """What :func:`fedml_fedmitr.core.models.load_global_model` needs to rebuild ``model``."""
    vit = check_vit(model)
    cfg = getattr(vit, "pretrained_cfg", None) or {}
    name = cfg.get("architecture")  # set by timm.create_model
    if not isinstance(name, str) and args is not None and isinstance(getattr(args, "model", None), str):
        name = args.model
    pe = vit.patch_embed
    return {"model": name, "img_size": int(pe.img_size[0]), "num_classes": int(vit.num_classes),
            "in_chans": int(pe.proj.in_channels), "patch_size": int(pe.patch_size[0])}


def input_shape_of(model: nn.Module):
    vit = check_vit(model)
    pe = vit.patch_embed
    return (int(pe.proj.in_channels), int(pe.img_size[0]), int(pe.img_size[1]))
