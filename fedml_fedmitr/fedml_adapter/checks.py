"""Checks of what clients upload, before the server spends hours on it (FedML-free).

Each raises an error that names the client and what was expected: :class:`ModelError` for
weights of another architecture or with NaN/Inf, :class:`ClientFailure` for a client that trained
on nothing.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..core.models import check_finite, check_state_fits
from .errors import ClientFailure


def check_architecture(state: Mapping[str, torch.Tensor], template: Mapping[str, torch.Tensor], what: str,
                       ours: str = "the server's model") -> None:
    """``state`` must have exactly the keys and shapes of ``template`` (the model called ``ours``)."""
    check_state_fits(state, template, what, ours, advice="every party must use the same model_args")


def check_upload(upload, template: Mapping[str, torch.Tensor]) -> None:
    """Architecture, finite weights and a non-empty shard of one :class:`ClientUpload`."""
    what = f"the model of client {upload.client_id}"
    check_architecture(upload.state_dict, template, what)
    check_finite(upload.state_dict, what)
    if int(upload.num_samples) <= 0 or sum(int(c) for c in upload.label_counts) <= 0:
        raise ClientFailure(f"client {upload.client_id} uploaded a model trained on {upload.num_samples} samples: "
                            "its training shard is empty (every client needs training data)",
                            details={"client": int(upload.client_id)})
