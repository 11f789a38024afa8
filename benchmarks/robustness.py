"""Robustness of the FedMITR defaults: one matrix of small federations, FedMITR next to
DeepInversion and one-shot FedAvg on the same uploads, five seeds per cell.

    python benchmarks/robustness.py                    # the whole matrix, 5 seeds, --jobs 2
    python benchmarks/robustness.py --cells digits_K5_a0.5 --seeds 0 1 --name probe
    python benchmarks/robustness.py --set relabel_weight=4 --name lambda4   # an ablation row set
    python benchmarks/robustness.py --change robust_defaults lambda4 --name lambda4_change

Every cell goes through the plugin's own data path (``fedml_fedmitr.data.load_data`` with a
FedML-style ``args``), the plugin's model factory, and the core's client training, so a cell gives
the same clients as ``python -m fedml_fedmitr`` with the same settings. The server methods run
with ``FedMITRConfig`` defaults and the budget of the shipped configs (``BUDGET`` below: sizes,
steps, epochs); ``--set KEY=VALUE`` changes a method knob for an ablation.

Per cell and seed it records, for FedMITR: test accuracy per distillation epoch from its start
(``curve``), how many synthetic images the ensemble assigns their synthesis label
(``pool_fit``), the class balance of the ensemble's predictions on the pool and on the pool's
background tokens, per-class accuracy, and whether the global model collapsed (its test
predictions miss a class that the ensemble predicts correctly at least once).

Three conditions per cell (5-seed means): FedMITR >= 0.9 x ensemble, FedMITR >= its start
(one-shot FedAvg of the same uploads), and no seed collapsed. Results:
``benchmarks/results/<name>.json`` and ``.md``. Client uploads and method records are cached
under ``benchmarks/cache/robust/`` (git-ignored), so a rerun only computes what is missing.

Data: scikit-learn's digits (installed), and, built once from ``../shared/data`` into the cache,
an MNIST subset (5,000 / 2,000), and CIFAR-10 split into public classes 0-4 (the backbone's
pretraining data) and a task of classes 5-9 (relabelled 0-4, from the 5k/1k subset).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

import yaml

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from fedbench.stats import fmt_paired, paired  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
CACHE = ROOT / "benchmarks" / "cache" / "robust"
RESULTS = ROOT / "benchmarks" / "results"

METHODS = ["FedMITR", "DeepInversion", "OneShotFedAvg", "KD-real", "KD-real-plain"]
# References, not methods: FedMITR's distillation (same student start, loss, budget) on real unlabelled
# training images in place of the synthetic pool, with token-relabel masks from the ensemble's
# attention on them (KD-real) or plain KD on full images (KD-real-plain). They separate a weak
# teacher or a short distillation from weak synthesis.
REFERENCES = {"KD-real": "FedMITR", "KD-real-plain": "FedMITR-kd"}

# The server budget of the shipped configs, read from the main job's config (the other shipped configs
# carry the same; tests/test_benchmark_shipped.py checks it): sizes, steps, epochs only. Every method
# knob comes from FedMITRConfig's defaults.
BUDGET_KEYS = ("num_synthetic", "synthesis_batch_size", "inversion_iters", "distill_epochs", "distill_batch_size")
_SHIPPED = yaml.safe_load((ROOT / "config" / "fedmitr_sp.yaml").read_text())["fedmitr_args"]
BUDGET = {k: _SHIPPED[k] for k in BUDGET_KEYS}

# Local training of the clients (FedML's train_args) per dataset family: to convergence on a shard.
CLIENT = {
    "digits": dict(epochs=30, batch_size=32, learning_rate=0.002, client_augment=False, client_flip=False),
    "mnist": dict(epochs=15, batch_size=32, learning_rate=0.002, client_augment=False, client_flip=False),
    "cifar10": dict(epochs=20, batch_size=32, learning_rate=0.002, client_augment=True, client_flip=True),
}

# The matrix: K from 2 to 10; Dirichlet 0.1 / 0.5 and label-sorted shards of 1-2 classes;
# clients from one shared random init (scratch) or from a backbone pretrained on public data.
CELLS: Dict[str, Dict[str, Any]] = {
    "digits_K5_a0.5": dict(data="digits", clients=5, partition="hetero", alpha=0.5),
    "digits_K2_a0.5": dict(data="digits", clients=2, partition="hetero", alpha=0.5),
    "digits_K5_c2": dict(data="digits", clients=5, partition="pathological", classes_per_client=2),
    "mnist_K5_a0.1": dict(data="mnist", clients=5, partition="hetero", alpha=0.1),
    "mnist_K10_c1": dict(data="mnist", clients=10, partition="pathological", classes_per_client=1),
    "digits_K5_a0.1_pre": dict(data="digits", clients=5, partition="hetero", alpha=0.1, backbone="mnist_full"),
    "cifar10_K10_a0.1_pre": dict(data="cifar10", clients=10, partition="hetero", alpha=0.1,
                                 backbone="cifar10_public"),
    "cifar10_K5_c2_pre": dict(data="cifar10", clients=5, partition="pathological", classes_per_client=2,
                              backbone="cifar10_public"),
}

MATRIX = list(CELLS)   # the robustness matrix of the defaults (#18); the cells below are #17's regime trials

# Full CIFAR-10 (50,000 / 10,000), for a regime with headroom (#17): the task is either classes 5-9
# (25,000 / 5,000, relabelled 0-4) with a backbone pretrained on classes 0-4, or all 10 classes on half
# of each class's training images with a backbone pretrained on the other half (10,000 test images).
# ``task`` names the archive under the cache; ``img_size`` the side the plugin resizes to.
CELLS.update({
    "c10full_K10_a0.1_pre": dict(data="cifar10", task="cifar10full_task", clients=10, partition="hetero",
                                 alpha=0.1, backbone="cifar10_public_e30"),
    "c10half_K10_a0.1_pre": dict(data="cifar10", task="cifar10half_task", clients=10, partition="hetero",
                                 alpha=0.1, backbone="cifar10half_public_e30"),
    "c10full32_K10_a0.1_pre": dict(data="cifar10", task="cifar10full_task", clients=10, partition="hetero",
                                   alpha=0.1, backbone="cifar10_public32_e15", img_size=32),
})
TASK_FILES = {"digits": None, "mnist": "mnist_5k.npz", "cifar10": "cifar10_task.npz"}

BACKBONES = {  # public pretraining data, disjoint from the federated task
    "mnist_full": dict(npz="mnist_full.npz", epochs=2),
    "cifar10_public": dict(npz="cifar10_public.npz", epochs=5),
    "cifar10_public_e30": dict(npz="cifar10_public.npz", epochs=30),
    "cifar10half_public_e30": dict(npz="cifar10half_public.npz", epochs=30),
    "cifar10_public32_e15": dict(npz="cifar10_public.npz", epochs=15, img_size=32),
}


# ---------------------------------------------------------------------------------------------
# Data built once into the cache
# ---------------------------------------------------------------------------------------------
def _save_npz(path: Path, **arrays) -> None:
    import numpy as np
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def build_data() -> None:
    """The MNIST subset, MNIST in full, and the CIFAR-10 public/task split, under the cache."""
    import numpy as np
    data = CACHE / "data"
    if not (data / "mnist_5k.npz").exists() or not (data / "mnist_full.npz").exists():
        z = np.load(SHARED / "mnist.npz")
        rng = np.random.default_rng(0)
        tr = np.concatenate([rng.permutation(np.flatnonzero(z["y_train"] == c))[:500] for c in range(10)])
        te = np.concatenate([rng.permutation(np.flatnonzero(z["y_test"] == c))[:200] for c in range(10)])
        _save_npz(data / "mnist_5k.npz", x_train=z["x_train"][tr], y_train=z["y_train"][tr],
                  x_test=z["x_test"][te], y_test=z["y_test"][te])
        _save_npz(data / "mnist_full.npz", **{k: z[k] for k in ("x_train", "y_train", "x_test", "y_test")})
    if not (data / "cifar10_task.npz").exists() or not (data / "cifar10_public.npz").exists():
        small = np.load(SHARED / "cifar10_small.npz")
        keep_tr, keep_te = small["y_train"] >= 5, small["y_test"] >= 5
        _save_npz(data / "cifar10_task.npz", x_train=small["x_train"][keep_tr], y_train=small["y_train"][keep_tr] - 5,
                  x_test=small["x_test"][keep_te], y_test=small["y_test"][keep_te] - 5)
        full = data / "cifar10_full.npz"
        if not full.exists():
            import subprocess
            subprocess.run([sys.executable, str(SHARED / "build_cifar10.py"), str(full)], check=True)
        z = np.load(full)
        pub_tr, pub_te = z["y_train"] < 5, z["y_test"] < 5
        _save_npz(data / "cifar10_public.npz", x_train=z["x_train"][pub_tr], y_train=z["y_train"][pub_tr],
                  x_test=z["x_test"][pub_te], y_test=z["y_test"][pub_te])
    if not (data / "cifar10full_task.npz").exists() or not (data / "cifar10half_task.npz").exists():
        z = np.load(data / "cifar10_full.npz")
        task_tr, task_te = z["y_train"] >= 5, z["y_test"] >= 5
        _save_npz(data / "cifar10full_task.npz", x_train=z["x_train"][task_tr], y_train=z["y_train"][task_tr] - 5,
                  x_test=z["x_test"][task_te], y_test=z["y_test"][task_te] - 5)
        rng = np.random.default_rng(11)
        public = np.zeros(len(z["y_train"]), dtype=bool)
        for c in range(10):
            idx = rng.permutation(np.flatnonzero(z["y_train"] == c))
            public[idx[:len(idx) // 2]] = True
        _save_npz(data / "cifar10half_public.npz", x_train=z["x_train"][public], y_train=z["y_train"][public],
                  x_test=z["x_test"], y_test=z["y_test"])
        _save_npz(data / "cifar10half_task.npz", x_train=z["x_train"][~public], y_train=z["y_train"][~public],
                  x_test=z["x_test"], y_test=z["y_test"])
    # validation archives: a fifth of each task's training images held out (stratified), the rest
    # for the clients; knobs are chosen on these (--split val), never on the test images
    from fedml_fedmitr.data import digits_arrays
    x_tr, y_tr, _, _ = digits_arrays(0, 0.2)
    sources = {"digits": (x_tr, y_tr)}
    for fam, name in (("mnist", "mnist_5k.npz"), ("cifar10", "cifar10_task.npz"),
                      ("cifar10full_task", "cifar10full_task.npz"), ("cifar10half_task", "cifar10half_task.npz")):
        if (data / f"{fam}_val.npz").exists():
            continue
        z = np.load(data / name)
        sources[fam] = (z["x_train"], z["y_train"])
    for fam, (x, y) in sources.items():
        out = data / f"{fam}_val.npz"
        if out.exists():
            continue
        rng = np.random.default_rng(7)
        held = np.zeros(len(y), dtype=bool)
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            held[idx[:len(idx) // 5]] = True
        _save_npz(out, x_train=x[~held], y_train=y[~held], x_test=x[held], y_test=y[held])


def cell_args(cell: Dict[str, Any], seed: int, split: str = "test") -> SimpleNamespace:
    """FedML-style args of one cell: what the YAML sections of the same run would hold. With
    ``split="val"`` the clients get four fifths of the training images and the rest is the
    evaluation set (the validation split on which knobs are chosen)."""
    fam = cell["data"]
    task = cell.get("task")
    args = dict(dataset="digits" if fam == "digits" and split == "test" else "npz", random_seed=seed, model="fedmitr_vit_micro",
                img_size=cell.get("img_size", 16), patch_size=4, client_num_in_total=cell["clients"],
                client_num_per_round=cell["clients"], partition_method=cell["partition"],
                partition_alpha=cell.get("alpha", 0.5), classes_per_client=cell.get("classes_per_client", 2),
                client_optimizer="adamw", weight_decay=0.05, data_cache_dir=str(CACHE / "data"))
    if split == "val":
        args["npz_path"] = str(CACHE / "data" / f"{task or fam}_val.npz")
    elif fam != "digits":
        args["npz_path"] = str(CACHE / "data" / (f"{task}.npz" if task else TASK_FILES[fam]))
    args.update(CLIENT[fam])
    if cell.get("backbone"):
        args["pretrained_path"] = str(CACHE / "backbones" / f"{cell['backbone']}.pt")
    return SimpleNamespace(**args)


# ---------------------------------------------------------------------------------------------
# Worker side (torch is imported here only)
# ---------------------------------------------------------------------------------------------
def _init_worker(threads: int) -> None:
    import torch
    torch.set_num_threads(threads)


def pretrain_backbone(name: str) -> Dict[str, Any]:
    """A micro ViT trained on a public archive (all of its classes), cached."""
    import torch

    from fedml_fedmitr.core.client import train_local
    from fedml_fedmitr.core.evaluate import evaluate_model
    from fedml_fedmitr.data import load_data
    from fedml_fedmitr.fedml_adapter.config import client_train_config
    from fedml_fedmitr.fedml_adapter.model import create_model

    path = CACHE / "backbones" / f"{name}.pt"
    meta_path = path.with_suffix(".json")
    if path.exists() and meta_path.exists():
        return json.loads(meta_path.read_text())
    spec = BACKBONES[name]
    fam = "mnist" if name.startswith("mnist") else "cifar10"
    args = SimpleNamespace(dataset="npz", npz_path=str(CACHE / "data" / spec["npz"]), random_seed=1234,
                           model="fedmitr_vit_micro", img_size=spec.get("img_size", 16), patch_size=4, client_num_in_total=1,
                           client_num_per_round=1, partition_method="homo", client_optimizer="adamw",
                           weight_decay=0.05, **dict(CLIENT[fam], epochs=spec["epochs"], batch_size=128))
    dataset, n = load_data(args)
    model = create_model(args, n)
    t = time.perf_counter()
    train_local(model, dataset[2], client_train_config(args), torch.device("cpu"))
    acc = evaluate_model(model, dataset[3], torch.device("cpu"), n)["acc"]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": model.state_dict()}, str(path.with_suffix(".tmp")))
    os.replace(path.with_suffix(".tmp"), path)
    meta = {"backbone": name, "train_images": int(dataset[0]), "epochs": spec["epochs"], "test_acc": acc,
            "train_s": time.perf_counter() - t}
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


def _clients(cell_name: str, split: str, seed: int, args, dataset, n, device):
    """Train (or load) the cell's client uploads for ``seed``."""
    import torch

    from fedml_fedmitr.core.client import train_client
    from fedml_fedmitr.core.methods import ClientUpload
    from fedml_fedmitr.fedml_adapter.config import client_train_config
    from fedml_fedmitr.fedml_adapter.model import create_model

    path = CACHE / "clients" / f"{cell_name}_{split}_s{seed}.pt"
    if path.exists():
        blob = torch.load(str(path), map_location="cpu", weights_only=True)
        return [ClientUpload.from_payload(p) for p in blob["uploads"]], blob["init"], blob["train_s"]
    init = create_model(args, n).state_dict()
    cfg = client_train_config(args)
    uploads, t = [], time.perf_counter()
    for k in range(int(args.client_num_in_total)):
        model = create_model(args, n)
        torch.manual_seed(seed * 1000 + k)
        uploads.append(train_client(k, model, dataset[5][k], cfg, device, n))
    train_s = time.perf_counter() - t
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"uploads": [u.to_payload() for u in uploads], "init": init, "train_s": train_s},
               str(path.with_suffix(".tmp")))
    os.replace(path.with_suffix(".tmp"), path)
    return uploads, init, train_s


def _predictions(fn, loader, device):
    import torch
    preds, ys = [], []
    with torch.no_grad():
        for x, y in loader:
            preds.append(fn(x.to(device)).argmax(1).cpu())
            ys.append(y)
    return torch.cat(preds), torch.cat(ys)


def environment(jobs: int, threads: int) -> Dict[str, Any]:
    """What the clients' training depends on beyond the seed: the same seed gives the same uploads on CPU
    only with the same library versions and threads per process (a rebuilt cache elsewhere may differ)."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for pkg in ("torch", "torchvision", "timm", "numpy", "scikit-learn", "fedml"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    return {"python": sys.version.split()[0], "packages": versions, "jobs": jobs, "threads_per_job": threads}


def core_version() -> str:
    """A hash of the core's source: a method record computed by other code is not reused."""
    h = hashlib.sha256()
    for f in sorted((ROOT / "fedml_fedmitr" / "core").rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def cell_setup(cell_name: str, seed: int, split: str, device) -> SimpleNamespace:
    """One (cell, seed, split): its FedML-style args, data, client uploads (trained or cached, with
    their feature statistics) and model factory; what every method of the cell runs on."""
    from fedml_fedmitr.data import load_data
    from fedml_fedmitr.fedml_adapter.config import client_train_config
    from fedml_fedmitr.fedml_adapter.model import create_model

    from fedbench.jobs import fill_feature_stats

    args = cell_args(CELLS[cell_name], seed, split)
    dataset, n = load_data(args)
    uploads, init, train_s = _clients(cell_name, split, seed, args, dataset, n, device)

    def model_fn():
        m = create_model(args, n)
        m.load_state_dict(init)
        return m

    fill_feature_stats(uploads, model_fn, dataset[5], device)   # uploads cached before clients sent them
    return SimpleNamespace(args=args, dataset=dataset, num_classes=n, info=args.fedmitr_data_info,
                           uploads=uploads, init=init, train_s=train_s, model_fn=model_fn,
                           client_train=client_train_config(args))


def run_cell_seed(cell_name: str, seed: int, overrides: Dict[str, Any], methods: Sequence[str],
                  split: str = "test", cached_only: bool = False) -> Dict[str, Any]:
    """Clients, then every method on the same uploads; returns the record of (cell, seed)."""
    import torch

    from fedml_fedmitr.core.config import FedMITRConfig
    from fedml_fedmitr.core.ensemble import Ensemble
    from fedml_fedmitr.core.evaluate import evaluate_model
    from fedml_fedmitr.core.methods import ServerContext, get_method
    from fedml_fedmitr.fedml_adapter.model import create_model

    from fedbench.jobs import MEAN_ENSEMBLE
    from fedbench.references import CurveRecorder, attention_probe, probe_k, real_images, real_pool_method

    device = torch.device("cpu")
    cell = CELLS[cell_name]
    setup = cell_setup(cell_name, seed, split, device)
    args, dataset, n, info = setup.args, setup.dataset, setup.num_classes, setup.info
    uploads, init, train_s, model_fn, client_train = (setup.uploads, setup.init, setup.train_s, setup.model_fn,
                                                      setup.client_train)
    test = dataset[3]
    client_acc = []
    for u in uploads:
        m = model_fn()
        m.load_state_dict(u.state_dict)
        client_acc.append(evaluate_model(m, test, device, n)["acc"])
    ens = Ensemble.from_uploads(uploads, model_fn, n, FedMITRConfig(**MEAN_ENSEMBLE), device)
    ens_pred, y_test = _predictions(ens, test, device)
    ens_correct = sorted(set(int(c) for c in ens_pred[ens_pred == y_test].tolist()))
    record: Dict[str, Any] = {
        "cell": cell_name, "seed": seed, "client_acc": client_acc, "clients_train_s": train_s,
        "ensemble_acc": float((ens_pred == y_test).float().mean()), "ensemble_correct_classes": ens_correct,
        "num_test": int(len(y_test)),
        "client_label_counts": info.client_label_counts, "methods": {}}

    from fedml_fedmitr.core.config import FedMITRConfig as _Cfg
    grid = create_model(args, n).patch_embed.grid_size
    k = probe_k(_Cfg.from_dict(dict(BUDGET, **overrides), where="robustness"), grid[0] * grid[1])
    record["attention_probe"] = attention_probe(ens, test, k, seed)

    for name in methods:
        key_cfg = dict(BUDGET, **overrides, progress=False, save_images=False)
        cache_key = hashlib.sha256(json.dumps([cell_name, split, seed, name, key_cfg, core_version()], sort_keys=True).encode()).hexdigest()[:16]
        cpath = CACHE / "records" / f"{cell_name}_{split}_s{seed}_{name}_{cache_key}.json"
        if cpath.exists():
            record["methods"][name] = json.loads(cpath.read_text())
            continue
        if cached_only:
            continue
        cfg = FedMITRConfig.from_dict(dict(key_cfg, eval_every=1), where="robustness")
        rec = CurveRecorder()
        ctx = ServerContext(model_fn=model_fn, num_classes=n, input_shape=info.input_shape, mean=info.mean,
                            std=info.std, device=device, eval_loader=test, callbacks=rec, seed=seed,
                            pretrained_state=init if cell.get("backbone") else None,
                            client_augment=client_train.augment, client_flip=client_train.flip)
        if name in REFERENCES:
            method = real_pool_method(REFERENCES[name], real_images(dataset[2].dataset, cfg.num_synthetic, seed))(cfg)
        else:
            method = get_method(name)(cfg)
        seen = {}
        if hasattr(method, "distill"):
            plain = method.distill

            def distill(pool, c, plain=plain, seen=seen, method=method):
                seen["start"] = evaluate_model(method.student, test, device, n)["acc"]
                return plain(pool, c)

            method.distill = distill
        t = time.perf_counter()
        result = method.run(uploads, ctx)
        m = result.metrics
        pred, _ = _predictions(result.model, test, device)
        covered = sorted(set(int(c) for c in pred.tolist()))
        # the method's own teacher (its ensemble settings), and the classes it gets right at least once
        teacher = Ensemble.from_uploads(uploads, model_fn, n, method.config, device)
        t_pred, _ = _predictions(teacher, test, device)
        teacher_correct = sorted(set(int(c) for c in t_pred[t_pred == y_test].tolist()))
        out = {"test_acc": m["test_acc"], "start_acc": seen.get("start", m["test_acc"]),
               "teacher_acc": float((t_pred == y_test).float().mean()), "teacher_correct_classes": teacher_correct,
               "curve": rec.curve, "per_class_acc": m.get("per_class_acc"),
               "predicted_classes": covered,
               "collapsed": any(c not in covered for c in teacher_correct),
               "synthesis_s": m["timings"].get("synthesis_s"), "distill_s": m["timings"].get("distill_s"),
               "total_s": time.perf_counter() - t}
        pool = m.get("pool")          # FedMITR's own measurements of its pool (core/pool_stats.py)
        if pool:
            out["pool_fit"] = pool["fit"]
            out["pool_pred_balance"] = pool["ensemble_pred"]
            if pool["background_pred"] is not None:
                out["background_pred_balance"] = pool["background_pred"]
                out["background_fit"] = pool["background_fit"]
            out["foreground_tokens"] = pool["foreground_tokens"]
            out["student_pool_agreement"] = pool["student_agreement"]
            out["pool_confidence"] = pool["ensemble_confidence"]
            out["kd_temperature"] = m.get("kd_temperature")
            out["student_pool_pred_balance"] = pool["student_pred"]
        cpath.parent.mkdir(parents=True, exist_ok=True)
        cpath.write_text(json.dumps(out))
        record["methods"][name] = out
    return record


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _mean(v: Sequence[float]) -> float:
    return sum(v) / len(v)


def summarise(records: List[Dict[str, Any]], cells: Sequence[str], seeds: Sequence[int],
              methods: Sequence[str]) -> Dict[str, Any]:
    by = {(r["cell"], r["seed"]): r for r in records}
    out = {}
    for c in cells:
        rs = [by[(c, s)] for s in seeds if (c, s) in by]
        if not rs:
            continue
        row = {"seeds": [r["seed"] for r in rs], "ensemble_acc": _mean([r["ensemble_acc"] for r in rs]),
               "ensemble_per_seed": [r["ensemble_acc"] for r in rs],
               "client_acc_mean": _mean([_mean(r["client_acc"]) for r in rs]), "methods": {}}
        probes = [r["attention_probe"] for r in rs if "attention_probe" in r]
        if probes:
            row["attention_probe"] = dict({key: _mean([p[key] for p in probes])
                                           for key in ("top_k", "random_k", "bottom_k")},
                                          k=probes[0]["k"], num_patches=probes[0]["num_patches"],
                                          top_minus_random=paired([p["top_k"] - p["random_k"] for p in probes]))
        for m in methods:
            pairs = [(r, r["methods"][m]) for r in rs if m in r["methods"]]
            if not pairs:
                continue
            vals = [v for _, v in pairs]
            row["methods"][m] = {"test_acc": _mean([v["test_acc"] for v in vals]),
                                 "teacher_acc": _mean([v.get("teacher_acc", r["ensemble_acc"]) for r, v in pairs]),
                                 "per_seed": [v["test_acc"] for v in vals],
                                 "seeds": [r["seed"] for r, _ in pairs],
                                 "start_acc": _mean([v["start_acc"] for v in vals]),
                                 "collapsed_seeds": [r["seed"] for r, v in pairs if v["collapsed"]],
                                 "pool_fit": _mean([v["pool_fit"] for v in vals]) if "pool_fit" in vals[0] else None}
        row["num_test"] = rs[0].get("num_test")
        row["references"] = {key: {"test_acc": row["methods"][m]["test_acc"], "test_acc_per_seed": row["methods"][m]["per_seed"]}
                             for key, m in (("kd_real", "KD-real"), ("kd_real_plain", "KD-real-plain"))
                             if m in row["methods"]}
        if "attention_probe" in row:
            row["references"]["attention_probe"] = row["attention_probe"]
        f = row["methods"].get("FedMITR")
        if f:
            row["paired_vs_fedmitr"] = {}
            for m in methods:
                if m == "FedMITR" or m not in row["methods"]:
                    continue
                diffs = [r["methods"]["FedMITR"]["test_acc"] - r["methods"][m]["test_acc"] for r in rs
                         if m in r["methods"] and "FedMITR" in r["methods"]]
                row["paired_vs_fedmitr"][m] = paired(diffs)
            # against FedMITR's own teacher: the ensemble of its ensemble_weighting
            row["conditions"] = {"ratio_to_ensemble": f["test_acc"] / max(f["teacher_acc"], 1e-9),
                                 "at_least_0.9_ensemble": f["test_acc"] >= 0.9 * f["teacher_acc"],
                                 "not_below_start": f["test_acc"] >= f["start_acc"],
                                 "no_collapse": not f["collapsed_seeds"]}
            row["conditions"]["all"] = all(v for k, v in row["conditions"].items() if k != "ratio_to_ensemble")
        out[c] = row
    return out


def markdown(summary: Dict[str, Any], settings: Dict[str, Any]) -> str:
    methods = settings["methods"]
    lines = [f"# FedMITR defaults: robustness matrix ({settings['name']})", "",
             f"Command: `{settings['command']}`", "",
             f"Server budget: {settings['budget']}; overrides: {settings['overrides'] or 'none (defaults)'}; "
             f"evaluated on the {'validation split' if settings['split'] == 'val' else 'test set'}.",
             "Accuracies in %, mean over seeds (per seed after it). Start = one-shot FedAvg of the same uploads "
             "(FedMITR's student initialisation).", "",
             "Ensemble: the mean of the client logits; teacher: FedMITR's own ensemble (its `ensemble_weighting` and `ensemble_calibration`), "
             "the one the conditions compare with. Collapsed: the global model never predicts a class the "
             "teacher gets right at least once.", "",
             "| cell | seeds | ensemble | teacher | " + " | ".join(methods) + " | FedMITR / teacher | >= start | no collapse | all |",
             "|---|---|---:|---:|" + "---:|" * len(methods) + "---:|:-:|:-:|:-:|"]
    for c, row in summary.items():
        cells = []
        for m in methods:
            v = row["methods"].get(m)
            cells.append("-" if v is None else f"{100 * v['test_acc']:.1f} ({' / '.join(f'{100 * a:.0f}' for a in v['per_seed'])})"
                         + ("" if len(v["seeds"]) == len(row["seeds"]) else f" [seeds {', '.join(map(str, v['seeds']))}]"))
        cond = row.get("conditions")
        tail = ["-"] * 4 if not cond else [f"{cond['ratio_to_ensemble']:.2f}", "yes" if cond["not_below_start"] else "NO",
                                            "yes" if cond["no_collapse"] else "NO", "yes" if cond["all"] else "NO"]
        f = row["methods"].get("FedMITR")
        teacher = f"{100 * f['teacher_acc']:.1f}" if f else "-"
        lines.append(f"| {c} | {len(row['seeds'])} | {100 * row['ensemble_acc']:.1f} | {teacher} | " + " | ".join(cells) + " | "
                     + " | ".join(tail) + " |")
    others = [m for m in methods if m != "FedMITR"]
    if "FedMITR" in methods and others:
        lines += ["", "Paired differences, FedMITR minus each method, accuracy points: mean over the seeds both ran "
                  "[95% interval, t distribution]; an order holds only where the interval excludes 0.", "",
                  "| cell | " + " | ".join(f"FedMITR - {m}" for m in others) + " |",
                  "|---|" + "---:|" * len(others)]
        for c, row in summary.items():
            vals = [fmt_paired(row.get("paired_vs_fedmitr", {}).get(m)) for m in others]
            lines.append(f"| {c} | " + " | ".join(vals) + " |")
    probed = {c: row["attention_probe"] for c, row in summary.items() if "attention_probe" in row}
    if probed:
        lines += ["", "Attention probe: the ensemble's accuracy on the test images seen through only k patches "
                  "(k = what FedMITR keeps), chosen by its last-block CLS attention (top), at random, or the "
                  "lowest (bottom); top - random is paired by seed [95% interval].", "",
                  "| cell | k / patches | top-k | random-k | bottom-k | top - random |", "|---|---:|---:|---:|---:|---:|"]
        for c, pr in probed.items():
            lines.append(f"| {c} | {pr['k']} / {pr['num_patches']} | {100 * pr['top_k']:.1f} | {100 * pr['random_k']:.1f} | "
                         f"{100 * pr['bottom_k']:.1f} | {fmt_paired(pr['top_minus_random'])} |")
    return "\n".join(lines) + "\n"


def plot_curves(summary: Dict[str, Any], records: List[Dict[str, Any]], out_dir: Path) -> List[str]:
    """One picture per cell: test accuracy per distillation epoch (epoch 0 = the start) of every distilled
    method, mean over seeds, with the teacher and the FedAvg start as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for cell, row in summary.items():
        curves: Dict[str, List[List[float]]] = {}
        for r in records:
            if r["cell"] != cell:
                continue
            for m, v in r["methods"].items():
                if v.get("curve"):
                    curves.setdefault(m, []).append([v["start_acc"]] + list(v["curve"]))
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for m, cs in curves.items():
            n = min(len(c) for c in cs)
            mean = [100 * sum(c[i] for c in cs) / len(cs) for i in range(n)]
            ax.plot(range(n), mean, label=f"{m} ({len(cs)} seeds)")
        ax.axhline(100 * row["ensemble_acc"], color="k", ls="--", lw=0.8, label="ensemble")
        ax.set_xlabel("distillation epoch (0 = start)")
        ax.set_ylabel("test accuracy %")
        ax.set_title(cell, fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{cell}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(str(path.relative_to(ROOT)))
    return written


def parse_set(items: Sequence[str]) -> Dict[str, Any]:
    import yaml
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE (a fedmitr_args key)")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def _command(argv: Optional[Sequence[str]]) -> str:
    """The command line a result file records (the script's own arguments)."""
    return "python benchmarks/robustness.py " + " ".join(argv if argv is not None else sys.argv[1:])


def write_report(a, settings, summary, records, tail: str = "") -> int:
    """``results/<name>.json`` and ``.md`` (and, with ``--plots``, the learning curves)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps({"settings": settings, "summary": summary, "records": records},
                                                       indent=1))
    md = markdown(summary, settings)
    if a.plots:
        pics = plot_curves(summary, records, RESULTS / f"{a.name}_curves")
        md += "\nLearning curves (test accuracy per distillation epoch, mean over seeds): " + ", ".join(
            f"`{p}`" for p in pics) + "\n"
    md += tail
    (RESULTS / f"{a.name}.md").write_text(md)
    print(md)
    return 0


def merge_source(item: str):
    """``NAME`` (every record of benchmarks/results/NAME.json) or ``NAME:S1,S2`` (only those seeds)."""
    if ":" not in item:
        return item, None
    name, seeds = item.split(":", 1)
    parts = [x.strip() for x in seeds.split(",") if x.strip()]
    if not parts or not all(x.isdigit() for x in parts):
        raise SystemExit(f"--merge {item!r}: expected NAME or NAME:SEEDS with SEEDS a comma-separated list of integers")
    return name, {int(x) for x in parts}


def _source_text(source: Dict[str, Any]) -> str:
    """One merged-from entry of a report: the command, and the seeds taken where not all."""
    seeds = "" if source["seeds"] is None else f" (seeds {', '.join(map(str, source['seeds']))})"
    return f"`{source['command']}`{seeds}"


def merge_records(items: Sequence[str]):
    """The records of several results (``NAME`` or ``NAME:SEEDS``), the methods of each (cell, seed)
    joined, and where each came from. Two results holding different uploads of one (cell, seed) (their
    client accuracies differ) are refused: their methods ran on different clients."""
    merged: Dict[Any, Dict[str, Any]] = {}
    origin: Dict[Any, str] = {}
    sources = []
    for item in items:
        name, only = merge_source(item)
        blob = json.loads((RESULTS / f"{name}.json").read_text())
        sources.append({"name": name, "command": blob["settings"]["command"],
                        "seeds": None if only is None else sorted(only)})
        for r in blob["records"]:
            key = (r["cell"], r["seed"])
            if only is not None and r["seed"] not in only:
                continue
            if key not in merged:
                merged[key] = dict(r, methods=dict(r["methods"]))
                origin[key] = name
            elif merged[key]["client_acc"] != r["client_acc"]:
                raise SystemExit(f"--merge: cell {key[0]} seed {key[1]} holds different client uploads in {origin[key]} "
                                 f"and {name} (client accuracies {merged[key]['client_acc']} vs {r['client_acc']}): "
                                 f"trained on different caches (settings.environment); take each seed from one of "
                                 f"them (NAME:SEEDS, e.g. {name}:{key[1]})")
            else:
                merged[key]["methods"].update(r["methods"])
            if "attention_probe" in r:
                merged[key]["attention_probe"] = r["attention_probe"]
    records = sorted(merged.values(), key=lambda r: (list(CELLS).index(r["cell"]), r["seed"]))
    return records, sources


def merge_results(a, argv) -> int:
    """One report from the records of several result files (e.g. a method run on fewer seeds)."""
    records, sources = merge_records(a.merge)
    cells = [c for c in CELLS if any(r["cell"] == c for r in records)]
    seeds = sorted({r["seed"] for r in records})
    methods = [m for m in METHODS if any(m in r["methods"] for r in records)]
    summary = summarise(records, cells, seeds, methods)
    first = json.loads((RESULTS / f"{merge_source(a.merge[0])[0]}.json").read_text())["settings"]
    settings = dict(first, name=a.name, methods=methods, seeds=seeds, merged_from=sources,
                    command=_command(argv))
    return write_report(a, settings, summary, records,
                        "\nMerged from: " + "; ".join(_source_text(s) for s in sources) + "\n")


def change_table(base: Dict[str, Any], other: Dict[str, Any], method: str = "FedMITR") -> Dict[str, Any]:
    """``method`` in ``other`` minus the same method in ``base``, paired by (cell, seed), per cell and
    over every pair. The two results must hold the same uploads (the same client accuracies on each
    pair): a change is only measured on the same clients."""
    def index(blob, name):
        out = {}
        for r in blob["records"]:
            if method in r["methods"]:
                out[(r["cell"], r["seed"])] = r
        if not out:
            raise SystemExit(f"--change: {name} holds no {method} record")
        return out
    b, o = index(base, base["settings"]["name"]), index(other, other["settings"]["name"])
    pairs = [k for k in b if k in o]
    if not pairs:
        raise SystemExit(f"--change: {base['settings']['name']} and {other['settings']['name']} share no (cell, seed)")
    for k in pairs:
        if b[k]["client_acc"] != o[k]["client_acc"]:
            raise SystemExit(f"--change: cell {k[0]} seed {k[1]} holds different client uploads in the two results "
                             f"(client accuracies {b[k]['client_acc']} vs {o[k]['client_acc']}): the uploads were trained "
                             f"on different caches (another environment or thread count, settings.environment); "
                             f"rerun both on one cache")
    cells = [c for c in CELLS if any(k[0] == c for k in pairs)]
    rows, diffs = {}, []
    for c in cells:
        ks = sorted(k for k in pairs if k[0] == c)
        rb = [b[k]["methods"][method] for k in ks]
        ro = [o[k]["methods"][method] for k in ks]
        d = [x["test_acc"] - y["test_acc"] for x, y in zip(ro, rb)]
        diffs += d
        rows[c] = {"seeds": [k[1] for k in ks], "base": _mean([r["test_acc"] for r in rb]),
                   "other": _mean([r["test_acc"] for r in ro]), "teacher_base": _mean([r["teacher_acc"] for r in rb]),
                   "teacher_other": _mean([r["teacher_acc"] for r in ro]),
                   "base_collapsed_seeds": [k[1] for k, r in zip(ks, rb) if r.get("collapsed")],
                   "other_collapsed_seeds": [k[1] for k, r in zip(ks, ro) if r.get("collapsed")],
                   "change": paired(d)}
    cell_means = [r["change"]["mean_diff"] for r in rows.values()]
    return {"method": method, "base": base["settings"]["name"], "other": other["settings"]["name"],
            "split": base["settings"].get("split", "test"),
            "base_overrides": base["settings"].get("overrides", {}), "other_overrides": other["settings"].get("overrides", {}),
            "cells": rows, "all_pairs": paired(diffs), "cells_up": sum(d > 0 for d in cell_means),
            "cells_down": sum(d < 0 for d in cell_means)}


def change_markdown(t: Dict[str, Any], command: str) -> str:
    m = t["method"]
    lines = [f"# {m}: {t['other']} minus {t['base']}, on the same uploads", "", f"Command: `{command}`", "",
             f"Overrides: {t['base']} {t['base_overrides'] or 'none (defaults)'}; {t['other']} "
             f"{t['other_overrides'] or 'none (defaults)'}. Accuracy % on the {t['split']} split, mean over seeds; "
             f"the change is paired by seed, in points [95% interval, t distribution]; collapsed: seeds whose global model never "
             f"predicts a class its teacher gets right at least once.", "",
             f"| cell | seeds | teacher ({t['base']} / {t['other']}) | {m}, {t['base']} | {m}, {t['other']} | change | "
             f"collapsed seeds ({t['base']} / {t['other']}) |", "|---|---:|---:|---:|---:|---:|---|"]
    for c, r in t["cells"].items():
        col = " / ".join(", ".join(map(str, s)) or "none" for s in (r["base_collapsed_seeds"], r["other_collapsed_seeds"]))
        per = " / ".join(f"{v:+.1f}" for v in r["change"]["per_seed"])
        lines.append(f"| {c} | {len(r['seeds'])} | {100 * r['teacher_base']:.1f} / {100 * r['teacher_other']:.1f} | "
                     f"{100 * r['base']:.1f} | {100 * r['other']:.1f} | {fmt_paired(r['change'])} ({per}) | {col} |")
    n = len(t["all_pairs"]["per_seed"])
    lines += ["", f"Over all {n} (cell, seed) pairs: {fmt_paired(t['all_pairs'])}; the cell mean rises in {t['cells_up']} "
              f"of {len(t['cells'])} cells and falls in {t['cells_down']}."]
    return "\n".join(lines) + "\n"


def change_results(a, argv) -> int:
    """``--change BASE OTHER``: one method's paired change between two results on the same uploads."""
    blobs = []
    for name in a.change:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            raise SystemExit(f"--change: no result {name}.json in benchmarks/results (expected the --name of a "
                             "robustness.py result)")
        blobs.append(json.loads(path.read_text()))
    table = change_table(blobs[0], blobs[1], a.change_method)
    command = _command(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps(dict(table, command=command), indent=1))
    md = change_markdown(table, command)
    (RESULTS / f"{a.name}.md").write_text(md)
    print(md)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", nargs="+", default=MATRIX, choices=list(CELLS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="fedmitr_args overrides")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per job")
    p.add_argument("--name", default="robust_defaults")
    p.add_argument("--cached-only", action="store_true",
                   help="report the method records already computed; compute nothing new (e.g. a method run "
                        "on fewer seeds than the others)")
    p.add_argument("--merge", nargs="+", metavar="NAME",
                   help="write --name from the records of these earlier results (benchmarks/results/NAME.json, "
                        "or NAME:0,2 for only those seeds), the methods of each (cell, seed) joined (refused where "
                        "two hold different uploads of one (cell, seed)); runs nothing")
    p.add_argument("--change", nargs=2, metavar=("BASE", "OTHER"),
                   help="write --name: the paired change of --change-method from result BASE to result OTHER "
                        "(benchmarks/results/NAME.json, the same uploads), per cell and over all pairs; runs nothing")
    p.add_argument("--change-method", default="FedMITR", help="the method --change compares (default FedMITR)")
    p.add_argument("--plots", action="store_true",
                   help="also draw each cell's learning curves into benchmarks/results/NAME_curves/")
    p.add_argument("--split", choices=["test", "val"], default="test",
                   help="evaluate on the test images, or on a validation split held out of the training images")
    a = p.parse_args(argv)
    overrides = parse_set(a.set)
    if a.merge:
        return merge_results(a, argv)
    if a.change:
        if a.name == "robust_defaults":
            raise SystemExit("--change: give the report its own --name (robust_defaults is the defaults' matrix)")
        return change_results(a, argv)
    from fedml_fedmitr.core.config import FedMITRConfig
    FedMITRConfig.from_dict(dict(BUDGET, **overrides), where="--set")   # fail before any work
    build_data()
    needed = sorted({CELLS[c]["backbone"] for c in a.cells if CELLS[c].get("backbone")})
    t0 = time.perf_counter()
    backbones = {}
    with ProcessPoolExecutor(max_workers=a.jobs, initializer=_init_worker, initargs=(a.threads,)) as pool:
        for b, meta in zip(needed, pool.map(pretrain_backbone, needed)):
            backbones[b] = meta
            print(f"backbone {b}: {meta['train_images']} public images, test acc {meta['test_acc']:.3f}", flush=True)
        futures = {pool.submit(run_cell_seed, c, s, overrides, a.methods, a.split, a.cached_only): (c, s) for s in a.seeds for c in a.cells}
        records = []
        for fut in as_completed(futures):
            try:
                r = fut.result()
            except Exception as exc:   # one failed (cell, seed) is reported, the others go on
                c, s = futures[fut]
                print(f"FAILED {c} seed {s}: {type(exc).__name__}: {exc}", flush=True)
                continue
            records.append(r)
            ms = ", ".join(f"{k} {100 * v['test_acc']:.1f}" for k, v in r["methods"].items())
            print(f"[{time.perf_counter() - t0:6.0f} s] {r['cell']} seed {r['seed']}: ensemble "
                  f"{100 * r['ensemble_acc']:.1f}, {ms}", flush=True)
    records.sort(key=lambda r: (a.cells.index(r["cell"]), r["seed"]))
    summary = summarise(records, a.cells, a.seeds, a.methods)
    settings = {"name": a.name, "command": _command(argv),
                "budget": BUDGET, "overrides": overrides, "split": a.split, "methods": a.methods, "seeds": a.seeds,
                "cells": {c: CELLS[c] for c in a.cells}, "client_training": CLIENT, "backbones": backbones,
                "defaults": FedMITRConfig().to_dict(), "environment": environment(a.jobs, a.threads),
                "wall_s": time.perf_counter() - t0}
    return write_report(a, settings, summary, records)


if __name__ == "__main__":
    sys.exit(main())
