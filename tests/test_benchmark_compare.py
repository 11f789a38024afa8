"""Smoke test of benchmarks/compare.py: digits, 3 clients, tiny scale, two methods, one seed.

The first invocation trains the clients and the central model and runs each method in its own
child process; the second must reuse everything from the cache (no retraining)."""
import importlib.util
import json
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
                "central_train", "server", "budget", "student_init"):
        assert key in st, key
    assert (st["dataset"], st["partition"], st["alpha"], st["clients"], st["seed"], st["backbone"], st["scale"]) == \
        ("digits", "hetero", 0.5, 3, [0], "scratch", "tiny")
    assert st["server"]["num_synthetic"] == st["budget"]["synthetic_images"]
    assert st["server"]["gen_epochs"] * st["server"]["gen_batch_size"] >= st["server"]["num_synthetic"]
    assert "how" in st["budget"]
    assert "compare.py" in result["command"] and "--scale tiny" in result["command"]

    # ---- records: every requested method, then the two references ----
    records = {r["method"]: r for r in result["records"]}
    assert [r["method"] for r in result["records"]] == METHODS + ["Ensemble", "Central"]
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
    assert records["FedMITR"]["num_synthetic"] == st["server"]["num_synthetic"]
    assert records["FedMITR"]["synthesis_s"] > 0 and records["FedMITR"]["images_per_s"] > 0
    assert records["FedMITR"]["ensemble_queries"] >= st["budget"]["synthesis_ensemble_queries"]
    assert records["OneShotFedAvg"]["num_synthetic"] == 0
    # the same client models under every method: the same ensemble accuracy
    assert records["FedMITR"]["ensemble_acc"] == pytest.approx(records["Ensemble"]["test_acc"])
    assert records["OneShotFedAvg"]["ensemble_acc"] == pytest.approx(records["Ensemble"]["test_acc"])
    assert 0.0 <= records["Central"]["test_acc"] <= 1.0
    assert len(result["clients"]["0"]["client_acc"]) == 3

    # ---- markdown table, written and printed ----
    md = md_path.read_text()
    assert "| method | test acc (%) | ensemble acc (%) | mean client acc (%) | synthesis (s) | images/s | " \
           "distillation (s) | peak memory (MB) |" in md
    for name in METHODS + ["Ensemble (reference)", "Central (reference)"]:
        assert f"| {name} |" in md
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
        "model": {"name": "m", "img_size": 16, "patch_size": 4},
        "budget": {"synthetic_images": 1, "synthesis_ensemble_queries": 1, "distill_steps": 1,
                   "distill_batch_size": 1}}})
    assert "| FedMITR (failed: seed 1) | 60.0 ± 10.0 | 50.0 / - / 70.0 |" in table
    assert "| method | test acc (%) | per seed | ensemble acc (%) |" in table


def _job(cmp, tmp_path, name):
    return cmp.Job("method", name, tmp_path / "server" / f"{name}.json", {"method": name}, tmp_path / f"{name}.log")


def _other_process(seconds=60):
    import subprocess
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_claims_keep_two_processes_off_the_same_job(tmp_path):
    """A job claimed by another live process is skipped (then waited for); a dead holder's claim is taken."""
    import argparse
    import os
    import socket
    cmp = load_compare()
    a, b = _job(cmp, tmp_path, "A"), _job(cmp, tmp_path, "B")
    other = _other_process()
    try:
        cmp.claim_path(a).parent.mkdir(parents=True)
        cmp.claim_path(a).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(), "since": "t"}))
        owner = cmp.try_claim(a)
        assert owner is not None and f"pid {other.pid}" in owner
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
    finally:
        other.kill()
        other.wait()

    # the holder died without releasing its claim: the claim is stale and taken over
    c = _job(cmp, tmp_path, "C")
    cmp.claim_path(c).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(), "since": "t"}))
    assert cmp.try_claim(c) is None
    assert json.loads(cmp.claim_path(c).read_text())["pid"] == os.getpid()
    # a claim on another host cannot be checked: it is respected, and the message says how to take it
    d = _job(cmp, tmp_path, "D")
    cmp.claim_path(d).write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "t"}))
    owner = cmp.try_claim(d)
    assert "host elsewhere" in owner and str(cmp.claim_path(d)) in owner
    cmp.release_claim(d)                           # not ours: left alone
    assert cmp.claim_path(d).exists()


def test_run_all_waits_for_a_job_another_process_runs(tmp_path):
    """run_all runs the free job, then waits for the claimed one until its record appears, and runs
    nothing twice (the 'other process' writes the record and exits)."""
    import argparse
    import socket
    import subprocess
    cmp = load_compare()
    a, b = _job(cmp, tmp_path, "A"), _job(cmp, tmp_path, "B")
    writer = subprocess.Popen([sys.executable, "-c", (
        "import json, sys, time; time.sleep(2); "
        f"open({str(a.out)!r}, 'w').write(json.dumps({{'ok': True, 'test_acc': 0.25}}))")])
    cmp.claim_path(a).parent.mkdir(parents=True)
    cmp.claim_path(a).write_text(json.dumps({"pid": writer.pid, "host": socket.gethostname(), "since": "t"}))
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
