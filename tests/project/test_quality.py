"""The results grid (`retrieval results run`): runs, skips finished cells, resumes, renders; the app's Results tab."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest

import retrieval.train.grid_runner as grid_runner
from retrieval.analysis.grid import TABLES as GRID_TABLES
from retrieval.analysis.grid import DatasetSpec, Method, Table
from retrieval.analysis.grid_discussion import discuss_pairs
from retrieval.analysis.results import (
    MARKER,
    best_rows,
    difference,
    format_cell,
    generated_block,
    generated_blocks,
    grid_size,
    marker_ids,
    results_document,
    results_markdown,
    summarize,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS_MD, RESULTS_JSON = ROOT / "docs" / "RESULTS.md", ROOT / "docs" / "results.json"

# The grid runner is under test, not the runs: 20 digits a class (the backbone's features are extracted once per
# data set: 400 images, not 1797), a 64-d head (each run's linear probe fits a logistic regression on it), one step an
# epoch, and no report plots in the run folders (a t-SNE map per run took most of the fixture's minutes;
# tests/analysis/test_pictures.py checks those pictures). The grid's own figures are still drawn.
DIGITS = dict(dataset="digits", image_size=32, batch_size=20, per_class=4, epochs=2, batches_per_epoch=1, workers=0,
              embedding_dim=64, plots=False)
DATASETS = {
    "digits": DatasetSpec("digits", "Digits", "sklearn digits, class-disjoint",
                          dict(DIGITS, dataset_kwargs={"protocol": "disjoint", "limit_per_class": 20})),
    "digits-std": DatasetSpec("digits-std", "Digits standard", "sklearn digits, all classes",
                              dict(DIGITS, dataset_kwargs={"protocol": "standard", "limit_per_class": 20},
                                   linear_probe=True)),
}
TABLES = [
    Table("loop", "LoOp", "claim", "caveat", ("digits",),
          (Method("triplet", "triplet"), Method("triplet + LoOp", "triplet", "loop"))),
    Table("sct", "SCT", "claim", "caveat", ("digits",),
          (Method("NCA triplet, HN", "nca_triplet", loss_kwargs={"mining": "hard"}), Method("SCT", "sct")),
          curve="loss_hard_fraction"),
    Table("dcdl", "DCDL", "claim", "caveat", ("digits-std",), (), noise=(None, "symmetric:0.3"),
          blocks=(("triplet", (Method("triplet", "triplet", normalize=True),
                               Method("triplet + Sinkhorn", "dcdl", loss_kwargs={"local": "triplet"},
                                      normalize=True))),)),
]
SEEDS = [0, 1]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    paths = dict(runs=root / "runs", feature_cache=str(root / "features"), markdown=root / "RESULTS.md",
                 json_path=root / "results.json", figures=root / "figures")
    results = grid_runner.run_grid(TABLES, DATASETS, SEEDS, **paths)
    return results, paths


def test_grid_writes_every_cell_over_seeds(grid):
    results, paths = grid
    saved = json.loads(paths["json_path"].read_text())
    assert saved == json.loads(json.dumps(results))
    assert [t["id"] for t in saved["tables"]] == ["loop", "sct", "dcdl"]
    assert saved["setup"]["runs"] == 4 + 4 + 8  # triplet is shared: each cell once per seed
    loop = saved["tables"][0]
    floor, base, looped = loop["blocks"][0]["rows"]
    assert floor["floor"] and floor["cells"]["recall@1"]["n"] == 1
    for row in (base, looped):
        cell = row["cells"]["recall@1"]
        assert cell["n"] == 2 and 0 < cell["mean"] <= 1 and cell["std"] >= 0
    assert "--negatives loop" in looped["command"] and "--negatives" not in base["command"]
    dcdl = saved["tables"][2]
    assert [c["key"] for c in dcdl["columns"]] == ["clean", "symmetric 0.3"]
    sinkhorn = dcdl["blocks"][0]["rows"][2]
    assert all(sinkhorn["cells"][k]["n"] == 2 for k in ("clean", "symmetric 0.3"))
    assert dcdl["blocks"][0]["rows"][0]["cells"]["clean"]["n"] == 1  # the floor's linear probe
    # SCT Figure 6: one value per epoch, averaged over seeds, for both rows
    (curve,) = saved["curves"]
    assert set(curve["series"]["Digits"]) == {"NCA triplet, HN", "SCT"}
    assert all(len(ys) == 2 and all(0 <= y <= 1 for y in ys) for ys in curve["series"]["Digits"].values())
    assert (paths["figures"] / "sct_hard_fraction.png").stat().st_size > 1000
    markdown = paths["markdown"].read_text()
    assert "## LoOp" in markdown and "**Discussion.**" in markdown and "sct_hard_fraction.png" in markdown
    assert "*pretrained only (no head)*" in markdown and "**" in markdown.split("## SCT")[0]
    assert any("LoOp raises Recall@1 for" in point for point in loop["discussion"])


def test_finished_cells_are_skipped_and_interrupted_ones_resume(grid, monkeypatch):
    results, paths = grid
    from retrieval import train

    calls = []

    def fake_train(cfg, progress=True):
        calls.append(cfg)
        from retrieval.train.trainer import Trainer

        return Trainer(cfg, progress=False).run()

    monkeypatch.setattr(train, "train", fake_train)
    written = paths["markdown"].read_text()
    hand = "## Robust fine-tuning\n\nmeasured by hand\n"
    edited = written.replace("*Caveats:* caveat", "*Caveats:* a caveat written by hand") + "\n" + hand
    stale = edited.replace("**Discussion.**", "**Discussion (stale).**", 1)  # a generated part edited by hand
    paths["markdown"].write_text(stale)
    again = grid_runner.run_grid(TABLES, DATASETS, SEEDS, **paths)
    assert calls == []  # nothing was trained again
    assert again["tables"][0]["blocks"] == results["tables"][0]["blocks"]
    # the generated parts rewritten from the results, the prose around them kept as it was
    assert paths["markdown"].read_text() == edited

    interrupted = paths["runs"] / "digits" / "triplet+loop" / "seed1"
    (interrupted / "report.json").unlink()  # as if killed after its last checkpoint
    grid_runner.run_grid(TABLES, DATASETS, SEEDS, **paths)
    assert len(calls) == 1 and calls[0].resume and Path(calls[0].out) == interrupted
    grid_runner.run_grid(TABLES, DATASETS, SEEDS, **paths)
    assert len(calls) == 1  # a resumed run counts as finished too


def test_cell_command_reproduces_its_configuration(tmp_path):
    from click.testing import CliRunner

    from retrieval.cli.main import main

    captured = {}

    def fake_train(cfg, progress=True):
        captured["cfg"] = cfg
        return {}

    from retrieval import train

    for method in (Method("x", "dcdl", loss_kwargs={"local": "npair", "phi": "sinkhorn"}, normalize=False),
                   Method("y", "nca_triplet", loss_kwargs={"mining": "semihard"})):
        run = grid_runner.Run(TABLES[0], DATASETS["digits-std"], method, "asymmetric:0.2", 2, tmp_path / "r")
        cfg = run.config(feature_cache=None)
        command = grid_runner.train_command(cfg).replace("--seed S", "--seed 2").replace("RUN", str(tmp_path / "r"))
        args = shlex.split(command)[2:]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(train, "train", fake_train)
            result = CliRunner().invoke(main, ["train", *args])
        assert result.exit_code == 0, result.output
        assert captured["cfg"].to_dict() == cfg.to_dict()


def test_summary_and_significance():
    cell = summarize([0.5, 0.7])
    assert cell["mean"] == pytest.approx(0.6) and cell["std"] == pytest.approx(math.sqrt(0.02)) and cell["n"] == 2
    assert summarize([0.4])["std"] == 0.0 and summarize([])["n"] == 0
    far, near = summarize([0.80, 0.81, 0.82]), summarize([0.60, 0.61, 0.62])
    assert difference(far, near) == (pytest.approx(0.2), True)
    assert difference(summarize([0.8]), summarize([0.6]))[1] is False  # one seed: the noise is unknown
    assert difference(summarize([0.5, 0.9]), summarize([0.6, 0.7]))[1] is False
    assert format_cell(far) == "81.0 ± 1.0" and format_cell(far, bold=True) == "**81.0 ± 1.0**"
    assert format_cell(None) == "–"


def test_best_rows_ignore_the_floor_and_keep_ties():
    block = {"rows": [
        {"label": "floor", "floor": True, "cells": {"r": summarize([0.99])}},
        {"label": "a", "cells": {"r": summarize([0.5])}},
        {"label": "b", "cells": {"r": summarize([0.7])}},
        {"label": "c", "cells": {"r": summarize([0.7])}},
    ]}
    assert best_rows(block, "r") == {2, 3}
    table = {"title": "T", "columns": [{"key": "r", "label": "R"}], "blocks": [dict(block, title="B")]}
    text = results_markdown({"tables": [table]})
    assert "| *floor* | 99.0 |" in text and "| b | **70.0** |" in text and "| a | 50.0 |" in text


def test_pair_discussion_counts_gains_beyond_noise():
    def row(label, r1, m):
        return {"label": label, "cells": {"recall@1": summarize(r1), "map@r": summarize(m)}}

    entry = {"blocks": [{"title": "Data", "short": "Data", "rows": [
        row("triplet", [0.50, 0.51, 0.52], [0.3, 0.3, 0.3]), row("triplet + LoOp", [0.60, 0.61, 0.62], [0.4] * 3),
        row("ms", [0.70, 0.71, 0.72], [0.5] * 3), row("ms + LoOp", [0.69, 0.71, 0.73], [0.5] * 3),
    ]}]}
    (point,) = discuss_pairs(entry, "LoOp", "LoOp")
    assert "raises Recall@1 for 1 of 2 losses (1 beyond seed noise, 0 clearly lower)" in point
    assert "triplet +10.0 (MAP@R +10.0)" in point and "holds only in part" in point


def _prose(text: str) -> str:
    """A results document without its generated parts: what is written by hand."""
    return MARKER.sub(lambda m: m["id"], text)


def test_results_md_agrees_with_results_json():
    """docs/RESULTS.md's generated parts are exactly what docs/results.json renders to, and each has its place: a
    number edited by hand, or a results file re-run without rewriting the page, fails here."""
    document, results = RESULTS_MD.read_text(encoding="utf-8"), json.loads(RESULTS_JSON.read_text())
    assert sorted(marker_ids(document)) == sorted(generated_blocks(results))
    rendered = results_document(document, results)
    stale = [i for i, (a, b) in enumerate(zip(document.splitlines(), rendered.splitlines(), strict=False)) if a != b]
    assert rendered == document, f"docs/RESULTS.md disagrees with docs/results.json from line {stale[:1]}"


def test_rewriting_results_md_keeps_the_prose():
    document, results = RESULTS_MD.read_text(encoding="utf-8"), json.loads(RESULTS_JSON.read_text())
    hand = document.replace("*Paper:* LoOp improves", "*Paper:* By hand, LoOp improves")
    stale = hand.replace("| triplet | 15.4 ± 0.3 |", "| triplet | 99.9 ± 0.3 |", 1)
    assert stale != hand and results_document(stale, results) == hand
    changed = json.loads(json.dumps(results))
    changed["tables"][0]["blocks"][0]["rows"][1]["cells"]["recall@1"]["mean"] = 0.01
    rewritten = results_document(hand, changed)
    assert "| triplet | 1.0 ± 0.3 |" in rewritten and _prose(rewritten) == _prose(hand)
    with pytest.raises(ValueError, match="markers do not pair up"):  # else a part would swallow the prose after it
        results_document(hand.replace("<!-- end results -->", "", 1), results)


def test_results_md_has_its_prose_and_not_its_history():
    """The prose lives in the page: the protocol, each table's claim and caveats; no work history in it."""
    document = RESULTS_MD.read_text(encoding="utf-8")
    prose = _prose(document)
    assert "Protocol:" in prose and prose.count("*Paper:*") == len(GRID_TABLES)
    assert prose.count("*Caveats:*") == len(GRID_TABLES)
    assert not re.search(r"\bissue \d+|\bnot re-run\b|\blent\b|re-run since", document, re.IGNORECASE)
    assert "seeds 0, 1, 2" in document and "lr 0.001" in document  # from the results, in the setup part


def test_a_new_table_gets_a_section_and_a_new_document_its_parts():
    results = json.loads(RESULTS_JSON.read_text())
    document = RESULTS_MD.read_text(encoding="utf-8")
    without = MARKER.sub(lambda m: "" if m["id"].startswith("proxy") else m[0], document)
    rewritten = results_document(without, results)
    proxy = next(t for t in results["tables"] if t["id"] == "proxy")
    added = rewritten[len(without.rstrip("\n")):]
    assert f"## {proxy['title']}" in added and f"*Caveats:* {proxy['caveats']}" in added
    assert generated_block("proxy", generated_blocks(results)["proxy"]) in added
    fresh = results_document(None, results)
    assert fresh.startswith("# Results\n\n<!-- results: setup -->")
    assert sorted(marker_ids(fresh)) == sorted(generated_blocks(results))
    assert results_document(fresh, results) == fresh


def test_grid_size_names_where_each_table_comes_from():
    results = json.loads(RESULTS_JSON.read_text())
    text = grid_size(results)
    assert text.startswith("Grid size: tables loop, symm, sct and unified come from the grid of 2026-11-21 09:13:10 "
                           "(312 runs, 126 min of training and evaluation")
    assert "table dcdl comes from `retrieval results run --tables dcdl` of 2026-11-23 12:21:51 (180 runs, 338 min)" \
        in text
    single = {"tables": results["tables"][:1], "setup": {"runs": 8, "train_seconds_total": 600,
                                                        "cells_not_finished": ["a", "b"]}}
    assert grid_size(single).startswith("Grid size: 8 runs; their training and evaluation took 10 min in all")
    assert grid_size(single).endswith("; 2 cells had not finished all their seeds and are left empty.")


def test_results_tab_shows_tables_and_figure(grid, tmp_path):
    from retrieval.serve.ui import ResultsTab

    _, paths = grid
    tab = ResultsTab(paths["json_path"])
    assert [i for _, i in tab.titles()] == ["loop", "sct", "dcdl"]
    text, figure = tab.show("sct")
    assert "## SCT" in text and "NCA triplet, HN" in text and figure is not None and figure.size[0] > 100
    text, figure = tab.show("loop")
    assert "triplet + LoOp" in text and figure is None
    missing = ResultsTab(tmp_path / "none.json")
    text, _ = missing.show(None)
    assert "no results grid at" in text and "retrieval results run" in text
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    assert "not a results file" in ResultsTab(tmp_path / "bad.json").show(None)[0]


def test_a_failing_run_is_reported_and_the_rest_still_runs(grid, tmp_path):
    _, paths = grid
    table = Table("loop", "LoOp", "claim", "caveat", ("digits",),
                  (Method("triplet", "triplet"), Method("broken", "triplet", loss_kwargs={"mining": "nope"})))
    out = dict(paths, markdown=tmp_path / "R.md", json_path=tmp_path / "r.json", figures=tmp_path / "f")
    results = grid_runner.run_grid([table], DATASETS, SEEDS, **out)
    assert not results["complete"] and len(results["failures"]) == 2
    assert "mining" in results["failures"][0]["error"]
    rows = {r["label"]: r for r in results["tables"][0]["blocks"][0]["rows"]}
    assert rows["triplet"]["cells"]["recall@1"]["n"] == 2 and rows["broken"]["cells"]["recall@1"]["n"] == 0
    assert "Runs that failed" in (tmp_path / "R.md").read_text()


def test_rerunning_one_table_keeps_the_others_and_shows_only_complete_cells(grid, monkeypatch):
    """`--tables dcdl --report-only`: the other tables stay exactly as they were in results.json; a cell with a
    seed missing is left empty rather than shown with fewer seeds; nothing is trained."""
    results, paths = grid
    from retrieval import train

    monkeypatch.setattr(train, "train", lambda cfg, progress=True: pytest.fail("report-only must not train"))
    before = json.loads(paths["json_path"].read_text())
    dcdl_table = [t for t in TABLES if t.id == "dcdl"]
    grid_runner.run_grid(dcdl_table, DATASETS, SEEDS, **paths, train=False)
    saved = json.loads(paths["json_path"].read_text())
    assert [t["id"] for t in saved["tables"]] == ["loop", "sct", "dcdl"]
    words = ("title", "claim", "caveats")  # a kept table's numbers stay; its words are the grid's current ones
    for kept, old in zip(saved["tables"][:2], before["tables"][:2], strict=True):
        assert {k: v for k, v in kept.items() if k not in words} == {k: v for k, v in old.items() if k not in words}
        assert kept["caveats"] == next(t.caveats for t in GRID_TABLES if t.id == kept["id"])
    assert saved["curves"] == before["curves"]
    assert saved["tables"][2]["blocks"] == before["tables"][2]["blocks"]
    assert saved["setup"]["kept"]["tables"] == ["loop", "sct"]
    markdown = paths["markdown"].read_text()
    assert f"tables loop and sct come from the grid of {before['created']}" in markdown
    assert "table dcdl comes from the grid of" in markdown
    grid_runner.run_grid(dcdl_table, DATASETS, SEEDS, **paths, train=False)  # again: the kept tables' origin stays
    twice = json.loads(paths["json_path"].read_text())
    assert twice["setup"]["kept"]["from"] == before["created"]
    assert twice["setup"]["kept"]["setup"]["runs"] == before["setup"]["runs"]

    sinkhorn = dcdl_table[0].blocks[0][1][1]
    missing = grid_runner.cell_dir(paths["runs"], "digits-std", sinkhorn, None) / "seed1" / "report.json"
    missing.unlink()
    again = grid_runner.run_grid(dcdl_table, DATASETS, SEEDS, **paths, train=False)
    row = again["tables"][2]["blocks"][0]["rows"][2]
    assert row["label"] == "triplet + Sinkhorn"
    assert row["cells"]["clean"]["n"] == 0 and row["cells"]["symmetric 0.3"]["n"] == 2
    assert len(again["setup"]["cells_not_finished"]) == 1


def test_results_command_runs_the_grid_with_its_options(tmp_path, monkeypatch):
    """`retrieval results run|report` (formerly `python benchmarks/quality.py`): the options reach the runner, and
    the documents name the command that re-runs them."""
    from click.testing import CliRunner

    from retrieval.cli.main import main

    calls = []

    def fake_run_grid(tables, datasets, seeds, runs, feature_cache=None, markdown=None, json_path=None, figures=None,
                      **options):
        calls.append(dict(tables=[t.id for t in tables], seeds=seeds, runs=runs, json_path=json_path, **options))
        return {"setup": {"runs": 0, "train_seconds_total": 0.0}}

    monkeypatch.setattr(grid_runner, "run_grid", fake_run_grid)
    paths = ["--runs", str(tmp_path / "runs"), "--json", str(tmp_path / "r.json"), "--markdown",
             str(tmp_path / "R.md"), "--figures", str(tmp_path / "f")]
    result = CliRunner().invoke(main, ["results", "report", "--tables", "dcdl", "--seeds", "0,1", "--seeds", "2",
                                       "--skip-cells", "*sinkhorn*", *paths])
    assert result.exit_code == 0, result.output
    (call,) = calls
    assert call["tables"] == ["dcdl"] and call["seeds"] == [0, 1, 2] and call["train"] is False
    assert call["command"] == "retrieval results run --tables dcdl" and call["skip_cells"] == ("*sinkhorn*",)

    result = CliRunner().invoke(main, ["results", "run", "--tables", "loop,sct", "--shard", "1/2", "--datasets",
                                       "fmnist-disjoint", *paths])
    assert result.exit_code == 0, result.output
    assert calls[-1]["tables"] == ["loop", "sct"] and calls[-1]["shard"] == (1, 2) and "command" not in calls[-1]
    assert "run `retrieval results report`" in result.output

    result = CliRunner().invoke(main, ["results", "run", "--tables", "nope", *paths])
    assert result.exit_code != 0 and "choose from loop, symm, sct, unified, dcdl" in result.output
    result = CliRunner().invoke(main, ["results", "run", "--shard", "2/2", *paths])
    assert result.exit_code != 0 and "K/N" in result.output
