"""The training loop: improvement, resume, checkpoints, divergence, config and CLI."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from reads_back import ReadsBack
from run_files import read_jsonl
from train_configs import digits_config

from retrieval.cli.main import main
from retrieval.models import load_embedder
from retrieval.train import TrainConfig, TrainingDiverged, train
from retrieval.train.state import TIMING_KEYS
from retrieval.utils.reads import on_host, require


@pytest.fixture(scope="module")
def feature_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("features"))


def all_digits_config(out, feature_cache, **overrides) -> TrainConfig:
    """All of sklearn digits (no limit a class), a 64-d head, whole epochs of 40-image batches, on the default
    device: enough data that a short training measurably improves recall."""
    return digits_config(out, feature_cache, **{"dataset_kwargs": {"protocol": "standard"}, "embedding_dim": 64,
                                                "batch_size": 40, "batches_per_epoch": None, "device": "auto",
                                                **overrides})


def test_short_training_improves_recall(tmp_path, feature_cache):
    report = train(all_digits_config(tmp_path / "run", feature_cache), progress=False)
    before, after = report["baseline"]["recall@1"], report["last"]["recall@1"]
    assert after > before + 0.02, (before, after)
    assert report["last"]["map@r"] > report["baseline"]["map@r"]
    run = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "last.pt", "best.pt", "report.json", "curves.png", "recall.png"):
        assert (run / name).is_file(), name
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    assert all(r["steps"] > 0 and r["skipped_steps"] == 0 for r in rows[1:])
    best = torch.load(run / "best.pt", weights_only=False)
    assert best["metrics"]["recall@1"] == max(r["recall@1"] for r in rows[1:])
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["loss"] == "ms" and config["model"]["input_size"] == 32


def test_training_is_deterministic_and_resumes_exactly(tmp_path, feature_cache):
    straight = train(all_digits_config(tmp_path / "a", feature_cache, epochs=3), progress=False)
    again = train(all_digits_config(tmp_path / "b", feature_cache, epochs=3), progress=False)
    assert straight["last"]["loss"] == again["last"]["loss"]

    # Stop after 2 of 3 epochs (as if killed), then resume: the same numbers as the straight run.
    partial = all_digits_config(tmp_path / "c", feature_cache, epochs=3)
    trainer_cls = __import__("retrieval.train.trainer", fromlist=["Trainer"]).Trainer
    t = trainer_cls(partial, progress=False)
    t.setup()
    t.record.baseline = t.evaluate()
    t.record.history.append({"epoch": 0, **t.record.baseline})
    for epoch in range(2):
        row = {"epoch": epoch + 1, **t.train_epoch(epoch), **t.evaluate()}
        t.record.history.append(row)
        from retrieval.train.checkpointing import atomic_save

        atomic_save(t.checkpoint(epoch + 1, row), tmp_path / "c" / "last.pt")
    resumed = train(all_digits_config(tmp_path / "c", feature_cache, epochs=3, resume=True), progress=False)
    assert resumed["last"]["loss"] == pytest.approx(straight["last"]["loss"], rel=1e-6)
    assert resumed["last"]["recall@1"] == pytest.approx(straight["last"]["recall@1"])
    assert [r["epoch"] for r in read_jsonl(tmp_path / "c" / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_resume_with_another_validation_share_is_refused(tmp_path, feature_cache):
    """A run started with no validation split (as every run before the split became the default), resumed with the
    new default: it would train on fewer classes and choose best.pt on another split. Refused, naming both."""
    train(all_digits_config(tmp_path / "run", feature_cache, epochs=1, val_fraction=0.0), progress=False)
    with pytest.raises(ValueError, match=r"trained with --val-fraction 0.0, this configuration has auto; resume"):
        train(all_digits_config(tmp_path / "run", feature_cache, epochs=2, val_fraction=None, resume=True),
              progress=False)


def test_existing_run_is_not_overwritten(tmp_path, feature_cache):
    train(all_digits_config(tmp_path / "run", feature_cache, epochs=1), progress=False)
    before = (tmp_path / "run" / "last.pt").read_bytes()
    with pytest.raises(FileExistsError, match="--resume"):
        train(all_digits_config(tmp_path / "run", feature_cache, epochs=1), progress=False)
    assert (tmp_path / "run" / "last.pt").read_bytes() == before


def test_resume_refuses_a_model_only_checkpoint(tmp_path, feature_cache):
    from retrieval.models import CHECKPOINT_FORMAT, create_embedder

    model = create_embedder("resnet18", 16)
    (tmp_path / "run").mkdir()
    torch.save({"format": CHECKPOINT_FORMAT, "model_config": model.config.to_json(), "state_dict": model.state_dict()},
               tmp_path / "run" / "last.pt")
    with pytest.raises(ValueError, match="model only, no training state"):
        train(all_digits_config(tmp_path / "run", feature_cache, epochs=1, resume=True), progress=False)


class NaNEvery(torch.nn.Module):
    """A loss that is NaN on chosen steps (to exercise the skip-and-stop logic)."""

    def __init__(self, bad_steps):
        super().__init__()
        self.bad_steps, self.calls = set(bad_steps), 0

    def forward(self, embeddings, labels):
        self.calls += 1
        value = (embeddings * embeddings).mean()
        return value * float("nan") if self.calls in self.bad_steps else value


def test_non_finite_steps_are_skipped_then_stop(tmp_path, feature_cache, monkeypatch):
    import retrieval.train.building as building

    monkeypatch.setattr(building.losses, "build", lambda *a, **k: NaNEvery({2, 5}))
    report = train(all_digits_config(tmp_path / "ok", feature_cache, epochs=1), progress=False)
    assert report["history"][1]["skipped_steps"] == 2
    assert all(torch.isfinite(p).all() for p in load_embedder(tmp_path / "ok" / "last.pt").parameters())

    monkeypatch.setattr(building.losses, "build", lambda *a, **k: NaNEvery(range(3, 100)))
    with pytest.raises(TrainingDiverged, match="5 steps in a row"):
        train(all_digits_config(tmp_path / "bad", feature_cache, epochs=1), progress=False)


def test_full_finetuning_path_writes_a_loadable_checkpoint(tmp_path):
    cfg = TrainConfig(dataset="digits", backbone="resnet18", pretrained=False, image_size=32, embedding_dim=16,
                      loss="triplet", batch_size=8, per_class=2, epochs=1, batches_per_epoch=2, workers=0,
                      eval_limit=60, out=str(tmp_path / "full"))
    report = train(cfg, progress=False)
    assert report["history"][1]["steps"] == 2
    model = load_embedder(tmp_path / "full" / "best.pt")
    assert model.config.input_size == 32 and model.config.embedding_dim == 16


def test_label_noise_is_recorded(tmp_path, feature_cache):
    train(all_digits_config(tmp_path / "noisy", feature_cache, epochs=1, label_noise="symmetric:0.3"), progress=False)
    info = json.loads((tmp_path / "noisy" / "config.json").read_text())["label_noise"]
    assert info["mode"] == "symmetric" and info["rate"] == 0.3 and info["flipped"] > 0


def test_asymmetric_noise_uses_the_datasets_own_table(tmp_path, feature_cache):
    """digits flip along their own similar classes (2 -> 7, ...), recorded in config.json by name; a data set
    without a table is refused before training with the option that fixes it."""
    train(all_digits_config(tmp_path / "asym", feature_cache, epochs=1, label_noise="asymmetric:0.4"), progress=False)
    info = json.loads((tmp_path / "asym" / "config.json").read_text())["label_noise"]
    assert info["transitions"] == [[2, 7], [3, 8], [5, 6], [6, 5], [7, 1]] and info["flipped"] > 0
    assert info["transitions_source"] == "known table for digits" and ["2", "7"] in info["transitions_by_name"]
    table = tmp_path / "t.csv"
    table.write_text("0,8\n")
    train(all_digits_config(tmp_path / "own", feature_cache, epochs=1, label_noise="asymmetric:0.4",
                        label_noise_transitions=str(table)), progress=False)
    info = json.loads((tmp_path / "own" / "config.json").read_text())["label_noise"]
    assert info["transitions"] == [[0, 8]] and info["transitions_by_name"] == [["0", "8"]]


def test_config_validation_names_the_fix():
    with pytest.raises(ValueError, match="--per-class must be >= 2"):
        TrainConfig(per_class=1)
    with pytest.raises(ValueError, match="multiple of --per-class"):
        TrainConfig(batch_size=30, per_class=4)
    with pytest.raises(ValueError, match="--label-noise"):
        TrainConfig(label_noise="gaussian:0.1")
    with pytest.raises(ValueError, match="--eval-every must be >= 1"):
        TrainConfig(eval_every=0)


def test_cli_train_with_config_file_and_evaluate(tmp_path, feature_cache):
    config = tmp_path / "run.toml"
    config.write_text(
        'dataset = "digits"\nbackbone = "efficientnet_lite0"\nimage_size = 32\nfreeze_backbone = true\n'
        'embedding_dim = 32\nbatch_size = 40\nper_class = 4\nepochs = 5\nworkers = 0\n'
        f'feature_cache = "{feature_cache}"\n'
        '[dataset_kwargs]\nprotocol = "standard"\n[loss]\nname = "triplet"\nmargin = 0.1\n'
    )
    runner = CliRunner()
    out = tmp_path / "cli-run"
    result = runner.invoke(main, ["train", "--config", str(config), "--epochs", "1", "--loss-param", "margin=0.3",
                                  "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "config.json").read_text())["train"]
    assert saved["epochs"] == 1 and saved["loss"] == "triplet" and saved["loss_kwargs"] == {"margin": 0.3}
    assert saved["dataset_kwargs"] == {"protocol": "standard"}

    result = runner.invoke(main, ["evaluate", "--checkpoint", str(out / "best.pt"), "--workers", "0"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "eval_report.json").read_text())["metrics"]
    assert 0 < metrics["recall@1"] <= 1 and "map@r" in metrics
    # for people: the metrics in words on a line, the report's place; no JSON unless --json
    assert f"recall@1 {metrics['recall@1']:.4f}, recall@2" in result.stdout and "{" not in result.stdout
    assert f"report {out / 'eval_report.json'} (pictures: embedding_map.png, retrieval.png)" in result.stdout
    assert result.stdout.splitlines()[-1].startswith(f"next: retrieval export --checkpoint {out / 'best.pt'} ")

    result = runner.invoke(main, ["train", "--per-class", "1", "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "--per-class must be >= 2" in result.output


def test_background_is_recorded_with_the_model_and_travels_to_onnx(tmp_path, feature_cache):
    """--background is a model setting like mean/std: checkpoint, ONNX metadata, and the index's preprocessing."""
    from retrieval.export import export_checkpoint
    from retrieval.onnx_runtime import OnnxEmbedder

    train(all_digits_config(tmp_path / "run", feature_cache, epochs=1, background="#102030"), progress=False)
    model = load_embedder(tmp_path / "run" / "best.pt")
    assert model.config.background == [16, 32, 48]
    export_checkpoint(tmp_path / "run" / "best.pt", tmp_path / "model.onnx", verify=False, log=lambda _: None)
    assert OnnxEmbedder(tmp_path / "model.onnx").preprocessing.background == (16, 32, 48)
    with pytest.raises(ValueError, match="--background"):
        all_digits_config(tmp_path / "bad", feature_cache, background="no-such-colour").validate()


def test_resize_is_recorded_with_the_model_and_travels_to_onnx(tmp_path, feature_cache):
    """--resize pad trains, evaluates and exports a letterboxing model: checkpoint and ONNX metadata say so, and
    the export is verified against PyTorch on the same letterboxed pixels."""
    from retrieval.export import export_checkpoint
    from retrieval.onnx_runtime import OnnxEmbedder

    train(all_digits_config(tmp_path / "run", feature_cache, epochs=1, resize="pad"), progress=False)
    assert load_embedder(tmp_path / "run" / "best.pt").config.resize == "pad"
    result = export_checkpoint(tmp_path / "run" / "best.pt", tmp_path / "model.onnx", log=lambda _: None)
    assert result.verification is not None and result.metadata["resize"] == "pad"
    assert OnnxEmbedder(tmp_path / "model.onnx").preprocessing.resize_mode == "pad"
    # the device stage letterboxes too (tests/data/test_resize_modes.py compares it with the workers')
    all_digits_config(tmp_path / "device", feature_cache, resize="pad", freeze_backbone=False,
                      decode_on="device").validate()


def test_an_epoch_that_waits_for_its_batches_measures_the_wait_and_says_what_to_try(tmp_path, feature_cache,
                                                                                      monkeypatch, capsys):
    import time

    from retrieval.train.features import CachedFeatures

    delay = 0.4
    original = CachedFeatures.batches

    def slow(self, sampler, epoch, start):
        for batch in original(self, sampler, epoch, start):
            time.sleep(delay)  # as a loader behind its step would
            yield batch

    lean = dict(eval_before=False, plots=False, eval_every=100)  # the timing is the training's: no evaluation
    quick = train(digits_config(tmp_path / "quick", feature_cache, epochs=1, **lean), progress=True)["history"][-1]
    assert 0 <= quick["data_wait_s"] < 3 * delay and "waited for its batches" not in capsys.readouterr().out
    monkeypatch.setattr(CachedFeatures, "batches", slow)
    rows = train(digits_config(tmp_path / "slow", feature_cache, epochs=2, **lean), progress=True)["history"]
    for row in rows:  # 3 batches an epoch
        assert 3 * delay <= row["data_wait_s"] <= row["epoch_time_s"]
        assert row["data_wait_s"] / row["epoch_time_s"] > 0.5
    out = capsys.readouterr().out
    assert "epoch 1: loss " in out and "images/s" in out and "% of the time waiting for batches" in out
    assert out.count("waited for its batches") == 1  # said once a run
    assert "more --workers (now 0)" in out and "--decode-on device" not in out  # no GPU here


def test_the_trainer_reads_its_losses_back_in_one_transfer_and_logs_what_reading_every_step_logs(
        tmp_path, feature_cache, monkeypatch):
    import retrieval.train.building as building
    import retrieval.train.epochs as epochs
    import retrieval.train.trainer as trainer_module

    # a loss and an optimizer that read nothing back themselves: what is counted is the trainer's
    monkeypatch.setattr(building.losses, "build", lambda *a, **k: NaNEvery({4}))
    read_back = trainer_module.Trainer._read_back
    transfers = []  # the steps each read-back carried

    def counted(self, state, pending):
        transfers.append(len(pending))
        read_back(self, state, pending)

    monkeypatch.setattr(trainer_module.Trainer, "_read_back", counted)
    for aux_ce in (0.0, 0.5):  # with the auxiliary head, its term is read back with the loss
        runs = {}
        for name, seconds in (("every_step", 0.0), ("at_epoch_end", 1e9)):
            monkeypatch.setattr(epochs, "READ_BACK_SECONDS", seconds)
            out = tmp_path / f"{name}-{aux_ce}"
            trainer = trainer_module.Trainer(digits_config(out, feature_cache, optimizer="sgd", batches_per_epoch=12,
                                                           epochs=1, aux_ce=aux_ce), progress=False)
            trainer.setup()
            transfers.clear()
            with ReadsBack() as reads:
                row = trainer.train_epoch(0)
            runs[name] = (row, reads.count, [n for n in transfers if n], read_jsonl(out / "steps.jsonl"))
        (every, every_reads, every_transfers, every_log), (once, once_reads, once_transfers, once_log) = runs.values()
        assert every["steps"] == 11 and every["skipped_steps"] == 1  # the NaN step is skipped either way
        assert once_log == every_log and [line["step"] for line in once_log] == list(range(1, 12))
        untimed = [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in (once, every)]
        assert untimed[0] == untimed[1]
        assert once_transfers == [11] and every_transfers == [1] * 11
        if aux_ce:
            assert once["aux_ce"] > 0
        else:  # the finiteness check of each step (the one read a step needs), then the losses' transfers
            assert (once_reads, every_reads) == (12 + 1, 12 + 11)


def test_the_loss_statistics_travel_with_the_losses_and_a_step_reads_the_device_once(tmp_path, feature_cache,
                                                                                       monkeypatch):
    import retrieval.train.epochs as epochs
    import retrieval.train.trainer as trainer_module

    rows, reads = {}, {}
    for name, seconds in (("every_step", 0.0), ("at_epoch_end", 1e9)):
        monkeypatch.setattr(epochs, "READ_BACK_SECONDS", seconds)
        trainer = trainer_module.Trainer(digits_config(tmp_path / name, feature_cache, optimizer="sgd", loss="ms",
                                                       batches_per_epoch=12, epochs=1), progress=False)
        trainer.setup()
        with ReadsBack() as counted:
            rows[name] = trainer.train_epoch(0)
        reads[name] = counted
    every, once = rows.values()
    assert every["steps"] == once["steps"] == 12
    untimed = [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in (once, every)]
    assert untimed[0] == untimed[1]
    assert 0 < once["loss_positive_pairs_kept"] <= 1 and 0 < once["loss_negative_pairs_kept"] <= 1
    # a step reads once: MS's batch check (a positive pair) with the finiteness check; its mining statistics are
    # read with the losses, one transfer for all the steps
    assert (reads["at_epoch_end"].count, reads["every_step"].count) == (12 + 1, 12 + 12)


class FailsItsCheckAt(torch.nn.Module):
    """A loss whose batch check fails on one call (as a batch without a positive pair fails a pair loss's)."""

    def __init__(self, call: int, nan: bool = False) -> None:
        super().__init__()
        self.call, self.calls, self.nan = call, 0, nan

    def forward(self, embeddings, labels):
        self.calls += 1
        require(torch.tensor(self.calls != self.call), ValueError(f"call {self.calls}: the batch check failed"))
        value = (embeddings * embeddings).mean()
        return value * float("nan") if self.nan and self.calls == self.call else value


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "and NaN"])  # a failed check is not a skipped step
def test_a_failed_batch_check_read_with_the_step_stops_it_before_the_weights_change(tmp_path, feature_cache,
                                                                                    monkeypatch, nan):
    import retrieval.train.building as building
    import retrieval.train.epochs as epochs
    import retrieval.train.trainer as trainer_module

    monkeypatch.setattr(epochs, "READ_BACK_SECONDS", 1e9)  # the steps before are read back by the error
    monkeypatch.setattr(building.losses, "build", lambda *a, **k: FailsItsCheckAt(3, nan))
    trainer = trainer_module.Trainer(digits_config(tmp_path / "run", feature_cache, optimizer="sgd", epochs=1),
                                     progress=False)
    trainer.setup()
    after_two = {}
    step = trainer_module.Trainer._optimizer_step

    def stepped(self, backward, replay=None):
        step(self, backward, replay)
        if self.parts.loss_fn.calls == 2:
            after_two.update({k: v.clone() for k, v in self.parts.model.state_dict().items()})

    monkeypatch.setattr(trainer_module.Trainer, "_optimizer_step", stepped)
    with pytest.raises(ValueError, match="call 3: the batch check failed"):
        trainer.train_epoch(0)
    assert after_two and all(torch.equal(after_two[k], v) for k, v in trainer.parts.model.state_dict().items())
    assert [line["step"] for line in read_jsonl(tmp_path / "run" / "steps.jsonl")] == [1, 2]


class RecordsHostLabels(torch.nn.Module):
    """A loss that records whether the labels' values were known on the host without copying them back."""

    def __init__(self) -> None:
        super().__init__()
        self.known: list[bool] = []

    def forward(self, embeddings, labels):
        self.known.append(on_host(labels) is labels)  # a copy back would be another tensor
        return (embeddings * embeddings).mean()


def test_a_training_step_hands_the_loss_its_labels_host_copy(tmp_path, feature_cache, monkeypatch):
    import retrieval.train.building as building
    import retrieval.train.trainer as trainer_module

    recorder = RecordsHostLabels()
    monkeypatch.setattr(building.losses, "build", lambda *a, **k: recorder)
    trainer = trainer_module.Trainer(digits_config(tmp_path / "run", feature_cache, optimizer="sgd", epochs=1),
                                     progress=False)
    trainer.setup()
    trainer.train_epoch(0)
    assert recorder.known and all(recorder.known)


class FailsAt(torch.nn.Module):
    """A loss that raises on one call (as a bug or an interrupt in the middle of an epoch would)."""

    def __init__(self, call: int) -> None:
        super().__init__()
        self.call, self.calls = call, 0

    def forward(self, embeddings, labels):
        self.calls += 1
        if self.calls == self.call:
            raise RuntimeError("the loss failed")
        return (embeddings * embeddings).mean()


def test_the_steps_taken_before_an_error_keep_their_logged_losses(tmp_path, feature_cache, monkeypatch):
    import retrieval.train.building as building
    import retrieval.train.epochs as epochs

    monkeypatch.setattr(building.losses, "build", lambda *a, **k: FailsAt(6))
    monkeypatch.setattr(epochs, "READ_BACK_SECONDS", 1e9)  # nothing read back before the error
    with pytest.raises(RuntimeError, match="the loss failed"):
        train(digits_config(tmp_path / "run", feature_cache, batches_per_epoch=12, epochs=1, eval_before=False),
              progress=False)
    logged = read_jsonl(tmp_path / "run" / "steps.jsonl")
    assert [line["step"] for line in logged] == [1, 2, 3, 4, 5] and all(line["loss"] > 0 for line in logged)


def test_a_log_that_fails_while_losses_are_read_back_counts_no_step_twice(tmp_path, feature_cache, monkeypatch):
    import retrieval.train.epochs as epochs
    from retrieval.train.checkpointing import Checkpointer

    monkeypatch.setattr(epochs, "READ_BACK_SECONDS", 1e9)  # all the epoch's losses read back at its end
    write = Checkpointer.log_step
    calls = []

    def fails_once(self, step, epoch, loss):
        calls.append(step)
        if len(calls) == 3:  # the third step's line, once
            raise OSError("disk full")
        write(self, step, epoch, loss)

    monkeypatch.setattr(Checkpointer, "log_step", fails_once)
    with pytest.raises(OSError, match="disk full"):
        train(digits_config(tmp_path / "run", feature_cache, batches_per_epoch=6, epochs=1, eval_before=False),
              progress=False)
    # the epoch stops at the error; the steps not yet logged are logged on the way out, each once
    assert [line["step"] for line in read_jsonl(tmp_path / "run" / "steps.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_a_run_says_its_class_split_and_records_it_in_config_json(tmp_path, feature_cache, capsys):
    out = tmp_path / "run"
    train(digits_config(out, feature_cache, epochs=1, eval_before=False, plots=False, val_fraction=0.4),
          progress=True)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("data: ")]
    split = json.loads((out / "config.json").read_text())["class_split"]
    # digits' standard protocol: all 10 classes in train and test, so validation is images of each train class
    assert split["train"]["classes"] == split["validation"]["classes"] == 10
    assert split["test"]["classes"] == 10 and split["shared_train_test_classes"] == 10
    assert split["validation"]["held_out"] == "images"
    assert split["protocol"].startswith("protocol=standard")
    assert said == [f"data: train {split['train']['classes']} classes, {split['train']['images']} images; "
                    f"validation (a held-out share of each train class's images) {split['validation']['classes']} "
                    "classes, "
                    f"{split['validation']['images']} images; test 10 classes, {split['test']['images']} images "
                    f"({split['train']['classes']} classes in both train and test); the split is recorded in "
                    f"{out / 'config.json'} (class_split)"]
