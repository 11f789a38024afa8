"""Smoke test of benchmarks/compare.py: digits, 3 clients, tiny scale, two methods, one seed.

The first invocation trains the clients and the central model and runs each method in its own
child process; the second must reuse everything from the cache (no retraining)."""
import importlib.util
import json
import math
import sys
import time

import pytest

from conftest import PYTHON, ROOT, child_env

SCRIPT = ROOT / "benchmarks" / "compare.py"
METHODS = ["OneShotFedAvg", "FedMITR"]
NAME = "compare_digits_hetero-a0.5_K3_scratch_tiny"


def load_compare():
    spec = importlib.util.spec_from_file_location("bench_compare", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run(procs, home, tmp_path, log_name, methods=METHODS, extra=()):
    cmd = [PYTHON, str(SCRIPT), "--dataset", "digits", "--clients", "3", "--scale", "tiny", "--seeds", "0",
           "--methods", *methods, "--jobs", "2", "--cache-dir", str(tmp_path / "cache"),
           "--results-dir", str(tmp_path / "results"), *extra]
    p = procs.start(cmd, child_env(home), log_path=tmp_path / log_name)
    rc = p.wait(timeout=170)
    out = p.output()
    assert rc == 0, out[-4000:]
    return out


def test_compare_smoke_schema_table_and_cached_clients(procs, tmp_home, tmp_path):
    t = time.perf_counter()
    out = run(procs, tmp_home, tmp_path, "first.log")
    first_s = time.perf_counter() - t
    json_path = tmp_path / "results" / f"{NAME}.json"
    md_path = tmp_path / "results" / f"{NAME}.md"
    assert json_path.is_file() and md_path.is_file(), out[-2000:]
    result = json.loads(json_path.read_text())

    # ---- settings ----
    st = result["settings"]
    for key in ("dataset", "partition", "alpha", "clients", "seed", "backbone", "scale", "model", "client_train",
                "central_train", "server", "budget", "budget_detail", "student_init", "num_test", "split"):
        assert key in st, key
    assert (st["dataset"], st["partition"], st["alpha"], st["clients"], st["seed"], st["backbone"], st["scale"]) == \
        ("digits", "hetero", 0.5, 3, [0], "scratch", "tiny")
    assert st["budget"] == "queries" and st["split"] == "test"
    assert st["server"]["num_synthetic"] == st["budget_detail"]["synthetic_images"]
    assert st["server"]["gen_epochs"] * st["server"]["gen_batch_size"] >= st["server"]["num_synthetic"]
    assert "how" in st["budget_detail"]
    assert "compare.py" in result["command"] and "--scale tiny" in result["command"]
    # the plugin's data path: digits split 80/20 by the seed, as `python -m fedml_fedmitr` does
    assert st["num_test"] == 360
    # no absolute path of this machine in the result file (but the command line as typed)
    assert str(ROOT) not in json_path.read_text()
    assert str(tmp_path) not in json.dumps({k: v for k, v in result.items() if k not in ("command", "argv")})

    # ---- records: every requested method, the ensemble and central model, then the KD-real rows ----
    records = {r["method"]: r for r in result["records"]}
    assert [r["method"] for r in result["records"]] == METHODS + ["Ensemble", "Central", "KD-real", "KD-real-plain"]
    numeric = ["test_acc", "ensemble_acc", "client_acc_mean", "synthesis_s", "images_per_s", "distill_s",
               "peak_rss_mb"]
    for m in METHODS:
        r = records[m]
        for key in numeric:
            assert isinstance(r[key], float), (m, key, r[key])
            assert r[f"{key}_per_seed"] == [pytest.approx(r[key])]
        assert 0.0 <= r["test_acc"] <= 1.0 and 0.0 <= r["ensemble_acc"] <= 1.0
        assert r["peak_rss_mb"] > 50
        assert "errors" not in r
    # learning curve (one accuracy per distillation epoch) and start of the distilled rows
    for m in ("FedMITR", "KD-real", "KD-real-plain"):
        assert len(records[m]["curve"]["0"]) == st["server"]["distill_epochs"], m
        assert 0.0 <= records[m]["start_acc"] <= 1.0
    # the students start from the same one-shot FedAvg model
    assert records["FedMITR"]["start_acc"] == pytest.approx(records["OneShotFedAvg"]["test_acc"])
    assert records["KD-real"]["start_acc"] == pytest.approx(records["OneShotFedAvg"]["test_acc"])
    assert records["KD-real"]["kind"] == "reference" and records["KD-real"]["num_synthetic"] == st["server"]["num_synthetic"]
    # paired differences to FedMITR (one seed: no interval)
    d = records["OneShotFedAvg"]["paired_vs_fedmitr"]
    assert d["per_seed"] == [pytest.approx(100 * (records["FedMITR"]["test_acc"] - records["OneShotFedAvg"]["test_acc"]))]
    assert d["ci95"] is None and records["FedMITR"]["paired_vs_fedmitr"] is None
    refs = result["references"]
    assert refs["kd_real"]["test_acc"] == pytest.approx(records["KD-real"]["test_acc"])
    assert refs["kd_real_plain"]["test_acc_per_seed"] == [pytest.approx(records["KD-real-plain"]["test_acc"])]
    probe = refs["attention_probe"]
    assert probe["num_patches"] == 16 and 1 <= probe["k"] < 16
    assert all(0.0 <= probe[k] <= 1.0 for k in ("top_k", "random_k", "bottom_k"))
    assert records["FedMITR"]["num_synthetic"] == st["server"]["num_synthetic"]
    assert records["FedMITR"]["synthesis_s"] > 0 and records["FedMITR"]["images_per_s"] > 0
    assert records["FedMITR"]["ensemble_queries"] >= st["budget_detail"]["synthesis_ensemble_queries"]
    assert records["OneShotFedAvg"]["num_synthetic"] == 0
    # each cached method record carries the machine speed it was timed at (for --budget time)
    raw = json.loads(next((tmp_path / "cache").rglob("FedMITR.json")).read_text())
    assert raw["speed_probe_s"] > 0
    # the same client models under every method: the same ensemble accuracy
    assert records["FedMITR"]["ensemble_acc"] == pytest.approx(records["Ensemble"]["test_acc"])
    assert records["OneShotFedAvg"]["ensemble_acc"] == pytest.approx(records["Ensemble"]["test_acc"])
    assert 0.0 <= records["Central"]["test_acc"] <= 1.0
    assert len(result["clients"]["0"]["client_acc"]) == 3

    # ---- markdown table, written and printed ----
    md = md_path.read_text()
    assert "| method | test acc (%) | ensemble acc (%) | mean client acc (%) | synthesis (s) | images/s | " \
           "distillation (s) | peak memory (MB) |" in md
    for name in METHODS + ["Ensemble (reference)", "Central (reference)", "KD-real (reference)"]:
        assert f"| {name} |" in md
    assert "| OneShotFedAvg | " in md.split("FedMITR minus each row")[1] and "Attention probe" in md
    assert "| FedMITR |" in out

    # ---- second invocation: nothing retrained ----
    clients_pt = next((tmp_path / "cache").rglob("clients.pt"))
    mtime = clients_pt.stat().st_mtime_ns
    t = time.perf_counter()
    out2 = run(procs, tmp_home, tmp_path, "second.log")
    second_s = time.perf_counter() - t
    assert "reusing cached clients" in out2
    assert "done clients" not in out2 and "done FedMITR" not in out2
    assert clients_pt.stat().st_mtime_ns == mtime
    assert second_s < first_s
    again = json.loads(json_path.read_text())
    assert again["records"][1]["test_acc"] == records["FedMITR"]["test_acc"]

    # ---- --report-only: tabulates the cache, runs nothing, marks the missing method ----
    out3 = run(procs, tmp_home, tmp_path, "third.log", methods=METHODS + ["DeepInversion"],
               extra=["--report-only"])
    assert "done " not in out3 and "not run yet" in out3
    assert not list((tmp_path / "cache").rglob("DeepInversion.json"))
    third = {r["method"]: r for r in json.loads(json_path.read_text())["records"]}
    assert third["DeepInversion"]["not_run"] == [0] and third["DeepInversion"]["test_acc"] is None
    assert "errors" not in third["DeepInversion"]
    assert third["FedMITR"]["test_acc"] == records["FedMITR"]["test_acc"]
    assert "--report-only" not in json.loads(json_path.read_text())["command"]
    assert "| DeepInversion (not run yet: seed 0) |" in md_path.read_text()


def test_budget_matching_and_seed_aggregation():
    cmp = load_compare()
    server = dict(num_synthetic=100, distill_batch_size=32, distill_epochs=3, inversion_iters=40, gen_epochs=4)
    budget = cmp.derive_budget(server, explicit=[])
    assert server["gen_batch_size"] == 25 and server["gen_steps"] == 40
    assert budget["distill_steps"] == 3 * 4 and server["gen_kd_steps"] == 3
    assert budget["generator_ensemble_queries"] == budget["synthesis_ensemble_queries"] == 4000
    kept = dict(server, gen_steps=7)
    cmp.derive_budget(kept, explicit=["gen_steps"])
    assert kept["gen_steps"] == 7

    per_seed = {"FedMITR": {0: {"test_acc": 0.5, "peak_rss_mb": 100.0}, 2: {"test_acc": 0.7, "peak_rss_mb": 120.0}}}
    rows = cmp.aggregate_rows(per_seed, ["FedMITR"], [0, 1, 2], {"FedMITR": {1: "exit 1"}})
    row = rows[0]
    assert row["test_acc"] == pytest.approx(0.6) and row["test_acc_std"] == pytest.approx(0.1)
    assert row["test_acc_per_seed"] == [0.5, None, 0.7]
    assert row["seeds"] == [0, 2] and row["errors"] == {"1": "exit 1"}
    assert row["synthesis_s"] is None
    table = cmp.markdown({"name": "x", "command": "python benchmarks/compare.py", "records": rows, "settings": {
        "partition": "hetero", "alpha": 0.5, "classes_per_client": None, "seed": [0, 1, 2], "data_name": "digits",
        "num_classes": 10, "clients": 3, "backbone": "scratch", "scale": "tiny", "student_init": "fedavg",
        "model": {"name": "m", "img_size": 16, "patch_size": 4}, "budget": "queries",
        "budget_detail": {"synthetic_images": 1, "synthesis_ensemble_queries": 1, "distill_steps": 1,
                          "distill_batch_size": 1}}})
    assert "| FedMITR (failed: seed 1) | 60.0 ± 10.0 | 50.0 / - / 70.0 |" in table
    assert "| method | test acc (%) | per seed | ensemble acc (%) |" in table
    assert "Central:" not in table   # the budget line explains only rows the table has

    # paired differences: FedMITR minus a method over the seeds both ran, with a t interval
    per_seed = {"FedMITR": {0: {"test_acc": 0.50}, 1: {"test_acc": 0.60}, 2: {"test_acc": 0.70}},
                "DENSE": {0: {"test_acc": 0.40}, 1: {"test_acc": 0.55}, 2: {"test_acc": 0.62}}}
    rows = {r["method"]: r for r in cmp.aggregate_rows(per_seed, ["FedMITR", "DENSE"], [0, 1, 2], {})}
    d = rows["DENSE"]["paired_vs_fedmitr"]
    assert d["per_seed"] == [pytest.approx(10.0), pytest.approx(5.0), pytest.approx(8.0)]
    assert d["mean_diff"] == pytest.approx(23 / 3)
    half = 4.302653 * math.sqrt(((10 - 23 / 3) ** 2 + (5 - 23 / 3) ** 2 + (8 - 23 / 3) ** 2) / 2) / math.sqrt(3)
    assert d["ci95"] == [pytest.approx(23 / 3 - half, abs=1e-3), pytest.approx(23 / 3 + half, abs=1e-3)]
    assert d["ci95"][0] > 0     # FedMITR higher on every seed, by enough: the order holds


def _job(cmp, tmp_path, name):
    return cmp.Job("method", name, tmp_path / "server" / f"{name}.json", {"method": name}, tmp_path / f"{name}.log")


def _hold_lock(job, seconds=60):
    """Another process holding ``job``'s lock (as a second compare.py running it would)."""
    import subprocess
    job.out.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from filelock import FileLock; "
        f"l = FileLock({str(job.out.with_name(job.out.stem + '.lock'))!r}); l.acquire(); "
        "print('held', flush=True); time.sleep(float(sys.argv[1]))"), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_claims_keep_two_processes_off_the_same_job(tmp_path):
    """A job locked by another live process is skipped (then waited for); when that process dies
    without releasing it, the OS frees the lock and the job is taken."""
    import argparse
    import os
    cmp = load_compare()
    a, b = _job(cmp, tmp_path, "A"), _job(cmp, tmp_path, "B")
    other = _hold_lock(a)
    try:
        owner = cmp.try_claim(a)
        assert owner is not None and "A.lock" in owner
        assert cmp.try_claim(b) is None
        assert json.loads(cmp.claim_path(b).read_text())["pid"] == os.getpid()
        assert cmp.try_claim(b) is None            # our own claim stays ours

        args = argparse.Namespace(jobs=1, force=False, report_only=False, no_progress=True, threads=1,
                                  job_timeout=0)
        runner = cmp.Runner({}, args, total=2)
        cmp.release_claim(b)
        assert not cmp.claim_path(b).exists()
        queue = [a, b]
        assert runner._pick(queue) is b and queue == [a]       # a is held by the other process
        assert runner._pick(queue) is cmp.WAIT and queue == [a]
        # the other process writes its record: a is reused, not run again
        a.out.write_text(json.dumps({"ok": True, "test_acc": 0.5}))
        assert runner._pick(queue) is a and a.cached and a.result["test_acc"] == 0.5 and queue == []
        assert runner._pick(queue) is None
        cmp.release_claim(b)
    finally:
        other.kill()
        other.wait()

    # the holder was killed without releasing: nothing stale is left behind, the job is free
    c = _job(cmp, tmp_path, "C")
    holder = _hold_lock(c)
    assert cmp.try_claim(c) is not None
    holder.kill()
    holder.wait()
    assert cmp.try_claim(c) is None
    cmp.release_claim(c)


def test_run_all_waits_for_a_job_another_process_runs(tmp_path):
    """run_all runs the free job, then waits for the claimed one until its record appears, and runs
    nothing twice (the 'other process' writes the record and exits)."""
    import argparse
    import subprocess
    cmp = load_compare()
    a, b = _job(cmp, tmp_path, "A"), _job(cmp, tmp_path, "B")
    a.out.parent.mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-c", (
        "import json, sys, time; from filelock import FileLock; "
        f"l = FileLock({str(a.out.with_name('A.lock'))!r}); l.acquire(); print('held', flush=True); time.sleep(2); "
        f"open({str(a.out)!r}, 'w').write(json.dumps({{'ok': True, 'test_acc': 0.25}}))")], stdout=subprocess.PIPE,
        text=True)
    assert writer.stdout.readline().strip() == "held"
    args = argparse.Namespace(jobs=2, force=False, report_only=False, no_progress=True, threads=1, job_timeout=0)
    runner = cmp.Runner({}, args, total=2)
    runner.poll_s = 0.2
    ran = []

    def fake_run_one(job):           # stands in for the child process of one job
        ran.append(job.name)
        job.result = {"ok": True, "test_acc": 0.75}
        job.out.write_text(json.dumps(job.result))

    runner._run_one = fake_run_one
    try:
        runner.run_all([a, b], "server methods")
    finally:
        writer.wait(timeout=30)
    assert ran == ["B"]
    assert a.cached and a.result["test_acc"] == 0.25 and b.result["test_acc"] == 0.75
    assert not cmp.claim_path(b).exists()          # released after the run


def test_time_budget_turns_the_reference_seconds_into_images(tmp_path):
    """--budget time: every synthesis method gets the seconds the reference took at the query budget,
    as many images (whole batches) as its own measured speed makes in them; the KD-real rows as many
    real images as FedMITR; a method without synthesis is unchanged (its query-budget record reused)."""
    cmp = load_compare()
    server = dict(num_synthetic=40, synthesis_batch_size=20, inversion_iters=10, distill_epochs=2,
                  distill_batch_size=20, gen_epochs=2, gen_batch_size=20, gen_steps=10, gen_kd_steps=2)
    settings = {"methods": ["FedMITR", "DeepInversion", "DENSE", "OneShotFedAvg"], "references": ["KD-real"],
                "time_reference": "DeepInversion", "server": server, "server_explicit": [], "threads_per_job": 1}
    timings = {"FedMITR": 2.5, "DeepInversion": 10.0, "DENSE": 20.0, "OneShotFedAvg": 0.0, "KD-real": 0.1}
    jobs = {}
    for m, sec in timings.items():
        jobs[m] = _job(cmp, tmp_path, m)
        jobs[m].result = {"ok": True, "synthesis_s": sec, "num_synthetic": 0 if m == "OneShotFedAvg" else 40}
    jobs["clients"] = cmp.Job("clients", "clients", tmp_path / "clients.json", {"checkpoint": "c.pt"}, tmp_path / "c.log")
    plan = {"seeds": {0: {"dir": tmp_path, "jobs": jobs}}}
    out = cmp.time_budget_jobs(settings, plan, 0)
    images = {m: out[m].spec["server_override"].get("num_synthetic") for m in settings["methods"] + ["KD-real"]}
    assert images == {"FedMITR": 160, "DeepInversion": 40, "DENSE": 20, "OneShotFedAvg": None, "KD-real": 160}
    assert out["DENSE"].spec["server_override"]["gen_batch_size"] == 10      # 2 generator epochs x 10 images
    assert out["FedMITR"].spec["server_override"]["gen_kd_steps"] == 8       # 2 epochs x 8 batches, over 2
    assert out["_budget"] == {"seconds": 10.0, "images": {"FedMITR": 160, "DeepInversion": 40, "DENSE": 20},
                              "speed_ratio": {}, "speed_unchecked": ["FedMITR", "DENSE"]}   # no probe in these records
    # the reference's own time-budget job is its query-budget job (same knobs, same record path)
    skey = cmp.server_key(dict(settings, server=server))
    assert out["DeepInversion"].out.parent.name == f"server-{skey}"
    assert out["OneShotFedAvg"].out.parent.name == f"server-{skey}"
    jobs["DeepInversion"].result = None
    with pytest.raises(RuntimeError, match="DeepInversion"):
        cmp.time_budget_jobs(settings, plan, 0)


def test_time_budget_refuses_records_timed_at_another_machine_speed(tmp_path):
    """The time budget multiplies the reference's seconds by each method's images per second: records of
    one seed timed on machines of different speed (a suite resumed elsewhere) are refused, naming the
    records to recompute; the same speed within the tolerance passes and is recorded in the budget."""
    cmp = load_compare()
    server = dict(num_synthetic=40, synthesis_batch_size=20, inversion_iters=10, distill_epochs=2,
                  distill_batch_size=20, gen_epochs=2, gen_batch_size=20, gen_steps=10, gen_kd_steps=2)
    settings = {"methods": ["FedMITR", "DeepInversion", "OneShotFedAvg"], "references": [],
                "time_reference": "DeepInversion", "server": server, "server_explicit": [], "threads_per_job": 1}
    jobs = {m: _job(cmp, tmp_path, m) for m in settings["methods"]}
    jobs["clients"] = cmp.Job("clients", "clients", tmp_path / "clients.json", {"checkpoint": "c.pt"}, tmp_path / "c.log")
    plan = {"seeds": {0: {"dir": tmp_path, "jobs": jobs}}}

    def timed(fedmitr_probe):
        jobs["FedMITR"].result = {"ok": True, "synthesis_s": 2.5, "num_synthetic": 40, "speed_probe_s": fedmitr_probe}
        jobs["DeepInversion"].result = {"ok": True, "synthesis_s": 10.0, "num_synthetic": 40, "speed_probe_s": 0.02}
        jobs["OneShotFedAvg"].result = {"ok": True, "synthesis_s": 0.0, "num_synthetic": 0, "speed_probe_s": 0.05}
        return cmp.time_budget_jobs(settings, plan, 0)

    out = timed(0.022)                 # 10% slower: one machine
    assert out["_budget"]["speed_ratio"] == {"FedMITR": pytest.approx(1.1)}
    assert out["_budget"]["speed_unchecked"] == [] and out["_budget"]["images"]["FedMITR"] == 160
    with pytest.raises(RuntimeError, match=r"seed 0: .*FedMITR \(0\.50x DeepInversion's.*delete .*FedMITR\.json"):
        timed(0.01)                    # timed on a machine twice as fast
    with pytest.raises(RuntimeError, match="FedMITR"):
        timed(0.032)                   # 1.6x slower
    # the table says what was checked
    from fedbench.report import speed_words
    assert "1.10-1.10x" in speed_words({"0": out["_budget"]})
    assert "not checked on seed(s) 3" in speed_words({"0": out["_budget"], "3": {"speed_unchecked": ["DENSE"]}})
    assert speed_words({}) == ""


def test_the_speed_probe_times_the_model_and_leaves_the_random_stream_alone():
    load_compare()
    import torch

    from fedbench.jobs import speed_probe
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    seconds = speed_probe(lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 5)), (3, 4, 4),
                          torch.device("cpu"), batch=8, repeats=3)
    assert seconds > 0
    assert torch.equal(torch.rand(4), expected)      # the method after the probe draws what it would have


def test_the_table_names_the_teacher_the_server_settings_chose():
    load_compare()   # puts benchmarks/ on the path
    from fedbench.report import teacher_words
    assert teacher_words({"ensemble_weighting": "mean", "ensemble_calibration": "none"}) == "mean of the client logits"
    default = teacher_words({})          # per_class weights, calibration auto -> held_classes
    assert "per class" in default and "classes it holds" in default
    calibrated = teacher_words({"ensemble_calibration": "label_prior", "ensemble_weighting": "per_class"})
    assert "per class" in calibrated and "label prior" in calibrated
    robust = teacher_words({"ensemble_aggregate": "median"})     # auto resolves to no calibration
    assert "median" in robust and "classes it holds" not in robust


def test_a_method_set_knob_is_that_methods_alone(tmp_path):
    """--method-set METHOD:KEY=VALUE: one method runs with a knob of its own (as chosen for it on the
    validation split); its records are keyed by it, every other method's are the plain setting's, the
    time budget keeps it, the table says it; a budget knob, a knob the method does not use, a method
    that is not a row, or a malformed item is refused before any work."""
    cmp = load_compare()
    base = ["--dataset", "digits", "--clients", "3", "--scale", "tiny", "--seeds", "0",
            "--methods", "FedMITR", "DENSE", "--cache-dir", str(tmp_path / "cache")]

    def settings(*extra):
        return cmp.build_settings(cmp.build_parser().parse_args(base + list(extra)))

    plain = settings()
    tuned = settings("--method-set", "DENSE:baseline_kd_temperature=4")
    assert plain["method_server"] == {} and tuned["method_server"] == {"DENSE": {"baseline_kd_temperature": 4}}
    p, q = cmp.plan(plain, tmp_path / "cache")["seeds"][0]["jobs"], cmp.plan(tuned, tmp_path / "cache")["seeds"][0]["jobs"]
    assert q["FedMITR"].out == p["FedMITR"].out and q["KD-real"].out == p["KD-real"].out
    assert q["DENSE"].out != p["DENSE"].out
    assert q["DENSE"].spec["server_override"] == {"baseline_kd_temperature": 4}
    assert p["DENSE"].spec["server_override"] == {}

    # the time budget adds its image count to the method's own knob
    for m in ("FedMITR", "DeepInversion", "DENSE"):
        q.setdefault(m, _job(cmp, tmp_path, m))
        q[m].result = {"ok": True, "synthesis_s": 10.0, "num_synthetic": 40}
    timed = cmp.time_budget_jobs(dict(tuned, methods=["FedMITR", "DeepInversion", "DENSE"], references=[],
                                      time_reference="DeepInversion"), {"seeds": {0: {"dir": tmp_path, "jobs": q}}}, 0)
    assert timed["DENSE"].spec["server_override"]["baseline_kd_temperature"] == 4
    assert "num_synthetic" in timed["DENSE"].spec["server_override"]
    assert "baseline_kd_temperature" not in timed["FedMITR"].spec["server_override"]

    table = cmp.markdown({"name": "x", "command": "c", "settings": dict(tuned, num_classes=10, budget_detail=dict(
        synthetic_images=1, synthesis_ensemble_queries=1, distill_steps=1, distill_batch_size=1)), "records":
        cmp.aggregate_rows({"DENSE": {0: {"test_acc": 0.5}}}, ["DENSE"], [0], {})})
    assert "| DENSE {baseline_kd_temperature=4} | 50.0 |" in table
    assert "DENSE runs with baseline_kd_temperature=4 (--method-set)" in table

    for item, words in [("DENSE:num_synthetic=8", "num_synthetic is a budget knob"),
                        ("FedMITR:coboost_temperature=2", "FedMITR does not use"),
                        ("CoBoosting:coboost_temperature=2", "'CoBoosting' is not a row"),
                        ("DENSE:baseline_kd_temperature", "not METHOD:KEY=VALUE"),
                        ("DENSE:baseline_kd_temperature=-1", "baseline_kd_temperature"),
                        ("DENSE:seed=3", "set by the benchmark")]:
        with pytest.raises(SystemExit, match=words):
            settings("--method-set", item)
