"""How good a teacher is each way of combining the clients? Ensemble accuracy per (cell, seed, variant).

    python benchmarks/teacher_probe.py --seeds 0 1 2 3 4 --split val --variants default \\
        ensemble_weighting=per_class ensemble_calibration=label_prior \\
        ensemble_calibration=held_classes ensemble_weighting=per_class,ensemble_calibration=held_classes \\
        --name teacher_probe_val

A diagnostic for #18: on each cell's cached client uploads (``benchmarks/robustness.py`` trains and
caches them) it builds the ensemble every distillation method distils from, once per variant
(``KEY=VALUE`` changes to ``FedMITRConfig``'s ensemble settings), and measures its accuracy on the
split. No synthesis, no distillation: seconds per cell on one core. Each variant is compared with the
first, paired by (cell, seed), per cell and over all pairs. Results:
``benchmarks/results/<name>.{json,md}``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import robustness as R  # noqa: E402  (cells, budget, cached clients)
from pool_fit_probe import command, probe_parser, run_rows, variant_configs, write_result  # noqa: E402

from fedbench.stats import fmt_paired, paired  # noqa: E402


def probe(cell_name: str, seed: int, split: str, variants: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per variant (its text -> its FedMITRConfig): the ensemble's accuracy on the split."""
    import torch

    from fedml_fedmitr.core.ensemble import Ensemble

    device = torch.device("cpu")
    setup = R.cell_setup(cell_name, seed, split, device)
    rows = []
    for text, cfg in variants.items():
        ens = Ensemble.from_uploads(setup.uploads, setup.model_fn, setup.num_classes, cfg, device)
        pred, y = R._predictions(ens, setup.dataset[3], device)
        right = sorted(set(int(c) for c in pred[pred == y].tolist()))
        rows.append({"cell": cell_name, "seed": seed, "split": split, "variant": text,
                     "acc": float((pred == y).float().mean()), "classes_right": right})
        print(f"{cell_name} seed {seed} {text}: {100 * rows[-1]['acc']:.1f}% ({len(right)} classes right)", flush=True)
    return rows


def summary(rows: List[Dict[str, Any]], variants: List[str]) -> Dict[str, Any]:
    """Per cell, each variant's mean accuracy and its paired change from the first variant; and over
    all (cell, seed) pairs."""
    acc = {(r["cell"], r["seed"], r["variant"]): r["acc"] for r in rows}
    cells = list(dict.fromkeys(r["cell"] for r in rows))
    pairs = sorted({(r["cell"], r["seed"]) for r in rows})
    base = variants[0]
    out: Dict[str, Any] = {"cells": {}, "overall": {}}
    for cell in cells:
        seeds = [s for c, s in pairs if c == cell]
        out["cells"][cell] = {v: {"mean": sum(acc[cell, s, v] for s in seeds) / len(seeds),
                                  "change": paired([acc[cell, s, v] - acc[cell, s, base] for s in seeds])}
                              for v in variants}
    out["overall"] = {v: paired([acc[c, s, v] - acc[c, s, base] for c, s in pairs]) for v in variants[1:]}
    return out


def markdown(result: Dict[str, Any]) -> str:
    variants, s = result["variants"], result["summary"]
    lines = [f"# Teacher probe ({result['name']})", "", f"Command: `{result['command']}`", "",
             "The ensemble's accuracy (%) on the split, mean over the seeds, per variant of the ensemble "
             f"settings; in brackets the change from `{variants[0]}`, paired by seed, with its 95% t interval.", "",
             "| cell | " + " | ".join(f"`{v}`" for v in variants) + " |", "|---|" + "---:|" * len(variants)]
    for cell, per in s["cells"].items():
        cells = [f"{100 * per[variants[0]]['mean']:.1f}"] + [
            f"{100 * per[v]['mean']:.1f} ({fmt_paired(per[v]['change'])})" for v in variants[1:]]
        lines.append(f"| {cell} | " + " | ".join(cells) + " |")
    lines.append("| all pairs | - | " + " | ".join(fmt_paired(s["overall"][v]) for v in variants[1:]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    a = probe_parser(__doc__, all_cells_by_default=True).parse_args(argv)
    configs = variant_configs(a.variants)
    rows = run_rows(probe, a, configs)
    result = {"name": a.name, "command": command("teacher_probe.py", argv), "split": a.split,
              "variants": a.variants, "rows": rows, "summary": summary(rows, a.variants)}
    write_result(result, markdown(result))


if __name__ == "__main__":
    main()
