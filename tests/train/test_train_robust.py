"""`retrieval train` survives unreadable images and resumes exactly from a mid-epoch checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from run_files import read_jsonl
from sample_images import noisy_png

from retrieval.cli.main import main
from retrieval.data import ClassBalancedBatchSampler
from retrieval.train import TrainConfig, train
from retrieval.train.state import TIMING_KEYS

REPO = Path(__file__).resolve().parents[2]
CLASSES = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def folder_with_bad_images(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """train/ and test/ class folders of small PNGs, plus unreadable files: {path: expected reason prefix}."""
    root = tmp_path_factory.mktemp("bad-folder")
    colors = {"a": (200, 30, 30), "b": (30, 200, 30), "c": (30, 30, 200), "d": (200, 200, 30)}
    for split, per_class in (("train", 6), ("test", 4)):
        for cls in CLASSES:
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                (folder / f"{i}.png").write_bytes(noisy_png(colors[cls], hash((split, cls, i)) % 2**32))
    bad = {
        root / "train" / "a" / "truncated.png": noisy_png((0, 0, 0), 1, size=64)[:300],
        root / "train" / "b" / "text.png": b"this is a text file, not an image\n",
        root / "train" / "c" / "empty.png": b"",
        root / "test" / "d" / "broken.png": b"\x89PNG\r\n\x1a\n" + b"\x00" * 40,
    }
    for path, data in bad.items():
        path.write_bytes(data)
    reasons = {str(root / "train" / "a" / "truncated.png"): "",  # PIL words a cut PNG in several ways
               str(root / "train" / "b" / "text.png"): "not an image",
               str(root / "train" / "c" / "empty.png"): "empty file (0 bytes)",
               str(root / "test" / "d" / "broken.png"): ""}
    return root, reasons


def tiny_config(root: Path, out: Path, **overrides) -> TrainConfig:
    """A random-init timm test ResNet (0.4 M parameters) on 32 px images, 4 batches of 4 classes x 2 an
    epoch: every image is drawn in each epoch."""
    values = dict(dataset="folder", data=str(root), backbone="timm:test_resnet", pretrained=False,
                  image_size=32, embedding_dim=16, loss="ms", batch_size=8, per_class=2, batches_per_epoch=4, epochs=2,
                  lr=1e-3, workers=0, device="cpu", out=str(out),  # CPU: bit-exact resumes
                  val_fraction=0)  # the test split evaluated every epoch, where unreadable images are counted
    values.update(overrides)
    return TrainConfig(**values)


def check_bad_images_recorded(run: Path, reasons: dict[str, str], report: dict) -> list[dict]:
    """The report lists every bad file once with its reason; metrics.jsonl counts the skipped images."""
    listed = report["bad_images"]
    assert sorted(r["file"] for r in listed) == sorted(reasons)  # each once
    for record in listed:
        assert record["reason"].startswith(reasons[record["file"]]), record
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    for row in rows:  # the baseline (epoch 0) too: 16 test images evaluated, the broken one left out
        assert row["eval_images"] == 16 and row["eval_skipped_images"] == 1, row
    for row in rows[1:]:  # every train image is drawn each epoch, so each of the 3 bad ones at least once
        assert row["skipped_images"] >= 3 and row["steps"] == 4, row
    assert report["last"]["eval_images"] == 16
    return rows


def test_full_training_skips_unreadable_images_everywhere(folder_with_bad_images, tmp_path, capsys):
    """Train batches, baseline and per-epoch evaluation and the linear probe all read the folder's bad files."""
    root, reasons = folder_with_bad_images
    report = train(tiny_config(root, tmp_path / "run", linear_probe=True), progress=False)
    rows = check_bad_images_recorded(tmp_path / "run", reasons, report)
    assert 0 <= rows[0]["linear_probe"] <= 1 and 0 <= report["last"]["linear_probe"] <= 1
    stderr = capsys.readouterr().err
    warnings = [line for line in stderr.splitlines() if line.startswith("warning: skipping unreadable image ")]
    assert sorted(w.split()[4].rstrip(":") for w in warnings) == sorted(reasons)  # one line per file, once
    assert "Traceback" not in stderr


def test_frozen_feature_cache_skips_unreadable_images(folder_with_bad_images, tmp_path):
    """--freeze-backbone: the feature cache leaves the bad files out, remembers them, and batches drop them."""
    root, reasons = folder_with_bad_images
    cache = tmp_path / "features"
    first = train(tiny_config(root, tmp_path / "a", freeze_backbone=True, feature_cache=str(cache)), progress=False)
    check_bad_images_recorded(tmp_path / "a", reasons, first)
    # a second run reads the cache and still knows which files were bad
    again = train(tiny_config(root, tmp_path / "b", freeze_backbone=True, feature_cache=str(cache)), progress=False)
    check_bad_images_recorded(tmp_path / "b", reasons, again)
    assert again["last"]["loss"] == first["last"]["loss"]


def test_on_bad_image_fail_names_the_file_and_the_option(folder_with_bad_images, tmp_path):
    root, reasons = folder_with_bad_images
    args = cli_args(tiny_config(root, tmp_path / "run", epochs=1))
    result = CliRunner().invoke(main, ["train", *args, "--no-eval-before", "--on-bad-image", "fail"])
    assert result.exit_code != 0
    assert "cannot read image" in result.output and "--on-bad-image skip" in result.output
    assert "BadImageError" not in result.output  # the message speaks for itself
    named = [path for path in reasons if path in result.output]
    # the first image read: the test split's, whose pretrained-export features are taken before training
    assert len(named) == 1 and "/test/" in named[0], result.output
    assert "Traceback" not in result.output
    # the baseline evaluation stops on the test split's broken file the same way
    with pytest.raises(ValueError, match=r"cannot read image .*broken\.png.*--on-bad-image skip"):
        train(tiny_config(root, tmp_path / "eval", on_bad_image="fail"), progress=False)


def test_sampler_resumes_inside_an_epoch():
    labels = np.repeat(np.arange(6), 5)
    sampler = ClassBalancedBatchSampler(labels, 3, 2, seed=4, batches_per_epoch=7)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start=3)
    assert len(sampler) == 4 and list(sampler) == full[3:]
    with pytest.raises(ValueError, match="start must lie in 0..7"):
        sampler.set_epoch(0, start=8)


def cli_args(cfg: TrainConfig) -> list[str]:
    """The `retrieval train` options that reproduce ``cfg`` (the fields these tests set)."""
    args = ["--dataset", cfg.dataset, "--data", cfg.data, "--backbone", cfg.backbone, "--no-pretrained",
            "--image-size", str(cfg.image_size), "--embedding-dim", str(cfg.embedding_dim), "--loss", cfg.loss,
            "--batch-size", str(cfg.batch_size), "--per-class", str(cfg.per_class),
            "--batches-per-epoch", str(cfg.batches_per_epoch), "--epochs", str(cfg.epochs), "--lr", str(cfg.lr),
            "--workers", str(cfg.workers), "--device", cfg.device, "--out", cfg.out,
            "--no-plots"]  # report plots (seconds of matplotlib a run): nothing here compares them
    if cfg.val_fraction is not None:
        args += ["--val-fraction", str(cfg.val_fraction)]
    if cfg.freeze_backbone:
        args += ["--freeze-backbone", "--feature-cache", cfg.feature_cache]
    if cfg.head_start != "auto":
        args += ["--head-start", cfg.head_start]
    return args


def train_env() -> dict[str, str]:
    """One torch thread in every compared run: float sums then add up in the same order (fine-tuning amplifies a
    last-bit difference into different weights within a few steps)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run_train(args: list[str]) -> None:
    """`retrieval train` in a process of its own, as ``kill_inside_an_epoch`` runs it."""
    result = subprocess.run([sys.executable, "-m", "retrieval", "train", *args], env=train_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def start_train(args: list[str]) -> tuple[subprocess.Popen, object]:
    """`retrieval train` started as ``run_train`` runs it, without waiting; ``finish_train`` waits for it."""
    stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the run
    return subprocess.Popen([sys.executable, "-m", "retrieval", "train", *args], env=train_env(), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True), stderr


def finish_train(started: tuple[subprocess.Popen, object]) -> None:
    proc, stderr = started
    with stderr:
        returncode = proc.wait(timeout=600)
        stderr.seek(0)
        assert returncode == 0, stderr.read()[-4000:]


def kill_inside_an_epoch(args: list[str], last: Path, steps_per_epoch: int) -> dict:
    """Start `retrieval train`, SIGKILL it once last.pt holds a checkpoint from inside epoch 2 or later."""
    proc = subprocess.Popen([sys.executable, "-m", "retrieval", "train", *args], env=train_env(), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if last.is_file():
                proc.send_signal(signal.SIGSTOP)  # hold it still while last.pt is read
                position = torch.load(last, weights_only=False, mmap=True)["in_epoch"]  # mmap: no tensor reads
                if position and position["epoch"] >= 1 and 0 < position["batch"] < steps_per_epoch:
                    proc.kill()
                    proc.wait()
                    return position
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.005)
        raise AssertionError(f"no mid-epoch checkpoint caught (rc {proc.poll()}): {proc.stderr.read().decode()}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def assert_same_run(a: Path, b: Path) -> None:
    state_a = torch.load(a / "last.pt", weights_only=False)["state_dict"]
    state_b = torch.load(b / "last.pt", weights_only=False)["state_dict"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.allclose(state_a[key].float(), state_b[key].float(), rtol=0, atol=1e-6), key
    rows_a, rows_b = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    strip = lambda row: {k: v for k, v in row.items() if k not in TIMING_KEYS}  # noqa: E731
    for row_a, row_b in zip(rows_a, rows_b, strict=True):
        # same steps, same counts; float sums may differ in the last bits (threads differ between the runs)
        assert strip(row_a) == pytest.approx(strip(row_b), rel=1e-6, abs=1e-9)
    assert all(row["loss"] > 0 for row in rows_a[1:])  # the weights did move: equal weights mean something
    report_a, report_b = (json.loads((run / "report.json").read_text()) for run in (a, b))
    assert report_a["bad_images"] == report_b["bad_images"]


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-features", "fine-tune-2-workers"])
def test_killed_mid_epoch_resume_equals_an_uninterrupted_run(folder_with_bad_images, tmp_path, frozen):
    """A real `retrieval train --checkpoint-every 1` is SIGKILLed inside epoch 2, then resumed with --resume.

    Fine-tuning runs EfficientNet-Lite0, whose drop-connect draws on torch's global RNG in every step, with two
    workers whose random crops must not depend on where the run resumed.
    """
    root, _ = folder_with_bad_images

    def extra(run: str) -> dict:
        # a random head: started at the baseline, the tiny folder's classes are apart already and nothing moves
        return (dict(freeze_backbone=True, feature_cache=str(tmp_path / f"features-{run}"), head_start="random")
                if frozen
                else dict(backbone="efficientnet_lite0", workers=2))

    # the uninterrupted run trains in its own process (and feature cache) while the other is killed and resumed
    straight = start_train(cli_args(tiny_config(root, tmp_path / "straight", epochs=3, **extra("straight"))))

    killed = tiny_config(root, tmp_path / "killed", epochs=3, **extra("killed"))
    position = kill_inside_an_epoch([*cli_args(killed), "--checkpoint-every", "1"], tmp_path / "killed" / "last.pt",
                                    steps_per_epoch=4)
    assert [r["epoch"] for r in read_jsonl(tmp_path / "killed" / "metrics.jsonl")][-1] == position["epoch"]
    run_train([*cli_args(killed), "--checkpoint-every", "1", "--resume"])
    finish_train(straight)
    assert_same_run(tmp_path / "straight", tmp_path / "killed")


class WorkerPids(torch.utils.data.Dataset):
    """Each sample's label is the process that loaded it."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int):
        return torch.zeros(3, 4, 4), os.getpid()


def exited(pids: set[int]) -> bool:
    """Whether every process of ``pids`` has exited (waited for, or a zombie), within 5 s."""
    for _ in range(100):
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()
                 and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def test_the_train_workers_live_from_epoch_to_epoch_and_stop_when_training_ends():
    from retrieval.data import BadImageLog, ModelPreprocessing
    from retrieval.train.features import Embedding, ImagePipeline

    cfg = TrainConfig(dataset="digits", seed=3)
    run = Embedding(torch.device("cpu"), 8, workers=2, amp=False, progress=False, bad_images=BadImageLog("skip"))
    pipeline = ImagePipeline(cfg, WorkerPids(), None, run, ModelPreprocessing(input_size=4, mean=(0.5,) * 3,
                                                                                std=(0.5,) * 3))
    sampler = ClassBalancedBatchSampler(np.repeat(np.arange(4), 6), 2, 2, seed=1, batches_per_epoch=3)

    def pids(batches) -> set[int]:
        return {int(pid) for _, labels, _ in batches for pid in labels}

    per_epoch = []
    for epoch in range(3):
        batches = list(pipeline.batches(sampler, epoch, start=1 if epoch == 1 else 0))
        assert len(batches) == (2 if epoch == 1 else 3)
        per_epoch.append(pids(batches))
    assert len(per_epoch[0]) == 2 and per_epoch[1] <= per_epoch[0] and per_epoch[2] <= per_epoch[0]
    # an epoch left after its first batch (an error in the step): the next epoch is whole, from new workers
    left = pipeline.batches(sampler, 3, 0)
    next(left)
    left.close()
    assert exited(per_epoch[0])
    again = list(pipeline.batches(sampler, 4, 0))
    assert len(again) == 3 and not pids(again) & per_epoch[0]
    pipeline.close()
    assert exited(pids(again))
