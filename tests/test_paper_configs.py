"""Pretrained timm models the way timm means them (input size, mean/std, interpolation from the
pretrained_cfg unless the YAML says otherwise; model_args.checkpoint), and the paper's configs under
config/paper/, each through the CLI's validation and preflight on data this test makes."""
from types import SimpleNamespace

import pytest
import torch

from fedml_fedmitr.fedml_adapter.model import apply_pretrained_input, create_model

from conftest import ROOT

PAPER = sorted((ROOT / "config" / "paper").glob("*.yaml"))


def test_a_pretrained_model_brings_its_input_size_normalisation_and_interpolation():
    args = SimpleNamespace(model="deit_tiny_patch16_224", pretrained=True)
    taken = apply_pretrained_input(args)
    assert args.img_size == 224 and args.interpolation == "bicubic"
    assert args.input_mean == pytest.approx([0.485, 0.456, 0.406]) and args.input_std == pytest.approx([0.229, 0.224, 0.225])
    assert set(taken) == {"img_size", "input_mean", "input_std", "interpolation"}
    # what the YAML says wins
    args = SimpleNamespace(model="vit_tiny_patch16_224", pretrained=True, img_size=32, input_mean=[0.1, 0.2, 0.3])
    apply_pretrained_input(args)
    assert args.img_size == 32 and args.input_mean == [0.1, 0.2, 0.3] and args.input_std == pytest.approx([0.5] * 3)
    # random weights: nothing is taken
    args = SimpleNamespace(model="deit_tiny_patch16_224", pretrained=False)
    assert apply_pretrained_input(args) == {} and not hasattr(args, "img_size")


def test_a_checkpoint_file_is_loaded(tmp_path):
    args = SimpleNamespace(model="fedmitr_vit_micro", img_size=16, patch_size=4, in_chans=1, random_seed=3)
    source = create_model(args, 10)
    path = tmp_path / "weights.pt"
    torch.save(source.state_dict(), path)
    args = SimpleNamespace(model="fedmitr_vit_micro", img_size=16, patch_size=4, in_chans=1, random_seed=0,
                           checkpoint=str(path))
    loaded = create_model(args, 10)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in source.state_dict().items())


def _data_for(dataset, root):
    from test_data_sources import write_cifar100, write_imagefolder
    if dataset == "cifar100":
        return write_cifar100(root)
    if dataset == "imagefolder":
        return write_imagefolder(root, classes=[f"c{i}" for i in range(10)], train=3, test=1)
    folder = root / "cifar-10-batches-py"   # the preflight checks the files are there
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(b"")
    return root


def test_there_are_paper_configs_for_four_datasets_and_two_models():
    names = {p.stem for p in PAPER}
    assert names == {f"{d}_{m}" for d in ("cifar10", "cifar100", "officehome", "miniimagenet")
                     for m in ("deit_tiny", "deit_small")}


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_a_paper_config_passes_the_preflight(path, tmp_path):
    from fedml_fedmitr import cli
    from fedml_fedmitr.fedml_adapter.config import load_yaml

    sections = load_yaml(path)
    assert sections["model_args"]["pretrained"] is True and sections["device_args"]["using_gpu"] is True
    assert "img_size" not in sections["model_args"]   # it comes from the model's pretrained_cfg
    sections["data_args"]["data_cache_dir"] = str(_data_for(sections["data_args"]["dataset"], tmp_path / "data"))
    sections["data_args"]["partition_method"] = "homo"   # the tiny data is too small for Dirichlet 0.1 shards
    sections["model_args"]["pretrained"] = False          # no download here: random weights
    sections["device_args"]["using_gpu"] = False          # no GPU here
    sections["fedmitr_args"]["output_dir"] = str(tmp_path / "out")
    _, flat = cli.validate_sections(sections, str(path))
    cli.preflight(sections, flat)
    assert flat.fedmitr_settings.method.inversion_iters >= 200
