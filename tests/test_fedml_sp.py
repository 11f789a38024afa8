"""Single-process simulation, end to end through ``python -m fedml_fedmitr`` (real FedML runtime),
run under an audit hook that records every network connection attempt: none may happen."""
from __future__ import annotations

import json
import time
from pathlib import Path

from conftest import PYTHON, check_summary, child_env, read_summary, tiny_config, write_yaml

# Runs a module like ``python -m`` after installing an audit hook that logs every socket
# connect / DNS lookup to a file (loopback included, so the test sees everything).
NETGUARD = r'''
import json, runpy, sys
log_path = sys.argv[1]
events = []
def hook(event, args):
    if event in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "socket.sendto"):
        try:
            detail = repr(args[1] if event in ("socket.connect", "socket.sendto") else args[0])
        except Exception:
            detail = "?"
        events.append([event, detail])
        with open(log_path, "w") as fh:
            json.dump(events, fh)
sys.addaudithook(hook)
open(log_path, "w").write("[]")
sys.argv = [sys.argv[2]] + sys.argv[3:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
'''


def test_sp_end_to_end_offline(tmp_path, tmp_home, procs):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "sp.yaml", tiny_config(out, train_args={"client_num_in_total": 3,
                                                                           "client_num_per_round": 3},
                                                       fedmitr_args={"save_images": True, "client_screening": True,
                                                                     "screening_images": 20,
                                                                     "screening_iters": 10,
                                                                     "screening_min_ratio": 0.6}))
    guard = tmp_path / "netguard.py"
    guard.write_text(NETGUARD)
    net_log = tmp_path / "net.json"
    start = time.time()
    p = procs.start([PYTHON, guard, net_log, "fedml_fedmitr", "--cf", cfg], child_env(tmp_home))
    rc = p.wait(timeout=240)
    assert rc == 0, p.output()[-5000:]
    summary = read_summary(out)
    check_summary(summary, "FedMITR", clients=3)
    assert summary["num_synthetic"] == 40
    assert summary["backend"] == "sp"
    assert summary["partition"]["method"] == "homo"
    assert len(summary["partition"]["label_counts"]) == 3
    # the poisoned-upload screen ran on the 3 honest clients and its verdict is in the summary
    screening = summary["screening"]
    assert screening["probe_images"] == 20 and len(screening["agreement"]) == 3
    dropped = {int(c) for c in summary["clients_dropped"]}
    assert sorted(set(screening["kept"]) | dropped) == [0, 1, 2] and len(screening["kept"]) >= 2
    assert summary["timings"]["total_s"] <= time.time() - start
    # the one summary line on stdout
    assert "FedMITR: test_acc=" in p.stdout, p.stdout
    # every client evaluated the model it received on its own test data
    for cid in range(3):
        rec = json.loads((out / "clients" / f"client_{cid}.json").read_text())
        assert rec["local_test_acc"] is not None and rec["local_test_samples"] > 0
    # the checkpoint rebuilds through the documented helper and scores what the summary says
    from types import SimpleNamespace

    import torch

    from fedml_fedmitr import load_data, load_global_model
    from fedml_fedmitr.core.evaluate import evaluate_model

    model = load_global_model(out / "global_model.pt")
    args = SimpleNamespace(dataset="digits", random_seed=0, img_size=16, client_num_in_total=3,
                           partition_method="homo", batch_size=32)
    dataset, classes = load_data(args)
    acc = evaluate_model(model, dataset[3], torch.device("cpu"), classes)["acc"]
    assert abs(acc - summary["test_acc"]) < 1e-6
    # offline: no connection attempt and no DNS lookup at all (FedML's cloud fetch_config is bypassed)
    events = json.loads(net_log.read_text())
    assert events == [], events
    # pictures and metrics a researcher expects (issue: show the work)
    from PIL import Image
    for name in ("label_distribution", "synthetic_grid", "synthetic_masks"):
        path = Path(summary["pictures"][name])
        assert path.is_file(), name
        Image.open(path).verify()
    history = json.loads((out / "metrics_history.json").read_text())
    assert history["inversion/loss"] and history["inversion/kept_tokens"]
    assert [step for step, _ in history["distill/loss"]] == list(range(len(history["distill/loss"])))
    assert len(summary["per_class_acc"]["global"]) == 10 and len(summary["per_class_acc"]["ensemble"]) == 10
    # what each model predicts, per class, over the 360 test images, and the collapse measure read from it
    assert sum(summary["predicted_per_class"]["global"]) == 360 == sum(summary["predicted_per_class"]["ensemble"])
    assert summary["missed_classes"] == [c for c in range(10) if summary["per_class_acc"]["ensemble"][c] > 0
                                         and summary["predicted_per_class"]["global"][c] == 0]
    assert history["summary/test_acc"] == [[0, summary["test_acc"]]]
    assert "summary/per_class_acc/ensemble/9" in history and "summary/timings/synthesis_s" in history
