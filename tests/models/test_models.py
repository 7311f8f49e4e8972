"""Backbone registry, embedder head, offline pretrained weights, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrieval.models import (
    BACKBONES,
    PretrainedWeightsMissing,
    create_embedder,
    efficientnet_lite0_classifier,
    load_embedder,
)
from retrieval.models.checkpoint import CHECKPOINT_FORMAT, Checkpoint, load_checkpoint

# ImageNet classes 281-285 are the domestic cats (tabby, tiger cat, Persian, Siamese, Egyptian cat).
IMAGENET_CATS = set(range(281, 286))


@pytest.mark.parametrize("name", BACKBONES.names())
def test_every_backbone_embeds(name):
    torch.manual_seed(0)
    model = create_embedder(name, embedding_dim=32, pretrained=False).eval()
    size = 224 if name == "vit_b_16" else 64  # ViT needs its patch grid; the CNNs take any size
    with torch.no_grad():
        out = model(torch.randn(2, 3, size, size))
    assert out.shape == (2, 32)
    assert torch.isfinite(out).all()
    assert model.config.feature_dim == model.head.linear.in_features
    assert model.config.backbone == name


def test_timm_backbone_by_name():
    model = create_embedder("timm:resnet18", embedding_dim=16).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 64, 64))
    assert out.shape == (1, 16)


def test_normalisation_is_optional():
    torch.manual_seed(0)
    x = torch.randn(3, 3, 64, 64)
    norm = create_embedder("resnet18", 16, normalize=True).eval()
    raw = create_embedder("resnet18", 16, normalize=False).eval()
    raw.load_state_dict(norm.state_dict())
    with torch.no_grad():
        a, b = norm(x), raw(x)
    torch.testing.assert_close(a.norm(dim=1), torch.ones(3))
    torch.testing.assert_close(a, torch.nn.functional.normalize(b, dim=1))
    assert not torch.allclose(b.norm(dim=1), torch.ones(3))


def test_frozen_batchnorm_keeps_statistics_and_weights():
    model = create_embedder("resnet18", 8, freeze_bn=True)
    bn = model.backbone.bn1
    before = bn.running_mean.clone()
    model.train()
    model(torch.randn(4, 3, 64, 64) * 5 + 3)
    assert not bn.training
    torch.testing.assert_close(bn.running_mean, before)
    assert not bn.weight.requires_grad


def test_packaged_efficientnet_lite0_weights_classify_a_cat():
    """The offline ImageNet weights load correctly: skimage's chelsea is a cat in the top-5."""
    skimage_data = pytest.importorskip("skimage.data")
    from PIL import Image

    from retrieval.data import preprocess_eval

    net = efficientnet_lite0_classifier(pretrained=True).eval()
    config = create_embedder("efficientnet_lite0", 8).preprocessing
    x = preprocess_eval(Image.fromarray(skimage_data.chelsea()), config)[None]
    with torch.no_grad():
        top5 = net(x).softmax(-1).topk(5).indices[0].tolist()
    assert IMAGENET_CATS & set(top5[:2]), top5
    # a non-cat photo must not come out as a cat: the check can fail
    x = preprocess_eval(Image.fromarray(skimage_data.rocket()), config)[None]
    with torch.no_grad():
        top1 = int(net(x).argmax())
    assert top1 not in IMAGENET_CATS


def test_pretrained_backbone_uses_packaged_weights():
    from retrieval.models.backbones import efficientnet_lite0_classifier as classifier

    reference = classifier(pretrained=True).state_dict()
    model = create_embedder("efficientnet_lite0", 8, pretrained=True)
    conv = model.backbone.net._conv_stem.weight
    torch.testing.assert_close(conv, reference["_conv_stem.weight"])


def test_missing_torchvision_weights_say_where_to_put_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(PretrainedWeightsMissing, match=str(tmp_path)) as info:
        create_embedder("resnet18", pretrained=True, offline=True)
    assert "weights=PATH" in str(info.value)


def test_torchvision_weights_from_the_cache(tmp_path, monkeypatch):
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    reference = torchvision.models.resnet18()
    url = torchvision.models.ResNet18_Weights.DEFAULT.url
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(reference.state_dict(), tmp_path / "hub" / "checkpoints" / url.rsplit("/", 1)[-1])
    model = create_embedder("resnet18", pretrained=True, offline=True)
    torch.testing.assert_close(model.backbone.conv1.weight, reference.conv1.weight)


def test_missing_timm_weights_fail_clearly(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache, whatever this machine holds
    with pytest.raises(PretrainedWeightsMissing, match="'timm:resnet18' are not in the local cache"):
        create_embedder("timm:resnet18", pretrained=True, offline=True)


def test_local_weights_file(tmp_path):
    import torchvision

    reference = torchvision.models.resnet18()
    path = tmp_path / "r18.pth"
    torch.save(reference.state_dict(), path)
    model = create_embedder("resnet18", 8, weights=path)
    torch.testing.assert_close(model.backbone.layer4[0].conv1.weight, reference.layer4[0].conv1.weight)
    assert model.config.pretrained
    with pytest.raises(ValueError, match="does not fit"):
        create_embedder("googlenet", 8, weights=path)
    with pytest.raises(FileNotFoundError, match="not found"):
        create_embedder("resnet18", 8, weights=tmp_path / "nope.pth")


def test_unknown_backbone_lists_choices():
    with pytest.raises(KeyError, match="resnet18"):
        create_embedder("resnet9000")


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = create_embedder("resnet18", 16, normalize=False, freeze_bn=True).eval()
    model.config = model.config.with_fields({"input_size": 96})
    path = tmp_path / "m.pt"
    torch.save({"format": CHECKPOINT_FORMAT, "model_config": model.config.to_json(),
                "state_dict": model.state_dict()}, path)
    loaded = load_embedder(path)
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), atol=1e-6)
    assert loaded.config.input_size == 96 and not loaded.config.normalize
    torch.save({"something": "else"}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a retrieval checkpoint"):
        load_checkpoint(tmp_path / "bad.pt")


def test_checkpoint_schema_keeps_the_file_format():
    """The on-disk keys stay those of retrieval-checkpoint/1, in order, and a file read back writes the same dict."""
    keys = ["format", "model_config", "state_dict", "train_config", "config_hash", "epoch", "metrics", "class_names",
            "optimizer", "scheduler", "scaler", "loss_state", "aux_state", "best_recall", "history", "baseline",
            "bad_images", "steps_per_epoch", "in_epoch", "rng"]
    configs = {"model_config": {"backbone": "resnet18", "added_later": [1]}, "train_config": {"seed": 0, "lr": 0.1}}
    on_disk = {key: f"value of {key}" for key in keys} | {"format": CHECKPOINT_FORMAT} | configs
    checkpoint = Checkpoint.from_dict(on_disk)
    assert list(checkpoint.to_dict()) == keys and checkpoint.to_dict() == on_disk and checkpoint.resumable
    assert checkpoint.model_config.backbone == "resnet18" and checkpoint.train_config.seed == 0
    assert all(type(checkpoint.to_dict()[key]) is dict for key in configs)  # a weights_only load reads them
    model_only = Checkpoint.from_dict({"format": CHECKPOINT_FORMAT, "model_config": {}, "state_dict": {}})
    assert not model_only.resumable and model_only.train_config.to_json() == {} and model_only.config_hash is None
    assert model_only.to_dict()["train_config"] == {}
    with pytest.raises(ValueError, match="model_config: a model config holds a str"):
        Checkpoint.from_dict(on_disk | {"model_config": "not an object"})
    robust = {"training_weights": {"w": torch.ones(1)}, "robust": {"start": {}}, "reference": {"recall@1": 0.5}}
    with_robust = Checkpoint.from_dict(on_disk | robust).to_dict()
    assert list(with_robust) == keys + list(robust) and with_robust["reference"] == {"recall@1": 0.5}
