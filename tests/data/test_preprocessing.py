"""``ModelPreprocessing``: the typed record of what a model needs to embed an image. It reads the dicts a model's files
hold, gives them back key for key, hashes into the model's identity as the dicts did, and refuses a bad value naming
the field; ``resized_size`` is the one short-side resize, in PIL's (width, height) order."""

from __future__ import annotations

import json
import pickle
from dataclasses import FrozenInstanceError, replace

import pytest

from retrieval.data.preprocessing import ModelPreprocessing, resized_size

# a checkpoint's model_config as create_embedder writes it (efficientnet_lite0, 32-d), with the keys the record leaves
CHECKPOINT_CONFIG = {
    "backbone": "efficientnet_lite0", "embedding_dim": 32, "normalize": True, "freeze_bn": False, "feature_dim": 1280,
    "input_size": 224, "mean": [0.4980392156862745] * 3, "std": [0.5019607843137255] * 3,
    "background": [255, 255, 255], "pretrained": False,
}
# the identity digests these configs had before the record existed: the model hashes of files already written
DIGESTS = {
    "checkpoint": "b89c73a00ea04b82d9421c0964be0dcb82e81cd56e3add4e6f662d1162ed3ded",
    "pad-on-black": "93b4daf6af219428c27f5033ca6654bfbf26e2ad2048f68cc22c8e9a44d786b8",
    "partial": "53593e25cae5415dc832df1ee14875b4581ce8eed12fc8f63bd3100299b6b61d",
}


def test_a_checkpoints_config_reads_and_gives_back_its_preprocessing_keys_exactly():
    record = ModelPreprocessing.from_config(CHECKPOINT_CONFIG)
    assert record.input_size == 224 and record.background == (255, 255, 255) and record.resize_mode == "crop"
    assert record.backbone == "efficientnet_lite0" and record.embedding_dim == 32 and record.normalize is True
    written = record.to_config()
    assert written == {key: CHECKPOINT_CONFIG[key] for key in written}  # the same values, lists as lists
    assert set(CHECKPOINT_CONFIG) - set(written) == {"freeze_bn", "feature_dim", "pretrained"}  # left in the dict
    assert json.dumps(written, sort_keys=True) == json.dumps({k: CHECKPOINT_CONFIG[k] for k in written}, sort_keys=True)
    # a mode is given back only where the config records one (files from before the modes have none)
    assert "resize" not in written
    assert ModelPreprocessing.from_config(CHECKPOINT_CONFIG | {"resize": "crop"}).to_config()["resize"] == "crop"


def test_the_identity_hashes_as_before():
    assert ModelPreprocessing.from_config(CHECKPOINT_CONFIG).identity_digest().hexdigest() == DIGESTS["checkpoint"]
    crop = ModelPreprocessing.from_config(CHECKPOINT_CONFIG | {"resize": "crop"})
    assert crop.identity_digest().hexdigest() == DIGESTS["checkpoint"]
    pad = ModelPreprocessing.from_config(CHECKPOINT_CONFIG | {"resize": "pad", "background": [0, 0, 0]})
    assert pad.identity_digest().hexdigest() == DIGESTS["pad-on-black"]
    partial = ModelPreprocessing.from_config({"input_size": 32, "mean": [0.5] * 3, "std": [0.25] * 3})
    assert partial.identity_digest().hexdigest() == DIGESTS["partial"]  # unnamed keys hash as null


@pytest.mark.parametrize("config,match", [
    ({"mean": [0.5] * 3, "std": [0.5] * 3}, r"model_config\['input_size'\] must be a positive int, got None"),
    ({"input_size": 0, "mean": [0.5] * 3, "std": [0.5] * 3}, r"model_config\['input_size'\] must be a positive int"),
    ({"input_size": (3, 16, 8), "mean": [0.5] * 3, "std": [0.5] * 3}, r"input_size must be an int or a square"),
    ({"input_size": 8, "mean": [0.5] * 2, "std": [0.5] * 3}, "needs 'mean' and 'std', each 3 numbers"),
    ({"input_size": 8, "mean": [0.5] * 3, "std": [0.5, 0, 0.5]}, r"model_config\['std'\] must be non-zero"),
    ({"input_size": 8, "mean": [0.5] * 3, "std": [0.5] * 3, "resize": "stretch"}, "must be one of crop, pad"),
    ({"input_size": 8, "mean": [0.5] * 3, "std": [0.5] * 3, "background": [300, 0, 0]}, "background colour"),
])
def test_a_bad_value_is_refused_naming_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        ModelPreprocessing.from_config(config)


def test_the_record_is_frozen_hashable_and_picklable():
    record = ModelPreprocessing(input_size=16, mean=[0.5] * 3, std=[0.25] * 3, background="black")  # type: ignore[arg-type]
    assert record.mean == (0.5, 0.5, 0.5) and record.background == (0, 0, 0)  # sequences kept as tuples
    with pytest.raises(FrozenInstanceError):
        record.input_size = 32  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(record)) == record and hash(record) == hash(replace(record))
    with pytest.raises(ValueError, match="must be one of crop, pad"):
        replace(record, resize="stretch")  # a changed copy is checked too
    assert replace(record, input_size=224).short_side == 255  # the usual 256 -> 224, truncated as before


@pytest.mark.parametrize("width,height", [(400, 144), (144, 400), (50, 50), (1, 300), (257, 256), (7, 3)])
def test_resized_size_is_torchvisions_resize_in_pils_order(width, height):
    import torch
    from torchvision.transforms import v2

    resized = v2.functional.resize(torch.zeros(1, height, width), 72, antialias=True)
    assert resized_size(width, height, 72) == (resized.shape[2], resized.shape[1])
