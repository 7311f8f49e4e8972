"""--compatible-with under --freeze-backbone with an old model that cannot read the cached features (an exported
ONNX file, as `retrieval export --pretrained` writes one, or a checkpoint of another preprocessing): it embeds each
train and evaluation image once, as it sees it, into the feature cache; each batch's rows carry their image's old
embedding behind the features; the export declares the ONNX file's hash, and the index that file built upgrades in
place."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from embedders import write_projection_onnx
from run_files import metrics_rows
from sample_images import noisy_png
from train_configs import digits_config

from retrieval.data import build_transforms
from retrieval.onnx_runtime import OnnxEmbedder
from retrieval.train import train
from retrieval.train.feature_cache import image_list_digest
from retrieval.train.trainer import Trainer


@pytest.fixture(scope="module")
def pad_onnx(tmp_path_factory):
    """The quick path's old model: the pretrained backbone exported as it is, letterboxing (32 px, 1280-d)."""
    from retrieval.export.onnx_export import export_pretrained

    out = tmp_path_factory.mktemp("pretrained") / "model_pad.onnx"
    export_pretrained("efficientnet_lite0", out, image_size=32, resize="pad", verify=False, log=lambda message: None)
    return out


def frozen(tmp_path, name, old, **overrides):
    values = dict(epochs=2, seed=1, optimizer="sgd", lr=0.05, plots=False, tensorboard=False, eval_before=False,
                  compatible_with=str(old))
    values.update(overrides)
    return digits_config(tmp_path / name, tmp_path / "cache", **values)


def old_cache_files(cache) -> dict[str, int]:
    """The old model's entries in the feature cache (their key names it): file -> modification time (ns)."""
    entries = {}
    for key in cache.glob("*.json"):
        if "old_model" in json.loads(key.read_text()):
            npz = key.with_suffix(".npz")
            entries[npz.name] = npz.stat().st_mtime_ns
    return entries


class CountedCalls:
    """Counts OnnxEmbedder.embed_batch calls (every run of an ONNX model goes through it)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = OnnxEmbedder.embed_batch

        def counted(embedder, batch):
            self.calls += 1
            return original(embedder, batch)

        monkeypatch.setattr(OnnxEmbedder, "embed_batch", counted)


def images_of(dataset, positions) -> list:
    return [dataset.load_image(int(i)) for i in positions]


def test_a_frozen_run_against_an_onnx_model_caches_its_embeddings_of_each_image_once(pad_onnx, tmp_path,
                                                                                    monkeypatch, capsys):
    """(1) the run completes with BCT's blocks and declares the ONNX file's hashes; the cached old embeddings of the
    train and evaluation images equal OnnxEmbedder's of the same images (its own preprocessing: 32 px, pad).
    (2) a second run reads them back: the ONNX model does not run again, and the cache files are not rewritten."""
    counted = CountedCalls(monkeypatch)
    report = train(frozen(tmp_path, "first", pad_onnx), progress=False)
    assert "it embeds each train and evaluation image once" in capsys.readouterr().err
    blocks = report["last"]["compatibility"]
    assert {"new", "old", "cross_model", "verdict"} <= set(blocks)
    assert all(row["compatible"] != 0 for row in metrics_rows(tmp_path / "first"))
    runtime = OnnxEmbedder(pad_onnx, providers="cpu")
    declared = torch.load(tmp_path / "first" / "last.pt", weights_only=False)["model_config"]["compatible_with"]
    assert declared == sorted({*runtime.model_hashes, runtime.source_model_hash})  # the earlier hash too
    first_calls, cached = counted.calls, old_cache_files(tmp_path / "cache")
    assert first_calls > 0 and len(cached) == 2  # train and query (digits has no separate gallery)

    probe = Trainer(frozen(tmp_path, "probe", pad_onnx), progress=False)
    probe.setup()  # reads every cache entry
    assert counted.calls == first_calls  # not run again
    features, train_set = probe.parts.features, probe.data.train_set
    want = runtime.embed(images_of(train_set, features.train_feature_indices))
    np.testing.assert_allclose(features.train_old.cpu().numpy(), want, atol=1e-5)
    query_set = probe.data.eval_sets.query
    old_q, old_ql, _, _ = features.embed_eval(probe.parts.old_model.eval_model)
    query_positions = features.eval_indices()[0]
    np.testing.assert_allclose(old_q, runtime.embed(images_of(query_set, query_positions)), atol=1e-5)
    assert np.array_equal(old_ql, np.asarray(query_set.labels)[query_positions])
    assert report["last"]["compatibility"]["old"]["recall@1"] > 0

    before = counted.calls  # this test's own embedding above ran it
    again = train(frozen(tmp_path, "second", pad_onnx), progress=False)
    assert counted.calls == before and old_cache_files(tmp_path / "cache") == cached
    assert again["last"]["compatibility"]["old"] == blocks["old"]  # the same old embeddings of the same images


def test_another_image_list_or_another_old_model_embeds_again(pad_onnx, tmp_path, monkeypatch):
    counted = CountedCalls(monkeypatch)
    train(frozen(tmp_path, "thirty", pad_onnx, epochs=1), progress=False)
    calls, cached = counted.calls, old_cache_files(tmp_path / "cache")
    fewer = dict(digits_config(tmp_path, tmp_path).dataset_kwargs, limit_per_class=25)
    train(frozen(tmp_path, "twenty-five", pad_onnx, epochs=1, dataset_kwargs=fewer), progress=False)
    assert counted.calls > calls and len(old_cache_files(tmp_path / "cache")) == 2 * len(cached)
    calls = counted.calls
    other = write_projection_onnx(tmp_path / "projection.onnx", dim=24, seed=3)  # 16 px, 24-d, its own normalisation
    train(frozen(tmp_path, "other-model", other, epochs=1), progress=False)
    assert counted.calls > calls and len(old_cache_files(tmp_path / "cache")) == 3 * len(cached)


def test_the_image_list_digest_follows_the_files_and_their_order(tmp_path):
    from torch.utils.data import Subset

    from retrieval.data import ImageDataset

    paths = []
    for n in range(3):
        paths.append(tmp_path / f"{n}.png")
        paths[-1].write_bytes(noisy_png((200, 40, 40), n))
    dataset = ImageDataset([str(p) for p in paths], np.zeros(3, np.int64), ["a"])
    before = image_list_digest(dataset)
    assert image_list_digest(ImageDataset([str(p) for p in paths], np.zeros(3, np.int64), ["a"])) == before
    assert image_list_digest(Subset(dataset, [2, 1, 0])) != before  # the positions' images, in order
    assert image_list_digest(ImageDataset([str(p) for p in paths[:2]], np.zeros(2, np.int64), ["a"])) != before
    stat = paths[1].stat()
    os.utime(paths[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed in place
    assert image_list_digest(dataset) != before
    pixels = [np.zeros((8, 8), np.uint8), np.ones((8, 8), np.uint8)]
    arrays = image_list_digest(ImageDataset(pixels, np.zeros(2, np.int64), ["a"]))
    pixels[1] = pixels[1] * 2
    assert image_list_digest(ImageDataset(pixels, np.zeros(2, np.int64), ["a"])) != arrays


def test_each_shuffled_batch_carries_its_own_images_old_embeddings(pad_onnx, tmp_path):
    """(3) the sampler's batches are drawn class-balanced and shuffled; each row's old embedding (behind its
    features) is the ONNX model's embedding of that very image, the head reads the features alone, and the
    influence term equals the one computed from the ONNX model's embeddings of the batch's images directly (and
    differs from that of the same embeddings out of order)."""
    trainer = Trainer(frozen(tmp_path, "aligned", pad_onnx), progress=False)
    trainer.setup()
    parts, train_set = trainer.parts, trainer.data.train_set
    runtime = OnnxEmbedder(pad_onnx, providers="cpu")
    parts.sampler.set_epoch(1)
    drawn = [list(batch) for batch in parts.sampler]
    batches = list(parts.features.batches(parts.sampler, 1, 0))
    assert len(batches) == len(drawn) == 3
    assert any(batch != sorted(batch) for batch in drawn)  # shuffled, not in dataset order
    feature_dim = parts.features.feature_dim
    for positions, (inputs, labels, unreadable) in zip(drawn, batches, strict=True):
        assert unreadable == 0 and inputs.shape == (len(positions), feature_dim + 1280)
        assert torch.equal(labels, torch.as_tensor(np.asarray(train_set.labels)[positions]))
        old = parts.old_model(inputs)
        reference = torch.from_numpy(runtime.embed(images_of(train_set, positions)))
        assert torch.allclose(old, reference, atol=1e-5)
        rows = parts.features.train_feature_row[positions]
        assert torch.equal(inputs[:, :feature_dim], parts.features.train_features[torch.from_numpy(rows)])

    inputs, labels, _ = batches[0]
    model = parts.model.eval()
    with torch.no_grad():
        embeddings = parts.features.forward(model, inputs)
        assert torch.equal(embeddings, model.head(inputs[:, :feature_dim]))
        embeddings = torch.cat([embeddings, model.compatible(embeddings)], dim=1)  # what the step gives (1280-d P)
        reference = torch.from_numpy(runtime.embed(images_of(train_set, drawn[0])))
        got = parts.objective(embeddings, labels, old=parts.old_model(inputs)).local_terms["compatible"]
        want = parts.objective(embeddings, labels, old=reference).local_terms["compatible"]
        shuffled = parts.objective(embeddings, labels, old=reference.roll(1, 0)).local_terms["compatible"]
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    assert abs(float(shuffled) - float(want)) > 1e-3


def test_chunked_steps_equal_whole_ones_with_cached_old_embeddings(pad_onnx, tmp_path):
    train(frozen(tmp_path, "whole", pad_onnx), progress=False)
    train(frozen(tmp_path, "chunked", pad_onnx, chunks=3), progress=False)
    for a, b in zip(metrics_rows(tmp_path / "whole"), metrics_rows(tmp_path / "chunked"), strict=True):
        for key in ("loss", "compatible"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def test_a_checkpoint_that_cannot_read_the_features_embeds_each_image_once_too(tmp_path):
    """An old run at another image size: its head on this run's features is not the old model, so it embeds each
    image once at its own size (its Embedder on its own preprocessing); a checkpoint of this very backbone and
    preprocessing keeps reading the cached features with its head, and one whose backbone was fine-tuned does not."""
    from retrieval.models import load_embedder
    from retrieval.train.compatible import reads_the_features

    train(digits_config(tmp_path / "old40", tmp_path / "cache", image_size=40, epochs=1, plots=False,
                        tensorboard=False), progress=False)
    train(digits_config(tmp_path / "old32", tmp_path / "cache", epochs=1, plots=False, tensorboard=False),
          progress=False)
    same = Trainer(frozen(tmp_path, "reads", tmp_path / "old32" / "last.pt"), progress=False)
    same.setup()
    assert same.parts.old_model.reads_features and same.parts.features.train_old is None
    tuned = load_embedder(tmp_path / "old32" / "last.pt")  # the same run, its backbone fine-tuned a little
    assert reads_the_features(tuned, same.parts.model.backbone, same.parts.model.preprocessing)
    with torch.no_grad():
        next(tuned.backbone.parameters()).add_(1e-3)
    assert not reads_the_features(tuned, same.parts.model.backbone, same.parts.model.preprocessing)
    other = Trainer(frozen(tmp_path, "embeds", tmp_path / "old40" / "last.pt"), progress=False)
    other.setup()
    old_model, features, train_set = other.parts.old_model, other.parts.features, other.data.train_set
    assert old_model.embeds_once and not old_model.reads_features
    old = load_embedder(tmp_path / "old40" / "last.pt").eval()
    transform = build_transforms(old.preprocessing, train=False)
    positions = features.train_feature_indices
    with torch.no_grad():
        want = old(torch.stack([transform(image) for image in images_of(train_set, positions)]))
    assert torch.allclose(features.train_old, want, atol=1e-5)
    report = train(frozen(tmp_path, "embeds", tmp_path / "old40" / "last.pt"), progress=False)
    assert report["last"]["compatibility"]["old"]["recall@1"] > 0


def test_the_quick_path_pretrained_onnx_index_upgrades_in_place_to_the_frozen_compatible_model(pad_onnx, tmp_path):
    """(4) `retrieval export --pretrained --resize pad` (the fixture) -> `index build` -> a frozen-backbone run
    --compatible-with that file -> `retrieval export` -> `retrieval index upgrade`: the new model is accepted at once
    (mixed, served through its compatible output into the old 1280-d space), nothing is built again, and search
    answers."""
    from retrieval.cli.main import main
    from retrieval.index import Index, load_model

    cli = CliRunner()
    old_onnx, new_onnx = pad_onnx, tmp_path / "model_new.onnx"
    for label, colour in enumerate([(200, 40, 40), (40, 200, 40)]):
        (tmp_path / "g" / f"c{label}").mkdir(parents=True)
        for n in range(4):
            (tmp_path / "g" / f"c{label}" / f"{n}.png").write_bytes(noisy_png(colour, 10 * label + n, size=32))
    run = cli.invoke(main, ["index", "build", "--model", str(old_onnx), "--images", str(tmp_path / "g"),
                            "--out", str(tmp_path / "idx"), "--workers", "0"])
    assert run.exit_code == 0, run.output
    built = json.loads((tmp_path / "idx" / "index.json").read_text())

    train(frozen(tmp_path, "new", old_onnx), progress=False)
    run = cli.invoke(main, ["export", "--checkpoint", str(tmp_path / "new" / "last.pt"), "--out", str(new_onnx),
                            "--no-verify"])
    assert run.exit_code == 0, run.output
    old_hash = load_model(old_onnx).model_hash
    assert old_hash in json.loads(load_model(new_onnx).metadata["compatible_with"])
    with Index.open(tmp_path / "idx", embedder=load_model(new_onnx)) as index:  # declared compatible: serves at once
        assert index.embedder.output_name == "compatible_embedding"
        assert len(index.search_images([tmp_path / "g" / "c0" / "0.png"], k=3)[0]) == 3

    # --force: a run this short is measured not compatible, which the upgrade refuses by default
    run = cli.invoke(main, ["index", "upgrade", str(tmp_path / "idx"), "--model", str(new_onnx), "--workers", "0",
                            "--force", "--json"])
    assert run.exit_code == 0, run.output
    summary = json.loads(run.stdout)
    assert summary["mode"] == "mixed" and summary["reembedded"] == 8
    info = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert info["model_hash"] == load_model(new_onnx).model_hash and info["upgraded_from"] == [old_hash]
    assert info["embedding_dim"] == built["embedding_dim"] == 1280 and old_hash in info["model_output_space"]
    run = cli.invoke(main, ["search", "--index", str(tmp_path / "idx"), str(tmp_path / "g" / "c1" / "2.png"),
                            "-k", "1", "--json"])
    assert run.exit_code == 0, run.output
    assert "c1/2.png" in run.stdout


def test_a_compatible_run_never_delivers_its_start_whose_projection_is_untrained(pad_onnx, tmp_path, monkeypatch):
    """A head started at the baseline may deliver its start, but not under --compatible-with an old model of another
    size: at the start its projection into the old space is an untrained map, so best.pt is a trained epoch even
    where the start scores best on the validation split."""
    from retrieval.train.evaluating import Evaluator

    validation = iter([0.9, 0.2, 0.5])  # epochs 0 (the start), 1, 2
    monkeypatch.setattr(Evaluator, "validate", lambda self: {"recall@1": (v := next(validation)), "map@r": v})
    report = train(frozen(tmp_path, "run", pad_onnx, eval_before=True, val_fraction=0.2, head_start="principal"),
                   progress=False)
    assert report["best"]["epoch"] == 2
    assert torch.load(tmp_path / "run" / "best.pt", weights_only=False)["epoch"] == 2
