"""benchmarks/robustness.py --change: one method's paired change between two results on the same
uploads (an option or a new default measured against the defaults). Synthetic result files; no torch."""
import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import robustness  # noqa: E402


def _result(name, accs, overrides=None, clients=None, collapsed=()):
    """A robustness result with one FedMITR record per (cell, seed) of ``accs``."""
    records = []
    for (cell, seed), acc in accs.items():
        records.append({"cell": cell, "seed": seed, "client_acc": (clients or {}).get((cell, seed), [0.5, 0.6]),
                        "methods": {"FedMITR": {"test_acc": acc, "teacher_acc": 0.8,
                                                "collapsed": (cell, seed) in collapsed}}})
    return {"settings": {"name": name, "overrides": overrides or {}, "command": "x"}, "records": records}


def test_change_is_paired_by_cell_and_seed():
    base = _result("base", {("digits_K5_a0.5", 0): 0.40, ("digits_K5_a0.5", 1): 0.50, ("mnist_K5_a0.1", 0): 0.30,
                            ("mnist_K5_a0.1", 1): 0.20, ("mnist_K5_a0.1", 2): 0.25})
    other = _result("other", {("digits_K5_a0.5", 0): 0.45, ("digits_K5_a0.5", 1): 0.53, ("mnist_K5_a0.1", 0): 0.28,
                              ("mnist_K5_a0.1", 1): 0.20}, overrides={"teacher_debias": "pool"},
                    collapsed={("mnist_K5_a0.1", 1)})
    t = robustness.change_table(base, other)
    digits, mnist = t["cells"]["digits_K5_a0.5"], t["cells"]["mnist_K5_a0.1"]
    assert digits["change"]["per_seed"] == pytest.approx([5.0, 3.0])
    assert digits["change"]["mean_diff"] == pytest.approx(4.0)
    low, high = digits["change"]["ci95"]
    assert low < 4.0 < high and high - low == pytest.approx(2 * 12.706, rel=1e-3)   # t(1) x sd 2**0.5 / 2**0.5
    assert mnist["seeds"] == [0, 1]                   # seed 2 is only in the base: not a pair
    assert mnist["change"]["mean_diff"] == pytest.approx(-1.0)
    assert mnist["other_collapsed_seeds"] == [1] and mnist["base_collapsed_seeds"] == []
    assert t["all_pairs"]["per_seed"] == pytest.approx([5.0, 3.0, -2.0, 0.0])
    assert (t["cells_up"], t["cells_down"]) == (1, 1)
    md = robustness.change_markdown(t, "cmd")
    assert "| digits_K5_a0.5 | 2 |" in md and "+4.0 [" in md and "Over all 4 (cell, seed) pairs" in md


def test_change_refuses_results_from_different_uploads():
    base = _result("base", {("digits_K5_a0.5", 0): 0.4})
    other = _result("other", {("digits_K5_a0.5", 0): 0.4}, clients={("digits_K5_a0.5", 0): [0.5, 0.7]})
    with pytest.raises(SystemExit, match="digits_K5_a0.5 seed 0 holds different client uploads .*different caches "
                                         r"\(another environment or thread count, settings.environment\)"):
        robustness.change_table(base, other)


def test_a_result_records_what_its_uploads_depend_on_beyond_the_seed():
    env = robustness.environment(jobs=2, threads=1)
    assert (env["jobs"], env["threads_per_job"]) == (2, 1)
    assert env["python"] == sys.version.split()[0]
    assert env["packages"]["timm"] and env["packages"]["numpy"] and env["packages"]["torch"]
    assert env["packages"]["scikit-learn"] and env["packages"]["fedml"] == "0.9.6"


def test_change_cli_writes_its_report_and_names_a_missing_result(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(robustness, "RESULTS", tmp_path)
    accs = {("digits_K2_a0.5", s): 0.5 + 0.01 * s for s in range(3)}
    (tmp_path / "a.json").write_text(json.dumps(_result("a", accs)))
    (tmp_path / "b.json").write_text(json.dumps(_result("b", {k: v + 0.02 for k, v in accs.items()})))
    assert robustness.main(["--change", "a", "b", "--name", "a_to_b"]) == 0
    out = json.loads((tmp_path / "a_to_b.json").read_text())
    assert out["all_pairs"]["mean_diff"] == pytest.approx(2.0)
    assert out["command"] == "python benchmarks/robustness.py --change a b --name a_to_b"
    assert (tmp_path / "a_to_b.md").read_text().startswith("# FedMITR: b minus a")
    with pytest.raises(SystemExit, match="missing.json"):
        robustness.main(["--change", "a", "missing", "--name", "x"])


def test_merge_joins_methods_takes_chosen_seeds_and_refuses_mixed_uploads(tmp_path, monkeypatch):
    monkeypatch.setattr(robustness, "RESULTS", tmp_path)
    old_cache = {("digits_K2_a0.5", 0): [0.5, 0.6], ("digits_K2_a0.5", 1): [0.5, 0.6]}
    new_cache = {("digits_K2_a0.5", s): [0.4, 0.7] for s in range(3)}
    (tmp_path / "old.json").write_text(json.dumps(_result("old", {k: 0.5 for k in old_cache}, clients=old_cache)))
    (tmp_path / "new.json").write_text(json.dumps(_result("new", {k: 0.6 for k in new_cache}, clients=new_cache)))
    di = _result("di", {k: 0.7 for k in new_cache}, clients=new_cache)
    for r in di["records"]:
        r["methods"] = {"DeepInversion": r["methods"]["FedMITR"]}
    (tmp_path / "di.json").write_text(json.dumps(di))
    with pytest.raises(SystemExit, match=r"--merge: cell digits_K2_a0.5 seed 0 holds different client uploads in "
                                         r"old and new .*take each seed from one of them \(NAME:SEEDS, e.g. new:0\)"):
        robustness.merge_records(["old", "new"])
    records, sources = robustness.merge_records(["old", "new:2", "di:2"])
    assert [(r["seed"], r["client_acc"]) for r in records] == [(0, [0.5, 0.6]), (1, [0.5, 0.6]), (2, [0.4, 0.7])]
    assert records[2]["methods"] == {"FedMITR": {"test_acc": 0.6, "teacher_acc": 0.8, "collapsed": False},
                                     "DeepInversion": {"test_acc": 0.7, "teacher_acc": 0.8, "collapsed": False}}
    assert [s["seeds"] for s in sources] == [None, [2], [2]]
    with pytest.raises(SystemExit, match="--merge 'new:x': expected NAME or NAME:SEEDS"):
        robustness.merge_records(["new:x"])


def test_pool_fit_probe_refuses_a_bad_variant_before_any_inversion(tmp_path, monkeypatch):
    """benchmarks/pool_fit_probe.py: a variant's unknown key or bad value is named before clients load."""
    import pool_fit_probe

    from fedml_fedmitr.core.config import ConfigError

    monkeypatch.setattr(pool_fit_probe.R, "RESULTS", tmp_path)
    monkeypatch.setattr(pool_fit_probe, "probe", lambda *a: pytest.fail("probe ran on a bad variant"))
    with pytest.raises(ConfigError, match="no_such_knob"):
        pool_fit_probe.main(["--cells", "digits_K5_a0.5", "--variants", "default", "no_such_knob=1", "--name", "x"])
    with pytest.raises(ConfigError, match="prune_ratio"):
        pool_fit_probe.main(["--cells", "digits_K5_a0.5", "--variants", "prune_ratio=2,feature_weight=0", "--name", "x"])
    assert pool_fit_probe.parse_variant("feature_weight=0,inversion_iters=240") == {"feature_weight": 0,
                                                                                     "inversion_iters": 240}
    assert pool_fit_probe.parse_variant("default") == {} and not list(tmp_path.iterdir())


def test_teacher_probe_refuses_a_bad_variant_and_pairs_changes_by_seed(tmp_path, monkeypatch):
    """benchmarks/teacher_probe.py: a bad ensemble setting is named before clients load; each variant's
    change from the first is paired by (cell, seed)."""
    import teacher_probe

    from fedml_fedmitr.core.config import ConfigError

    monkeypatch.setattr(teacher_probe.R, "RESULTS", tmp_path)
    monkeypatch.setattr(teacher_probe, "probe", lambda *a: pytest.fail("probe ran on a bad variant"))
    with pytest.raises(ConfigError, match="ensemble_calibration"):
        teacher_probe.main(["--cells", "digits_K5_a0.5", "--variants", "default", "ensemble_calibration=nope",
                            "--name", "x"])
    with pytest.raises(ConfigError, match="ensemble_aggregate"):
        teacher_probe.main(["--cells", "digits_K5_a0.5", "--variants",
                            "ensemble_calibration=held_classes,ensemble_aggregate=median", "--name", "x"])
    assert not list(tmp_path.iterdir())
    rows = [{"cell": c, "seed": s, "variant": v, "acc": a} for c, s, v, a in [
        ("a", 0, "default", 0.5), ("a", 1, "default", 0.6), ("a", 0, "w", 0.7), ("a", 1, "w", 0.7),
        ("b", 0, "default", 0.2), ("b", 0, "w", 0.1)]]
    s = teacher_probe.summary(rows, ["default", "w"])
    assert s["cells"]["a"]["w"]["change"]["per_seed"] == pytest.approx([20.0, 10.0])
    assert s["cells"]["b"]["w"]["mean"] == pytest.approx(0.1)
    assert s["overall"]["w"]["per_seed"] == pytest.approx([20.0, 10.0, -10.0])
    assert "all pairs" in teacher_probe.markdown({"name": "x", "command": "c", "variants": ["default", "w"],
                                                  "summary": s})


def test_pool_fit_probe_holder_margins_say_whether_the_holder_outbids_the_others():
    """The held-class margins: the holder's probability of the label against the non-holders' best
    probability of one of their own classes, per image; an image whose label every client holds has no
    non-holder and is left out of the second."""
    import pool_fit_probe
    import torch

    held = torch.tensor([[True, True, False], [False, False, True], [True, False, True]])
    # (K=3, B=3, C=3) probabilities over each client's held classes
    p = torch.tensor([[[0.9, 0.1, 0.0], [0.2, 0.8, 0.0], [0.5, 0.5, 0.0]],
                      [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]],
                      [[0.7, 0.0, 0.3], [0.4, 0.0, 0.6], [0.1, 0.0, 0.9]]])
    logp = p.clamp_min(1e-12).log()
    labels = torch.tensor([0, 1, 2])
    m = pool_fit_probe.holder_margins(logp, held, labels)
    # image 0 (label 0): holders 0 and 2 -> 0.9; non-holder 1 -> 1.0: not beaten
    # image 1 (label 1): holder 0 -> 0.8; non-holders 1 (1.0) and 2 (0.6) -> 1.0
    # image 2 (label 2): holders 1 and 2 -> 1.0; non-holder 0 -> 0.5: beaten
    assert abs(m["holder_p"] - (0.9 + 0.8 + 1.0) / 3) < 1e-5
    assert abs(m["nonholder_p"] - (1.0 + 1.0 + 0.5) / 3) < 1e-5
    assert abs(m["holder_beats"] - 1 / 3) < 1e-6 and m["images_with_a_nonholder"] == 1.0
    everyone = torch.ones(3, 3, dtype=torch.bool)
    m = pool_fit_probe.holder_margins(torch.full((3, 3, 3), -1.0986), everyone, labels)
    assert m["images_with_a_nonholder"] == 0.0 and m["holder_beats"] == 1.0
