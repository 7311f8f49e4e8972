"""The proxy losses against float64 references written here from their papers' equations (value and gradient, the
proxies included), their degenerate batches, their errors, and how the trainer gives the proxies their own
learning rate and keeps them across --resume."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from train_configs import digits_config

from retrieval.losses import available, build, describe, needs_classes

PROXY_LOSSES = ["proxy_anchor", "proxy_nca", "norm_softmax", "cosface", "arcface", "soft_triple"]


def unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def cos(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return unit(x) @ unit(p)


def softmax_nll(logits: list[torch.Tensor], target: int) -> torch.Tensor:
    """-log(exp(l_y) / sum_c exp(l_c)), written out."""
    return -(logits[target] - torch.log(sum(torch.exp(v) for v in logits)))


# --- the references: loops over samples and classes, the papers' formulas ----------------------------------------
def ref_proxy_anchor(x, labels, proxies, alpha=32.0, margin=0.1):
    classes = len(proxies)
    positive_part, with_positive, negative_part = 0.0, 0, 0.0
    for c in range(classes):
        pos = [i for i in range(len(x)) if labels[i] == c]
        neg = [i for i in range(len(x)) if labels[i] != c]
        if pos:
            with_positive += 1
            positive_part = positive_part + torch.log(1 + sum(torch.exp(-alpha * (cos(x[i], proxies[c]) - margin))
                                                              for i in pos))
        negative_part = negative_part + torch.log(1 + sum((torch.exp(alpha * (cos(x[i], proxies[c]) + margin))
                                                           for i in neg), torch.zeros((), dtype=x.dtype)))
    return positive_part / max(with_positive, 1) + negative_part / classes


def ref_proxy_nca(x, labels, proxies, temperature=1 / 9):
    total = 0.0
    for i in range(len(x)):
        logits = [-((unit(x[i]) - unit(p)) ** 2).sum() / temperature for p in proxies]
        total = total + softmax_nll(logits, int(labels[i]))
    return total / len(x)


def ref_norm_softmax(x, labels, proxies, temperature=0.05):
    return sum(softmax_nll([cos(x[i], p) / temperature for p in proxies], int(labels[i]))
               for i in range(len(x))) / len(x)


def ref_cosface(x, labels, proxies, scale=64.0, margin=0.35):
    total = 0.0
    for i in range(len(x)):
        y = int(labels[i])
        total = total + softmax_nll([scale * (cos(x[i], p) - (margin if c == y else 0.0))
                                     for c, p in enumerate(proxies)], y)
    return total / len(x)


def ref_arcface(x, labels, proxies, scale=64.0, margin=0.5, centers=1):
    total = 0.0
    for i in range(len(x)):
        y = int(labels[i])
        logits = []
        for c in range(len(proxies) // centers):
            cosine = max((cos(x[i], proxies[c * centers + k]) for k in range(centers)), key=lambda v: float(v.detach()))
            if c == y:
                theta = torch.acos(cosine)
                # the target logit cos(theta + m), with the paper code's linear continuation beyond pi
                cosine = torch.cos(theta + margin) if theta + margin < math.pi else cosine - margin * math.sin(margin)
            logits.append(scale * cosine)
        total = total + softmax_nll(logits, y)
    return total / len(x)


def ref_soft_triple(x, labels, proxies, scale=20.0, gamma=0.1, tau=0.2, margin=0.01, centers=10):
    classes = len(proxies) // centers
    total = 0.0
    for i in range(len(x)):
        y = int(labels[i])
        logits = []
        for c in range(classes):
            sims = [cos(x[i], proxies[c * centers + k]) for k in range(centers)]
            norm = sum(torch.exp(s / gamma) for s in sims)
            relaxed = sum(torch.exp(s / gamma) / norm * s for s in sims)
            logits.append(scale * (relaxed - (margin if c == y else 0.0)))
        total = total + softmax_nll(logits, y)
    spread = 0.0
    for c in range(classes):
        for t in range(centers):
            for s in range(t + 1, centers):
                a, b = unit(proxies[c * centers + t]), unit(proxies[c * centers + s])
                spread = spread + torch.sqrt(2 + 1e-5 - 2 * (a @ b))
    return total / len(x) + tau * spread / (classes * centers * (centers - 1))


REFERENCES = {
    "proxy_anchor": (ref_proxy_anchor, {}),
    "proxy_nca": (ref_proxy_nca, {}),
    "norm_softmax": (ref_norm_softmax, {}),
    "cosface": (ref_cosface, {}),
    "arcface": (ref_arcface, {}),
    "arcface-subcenter": (ref_arcface, {"centers": 3}),
    "arcface-beyond-pi": (ref_arcface, {"margin": 1.2, "scale": 4.0}),
    "soft_triple": (ref_soft_triple, {"centers": 4}),
    "proxy_anchor-other-hparams": (ref_proxy_anchor, {"alpha": 8.0, "margin": 0.3}),
}


def batch(classes=6, dim=5, size=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes - 1, (size,), generator=g)  # the last class has no sample in the batch
    return torch.randn(size, dim, generator=g, dtype=torch.float64), labels


@pytest.mark.parametrize("case", sorted(REFERENCES))
def test_value_and_gradient_match_the_paper_equation(case):
    name = case.split("-")[0]
    reference, hparams = REFERENCES[case]
    x, labels = batch()
    torch.manual_seed(1)
    loss = build(name, num_classes=6, embedding_dim=5, **hparams).double()
    if case == "arcface-beyond-pi":  # put some true-class angles beyond pi - m, where the continuation applies
        with torch.no_grad():
            loss.proxies[labels[:4] * loss.centers] = -x[:4]
    x1 = x.clone().requires_grad_(True)
    value = loss(x1, labels)
    value.backward()
    proxies = loss.proxies.detach().clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    expected = reference(x2, labels, proxies, **hparams)
    expected.backward()
    assert value.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    assert torch.allclose(x1.grad, x2.grad, rtol=1e-8, atol=1e-12)
    assert torch.allclose(loss.proxies.grad, proxies.grad, rtol=1e-8, atol=1e-12)  # the proxies learn too
    assert loss.proxies.grad.abs().sum() > 0


@pytest.mark.parametrize("name", PROXY_LOSSES)
def test_gradcheck_on_embeddings_and_proxies(name):
    x, labels = batch(size=6)
    torch.manual_seed(2)
    kwargs = {"centers": 2} if name in ("arcface", "soft_triple") else {}
    loss = build(name, num_classes=6, embedding_dim=5, **kwargs).double()

    def f(embeddings, proxies):
        return torch.func.functional_call(loss, {"proxies": proxies}, (embeddings, labels))

    inputs = (x.requires_grad_(True), loss.proxies.detach().clone().requires_grad_(True))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5)


def test_every_proxy_loss_is_registered_and_needs_its_classes():
    assert set(PROXY_LOSSES) <= set(available())
    assert {n for n in available() if needs_classes(n)} == set(PROXY_LOSSES)
    with pytest.raises(ValueError, match="num_classes="):
        build("proxy_anchor")
    with pytest.raises(ValueError, match="negatives loop does not apply"):
        build("proxy_anchor", negatives="loop", num_classes=4, embedding_dim=3)


def test_proxies_are_the_loss_parameter_with_the_documented_shape():
    assert build("proxy_anchor", num_classes=7, embedding_dim=3).proxies.shape == (7, 3)
    assert build("arcface", num_classes=7, embedding_dim=3, centers=3).proxies.shape == (21, 3)
    assert build("soft_triple", num_classes=7, embedding_dim=3).proxies.shape == (70, 3)
    assert [name for name, _ in build("cosface", num_classes=7, embedding_dim=3).named_parameters()] == ["proxies"]


def test_proxy_losses_describe_their_hyperparameter_names_defaults_and_equation():
    assert describe("proxy_anchor")["defaults"] == {"alpha": 32.0, "margin": 0.1, "--loss-lr": 1e-2}
    assert describe("arcface")["defaults"]["scale"] == 64.0 and describe("arcface")["defaults"]["margin"] == 0.5
    assert describe("cosface")["defaults"] == {"scale": 64.0, "margin": 0.35}
    assert describe("norm_softmax")["defaults"] == {"temperature": 0.05}
    for name in PROXY_LOSSES:
        assert describe(name)["equation"], name


@pytest.mark.parametrize("name", PROXY_LOSSES)
@pytest.mark.parametrize("case", ["one class", "equal", "zeros", "one sample", "empty"])
def test_degenerate_batches_are_finite(name, case):
    loss = build(name, num_classes=4, embedding_dim=3)
    x = {"one class": torch.randn(6, 3), "equal": torch.full((6, 3), 0.3), "zeros": torch.zeros(6, 3),
         "one sample": torch.randn(1, 3), "empty": torch.zeros(0, 3)}[case].requires_grad_(True)
    labels = torch.zeros(len(x), dtype=torch.long)
    value = loss(x, labels)
    assert torch.isfinite(value)
    value.backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(loss.proxies.grad).all()


def test_labels_outside_the_classes_and_wrong_shapes_are_refused():
    loss = build("norm_softmax", num_classes=4, embedding_dim=3)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        loss(torch.randn(2, 3), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"\[batch, 3\]"):
        loss(torch.randn(2, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="radians"):
        build("arcface", num_classes=4, embedding_dim=3, margin=30.0)


def test_a_trained_proxy_loss_separates_classes():
    """Plain SGD on fixed points: each proxy loss moves its proxies to the classes (the loss falls, the nearest
    proxy of every point is its own class's)."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 8, generator=g)
    labels = torch.arange(4).repeat(8)
    x = centres[labels] + 0.1 * torch.randn(32, 8, generator=g)
    for name in PROXY_LOSSES:
        torch.manual_seed(0)
        loss = build(name, num_classes=4, embedding_dim=8)
        optimizer = torch.optim.SGD(loss.parameters(), lr=0.5)
        first = float(loss(x, labels))
        for _ in range(200):
            optimizer.zero_grad()
            loss(x, labels).backward()
            optimizer.step()
        assert float(loss(x, labels)) < first, name
        nearest = loss.cosines(x).amax(dim=2).argmax(dim=1)
        assert (nearest == labels).all(), name


# --- in the trainer ---------------------------------------------------------------------------------------------
# the proxies' own learning rate and their state are what these tests look at: no evaluation, no plots
proxy_config = functools.partial(digits_config, loss="proxy_anchor", eval_before=False, eval_every=100, plots=False)


def test_the_proxies_learn_at_their_own_rate_and_stay_out_of_the_model(tmp_path):
    from retrieval.train.trainer import Trainer

    trainer = Trainer(proxy_config(tmp_path / "a", tmp_path / "cache"), progress=False)
    trainer.setup()
    groups = {g["name"]: g for g in trainer.parts.optimizer.param_groups}
    assert groups["loss"]["lr"] == 1e-2 and groups["head"]["lr"] == 1e-3  # the paper's 100x
    assert groups["loss"]["params"][0] is trainer.parts.loss_fn.proxies
    assert trainer.parts.loss_fn.proxies.shape == (10, 16)  # digits: 10 training classes

    trainer = Trainer(proxy_config(tmp_path / "b", tmp_path / "cache", loss="arcface", loss_lr=0.5), progress=False)
    trainer.setup()
    assert {g["name"]: g["lr"] for g in trainer.parts.optimizer.param_groups}["loss"] == 0.5  # --loss-lr wins
    trainer = Trainer(proxy_config(tmp_path / "c", tmp_path / "cache", loss="cosface"), progress=False)
    trainer.setup()
    assert {g["name"]: g["lr"] for g in trainer.parts.optimizer.param_groups}["loss"] == 1e-3  # no paper rate: --lr


def test_a_resumed_proxy_run_equals_the_uninterrupted_one(tmp_path):
    """Killed after epoch 2 of 3 (last.pt as the trainer writes it), resumed: the same losses, proxies and head."""
    from retrieval.train import train
    from retrieval.train.checkpointing import atomic_save
    from retrieval.train.trainer import Trainer

    cache = tmp_path / "cache"
    straight = train(proxy_config(tmp_path / "straight", cache, loss="soft_triple",
                                   loss_kwargs={"centers": 3}), progress=False)
    partial = Trainer(proxy_config(tmp_path / "resumed", cache, loss="soft_triple", loss_kwargs={"centers": 3}),
                      progress=False)
    partial.setup()
    for epoch in range(2):
        row = {"epoch": epoch + 1, **partial.train_epoch(epoch)}
        partial.record.history.append(row)
        atomic_save(partial.checkpoint(epoch + 1, row), tmp_path / "resumed" / "last.pt")
    resumed = train(proxy_config(tmp_path / "resumed", cache, loss="soft_triple", loss_kwargs={"centers": 3},
                                  resume=True), progress=False)
    assert resumed["last"]["loss"] == pytest.approx(straight["last"]["loss"], rel=1e-6)
    a, b = (torch.load(tmp_path / run / "last.pt", weights_only=False) for run in ("straight", "resumed"))
    assert torch.allclose(a["loss_state"]["proxies"], b["loss_state"]["proxies"], atol=1e-6)
    assert not torch.allclose(a["loss_state"]["proxies"], partial.parts.loss_fn.proxies.detach(), atol=1e-6)
    for key, value in a["state_dict"].items():
        assert torch.allclose(value, b["state_dict"][key], atol=1e-6), key
    assert not any("proxies" in key for key in a["state_dict"])  # the embedder (what ONNX exports) has none


def classifier(name: str) -> torch.nn.Module:
    """A proxy loss, or the auxiliary classification head, for 8 classes of 16-d embeddings."""
    if name == "auxiliary head":
        from retrieval.losses.auxiliary import AuxiliaryCrossEntropy

        return AuxiliaryCrossEntropy(16, 8)
    return build(name, num_classes=8, embedding_dim=16)


@pytest.mark.parametrize("name", [*PROXY_LOSSES, "auxiliary head"])
def test_a_label_outside_the_classes_is_refused_at_once_or_with_the_trainers_read(name):
    from retrieval.utils.reads import deferred_checks, read_checks

    x = torch.nn.functional.normalize(torch.randn(6, 16), dim=1)
    labels = torch.tensor([0, 0, 3, 3, 8, -1])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 8\) \(the training classes\), got \[-1, 8\]"):
        classifier(name)(x, labels)
    with deferred_checks() as checks:  # deferred: the loss runs on labels clamped into the classes, no index trap
        value = classifier(name)(x, labels)
    assert torch.isfinite(value)
    error = read_checks(checks)[1]
    assert isinstance(error, ValueError) and "got [-1, 8]" in str(error)
    with deferred_checks() as checks:
        classifier(name)(x, labels.clamp(0, 7))
    assert read_checks(checks)[1] is None
