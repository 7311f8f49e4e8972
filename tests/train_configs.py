"""Training configurations the tests share."""

from __future__ import annotations


def digits_config(out, cache, **overrides):
    """Frozen pretrained EfficientNet-Lite0 features of sklearn digits (30 images a class, cached in ``cache``) and
    a trained head on the CPU, 3 batches an epoch: seconds. No validation split (best.pt the last epoch, the test
    split evaluated every epoch), unless ``val_fraction`` is given: these runs test other things than the choice of
    best.pt. ``overrides`` replace any option."""
    from retrieval.train import TrainConfig  # on first use: importing this module stays cheap

    values = dict(dataset="digits", dataset_kwargs={"protocol": "standard", "limit_per_class": 30},
                  backbone="efficientnet_lite0", pretrained=True, image_size=32, freeze_backbone=True,
                  embedding_dim=16, loss="ms", batch_size=20, per_class=4, batches_per_epoch=3, epochs=3, lr=1e-3,
                  workers=0, device="cpu", out=str(out), feature_cache=str(cache), val_fraction=0)
    values.update(overrides)
    return TrainConfig(**values)
