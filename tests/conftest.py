"""Shared fixtures: a temporary HOME (FedML writes ~/.fedml), tiny FedML configs, and process
helpers that start real processes in their own process group, with a timeout, and kill every
process they started."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(PYTHON).parent


def _find_mpirun():
    cand = BIN / "mpirun"
    if cand.exists():
        return str(cand)
    import shutil
    return shutil.which("mpirun")


MPIRUN = _find_mpirun()


@pytest.fixture
def tmp_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def child_env(home: Path, **extra) -> dict:
    env = dict(os.environ)
    env.update({
        "HOME": str(home),
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "FEDMITR_TORCH_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "WANDB_MODE": "disabled",
        "no_proxy": "127.0.0.1,localhost",
        "NO_PROXY": "127.0.0.1,localhost",
    })
    env.pop("http_proxy", None)
    env.pop("https_proxy", None)
    env.pop("HTTP_PROXY", None)
    env.pop("HTTPS_PROXY", None)
    env.update({k: str(v) for k, v in extra.items()})
    if any(k.startswith("FEDMITR_TEST_") for k in extra):   # fault injection (tests/faults/sitecustomize.py)
        env["PYTHONPATH"] = str(ROOT / "tests" / "faults") + os.pathsep + env["PYTHONPATH"]
    return env


def tiny_config(output_dir: Path, **sections) -> dict:
    """A FedML config that runs in seconds: digits, homo split, 2 local epochs, tiny server."""
    cfg = {
        "common_args": {"training_type": "simulation", "random_seed": 0, "using_mlops": False},
        "data_args": {"dataset": "digits", "data_cache_dir": str(output_dir / "data"),
                      "partition_method": "homo", "partition_alpha": 0.5},
        "model_args": {"model": "fedmitr_vit_micro", "img_size": 16, "patch_size": 4},
        "train_args": {"federated_optimizer": "FedMITR", "client_num_in_total": 2, "client_num_per_round": 2,
                       "comm_round": 1, "epochs": 6, "batch_size": 16, "client_optimizer": "adamw",
                       "learning_rate": 0.001, "weight_decay": 0.01, "client_augment": False,
                       "client_flip": False},
        "validation_args": {"frequency_of_the_test": 1},
        "device_args": {"using_gpu": False, "gpu_id": 0},
        "comm_args": {"backend": "sp"},
        "tracking_args": {"enable_wandb": False},
        "fedmitr_args": {"output_dir": str(output_dir), "num_synthetic": 40, "synthesis_batch_size": 20,
                         "inversion_iters": 10, "prune_fractions": [0.1, 0.2, 0.35, 0.5],
                         "distill_epochs": 2, "distill_batch_size": 20, "progress": False,
                         "save_images": False},
    }
    for name, values in sections.items():
        if values is None:
            cfg.pop(name, None)
            continue
        cfg.setdefault(name, {})
        for key, value in values.items():
            if value is None:
                cfg[name].pop(key, None)
            else:
                cfg[name][key] = value
    return cfg


def write_yaml(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def free_ports(n: int):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _default_sigint():
    """In the child before exec: Ctrl-C at its default. A shell starts background jobs with SIGINT
    ignored, and a Python started that way never raises KeyboardInterrupt, so a suite run with `&`
    would see the Ctrl-C tests hang."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Proc:
    """A process started in its own session (process group); killed as a group on cleanup."""

    def __init__(self, cmd, env, cwd=None, log_path=None):
        self.cmd = [str(c) for c in cmd]
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.PIPE
        self.p = subprocess.Popen(self.cmd, env=env, cwd=str(cwd or ROOT), stdout=self._log,
                                  stderr=subprocess.STDOUT if log_path else subprocess.PIPE,
                                  start_new_session=True, preexec_fn=_default_sigint)

    def wait(self, timeout):
        try:
            out, err = self.p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.p.communicate()
            raise AssertionError(f"{' '.join(self.cmd)} timed out after {timeout} s\n{self.output()[-4000:]}") from None
        self.stdout = out.decode(errors="replace") if out else ""
        self.stderr = err.decode(errors="replace") if err else ""
        return self.p.returncode

    def output(self) -> str:
        if self.log_path:
            if hasattr(self._log, "flush"):
                self._log.flush()
            return Path(self.log_path).read_text(errors="replace")
        return (getattr(self, "stdout", "") or "") + (getattr(self, "stderr", "") or "")

    def kill(self):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            # the leader is gone; make sure nothing of its group survives
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self):
        self.kill()
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.log_path and hasattr(self._log, "close"):
            self._log.close()


@pytest.fixture
def procs(tmp_path):
    """Start processes with ``procs.start(cmd, env, ...)`` (working directory: the test's tmp_path);
    all are killed at the end of the test."""
    started = []

    class Starter:
        def start(self, cmd, env, cwd=None, log_path=None) -> Proc:
            p = Proc(cmd, env, cwd or tmp_path, log_path)
            started.append(p)
            return p

    yield Starter()
    for p in started:
        p.close()


def read_summary(output_dir: Path) -> dict:
    path = Path(output_dir) / "summary.json"
    assert path.is_file(), f"no {path}"
    return json.loads(path.read_text())


SUMMARY_KEYS = ["optimizer", "dataset", "client_num", "partition", "test_acc", "ensemble_acc",
                "client_test_acc", "num_synthetic", "timings", "config"]
TIMING_KEYS = ["local_train_s", "synthesis_s", "distill_s", "total_s"]


def check_summary(summary: dict, optimizer: str, clients: int, min_acc: float = 0.15,
                  min_ensemble_acc: float = 0.3, dataset: str = "digits") -> None:
    for key in SUMMARY_KEYS:
        assert key in summary, f"summary.json lacks {key}"
    for key in TIMING_KEYS:
        assert key in summary["timings"], f"summary.json timings lack {key}"
        assert summary["timings"][key] is not None and summary["timings"][key] >= 0
    assert summary["optimizer"] == optimizer
    assert summary["dataset"] == dataset
    assert summary["client_num"] == clients
    assert len(summary["client_test_acc"]) == clients
    assert summary["client_ids"] == list(range(clients))
    # 10 classes: chance is 0.1 (0.15 is 3 standard deviations above it on 360 test images)
    assert summary["test_acc"] > min_acc, summary["test_acc"]
    assert summary["ensemble_acc"] > min_ensemble_acc, summary["ensemble_acc"]
    assert sum(summary["client_test_acc"]) / clients > min_ensemble_acc, summary["client_test_acc"]
    assert Path(summary["checkpoint"]).is_file()
    assert summary["config"]["fedmitr_args"]["output_dir"]
    if not summary["config"]["fedmitr_args"].get("client_screening"):
        assert summary["screening"] is None and summary["clients_dropped"] == {}
    if optimizer == "FedMITR" or optimizer.startswith("FedMITR-") or optimizer == "DeepInversion":
        # what the pool taught, measured without test data (core/pool_stats.py)
        pool = summary["metrics"]["pool"]
        assert pool["size"] == summary["num_synthetic"]
        for key in ("labels", "ensemble_pred", "student_pred"):
            assert len(pool[key]) == 10 and sum(pool[key]) == pool["size"], key
        assert 0.0 <= pool["student_agreement"] <= 1.0 and pool["fit"] == summary["metrics"]["pool_ensemble_fit"]


# ---- helpers of the robustness tests (tests/test_robust_*.py) ------------------------------------
def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition", procs_alive=()):
    """Poll ``predicate`` until true (returns its value); AssertionError after ``timeout`` s or when one
    of ``procs_alive`` (Proc objects) exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs_alive:
            if p.p.poll() is not None:
                raise AssertionError(f"{what}: process exited with {p.p.returncode} first\n{p.output()[-4000:]}")
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def consecutive_free_ports(n: int) -> int:
    import random

    for _ in range(50):
        base = random.randint(20000, 60000)
        ok = True
        for port in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free loopback ports")


def error_lines(stderr: str):
    """The ``fedml_fedmitr: error:`` lines of a stderr text."""
    return [line for line in stderr.splitlines() if line.startswith("fedml_fedmitr: error:")]


def pytest_collection_modifyitems(config, items):
    """The layers of pytest.ini: core / process / mpi, from the test's file and fixtures."""
    for item in items:
        if item.fspath.basename.startswith("test_core_"):
            item.add_marker(pytest.mark.core)
        if "procs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.process)
        if "mpi" in item.name or "mpirun" in item.name:
            item.add_marker(pytest.mark.mpi)
