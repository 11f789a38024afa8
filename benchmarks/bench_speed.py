"""Speed of the core: sparse vs dense inversion, and the batched (vmap) vs looped ensemble.

Prints a table and writes JSON. On 32x32 images with patch 4 (64 tokens) the sparse schedule is timed
at each --prune-ratios value: FedMITRConfig's default (0.15, about half of the tokens kept at the end)
and SMI's 0.3 (about a quarter kept, the paper's setting, whose sparse/dense wall-time target is
<= 0.4).
Batched vs looped ensemble is timed for K = 10 and K = 50 clients (the batched target, >= 2x at
K = 50, is for a GPU, where launch overhead dominates).

    python benchmarks/bench_speed.py                       # CPU, writes benchmarks/results/speed_cpu.json
    python benchmarks/bench_speed.py --device cuda --out benchmarks/results/speed_gpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedml_fedmitr.core.config import FedMITRConfig  # noqa: E402
from fedml_fedmitr.core.ensemble import Ensemble, client_weights  # noqa: E402
from fedml_fedmitr.core.inversion import SparseModelInversion  # noqa: E402
from fedml_fedmitr.core.models import create_vit, token_moments  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_ensemble(k, model, img, patch, chans, batched, device):
    models = []
    for i in range(k):
        torch.manual_seed(i)
        models.append(create_vit(model, img_size=img, num_classes=10, in_chans=chans, patch_size=patch))
    # feature statistics as clients upload them (token moments), here on random images: the timing needs
    # their shape, not their values
    images = [(torch.randn(16, chans, img, img, generator=torch.Generator().manual_seed(0)), None)]
    stats = [token_moments(m, images, "cpu") for m in models]
    return Ensemble(models, client_weights("mean", [1] * k, [[1] * 10] * k, 10), batched=batched, device=device,
                    feature_stats=stats)


def time_inversion(ens, cfg, shape, batch, device, repeats):
    inv = SparseModelInversion(ens, cfg, shape, [0.5] * shape[0], [0.25] * shape[0], device)
    labels = torch.arange(batch) % 10
    best = float("inf")
    for r in range(repeats):
        sync(device)
        t = time.perf_counter()
        inv.synthesize(labels, batch_index=r, seed=0)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def time_ensemble(ens, x, repeats, iters=5):
    with torch.no_grad():
        ens(x)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            sync(x.device)
            t = time.perf_counter()
            for _ in range(iters):
                ens(x)
            sync(x.device)
            best = min(best, (time.perf_counter() - t) / iters)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="fedmitr_vit_micro")
    ap.add_argument("--img", type=int, default=32)
    ap.add_argument("--patch", type=int, default=4)
    ap.add_argument("--clients", type=int, default=5, help="ensemble size for the inversion timing")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200, help="inversion iterations (SMI schedule scaled)")
    ap.add_argument("--ensemble-k", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--ensemble-batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--prune-ratios", type=float, nargs="+", default=[FedMITRConfig.prune_ratio, 0.3],
                    help="prune_ratio values to time the sparse inversion at (default: the config's and SMI's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape = (3, args.img, args.img)
    rows = []

    ens = make_ensemble(args.clients, args.model, args.img, args.patch, 3, "auto", device)
    dense_cfg = FedMITRConfig(inversion_iters=args.iters, synthesis_batch_size=args.batch, inversion="dense")
    n_tokens = (args.img // args.patch) ** 2
    t_dense = time_inversion(ens, dense_cfg, shape, args.batch, device, args.repeats)
    rows.append(("inversion dense", f"{t_dense:.2f} s", f"{args.batch / t_dense:.1f} img/s", ""))
    sparse = []
    for ratio in args.prune_ratios:
        cfg = dense_cfg.replace(inversion="sparse", prune_ratio=ratio)
        kept = cfg.keep_counts(n_tokens)
        t_sparse = time_inversion(ens, cfg, shape, args.batch, device, args.repeats)
        sparse.append({
            "prune_ratio": ratio, "tokens": n_tokens, "kept_tokens": kept,
            "kept_tokens_final": kept[-1], "prune_at": cfg.prune_iterations(),
            "iters": args.iters, "batch": args.batch, "clients": args.clients, "dense_s": t_dense,
            "sparse_s": t_sparse, "dense_images_per_s": args.batch / t_dense,
            "sparse_images_per_s": args.batch / t_sparse, "sparse_over_dense": t_sparse / t_dense,
        })
        rows.append((f"inversion sparse {ratio:g}", f"{t_sparse:.2f} s", f"{args.batch / t_sparse:.1f} img/s",
                     f"ratio {t_sparse / t_dense:.2f}, {n_tokens} -> {kept[-1]} tokens"))

    ensemble = []
    x = torch.randn(args.ensemble_batch, *shape, device=device)
    for k in args.ensemble_k:
        loop = make_ensemble(k, args.model, args.img, args.patch, 3, "loop", device)
        vmapped = make_ensemble(k, args.model, args.img, args.patch, 3, "vmap", device)
        t_loop = time_ensemble(loop, x, args.repeats)
        t_vmap = time_ensemble(vmapped, x, args.repeats)
        ensemble.append({"clients": k, "batch": args.ensemble_batch, "loop_s": t_loop, "vmap_s": t_vmap,
                         "vmap_speedup": t_loop / t_vmap,
                         "loop_images_per_s": args.ensemble_batch / t_loop,
                         "vmap_images_per_s": args.ensemble_batch / t_vmap})
        rows.append((f"ensemble K={k} loop", f"{t_loop * 1e3:.1f} ms", f"{args.ensemble_batch / t_loop:.0f} img/s", ""))
        rows.append((f"ensemble K={k} vmap", f"{t_vmap * 1e3:.1f} ms", f"{args.ensemble_batch / t_vmap:.0f} img/s",
                     f"speedup {t_loop / t_vmap:.2f}x"))

    print(f"{'what':<24}{'time':>12}{'throughput':>16}  note")
    for r in rows:
        print(f"{r[0]:<24}{r[1]:>12}{r[2]:>16}  {r[3]}")
    result = {"command": " ".join(["python"] + sys.argv), "device": str(device),
              "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "model": args.model,
              "img_size": args.img, "patch_size": args.patch, "inversion": sparse, "ensemble": ensemble}
    out = Path(args.out or Path(__file__).parent / "results" / f"speed_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
