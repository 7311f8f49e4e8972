"""What `retrieval export --checkpoint` says to run next, from the exported model's metadata: an index build for a
model declared compatible with nothing; `retrieval index upgrade INDEX --model MODEL` for one trained
--compatible-with an old model (the old model's index, which keeps serving while it re-embeds); and, where its
training measured it not compatible (which `index upgrade` refuses), an index build into a new folder, saying why."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from retrieval.cli.export_next import export_next_step
from retrieval.cli.main import main
from retrieval.compatibility import (
    COMPATIBILITY_KEY,
    COMPATIBILITY_METRICS,
    COMPATIBLE,
    NOT_COMPATIBLE,
    compatibility_record,
    compatibility_verdict,
)

OLD_HASH = "0123456789abcdef"


def measured(cross_hits: float, queries: int = 200) -> str:
    """A compatibility record as training writes it: old queries find their class every time, new ones on the old
    gallery ``cross_hits`` of the time (seeded), measured by the verdict's own bootstrap."""
    rng = np.random.default_rng(0)
    old = {name: np.ones(queries) for name in COMPATIBILITY_METRICS}
    cross = {name: (rng.random(queries) < cross_hits).astype(float) for name in COMPATIBILITY_METRICS}
    blocks = {"old": {n: float(v.mean()) for n, v in old.items()},
              "cross_model": {n: float(v.mean()) for n, v in cross.items()}, **compatibility_verdict(cross, old)}
    return compatibility_record(blocks)


def metadata(compatibility: str | None = None, declared: bool = True) -> dict[str, str]:
    meta = {"backbone": "efficientnet_lite0", "input_size": "224", "resize": "pad", "embedding_dim": "128",
            "normalized": "true", "model_hash": "fedcba9876543210", "config_hash": "c0ffee"}
    if declared:
        meta["compatible_with"] = json.dumps([OLD_HASH])
    if compatibility is not None:
        meta[COMPATIBILITY_KEY] = compatibility
    return meta


def test_a_model_declared_compatible_with_nothing_is_indexed():
    said = export_next_step("run/model.onnx", metadata(declared=False))
    assert said == "retrieval index build --model run/model.onnx --images YOUR_IMAGES --out INDEX"


@pytest.mark.parametrize("compatibility", [None, "compatible"])
def test_a_compatible_model_upgrades_the_old_model_index_which_keeps_serving(compatibility):
    record = measured(1.0) if compatibility else None
    if record is not None:
        assert json.loads(record)["verdict"] == COMPATIBLE
    said = export_next_step("run/model.onnx", metadata(record))
    assert said.startswith("retrieval index upgrade INDEX --model run/model.onnx ")
    assert f"the index the old model built, model_hash {OLD_HASH}" in said and "keeps serving" in said
    assert "index build" not in said


def test_a_model_measured_not_compatible_is_built_into_a_new_folder_saying_upgrade_would_refuse_it():
    record = measured(0.2)
    assert json.loads(record)["verdict"] == NOT_COMPATIBLE
    said = export_next_step("run/model.onnx", metadata(record))
    assert said.startswith("retrieval index build --model run/model.onnx --images YOUR_IMAGES --out NEW_INDEX ")
    assert "not compatible" in said and "`retrieval index upgrade` of the old index would refuse it" in said
    cross = json.loads(record)["cross_model"]["recall@1"]
    assert f"recall@1 {cross:.3f} vs the old model's 1.000" in said


def test_an_unreadable_declaration_or_record_falls_back_to_what_can_be_read():
    assert "index build" in export_next_step("m.onnx", {"compatible_with": "{not json"})
    assert "index upgrade" in export_next_step("m.onnx", metadata("{not json"))


def test_the_export_command_says_the_upgrade_as_its_next_line(monkeypatch, tmp_path):
    from retrieval.export import onnx_export

    out = tmp_path / "model.onnx"
    result = onnx_export.ExportResult(out, "dynamo", 18, "fp32", 0.1, 1, metadata(measured(1.0)))
    monkeypatch.setattr(onnx_export, "export_checkpoint", lambda *args, **kwargs: result)
    checkpoint = tmp_path / "run" / "best.pt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"never read")
    said = CliRunner().invoke(main, ["export", "--checkpoint", str(checkpoint), "--out", str(out)])
    assert said.exit_code == 0, said.output
    assert said.stdout.splitlines()[-1].startswith(f"next: retrieval index upgrade INDEX --model {out} ")
