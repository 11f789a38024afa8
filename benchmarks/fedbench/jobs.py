"""What a child process of the benchmark runs (torch lives here): pretraining the backbone, the K
clients of a seed, the central reference, one server method or reference row on one seed.

``python benchmarks/compare.py --worker JOB.json`` calls :func:`worker_main`, which writes the job's
record (JSON) where the parent reads it.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from .settings import REAL_REFERENCES
from .store import write_json_atomic
from .tasks import load_public, load_task

# the benchmarks' reference ensemble: the plain mean of the client logits (not the defaults' teacher)
MEAN_ENSEMBLE = {"ensemble_weighting": "mean", "ensemble_calibration": "none"}

def _peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def speed_probe(model_fn, input_shape, device, batch: int = 64, repeats: int = 9) -> float:
    """Seconds of one forward and backward pass of a fresh student on a fixed random batch (the fastest
    of ``repeats``, the least disturbed by a job beside it): how fast this machine runs the benchmark's
    model, with this process's threads. The time budget compares it between the records it combines (``compare.time_budget_jobs``).
    The RNG state is restored, so the method that follows draws what it would have drawn."""
    import torch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_fn().to(device)
        x = torch.randn(batch, *input_shape, device=device)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            model(x).float().logsumexp(1).mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
    return min(times)


def build_model(settings: Dict[str, Any], num_classes: int, pretrained_path: Optional[str] = None,
                timm_pretrained: bool = False):
    from fedml_fedmitr.core.models import create_vit
    m = settings["model"]
    return create_vit(m["name"], img_size=m["img_size"], num_classes=num_classes, in_chans=m["in_chans"],
                      patch_size=m["patch_size"], pretrained=timm_pretrained, pretrained_path=pretrained_path,
                      **m["kwargs"])


def shared_init(settings: Dict[str, Any], seed: int, backbone: Optional[str]) -> Tuple[Dict[str, Any], str]:
    """The clients' common starting weights for ``seed`` (and a description): random (scratch), or
    the backbone's body with a fresh classifier head seeded by ``seed``."""
    import torch
    torch.manual_seed(seed)
    n = settings["num_classes"]
    pre = settings.get("pretrain")
    if settings["backbone"] == "scratch":
        model, what = build_model(settings, n), f"random (seed {seed})"
    else:
        if pre["source"] == "timm":
            model = build_model(settings, n, timm_pretrained=True)
            what = f"timm's published weights of {settings['model']['name']}"
        else:
            path = pre["path"] if pre["source"] == "checkpoint" else backbone
            model = build_model(settings, n, pretrained_path=path)
            what = "the backbone"
        torch.manual_seed(seed)
        model.reset_classifier(n)
        what += f", fresh head (seed {seed})"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, what


def _client_cfg(settings):
    from fedml_fedmitr.core.config import ClientTrainConfig
    return ClientTrainConfig(**settings["client_train"])


def _cache(job: Dict[str, Any]) -> Path:
    return Path(job["cache"])


def job_pretrain(job: Dict[str, Any], device) -> Dict[str, Any]:
    import torch

    from fedml_fedmitr.core.client import train_local
    from fedml_fedmitr.core.evaluate import evaluate_model

    settings = job["settings"]
    pre = settings["pretrain"]
    cfg = _client_cfg(settings)
    cfg.epochs = int(pre["epochs"])
    dataset, n, info = load_public(settings, _cache(job), cfg.batch_size)
    torch.manual_seed(pre["seed"])
    model = build_model(settings, n)
    t = time.perf_counter()
    train_local(model, dataset[2], cfg, device)
    train_s = time.perf_counter() - t
    acc = evaluate_model(model, dataset[3], device, n)["acc"]
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    path = Path(job["checkpoint"])
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state, "meta": {"pretrain": {k: v for k, v in pre.items() if k != "npz"},
                                              "model": settings["model"], "num_classes": n,
                                              "public_test_acc": acc, "mean": info.mean, "std": info.std}},
               str(path.with_suffix(".tmp")))
    os.replace(path.with_suffix(".tmp"), path)
    print(f"pretrained backbone: {dataset[0]} public images, {cfg.epochs} epochs, "
          f"public test accuracy {acc:.3f}, {train_s:.0f} s -> {path}")
    return {"checkpoint": str(path), "public_train_images": int(dataset[0]), "public_test_acc": acc,
            "epochs": cfg.epochs, "train_s": train_s}


def _model_fn(settings, n, init):
    def model_fn():
        m = build_model(settings, n)
        m.load_state_dict(init)
        return m
    return model_fn


def fill_feature_stats(uploads, model_fn, loaders, device):
    """Uploads cached before clients sent feature statistics get them now, and their per-class ones (which
    a client sends only when asked, for ``feature_prior: per_class``), from their trained weights on their
    own shard (``loaders[client_id]``): what ``train_client`` computes after training."""
    from fedml_fedmitr.core.models import class_token_moments, token_moments

    for u in uploads:
        if u.feature_stats is None or u.class_feature_stats is None:
            m = model_fn()
            m.load_state_dict(u.state_dict)
            if u.feature_stats is None:
                u.feature_stats = token_moments(m, loaders[u.client_id], device)
            if u.class_feature_stats is None:
                u.class_feature_stats = class_token_moments(m, loaders[u.client_id], device, len(u.label_counts))
    return uploads


def load_uploads(payloads, model_fn, loaders, device):
    """Cached client uploads, with their feature statistics (:func:`fill_feature_stats`)."""
    from fedml_fedmitr.core.methods import ClientUpload

    return fill_feature_stats([ClientUpload.from_payload(p) for p in payloads], model_fn, loaders, device)


def job_clients(job: Dict[str, Any], device) -> Dict[str, Any]:
    """The K clients of a seed, each trained on its shard of the plugin's partition (and, for the
    log, the accuracy of their plain mean ensemble)."""
    import torch

    from fedml_fedmitr.core.client import train_client
    from fedml_fedmitr.core.config import FedMITRConfig
    from fedml_fedmitr.core.ensemble import Ensemble
    from fedml_fedmitr.core.evaluate import evaluate_ensemble, evaluate_model

    settings, seed = job["settings"], int(job["seed"])
    dataset, n, info = load_task(settings, seed, _cache(job))
    init, what = shared_init(settings, seed, job.get("backbone"))
    model_fn = _model_fn(settings, n, init)
    cfg = _client_cfg(settings)
    test = dataset[3]
    uploads, accs, times = [], [], []
    for k in range(settings["clients"]):
        torch.manual_seed(seed * 1000 + k)
        t = time.perf_counter()
        up = train_client(k, model_fn(), dataset[5][k], cfg, device, n)
        times.append(time.perf_counter() - t)
        m = model_fn()
        m.load_state_dict(up.state_dict)
        accs.append(evaluate_model(m, test, device, n)["acc"])
        uploads.append(up)
        print(f"client {k}: {up.num_samples} samples, labels {up.label_counts}, test acc {accs[-1]:.3f}, "
              f"{times[-1]:.0f} s", flush=True)
    ens = Ensemble.from_uploads(uploads, model_fn, n, FedMITRConfig(**MEAN_ENSEMBLE), device)
    ens_acc = evaluate_ensemble(ens, test, device, n)["acc"]
    path = Path(job["checkpoint"])
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"init_state": init, "uploads": [u.to_payload() for u in uploads], "client_acc": accs,
                "ensemble_acc": ens_acc}, str(path.with_suffix(".tmp")))
    os.replace(path.with_suffix(".tmp"), path)
    print(f"trained {len(uploads)} clients from {what}; mean-logit ensemble acc {ens_acc:.3f}")
    return {"checkpoint": str(path), "init": what, "client_acc": accs, "client_acc_mean": sum(accs) / len(accs),
            "mean_ensemble_acc": ens_acc, "client_samples": [u.num_samples for u in uploads],
            "client_label_counts": [u.label_counts for u in uploads], "client_train_s": times,
            "train_s": sum(times), "num_test": int(dataset[1]), "num_train": int(dataset[0]),
            "mean": info.mean, "std": info.std}


def job_ensemble(job: Dict[str, Any], device) -> Dict[str, Any]:
    """The teacher every method distils, as the server's knobs build it (``ensemble_weighting``,
    ``ensemble_aggregate``): its test accuracy and the attention probe (k = FedMITR's kept patches)."""
    import torch

    from fedml_fedmitr.core.config import FedMITRConfig
    from fedml_fedmitr.core.ensemble import Ensemble
    from fedml_fedmitr.core.evaluate import evaluate_ensemble

    from .references import attention_probe, probe_k

    settings, seed = job["settings"], int(job["seed"])
    dataset, n, _ = load_task(settings, seed, _cache(job))
    blob = torch.load(job["clients"], map_location="cpu", weights_only=True)
    model_fn = _model_fn(settings, n, blob["init_state"])
    uploads = load_uploads(blob["uploads"], model_fn, dataset[5], device)
    cfg = FedMITRConfig.from_dict(dict(settings["server"], progress=False), where="settings.server")
    ens = Ensemble.from_uploads(uploads, model_fn, n, cfg, device)
    acc = evaluate_ensemble(ens, dataset[3], device, n)["acc"]
    grid = model_fn().patch_embed.grid_size
    probe = attention_probe(ens, dataset[3], probe_k(cfg, grid[0] * grid[1]), seed)
    print(f"ensemble ({cfg.ensemble_weighting} weights, {cfg.ensemble_aggregate}) seed {seed}: test acc {acc:.3f}; "
          f"attention probe top/random/bottom-{probe['k']} of {probe['num_patches']}: {probe['top_k']:.3f} / "
          f"{probe['random_k']:.3f} / {probe['bottom_k']:.3f}")
    return {"test_acc": acc, "ensemble_acc": acc, "attention_probe": probe,
            "weighting": cfg.ensemble_weighting, "aggregate": cfg.ensemble_aggregate}


def job_central(job: Dict[str, Any], device) -> Dict[str, Any]:
    import torch

    from fedml_fedmitr.core.client import train_local
    from fedml_fedmitr.core.evaluate import evaluate_model

    settings, seed = job["settings"], int(job["seed"])
    dataset, n, _ = load_task(settings, seed, _cache(job))
    init, what = shared_init(settings, seed, job.get("backbone"))
    model = _model_fn(settings, n, init)()
    cfg = _client_cfg(settings)
    torch.manual_seed(seed * 1000 + 999)
    t = time.perf_counter()
    train_local(model, dataset[2], cfg, device, desc="central")
    train_s = time.perf_counter() - t
    acc = evaluate_model(model, dataset[3], device, n)["acc"]
    print(f"central model on all {dataset[0]} training images from {what}: test acc {acc:.3f}")
    return {"test_acc": acc, "train_s": train_s, "train_images": int(dataset[0])}


def job_method(job: Dict[str, Any], device) -> Dict[str, Any]:
    """One server method (or a KD-real reference) on the cached uploads of a seed, with its learning
    curve, its start (the student before distillation) and the ensemble queries it made."""
    import torch

    from fedml_fedmitr.core import ensemble as ensemble_module
    from fedml_fedmitr.core.config import FedMITRConfig
    from fedml_fedmitr.core.evaluate import evaluate_model
    from fedml_fedmitr.core.methods import ServerContext, get_method

    from .references import CurveRecorder, real_images, real_pool_method

    settings, seed, name = job["settings"], int(job["seed"]), job["method"]
    dataset, n, info = load_task(settings, seed, _cache(job))
    blob = torch.load(job["clients"], map_location="cpu", weights_only=True)
    init = blob["init_state"]
    model_fn = _model_fn(settings, n, init)
    uploads = load_uploads(blob["uploads"], model_fn, dataset[5], device)
    server = dict(settings["server"], **job.get("server_override", {}))
    cfg = FedMITRConfig.from_dict(dict(server, progress=False, save_images=False, eval_every=1),
                                  where="settings.server")
    recorder = CurveRecorder()
    client = _client_cfg(settings)
    ctx = ServerContext(model_fn=model_fn, num_classes=n, input_shape=info.input_shape, mean=info.mean,
                        std=info.std, device=device, eval_loader=dataset[3], state_dir=None,
                        callbacks=recorder, seed=seed,
                        pretrained_state=init if settings["backbone"] == "pretrained" else None,
                        client_augment=client.augment, client_flip=client.flip)
    # count the images each method passes through the ensemble (the test evaluation excluded)
    counter = {"on": True, "n": 0}
    original = ensemble_module.Ensemble.client_logits

    def counted(self, x, *a, **kw):
        if counter["on"]:
            counter["n"] += int(x.shape[0])
        return original(self, x, *a, **kw)

    ensemble_module.Ensemble.client_logits = counted
    if name in REAL_REFERENCES:
        method = real_pool_method(REAL_REFERENCES[name], real_images(dataset[2].dataset, cfg.num_synthetic, seed))(cfg)
    else:
        method = get_method(name)(cfg)
    plain_evaluate = method.evaluate
    seen: Dict[str, Any] = {}

    def evaluate(model, c):
        counter["on"] = False
        try:
            return plain_evaluate(model, c)
        finally:
            counter["on"] = True

    method.evaluate = evaluate
    if hasattr(method, "distill"):
        plain_distill = method.distill

        def distill(pool, c):
            counter["on"] = False
            seen["start"] = evaluate_model(method.student, dataset[3], device, n)["acc"]
            counter["on"] = True
            return plain_distill(pool, c)

        method.distill = distill
    speed_s = speed_probe(model_fn, info.input_shape, device)
    rss_before = _peak_rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    result = method.run(uploads, ctx)
    total = time.perf_counter() - t
    m = result.metrics
    timings = m.get("timings", {})
    out = {"method": name, "test_acc": m.get("test_acc"), "ensemble_acc": m.get("ensemble_acc"),
           "start_acc": seen.get("start", m.get("test_acc")), "curve": recorder.curve,
           "synthesis_s": timings.get("synthesis_s"), "images_per_s": m.get("images_per_s"),
           "distill_s": timings.get("distill_s"), "total_s": total, "num_synthetic": m.get("num_synthetic"),
           "ensemble_queries": counter["n"], "rss_before_run_mb": rss_before, "speed_probe_s": speed_s,
           "per_class_acc": m.get("per_class_acc"), "pool_ensemble_fit": m.get("pool_ensemble_fit"),
           "pool": m.get("pool"),
           "clients_used": m.get("clients_used"), "screening": m.get("screening"),
           "config": method.config.to_dict()}
    print(f"{name} seed {seed}: test acc {out['test_acc']:.3f} (start {out['start_acc']:.3f}), ensemble acc "
          f"{out['ensemble_acc']:.3f}, synthesis {out['synthesis_s'] or 0:.1f} s, distillation "
          f"{out['distill_s'] or 0:.1f} s, {out['ensemble_queries']} ensemble queries")
    return out


JOBS = {"pretrain": job_pretrain, "clients": job_clients, "central": job_central, "ensemble": job_ensemble,
        "method": job_method}


def worker_main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    import torch
    threads = int(job["settings"].get("threads_per_job") or 1)
    torch.set_num_threads(threads)
    device = torch.device(job["settings"].get("device", "cpu"))
    t = time.perf_counter()
    out = JOBS[job["kind"]](job, device)
    out.update(ok=True, kind=job["kind"], seed=job.get("seed"), wall_s=time.perf_counter() - t,
               peak_rss_mb=_peak_rss_mb(), threads=threads, torch=torch.__version__, device=str(device))
    if "rss_before_run_mb" in out:
        out["rss_growth_mb"] = out["peak_rss_mb"] - out["rss_before_run_mb"]
    if device.type == "cuda":
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
    write_json_atomic(Path(job["out"]), out)
    return 0
