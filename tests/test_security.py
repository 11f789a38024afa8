"""What the server trusts and what it refuses: settings it would not apply or cannot read as meant,
files written through planted symlinks, a second run on the same output_dir, ports already served,
and the errors and signals that must end in one line. (Messages: test_safe_messages.py.)"""
from __future__ import annotations

import json
import logging
import os
import signal
import stat
import sys
import time

import numpy as np
import pytest
import torch

from fedml_fedmitr import cli
from fedml_fedmitr.core.config import ConfigError

from conftest import PYTHON, child_env, error_lines, free_ports, tiny_config, wait_for, write_yaml


def _assert_one_line(capfd, rc, words):
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert rc == 2, err[-3000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# ---- settings -------------------------------------------------------------------------------
def test_duplicate_keys_and_sections_are_refused(tmp_path, tmp_home, capfd):
    text = write_yaml(tmp_path / "ok.yaml", tiny_config(tmp_path / "out")).read_text()
    dup_key = tmp_path / "dup_key.yaml"
    dup_key.write_text(text.replace("  epochs: 6\n", "  epochs: 6\n  epochs: 1\n"))
    assert _assert_one_line(capfd, cli.main(["--cf", str(dup_key)]), ["key 'epochs' appears twice", "dup_key.yaml"])
    dup_section = tmp_path / "dup_section.yaml"
    dup_section.write_text(text + "train_args:\n  epochs: 1\n")
    assert _assert_one_line(capfd, cli.main(["--cf", str(dup_section)]), ["section 'train_args' appears twice"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("section,key,value,hint", [
    ("data_args", "partition_alpah", 0.1, "did you mean 'partition_alpha'"),
    ("train_args", "epocs", 3, "did you mean 'epochs'"),
])
def test_misspelt_fedml_keys_get_did_you_mean(section, key, value, hint, tmp_path, tmp_home, capfd):
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path / "out", **{section: {key: value}}))
    assert _assert_one_line(capfd, cli.main(["--cf", str(cfg)]), [f"{section}.{key}", hint, "fedmitr_args.custom_keys"])


def test_custom_keys_pass_and_other_unknown_keys_warn(tmp_path, caplog):
    from fedml_fedmitr.fedml_adapter.run_checks import check_run_keys
    sections = tiny_config(tmp_path / "out", train_args={"epocs": 3, "my_lab_tag": "x"},
                           fedmitr_args={"custom_keys": ["epocs"]})
    assert check_run_keys(sections) == ["train_args.my_lab_tag"]   # returned to be warned about
    cfg = write_yaml(tmp_path / "c.yaml", sections)
    with caplog.at_level(logging.WARNING, logger="fedml_fedmitr"):
        cli.validate(str(cfg))
    warned = [r.getMessage() for r in caplog.records if "my_lab_tag" in r.getMessage()]
    assert len(warned) == 1 and "no effect" in warned[0]


@pytest.mark.parametrize("section,key", [("dp_args", "enable_dp"), ("defense_args", "enable_defense"),
                                         ("attack_args", "enable_attack")])
def test_fedml_features_not_applied_are_refused(section, key, tmp_path, tmp_home, capfd):
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path / "out", **{section: {key: True}}))
    assert _assert_one_line(capfd, cli.main(["--cf", str(cfg)]), [f"{section}.{key} = True", "does not apply", "set it to false"])


@pytest.mark.parametrize("sections,words", [
    ({"model_args": {"patch_size": 5}}, ["patch_size = 5 does not divide model_args.img_size = 16"]),
    ({"train_args": {"client_num_in_total": 3, "client_num_per_round": 1}},
     ["client_num_per_round = 1", "client_num_in_total = 3"]),
    ({"common_args": {"torch_num_threads": "two"}}, ["torch_num_threads = 'two'", "integer"]),
    ({"model_args": {"in_chans": "three"}}, ["in_chans = 'three'", "integer"]),
    ({"common_args": {"random_seed": -1}}, ["random_seed = -1", ">= 0"]),
    ({"fedmitr_args": {"output_dir": "/proc/fedmitr_out"}}, ["output_dir", "/proc/fedmitr_out"]),
    ({"fedmitr_args": {"auth_token": "short"}}, ["auth_token", "16 characters"]),
    ({"fedmitr_args": {"tls_cert_file": "missing.pem"}}, ["tls_cert_file = 'missing.pem'", "no such file"]),
])
def test_bad_run_settings_are_one_line(sections, words, tmp_path, tmp_home, capfd):
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path / "out", **sections))
    assert _assert_one_line(capfd, cli.main(["--cf", str(cfg)]), words)
    assert not (tmp_home / ".fedml").exists()   # refused before FedML started


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_using_gpu_without_a_gpu_is_refused(tmp_path, tmp_home, capfd):
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path / "out", device_args={"using_gpu": True}))
    assert _assert_one_line(capfd, cli.main(["--cf", str(cfg)]), ["using_gpu = true", "no CUDA device"])


def test_home_in_output_dir_is_expanded(tmp_home):
    from fedml_fedmitr.core.config import FedMITRConfig
    assert FedMITRConfig.from_dict({"output_dir": "~/runs"}).output_dir == str(tmp_home / "runs")


def test_corrupt_image_array_is_found_by_the_preflight(tmp_path, tmp_home, capfd):
    path = tmp_path / "d.npz"
    rng = np.random.default_rng(0)
    np.savez_compressed(path, x_train=rng.random((40, 1, 8, 8)).astype(np.float32), y_train=np.arange(40) % 2,
                        x_test=rng.random((10, 1, 8, 8)).astype(np.float32), y_test=np.arange(10) % 2)
    raw = bytearray(path.read_bytes())
    start = raw.index(b"x_train.npy") + 200   # inside the compressed x_train member
    raw[start:start + 64] = bytes(64)
    path.write_bytes(bytes(raw))
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(
        tmp_path / "out", data_args={"dataset": "npz", "npz_path": str(path)},
        model_args={"img_size": 8, "patch_size": 4}))
    assert _assert_one_line(capfd, cli.main(["--cf", str(cfg)]), ["npz_path", "x_train"])


def test_truncated_checkpoint_is_a_user_error_naming_the_file(tmp_path):
    from fedml_fedmitr.core.checkpoint import CheckpointError, load_if_exists, save_atomic
    from fedml_fedmitr.fedml_adapter.errors import is_user_error
    path = tmp_path / "FedMITR_distill.pt"
    save_atomic({"epoch": 3, "w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError, match="FedMITR_distill.pt") as info:
        load_if_exists(path)
    assert is_user_error(info.value)


# ---- files ----------------------------------------------------------------------------------
def test_writes_never_follow_symlinks_and_private_files_are_0600(tmp_path):
    from fedml_fedmitr.core.checkpoint import save_atomic, write_text
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("summary.json", "summary.json.tmp"):   # at the target and at its temporary name
        os.symlink(victim, out / name)
    write_text(out / "summary.json", "{}")
    assert victim.read_text() == "precious"
    assert not (out / "summary.json").is_symlink() and (out / "summary.json").read_text() == "{}"
    os.symlink(victim, out / "uploads.pt.tmp")
    save_atomic({"w": torch.ones(2)}, out / "uploads.pt")
    assert victim.read_text() == "precious"
    assert stat.S_IMODE(os.stat(out / "uploads.pt").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(out / "summary.json").st_mode) == 0o666 & ~_umask()   # an output: umask decides


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_real_run_writes_through_no_planted_symlink(tmp_path, tmp_home, capfd):
    """A whole sp run with symlinks planted at every output file it writes."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    (out / "state").mkdir(parents=True)
    names = ["global_model.pt", "summary.json.tmp", "metrics_history.json", "state/uploads.pt.tmp",
             "label_distribution.png", "summary.json"]
    for name in names:
        os.symlink(victim, out / name)
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(out, train_args={"epochs": 1},
                                                      fedmitr_args={"save_images": True}))
    assert cli.main(["--cf", str(cfg)]) == 0, capfd.readouterr().err[-3000:]
    assert victim.read_text() == "precious"
    for name in ("global_model.pt", "metrics_history.json", "label_distribution.png", "summary.json"):
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    # the previous run's planted state moved aside, this run's uploads are private
    assert stat.S_IMODE(os.stat(out / "state" / "uploads.pt").st_mode) == 0o600


# ---- faults ---------------------------------------------------------------------------------
HOLD = """
import sys, time
from fedml_fedmitr.fedml_adapter.state import lock_output_dir
lock_output_dir(sys.argv[1])
print("LOCKED", flush=True)
time.sleep(60)
"""


def test_a_second_run_on_the_same_output_dir_is_refused_naming_the_first(tmp_path, tmp_home, procs, capfd):
    out = tmp_path / "out"
    holder = procs.start([PYTHON, "-c", HOLD, out], child_env(tmp_home), log_path=tmp_path / "holder.log")
    wait_for(lambda: "LOCKED" in holder.output(), 60, 0.1, "the first run to lock", [holder])
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(out))
    assert _assert_one_line(capfd, cli.main(["--cf", str(cfg)]), ["is in use by another run", f"PID {holder.p.pid}"])
    holder.kill()
    holder.p.wait(10)
    from fedml_fedmitr.fedml_adapter.state import lock_output_dir, release_output_dir
    assert lock_output_dir(out) is True   # free again once the first run is gone
    release_output_dir(out)


def test_a_fresh_run_keeps_the_previous_state_aside(tmp_path):
    from fedml_fedmitr.fedml_adapter.state import set_aside_previous_state
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "FedMITR_distill.pt").write_bytes(b"old")
    moved = set_aside_previous_state(tmp_path)
    assert moved == tmp_path / "state.previous" and (moved / "FedMITR_distill.pt").read_bytes() == b"old"
    assert not (tmp_path / "state").exists()
    assert set_aside_previous_state(tmp_path) is None


def test_error_record_survives_an_exception_whose_details_is_a_method(tmp_path):
    class RpcLike(Exception):
        def details(self):
            return "connection refused"
    cli.write_error(str(tmp_path), 1, RpcLike("boom"), 1)
    record = json.loads((tmp_path / "clients" / "error_rank1.json").read_text())
    assert record["error"] == "boom"


def test_user_error_is_not_printed_twice_once_fedml_logs(tmp_path, capfd):
    log_file = tmp_path / "fedml.log"
    fh, sh = logging.FileHandler(log_file), logging.StreamHandler(sys.stdout)
    logging.root.addHandler(fh)
    logging.root.addHandler(sh)
    try:
        cli.report_user_error(ConfigError("train_args.epochs = 0 is invalid"))
    finally:
        logging.root.removeHandler(fh)
        logging.root.removeHandler(sh)
        fh.close()
    cap = capfd.readouterr()
    assert (cap.out + cap.err).count("epochs = 0 is invalid") == 1
    assert "epochs = 0 is invalid" in log_file.read_text()


def test_ipconfig_without_this_rank_or_a_served_port_is_refused(tmp_path):
    from types import SimpleNamespace

    from fedml_fedmitr.fedml_adapter.run_checks import check_grpc_endpoint
    ports = free_ports(3)
    csv = tmp_path / "ip.csv"
    csv.write_text("eid,rank,grpc_server_ip,grpc_server_port\n0,0,127.0.0.1,%d\n1,1,127.0.0.1,%d\n" % tuple(ports[:2]))
    args = SimpleNamespace(training_type="cross_silo", backend="GRPC", grpc_ipconfig_path=str(csv), worker_num=2)
    with pytest.raises(ConfigError, match=r"no row for rank\(s\) \[2\]"):
        check_grpc_endpoint(args, 0)
    args.worker_num = 1
    check_grpc_endpoint(args, 0)   # free: fine
    # a FedML GRPC server already on rank 0's port (grpc would share it through SO_REUSEPORT)
    from fedml.core.distributed.communication.grpc.grpc_comm_manager import GRPCCommManager

    from fedml_fedmitr.fedml_adapter import fedml_patches, grpc_security
    fedml_patches.fix_receive_loops("GRPC", grpc_security.GrpcSecurity())
    first = GRPCCommManager(str(csv), client_rank=0, client_num=1)
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{ports[0]}"):
            check_grpc_endpoint(args, 0)
    finally:
        first.stop_receive_message()


@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted (Ctrl-C)"),
                                           (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_ctrl_c_and_sigterm_end_with_one_line(sig, code, word, tmp_path, tmp_home, procs):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(out, train_args={"epochs": 200}))
    p = procs.start([PYTHON, "-m", "fedml_fedmitr", "--cf", cfg], child_env(tmp_home), log_path=tmp_path / "run.log")
    wait_for(lambda: "fedml_fedmitr: FedMITR, mode" in p.output(), 120, 0.2, "the run to start", [p])
    time.sleep(1.0)
    os.kill(p.p.pid, sig)
    assert p.wait(timeout=60) == code, p.output()[-3000:]
    text = p.output()
    assert word in text and "Traceback" not in text, text[-3000:]


def test_a_rank_heard_from_one_host_is_refused_from_another():
    from types import SimpleNamespace

    from fedml_fedmitr.fedml_adapter.fedml_patches import _check_sender_host
    from fedml_fedmitr.fedml_adapter.safe_pickle import RefusedMessage
    manager = SimpleNamespace()
    _check_sender_host(manager, 1, "ipv4:10.0.0.5:40001 (claims client_1)")
    _check_sender_host(manager, 1, "ipv4:10.0.0.5:40517 (claims client_1)")   # a new channel, same host
    _check_sender_host(manager, 2, "ipv4:10.0.0.6:40002 (claims client_2)")
    with pytest.raises(RefusedMessage, match="rank 1 is already connected from ipv4:10.0.0.5"):
        _check_sender_host(manager, 1, "ipv4:10.0.0.9:40003 (claims client_1)")
    _check_sender_host(manager, 1, "this process")   # the server's own loop


def test_resume_without_saved_state_says_so(tmp_path, tmp_home, capfd):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(out, train_args={"epochs": 1}, fedmitr_args={"resume": True}))
    assert cli.main(["--cf", str(cfg)]) == 0
    cap = capfd.readouterr()
    assert "resume: true but" in cap.out + cap.err and "holds no saved uploads" in cap.out + cap.err
    assert cli.main(["--cf", str(cfg)]) == 0   # now there is state: it resumes from it
    cap = capfd.readouterr()
    assert "resuming from the saved uploads" in cap.out + cap.err


def test_another_fedml_version_is_one_line(tmp_path, tmp_home, capfd, monkeypatch):
    from fedml_fedmitr.fedml_adapter import fedml_patches
    monkeypatch.setattr(fedml_patches, "installed_fedml_version", lambda: "0.8.18")
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path / "out"))
    assert _assert_one_line(capfd, cli.main(["--cf", str(cfg)]), ["supports FedML 0.9.6, found 0.8.18", "pip install fedml==0.9.6"])
