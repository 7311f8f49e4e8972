"""What `retrieval index upgrade` checks before it begins, and what it does to a recorded text model: a model its
training measured not compatible is refused (``--force`` goes on, and says so); one that searches the index's own
labels worse than the stored vectors is refused, with the numbers, which index.json, stats and the app keep; a text
model whose space the new vectors leave is turned off, naming the commands that re-fit it. Real ONNX files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from embedders import write_projection_onnx
from index_builds import QUICK
from sample_images import noisy_png
from text_towers import small_text_model

from retrieval.cli.main import main
from retrieval.compatibility import MIN_DROP, compatibility_record, worse_on_labels
from retrieval.index import build_index, index_stats, load_model
from retrieval.index.catalogue import Catalogue
from retrieval.index.curation.compare import labelled_sample
from retrieval.index.writing.upgrade import upgrade_index
from retrieval.index.writing.upgrade_checks import UpgradeRefused
from retrieval.records.index_info import IndexInfo
from retrieval.text.text_index import TEXT_MODEL_OFF, NoTextModelError, open_text_model

COLOURS = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]  # one per class: classes cluster
# what a frozen-backbone run --compatible-with an old model may measure: new queries find the old gallery worse
REFUTED = {"old": {"recall@1": 0.8, "map@r": 0.6}, "cross_model": {"recall@1": 0.37, "map@r": 0.31},
           "verdict": "not compatible",
           "interval": {"queries": 500, "resamples": 1000, "seed": 0, "confidence": 0.95,
                        "cross_model": {"recall@1": [0.33, 0.41], "map@r": [0.28, 0.34]},
                        "old": {"recall@1": [0.76, 0.84], "map@r": [0.57, 0.63]},
                        "difference": {"recall@1": [-0.47, -0.39], "map@r": [-0.33, -0.25]}}}


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def info_of(index_dir) -> dict:
    return json.loads((index_dir / "index.json").read_text())


def with_metadata(path, **props: str):
    """``path`` with ONNX metadata ``props`` added (the model_hash leaves metadata out: the same model)."""
    import onnx

    model = onnx.load(str(path))
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return path


def colour_blind(path, seed: int):
    """A 24-d projection that cannot see an image's mean colour (each channel's weights sum to 0): it embeds the
    noise alone, so it finds nothing of an image's class in these galleries."""
    import onnx
    from onnx import numpy_helper

    write_projection_onnx(path, dim=24, seed=seed)
    model = onnx.load(str(path))
    weights = next(w for w in model.graph.initializer if w.name == "weights")
    array = numpy_helper.to_array(weights).reshape(3, -1, 24)
    centred = (array - array.mean(axis=1, keepdims=True)).reshape(-1, 24).astype(np.float32)
    weights.CopyFrom(numpy_helper.from_array(centred, "weights"))
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """old; refuted (declared compatible, its training's verdict: not compatible); new (declared compatible, no
    verdict); other (not declared compatible, as good on labels); blind (not declared compatible, worse); a text
    tower for old."""
    root = tmp_path_factory.mktemp("upgrade_check_models")
    old = write_projection_onnx(root / "old.onnx", dim=24, seed=0)
    old_hash = load_model(old).model_hash
    refuted = with_metadata(write_projection_onnx(root / "refuted.onnx", dim=24, seed=0, drift=0.3,
                                                  compatible_with=(old_hash,)),
                            compatibility=compatibility_record(REFUTED))
    return {"old": old, "refuted": refuted,
            "new": write_projection_onnx(root / "new.onnx", dim=24, seed=0, drift=0.3, compatible_with=(old_hash,)),
            "other": write_projection_onnx(root / "other.onnx", dim=24, seed=0, drift=0.2),  # near old, undeclared
            "blind": colour_blind(root / "blind.onnx", seed=3),
            "tower": small_text_model(root / "text.onnx", old_hash, 24)}


def _gallery(root):
    for label, colour in enumerate(COLOURS):
        (root / f"class{label}").mkdir(parents=True)
        for n in range(8):
            (root / f"class{label}" / f"img_{n}.png").write_bytes(noisy_png(colour, 100 * label + n))
    return root


@pytest.fixture
def gallery_index(tmp_path, models):
    build_index(_gallery(tmp_path / "g"), tmp_path / "idx", model=models["old"], options=QUICK)
    return tmp_path / "idx"


@pytest.fixture
def text_index(gallery_index, models):
    assert run("index", "text", gallery_index, "--text-model", models["tower"]).exit_code == 0
    return gallery_index


def _unchanged(index_dir, models) -> None:
    assert info_of(index_dir)["model_hash"] == load_model(models["old"]).model_hash
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        assert catalogue.get_meta("upgrade_model_hash") is None  # no upgrade under way: other writers may go on


def test_a_model_its_training_measured_not_compatible_is_refused_quoting_the_verdict(gallery_index, models):
    refused = run("index", "upgrade", gallery_index, "--model", models["refuted"])
    assert refused.exit_code != 0
    text = " ".join(refused.output.split())
    assert "not compatible" in text and "recall@1 0.370 vs 0.800" in text and "-0.470 to -0.390" in text
    assert "--force" in text and "Traceback" not in text
    _unchanged(gallery_index, models)


def test_force_upgrades_past_the_verdict_says_so_and_index_json_keeps_it(gallery_index, models):
    forced = run("index", "upgrade", gallery_index, "--model", models["refuted"], "--force", "--commit-every", "8")
    assert forced.exit_code == 0, forced.output
    assert "upgraded anyway (--force): its training measured it not compatible" in forced.output
    info = info_of(gallery_index)
    assert info["model_hash"] == load_model(models["refuted"]).model_hash
    last = info["last_upgrade"]
    assert last["verdict"] == "not compatible" and "not compatible" in last["forced"][0]


def test_a_model_measured_worse_on_the_index_labels_is_refused_with_the_numbers(gallery_index, models):
    with pytest.raises(UpgradeRefused, match="searches worse than the index's vectors") as refused:
        upgrade_index(gallery_index, models["blind"], options=QUICK)
    assert "stored vectors Recall@1 " in str(refused.value) and "WORSE beyond noise" in str(refused.value)
    assert "`force`" in str(refused.value)
    _unchanged(gallery_index, models)
    cli = run("index", "upgrade", gallery_index, "--model", models["blind"])
    assert cli.exit_code != 0 and "--force" in cli.output and "Traceback" not in cli.output

    summary = upgrade_index(gallery_index, models["blind"], options=QUICK, force=True)
    measured = summary["on_labels"]
    assert summary["mode"] == "swap" and measured["worse"] and "worse" in summary["forced"][0]
    assert measured["old"]["recall@1"] - measured["new"]["recall@1"] > 0.3  # blind to colour: near chance
    assert info_of(gallery_index)["last_upgrade"]["forced"] == summary["forced"]


def test_the_measurement_is_recorded_in_index_json_and_shown_by_stats_and_the_app(gallery_index, models):
    from retrieval.serve.stats_view import statistics_markdown

    summary = upgrade_index(gallery_index, models["new"], commit_every=8, options=QUICK)
    measured = summary["on_labels"]
    assert measured["measured"] and measured["images"] == 32 and measured["labels"] == 4 and not measured["worse"]
    assert set(measured["compared"]) == {"new", "cross_model"}  # mixed: its queries against the old vectors too
    assert 0 <= measured["cross_model"]["recall@1"] <= 1 and summary["forced"] == []
    last = info_of(gallery_index)["last_upgrade"]
    assert last["on_labels"] == measured and last["mode"] == "mixed"
    assert last["to"] == load_model(models["new"]).model_hash
    stats = index_stats(gallery_index, queries=10)
    assert stats["last_upgrade"]["on_labels"]["old"] == measured["old"]
    shown = statistics_markdown(stats, {})
    assert "Model upgrades" in shown and "measured first on the index" in shown


def test_an_unlabelled_index_is_upgraded_saying_it_could_not_measure(tmp_path, models):
    build_index(_gallery(tmp_path / "g"), tmp_path / "idx", model=models["old"], options=QUICK, label_from="none")
    upgraded = run("index", "upgrade", tmp_path / "idx", "--model", models["blind"])
    assert upgraded.exit_code == 0, upgraded.output
    assert "measured first on the index's labels: not measured: the index has no labels" in upgraded.output
    assert info_of(tmp_path / "idx")["last_upgrade"]["on_labels"]["measured"] is False


def test_a_swap_turns_the_text_model_off_naming_the_commands_that_refit_it(text_index, models, tmp_path):
    import gradio as gr

    from retrieval.serve.images import QueryError
    from retrieval.serve.service import SearchService
    from retrieval.serve.service.text import TextQuery
    from retrieval.serve.stats_view import statistics_markdown
    from retrieval.serve.ui.search import ExampleSet, SearchTab
    from retrieval.serve.upload_cache import UploadRecords

    upgraded = run("index", "upgrade", text_index, "--model", models["other"])
    assert upgraded.exit_code == 0, upgraded.output
    assert "text search is OFF" in upgraded.output and f"retrieval text train --model {models['other']}" in (
        upgraded.output)
    info = info_of(text_index)
    assert "text_model_hash" not in info and info[TEXT_MODEL_OFF]["upgraded_to"] == load_model(
        models["other"]).model_hash
    searched = run("search", "--index", text_index, "--text", "a red apple")
    assert searched.exit_code != 0 and "an upgrade turned text search off" in searched.output
    assert "retrieval text train --model" in searched.output and f"retrieval index text {text_index}" in (
        searched.output)
    with pytest.raises(NoTextModelError, match="turned text search off"):
        open_text_model(IndexInfo.from_json(info), text_index)
    service = SearchService(text_index, reload_interval_s=None)
    try:
        _, public = service.public_stats()
        described = service.describe()
        assert not described["text_search"] and "turned text search off" in described["text_model_problem"]
        assert str(tmp_path) not in described["text_model_problem"]  # what clients see names no server folder
        with pytest.raises(QueryError, match="turned text search off") as refused:
            service.search(TextQuery("a red apple"), 3)
        assert refused.value.status == 422
        assert public["last_upgrade"]["text_model"] == {"state": "off", "reason": info[TEXT_MODEL_OFF]["reason"]}
        page = statistics_markdown(public, {})
        assert "last upgrade: text model | an upgrade turned text search off" in page
        assert "retrieval index text" in page  # the row is whole, down to the command that re-fits one
        note = SearchTab(service, ExampleSet(service, tmp_path, count=0),
                         UploadRecords(gr.Blocks())).description_settings()["info"]
        assert "turned text search off" in note and "retrieval text train --model" in note  # the app says why
    finally:
        service.close()
    # a tower for the new model, recorded: text search is on again and the record of it being off is gone
    refit = small_text_model(tmp_path / "refit.onnx", load_model(models["other"]).model_hash, 24)
    assert run("index", "text", text_index, "--text-model", refit).exit_code == 0
    assert TEXT_MODEL_OFF not in info_of(text_index)


def test_a_forced_not_compatible_upgrade_turns_the_text_model_off_when_it_starts_serving(text_index, models):
    steps = []
    upgrade_index(text_index, models["refuted"], commit_every=8, options=QUICK, force=True,
                  on_publish=lambda progress: steps.append(info_of(text_index)))
    assert steps and all("text_model_hash" not in info and TEXT_MODEL_OFF in info for info in steps)
    assert "not compatible" in info_of(text_index)[TEXT_MODEL_OFF]["reason"]


def test_a_compatible_upgrade_keeps_the_text_model_and_says_so(text_index, models):
    upgraded = run("index", "upgrade", text_index, "--model", models["new"], "--json")
    assert upgraded.exit_code == 0, upgraded.output
    assert json.loads(upgraded.stdout)["text_model"]["state"] == "kept"
    info = info_of(text_index)
    assert info["text_model_hash"] and TEXT_MODEL_OFF not in info
    assert run("search", "--index", text_index, "--text", "a red apple", "-k", "3").exit_code == 0


def test_worse_on_labels_needs_a_drop_beyond_noise_and_at_least_the_minimum():
    rng = np.random.default_rng(0)
    old = {"recall@1": (rng.random(400) < 0.8).astype(float), "map@r": rng.random(400)}
    assert not worse_on_labels(old, old)["worse"]
    flipped = old["recall@1"].copy()
    flipped[np.flatnonzero(flipped)[:2]] = 0  # 2 of 400 queries lost: a drop of 0.005, below the minimum
    small = worse_on_labels({"recall@1": flipped, "map@r": old["map@r"]}, old)
    assert small["difference"]["recall@1"] == pytest.approx(-0.005) and -0.005 > -MIN_DROP and not small["worse"]
    lost = old["recall@1"].copy()
    lost[np.flatnonzero(lost)[:80]] = 0
    assert worse_on_labels({"recall@1": lost, "map@r": old["map@r"]}, old)["worse"]
    few = {name: values[:10] for name, values in old.items()}
    assert not worse_on_labels({"recall@1": np.zeros(10), "map@r": few["map@r"]}, few)["worse"]  # too few to tell


def test_the_labelled_sample_is_bounded_and_gives_each_query_others_of_its_label(gallery_index):
    with Catalogue(gallery_index / "catalogue.sqlite") as catalogue:
        sample = labelled_sample(catalogue, limit=10, per_label=4, seed=1)
        assert labelled_sample(catalogue, limit=10, per_label=4, seed=1) == sample  # seeded
    counts = {label: sum(1 for _, other in sample if other == label) for _, label in sample}
    assert len(sample) <= 10 and all(2 <= n <= 4 for n in counts.values())
