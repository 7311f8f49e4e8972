"""Cross-batch memory (XBM): the queue, its warm-up, and the loss it gives: the batch's anchors against batch and
memory (XBM eq. 5 and 7) for a loss with the rectangular form, checked against a float64 loop and against the
concatenated form less the memory anchors' terms; the concatenation for the others. In the trainer, --resume
restores it."""

from __future__ import annotations

import functools

import pytest
import torch
from loss_references import ANCHOR_REFERENCES, QueryGallery
from reads_back import ReadsBack
from train_configs import digits_config

from retrieval.losses import available, build, has_rectangular_form
from retrieval.losses.memory import CrossBatchMemory
from retrieval.utils.reads import deferred_checks

RECTANGULAR = [name for name in available() if has_rectangular_form(name)]
# losses that average over the anchors: B L = (B + M) L_cat - M L_mem holds exactly
MEAN_OVER_ANCHORS = ["contrastive", "binomial", "raw", "ms", "vthm", "generalized_lifted"]


def batch(seed: int, size: int = 8, dim: int = 6, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(size // classes)
    return torch.randn(size, dim, generator=g, dtype=torch.float64), labels


@pytest.mark.parametrize("name", ["triplet", "ms", "lifted", "npair", "contrastive", "dcdl"])
def test_an_empty_memory_is_the_plain_loss(name):
    memory = CrossBatchMemory(build(name), size=100, embedding_dim=6).double()
    first, first_labels = batch(0)
    assert memory(first, first_labels).item() == pytest.approx(build(name)(first, first_labels).item(), rel=1e-12)


def filled_memory(name: str) -> CrossBatchMemory:
    """A memory (of ``name``) that holds batch(0)'s 8 rows."""
    memory = CrossBatchMemory(build(name), size=100, embedding_dim=6).double()
    memory(*batch(0))
    return memory


@pytest.mark.parametrize("name", RECTANGULAR)
def test_a_filled_memory_gives_the_batch_anchors_against_batch_and_memory(name):
    memory = filled_memory(name)
    stored, stored_labels = batch(0)
    second, second_labels = batch(1)
    x = second.clone().requires_grad_(True)
    value = memory(x, second_labels)
    (grad,) = torch.autograd.grad(value, x)
    y = second.clone().requires_grad_(True)  # eq. 5 and 7: anchors of the batch, the memory's rows constants
    pairs = QueryGallery(y, second_labels, torch.cat([y, stored]), torch.cat([second_labels, stored_labels]),
                         torch.arange(len(second_labels)))
    expected = ANCHOR_REFERENCES[name](pairs)
    (expected_grad,) = torch.autograd.grad(expected, y)
    assert value.item() == pytest.approx(expected.item(), abs=1e-10)
    assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-10)
    assert memory.last_stats["memory_rows"] == 8.0


@pytest.mark.parametrize("name", MEAN_OVER_ANCHORS)
def test_the_memory_form_is_the_concatenated_one_without_the_memory_anchors(name):
    memory, loss = filled_memory(name), build(name)
    stored, stored_labels = batch(0)
    second, second_labels = batch(1)
    b, m = len(second_labels), len(stored_labels)
    gallery_labels = torch.cat([second_labels, stored_labels])
    x = second.clone().requires_grad_(True)
    value = memory(x, second_labels)
    (grad,) = torch.autograd.grad(b * value, x)
    y = second.clone().requires_grad_(True)
    concatenated = loss(torch.cat([y, stored]), gallery_labels)
    memory_anchors = loss.query_gallery(stored, stored_labels, torch.cat([y, stored]), gallery_labels,
                                        b + torch.arange(m))
    (expected_grad,) = torch.autograd.grad((b + m) * concatenated - m * memory_anchors, y)
    assert b * value.item() == pytest.approx((b + m) * concatenated.item() - m * memory_anchors.item(), abs=1e-10)
    assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["lifted", "lifted_min", "hphn_triplet", "angular", "dcdl"])
def test_a_loss_without_the_rectangular_form_sees_the_memory_concatenated_to_the_batch(name):
    memory, loss = filled_memory(name), build(name)
    first, first_labels = batch(0)
    second, second_labels = batch(1)
    x = second.clone().requires_grad_(True)
    value = memory(x, second_labels)
    value.backward()
    y = second.clone().requires_grad_(True)
    expected = loss(torch.cat([y, first]), torch.cat([second_labels, first_labels]))  # the memory's rows constants
    expected.backward()
    assert value.item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.allclose(x.grad, y.grad, rtol=1e-10, atol=1e-12)  # the memory rows are constants


def test_the_queue_is_first_in_first_out_and_bounded():
    memory = CrossBatchMemory(build("ms"), size=5, embedding_dim=2)
    for step in range(3):
        memory.enqueue(torch.full((2, 2), float(step)), torch.tensor([step, step]))
    stored, labels = memory.memory()
    assert labels.tolist() == [0, 1, 1, 2, 2] and stored[:, 0].tolist() == [0, 1, 1, 2, 2]
    memory.enqueue(torch.arange(14.0).view(7, 2), torch.arange(7))  # larger than the queue: its newest rows
    assert memory.memory()[1].tolist() == [2, 3, 4, 5, 6] and int(memory.filled) == 5


def test_the_memory_waits_for_its_warm_up():
    memory = CrossBatchMemory(build("ms"), size=100, embedding_dim=6, warmup=2).double()
    plain = build("ms")
    for seed in range(2):  # steps 0 and 1: the batch alone (but the queue fills)
        x, labels = batch(seed)
        assert memory(x, labels).item() == pytest.approx(plain(x, labels).item())
        assert memory.last_stats["memory_rows"] == 0.0
    x, labels = batch(5)
    memory(x, labels)
    assert memory.last_stats["memory_rows"] == 16.0


def test_the_memory_is_part_of_the_state_dict():
    memory = CrossBatchMemory(build("ms"), size=10, embedding_dim=6).double()
    for seed in range(3):
        memory(*batch(seed))
    copy = CrossBatchMemory(build("ms"), size=10, embedding_dim=6).double()
    assert set(memory.state_dict()) == {"embeddings", "labels", "filled", "position", "steps"}  # what --resume reads
    copy.load_state_dict(memory.state_dict())
    x, labels = batch(9)
    assert copy(x, labels).item() == memory(x, labels).item()


def test_a_memory_that_loads_a_state_continues_from_the_loaded_queue_not_its_own():
    memory, copy = (CrossBatchMemory(build("ms"), size=10, embedding_dim=6).double() for _ in range(2))
    for seed in range(3):
        memory(*batch(seed))
    copy(*batch(7))  # the copy counted its own queue: 1 batch, 8 rows
    copy.load_state_dict(memory.state_dict())
    assert copy.counts() == memory.counts() == (3, 10, 4)
    x, labels = batch(9)
    assert copy(x, labels).item() == memory(x, labels).item()
    assert torch.equal(copy.memory()[0], memory.memory()[0])


def test_the_queue_is_counted_on_the_host_and_read_from_the_device_once():
    memory = CrossBatchMemory(build("ms"), size=12, embedding_dim=6).double()
    with ReadsBack() as first, deferred_checks():
        memory(*batch(0))
    with ReadsBack() as later, deferred_checks() as checks:  # the memory's own rows in the gallery: a deferred check
        for seed in range(1, 5):
            memory(*batch(seed))
    assert (first.count, later.count) == (1, 0)
    assert len(checks) == 4 and all(bool(holds) for holds, _ in checks)
    assert memory.counts() == (int(memory.steps), int(memory.filled), int(memory.position)) == (5, 12, 4)


def test_bad_settings_are_refused():
    from retrieval.train import TrainConfig

    with pytest.raises(ValueError, match="--memory-size must be >= 1"):
        TrainConfig(memory="xbm", memory_size=0)
    with pytest.raises(ValueError, match="--negatives loop"):
        TrainConfig(memory="xbm", negatives="loop")
    with pytest.raises(ValueError, match="needs --gather"):
        TrainConfig(memory="xbm", gather=False)


# a queue that fills within the first epoch and is used from the third step; only the loss and the state matter
xbm_config = functools.partial(digits_config, memory="xbm", memory_size=50, memory_warmup=2, optimizer="sgd",
                               lr=0.05, eval_before=False, eval_every=100, plots=False, tensorboard=False)


def test_a_resumed_run_restores_the_memory_and_equals_the_uninterrupted_one(tmp_path):
    from retrieval.train import train
    from retrieval.train.checkpointing import atomic_save
    from retrieval.train.trainer import Trainer

    straight = train(xbm_config(tmp_path / "straight", tmp_path / "cache"), progress=False)
    partial = Trainer(xbm_config(tmp_path / "resumed", tmp_path / "cache"), progress=False)
    partial.setup()
    for epoch in range(2):
        row = {"epoch": epoch + 1, **partial.train_epoch(epoch)}
        partial.record.history.append(row)
        atomic_save(partial.checkpoint(epoch + 1, row), tmp_path / "resumed" / "last.pt")
    assert int(partial.parts.loss_fn.filled) == 50  # 6 batches of 20 went in: the queue is full
    resumed = train(xbm_config(tmp_path / "resumed", tmp_path / "cache", resume=True), progress=False)
    assert resumed["last"]["loss"] == pytest.approx(straight["last"]["loss"], rel=1e-6)
    assert resumed["last"]["loss_memory_rows"] == 50.0
    a, b = (torch.load(tmp_path / run / "last.pt", weights_only=False) for run in ("straight", "resumed"))
    assert torch.equal(a["loss_state"]["labels"], b["loss_state"]["labels"])
    for key, value in a["state_dict"].items():
        assert torch.allclose(value, b["state_dict"][key], atol=1e-6), key


def test_a_proxy_loss_refuses_the_memory(tmp_path):
    from retrieval.train import train

    with pytest.raises(ValueError, match="changes nothing"):
        train(xbm_config(tmp_path / "run", tmp_path / "cache", loss="proxy_anchor"), progress=False)


@pytest.mark.parametrize(("name", "kwargs"), [("triplet", {}), ("triplet", {"mining": "semihard"}),
                                              ("nca_triplet", {"mining": "semihard"})])
def test_a_memory_over_few_classes_is_refused_before_the_triplet_terms_are_allocated(monkeypatch, name, kwargs):
    import retrieval.losses.base as base

    monkeypatch.setattr(base, "MAX_PAIR_ROW_ELEMENTS", 300)
    memory = CrossBatchMemory(build(name, **kwargs), size=40, embedding_dim=6, warmup=0)
    memory(*batch(0))  # 8 rows: 8 x 1 positives x 8 = 64 terms
    with pytest.raises(ValueError, match=r"24 positive pairs x 16 samples.*cross-batch memory"):
        memory(*batch(1))  # 8 anchors against 16 rows: 8 x 3 positive pairs x 16 samples
