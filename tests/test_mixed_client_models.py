"""model_args.client_models through the CLI: clients get the architectures in turn, the server's
ensemble spans them, summary.json lists each client's; a list the method cannot use is one line."""
import json

import pytest

from fedml_fedmitr import cli

from conftest import tiny_config, write_yaml


def test_a_run_with_two_client_architectures(tmp_path, tmp_home):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(
        out, train_args={"epochs": 1, "client_num_in_total": 3, "client_num_per_round": 3},
        model_args={"client_models": ["fedmitr_vit_micro", "fedmitr_vit_tiny"]}))
    assert cli.main(["--cf", str(cfg)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["client_models"] == ["fedmitr_vit_micro", "fedmitr_vit_tiny", "fedmitr_vit_micro"]
    assert summary["model"]["model"] == "fedmitr_vit_micro" and len(summary["client_test_acc"]) == 3


@pytest.mark.parametrize("model_args,fedmitr_args,words", [
    ({"client_models": ["fedmitr_vit_micro", "vit_tiny_patch16_224"], "img_size": 32, "patch_size": None},
     {}, "client_models[1] = 'vit_tiny_patch16_224' sees a 2x2 patch grid at 32 px"),
    ({"client_models": ["fedmitr_vit_tiny"]}, {}, "which none of model_args.client_models ['fedmitr_vit_tiny'] has"),
    ({"client_models": ["fedmitr_vit_micro", "fedmitr_vit_tiny"]}, {"client_screening": True},
     "client_screening compares the clients' weights"),
    ({"client_models": "fedmitr_vit_tiny"}, {}, "client_models = 'fedmitr_vit_tiny' is invalid"),
])
def test_client_models_a_run_cannot_use_are_one_line(tmp_path, capfd, model_args, fedmitr_args, words):
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path / "out", model_args=model_args,
                                                      fedmitr_args=fedmitr_args))
    with pytest.raises(Exception) as err:
        cli.validate(str(cfg))
    assert words in str(err.value), str(err.value)
