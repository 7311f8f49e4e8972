"""End to end with a real exported ONNX model: CLI build, search, and the model check."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from embedders import FakeEmbedder

from retrieval.cli.index import index_group, search_command
from retrieval.data.synthetic import write_digits
from retrieval.index import Index, ModelMismatchError, load_model


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory):
    from retrieval.export import export_embedder
    from retrieval.models import create_embedder

    root = tmp_path_factory.mktemp("onnx")
    torch.manual_seed(0)
    model = create_embedder("resnet18", embedding_dim=32, pretrained=False, normalize=True).eval()
    export_embedder(model, root / "model.onnx", verify=False, log=lambda message: None)
    return root / "model.onnx"


def test_cli_build_and_search_with_real_onnx(onnx_model, tmp_path):
    model = onnx_model
    paths = write_digits(tmp_path / "gallery", 24)
    out = tmp_path / "idx"
    result = CliRunner().invoke(
        index_group,
        [
            "build",
            "--model",
            str(model),
            "--images",
            str(tmp_path / "gallery"),
            "--out",
            str(out),
            "--batch-size",
            "8",
            "--workers",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{") :])
    assert summary["indexed"] == 24 and summary["errors"] == 0
    info = json.loads((out / "index.json").read_text())
    assert info["model_hash"] == load_model(model).model_hash and info["model_path"] == str(model.resolve())
    assert info["model_hash"] == load_model(model).metadata["model_hash"]  # what the export printed and stored

    result = CliRunner().invoke(
        search_command, ["--index", str(out), "--json", "-k", "3", *map(str, paths[:4])]
    )
    assert result.exit_code == 0, result.output
    for query, payload in zip(paths[:4], json.loads(result.output), strict=True):
        assert payload["results"][0]["file"] == str(query.resolve())
        assert payload["results"][0]["score"] == pytest.approx(1.0, abs=1e-4)

    with pytest.raises(ModelMismatchError, match=load_model(model).model_hash + ".*upgrade the index"):
        Index.open(out, embedder=FakeEmbedder())  # any other model is refused
    with Index.open(out) as index:  # the stored model path is used when none is given
        assert index.search_images([paths[1]], k=1)[0][0].path == str(paths[1].resolve())
