"""benchmarks/gpu_check.sh --dry-run: the prepared GPU check runs its steps at tiny sizes on the CPU
and writes the speed table and a FedMITR cell's summary as JSON."""
import json
import os
import subprocess

from conftest import PYTHON, ROOT


def test_gpu_check_dry_run_writes_its_two_results(tmp_path, tmp_home):
    env = dict(os.environ, GPU_CHECK_OUT=str(tmp_path / "results"), PYTHON=str(PYTHON), HOME=str(tmp_home))
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    speed = json.loads((tmp_path / "results" / "gpu_check_dryrun_speed.json").read_text())
    assert speed["device"] == "cpu"
    # one sparse timing per prune ratio: the config's default, then SMI's 0.3
    assert [e["prune_ratio"] for e in speed["inversion"]] == [0.15, 0.3]
    assert all(e["sparse_s"] > 0 and e["kept_tokens_final"] < e["tokens"] for e in speed["inversion"])
    assert [e["clients"] for e in speed["ensemble"]] == [2, 3]
    cell = json.loads((tmp_path / "results" / "gpu_check_dryrun_cell.json").read_text())
    assert cell["optimizer"] == "FedMITR" and 0.0 <= cell["test_acc"] <= 1.0
    assert cell["config"]["fedmitr_args"]["autocast"] == "auto"


def test_gpu_check_without_a_gpu_says_so(tmp_path, tmp_home):
    import torch
    if torch.cuda.is_available():
        return
    env = dict(os.environ, GPU_CHECK_OUT=str(tmp_path), PYTHON=str(PYTHON), HOME=str(tmp_home))
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no CUDA device" in p.stderr and "--dry-run" in p.stderr
