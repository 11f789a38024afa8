"""Which classes can the inversion reach? One synthesis batch per (cell, seed, variant), per-class fit.

    python benchmarks/pool_fit_probe.py --cells cifar10_K10_a0.1_pre --seeds 0 2 --split val \\
        --variants default feature_weight=0 feature_weight=0.01 inversion_iters=240 --name pool_fit_cifar

A diagnostic for the robustness matrix's missing pool classes (#18): on the cell's cached client
uploads (``benchmarks/robustness.py`` trains and caches them), it inverts the first synthesis batch
of FedMITR's pool (``synthesis_batch_size`` images with balanced labels, batch index 0, the matrix's
budget and ``FedMITRConfig``'s defaults, plus each variant's ``KEY=VALUE`` changes) and counts, per
class, the images the ensemble assigns their synthesis label on the whole image; with the held-class
teacher also its margins (:func:`holder_margins`: the label's holders against the other clients). No distillation:
seconds to a minute per variant on one core. Results: ``benchmarks/results/<name>.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import robustness as R  # noqa: E402  (cells, budget, cached clients)


def parse_variant(text: str) -> Dict[str, Any]:
    """``default`` or ``k=v,k=v`` (values read as robustness.py's ``--set`` reads them)."""
    if text == "default":
        return {}
    return R.parse_set(text.split(","))


def probe(cell_name: str, seed: int, split: str, variants: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per variant (its text -> its FedMITRConfig) on the cell's uploads for ``seed``."""
    import torch

    from fedml_fedmitr.core.ensemble import Ensemble
    from fedml_fedmitr.core.inversion import SparseModelInversion, balanced_labels

    device = torch.device("cpu")
    setup = R.cell_setup(cell_name, seed, split, device)
    n, info, uploads, model_fn = setup.num_classes, setup.info, setup.uploads, setup.model_fn
    rows = []
    for text, cfg in variants.items():
        ens = Ensemble.from_uploads(uploads, model_fn, n, cfg, device)
        inv = SparseModelInversion(ens, cfg, info.input_shape, info.mean, info.std, device, None,
                                   client_augment=setup.client_train.augment,
                                   client_flip=setup.client_train.flip)
        labels = balanced_labels(cfg.synthesis_batch_size, n, 0)
        t = time.perf_counter()
        batch = inv.synthesize(labels, batch_index=0, seed=seed)
        with torch.no_grad():
            client_logits = ens.client_logits(batch.images)     # one forward per client, read twice below
            pred = ens.combine(client_logits).argmax(1)
            held = None if ens.held is None else holder_margins(ens.calibrated(client_logits), ens.held, labels)
        hit = pred == labels
        rows.append({"cell": cell_name, "seed": seed, "split": split, "variant": text,
                     "fit": float(hit.float().mean()), "held_class_margins": held,
                     "fit_per_class": torch.bincount(labels[hit], minlength=n).tolist(),
                     "images_per_class": torch.bincount(labels, minlength=n).tolist(),
                     "predicted_per_class": torch.bincount(pred, minlength=n).tolist(),
                     "client_label_counts": info.client_label_counts, "seconds": time.perf_counter() - t})
        r = rows[-1]
        print(f"{cell_name} seed {seed} {text}: fit {100 * r['fit']:.0f}%, per class {r['fit_per_class']} "
              f"of {r['images_per_class']}, predicted {r['predicted_per_class']} ({r['seconds']:.0f} s)", flush=True)
    return rows


def holder_margins(logp, held, labels) -> Dict[str, float]:
    """Why the held-class teacher does or does not give a synthetic image its label. ``logp``: the clients'
    calibrated log-probabilities (K, B, C) over the classes each holds; ``held``: (K, C) bool; ``labels``:
    (B,). Per image, the holders' best probability of the label and the non-holders' best probability of
    one of their own classes (images every client holds the label of are left out of the second):
    ``holder_p`` and ``nonholder_p`` are their means, ``holder_beats`` the share of images where the
    first is the larger (with one holder per class, as in label-sorted shards, the teacher's argmax is
    then the label)."""
    import torch
    p = logp.exp().masked_fill(~held.unsqueeze(1), 0.0)          # (K, B, C)
    holds = held[:, labels]                                       # (K, B): client k holds image b's label
    of_label = p[:, torch.arange(len(labels)), labels]           # (K, B): each client's p of the label
    holder = of_label.masked_fill(~holds, 0.0).max(0).values     # (B,)
    other = p.max(2).values.masked_fill(holds, -1.0).max(0).values   # (B,); -1: no non-holder
    some = other >= 0
    return {"holder_p": float(holder.mean()),
            "nonholder_p": float(other[some].mean()) if bool(some.any()) else float("nan"),
            "holder_beats": float((holder > other).float().mean()),
            "images_with_a_nonholder": float(some.float().mean())}


def variant_configs(variants: List[str]) -> Dict[str, Any]:
    """Every variant's FedMITRConfig (the matrix's budget, the defaults, the variant's changes), built
    once: a bad key or value stops here, before any client loads."""
    from fedml_fedmitr.core.config import FedMITRConfig
    return {text: FedMITRConfig.from_dict(dict(R.BUDGET, **parse_variant(text), progress=False, save_images=False),
                                          where=f"--variants {text}") for text in variants}


def run_rows(fn, a, configs: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``fn(cell, seed, split, configs)``'s rows for every cell and seed of the parsed arguments ``a``."""
    import torch
    torch.set_num_threads(a.threads)
    return [r for cell in a.cells for seed in a.seeds for r in fn(cell, seed, a.split, configs)]


def command(script: str, argv) -> str:
    return f"python benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None else argv)


def write_result(result: Dict[str, Any], text: str) -> None:
    """``benchmarks/results/<name>.{json,md}``; the markdown is printed too."""
    R.RESULTS.mkdir(parents=True, exist_ok=True)
    (R.RESULTS / f"{result['name']}.json").write_text(json.dumps(result, indent=1))
    (R.RESULTS / f"{result['name']}.md").write_text(text)
    print(text)


def markdown(result: Dict[str, Any]) -> str:
    lines = [f"# Pool fit probe ({result['name']})", "", f"Command: `{result['command']}`", "",
             "One synthesis batch per row (batch index 0, balanced labels, the matrix's budget and the "
             "defaults plus the variant); fit: images the ensemble assigns their synthesis label on the "
             "whole image, per class.", "",
             "Held-class teacher: holder p, the mean over images of the best probability that a client holding "
             "the image's label gives it (over the classes that client holds); non-holder p, of the best "
             "probability a client not holding it gives one of its own classes; beats, the share of images "
             "where the holder's is the larger.", "",
             "| cell | split | seed | variant | fit (%) | holder p | non-holder p | beats | fit per class | "
             "ensemble's predictions per class |",
             "|---|---|---:|---|---:|---:|---:|---:|---|---|"]
    for r in result["rows"]:
        per = " / ".join(map(str, r["fit_per_class"]))
        sizes = set(r["images_per_class"])
        of = f"of {sizes.pop()}" if len(sizes) == 1 else "of " + " / ".join(map(str, r["images_per_class"]))
        h = r.get("held_class_margins") or {}
        margins = " | ".join(f"{h[k]:.3f}" if k in h else "-" for k in ("holder_p", "nonholder_p", "holder_beats"))
        lines.append(f"| {r['cell']} | {r['split']} | {r['seed']} | {r['variant']} | {100 * r['fit']:.0f} | "
                     f"{margins} | {per} ({of}) | {' / '.join(map(str, r['predicted_per_class']))} |")
    return "\n".join(lines) + "\n"


def probe_parser(doc: str, all_cells_by_default: bool = False) -> argparse.ArgumentParser:
    """The probes' shared arguments: cells, seeds, split, variants, threads, name."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if all_cells_by_default:
        ap.add_argument("--cells", nargs="+", default=list(R.MATRIX), choices=list(R.CELLS))
    else:
        ap.add_argument("--cells", nargs="+", required=True, choices=list(R.CELLS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--split", choices=["val", "test"], default="val")
    ap.add_argument("--variants", nargs="+", default=["default"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", required=True)
    return ap


def main(argv=None) -> None:
    a = probe_parser(__doc__).parse_args(argv)
    configs = variant_configs(a.variants)
    rows = run_rows(probe, a, configs)
    result = {"name": a.name, "command": command("pool_fit_probe.py", argv), "rows": rows}
    write_result(result, markdown(result))


if __name__ == "__main__":
    main()
