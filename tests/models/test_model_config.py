"""The model's and the run's config records (``ModelConfig``, ``RunConfig``, ``RunFolderConfig``): read and written
back to the same object, key order included, so a checkpoint, the ONNX metadata's ``model_config`` and a run's
``config_hash`` are what the plain dict gave; a checkpoint file still holds plain dicts."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

from retrieval.export import export_embedder
from retrieval.models import Checkpoint, config_hash, create_embedder, load_checkpoint, load_embedder
from retrieval.records.model_config import ModelConfig
from retrieval.records.run_config import RunConfig, RunFolderConfig

# create_embedder("resnet18", 16)'s config, written out by hand, then what training adds (in the order it adds it)
RESNET18 = {"backbone": "resnet18", "embedding_dim": 16, "normalize": True, "freeze_bn": False, "feature_dim": 512,
            "input_size": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
            "background": [255, 255, 255], "pretrained": False}
TRAINED = {**RESNET18, "input_size": 32, "compatible_dim": 8, "compatible_with": ["0123456789abcdef"]}


def test_a_model_config_gives_back_its_object_key_order_values_and_unknown_keys():
    data = {"input_size": 32, "added_later": {"x": [1, 2.5]}, "backbone": "timm:vit_tiny", "wise_alpha": 0.5,
            "mean": [0.5, 0.25, 0.125], "resize": None}
    record = ModelConfig.from_json(data)
    assert record.to_json() == data and list(record.to_json()) == list(data)
    assert json.dumps(record.to_json()) == json.dumps(data)  # ints stay ints, floats floats: the same bytes
    assert record.input_size == 32 and record.wise_alpha == 0.5 and record.extra == {"added_later": {"x": [1, 2.5]}}
    assert record.holds("resize") and record.resize is None and not record.holds("head") and record.head is None
    with pytest.raises(KeyError):
        record.value_of("head")
    data["mean"][0] = 9.0  # the record shares nothing with the object it was read from, nor with what it gives
    record.to_json()["added_later"]["x"].append(3)
    assert record.mean == [0.5, 0.25, 0.125] and record.extra["added_later"] == {"x": [1, 2.5]}
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.input_size = 64  # type: ignore[misc]


def test_records_compare_as_their_objects_do_and_are_unhashable_as_they_are():
    record = ModelConfig.from_json(RESNET18)
    reordered = ModelConfig.from_json(dict(reversed(list(RESNET18.items()))))
    assert record == reordered and record != ModelConfig.from_json({**RESNET18, "embedding_dim": 32})
    assert record != RunConfig.from_json(RESNET18) and record != RESNET18  # another record, or the dict itself
    with pytest.raises(TypeError):
        hash(record)


def test_a_field_set_directly_is_refused_as_it_would_never_be_written():
    with pytest.raises(TypeError, match="backbone set but not held"):
        ModelConfig(backbone="resnet18")
    with pytest.raises(TypeError, match="wise_alpha"):
        dataclasses.replace(ModelConfig.from_json(RESNET18), wise_alpha=0.5)
    assert ModelConfig.from_json(RESNET18).with_fields({"wise_alpha": 0.5}).to_json() == {**RESNET18, "wise_alpha": 0.5}


def test_a_nested_part_may_be_given_as_its_record_or_its_object():
    model = ModelConfig.from_json(TRAINED)
    given_record = RunFolderConfig().with_fields({"model": model, "train": None})
    given_object = RunFolderConfig.from_json({"model": TRAINED, "train": None})
    assert given_record == given_object and given_record.model == model and given_record.train is None
    assert given_record.to_json() == {"model": TRAINED, "train": None}


def test_a_model_configs_update_keeps_a_held_key_in_place_and_adds_a_new_one_last():
    record = ModelConfig.from_json(RESNET18)
    updated = record.with_fields({"input_size": 32, "compatible_with": ["h"]})
    assert list(updated.to_json()) == [*RESNET18, "compatible_with"]
    assert updated.to_json() == {**RESNET18, "input_size": 32, "compatible_with": ["h"]}
    assert record.input_size == 224  # the record it came from is unchanged
    assert updated.without("compatible_with", "not_held").to_json() == {**RESNET18, "input_size": 32}
    with pytest.raises(ValueError, match="a model config holds a list, not a JSON object"):
        ModelConfig.from_json([1, 2])  # type: ignore[arg-type]


def test_a_real_models_checkpoint_and_onnx_metadata_hold_what_its_config_dict_gives(tmp_path):
    torch.manual_seed(0)
    model = create_embedder("resnet18", 16, pretrained=False).eval()
    assert model.config.to_json() == RESNET18 and list(model.config.to_json()) == list(RESNET18)
    model.config = model.config.with_fields({"input_size": 32})
    model.add_compatible(8, seed=0)
    model.config = model.config.with_fields({"compatible_with": ["0123456789abcdef"]})
    assert list(model.config.to_json()) == list(TRAINED) and model.config.to_json() == TRAINED

    train = {"dataset": "digits", "data": None, "dataset_kwargs": {"protocol": "standard"}, "lr": 0.001, "seed": 3,
             "wise_alpha": None}
    run = RunConfig.from_json(train)
    expected_hash = hashlib.sha256(json.dumps(train, sort_keys=True).encode()).hexdigest()[:16]
    assert config_hash(run) == expected_hash
    assert config_hash(run.with_fields({"wise_alpha": 0.5})) == \
        hashlib.sha256(json.dumps({**train, "wise_alpha": 0.5}, sort_keys=True).encode()).hexdigest()[:16]

    path = tmp_path / "best.pt"
    torch.save(Checkpoint(model_config=model.config, state_dict=model.state_dict(), train_config=run,
                          config_hash=config_hash(run)).to_dict(), path)
    on_disk = torch.load(path, weights_only=True)  # plain dicts: a weights_only load refuses any class of ours
    assert type(on_disk["model_config"]) is dict and type(on_disk["train_config"]) is dict
    assert list(on_disk["model_config"].items()) == list(TRAINED.items())
    assert list(on_disk["train_config"].items()) == list(train.items())
    assert on_disk["config_hash"] == expected_hash
    read = load_checkpoint(path)
    assert read.model_config == ModelConfig.from_json(TRAINED) and read.train_config.dataset_kwargs == \
        {"protocol": "standard"}
    assert list(load_embedder(path).config.to_json().items()) == list(TRAINED.items())

    metadata = export_embedder(model, tmp_path / "model.onnx", config_hash(run), verify=False,
                               log=lambda _: None).metadata
    assert metadata["model_config"] == json.dumps(TRAINED, sort_keys=True)
    assert metadata["compatible_dim"] == "8" and json.loads(metadata["compatible_with"]) == TRAINED["compatible_with"]
    assert metadata["config_hash"] == expected_hash


def test_a_runs_config_reads_its_training_options_and_model_as_records_and_gives_back_the_file():
    config = {"train": {"dataset": "csv", "data": "shop.csv", "val_fraction": None, "loss": "ms"},
              "model": RESNET18, "label_noise": None, "train_size": 120, "device": "cpu", "amp": False,
              "class_split": {"train": ["a"], "test": ["b"]}}
    record = RunFolderConfig.from_json(config)
    assert isinstance(record.train, RunConfig) and isinstance(record.model, ModelConfig)
    assert record.train.dataset == "csv" and record.train.holds("val_fraction") and record.train.extra == {"loss": "ms"}
    assert record.model.feature_dim == 512 and record.extra == {"class_split": {"train": ["a"], "test": ["b"]}}
    assert json.dumps(record.to_json(), indent=2) == json.dumps(config, indent=2)
    assert record.with_fields({"train_size": 7}).train == record.train
    with pytest.raises(ValueError, match="a run's training config holds a str, not a JSON object"):
        RunFolderConfig.from_json({"train": "ms"})
    assert RunFolderConfig.from_json({"model": None}).to_json() == {"model": None}  # a null part stays null


def test_a_config_that_is_not_a_json_object_is_refused_naming_the_file_and_the_part():
    from retrieval.data.preprocessing import ModelPreprocessing
    from retrieval.onnx_runtime import build_metadata, parse_metadata

    config = ModelConfig.from_json(RESNET18)
    meta = build_metadata(ModelPreprocessing.from_config(config), config, "0123456789abcdef", None)
    assert parse_metadata(meta, "model.onnx").backbone == "resnet18"
    with pytest.raises(ValueError, match="model.onnx's model_config metadata: a model config holds a list"):
        parse_metadata({**meta, "model_config": "[1, 2]"}, "model.onnx")
    written = Checkpoint(model_config=config, state_dict={}).to_dict()
    with pytest.raises(ValueError, match="best.pt's train_config: .* holds a str"):
        Checkpoint.from_dict({**written, "train_config": "lr=0.1"}, "best.pt")
