"""benchmarks/shipped_configs.py: the seeded copies it runs are the shipped configs with only the seed
and the output folder changed, and they still validate. No child process."""
import json
import sys

import pytest
import yaml

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import robustness  # noqa: E402
import shipped_configs  # noqa: E402

from fedml_fedmitr.cli import validate  # noqa: E402
from fedml_fedmitr.core.config import FedMITRConfig  # noqa: E402


@pytest.mark.parametrize("name", sorted(shipped_configs.CONFIGS))
def test_a_seeded_copy_is_the_shipped_config_but_for_seed_and_output(tmp_path, tmp_home, name):
    for role, src in shipped_configs.CONFIGS[name]["files"].items():
        original = yaml.safe_load((ROOT / src).read_text())
        dst = tmp_path / f"{role}.yaml"
        shipped_configs.seeded_copy(ROOT / src, dst, 2, str(tmp_path / "out"))
        copy = yaml.safe_load(dst.read_text())
        assert copy["common_args"].pop("random_seed") == 2 and original["common_args"].pop("random_seed") == 0
        assert copy["fedmitr_args"].pop("output_dir") == str(tmp_path / "out")
        original["fedmitr_args"].pop("output_dir")
        assert copy == original
        if name != "stock_main":   # the stock main.py reads its own dataset; its keys are FedML's
            _, flat = validate(str(dst))
            assert flat.random_seed == 2


def test_a_config_without_the_seed_key_is_refused_by_name(tmp_path):
    src = tmp_path / "c.yaml"
    src.write_text(yaml.safe_dump({"common_args": {}, "fedmitr_args": {"output_dir": "x"}}))
    with pytest.raises(SystemExit, match="common_args.random_seed"):
        shipped_configs.seeded_copy(src, tmp_path / "d.yaml", 1, "y")


def test_the_table_marks_each_seed_against_the_bar():
    rows = [{"config": "mpi", "seed": s, "test_acc": t, "ensemble_acc": 0.8, "ratio": t / 0.8,
             "client_test_acc": [0.5, 0.6], "wall_s": 60.0, "missed_classes": m, "missed_ensemble_acc": a,
             "fewest_predicted": f}
            for s, t, m, a, f in ((0, 0.76, [], [], [8, 2, 0.03]), (1, 0.70, [3, 6], [0.25, 0.03], [3, 0, 0.25]))]
    md = shipped_configs.markdown(rows, ["mpi"], [0, 1], "abc", "--configs mpi")
    assert md.startswith("# The shipped configs at the defaults of commit abc")
    assert "| mpi | 0 | 50.0 / 60.0 | 76.0 | 80.0 | 0.95 | yes | none | 8: 2 (3%) | 1.0 |" in md
    assert "| mpi | 1 | 50.0 / 60.0 | 70.0 | 80.0 | 0.87 | no | 3 (25%), 6 (3%) | 3: 0 (25%) | 1.0 |" in md
    assert "| mpi | mean | | 73.0 | 80.0 | 0.91 | not on every seed | collapsed on seed(s) 1 | | |" in md
    # a result without the collapse measures (before they were recorded) shows "-"
    old = [{k: v for k, v in rows[0].items() if not k.startswith(("missed", "fewest"))}]
    assert "| 0.95 | yes | - | - | 1.0 |" in shipped_configs.markdown(old, ["mpi"], [0], "abc", "")


def test_the_collapse_fields_come_from_the_runs_summary():
    summary = {"missed_classes": [2], "per_class_acc": {"ensemble": [0.9, 0.8, 0.05, 0.0]},
               "predicted_per_class": {"global": [6, 3, 0, 1]},
               "metrics": {"pool": {"ensemble_pred": [5, 5, 0, 0]}}}
    # the nearest miss is among the classes the ensemble gets right (class 3 it never does)
    assert shipped_configs.collapse_fields(summary) == {
        "missed_classes": [2], "missed_ensemble_acc": [0.05], "pool_ensemble_pred": [5, 5, 0, 0],
        "predicted_per_class": [6, 3, 0, 1], "fewest_predicted": [2, 0, 0.05]}
    summary["predicted_per_class"]["global"] = [6, 3, 1, 0]
    assert shipped_configs.collapse_fields(summary)["fewest_predicted"] == [2, 1, 0.05]
    summary["per_class_acc"]["ensemble"][2] = None          # a class absent from the test set is skipped
    assert shipped_configs.collapse_fields(summary)["fewest_predicted"] == [1, 3, 0.8]
    assert shipped_configs.collapse_fields({})["missed_classes"] is None
    assert shipped_configs.collapse_fields({})["fewest_predicted"] is None


def test_a_set_override_changes_only_that_key_and_is_recorded(tmp_path):
    src = ROOT / "config/fedmitr_sp.yaml"
    overrides = shipped_configs.parse_overrides(["distill_epochs=270"])
    assert overrides == {"distill_epochs": 270}
    shipped_configs.seeded_copy(src, tmp_path / "d.yaml", 0, "out", overrides)
    copy = yaml.safe_load((tmp_path / "d.yaml").read_text())
    original = yaml.safe_load(src.read_text())
    assert original["fedmitr_args"]["distill_epochs"] != 270 and copy["fedmitr_args"].pop("distill_epochs") == 270
    original["fedmitr_args"].pop("distill_epochs")
    copy["fedmitr_args"]["output_dir"] = original["fedmitr_args"]["output_dir"]
    assert copy == original
    rows = [{"config": "sp", "seed": 0, "test_acc": 0.5, "ensemble_acc": 0.5, "ratio": 1.0,
             "client_test_acc": None, "wall_s": 60.0}]
    assert "`fedmitr_args.distill_epochs: 270`" in shipped_configs.markdown(rows, ["sp"], [0], "abc", "", overrides)


@pytest.mark.parametrize("item", ["distil_epochs=180", "distill_epochs", "output_dir=x"])
def test_a_bad_set_override_is_refused_by_name_before_any_run(item):
    with pytest.raises(SystemExit, match="--set"):
        shipped_configs.parse_overrides([item])


def test_the_shipped_configs_the_matrix_and_the_defaults_share_one_budget():
    """The robustness matrix is run at the shipped configs' budget (#18), and FedMITRConfig's distillation
    budget is that budget: changing one of them without the others would make the matrix measure a
    setting no user runs."""
    # every file but a cross-silo client's, whose server decides the budget
    files = [ROOT / src for name in shipped_configs.SHIPPED
             for role, src in shipped_configs.CONFIGS[name]["files"].items() if role != "client"]
    files.append(ROOT / "config/cross_silo/fedmitr_mpi_backend.yaml")
    assert len(files) == 5
    for path in files:
        args = yaml.safe_load(path.read_text())["fedmitr_args"]
        assert {k: args.get(k) for k in robustness.BUDGET} == robustness.BUDGET, path
    defaults = FedMITRConfig()
    assert (defaults.distill_epochs, defaults.distill_batch_size) == (
        robustness.BUDGET["distill_epochs"], robustness.BUDGET["distill_batch_size"])


def _finished_server_run(root, seed, server_seed, distill_epochs=None):
    """A summary.json as `server_only` writes it for (sp, seed) rerun with fedmitr_args.seed = server_seed
    (at the shipped budget unless distill_epochs is given)."""
    import json
    out = root / "fedmitr_output" / "shipped" / f"sp_s{seed}_server{server_seed}"
    out.mkdir(parents=True)
    shipped = yaml.safe_load((ROOT / "config/fedmitr_sp.yaml").read_text())["fedmitr_args"]
    args = {**FedMITRConfig().__dict__, **shipped, "seed": server_seed,
            "distill_epochs": shipped["distill_epochs"] if distill_epochs is None else distill_epochs,
            "output_dir": "elsewhere", "save_images": False}
    (out / "summary.json").write_text(json.dumps({
        "test_acc": 0.75, "ensemble_acc": 0.85, "client_test_acc": [0.5], "random_seed": seed,
        "uploads_file": f"fedmitr_output/shipped/sp_s{seed}/state/uploads.pt",
        "config": {"fedmitr_args": args}, "metrics": {"pool": {"fit": 0.9}}, "timings": {"total_s": 300.0}}))


def test_server_seeds_read_a_finished_run_with_the_same_settings_and_rerun_any_other(tmp_path, monkeypatch):
    (tmp_path / "config").mkdir()
    (tmp_path / "config/fedmitr_sp.yaml").write_text((ROOT / "config/fedmitr_sp.yaml").read_text())
    monkeypatch.setattr(shipped_configs, "ROOT", tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(SystemExit, match="uploads.pt does not exist"):
        shipped_configs.server_seed_run("sp", 1, 11, "python", work)
    with pytest.raises(SystemExit, match="stock_main"):
        shipped_configs.server_seed_run("stock_main", 1, 11, "python", work)
    (tmp_path / "fedmitr_output/shipped/sp_s1/state").mkdir(parents=True)
    (tmp_path / "fedmitr_output/shipped/sp_s1/state/uploads.pt").write_bytes(b"")
    _finished_server_run(tmp_path, 1, 11)
    r = shipped_configs.server_seed_run("sp", 1, 11, "false", work)   # "false": a rerun would fail
    assert r["reused"] and r["server_seed"] == 11 and abs(r["ratio"] - 0.75 / 0.85) < 1e-9 and r["pool_fit"] == 0.9
    assert r["missed_classes"] is None       # a summary written before the collapse measure
    # the same server seed under another budget is not that run: it is rerun (and "false" exits 1)
    with pytest.raises(SystemExit, match="server seed 11.*exited with 1"):
        shipped_configs.server_seed_run("sp", 1, 11, "false", work, {"distill_epochs": 90})
    _finished_server_run(tmp_path, 1, 12, distill_epochs=90)
    with pytest.raises(SystemExit, match="server seed 12.*exited with 1"):
        shipped_configs.server_seed_run("sp", 1, 12, "false", work)


def test_the_server_seed_table_counts_the_draws_that_keep_the_bar():
    rows = [{"config": "sp", "seed": 1, "server_seed": s, "test_acc": t, "ensemble_acc": 0.5, "ratio": t / 0.5,
             "pool_fit": 0.9, "missed_classes": m, "missed_ensemble_acc": a}
            for s, t, m, a in ((1, 0.48, [], []), (11, 0.40, [7], [0.5]), (12, 0.46, [], []))]
    md = shipped_configs.server_seed_markdown(rows, "abc", "--configs sp --seeds 1 --server-seeds 1 11 12",
                                              {"kd_target_confidence": 0})
    assert "| sp | 1 | 11 | 40.0 | 50.0 | 0.80 | no | 0.90 | 7 (50%) |" in md
    assert "| sp | 1 | 1 | 48.0 | 50.0 | 0.96 | yes | 0.90 | none |" in md
    assert "| sp | 1 | all 3 | 44.7 | 50.0 | 0.89 (0.80 - 0.96) | 2 of 3 | | |" in md
    assert "`fedmitr_args.kd_target_confidence: 0`" in md      # the --set keys are named


def _write_result(monkeypatch, tmp_path, name, runs, overrides=None):
    monkeypatch.setattr(shipped_configs, "RESULTS", tmp_path)
    rows = [{"config": c, "seed": s, "test_acc": t, "ensemble_acc": 0.9, "ratio": t / 0.9,
             "client_test_acc": clients, "wall_s": 120.0} for c, s, t, clients in runs]
    (tmp_path / f"{name}.json").write_text(json.dumps({"commit": "abc", "configs": [], "seeds": [],
                                                       "overrides": overrides or {}, "bar": 0.9, "runs": rows}))


def test_change_pairs_runs_by_config_and_seed_and_counts_a_repeated_run_once(monkeypatch, tmp_path):
    cl = [0.5, 0.6]
    _write_result(monkeypatch, tmp_path, "a1", [("sp", 0, 0.80, cl), ("sp", 1, 0.70, cl)])
    _write_result(monkeypatch, tmp_path, "a2", [("mpi", 0, 0.85, cl), ("cross_silo", 0, 0.85, cl)])
    _write_result(monkeypatch, tmp_path, "b", [("sp", 0, 0.82, cl), ("sp", 1, 0.81, cl), ("mpi", 0, 0.86, cl),
                                               ("cross_silo", 0, 0.86, cl), ("stock_main", 0, 0.9, cl)],
                  {"distill_epochs": 360})
    shipped_configs.main(["--change", "a1,a2", "b", "--name", "diff"])
    t = json.loads((tmp_path / "diff.json").read_text())
    assert [(r["config"], r["seed"]) for r in t["rows"]] == [("sp", 0), ("sp", 1), ("mpi", 0), ("cross_silo", 0)]
    assert [r["repeats"] for r in t["rows"]] == [None, None, None, "mpi"]
    assert t["distinct_runs"] == 3 and t["all_distinct"]["per_seed"] == pytest.approx([2.0, 11.0, 1.0])
    sp = next(c for c in t["configs"] if c["config"] == "sp")
    assert sp["change"]["mean_diff"] == pytest.approx(6.5) and not sp["base_every_seed"] and sp["other_every_seed"]
    md = (tmp_path / "diff.md").read_text()
    assert "| cross_silo | 0 | 85.0 | 86.0 | +1.0 (repeats mpi) |" in md and "{'distill_epochs': 360}" in md


@pytest.mark.parametrize("case", ["other_uploads", "twice", "mixed_overrides", "missing"])
def test_change_refuses_what_it_cannot_pair_by_name(monkeypatch, tmp_path, case):
    _write_result(monkeypatch, tmp_path, "a", [("sp", 0, 0.8, [0.5, 0.6])])
    _write_result(monkeypatch, tmp_path, "b", [("sp", 0, 0.8, [0.5, 0.7] if case == "other_uploads" else [0.5, 0.6])])
    _write_result(monkeypatch, tmp_path, "c", [("sp", 0 if case == "twice" else 1, 0.8, [0.5, 0.6])],
                  {"distill_epochs": 360} if case == "mixed_overrides" else None)
    other = {"other_uploads": "b", "twice": "b,c", "mixed_overrides": "b,c", "missing": "nope"}[case]
    match = {"other_uploads": "different client uploads", "twice": "config sp seed 0 is in c and in b",
             "mixed_overrides": "different --set overrides", "missing": "no result nope.json"}[case]
    with pytest.raises(SystemExit, match=match):
        shipped_configs.main(["--change", "a", other, "--name", "diff"])


def test_teacher_classes_reports_holders_within_class_accuracy_and_what_the_ensemble_answers():
    import teacher_classes
    import torch

    class TwoClients:
        """Client 0 holds classes 0 and 1, client 1 holds class 2; the ensemble answers class 2 always."""
        def client_logits(self, x):
            a = torch.stack([x[:, 0], -x[:, 0], torch.zeros_like(x[:, 0])], 1)     # class 0 if x > 0 else 1
            return torch.stack([a, torch.zeros_like(a)])

        def combine(self, logits):
            return torch.tensor([[0.0, 0.0, 1.0]]).expand(logits.shape[1], 3)

    x = torch.tensor([[1.0], [2.0], [-1.0], [1.0]])
    y = torch.tensor([0, 0, 1, 2])
    table = teacher_classes.class_table(TwoClients(), [[5, 5, 0], [0, 0, 5]], [(x, y)])
    assert table["accuracy"] == 0.25
    by_class = {r["class"]: r for r in table["classes"]}
    assert by_class[0]["holders"] == [0] and by_class[0]["holder_acc"] == [1.0]
    assert by_class[1]["holder_acc"] == [1.0] and by_class[1]["ensemble_acc"] == 0.0
    assert by_class[0]["answers"] == [0, 0, 2] and by_class[2]["ensemble_acc"] == 1.0
    assert by_class[0]["true_score"] == 0.0 and by_class[0]["winning_score"] == 1.0
    md = teacher_classes.markdown({"name": "t", "command": "c", "commit": "abc", "ensemble": {}, "table": table})
    assert "| 1 | 1 | 0 | 100% | 0% | 0 0 1 | 0.00 | 1.00 |" in md
