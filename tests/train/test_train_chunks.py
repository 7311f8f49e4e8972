"""--chunks (the gradient cache): a step on a batch embedded in chunks equals the unchunked step, losses and
weights, on the frozen-feature and the fine-tuning paths, for every loss family; what it cannot cover is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from run_files import metrics_rows
from torch import nn

from retrieval.train import TrainConfig, train

# (name, loss, loss_kwargs, negatives): each loss family, both hard-negative methods, DCDL and the proxies
FAMILIES = [
    ("triplet-semihard", "triplet", {"mining": "semihard"}, None),
    ("ms", "ms", {}, None),
    ("ms-loop", "ms", {}, "loop"),
    ("npair-symm", "npair", {}, "symm"),
    ("lifted", "lifted", {}, None),
    ("dcdl", "dcdl", {"phi": "mmd_gaussian"}, None),
    ("sct", "sct", {}, None),
    ("proxy_anchor", "proxy_anchor", {}, None),
    ("soft_triple", "soft_triple", {"centers": 3}, None),
]


def assert_same_step(one, chunked):
    a, b = metrics_rows(one), metrics_rows(chunked)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7)
    wa, wb = (torch.load(run / "last.pt", weights_only=False) for run in (one, chunked))
    for part in ("state_dict", "loss_state"):
        for key, value in (wa[part] or {}).items():
            assert torch.allclose(wb[part][key].double(), value.double(), rtol=1e-5, atol=1e-5), (part, key)
    assert any(abs(r["loss"]) > 0 for r in a)


def digits(out, cache, loss, loss_kwargs, negatives, **overrides) -> TrainConfig:
    values = dict(dataset="digits", dataset_kwargs={"protocol": "standard", "limit_per_class": 20},
                  backbone="efficientnet_lite0", pretrained=True, image_size=32, freeze_backbone=True,
                  embedding_dim=16, loss=loss, loss_kwargs=loss_kwargs, negatives=negatives, batch_size=24,
                  per_class=4, batches_per_epoch=2, epochs=2, optimizer="sgd", lr=0.05, eval_before=False,
                  eval_every=100, workers=0, device="cpu", out=str(out), feature_cache=str(cache), plots=False,
                  tensorboard=False)
    values.update(overrides)
    return TrainConfig(**values)


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILIES, ids=[c[0] for c in FAMILIES])
def test_frozen_features_chunked_equals_the_whole_batch(tmp_path, case):
    name, loss, kwargs, negatives = case
    cache = tmp_path / "cache"
    train(digits(tmp_path / "one", cache, loss, kwargs, negatives), progress=False)
    train(digits(tmp_path / "chunked", cache, loss, kwargs, negatives, chunks=5), progress=False)  # uneven: 24/5
    assert_same_step(tmp_path / "one", tmp_path / "chunked")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk-images")
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for c in range(4):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(4):
                pixels = (0.7 * rng.integers(0, 256, (24, 24, 3)) + 0.3 * np.array([60 * c, 200 - 40 * c, 90]))
                Image.fromarray(pixels.astype(np.uint8)).save(root / split / f"c{c}" / f"{i}.png")
    return root


def tune(root, out, loss, loss_kwargs, negatives, **overrides) -> TrainConfig:
    values = dict(dataset="folder", data=str(root), backbone="timm:test_resnet", pretrained=False, image_size=32,
                  embedding_dim=16, loss=loss, loss_kwargs=loss_kwargs, negatives=negatives, batch_size=8,
                  per_class=2, batches_per_epoch=2, epochs=2, optimizer="sgd", lr=0.05, eval_every=100,
                  eval_before=False, workers=0, device="cpu", out=str(out), plots=False, tensorboard=False)
    values.update(overrides)
    return TrainConfig(**values)


@pytest.mark.slow
@pytest.mark.parametrize("case", [FAMILIES[i] for i in (0, 2, 3, 5, 7)], ids=lambda c: c[0])
def test_fine_tuning_chunked_equals_the_whole_batch(tmp_path, folder, case):
    name, loss, kwargs, negatives = case
    train(tune(folder, tmp_path / "one", loss, kwargs, negatives), progress=False)
    train(tune(folder, tmp_path / "chunked", loss, kwargs, negatives, chunks=3), progress=False)
    assert_same_step(tmp_path / "one", tmp_path / "chunked")


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(memory="xbm", memory_size=16, memory_warmup=1), dict(l2sp=0.5),
                                     dict(lp_epochs=1), dict(ema=0.5)], ids=["xbm", "l2sp", "lp-ft", "ema"])
def test_chunks_with_the_other_options(tmp_path, folder, options):
    train(tune(folder, tmp_path / "one", "ms", {}, None, **options), progress=False)
    train(tune(folder, tmp_path / "chunked", "ms", {}, None, chunks=4, **options), progress=False)
    assert_same_step(tmp_path / "one", tmp_path / "chunked")


def test_random_layers_are_replayed_chunk_by_chunk():
    """With dropout the chunks' second pass draws the masks of their first: the gradient is the exact gradient of
    the step's own masks (the reference runs the same chunks with autograd)."""
    from retrieval.train.distributed import DataParallelStep, DistContext

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.5), nn.Linear(12, 4))
    step = DataParallelStep(net, lambda model, x: model(x), None, nn.Identity(),
                            DistContext(0, 1, 0, torch.device("cpu")))
    x, labels = torch.randn(10, 6), torch.arange(10) % 3
    target = torch.randn(10, 4)

    torch.manual_seed(1)
    reference = torch.cat([net(part) for part in x.tensor_split(3)])
    ((reference - target) ** 2).sum().backward()
    expected = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()

    torch.manual_seed(1)
    embeddings, replay = step.chunked(x, labels, None, 3)
    assert torch.allclose(embeddings, reference)  # the first pass drew the reference's masks
    ((embeddings - target) ** 2).sum().backward()
    replay()
    for got, want in zip((p.grad for p in net.parameters()), expected, strict=True):
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize(("options", "message"), [
    (dict(chunks=2, aux_ce=0.5), "--aux-ce and --distill"),
    (dict(chunks=2, distill=1.0), "--aux-ce and --distill"),
    (dict(chunks=2, freeze_bn=False), "BatchNorm in training mode"),
    (dict(chunks=0), "--chunks must be >= 1"),  # the message every option's range check gives
    (dict(chunks=1.5), "--chunks must be a whole number"),
])
def test_what_chunks_cannot_cover_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**options)
