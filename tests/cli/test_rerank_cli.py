"""`retrieval search --rerank` and `retrieval evaluate --rerank`: the options come from ``RerankConfig``'s
declarations, a bad value names its flag, search answers what ``Index.search(..., rerank=)`` answers, and evaluate's
JSON keeps the plain metrics and adds a "reranked" block."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from retrieval.cli.main import main
from retrieval.index import Index, load_model
from retrieval.options import declared_options
from retrieval.rerank import RerankConfig

pytestmark = pytest.mark.timeout(300)


def search(artifacts, *args: str):
    return CliRunner().invoke(main, ["search", "--index", str(artifacts.index_dir), "-k", "4", *args])


def test_search_and_evaluate_have_one_option_per_declared_field():
    flags = {d.flag for d in declared_options(RerankConfig)}
    for command in (main.commands["search"], main.commands["evaluate"]):
        assert flags <= {opt for p in command.params for opt in p.opts}, command.name


@pytest.mark.parametrize("method", ["qe", "dba", "kreciprocal"])
def test_search_rerank_answers_what_the_index_answers(artifacts, method):
    query = artifacts.query_paths[2]
    result = search(artifacts, "--json", "--exclude-self", "--rerank", method, "--rerank-candidates", "12",
                    "--rerank-k", "3", "--rerank-k1", "5", "--rerank-k2", "2", str(query))
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)[0]
    config = RerankConfig(method=method, candidates=12, k=3, k1=5, k2=2)
    with Index.open(artifacts.index_dir) as index:
        from retrieval.data.decode import read_image

        embedding = load_model(index.info.model.path).embed([read_image(query).image])
        own = (answer["excluded_self"],) if answer["excluded_self"] is not None else ()
        expected = index.search(embedding, 4, exclude_ids=own, rerank=config)[0]
    assert [r["id"] for r in answer["results"]] == [r.id for r in expected]
    assert [r["rerank_score"] for r in answer["results"]] == pytest.approx([r.rerank_score for r in expected])

    text = search(artifacts, "--rerank", method, str(query))
    assert text.exit_code == 0 and f"re-ranked by {method}, the top 100 (" in text.output, text.output


@pytest.mark.parametrize("args,message", [
    (["--rerank", "sift"], "'sift' is not one of 'none', 'qe', 'dba', 'kreciprocal'"),
    (["--rerank", "qe", "--rerank-k", "500"], "--rerank-k must be in [1, 100], got 500"),
    (["--rerank", "kreciprocal", "--rerank-candidates", "5000"], "--rerank-candidates must be in [1, 1000] results"),
    (["--rerank", "kreciprocal", "--rerank-lambda", "-0.5"], "--rerank-lambda must be in [0, 1], got -0.5"),
])
def test_a_bad_rerank_option_is_refused_naming_its_flag(artifacts, args, message):
    result = search(artifacts, *args, str(artifacts.query_paths[0]))
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An untrained small embedder (32 px EfficientNet-Lite0, no weights) recorded as trained on digits."""
    import torch

    from retrieval.models import create_embedder
    from retrieval.models.checkpoint import CHECKPOINT_FORMAT

    torch.manual_seed(0)
    model = create_embedder("efficientnet_lite0", embedding_dim=16)
    model.config = model.config.with_fields({"input_size": 32})
    path = tmp_path_factory.mktemp("rerank-eval") / "model.pt"
    torch.save({"format": CHECKPOINT_FORMAT, "model_config": model.config.to_json(), "state_dict": model.state_dict(),
                "train_config": {"dataset": "digits", "dataset_kwargs": {"protocol": "standard"}}}, path)
    return path


def test_evaluate_rerank_adds_a_reranked_block_beside_the_plain_metrics(checkpoint, tmp_path):
    pytest.importorskip("torch")
    common = ["evaluate", "--checkpoint", str(checkpoint), "--limit", "150", "--workers", "0", "--no-pictures",
              "--device", "cpu", "--json"]
    plain = CliRunner().invoke(main, [*common, "--out", str(tmp_path / "plain.json")])
    assert plain.exit_code == 0, plain.output
    plain_metrics = json.loads(plain.stdout)
    assert "reranked" not in plain_metrics
    result = CliRunner().invoke(main, [*common, "--out", str(tmp_path / "reranked.json"), "--rerank", "kreciprocal",
                                       "--rerank-candidates", "30"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    for key in ("recall@1", "map@r", "r_precision", "nmi"):
        assert metrics[key] == pytest.approx(plain_metrics[key]), key  # the plain metrics are unchanged
    block = metrics["reranked"]
    # 150 test images of 10 digits: a typical one has 14 others of its digit, which sets k1 and k2 (k1 / 3)
    assert block["method"] == "kreciprocal" and block["params"] == {"candidates": 30, "k1": 14, "k2": 5,
                                                                    "lambda_value": 0.3}
    assert "has 14 other images (10 labels, 150 images)" in block["defaults"]
    assert set(block["metrics"]) == {"recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision"}
    assert all(0 <= value <= 1 for value in block["metrics"].values())
    assert block["metrics"]["map@r"] != plain_metrics["map@r"]  # it re-ranked something
    report = json.loads((tmp_path / "reranked.json").read_text())
    assert report["reranked"] == block and np.isclose(report["metrics"]["map@r"], plain_metrics["map@r"])


@pytest.fixture(scope="module")
def checkpoint_with_validation(checkpoint, tmp_path_factory):
    """The same model recorded as trained on digits' train classes with 2 of its 5 held out for validation."""
    import torch

    saved = torch.load(checkpoint, weights_only=False)
    saved["train_config"] = {"dataset": "digits", "val_fraction": 0.4, "seed": 0}
    path = tmp_path_factory.mktemp("rerank-choose") / "model.pt"
    torch.save(saved, path)
    return path


def test_evaluate_chooses_the_unset_sizes_on_the_validation_classes(checkpoint_with_validation, tmp_path):
    pytest.importorskip("torch")
    from retrieval.data import load_dataset
    from retrieval.metrics.evaluation import RERANK_CHOICES
    from retrieval.train.data import hold_out_classes

    result = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(checkpoint_with_validation), "--limit", "120",
                                       "--workers", "0", "--no-pictures", "--device", "cpu", "--rerank", "qe",
                                       "--rerank-choose", "--out", str(tmp_path / "report.json")])
    assert result.exit_code == 0, result.output
    block = json.loads((tmp_path / "report.json").read_text())["reranked"]
    chosen = block["chosen"]
    held = hold_out_classes(load_dataset("digits", None, split="train"), 0.4, 0)[1]
    assert chosen["on"] == "validation" and chosen["classes"] == 2 == len(set(held.labels))
    assert chosen["images"] == 120  # --limit bounds the validation images too
    tried = [row["params"]["k"] for row in chosen["tried"] if row["params"] is not None]
    assert sorted(tried) == sorted(RERANK_CHOICES["k"]) and [None] == [r["params"] for r in chosen["tried"]
                                                                       if r["params"] is None]
    best = max(chosen["tried"][1:] if chosen["tried"][0]["params"] is None else chosen["tried"],
               key=lambda row: row["map@r"] if row["params"] is not None else -1)
    assert block["params"]["k"] == best["params"]["k"] and "defaults" not in block
    assert chosen["tried"] == sorted(chosen["tried"], key=lambda row: -row["map@r"])
    assert f"validation images of 2 classes: k = {best['params']['k']}, alpha = 3.0 (MAP@R" in result.output


@pytest.mark.parametrize("args,message", [
    (["--rerank-choose"], "give --rerank qe|dba|kreciprocal"),
    (["--rerank", "qe", "--rerank-k", "3", "--rerank-choose"], "leave out --rerank-k"),
])
def test_evaluate_refuses_a_choice_with_nothing_to_choose(checkpoint, args, message):
    result = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(checkpoint), "--no-pictures", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_evaluate_refuses_to_choose_for_a_checkpoint_trained_without_validation(checkpoint, tmp_path):
    import torch

    saved = torch.load(checkpoint, weights_only=False)
    saved["train_config"]["val_fraction"] = 0
    checkpoint = tmp_path / "model.pt"
    torch.save(saved, checkpoint)
    result = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(checkpoint), "--limit", "60", "--workers",
                                       "0", "--no-pictures", "--device", "cpu", "--rerank", "dba", "--rerank-choose",
                                       "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 1 and "its training had none (--val-fraction 0 turned it off)" in result.output, \
        result.output
    assert "embed query" not in result.output  # refused before the split was embedded
