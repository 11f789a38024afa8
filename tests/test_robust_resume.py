"""Checkpoint and resume: a real server process (single-process simulation, digits) is SIGKILLed
during synthesis and again during distillation, restarted with ``fedmitr_args.resume: true``, and
ends with the bit-identical global model of a run never interrupted; the resumed runs train no
client (the saved uploads are enough). The same saved uploads let ``server_only`` rerun the server
alone with another method."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, Proc, child_env, tiny_config, wait_for, write_yaml

BATCHES, EPOCHS = 6, 12
SERVER = {"num_synthetic": 60, "synthesis_batch_size": 10, "inversion_iters": 20, "distill_epochs": EPOCHS,
          "distill_batch_size": 20}


def _config(out: Path, **fedmitr) -> dict:
    return tiny_config(out, common_args={"torch_num_threads": 1}, train_args={"epochs": 2},
                       fedmitr_args={**SERVER, **fedmitr})


def _state(path: Path) -> dict:
    return torch.load(str(path), map_location="cpu", weights_only=False)["state_dict"]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of the same config (and its saved uploads, for server_only)."""
    root = tmp_path_factory.mktemp("reference")
    home = root / "home"
    home.mkdir()
    out = root / "out"
    cfg = write_yaml(root / "sp.yaml", _config(out))
    p = Proc([PYTHON, "-m", "fedml_fedmitr", "--cf", cfg], child_env(home), cwd=root, log_path=root / "run.log")
    try:
        rc = p.wait(timeout=240)
        assert rc == 0, p.output()[-5000:]
    finally:
        p.close()
    return {"out": out, "cfg": cfg, "home": home, "model": _state(out / "global_model.pt"),
            "summary": json.loads((out / "summary.json").read_text())}


def _start(procs, tmp_path, home, cfg, name):
    return procs.start([PYTHON, "-m", "fedml_fedmitr", "--cf", cfg], child_env(home), log_path=tmp_path / f"{name}.log")


def test_killed_server_resumes_bit_identical(reference, tmp_path, tmp_home, procs):
    out = tmp_path / "out"
    state = out / "state"
    fresh = write_yaml(tmp_path / "fresh.yaml", _config(out))
    resume = write_yaml(tmp_path / "resume.yaml", _config(out, resume=True))

    # 1. killed during synthesis: some but not all batches are checkpointed
    p1 = _start(procs, tmp_path, tmp_home, fresh, "run1")
    wait_for(lambda: (state / "FedMITR_pool.pt").is_file(), 180, 0.02, "the first synthesis checkpoint", [p1])
    p1.kill()
    p1.p.wait(timeout=10)
    assert (state / "uploads.pt").is_file()  # saved before the server's long work
    done = len(torch.load(str(state / "FedMITR_pool.pt"), weights_only=False)["batches"])
    assert 1 <= done < BATCHES, done
    assert not (out / "global_model.pt").exists()

    # 2. resumed, then killed during distillation
    p2 = _start(procs, tmp_path, tmp_home, resume, "run2")
    wait_for(lambda: (state / "FedMITR_distill.pt").is_file(), 180, 0.02, "the first distillation checkpoint", [p2])
    p2.kill()
    p2.p.wait(timeout=10)
    epoch = torch.load(str(state / "FedMITR_distill.pt"), weights_only=False)["epoch"]
    assert 1 <= epoch < EPOCHS, epoch
    log2 = p2.output()
    assert f"resuming synthesis with {done * 10} images" in log2
    assert "trained on" not in log2  # no client trained again: the saved uploads were used

    # 3. resumed to the end: the same global model as the run never interrupted, bit for bit
    p3 = _start(procs, tmp_path, tmp_home, resume, "run3")
    assert p3.wait(timeout=240) == 0, p3.output()[-5000:]
    log3 = p3.output()
    assert "resuming distillation at epoch" in log3 and "trained on" not in log3
    assert _same(_state(out / "global_model.pt"), reference["model"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_acc"] == reference["summary"]["test_acc"]
    assert summary["client_ids"] == [0, 1] and summary["clients_missing"] == []
    assert summary["uploads_file"] == str(state / "uploads.pt")


def test_server_only_reruns_saved_uploads_with_another_method(reference, tmp_path, procs):
    from fedml_fedmitr.core.methods.base import ClientUpload
    from fedml_fedmitr.core.models import fedavg_state_dict
    from fedml_fedmitr.fedml_adapter.state import load_uploads

    other = tmp_path / "fedavg"
    p = procs.start([PYTHON, "-m", "fedml_fedmitr.server_only", "--cf", reference["cfg"], "--optimizer",
                     "OneShotFedAvg", "--output_dir", other], child_env(reference["home"]),
                    log_path=tmp_path / "server_only.log")
    assert p.wait(timeout=180) == 0, p.output()[-5000:]
    summary = json.loads((other / "summary.json").read_text())
    assert summary["optimizer"] == "OneShotFedAvg" and summary["client_ids"] == [0, 1]
    assert summary["uploads_file"] == str(reference["out"] / "state" / "uploads.pt")
    assert "trained on" not in p.output()  # no client
    uploads = [ClientUpload.from_payload(x) for x in load_uploads(reference["out"] / "state" / "uploads.pt")["uploads"]]
    assert _same(_state(other / "global_model.pt"), fedavg_state_dict(uploads))
    assert _same(_state(reference["out"] / "global_model.pt"), reference["model"])  # the first run's results stay


def test_resume_refuses_checkpoints_of_other_settings(tmp_path):
    """A resumed method never mixes checkpoints of another run; a fresh run removes old ones."""
    from fedml_fedmitr.fedml_adapter.errors import StateError
    from fedml_fedmitr.fedml_adapter.state import prepare_method_state

    fp = {"method": "FedMITR", "fedmitr_args": {"distill_epochs": 12}, "seed": 0, "uploads": "abc"}
    prepare_method_state(tmp_path, "FedMITR", fp, resume=False)
    (tmp_path / "FedMITR_pool.pt").write_bytes(b"x")
    prepare_method_state(tmp_path, "FedMITR", fp, resume=True)  # same settings: resumes
    assert (tmp_path / "FedMITR_pool.pt").exists()
    other = {**fp, "fedmitr_args": {"distill_epochs": 3}}
    with pytest.raises(StateError, match=r"differs in: fedmitr_args\.distill_epochs.*resume: false"):
        prepare_method_state(tmp_path, "FedMITR", other, resume=True)
    with pytest.raises(StateError, match="differs in: uploads"):
        prepare_method_state(tmp_path, "FedMITR", {**fp, "uploads": "def"}, resume=True)
    prepare_method_state(tmp_path, "FedMITR", other, resume=False)  # fresh: old checkpoints go
    assert not (tmp_path / "FedMITR_pool.pt").exists()
    assert json.loads((tmp_path / "FedMITR_run.json").read_text())["fedmitr_args"]["distill_epochs"] == 3
