"""Why does the ensemble miss a class? Per true class, on a finished run's uploads and test data.

    python benchmarks/teacher_classes.py --cf RUN.yaml [--seed S] [--uploads PATH] [--set KEY=VALUE ...] [--name NAME]

A diagnostic for #18. It rebuilds the ensemble every distillation method distils from, exactly as the
run's server did (the run's YAML file: data, model and ``fedmitr_args``; ``--seed`` its
``common_args.random_seed``, which also draws the data split; ``--set`` changes an ensemble key), from the uploads the server saved (default ``<output_dir>/state/uploads.pt``), and for
each true class of the test set reports: the clients that hold it (label count > 0), each holder's
accuracy on it when it may answer only among its own classes (what ``ensemble_calibration:
held_classes`` asks of it), the ensemble's accuracy on it and what it answers instead, and the
ensemble's mean score (its logit) of the true class against the mean winning score. A class whose
holders know it but whose score loses to other clients' classes is the teacher's fault, not the
clients'. No synthesis, no distillation: seconds on one core. With ``--name`` the table is written
to ``benchmarks/results/<name>.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from shipped_configs import command_line, git_commit, parse_overrides  # noqa: E402  (--set, commit, command)


def class_table(ensemble, label_counts: List[List[int]], loader) -> Dict[str, Any]:
    """Per true class: holders, their within-class accuracy, the ensemble's accuracy, its answers and
    scores (see the module's docstring)."""
    import torch

    from fedml_fedmitr.core.ensemble import UNHELD_LOG_PROB

    xs, ys = zip(*[(x, y) for x, y in loader])
    x, y = torch.cat(xs), torch.cat(ys).long()
    with torch.no_grad():
        raw = ensemble.client_logits(x)                  # (K, N, C)
        out = ensemble.combine(raw).float()              # (N, C)
    num_classes = out.shape[1]
    pred = out.argmax(1)
    held = torch.tensor([[c > 0 for c in row] for row in label_counts])
    own = raw.float().masked_fill(~held.unsqueeze(1), float("-inf"))   # each client among its own classes
    rows = []
    for c in range(num_classes):
        sel = y == c
        if not bool(sel.any()):
            continue
        holders = [k for k in range(held.shape[0]) if bool(held[k, c])]
        rows.append({
            "class": c, "test_images": int(sel.sum()), "holders": holders,
            "holder_acc": [float((own[k][sel].argmax(1) == c).float().mean()) for k in holders],
            "ensemble_acc": float((pred[sel] == c).float().mean()),
            "answers": torch.bincount(pred[sel], minlength=num_classes).tolist(),
            "true_score": float(out[sel, c].clamp_min(UNHELD_LOG_PROB).mean()),
            "winning_score": float(out[sel].max(1).values.mean())})
    return {"accuracy": float((pred == y).float().mean()), "classes": rows}


def markdown(result: Dict[str, Any]) -> str:
    lines = [f"# Per-class teacher ({result['name']})", "", f"Command: `{result['command']}` (commit {result['commit']})", "",
             f"Ensemble settings: {result['ensemble']}; its test accuracy {100 * result['table']['accuracy']:.1f}%.", "",
             "Per true class: the clients that hold it, each holder's accuracy on it among its own classes, the "
             "ensemble's accuracy on it, what the ensemble answers for its images (count per class), and the "
             "ensemble's mean score of the true class against its mean winning score.", "",
             "| class | test images | holders | holders' accuracy | ensemble | ensemble's answers | true score | winning score |",
             "|---:|---:|---|---|---:|---|---:|---:|"]
    for r in result["table"]["classes"]:
        lines.append(f"| {r['class']} | {r['test_images']} | {', '.join(map(str, r['holders']))} | "
                     f"{' / '.join(f'{100 * a:.0f}%' for a in r['holder_acc'])} | {100 * r['ensemble_acc']:.0f}% | "
                     f"{' '.join(map(str, r['answers']))} | {r['true_score']:.2f} | {r['winning_score']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cf", required=True, help="the run's FedML YAML file")
    ap.add_argument("--seed", type=int, default=None, help="the run's common_args.random_seed (default: the file's)")
    ap.add_argument("--uploads", default=None, help="saved uploads (default: <output_dir>/state/uploads.pt)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="fedmitr_args keys to change")
    ap.add_argument("--name", default=None, help="write benchmarks/results/<name>.{json,md}")
    args = ap.parse_args(argv)

    import os

    import torch

    from fedml_fedmitr.cli import validate_sections
    from fedml_fedmitr.core.ensemble import Ensemble
    from fedml_fedmitr.core.methods import ClientUpload
    from fedml_fedmitr.data import load_data
    from fedml_fedmitr.fedml_adapter.config import load_yaml
    from fedml_fedmitr.fedml_adapter.model import create_model
    from fedml_fedmitr.fedml_adapter.state import load_uploads

    sections = load_yaml(args.cf)
    out_dir = (sections.get("fedmitr_args") or {}).get("output_dir", "./fedmitr_output")
    sections.setdefault("fedmitr_args", {}).update(parse_overrides(args.set))
    if args.seed is not None:
        sections.setdefault("common_args", {})["random_seed"] = args.seed
    _, flat = validate_sections(sections, args.cf)
    cfg = flat.fedmitr_settings.method
    torch.set_num_threads(1)
    dataset, num_classes = load_data(flat)
    path = args.uploads or os.path.join(os.path.expanduser(str(out_dir)), "state", "uploads.pt")
    uploads = [ClientUpload.from_payload(p) for p in load_uploads(path)["uploads"]]
    ensemble = Ensemble.from_uploads(uploads, lambda: create_model(flat, num_classes), num_classes, cfg, "cpu")
    table = class_table(ensemble, [u.label_counts for u in uploads], dataset[3])
    shown = "python benchmarks/teacher_classes.py " + command_line(argv)
    commit = git_commit()
    result = {"name": args.name or "-", "command": shown, "commit": commit,
              "ensemble": {k: getattr(cfg, k) for k in ("ensemble_weighting", "ensemble_aggregate", "ensemble_calibration")},
              "table": table}
    md = markdown(result)
    print(md)
    if args.name:
        results = ROOT / "benchmarks" / "results"
        (results / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (results / f"{args.name}.md").write_text(md)


if __name__ == "__main__":
    main()
