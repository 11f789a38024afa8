"""model_args.client_models through the CLI: a list the method cannot use is one line before anything
runs (the end-to-end run with two client architectures is in test_tracking.py)."""

import pytest

from fedml_fedmitr import cli

from conftest import tiny_config, write_yaml


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
