"""FedML tracking: with tracking_args.enable_wandb the server's metrics go through FedML's own calls
(wandb.log and fedml.mlops.log, recorded here by a local sink, wandb itself disabled); with tracking
off the plugin makes no tracking call; enable_tracking without FedML's platform keys is one line.
The tracked run is also the end-to-end run of an image folder and of mixed client architectures."""
import json

import pytest

from fedml_fedmitr import cli

from conftest import tiny_config, write_yaml


def _recorders(monkeypatch):
    import wandb
    from fedml import mlops

    seen = {"wandb": [], "mlops": []}

    def record(record, *a, **k):
        seen["wandb"].append(dict(record))
    real_init = wandb.init

    def init(*a, **k):   # FedML's wandb.init, then the run's wandb.log is recorded
        run = real_init(*a, **k)
        monkeypatch.setattr(wandb, "log", record)
        return run
    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb, "log", record)
    real = mlops.log

    def mlops_log(record, *a, **k):
        seen["mlops"].append(dict(record))
        return real(record, *a, **k)   # FedML's own: sends nothing without its platform
    monkeypatch.setattr(mlops, "log", mlops_log)
    return seen


def test_one_run_with_an_image_folder_two_client_architectures_and_tracking(tmp_path, tmp_home, monkeypatch):
    """One CLI run of the paper options together (one run keeps the suite short): an image folder
    (class names in summary.json), clients of two architectures in turn (client_models in
    summary.json), and the server's metrics through FedML's tracking calls."""
    from test_data_sources import write_imagefolder

    monkeypatch.setenv("WANDB_MODE", "disabled")   # wandb.init is FedML's; nothing leaves the machine
    seen = _recorders(monkeypatch)
    out = tmp_path / "out"
    root = write_imagefolder(tmp_path / "images", train=8)
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(
        out, data_args={"dataset": "imagefolder", "data_cache_dir": str(root)},
        model_args={"in_chans": 3, "client_models": ["fedmitr_vit_micro", "fedmitr_vit_tiny"]},
        train_args={"epochs": 1, "client_num_in_total": 3, "client_num_per_round": 3},
        tracking_args={"enable_wandb": True, "wandb_project": "t"}))
    assert cli.main(["--cf", str(cfg)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["class_names"] == ["cat", "dog", "fox"] and summary["dataset"] == "imagefolder"
    assert summary["config"]["data"]["input_shape"] == [3, 16, 16]
    assert summary["client_models"] == ["fedmitr_vit_micro", "fedmitr_vit_tiny", "fedmitr_vit_micro"]
    assert summary["model"]["model"] == "fedmitr_vit_micro" and len(summary["client_test_acc"]) == 3
    names = {k for record in seen["mlops"] for k in record if k != "fedmitr_step"}
    assert seen["wandb"] == [r for r in seen["mlops"] if "fedmitr_step" in r]   # the same records to both
    for name in ("distill/loss", "summary/test_acc", "summary/ensemble_acc", "summary/timings/synthesis_s"):
        assert name in names, sorted(names)[:20]
    assert any(n.endswith("/kept_tokens") for n in names) and any(n.startswith("summary/per_class_acc/") for n in names)
    logged = [r["summary/test_acc"] for r in seen["mlops"] if "summary/test_acc" in r]
    assert logged == [pytest.approx(summary["test_acc"])]


def test_no_sink_when_tracking_is_off_and_a_failing_sink_never_costs_the_run(tmp_path):
    from types import SimpleNamespace

    from fedml_fedmitr.core.report import ReportCallbacks
    from fedml_fedmitr.fedml_adapter.tracking import fedml_sink

    assert fedml_sink(SimpleNamespace(enable_wandb=False, enable_tracking=False)) is None
    assert fedml_sink(SimpleNamespace()) is None
    calls = []

    def sink(name, value, step):
        calls.append(name)
        raise ConnectionError("the tracking server is gone")
    cb = ReportCallbacks(tmp_path, progress=False, save_images=False, sink=sink)
    cb.metric("distill/loss", 1.0, 0)
    cb.metric("distill/loss", 0.5, 1)     # the sink was dropped after its failure; the history goes on
    assert calls == ["distill/loss"] and cb.history["distill/loss"] == [(0, 1.0), (1, 0.5)]


@pytest.mark.parametrize("tracking,words", [
    ({"enable_tracking": True}, "needs mlops_project_name and mlops_api_key"),
    ({"enable_wandb": True}, "needs tracking_args.wandb_project"),
    ({"enable_wandb": "yes"}, "tracking_args.enable_wandb = 'yes' is invalid"),
])
def test_tracking_settings_fedml_cannot_use_are_one_line(tmp_path, tmp_home, capfd, tracking, words):
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path / "out", tracking_args=tracking))
    assert cli.main(["--cf", str(cfg)]) == 2
    err = capfd.readouterr().err
    assert words in err and "Traceback" not in err, err[-2000:]
