"""The result file's rows and the markdown report (no torch)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from .settings import NOT_RUN, NUMERIC_FIELDS, REAL_REFERENCES, RECORD_FIELDS, REFERENCE_ROWS
from .stats import fmt_paired, mean_std, order_holds, paired


def paired_vs(per_seed: Dict[str, Dict[int, Dict[str, Any]]], base: str, other: str,
              seeds: List[int]) -> Optional[Dict[str, Any]]:
    """``base`` minus ``other`` in test accuracy, paired by seed over the seeds both have."""
    a, b = per_seed.get(base, {}), per_seed.get(other, {})
    both = [s for s in seeds if s in a and s in b and a[s].get("test_acc") is not None
            and b[s].get("test_acc") is not None]
    if not both:
        return None
    out = paired([a[s]["test_acc"] - b[s]["test_acc"] for s in both])
    out["seeds"] = both
    return out


def budget_words(st: Dict[str, Any]) -> str:
    if st.get("budget") == "time":
        words = (f"equal synthesis time: every synthesis method gets the seconds {st.get('time_reference')} "
                 "took at the query budget, as many images as its own speed makes in them")
        return words + speed_words(st.get("time_budget") or {})
    return "equal ensemble queries"


def speed_words(budgets: Dict[str, Dict[str, Any]]) -> str:
    """Whether the query-budget records each seed's time budget combines were timed at one machine speed."""
    ratios = [q for b in budgets.values() for q in (b.get("speed_ratio") or {}).values()]
    unchecked = [s for s, b in budgets.items() if b.get("speed_unchecked")]
    out = ""
    if ratios:
        out += f"; machine speed of those records checked (speed probe {min(ratios):.2f}-{max(ratios):.2f}x the reference's)"
    if unchecked:
        out += f"; not checked on seed(s) {', '.join(unchecked)} (records made before the speed probe)"
    return out


def teacher_words(server: Dict[str, Any]) -> str:
    """The teacher every method distils, from the server settings (the code's defaults where unset)."""
    from fedml_fedmitr.core.config import FedMITRConfig
    server = {**FedMITRConfig().to_dict(), **server}
    calibration = FedMITRConfig(ensemble_aggregate=server["ensemble_aggregate"],
                                ensemble_calibration=server["ensemble_calibration"]).calibration()
    weighting = server["ensemble_weighting"]
    words = {"mean": "mean of the client logits", "samples": "client logits weighted by sample count",
             "per_class": "client logits weighted per class by label counts"}.get(weighting, weighting)
    if server["ensemble_aggregate"] != "mean":
        words += f", combined by {server['ensemble_aggregate']}"
    if calibration == "label_prior":
        words += ", each client's logits minus the log of its label prior"
    if calibration == "held_classes":
        words += ", each client's log-probabilities over the classes it holds, each class over its holders"
    return words


def aggregate_rows(per_seed: Dict[str, Dict[int, Dict[str, Any]]], order: List[str], seeds: List[int],
                   errors: Dict[str, Dict[int, str]]) -> List[Dict[str, Any]]:
    """One record per row: each number's mean over the seeds, ``<key>_std`` (population std) and
    ``<key>_per_seed`` (in the order of ``seeds``, None where that seed is missing)."""
    rows = []
    for name in order:
        recs = per_seed.get(name, {})
        row: Dict[str, Any] = {"method": name, "kind": (
            "reference" if name in REFERENCE_ROWS or name in REAL_REFERENCES
            else "ablation" if name.startswith("FedMITR-") else "method"),
            "seeds": [s for s in seeds if s in recs]}
        for key in NUMERIC_FIELDS:
            values = [recs[s].get(key) if s in recs else None for s in seeds]
            if all(v is None for v in values) and key not in RECORD_FIELDS:
                continue
            mean, std = mean_std(values)
            row[key] = mean
            row[f"{key}_std"] = std
            row[f"{key}_per_seed"] = values
        failed = {str(s): e for s, e in errors.get(name, {}).items() if e != NOT_RUN}
        if failed:
            row["errors"] = failed
        not_run = [s for s, e in errors.get(name, {}).items() if e == NOT_RUN]
        if not_run:
            row["not_run"] = not_run
        first = next((recs[s] for s in seeds if s in recs), None)
        if first is not None and "config" in first:
            row["config"] = first["config"]
        if any(recs[s].get("curve") for s in seeds if s in recs):
            row["curve"] = {str(s): recs[s].get("curve") for s in seeds if s in recs}
        row["paired_vs_fedmitr"] = paired_vs(per_seed, "FedMITR", name, seeds) if name != "FedMITR" else None
        rows.append(row)
    return rows


def _fmt(row: Dict[str, Any], key: str, kind: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    std = row.get(f"{key}_std")
    n = len([x for x in row.get(f"{key}_per_seed", []) if x is not None])
    if kind == "acc":
        s = f"{100 * v:.1f}"
        return s + (f" ± {100 * std:.1f}" if n > 1 and std is not None else "")
    if kind == "s":
        return f"{v:.1f}" + (f" ± {std:.1f}" if n > 1 and std is not None else "")
    if kind == "rate":
        return f"{v:.1f}"
    growth = row.get("rss_growth_mb")
    return f"{v:.0f}" + (f" (+{growth:.0f})" if key == "peak_rss_mb" and growth is not None else "")


TABLE_COLUMNS = [("method", "method", None), ("test acc (%)", "test_acc", "acc"),
                 ("ensemble acc (%)", "ensemble_acc", "acc"), ("mean client acc (%)", "client_acc_mean", "acc"),
                 ("synthesis (s)", "synthesis_s", "s"), ("images/s", "images_per_s", "rate"),
                 ("distillation (s)", "distill_s", "s"), ("peak memory (MB)", "peak_rss_mb", "mb")]


def knob_words(knobs: Dict[str, Any]) -> str:
    """A method's own knobs (--method-set) as the table writes them: ``key=value, ...``."""
    return ", ".join(f"{k}={v}" for k, v in knobs.items())


def markdown(result: Dict[str, Any]) -> str:
    st = result["settings"]
    part = {"hetero": f"Dirichlet alpha={st['alpha']}", "pathological": f"#C={st['classes_per_client']}",
            "homo": "IID"}[st["partition"]]
    seeds = st["seed"]
    bd = st.get("budget_detail") or st["budget"]
    columns = list(TABLE_COLUMNS)
    if len(seeds) > 1:   # the per-seed test accuracies beside their mean
        columns.insert(2, ("per seed", "test_acc_per_seed", "seeds"))
    lines = [f"## {result['name']}", "",
             f"{st['data_name']}, {st['num_classes']} classes, {part}, K={st['clients']} clients, "
             f"backbone {st['backbone']}, scale {st['scale']}, model {st['model']['name']} "
             f"{st['model']['img_size']}px/patch {st['model']['patch_size']}, "
             f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
             + (" (mean ± std)" if len(seeds) > 1 else "") + ".",
             f"Budget ({budget_words(st)}): {bd['synthetic_images']} synthetic images, "
             f"{bd['synthesis_ensemble_queries']} synthesis ensemble queries, "
             f"{bd['distill_steps']} distillation steps of {bd['distill_batch_size']}; "
             f"student init {st['student_init']}. Ensemble: {teacher_words(st.get('server', {}))}; "
             + ("Central: one model trained on all clients' data (upper bound); "
                if any(r["method"] == "Central" for r in result["records"]) else "")
             + "peak memory: the child process's max RSS "
             "(in brackets: its growth during the method, above what loading torch, the data and the "
             "client models took)."
             + "".join(f" {m} runs with {knob_words(knobs)} (--method-set)."
                       for m, knobs in (st.get("method_server") or {}).items()), "",
             "| " + " | ".join(c[0] for c in columns) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    for row in result["records"]:
        cells = []
        for _title, key, kind in columns:
            if key == "method":
                label = row["method"] + (" (reference)" if row["kind"] == "reference" else "")
                own = (st.get("method_server") or {}).get(row["method"])
                if own:
                    label += " {" + knob_words(own) + "}"
                if row.get("num_synthetic_per_seed") and st.get("budget") == "time" and row["kind"] != "reference":
                    label += f" [{row['num_synthetic']:.0f} images]"
                if row.get("errors"):
                    label += f" (failed: seed {', '.join(row['errors'])})"
                if row.get("not_run"):
                    label += f" (not run yet: seed {', '.join(map(str, row['not_run']))})"
                cells.append(label)
            elif kind == "seeds":
                cells.append(" / ".join("-" if v is None else f"{100 * v:.1f}" for v in row.get(key, [])))
            else:
                cells.append(_fmt(row, key, kind))
        lines.append("| " + " | ".join(cells) + " |")
    lines += paired_table(result) + probe_lines(result)
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def paired_table(result: Dict[str, Any]) -> List[str]:
    rows = [r for r in result["records"] if r.get("paired_vs_fedmitr")]
    if not rows:
        return []
    out = ["", "FedMITR minus each row, test accuracy points, paired by seed: mean [95% t interval] "
               "(per seed); an order holds only where the interval excludes 0.", "",
           "| row | FedMITR - row | per seed | order |", "|---|---:|---|:-:|"]
    for r in rows:
        d = r["paired_vs_fedmitr"]
        holds = order_holds(d)
        word = {">": "FedMITR higher", "<": "FedMITR lower", None: "none"}[holds]
        out.append(f"| {r['method']} | {fmt_paired(d)} | {' / '.join(f'{v:+.1f}' for v in d['per_seed'])} | {word} |")
    return out


def probe_lines(result: Dict[str, Any]) -> List[str]:
    probe = (result.get("references") or {}).get("attention_probe")
    if not probe:
        return []
    d = probe.get("top_minus_random") or {}
    return ["", f"Attention probe (the ensemble on the test images seen through only k = {probe['k']} of "
                f"{probe['num_patches']} patches): top-k by CLS attention {100 * probe['top_k']:.1f}, random-k "
                f"{100 * probe['random_k']:.1f}, bottom-k {100 * probe['bottom_k']:.1f}; top - random "
                f"{fmt_paired(d)} points."]


def references(per_seed: Dict[str, Dict[int, Dict[str, Any]]], probes: Dict[int, Dict[str, Any]],
               seeds: List[int]) -> Dict[str, Any]:
    """``references`` of the result file: the KD-real rows and the attention probe."""
    out: Dict[str, Any] = {}
    for key, name in (("kd_real", "KD-real"), ("kd_real_plain", "KD-real-plain")):
        recs = per_seed.get(name, {})
        if recs:
            vals = [recs[s]["test_acc"] if s in recs else None for s in seeds]
            out[key] = {"test_acc": mean_std(vals)[0], "test_acc_per_seed": vals}
    have = [probes[s] for s in seeds if s in probes]
    if have:
        out["attention_probe"] = dict(
            {k: mean_std([p[k] for p in have])[0] for k in ("top_k", "random_k", "bottom_k")},
            k=have[0]["k"], num_patches=have[0]["num_patches"],
            per_seed={str(s): probes[s] for s in seeds if s in probes},
            top_minus_random=paired([p["top_k"] - p["random_k"] for p in have]))
    return out


def plot_curves(result: Dict[str, Any], path: Path) -> Optional[str]:
    """One picture: every distilled row's test accuracy per distillation epoch (0 = its start), mean
    over seeds, with the ensemble as a line."""
    rows = [r for r in result["records"] if r.get("curve")]
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in rows:
        curves = [[start] + list(c) for s, c in r["curve"].items() if c
                  for start in [r["start_acc_per_seed"][result["settings"]["seed"].index(int(s))]]]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        ax.plot(range(n), [100 * sum(c[i] for c in curves) / len(curves) for i in range(n)],
                label=f"{r['method']} ({len(curves)} seeds)")
    ens = next((r for r in result["records"] if r["method"] == "Ensemble"), None)
    if ens and ens.get("test_acc") is not None:
        ax.axhline(100 * ens["test_acc"], color="k", ls="--", lw=0.8, label="ensemble")
    ax.set_xlabel("distillation epoch (0 = start)")
    ax.set_ylabel("test accuracy %")
    ax.set_title(result["name"], fontsize=8)
    ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)
