"""Means over seeds and paired differences (no torch)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (scipy comes with scikit-learn)."""
    from scipy.stats import t
    return float(t.ppf(0.975, df))


def mean_std(values: Sequence[Optional[float]]) -> Tuple[Optional[float], Optional[float]]:
    """Mean and population standard deviation of the values that are not None."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))


def paired(diffs: Sequence[float]) -> Dict[str, Any]:
    """Paired differences (fractions, e.g. FedMITR minus a method per seed) in accuracy points: the
    per-seed values, their mean and the 95% confidence interval of the t distribution (None for
    fewer than two seeds)."""
    pts: List[float] = [100.0 * d for d in diffs]
    out: Dict[str, Any] = {"per_seed": pts, "mean_diff": sum(pts) / len(pts) if pts else None, "ci95": None}
    if len(pts) >= 2:
        m = out["mean_diff"]
        sd = math.sqrt(sum((v - m) ** 2 for v in pts) / (len(pts) - 1))
        half = t975(len(pts) - 1) * sd / math.sqrt(len(pts))
        out["ci95"] = [m - half, m + half]
    return out


def order_holds(d: Optional[Dict[str, Any]]) -> Optional[str]:
    """'>' or '<' when the 95% interval of a paired difference excludes 0, else None."""
    if not d or d.get("ci95") is None:
        return None
    lo, hi = d["ci95"]
    return ">" if lo > 0 else "<" if hi < 0 else None


def fmt_paired(d: Optional[Dict[str, Any]]) -> str:
    if not d or d.get("mean_diff") is None:
        return "-"
    if d.get("ci95") is None:
        return f"{d['mean_diff']:+.1f}"
    return f"{d['mean_diff']:+.1f} [{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]"
