"""Settings by section: every method declares the sections of FedMITRConfig it reads (checked against
what a run really reads), a key of another method's section has no effect and the CLI says so; the
core's one pipeline (run_one_shot) writes the outputs without FedML."""
import json
import logging
import sys
from dataclasses import fields

import pytest
import torch

from fedml_fedmitr.core.config import SECTIONS, FedMITRConfig
from fedml_fedmitr.core.methods import Callbacks, ClientUpload, ServerContext, get_method, method_names

from helpers_core import digits, loader, stats_of, tiny_vit

torch.set_num_threads(1)
FIELDS = {f.name for f in fields(FedMITRConfig)}
READ = set()
SKIP_FILES = ("dataclasses.py",)


class RecordingConfig(FedMITRConfig):
    """A config that records which of its keys code outside the config class reads."""

    def __getattribute__(self, name):
        if name in FIELDS:
            code = sys._getframe(1).f_code
            inside = code.co_qualname.split(".")[0] in ("FedMITRConfig", "RecordingConfig")
            if not inside and not code.co_filename.endswith(SKIP_FILES):
                READ.add(name)
        return object.__getattribute__(self, name)


def uploads(k=3):
    out = []
    for i in range(k):
        counts = [(5 * i + 3 * j) % 7 + 1 for j in range(10)]
        model = tiny_vit(seed=i, depth=1)
        out.append(ClientUpload(i, {n: v.clone() for n, v in model.state_dict().items()}, sum(counts), counts,
                                feature_stats=stats_of(model)))
    return out


def context(state_dir=None):
    (_, _), (xte, yte) = digits()
    return ServerContext(model_fn=lambda: tiny_vit(seed=11, depth=1), num_classes=10, input_shape=(1, 16, 16),
                         mean=[0.3], std=[0.35], eval_loader=loader(xte[:32], yte[:32]),
                         callbacks=Callbacks(progress=False), seed=0, state_dir=state_dir)


TINY = dict(num_synthetic=8, synthesis_batch_size=8, inversion_iters=4, distill_epochs=1, distill_batch_size=8,
            gen_epochs=1, gen_steps=1, gen_batch_size=8, gen_nz=16, client_screening=True, screening_images=4,
            screening_iters=2, distill_augment=False)


def test_every_key_belongs_to_a_section():
    assert {k for keys in SECTIONS.values() for k in keys} == FIELDS


@pytest.mark.parametrize("name", method_names())
def test_a_method_reads_only_the_sections_it_declares(name):
    cls = get_method(name)
    READ.clear()
    method = cls(RecordingConfig(**TINY))
    if hasattr(method, "generator_width"):
        method.generator_width = 8
    method.run(uploads(), context())
    undeclared = READ - set(cls.used_keys()) - set(cls.forced)
    assert not undeclared, f"{name} reads {sorted(undeclared)} outside its sections {cls.sections}"
    assert READ & set(cls.used_keys()), f"{name} read none of its keys: the recording is broken"


def test_keys_of_other_methods_and_forced_keys_are_unused():
    assert get_method("FedMITR").unused_keys(["gen_lr", "num_synthetic", "output_dir", "client_screening"]) == ["gen_lr"]
    assert get_method("DeepInversion").unused_keys(["distill_mode", "kd_temperature", "baseline_kd_temperature",
                                                    "tv_weight"]) == ["distill_mode", "kd_temperature"]
    assert get_method("DENSE").unused_keys(["num_synthetic", "gen_lr", "distill_lr"]) == ["num_synthetic"]
    # the baseline's confidence rule needs a pool: DeepInversion's key, no generator's
    assert get_method("DeepInversion").unused_keys(["baseline_kd_target_confidence"]) == []
    assert get_method("DENSE").unused_keys(["baseline_kd_target_confidence"]) == ["baseline_kd_target_confidence"]
    assert get_method("FedMITR").unused_keys(["baseline_kd_target_confidence"]) == ["baseline_kd_target_confidence"]
    assert get_method("OneShotFedAvg").unused_keys(["student_init", "ensemble_weighting"]) == ["student_init"]


def test_the_cli_names_keys_the_method_does_not_read(tmp_path, caplog):
    from fedml_fedmitr import cli

    from conftest import tiny_config, write_yaml

    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path / "out", fedmitr_args={"gen_lr": 0.01}))
    with caplog.at_level(logging.WARNING, logger="fedml_fedmitr"):
        _, flat = cli.validate(str(cfg))
    lines = [r.getMessage() for r in caplog.records if "not read by" in r.getMessage()]
    assert len(lines) == 1 and "gen_lr" in lines[0] and "FedMITR" in lines[0], lines
    # the settings were read once, typed, and travel on with the namespace
    settings = flat.fedmitr_settings
    assert settings.method.gen_lr == 0.01 and settings.run.min_clients == 1
    assert not hasattr(settings.method, "client_timeout_s")   # run control stays outside the core


def test_run_one_shot_writes_the_outputs_without_fedml(tmp_path):
    from fedml_fedmitr.core.models import load_global_model
    from fedml_fedmitr.core.server import RunInfo, run_one_shot

    meta = {"model": "fedmitr_vit_micro", "img_size": 16, "num_classes": 10, "in_chans": 1, "patch_size": 4,
            "model_kwargs": {"depth": 1}}
    info = RunInfo(method="OneShotFedAvg", output_dir=tmp_path, model_meta=meta, run={"dataset": "digits"},
                   refused={"7": "NaN weights"}, extra={"clients_missing": [5]})
    outcome = run_one_shot(uploads(), context(tmp_path / "state"), FedMITRConfig(save_images=False), info)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["optimizer"] == "OneShotFedAvg" and summary["dataset"] == "digits"
    assert summary["client_ids"] == [0, 1, 2] and len(summary["client_test_acc"]) == 3
    assert summary["test_acc"] == pytest.approx(outcome.result.metrics["test_acc"])
    assert summary["clients_dropped"] == {"7": "upload refused: NaN weights"} and summary["clients_missing"] == [5]
    model = load_global_model(tmp_path / "global_model.pt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in outcome.state.items())
