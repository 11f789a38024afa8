import pytest
import torch

from fedml_fedmitr.core.models import (
    ModelError,
    average_state_dicts,
    check_vit,
    create_vit,
    forward_tokens,
    load_global_model,
    load_state_checked,
    save_global_model,
)

from helpers_core import tiny_vit


def test_full_token_forward_equals_timm_forward():
    model = tiny_vit(depth=3)
    x = torch.randn(4, 1, 16, 16)
    torch.testing.assert_close(forward_tokens(model, x), model(x), rtol=1e-5, atol=1e-5)
    idx = torch.arange(16).unsqueeze(0).repeat(4, 1)
    torch.testing.assert_close(forward_tokens(model, x, idx), model(x), rtol=1e-5, atol=1e-5)


def test_subset_forward_runs_blocks_on_k_plus_prefix_tokens_only():
    model = tiny_vit(depth=3)
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].shape[1])) for b in model.blocks]
    keep = torch.tensor([[0, 5, 9], [1, 2, 15]])
    out = forward_tokens(model, torch.randn(2, 1, 16, 16), keep)
    for h in hooks:
        h.remove()
    assert out.shape == (2, 10)
    assert seen == [4, 4, 4]  # CLS + 3 kept patches in every block


def test_subset_forward_depends_only_on_kept_patches():
    model = tiny_vit()
    x = torch.randn(1, 1, 16, 16)
    keep = torch.tensor([[0, 1, 4, 5]])  # the top-left 8x8 pixels (patch 4, grid 4x4)
    y = x.clone()
    y[:, :, 8:, 8:] += 3.0  # change only dropped patches
    torch.testing.assert_close(forward_tokens(model, x, keep), forward_tokens(model, y, keep))
    assert not torch.allclose(model(x), model(y))


def test_last_block_attention_is_read_from_timm_non_fused_path_and_restored():
    model = tiny_vit()
    attn_mod = model.blocks[-1].attn
    fused_before = attn_mod.fused_attn
    keep = torch.tensor([[0, 3, 7, 8, 12]])
    logits, attn = forward_tokens(model, torch.randn(1, 1, 16, 16), keep, return_attn=True)
    assert attn.shape == (1, 5)
    assert bool((attn >= 0).all()) and float(attn.sum()) < 1.0  # CLS->CLS takes the rest
    assert attn_mod.fused_attn == fused_before


def test_non_vit_models_are_rejected_with_a_clear_message():
    with pytest.raises(ModelError, match="not a timm model name"):
        create_vit("no_such_model_xyz", img_size=16, num_classes=10)
    with pytest.raises(ModelError, match="class-token ViT|VisionTransformer"):
        create_vit("resnet18", img_size=32, num_classes=10)
    with pytest.raises(ModelError, match="global_pool='token'"):
        import timm
        check_vit(timm.create_model("fedmitr_vit_micro", global_pool="avg", class_token=True))


def test_shape_mismatch_names_the_parameter():
    a = tiny_vit()
    b = create_vit("fedmitr_vit_tiny", img_size=16, num_classes=10, in_chans=1, patch_size=4, depth=2)
    with pytest.raises(ModelError, match=r"client 3's uploaded model does not fit the model \(another "
                                         r"architecture\): parameter 'cls_token' has shape \(1, 1, \d+\)"):
        load_state_checked(a, b.state_dict(), "client 3's uploaded model")
    state = dict(a.state_dict())
    state.pop("head.bias")
    state["extra"] = torch.zeros(1)
    with pytest.raises(ModelError, match=r"missing keys \['head.bias'\], unexpected keys \['extra'\]"):
        load_state_checked(a, state, "client 3's uploaded model")


def test_save_and_rebuild_global_model(tmp_path):
    model = tiny_vit()
    path = tmp_path / "global_model.pt"
    save_global_model(path, model, {"model": "fedmitr_vit_micro", "img_size": 16, "num_classes": 10,
                                    "in_chans": 1, "patch_size": 4, "model_kwargs": {"depth": 2}})
    again = load_global_model(path)
    x = torch.randn(2, 1, 16, 16)
    torch.testing.assert_close(again(x), model(x))


def test_pretrained_path_loads_weights_and_adapts_the_head(tmp_path):
    src = create_vit("fedmitr_vit_micro", img_size=16, num_classes=5, in_chans=1, patch_size=4)
    torch.save({"state_dict": src.state_dict()}, tmp_path / "ckpt.pt")
    dst = create_vit("fedmitr_vit_micro", img_size=16, num_classes=10, in_chans=1, patch_size=4,
                     pretrained_path=str(tmp_path / "ckpt.pt"))
    torch.testing.assert_close(dst.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
    assert dst.head.weight.shape == (10, 96)
    with pytest.raises(ModelError, match="does not exist"):
        create_vit("fedmitr_vit_micro", img_size=16, num_classes=10, pretrained_path=str(tmp_path / "nope.pt"))


def test_average_state_dicts_is_weighted():
    a, b = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    torch.testing.assert_close(average_state_dicts([a, b], [1, 3])["w"], torch.full((2,), 0.75))
