"""Non-IID partitions of a labelled dataset into K client shards, all seeded.

Each function returns a list of K sorted index arrays that together cover every sample exactly
once.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np


def dirichlet_partition(labels: Sequence[int], num_clients: int, alpha: float, seed: int,
                        min_size: int = 10, max_tries: int = 1000) -> List[np.ndarray]:
    """Per-class Dirichlet(alpha) split; redrawn until every client holds ``min_size``+ samples."""
    labels = np.asarray(labels)
    _check(labels, num_clients)
    if not alpha > 0:
        raise ValueError(f"partition_alpha = {alpha!r} is invalid: expected a number > 0")
    if min_size * num_clients > len(labels):
        raise ValueError(f"cannot give {num_clients} clients {min_size}+ samples each from "
                         f"{len(labels)} samples: use fewer clients")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        shards: List[List[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = np.flatnonzero(labels == c)
            rng.shuffle(idx)
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
            for k, part in enumerate(np.split(idx, cuts)):
                shards[k].extend(part.tolist())
        if min(len(s) for s in shards) >= min_size:
            return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]
    raise ValueError(f"no Dirichlet(alpha={alpha}) split gave every one of {num_clients} clients "
                     f"{min_size}+ samples in {max_tries} draws: raise partition_alpha or use fewer clients")


def pathological_partition(labels: Sequence[int], num_clients: int, classes_per_client: int,
                           seed: int) -> List[np.ndarray]:
    """``#C=k``: each client sees ``classes_per_client`` classes; each class is split evenly among
    the clients that hold it. Classes are dealt round-robin so every class has a holder."""
    labels = np.asarray(labels)
    _check(labels, num_clients)
    classes = np.unique(labels)
    k = int(classes_per_client)
    if not 1 <= k <= len(classes):
        raise ValueError(f"classes_per_client = {classes_per_client!r} is invalid: expected 1..{len(classes)}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(classes)
    # client i holds classes order[(i*k + j) % C], j < k; every class gets a holder if K*k >= C
    if num_clients * k < len(classes):
        raise ValueError(f"{num_clients} clients x {k} classes each cannot cover {len(classes)} classes")
    holders = {int(c): [] for c in classes}
    client_classes = []
    for i in range(num_clients):
        mine = [int(order[(i * k + j) % len(classes)]) for j in range(k)]
        client_classes.append(mine)
        for c in mine:
            holders[c].append(i)
    shards: List[List[int]] = [[] for _ in range(num_clients)]
    for c, owners in holders.items():
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        for owner, part in zip(owners, np.array_split(idx, len(owners))):
            shards[owner].extend(part.tolist())
    empty = [i for i, s in enumerate(shards) if not s]
    if empty:
        raise ValueError(f"clients {empty} got no samples: too few samples per class for {num_clients} clients")
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]


def iid_partition(labels: Sequence[int], num_clients: int, seed: int) -> List[np.ndarray]:
    """Uniformly random, equal-sized shards."""
    labels = np.asarray(labels)
    _check(labels, num_clients)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(labels))
    return [np.sort(part.astype(np.int64)) for part in np.array_split(perm, num_clients)]


def partition(labels: Sequence[int], num_clients: int, method: str, seed: int, alpha: float = 0.5,
              classes_per_client: int = 1, min_size: int = 10) -> List[np.ndarray]:
    """Dispatch by FedML's ``partition_method`` name: ``hetero``, ``pathological``, ``homo``."""
    if method == "hetero":
        return dirichlet_partition(labels, num_clients, alpha, seed, min_size=min_size)
    if method == "pathological":
        return pathological_partition(labels, num_clients, classes_per_client, seed)
    if method in ("homo", "iid"):
        return iid_partition(labels, num_clients, seed)
    raise ValueError(f"partition_method = {method!r} is invalid: expected 'hetero', 'pathological' or 'homo'")


def label_counts(labels: Sequence[int], num_classes: int) -> List[int]:
    return np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes).tolist()


def _check(labels: np.ndarray, num_clients: int) -> None:
    if num_clients < 1:
        raise ValueError(f"client_num_in_total = {num_clients!r} is invalid: expected >= 1")
    if len(labels) < num_clients:
        raise ValueError(f"{len(labels)} samples cannot be split among {num_clients} clients")
