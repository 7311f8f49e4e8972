"""--label-from: where a gallery image's label comes from, said at build time, kept by add."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from index_builds import load_models_as
from sample_images import write_images

from retrieval.index import add_images, build_index
from retrieval.index.embedding.engine import IngestOptions

QUICK = IngestOptions(workers=0)


@pytest.fixture
def nested(tmp_path):
    """shapes/star/variants/deep/*.png, shapes/star/*.png, shapes/moon/*.png and one image at the top."""
    root = tmp_path / "shapes"
    for folder, count, start in (("star/variants/deep", 3, 0), ("star", 2, 10), ("moon", 4, 20), (".", 1, 30)):
        write_images(root / folder, count, start)
    return root


@pytest.mark.parametrize(("rule", "expected"), [
    ("parent", {"deep": 3, "star": 2, "moon": 4}),
    ("top", {"star": 5, "moon": 4}),
    ("none", {}),
])
def test_each_rule_labels_as_documented_and_the_summary_counts_the_classes(nested, tmp_path, rule, expected):
    summary = build_index(nested, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK, label_from=rule)
    labels = summary["labels"]
    assert labels["from"] == rule and labels["classes"] == len(expected)
    assert labels["largest_classes"] == dict(sorted(expected.items(), key=lambda kv: (-kv[1], kv[0])))
    assert labels["unlabelled"] == 10 - sum(expected.values())  # the top-level image never has a label


def test_the_default_is_the_parent_folder_and_add_keeps_the_index_rule(nested, tmp_path):
    summary = build_index(nested, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK, label_from="top")
    assert summary["labels"]["from"] == "top"
    extra = tmp_path / "more" / "star" / "new" / "deeper"
    write_images(extra, 2, 40)
    added = add_images(tmp_path / "idx", tmp_path / "more", embedder=FakeEmbedder(), options=QUICK)
    assert added["labels"]["from"] == "top" and added["labels"]["largest_classes"] == {"star": 2}
    with pytest.raises(ValueError, match="parent is not the rule this index labels its images by, top"):
        add_images(tmp_path / "idx", tmp_path / "more", embedder=FakeEmbedder(), options=QUICK, label_from="parent")
    default = build_index(nested, tmp_path / "idx2", embedder=FakeEmbedder(), options=QUICK)
    assert default["labels"]["from"] == "parent"


def test_manifest_rule_needs_a_manifest(nested, tmp_path):
    with pytest.raises(ValueError, match="label_from manifest takes a manifest's label column"):
        build_index(nested, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK, label_from="manifest")
    manifest = tmp_path / "list.csv"
    images = sorted(p for p in nested.rglob("*.png"))
    manifest.write_text("path,label\n" + "".join(f"{p},{'round' if 'moon' in str(p) else 'pointy'}\n"
                                                  for p in images))
    summary = build_index(manifest, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    assert summary["labels"]["from"] == "manifest" and summary["labels"]["classes"] == 2


def test_the_command_line_prints_the_rule_and_the_classes(nested, tmp_path, monkeypatch):
    from retrieval.cli.index import index_group

    load_models_as(monkeypatch, lambda path, providers="auto": FakeEmbedder())
    shutil.rmtree(nested / "star" / "variants")
    result = CliRunner().invoke(index_group, ["build", "--model", "m.onnx", "--images", str(nested), "--out",
                                              str(tmp_path / "idx"), "--workers", "0", "--label-from", "top",
                                              "--json"])
    assert result.exit_code == 0, result.output
    labels = json.loads(result.output[result.output.index("{\n"):])["labels"]
    assert labels["largest_classes"] == {"moon": 4, "star": 2} and "first folder under" in labels["rule"]
    help_text = " ".join(CliRunner().invoke(index_group, ["build", "--help"]).output.split())
    assert "--label-from" in help_text and "the name of the folder the image is in" in help_text


def catalogue_labels(index_dir) -> dict[str, str | None]:
    from retrieval.index.catalogue import Catalogue

    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        rows = catalogue.rows([int(i) for (i,) in catalogue.db.execute("SELECT id FROM images")])
    return {row["path"].split("shapes/", 1)[-1]: row["label"] for row in rows.values()}


def test_repair_relabels_the_index_without_embedding_again(nested, tmp_path, monkeypatch):
    """A star under star/variants/deep was labelled `deep`: `index repair --label-from top` relabels the index
    (labels only), a server's next state sees it, and `index add` then keeps the new rule."""
    from retrieval.cli.index import index_group
    from retrieval.cli.main import main
    from retrieval.index import Index

    build_index(nested, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    assert catalogue_labels(tmp_path / "idx")["star/variants/deep/img_000.png"] == "deep"
    shards = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "idx" / "shards").iterdir())

    def no_embedding(*_args, **_kwargs):
        raise AssertionError("relabelling must not embed")

    load_models_as(monkeypatch, no_embedding)
    result = CliRunner().invoke(index_group, ["repair", str(tmp_path / "idx"), "--label-from", "top"])
    assert result.exit_code == 0, result.output
    assert "relabelled 3 images, now 2 classes by --label-from top" in result.output
    labels = catalogue_labels(tmp_path / "idx")
    assert labels["star/variants/deep/img_000.png"] == "star" and labels["moon/img_020.png"] == "moon"
    assert labels["img_030.png"] is None
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "idx" / "shards").iterdir()) == shards
    with Index.open(tmp_path / "idx") as index:  # what a server opens next
        assert sorted({label for _, label in index.catalogue.labelled()}) == ["moon", "star"]
    write_images(tmp_path / "more" / "moon" / "new", 1, 50)
    added = add_images(tmp_path / "idx", tmp_path / "more", embedder=FakeEmbedder(), options=QUICK)
    assert added["labels"]["from"] == "top" and added["labels"]["largest_classes"] == {"moon": 1}
    refused = CliRunner().invoke(main, ["index", "repair", str(tmp_path / "idx"), "--label-from", "manifest"])
    assert refused.exit_code != 0 and "--label-from manifest takes a manifest's label column" in refused.output
    assert catalogue_labels(tmp_path / "idx")["star/variants/deep/img_000.png"] == "star"  # nothing lost


def test_a_refused_rule_names_the_relabel_command(nested, tmp_path):
    build_index(nested, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    with pytest.raises(ValueError, match="top is not the rule .*; give that rule .*, or relabel the whole index first"):
        add_images(tmp_path / "idx", nested, embedder=FakeEmbedder(), options=QUICK, label_from="top")


def test_a_class_folder_that_is_a_link_is_indexed_under_its_name_and_a_loop_is_not(tmp_path):
    root = tmp_path / "shapes"
    write_images(root / "moon", 2, 0)
    write_images(root / ".store" / "stars", 3, 10)
    (root / "star").symlink_to(root / ".store" / "stars", target_is_directory=True)
    (root / "moon" / "up").symlink_to(root, target_is_directory=True)  # an ancestor: listed once, no loop
    summary = build_index(root, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    assert summary["indexed"] == 5 and summary["errors"] == 0
    assert summary["labels"]["largest_classes"] == {"stars": 3, "moon": 2}  # listed under its own folder first


def test_a_linked_folder_outside_the_gallery_is_not_followed_and_is_named(tmp_path, caplog):
    """A server sends every catalogued file: a link to a folder elsewhere (a home folder, /) must not put it in the
    index, as a metadata path outside an embeddings folder must not."""
    root = tmp_path / "shapes"
    write_images(root / "moon", 2, 0)
    write_images(tmp_path / "private" / "stars", 3, 10)
    (root / "star").symlink_to(tmp_path / "private" / "stars", target_is_directory=True)
    with caplog.at_level("WARNING"):
        summary = build_index(root, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    assert summary["indexed"] == 2 and summary["labels"]["largest_classes"] == {"moon": 2}
    assert "lead outside it and were not followed" in caplog.text and str(tmp_path / "private" / "stars") in caplog.text
