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


def single_class_warning(uploads) -> "str | None":
    """A warning when every client trained on one class only; None otherwise.

    A model that saw one class learns to predict it for every image, so it carries nothing that tells
    the classes apart: the clients' ensemble is at chance and no data-free one-shot method can distil
    more than that (the benchmark cell ``mnist_K10_c1`` measures it, see benchmarks/README.md).
    """
    held = {int(u.client_id): [c for c, n in enumerate(u.label_counts) if int(n) > 0] for u in uploads}
    if not held or any(len(classes) != 1 for classes in held.values()):
        return None
    pairs = ", ".join(f"client {cid}: class {classes[0]}" for cid, classes in held.items())
    return (f"every client trained on one class only ({pairs}): a model that saw one class predicts it for "
            "every image, so the ensemble of the clients cannot tell the classes apart and stays at chance "
            "accuracy; no data-free one-shot method can distil more from it. Give each client at least two "
            "classes (e.g. data_args.classes_per_client >= 2) for the server to have something to learn")
