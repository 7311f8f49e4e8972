"""On a CUDA GPU: every loss agrees with the CPU in float64, and training runs with each GPU option.

CI has no GPU, so this module is skipped there (pytest -ra prints the reason); run it on a GPU machine with
``pytest tests/project/test_cuda.py``. docs/BENCHMARKS.md ("GPU") records the last run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from run_files import metrics_rows
from sample_images import noisy_png

from retrieval.losses import available, available_negatives, build, wants_normalized

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")

CASES = [(name, None) for name in available()] + available_negatives()


def batch(name: str, classes: int = 8, per_class: int = 4, dim: int = 64, seed: int = 0):
    """Shuffled P x N labels and float64 embeddings (unit rows for the losses that train on unit vectors)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    labels = labels[torch.randperm(len(labels), generator=g)]
    x = torch.randn(len(labels), dim, generator=g, dtype=torch.float64)
    if wants_normalized(name):
        x = torch.nn.functional.normalize(x, dim=1)
    return x, labels


def loss_and_grad(name: str, negatives: str | None, x: torch.Tensor, labels: torch.Tensor, device: str,
                  dtype: torch.dtype) -> tuple[float, np.ndarray]:
    torch.manual_seed(0)  # the proxy losses start from the same proxies on both devices
    loss = build(name, negatives=negatives, num_classes=8, embedding_dim=x.shape[1]).to(device=device, dtype=dtype)
    leaf = x.detach().to(device=device, dtype=dtype).clone().requires_grad_(True)
    value = loss(leaf, labels.to(device))
    value.backward()
    return float(value.detach()), leaf.grad.double().cpu().numpy()


@pytest.mark.parametrize("name, negatives", CASES, ids=[f"{n}-{m or 'batch'}" for n, m in CASES])
def test_loss_on_cuda_matches_cpu_float64(name, negatives):
    x, labels = batch(name)
    ref_value, ref_grad = loss_and_grad(name, negatives, x, labels, "cpu", torch.float64)
    value, grad = loss_and_grad(name, negatives, x, labels, "cuda", torch.float32)
    assert np.isfinite(value) and np.isfinite(grad).all()
    assert value == pytest.approx(ref_value, rel=1e-4, abs=1e-5)
    assert np.linalg.norm(grad - ref_grad) <= 1e-3 * np.linalg.norm(ref_grad) + 1e-6


@pytest.mark.parametrize("name", available())
def test_degenerate_batch_is_finite_on_cuda(name):
    """One class only, and identical embeddings: finite loss and gradient, as on the CPU."""
    x = torch.ones(8, 16, device="cuda") / 4.0
    labels = torch.zeros(8, dtype=torch.long, device="cuda")
    leaf = x.requires_grad_(True)
    try:
        value = build(name, num_classes=8, embedding_dim=16).cuda()(leaf, labels)
    except ValueError:  # a loss may refuse a batch without negatives: that is the CPU's behaviour too
        with pytest.raises(ValueError):
            build(name, num_classes=8, embedding_dim=16)(x.detach().cpu().requires_grad_(True), labels.cpu())
        return
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(leaf.grad).all()


# --- training with the GPU options ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """4 classes, 8 train and 4 test images each, plus one unreadable training file."""
    root = tmp_path_factory.mktemp("cuda-images")
    colors = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]
    for split, count in (("train", 8), ("test", 4)):
        for c, color in enumerate(colors):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                (folder / f"{i}.png").write_bytes(noisy_png(color, 1000 * c + 10 * i + (split == "test")))
    (root / "train" / "class0" / "text.png").write_bytes(b"not an image\n")
    return root


def config(root: Path, out: Path, **overrides):
    from retrieval.train import TrainConfig

    values = dict(dataset="folder", data=str(root), backbone="timm:resnet18", pretrained=False, image_size=32,
                  embedding_dim=16, loss="ms", batch_size=8, per_class=2, batches_per_epoch=3, epochs=2,
                  optimizer="sgd", lr=0.05, eval_every=1, workers=0, device="cuda", out=str(out), plots=False,
                  freeze_bn=False)
    values.update(overrides)
    return TrainConfig(**values)


GPU_OPTIONS = {
    "fp32": dict(amp="off"),
    "fp16": dict(amp="fp16"),
    "bf16": dict(amp="bf16"),
    "bf16-channels-last": dict(amp="bf16", channels_last=True),
    "fp16-compile": dict(amp="fp16", compile=True),
    "dcdl-loop-fp16": dict(amp="fp16", loss="dcdl", loss_kwargs={"phi": "sinkhorn"}),
    "dcdl-compile-bf16": dict(amp="bf16", loss="dcdl", loss_kwargs={"phi": "sinkhorn"}, compile=True),
    "ms-loop-bf16": dict(amp="bf16", negatives="loop"),
    "ms-loop-compile-bf16": dict(amp="bf16", negatives="loop", compile=True),
    "decode-on-device-fp16": dict(amp="fp16", decode_on="device"),
    "npair-symm-fp16": dict(amp="fp16", loss="npair", negatives="symm"),
}


@pytest.mark.slow
@pytest.mark.parametrize("option", list(GPU_OPTIONS))
def test_training_runs_on_cuda_with_each_gpu_option(image_folder, tmp_path, option):
    from retrieval.train import train

    report = train(config(image_folder, tmp_path / option, **GPU_OPTIONS[option]), progress=False)
    history = metrics_rows(tmp_path / option)
    losses = [row["loss"] for row in history if "loss" in row]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert all(row.get("skipped_steps", 0) == 0 for row in history)
    assert any(row.get("cuda_max_memory_mb", 0) > 0 for row in history)
    assert report["bad_images"], "the unreadable training file is reported"
    assert np.isfinite(report["last"]["recall@1"])


@pytest.mark.slow
def test_fp32_training_on_cuda_follows_the_cpu(image_folder, tmp_path):
    """The same seeded run, full precision: the first epoch's loss agrees between CPU and GPU."""
    from retrieval.train import train

    runs = {}
    for device in ("cpu", "cuda"):
        train(config(image_folder, tmp_path / device, amp="off", device=device, epochs=1, eval_every=100,
                     eval_before=False), progress=False)
        runs[device] = metrics_rows(tmp_path / device)
    cpu_loss = next(r["loss"] for r in runs["cpu"] if "loss" in r)
    gpu_loss = next(r["loss"] for r in runs["cuda"] if "loss" in r)
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-2)


@pytest.mark.slow
def test_fp16_training_resumes_on_cuda(image_folder, tmp_path):
    """last.pt of an fp16 run holds the grad scaler and the CUDA RNG; --resume continues to the planned epochs."""
    from retrieval.train import train

    train(config(image_folder, tmp_path / "run", amp="fp16", epochs=1, eval_every=100), progress=False)
    ckpt = torch.load(tmp_path / "run" / "last.pt", map_location="cpu", weights_only=False)
    assert "cuda" in ckpt["rng"]
    train(config(image_folder, tmp_path / "run", amp="fp16", epochs=2, eval_every=100, resume=True), progress=False)
    history = metrics_rows(tmp_path / "run")
    assert [row["epoch"] for row in history if "loss" in row] == [1, 2]


def test_autocast_embeddings_match_full_precision():
    """Evaluation's autocast (fp16) embeddings of a real backbone point where the float32 ones do."""
    from torch.utils.data import TensorDataset

    from retrieval.inference import embed_samples
    from retrieval.models import create_embedder

    torch.manual_seed(0)
    model = create_embedder("timm:resnet18", pretrained=False, embedding_dim=32, normalize=True).cuda()
    data = TensorDataset(torch.rand(24, 3, 64, 64), torch.arange(24))
    full = embed_samples(model, data, batch_size=8, device="cuda", workers=0, amp=False, progress=False)
    half = embed_samples(model, data, batch_size=8, device="cuda", workers=0, amp=True, progress=False)
    cosine = (np.asarray(full.embeddings) * np.asarray(half.embeddings)).sum(axis=1)
    assert cosine.min() > 0.999


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["ms", "proxy_anchor"])
def test_chunked_step_equals_the_whole_batch_on_cuda(image_folder, tmp_path, loss, monkeypatch):
    """--chunks on the GPU: the same losses and weights as the unchunked fp32 step (BatchNorm frozen, as required).

    cuDNN runs float32 convolutions in TF32 by default, and picks its algorithm by batch size, so a chunk and the
    whole batch round differently (~1e-3 relative); exact float32 convolutions make the comparison meaningful."""
    from retrieval.train import train

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)

    runs = {}
    for chunks in (1, 3):
        runs[chunks] = tmp_path / f"chunks{chunks}"
        train(config(image_folder, runs[chunks], amp="off", loss=loss, chunks=chunks, freeze_bn=True, eval_every=100,
                     eval_before=False, tensorboard=False), progress=False)
    one, chunked = metrics_rows(runs[1]), metrics_rows(runs[3])
    assert [r["loss"] for r in chunked] == pytest.approx([r["loss"] for r in one], rel=1e-4, abs=1e-6)
    wa, wb = (torch.load(runs[c] / "last.pt", map_location="cpu", weights_only=False) for c in (1, 3))
    for part in ("state_dict", "loss_state"):
        for key, value in (wa[part] or {}).items():
            gap = (wb[part][key].double() - value.double()).abs().max().item() if value.numel() else 0.0
            assert torch.allclose(wb[part][key].double(), value.double(), rtol=1e-4, atol=1e-5), (part, key, gap)


@pytest.mark.slow
def test_cross_batch_memory_trains_on_cuda_in_fp16(image_folder, tmp_path):
    """--memory xbm under fp16 autocast: the memory fills with the step's embeddings and the losses stay finite."""
    from retrieval.train import train

    train(config(image_folder, tmp_path / "xbm", amp="fp16", memory="xbm", memory_size=16, memory_warmup=0,
                 epochs=2, eval_every=100, tensorboard=False), progress=False)
    history = [row for row in metrics_rows(tmp_path / "xbm") if "loss" in row]
    assert len(history) == 2 and all(np.isfinite(r["loss"]) and r.get("skipped_steps", 0) == 0 for r in history)
    ckpt = torch.load(tmp_path / "xbm" / "last.pt", map_location="cpu", weights_only=False)
    filled = [value for key, value in ckpt["loss_state"].items() if key.endswith("filled")]
    assert filled and int(filled[0]) == 16, "the memory holds the last 16 embeddings"


# --- exact kNN and retrieval metrics on the GPU -----------------------------------------------------------------------
KNN_SIMILARITIES = ["cosine", "euclidean", "dot"]
KNN_NAMES = ["recall", "map@r", "r_precision"]


def grid_rows(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    """Rows of norm 2**j (j in -1..1) with entries +-1/2, +-1/4, +-1/8 and +-1/16 whose squares sum to 4**j: every
    product, sum, norm and normalised row is exact in float32, so the CPU and the GPU must give the same scores bit
    for bit whatever their summation order; scores are multiples of 1/1024, so they also tie often."""
    rows = np.zeros((n, dim), np.float32)
    for row in rows:
        while True:  # squares in units of 1/256: 1/2 -> 64, 1/4 -> 16, 1/8 -> 4, 1/16 -> 1; they sum to 256
            halves = rng.integers(0, 4)
            left = 256 - 64 * halves
            quarters = rng.integers(0, left // 16 + 1)
            left -= 16 * quarters
            sixteenths = 4 * rng.integers(0, min(left, 24) // 4 + 1)
            eighths = (left - sixteenths) // 4
            sizes = [0.5] * halves + [0.25] * quarters + [0.125] * eighths + [0.0625] * sixteenths
            if len(sizes) <= dim:
                break
        row[rng.choice(dim, size=len(sizes), replace=False)] = np.array(sizes) * rng.choice([-1.0, 1.0], len(sizes))
    return (rows * 2.0 ** rng.integers(-1, 2, size=(n, 1))).astype(np.float32)


def plant_ties(rng: np.random.Generator, query: np.ndarray, gallery: np.ndarray) -> None:
    """Repeated gallery rows (a block of copies and scattered ones) and queries that are gallery rows."""
    gallery[100:140] = gallery[7]
    copies = rng.choice(len(gallery), size=500, replace=False)
    gallery[copies] = gallery[rng.choice(len(gallery), size=500)]
    query[:300] = gallery[rng.choice(len(gallery), size=300)]


@pytest.fixture
def tf32_matmuls():
    """TF32 matmuls switched on, as a training run with --tf32 leaves them: the metrics must not use them."""
    matmul = torch.backends.cuda.matmul
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        saved = matmul.fp32_precision
        matmul.fp32_precision = "tf32"
        yield
        matmul.fp32_precision = saved
    else:
        saved = matmul.allow_tf32
        matmul.allow_tf32 = True
        yield
        matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def knn_sets():
    """3,000 queries and 20,000 gallery rows (D = 64) on the exact grid, with planted ties, and labels that follow
    the rows (the nearest of 600 random directions), so that neighbours often share a label: metrics well above 0."""
    rng = np.random.default_rng(0)
    query, gallery = grid_rows(rng, 3000, 64), grid_rows(rng, 20000, 64)
    plant_ties(rng, query, gallery)
    directions = rng.normal(size=(64, 600))
    return query, (query @ directions).argmax(axis=1), gallery, (gallery @ directions).argmax(axis=1)


@pytest.mark.parametrize("metric", KNN_SIMILARITIES)
def test_knn_on_cuda_equals_the_cpu(knn_sets, metric, tf32_matmuls):
    from retrieval.metrics import knn

    query, _, gallery, _ = knn_sets
    for args, exclude_self in (((query, gallery), False), ((gallery,), True)):  # the 20,000 rows leave-one-out
        want = knn(*args, k=10, exclude_self=exclude_self, metric=metric)
        got = knn(*args, k=10, exclude_self=exclude_self, metric=metric, device="cuda")
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("metric", KNN_SIMILARITIES)
def test_evaluate_on_cuda_equals_the_cpu(knn_sets, metric, tf32_matmuls):
    from retrieval.metrics import evaluate

    query, query_labels, gallery, gallery_labels = knn_sets
    for args in ((query, query_labels, gallery, gallery_labels), (gallery, gallery_labels)):
        want = evaluate(*args, metric=metric, metrics=KNN_NAMES, ks=(1, 2, 4, 8, 10))
        got = evaluate(*args, metric=metric, metrics=KNN_NAMES, ks=(1, 2, 4, 8, 10), device="cuda")
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name] == pytest.approx(value, abs=1e-6), name


@pytest.mark.parametrize("metric", KNN_SIMILARITIES)
def test_knn_on_cuda_of_gaussian_rows_is_full_float32(metric, tf32_matmuls):
    """Scores that round: the GPU's scores stay within 1e-5 of the CPU's (TF32 would be ~1e-3 off), and where a list
    differs, the swapped neighbours' exact scores are within that rounding of each other. Euclidean distances are
    compared squared: the sqrt of a rounding error at a planted copy (distance 0) is far above it on either device."""
    from retrieval.metrics import knn

    rng = np.random.default_rng(1)
    query, gallery = (rng.normal(size=(n, 64)).astype(np.float32) / 8 for n in (3000, 20000))  # |row| ~ 1
    plant_ties(rng, query, gallery)
    want = knn(query, gallery, k=10, metric=metric)
    got = knn(query, gallery, k=10, metric=metric, device="cuda")
    power = 2 if metric == "euclidean" else 1
    np.testing.assert_allclose(got[0].astype(np.float64) ** power, want[0].astype(np.float64) ** power, rtol=0,
                               atol=1e-5)
    q64, g64 = query.astype(np.float64), gallery.astype(np.float64)
    if metric == "cosine":
        q64, g64 = q64 / np.linalg.norm(q64, axis=1, keepdims=True), g64 / np.linalg.norm(g64, axis=1, keepdims=True)
    picked = g64[got[1]]  # [n, k, d]: each query's GPU neighbours, scored exactly
    exact = (((picked - q64[:, None]) ** 2).sum(axis=2) if metric == "euclidean"
             else np.einsum("nkd,nd->nk", picked, q64))
    np.testing.assert_allclose(exact, want[0].astype(np.float64) ** power, rtol=0, atol=1e-5)
    assert (got[1] != want[1]).mean() < 1e-3  # near-ties only


def test_knn_on_cuda_in_small_blocks_and_out_of_memory(knn_sets, monkeypatch):
    """Little free GPU memory gives small blocks and the same lists; a gallery that cannot fit is a clear error."""
    import retrieval.metrics.neighbours as neighbours

    query, _, gallery, _ = knn_sets
    want = neighbours.knn(query, gallery, k=10)
    gallery_bytes = gallery.nbytes
    per_row = gallery.shape[0] * (3 * 4 + 8) + 10 * neighbours.DEVICE_BYTES_PER_DEPTH
    monkeypatch.setattr(neighbours, "_device_free_bytes", lambda device: gallery_bytes + 2 * 37 * per_row)
    got = neighbours.knn(query, gallery, k=10, device="cuda")  # a few dozen queries per block
    np.testing.assert_array_equal(got[1], want[1])
    monkeypatch.setattr(neighbours, "_device_free_bytes", lambda device: gallery_bytes // 2)
    with pytest.raises(ValueError, match=r"cannot hold the gallery .* use device='cpu'"):
        neighbours.knn(query, gallery, k=10, device="cuda")
    with pytest.raises(ValueError, match=r"'cuda:99' was requested but only"):
        neighbours.knn(query, gallery, k=10, device="cuda:99")


@pytest.mark.parametrize("method", ["loop", "loop-linear"])
def test_compiled_loop_equals_eager_on_cuda(method):
    """LoOp's solver through torch.compile (retrieval train --compile): the same loss, gradient and statistic."""
    x, labels = batch("ms", classes=32, per_class=4, dim=128)
    results = []
    for compiled in (False, True):
        loss = build("ms", negatives=method).cuda()
        if compiled:
            loss.method.compile_solver()
        leaf = x.float().cuda().requires_grad_(True)
        value = loss(leaf, labels.cuda())
        value.backward()
        results.append((float(value), leaf.grad.double().cpu().numpy(),
                        float(loss.last_stats["synthetic_negative_share"])))
    (eager, eager_grad, eager_share), (fused, fused_grad, fused_share) = results
    assert fused == pytest.approx(eager, rel=1e-5)
    assert np.abs(fused_grad - eager_grad).max() <= 1e-4 * max(np.abs(eager_grad).max(), 1e-12)
    assert fused_share == pytest.approx(eager_share, abs=1e-6)  # an endpoint stays one when compiled


def test_compiled_sinkhorn_equals_eager_on_cuda():
    """DCDL's Sinkhorn iterations through torch.compile (retrieval train --compile): the same loss and gradient."""
    x, labels = batch("dcdl", classes=10, per_class=6, dim=128)
    results = []
    for compiled in (False, True):
        loss = build("dcdl", phi="sinkhorn").cuda()
        if compiled:
            loss.compile_solver()
        leaf = x.float().cuda().requires_grad_(True)
        value = loss(leaf, labels.cuda())
        value.backward()
        results.append((float(value), leaf.grad.double().cpu().numpy()))
    (eager, eager_grad), (fused, fused_grad) = results
    assert fused == pytest.approx(eager, rel=1e-4)
    assert np.abs(fused_grad - eager_grad).max() <= 1e-3 * max(np.abs(eager_grad).max(), 1e-12)


def test_device_decode_on_cuda_shows_what_the_workers_show(tmp_path):
    """nvJPEG and the augmentation on the GPU: the crops and flips of the CPU pipeline, bounded decode groups."""
    from device_batches import CONFIG, both_pipelines
    from sample_images import save_jpeg, smooth_picture

    paths = [save_jpeg(tmp_path / f"{i}.jpg", smooth_picture(120 + 37 * i, 300 - 21 * i, i)) for i in range(8)]
    paths.append(str(tmp_path / "x.png"))
    from PIL import Image

    Image.fromarray(smooth_picture(90, 70, 99)).save(paths[-1])
    for augmentation in ("crop-flip", "strong"):
        cpu, images, labels, bad, _ = both_pipelines(paths, augmentation, device="cuda", group_pixels=100_000)
        assert images.is_cuda and bad == [] and labels.tolist() == cpu.labels.tolist()
        if augmentation == "crop-flip":  # the colour augmentations draw other numbers on the device
            assert (images.cpu() - cpu.inputs).abs().mean(dim=(1, 2, 3)).max() < 0.05
    # a letterboxing model: the whole image resized and placed on the background canvas, on the GPU
    letterboxed = replace(CONFIG, resize="pad")
    cpu, images, labels, bad, _ = both_pipelines(paths, "crop-flip", device="cuda", config=letterboxed)
    assert images.is_cuda and bad == [] and (images.cpu() - cpu.inputs).abs().mean(dim=(1, 2, 3)).max() < 0.05


def test_the_device_stage_queues_its_work_after_decoding_without_waiting_for_the_gpu(tmp_path):
    """Crop, resize, flip and normalise on the GPU: the decode thread never waits for the GPU after nvJPEG."""
    from device_batches import CONFIG
    from sample_images import save_jpeg, smooth_picture

    from retrieval.data.augment import resolve_augmentation
    from retrieval.data.dataset import CatchBadSamples, ImageDataset
    from retrieval.data.device_decode import DeviceAugment, EncodedImages, collate_encoded

    paths = [save_jpeg(tmp_path / f"{i}.jpg", smooth_picture(120 + 37 * i, 300 - 21 * i, i)) for i in range(8)]
    augmentation = resolve_augmentation("crop-flip")
    items = EncodedImages(ImageDataset(paths, list(range(8)), [str(i) for i in range(8)]), CONFIG, augmentation)
    inputs = collate_encoded([CatchBadSamples(items)[(i, 7_000 + i)] for i in range(8)]).inputs
    assert any(image.flip for image in inputs.images) and not all(image.flip for image in inputs.images)
    stage = DeviceAugment(CONFIG, augmentation, "cuda")
    decoded = stage.decode(inputs.images)  # nvJPEG waits for its own results: not what is checked here
    stage.decode = lambda images: decoded
    want = stage(inputs)[0]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the GPU raises
    try:
        got = stage(inputs)[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, want)


def test_the_workers_hand_uint8_pixels_to_the_gpu_which_normalises_them_as_the_cpu_does():
    from sample_images import NoisePictures

    from retrieval.data import BadImageLog, ClassBalancedBatchSampler
    from retrieval.data.preprocessing import ModelPreprocessing
    from retrieval.train.config import TrainConfig
    from retrieval.train.features import Embedding, ImagePipeline

    config = ModelPreprocessing(input_size=32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    epochs = {}
    for device in ("cpu", "cuda"):
        cfg = TrainConfig(dataset="digits", seed=3)
        embedding = Embedding(torch.device(device), 8, workers=2, amp=False, progress=False,
                              bad_images=BadImageLog("skip"))
        pictures = NoisePictures(ImagePipeline.train_transform(config, cfg.augmentation(), embedding.device))
        assert pictures[0][0].dtype == (torch.uint8 if device == "cuda" else torch.float32)
        pipeline = ImagePipeline(cfg, pictures, None, embedding, config)
        sampler = ClassBalancedBatchSampler(np.arange(12) % 4, 2, 3, seed=1, batches_per_epoch=3)
        try:
            epochs[device] = list(pipeline.batches(sampler, 0, 0))
        finally:
            pipeline.close()
    for (images, labels, _), (expected, expected_labels, _) in zip(epochs["cuda"], epochs["cpu"], strict=True):
        assert images.is_cuda and images.dtype == torch.float32 and torch.equal(labels, expected_labels)
        torch.testing.assert_close(images.cpu(), expected, rtol=0, atol=1e-5)


def test_sgd_on_cuda_keeps_torchs_default_kernels():
    """Fused SGD leaves its momentum buffers uninitialised when an fp16 overflow skips the first step."""
    from retrieval.train.optimizers import OPTIMIZERS

    params = list(torch.nn.Linear(8, 4).cuda().parameters())
    assert not OPTIMIZERS.build("sgd", param_groups=[{"params": params, "lr": 0.1}], weight_decay=0.0).defaults["fused"]


@pytest.mark.parametrize("name", ["adamw", "adam"])
@pytest.mark.parametrize("first_overflows", [False, True])
def test_an_fp16_optimizer_step_on_cuda_skips_an_overflow_without_waiting_for_the_gpu(name, first_overflows):
    from retrieval.train.optimizers import OPTIMIZERS

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).cuda()
    optimizer = OPTIMIZERS.build(name, param_groups=[{"params": list(model.parameters()), "lr": 0.1}],
                                 weight_decay=1e-4)
    assert optimizer.defaults["fused"]
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(16, 8, device="cuda")
    weights, start = [], [p.detach().clone() for p in model.parameters()]
    for step, overflow in enumerate((first_overflows, False, True, False)):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss * (float("inf") if overflow else 1.0)).backward()
        # after the first step (which makes the optimizer's state), any read-back of the GPU's values raises
        torch.cuda.set_sync_debug_mode("error" if step else 0)
        try:
            scaler.step(optimizer)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(weights[1], weights[2], strict=True))  # the overflow: skipped
    assert not all(torch.equal(a, b) for a, b in zip(weights[2], weights[3], strict=True))
    if first_overflows:  # skipped too, and the state it made is the zeros a first step starts from
        assert all(torch.equal(a, b) for a, b in zip(start, weights[0], strict=True))
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert scaler.get_scale() < 65536.0  # and the scale backed off


def reads_nothing_on_the_cpu(name: str) -> bool:
    """Whether the loss's forward and backward, its batch check deferred, read nothing back on the CPU (no value,
    no data-dependent shape)."""
    from reads_back import ReadsBack

    from retrieval.utils.reads import deferred_checks

    x, labels = batch(name)
    loss = build(name, num_classes=8, embedding_dim=x.shape[1])
    with ReadsBack() as reads, deferred_checks():
        loss(x.requires_grad_(True), labels).backward()
    return reads.count == 0


SYNC_FREE = [name for name in available() if reads_nothing_on_the_cpu(name)] if torch.cuda.is_available() else []


@pytest.mark.parametrize("name", SYNC_FREE)
def test_a_loss_that_reads_nothing_on_the_cpu_never_waits_for_the_gpu(name):
    from retrieval.utils.reads import deferred_checks, read_checks

    x, labels = batch(name)
    loss = build(name, num_classes=8, embedding_dim=x.shape[1]).cuda()
    leaf, labels = x.float().cuda().requires_grad_(True), labels.cuda()
    loss(leaf, labels)  # warm-up: lazy initialisation may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any read-back of the GPU's values raises
    try:
        with deferred_checks() as checks:
            value = loss(leaf, labels)
        value.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert read_checks(checks)[1] is None and torch.isfinite(value)


@pytest.mark.parametrize("host_labels", [False, True], ids=["labels on the GPU only", "known on the host"])
@pytest.mark.parametrize(("name", "negatives"), available_negatives() if torch.cuda.is_available() else [],
                         ids=lambda v: str(v))
def test_a_loss_with_hard_negatives_waits_for_the_gpu_once_for_its_labels(name, negatives, host_labels):
    import contextlib
    import warnings

    from retrieval.utils.reads import known_on_host

    x, host = batch(name)
    loss = build(name, negatives=negatives).cuda()
    leaf, labels = x.float().cuda().requires_grad_(True), host.cuda()
    loss(leaf, labels).backward()  # warm-up: lazy initialisation and the pinned-memory cache
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # each read-back of the GPU's values warns
    try:
        with warnings.catch_warnings(record=True) as caught, (
                known_on_host(labels, host) if host_labels else contextlib.nullcontext()):
            warnings.simplefilter("always")
            value = loss(leaf, labels)
            value.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    waits = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    # the labels' copy to the host, where the batch is paired, unless the caller has them there (the trainer does)
    assert len(waits) == (0 if host_labels else 1), waits
    assert torch.isfinite(value)
