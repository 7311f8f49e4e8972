"""The zero-shot text tower: ImageNet's class texts read from the files timm ships (no download), in the order of the
classifier's rows; the tower trained onto EfficientNet-Lite0's head from them; its ONNX export equal to PyTorch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from retrieval.text.class_texts import (
    DEFINITION_FILE,
    LEMMA_FILE,
    SYNSETS_FILE,
    ImageNetClass,
    ImageNetTextsError,
    class_texts,
    info_folder,
    read_imagenet_classes,
)
from retrieval.train.zero_shot_tower import (
    ZeroShotSettings,
    imagenet_head,
    split_classes,
    train_zero_shot_tower,
)

SMALL = ZeroShotSettings(prompts=("names", "photo"), epochs=5, classes=60, seed=0)


@pytest.fixture(scope="module")
def head() -> torch.Tensor:
    return imagenet_head("efficientnet_lite0")


@pytest.fixture(scope="module")
def small_tower(head):
    return train_zero_shot_tower(head, SMALL, progress=False)


def test_classes_are_timms_shipped_ones_in_the_heads_row_order():
    """Against timm's own reader of the same files (ImageNetInfo) and rows known by heart."""
    from timm.data import ImageNetInfo

    classes = read_imagenet_classes()
    info = ImageNetInfo()
    assert [c.synset for c in classes] == info.label_names()
    assert [", ".join(c.lemmas) for c in classes] == [" ".join(d.split()) for d in info.label_descriptions()]
    assert (classes[0].name, classes[281].name, classes[954].name) == ("tench", "tabby", "banana")
    assert all(c.definition for c in classes)


def test_the_head_has_one_unit_row_per_class_and_classifies_a_cat_photo_as_a_cat(head):
    import skimage.data
    from PIL import Image

    from retrieval.models import create_pretrained_embedder
    from retrieval.onnx_runtime import preprocess_images

    names = [c.name for c in read_imagenet_classes()]
    assert head.shape == (len(names), 1280)
    assert torch.allclose(head.norm(dim=1), torch.ones(len(names)))
    embedder = create_pretrained_embedder("efficientnet_lite0", None, "crop").eval()
    batch = preprocess_images([Image.fromarray(skimage.data.chelsea())], embedder.preprocessing)
    with torch.no_grad():
        pooled = embedder(torch.from_numpy(batch))
    assert names[int((pooled @ head.T).argmax())] in ("tabby", "tiger cat", "Egyptian cat")


def test_a_missing_or_damaged_info_file_is_named(tmp_path):
    source = info_folder()
    with pytest.raises(ImageNetTextsError, match=f"{SYNSETS_FILE} is missing"):
        read_imagenet_classes(tmp_path)
    (tmp_path / SYNSETS_FILE).write_text("n01440764\nn01443537\n")
    with pytest.raises(ImageNetTextsError, match="holds 2 lines"):
        read_imagenet_classes(tmp_path)
    (tmp_path / SYNSETS_FILE).write_bytes((source / SYNSETS_FILE).read_bytes())
    (tmp_path / LEMMA_FILE).write_text("not a table\n")
    with pytest.raises(ImageNetTextsError, match=f"{LEMMA_FILE}, line 1"):
        read_imagenet_classes(tmp_path)
    (tmp_path / LEMMA_FILE).write_bytes((source / LEMMA_FILE).read_bytes())
    with pytest.raises(ImageNetTextsError, match=f"{DEFINITION_FILE} is missing"):
        read_imagenet_classes(tmp_path)


def test_prompt_sets_phrase_each_lemma_once():
    apple = ImageNetClass("n07739125", ("apple", "eating apple"), "fruit with red or yellow or green skin")
    texts = class_texts(apple, ("names", "photo", "definition", "templates"))
    assert texts["names"] == ["apple", "eating apple"]
    assert texts["photo"] == ["a photo of an apple", "a photo of an eating apple"]
    assert texts["definition"] == ["apple: fruit with red or yellow or green skin"]
    assert "a product photo of an apple" in texts["templates"] and "an apple for sale" in texts["templates"]
    everything = [t for group in texts.values() for t in group]
    assert len(everything) == len(set(everything))
    assert class_texts(apple, ("names",)) == {"names": ["apple", "eating apple"]}
    with pytest.raises(ImageNetTextsError, match="unknown prompt set"):
        class_texts(apple, ("captions",))


def test_class_split_is_seeded_disjoint_and_within_the_subset():
    trained, held = split_classes(1000, 0.2, 100, seed=3)
    assert (len(trained), len(held)) == (80, 20) and not set(trained) & set(held)
    again = split_classes(1000, 0.2, 100, seed=3)
    assert np.array_equal(trained, again[0]) and np.array_equal(held, again[1])
    assert not np.array_equal(trained, split_classes(1000, 0.2, 100, seed=4)[0])


def test_the_tower_puts_each_trained_class_name_on_its_own_row(small_tower, head):
    """The classes trained on are found by name among all 1,000 rows, far above chance (1 in 1,000)."""
    classes = read_imagenet_classes()
    trained, _ = split_classes(len(classes), 0.0, SMALL.classes, SMALL.seed)
    names = [classes[row].name for row in trained.tolist()]
    ids, mask = small_tower.tokenizer(names)
    with torch.no_grad():
        text = small_tower.tower(torch.from_numpy(ids), torch.from_numpy(mask))
    assert torch.allclose(text.norm(dim=1), torch.ones(len(names)), atol=1e-5)
    top = (text @ head.T).argmax(dim=1).numpy()
    assert (top == trained).mean() >= 0.8
    assert [h["epoch"] for h in small_tower.history] == list(range(SMALL.epochs + 1))


def test_training_is_seeded(head, small_tower):
    again = train_zero_shot_tower(head, SMALL, progress=False)
    assert torch.equal(again.tower.projection.weight, small_tower.tower.projection.weight)


def test_held_out_classes_are_measured_and_never_trained_on(head):
    settings = ZeroShotSettings(prompts=("names",), epochs=2, classes=50, held_out_share=0.2, seed=1)
    trained = train_zero_shot_tower(head, settings, progress=False)
    assert trained.texts == sum(len(c.lemmas) for n, c in enumerate(read_imagenet_classes())
                                if n in set(split_classes(1000, 0.2, 50, 1)[0].tolist()))
    assert all(0.0 <= h["held_out_recall@10"] <= 1.0 for h in trained.history)


def test_a_head_of_another_size_is_refused(head):
    from retrieval.errors import ParameterError

    with pytest.raises(ParameterError, match="one row per class"):
        train_zero_shot_tower(head[:10], SMALL, progress=False)


def test_onnx_export_embeds_as_pytorch_does_and_names_the_classes(small_tower, tmp_path):
    from retrieval.export.text_export import export_text_tower
    from retrieval.text.text_onnx import TextEmbedder

    path = tmp_path / "model.text.onnx"
    export_text_tower(small_tower.tower, small_tower.tokenizer, path, "0123456789abcdef",
                      small_tower.encoder_record, small_tower.check_texts, origin="zero-shot",
                      extra=small_tower.metadata())
    exported = TextEmbedder(path)
    queries = ["a sneaker", "trouser", "a red apple", "tabby", "a photo of a golden retriever"]
    ids, mask = small_tower.tokenizer(queries)
    with torch.no_grad():
        reference = small_tower.tower(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert ((exported.embed(queries) * reference).sum(1) >= 0.9999).all()
    metadata = dict(exported.session.get_modelmeta().custom_metadata_map)
    assert json.loads(metadata["zero_shot_classes"]) == [c.name for c in read_imagenet_classes()]
    assert metadata["text_origin"] == "zero-shot" and exported.image_model_hash == "0123456789abcdef"
