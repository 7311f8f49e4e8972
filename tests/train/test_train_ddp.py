"""Training in 2 real torch.distributed processes (torchrun, gloo on CPU) equals training in one process.

Each group launches ONE pair of ranks that trains every configuration of the group (tests/ddp_runs.py); the
one-process references run here. One step per epoch, so metrics.jsonl's loss of each epoch is the loss of a step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from run_files import read_jsonl
from sample_images import noisy_png
from train_paused import PAUSED

from retrieval.train import TrainConfig, train
from retrieval.train.state import TIMING_KEYS

REPO = Path(__file__).resolve().parents[2]
# (name, loss, loss_kwargs, negatives, aux_ce): every loss family and both hard-negative methods, plus the
# auxiliary cross-entropy head, whose per-sample term stays local to each rank
CASES = [
    ("triplet-semihard", "triplet", {"mining": "semihard"}, None, 0.0),
    ("ms", "ms", {}, None, 0.0),
    ("ms-loop", "ms", {}, "loop", 0.0),
    ("npair-symm", "npair", {}, "symm", 0.0),
    ("dcdl-sinkhorn", "dcdl", {"phi": "sinkhorn"}, None, 0.0),
    ("nca_triplet", "nca_triplet", {}, None, 0.0),
    ("sct", "sct", {}, None, 0.0),
    ("ms-aux-ce", "ms", {}, None, 0.5),
    # proxy losses: the proxies are the loss's parameters, replicated on every rank (DDP averages their gradients)
    ("proxy_anchor", "proxy_anchor", {}, None, 0.0),
    ("soft_triple", "soft_triple", {"centers": 3}, None, 0.0),
]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def run_ranks(configs: list[TrainConfig], folder: Path) -> None:
    """Train ``configs`` one after the other in one 2-rank torchrun job."""
    path = folder / "configs.json"
    path.write_text(json.dumps([c.to_dict() for c in configs]))
    result = subprocess.run(torchrun("tests/ddp_runs.py", str(path)), env=env(), cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]


def weights(run: Path, name: str = "last.pt") -> dict[str, torch.Tensor]:
    """The model's weights and the loss's own (proxies), by name."""
    checkpoint = torch.load(run / name, weights_only=False)
    return {**checkpoint["state_dict"], **{f"loss.{k}": v for k, v in (checkpoint["loss_state"] or {}).items()}}


def assert_equivalent(one: Path, ranks: Path, rel: float = 1e-5) -> None:
    """Every step's loss within ``rel``, the weights within 1e-5, the same evaluation (images and metrics)."""
    rows_one, rows_ranks = read_jsonl(one / "metrics.jsonl"), read_jsonl(ranks / "metrics.jsonl")
    assert [r["epoch"] for r in rows_one] == [r["epoch"] for r in rows_ranks]
    for a, b in zip(rows_one, rows_ranks, strict=True):
        assert b.get("steps", 1) == a.get("steps", 1) and b.get("skipped_images") == a.get("skipped_images")
        for key in ("loss", "aux_ce", "distill", "l2sp", "compatible"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-7), (key, a["epoch"])
        if "validation" in a:  # the validation split, embedded sharded: the same metrics
            assert b["validation"] == pytest.approx(a["validation"], abs=1e-6)
        if "recall@1" in a:  # the evaluation: the same image count and metrics
            assert b["eval_images"] == a["eval_images"]
            for key in ("recall@1", "recall@2", "map@r", "r_precision", "nmi", "f1"):
                assert b[key] == pytest.approx(a[key], abs=1e-6), key
    w_one, w_ranks = weights(one), weights(ranks)
    for key in w_one:
        assert torch.allclose(w_ranks[key].double(), w_one[key].double(), rtol=1e-5, atol=1e-5), key
    assert any(r.get("loss", 0) != 0 for r in rows_one)  # the weights did move: equal weights mean something
    report, alone = (json.loads((run / "report.json").read_text()) for run in (ranks, one))
    assert report["config"]["world_size"] == 2
    assert len(list((ranks / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 alone tracks
    # rank 0's report lists the unreadable images that any rank met
    assert sorted(b["file"] for b in report["bad_images"]) == sorted(b["file"] for b in alone["bad_images"])


# --- the frozen-feature path: pretrained EfficientNet-Lite0 features of sklearn digits ----------------------------
def frozen_config(out: Path, cache: Path, loss: str, loss_kwargs: dict, negatives: str | None, aux_ce: float,
                  **overrides) -> TrainConfig:
    values = dict(dataset="digits", dataset_kwargs={"protocol": "standard", "limit_per_class": 12},
                  backbone="efficientnet_lite0",
                  pretrained=True, image_size=32, freeze_backbone=True, embedding_dim=32, loss=loss,
                  loss_kwargs=loss_kwargs, negatives=negatives, aux_ce=aux_ce, batch_size=16, per_class=4,
                  batches_per_epoch=1, epochs=3, optimizer="sgd", lr=0.05, eval_before=False, eval_every=100,
                  eval_limit=41, workers=0, device="cpu", out=str(out), feature_cache=str(cache), plots=False,
                  val_fraction=0)  # 12 images a class: the cases compare ranks, validation_config a validation split
    values.update(overrides)
    return TrainConfig(**values)


@pytest.fixture(scope="module")
def frozen_runs(tmp_path_factory) -> Path:
    """Every case trained by 2 ranks (features extracted sharded into cache-ranks/), and by one process."""
    root = tmp_path_factory.mktemp("ddp-frozen")
    # the old models of --compatible-with (runs of another seed, one of the same size and one of 16 dimensions,
    # which the new 32-d model reaches through a projection), trained before the ranks start
    train(frozen_config(root / "old", root / "cache-old", "ms", {}, None, 0.0, epochs=1, seed=3), progress=False)
    train(frozen_config(root / "old16", root / "cache-old", "ms", {}, None, 0.0, epochs=1, seed=3, embedding_dim=16),
          progress=False)
    extra = [frozen_config(root / "ranks" / "ms-no-gather", root / "cache-ranks", "ms", {}, None, 0.0, gather=False),
             # 2 epochs of 4 steps: the uninterrupted run that the killed-and-resumed run must equal
             frozen_config(root / "ranks" / "long", root / "cache-ranks", "ms", {}, "loop", 0.0,
                           batches_per_epoch=4, epochs=2),
             compatible_config(root, "ranks"), compatible_config(root, "ranks", "old16"),
             validation_config(root, "ranks")]
    return ranks_and_one(lambda who, *case: frozen_config(root / who / case[0], root / f"cache-{who}", *case[1:]),
                         CASES, extra, root)


def compatible_config(root: Path, who: str, old: str = "old") -> TrainConfig:
    """ms with --compatible-with the old run: the influence term is computed on the gathered batch (through the
    projection into the old space, for the old run of another size)."""
    return frozen_config(root / who / f"compatible-{old}", root / f"cache-{who}", "ms", {}, None, 0.0,
                         compatible_with=str(root / old / "last.pt"), compatible_weight=2.0)


def validation_config(root: Path, who: str) -> TrainConfig:
    """ms choosing best.pt on a validation split (2 of digits' 10 classes) evaluated every epoch, the test split
    before and after; its own feature cache (the train split less the validation classes is another entry)."""
    return frozen_config(root / who / "validation", root / f"cache-validation-{who}", "ms", {}, None, 0.0,
                         val_fraction=0.2, eval_every=1, eval_before=True)


def ranks_and_one(make, cases, extra: list[TrainConfig], root: Path) -> Path:
    """Each case (and ``extra``) trained in one 2-rank job into root/ranks/NAME, each case alone into root/one/NAME."""
    run_ranks([make("ranks", *case) for case in cases] + extra, root)
    for case in cases:
        train(make("one", *case), progress=False)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_frozen_features_two_ranks_equal_one_process(frozen_runs, name):
    assert_equivalent(frozen_runs / "one" / name, frozen_runs / "ranks" / name)


@pytest.mark.slow
@pytest.mark.parametrize("old", ["old", "old16"], ids=["same-size", "projected"])
def test_compatible_training_on_two_ranks_equals_one_process(frozen_runs, old):
    train(compatible_config(frozen_runs, "one", old), progress=False)
    one, ranks = frozen_runs / "one" / f"compatible-{old}", frozen_runs / "ranks" / f"compatible-{old}"
    assert_equivalent(one, ranks)
    rows = read_jsonl(one / "metrics.jsonl")
    assert any(row.get("compatible", 0) != 0 for row in rows)
    assert ("compatible.linear.weight" in weights(ranks)) == (old == "old16")  # P trained across the ranks too


@pytest.mark.slow
def test_choosing_best_pt_on_validation_on_two_ranks_equals_one_process(frozen_runs):
    train(validation_config(frozen_runs, "one"), progress=False)
    one, ranks = (frozen_runs / who / "validation" for who in ("one", "ranks"))
    assert_equivalent(one, ranks)
    alone, report = (json.loads((run / "report.json").read_text()) for run in (one, ranks))
    assert report["selected_on"] == alone["selected_on"] == "validation"
    assert report["best"]["epoch"] == alone["best"]["epoch"]
    for key in ("recall@1", "map@r", "r_precision"):  # best.pt's test metrics, taken after training
        assert report["best"][key] == pytest.approx(alone["best"][key], abs=1e-6), key
    # the pretrained export: every rank embedded its part, rank 0 measured it and judged best.pt against it
    for key in ("recall@1", "map@r"):
        assert report["pretrained_export"][key] == pytest.approx(alone["pretrained_export"][key], abs=1e-6), key
    assert report["keep_pretrained"] is alone["keep_pretrained"]
    assert [r["epoch"] for r in read_jsonl(ranks / "metrics.jsonl") if "recall@1" in r] == [0, 3]


@pytest.mark.slow
def test_feature_cache_extracted_sharded_equals_one_process(frozen_runs):
    caches = [sorted((frozen_runs / f"cache-{who}").glob("*.npz")) for who in ("one", "ranks")]
    assert [p.name for p in caches[0]] == [p.name for p in caches[1]] and len(caches[0]) == 2  # train + test
    for one, ranks in zip(*caches, strict=True):
        with np.load(one) as a, np.load(ranks) as b:
            assert np.array_equal(a["indices"], b["indices"]) and np.array_equal(a["labels"], b["labels"])
            np.testing.assert_allclose(b["features"], a["features"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_no_gather_is_the_local_batch_loss_and_still_trains(frozen_runs):
    one = read_jsonl(frozen_runs / "one" / "ms" / "metrics.jsonl")
    local = read_jsonl(frozen_runs / "ranks" / "ms-no-gather" / "metrics.jsonl")
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in local)
    assert any(abs(a["loss"] - b["loss"]) > 1e-3 * abs(a["loss"]) for a, b in zip(one, local, strict=True))
    start = torch.load(frozen_runs / "one" / "ms" / "last.pt", weights_only=False)["state_dict"]
    moved = weights(frozen_runs / "ranks" / "ms-no-gather")
    assert not torch.allclose(start["head.linear.weight"], moved["head.linear.weight"], atol=1e-4)


# --- the fine-tuning path: a random-init timm test ResNet on 32 px images, unreadable train images ---------------
@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """4 classes; train 6 images each plus 2 unreadable files; test 4 + 4 + 4 + 3 = 15 (odd) images."""
    root = tmp_path_factory.mktemp("ddp-images")
    colors = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]
    for split, counts in (("train", (6, 6, 6, 6)), ("test", (4, 4, 4, 3))):
        for c, (color, count) in enumerate(zip(colors, counts, strict=True)):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                (folder / f"{i}.png").write_bytes(noisy_png(color, 1000 * c + 10 * i + (split == "test")))
    (root / "train" / "class0" / "text.png").write_bytes(b"not an image\n")
    (root / "train" / "class2" / "empty.png").write_bytes(b"")
    return root


def tune_config(root: Path, out: Path, loss: str, loss_kwargs: dict, negatives: str | None, aux_ce: float,
                **overrides) -> TrainConfig:
    values = dict(dataset="folder", data=str(root), backbone="timm:test_resnet", pretrained=False, image_size=32,
                  embedding_dim=16, loss=loss, loss_kwargs=loss_kwargs, negatives=negatives, aux_ce=aux_ce,
                  batch_size=8, per_class=2, batches_per_epoch=1, epochs=3, optimizer="sgd", lr=0.05,
                  eval_every=100, workers=0, device="cpu", out=str(out), plots=False)
    values.update(overrides)
    return TrainConfig(**values)


FINE_TUNE_CASES = [c for c in CASES if c[0] in ("triplet-semihard", "ms-loop", "npair-symm", "dcdl-sinkhorn",
                                                 "sct", "ms-aux-ce", "proxy_anchor")]


# robust fine-tuning (train/robust.py), the cross-batch memory, the gradient cache and training without labels, each
# option alone; "wise" also evaluates out of domain, sharded
ROBUST_CASES = {"lp-ft": dict(lp_epochs=1), "l2sp": dict(l2sp=0.5), "distill": dict(distill=1.0),
                "layer-decay": dict(layer_decay=0.5), "ema": dict(ema=0.5), "wise": dict(wise_alpha="auto"),
                "xbm": dict(memory="xbm", memory_size=12, memory_warmup=1), "chunks": dict(chunks=2),
                # without labels: the principal-axes start, the guard's neighbours, pseudo-labels grouped each epoch
                "unlabelled": dict(labels="none", pseudo_labels="instance"),
                "unlabelled-mutual": dict(labels="none", pseudo_labels="mutual", per_class=4, freeze_backbone=False)}


def robust_config(root: Path, out: Path, name: str) -> TrainConfig:
    extra = [str(root / "test")] if name == "wise" else []
    return tune_config(root, out, "ms", {}, None, 0.0, eval_extra=extra, **ROBUST_CASES[name])


@pytest.fixture(scope="module")
def tune_runs(tmp_path_factory, image_folder) -> Path:
    """The fine-tuning cases and the robust fine-tuning options, trained by 2 ranks (one job) and by one process."""
    root = tmp_path_factory.mktemp("ddp-tune")
    robust = [robust_config(image_folder, root / "ranks" / name, name) for name in ROBUST_CASES]
    ranks_and_one(lambda who, *case: tune_config(image_folder, root / who / case[0], *case[1:]),
                  FINE_TUNE_CASES, robust, root)
    for name in ROBUST_CASES:
        train(robust_config(image_folder, root / "one" / name, name), progress=False)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in FINE_TUNE_CASES])
def test_fine_tuning_two_ranks_equal_one_process(tune_runs, name):
    assert_equivalent(tune_runs / "one" / name, tune_runs / "ranks" / name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ROBUST_CASES))
def test_robust_fine_tuning_two_ranks_equal_one_process(tune_runs, name):
    assert_equivalent(tune_runs / "one" / name, tune_runs / "ranks" / name)
    if name == "wise":  # the mix, its curve and its out-of-domain evaluation
        one, ranks = (json.loads((tune_runs / who / name / "report.json").read_text())["wise"]
                      for who in ("one", "ranks"))
        assert ranks["alpha"] == one["alpha"]
        assert [p["out_of_domain"] for p in ranks["curve"]] == pytest.approx([p["out_of_domain"] for p in one["curve"]],
                                                                             abs=1e-6)
        assert ranks["metrics"]["extra"]["test"] == pytest.approx(one["metrics"]["extra"]["test"], abs=1e-6)
        for key, value in weights(tune_runs / "one" / name, "wise.pt").items():
            assert torch.allclose(weights(tune_runs / "ranks" / name, "wise.pt")[key].double(), value.double(),
                                  rtol=1e-5, atol=1e-5), key


@pytest.mark.slow
def test_unreadable_train_images_are_counted_over_all_ranks(tune_runs):
    rows = [r for case in FINE_TUNE_CASES for r in read_jsonl(tune_runs / "ranks" / case[0] / "metrics.jsonl")]
    assert sum(r.get("skipped_images", 0) for r in rows) > 0  # the cases did meet the unreadable files
    files = {b["file"] for case in FINE_TUNE_CASES
             for b in json.loads((tune_runs / "ranks" / case[0] / "report.json").read_text())["bad_images"]}
    assert {Path(f).name for f in files} == {"text.png", "empty.png"}


def test_a_gpu_rank_sums_its_batch_counts_on_the_host_group_without_waiting_for_the_gpu(monkeypatch):
    """Under NCCL the counts would be a GPU tensor, and reading them back would wait for the step queued before."""
    from types import SimpleNamespace

    from retrieval.train import distributed

    host_group, reduced = object(), []

    def all_reduce(tensor: torch.Tensor, group=None) -> None:
        reduced.append((tensor.device.type, group))
        tensor.mul_(2)  # two ranks with the same batch

    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    ctx = distributed.DistContext(0, 2, 0, torch.device("cuda", 0), host_group)
    counts = distributed.DataParallelStep.batch_counts(SimpleNamespace(ctx=ctx), torch.arange(5), 1, gather=True)
    assert counts == (True, 10, 2) and reduced == [("cpu", host_group)]


class RecordsGatheredLabels(torch.nn.Module):
    """A loss that records whether the gathered labels' host copy was known to it."""

    def forward(self, embeddings, labels):
        from retrieval.utils.reads import known_host_copy

        self.known = known_host_copy(labels)
        return (embeddings * embeddings).mean()


@pytest.mark.parametrize("host_labels", [False, True], ids=["labels on the device only", "known on the host"])
def test_a_gpu_rank_gathers_known_host_labels_on_the_host_group_and_no_row_count_from_the_gpu(monkeypatch,
                                                                                              host_labels):
    """Under NCCL the exchanged row counts would be GPU tensors, read back before each gather (a wait each)."""
    import contextlib

    import retrieval.distributed as distributed
    from retrieval.utils.reads import known_on_host

    host_group, gathered = object(), []

    def all_gather(parts, tensor, group=None):
        gathered.append(("counts" if tensor.shape == (1,) else "rows", group))
        for part in parts:  # two ranks with the same batch
            part.copy_(tensor)

    monkeypatch.setattr(distributed, "rank_and_world", lambda: (0, 2))
    monkeypatch.setattr(distributed.dist, "all_gather", all_gather)
    monkeypatch.setattr(distributed.dist, "all_reduce", lambda tensor, group=None: tensor.mul_(2))
    monkeypatch.setattr(distributed.dist, "get_backend", lambda group=None: "nccl")
    loss = RecordsGatheredLabels()
    objective = distributed.GlobalBatchObjective(loss, gather=True, host_group=host_group)
    embeddings, labels = torch.randn(6, 4, requires_grad=True), torch.tensor([0, 0, 1, 1, 2, 2])
    with known_on_host(labels, labels.clone()) if host_labels else contextlib.nullcontext():
        step = objective(embeddings, labels)
    if host_labels:  # the labels' counts and rows on the host group; the embeddings' rows only, sized from them
        assert gathered == [("counts", host_group), ("rows", host_group), ("rows", None)]
        assert loss.known is not None and loss.known.tolist() == labels.tolist() * 2
    else:
        assert gathered == [("counts", None), ("rows", None), ("counts", None), ("rows", None)]
        assert loss.known is None
    assert torch.isfinite(step.total)


@pytest.mark.slow
def test_evaluation_sharded_over_ranks_counts_every_image_once(tune_runs):
    for who in ("one", "ranks"):
        rows = read_jsonl(tune_runs / who / "ms-loop" / "metrics.jsonl")
        assert rows[0]["epoch"] == 0 and rows[0]["eval_images"] == 15 and rows[-1]["eval_images"] == 15
    one, ranks = (read_jsonl(tune_runs / who / "ms-loop" / "metrics.jsonl")[0] for who in ("one", "ranks"))
    assert {k: v for k, v in ranks.items() if k not in (*TIMING_KEYS, "validation")} == pytest.approx(
        {k: v for k, v in one.items() if k not in (*TIMING_KEYS, "validation")}, abs=1e-6)
    # the validation images (a share of each class's, carved the same on every rank) too
    assert ranks["validation"] == pytest.approx(one["validation"], abs=1e-6) and "recall@1" in one["validation"]


# --- options that need a GPU, and options that do not fit ------------------------------------------------------------
@pytest.mark.parametrize("option, message", [
    (dict(amp="bf16"), "--amp bf16 need"), (dict(amp="fp16"), "--amp fp16 need"),
    (dict(channels_last=True), "--channels-last need"), (dict(compile=True), "--compile need"),
])
def test_gpu_options_are_refused_without_cuda(image_folder, tmp_path, option, message):
    from retrieval.train.trainer import Trainer

    with pytest.raises(ValueError, match=f"{message}.*CUDA GPU but this run is on cpu"):
        Trainer(tune_config(image_folder, tmp_path / "run", "ms", {}, None, 0.0, **option))


def test_sync_bn_needs_cuda_and_trained_batchnorm(image_folder, tmp_path):
    with pytest.raises(ValueError, match="--sync-bn .* needs --no-freeze-bn"):
        tune_config(image_folder, tmp_path / "a", "ms", {}, None, 0.0, sync_bn=True)
    with pytest.raises(ValueError, match="--sync-bn needs CUDA GPUs"):
        train(tune_config(image_folder, tmp_path / "b", "ms", {}, None, 0.0, sync_bn=True, freeze_bn=False),
              progress=False)
    with pytest.raises(ValueError, match="--amp must be one of"):
        tune_config(image_folder, tmp_path / "c", "ms", {}, None, 0.0, amp="fp8")


# --- failures: SIGKILL and resume; a rank that dies ----------------------------------------------------------------
def train_job(cfg: TrainConfig, folder: Path, *extra: str, torchrun_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """`retrieval train` (python -m cli.main) under torchrun, in a process group of its own."""
    path = folder / f"{Path(cfg.out).name}.json"
    path.write_text(json.dumps(cfg.to_dict()))
    command = torchrun(*torchrun_args, "-m", "retrieval", "train", "--config", str(path), *extra)
    return subprocess.Popen(command, env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """Kill the job: its workers (torchrun may start them in sessions of their own), then its process group."""
    if proc.poll() is None:
        for pid in worker_pids(proc.pid).values():
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_two_ranks_killed_mid_epoch_resume_equals_an_uninterrupted_run(frozen_runs, tmp_path):
    straight = frozen_runs / "ranks" / "long"
    cfg = frozen_config(tmp_path / "killed", frozen_runs / "cache-ranks", "ms", {}, "loop", 0.0,
                        batches_per_epoch=4, epochs=2)
    path = tmp_path / "killed.json"
    path.write_text(json.dumps(cfg.to_dict()))
    # rank 0 stops after writing last.pt at epoch 2, batch 2 of 4 (polling for it raced a fast run)
    command = torchrun("tests/train_paused.py", "1:2", "train", "--config", str(path), "--checkpoint-every", "1")
    proc = subprocess.Popen(command, env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    watchdog = threading.Timer(240, stop, (proc,))  # a job that never pauses is killed: its stderr then ends
    watchdog.start()
    try:
        for line in proc.stderr:
            if PAUSED in line:
                break
        else:
            raise AssertionError(f"the job ended before its pause point (rc {proc.wait()})")
        assert torch.load(tmp_path / "killed" / "last.pt", weights_only=False)["in_epoch"]["batch"] == 2
    finally:
        watchdog.cancel()
        stop(proc)
        proc.stderr.close()
    resumed = train_job(cfg, tmp_path, "--checkpoint-every", "1", "--resume")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err.decode()[-4000:]
    assert_same(straight, tmp_path / "killed")


def assert_same(a: Path, b: Path) -> None:
    for key, value in weights(a).items():
        assert torch.allclose(weights(b)[key], value, rtol=0, atol=1e-6), key
    strip = lambda row: {k: v for k, v in row.items() if k not in TIMING_KEYS}  # noqa: E731
    for row_a, row_b in zip(read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl"), strict=True):
        assert strip(row_b) == pytest.approx(strip(row_a), rel=1e-6, abs=1e-9)


def worker_pids(ancestor: int) -> dict[int, int]:
    """{RANK: pid} of the torchrun workers below process ``ancestor`` (found through /proc)."""
    ranks, todo = {}, [ancestor]
    while todo:
        pid = todo.pop()
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(p) for p in (task / "children").read_text().split()]
            environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                           if "=" in item)
        except OSError:
            continue
        if "RANK" in environ and "TORCHELASTIC_RUN_ID" in environ:
            ranks[int(environ["RANK"])] = pid
    return ranks


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not path.is_file():  # training is under way in both ranks
        assert proc.poll() is None and time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_rank_that_dies_stops_the_job_with_a_message(frozen_runs, tmp_path):
    cfg = frozen_config(tmp_path / "dies", frozen_runs / "cache-ranks", "ms", {}, None, 0.0, batches_per_epoch=50,
                        epochs=50)
    proc = train_job(cfg, tmp_path, "--checkpoint-every", "1")
    try:
        wait_for(tmp_path / "dies" / "last.pt", proc)
        ranks = worker_pids(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        stop(proc)
    assert proc.returncode != 0 and took < 60
    message = err.decode()
    assert "ChildFailedError" in message and "Signal 9 (SIGKILL)" in message, message[-3000:]


@pytest.mark.slow
def test_nproc_shortcut_restarts_a_dead_rank_and_resumes_from_last_pt(frozen_runs, tmp_path):
    """`retrieval train --nproc 2 --max-restarts 1`: rank 1 is killed inside epoch 2; torchrun restarts both ranks,
    which continue from last.pt and finish the run."""
    steps = 8  # a window of 15 steps after the kill point, so that rank 1 is still alive on a fast machine
    cfg = frozen_config(tmp_path / "restarts", frozen_runs / "cache-ranks", "ms", {}, None, 0.0,
                        batches_per_epoch=steps, epochs=3, checkpoint_every=1)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    proc = subprocess.Popen([sys.executable, "-m", "retrieval", "train", "--config", str(tmp_path / "cfg.json"),
                             "--nproc", "2", "--max-restarts", "1", "--json"], env=env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        last = tmp_path / "restarts" / "last.pt"
        wait_for(last, proc)
        ranks = worker_pids(proc.pid)  # found while both ranks are surely alive
        assert set(ranks) == {0, 1}, ranks
        while torch.load(last, weights_only=False, mmap=True)["scheduler"]["last_epoch"] <= steps:  # into epoch 2
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.02)
        os.kill(ranks[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        stop(proc)
    assert proc.returncode == 0, err.decode()[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in err.decode()  # torchrun saw the death, then restarted
    rows = read_jsonl(tmp_path / "restarts" / "metrics.jsonl")  # the restart continued: no second "epoch 1"
    assert [r["epoch"] for r in rows] == [1, 2, 3] and all(r["steps"] == steps for r in rows)
    summary = out.decode()  # the --nproc shortcut prints rank 0's summary after its epoch lines
    assert json.loads(summary[summary.index('{\n  "run"'):])["after"]["recall@1"] > 0  # printed once


@pytest.mark.slow
def test_nproc_shortcut_prints_the_summary_once_when_a_rank_dies_after_the_run_finished(image_folder, tmp_path):
    """Rank 1 is killed as it exits, after rank 0 finished the run: torchrun restarts both ranks, which resume the
    finished run; `retrieval train --nproc 2 --max-restarts 1 --json` still prints one summary, after the job."""
    cfg = tune_config(image_folder, tmp_path / "run", "ms", {}, None, 0.0, epochs=1)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    marker = tmp_path / "rank-0-done"
    job_env = {**env(), "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "rank_dies_at_exit"), str(REPO)]),
               "RANK_DIES_AT_EXIT": str(marker)}
    proc = subprocess.Popen([sys.executable, "-m", "retrieval", "train", "--config", str(tmp_path / "cfg.json"),
                             "--nproc", "2", "--max-restarts", "1", "--json"], env=job_env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        stop(proc)
    assert proc.returncode == 0, err[-4000:]
    # rank 1 died after rank 0 had finished, and torchrun restarted the finished run (else the job had failed)
    assert marker.is_file() and "failed (exitcode: -9) local_rank: 1" in err, err[-4000:]
    assert out.count('"run":') == 1, out[-4000:]
    summary = json.loads(out[out.index('{\n  "run"'):])
    assert summary["run"] == str(tmp_path / "run") and "recall@1" in summary["after"]


@pytest.mark.slow
def test_a_rank_that_hangs_fails_the_others_after_the_dist_timeout(frozen_runs, tmp_path):
    """A rank frozen by SIGSTOP does not die, so torchrun cannot see it: --dist-timeout bounds the others' wait."""
    cfg = frozen_config(tmp_path / "hangs", frozen_runs / "cache-ranks", "ms", {}, None, 0.0, batches_per_epoch=50,
                        epochs=50, dist_timeout=5.0)
    proc = train_job(cfg, tmp_path, "--checkpoint-every", "1")
    try:
        wait_for(tmp_path / "hangs" / "last.pt", proc)
        pids = worker_pids(proc.pid)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while alive(pids[0]) and time.monotonic() - stopped < 60:  # rank 0 gives up after the dist timeout
            time.sleep(0.2)
        took = time.monotonic() - stopped
        # torchrun then waits 30 s for the frozen rank before it kills it: let it go on, so the job ends now
        os.kill(pids[1], signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert took < 60 and proc.returncode != 0
    assert "ChildFailedError" in err.decode(), err.decode()[-3000:]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- launching from a user's folder --------------------------------------------------------------------------------
@pytest.fixture
def research_folder(tmp_path) -> Path:
    """A folder holding the commonest script names, which `python -m` puts first on sys.path (they used to shadow
    our top-level packages: "No module named 'train.config'; 'train' is not a package")."""
    folder = tmp_path / "project"
    folder.mkdir()
    for name in ("train.py", "serve.py", "export.py", "cli.py"):
        (folder / name).write_text("raise SystemExit('the user script ran instead of the toolkit')\n")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["nproc", "torchrun"])
def test_multi_process_training_starts_from_a_folder_with_train_py(frozen_runs, research_folder, launcher):
    cfg = frozen_config(research_folder / "run", frozen_runs / "cache-ranks", "ms", {}, None, 0.0, epochs=1)
    (research_folder / "run.json").write_text(json.dumps(cfg.to_dict()))
    command = (torchrun("-m", "retrieval", "train", "--config", "run.json") if launcher == "torchrun"
               else [str(Path(sys.executable).with_name("retrieval")), "train", "--config", "run.json", "--nproc", "2"])
    user_env = {k: v for k, v in env().items() if k != "PYTHONPATH"}  # the installed package, nothing of the repo's
    result = subprocess.run(command, env=user_env, cwd=research_folder, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [r["epoch"] for r in read_jsonl(research_folder / "run" / "metrics.jsonl")] == [1]
