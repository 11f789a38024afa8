"""The stock FedML path: a user's main.py (fedml.init, get_device, their own dataset and timm
ViT, FedMLRunner(...).run()) gains federated_optimizer: FedMITR by ``import fedml_fedmitr``;
the registration (at import when FedML is imported, else by fedml_fedmitr.register()) patches only
FedMLRunner's two _init_*_runner methods; a model that is not a
class-token ViT is refused with a clear message; the core never imports FedML."""
from __future__ import annotations

import textwrap

from conftest import PYTHON, ROOT, check_summary, child_env, read_summary, tiny_config, write_yaml


def test_stock_main_py_with_fedmitr(tmp_path, tmp_home, procs):
    out = tmp_path / "out"
    cfg = tiny_config(out, data_args={"dataset": "my_digits", "data_cache_dir": None, "partition_method": None,
                                      "partition_alpha": None},
                      model_args={"model": "vit_tiny_patch16_224"})
    path = write_yaml(tmp_path / "stock.yaml", cfg)
    p = procs.start([PYTHON, ROOT / "examples" / "stock_main" / "main.py", "--cf", path], child_env(tmp_home))
    rc = p.wait(timeout=240)
    assert rc == 0, p.output()[-5000:]
    summary = read_summary(out)
    check_summary(summary, "FedMITR", clients=2, dataset="my_digits")
    assert summary["model"]["model"] == "vit_tiny_patch16_224"
    # no data info from the plugin's loader: the pixel range was estimated from the test set
    assert "pixel range observed" in p.output()


REGISTRATION = textwrap.dedent(r'''
    import sys
    from types import SimpleNamespace
    import fedml_fedmitr
    import fedml_fedmitr.core.methods, fedml_fedmitr.core.client, fedml_fedmitr.data
    import fedml_fedmitr.fedml_adapter.config
    assert "fedml" not in sys.modules, "importing the plugin or its core imported fedml"
    assert not any("fedml" in type(f).__module__ for f in sys.meta_path if hasattr(f, "find_spec")), "an import hook"

    import fedml
    from fedml.runner import FedMLRunner
    import fedml.core.mlops as mlops
    # imported before FedML, the plugin patched nothing; the explicit call registers it
    assert getattr(FedMLRunner._init_simulation_runner, "__fedmitr_original__", None) is None
    fedml_fedmitr.register()
    for name in ("_init_simulation_runner", "_init_cross_silo_runner"):
        assert getattr(getattr(FedMLRunner, name), "__fedmitr_original__", None) is not None, name
    assert getattr(mlops.fetch_config, "__fedmitr_offline__", False)
    assert FedMLRunner.run.__module__ == "fedml.runner"  # nothing else patched

    # the offline fetch_config serves the plugin's runs only: FedAvg (or using_mlops) gets FedML's own
    from fedml_fedmitr.fedml_adapter import fedml_patches
    fedml_patches._ORIGINAL_FETCH_CONFIG = lambda a, version="release": "FedML's own"
    assert mlops.fetch_config(SimpleNamespace(using_mlops=False, federated_optimizer="FedAvg")) == "FedML's own"
    assert mlops.fetch_config(SimpleNamespace(using_mlops=True, federated_optimizer="FedMITR")) == "FedML's own"
    plugin_args = SimpleNamespace(using_mlops=False, federated_optimizer="FedMITR", rank=0)
    assert mlops.fetch_config(plugin_args) is False and plugin_args.os_name

    # a FedML name still goes to FedML's own code (here: its "no such backend" error)
    try:
        FedMLRunner(SimpleNamespace(training_type="simulation", backend="bogus", federated_optimizer="FedAvg"),
                    "cpu", None, None)
    except Exception as exc:
        assert "not such backend bogus" in str(exc), exc
    else:
        raise AssertionError("FedAvg did not reach FedML")

    # a model the method cannot use is refused before anything runs
    import torch
    from fedml_fedmitr.core.models import ModelError
    args = SimpleNamespace(training_type="simulation", backend="sp", federated_optimizer="FedMITR",
                           yaml_config_file="", client_num_in_total=2, comm_round=1, random_seed=0)
    cnn = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.Flatten(), torch.nn.LazyLinear(10))
    try:
        FedMLRunner(args, torch.device("cpu"), [0] * 8, cnn)
    except ModelError as exc:
        print("REFUSED:", exc)
    else:
        raise AssertionError("a CNN was accepted")
    # an unknown optimizer name through the plugin's own runner
    from fedml_fedmitr.fedml_adapter.runner import FedMITRRunner
    args.federated_optimizer = "FedMagic"
    try:
        FedMITRRunner(args, torch.device("cpu"), [0] * 8, cnn)
    except ValueError as exc:
        print("UNKNOWN:", exc)
    print("OK")
''')


def test_registration_hook_and_model_check(tmp_path, tmp_home, procs):
    script = tmp_path / "check.py"
    script.write_text(REGISTRATION)
    p = procs.start([PYTHON, script], child_env(tmp_home))
    rc = p.wait(timeout=120)
    assert rc == 0, p.output()[-4000:]
    assert "OK" in p.stdout
    refused = [l for l in p.stdout.splitlines() if l.startswith("REFUSED:")][0]
    assert "not a timm VisionTransformer" in refused and "class-token ViT" in refused
    unknown = [l for l in p.stdout.splitlines() if l.startswith("UNKNOWN:")][0]
    assert "'FedMagic'" in unknown and "FedMITR" in unknown


def test_estimated_normalisation_maps_the_pixel_range_onto_the_data_range():
    """A stock main.py's normalised data: the inferred (mean, std) must send pixels 0 and 1 to the
    data's own min and max, so synthetic images span the same range as the real ones."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from fedml_fedmitr.fedml_adapter.aggregator import estimate_mean_std

    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(64, 3, 8, 8, generator=g)
    pixels[0].fill_(0.0)
    pixels[1].fill_(1.0)
    true_mean, true_std = torch.tensor([0.49, 0.48, 0.45]), torch.tensor([0.25, 0.24, 0.26])
    cases = {"[-1, 1]": (pixels * 2 - 1, torch.full((3,), 0.5), torch.full((3,), 0.5)),
             "mean/std": ((pixels - true_mean.view(1, 3, 1, 1)) / true_std.view(1, 3, 1, 1), true_mean, true_std)}
    for name, (x, mean, std) in cases.items():
        got_mean, got_std = estimate_mean_std(DataLoader(TensorDataset(x, torch.zeros(64)), batch_size=16), 3)
        torch.testing.assert_close(torch.tensor(got_mean), mean, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(torch.tensor(got_std), std, rtol=1e-4, atol=1e-5, msg=name)
        lo = (0 - torch.tensor(got_mean)) / torch.tensor(got_std)
        hi = (1 - torch.tensor(got_mean)) / torch.tensor(got_std)
        torch.testing.assert_close(lo, x.transpose(0, 1).reshape(3, -1).min(1).values, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hi, x.transpose(0, 1).reshape(3, -1).max(1).values, rtol=1e-4, atol=1e-4)
