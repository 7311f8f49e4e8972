"""BCT's influence term for pair losses: zero when the new model is the old one, its gradient toward the old space."""

from __future__ import annotations

import pytest
import torch

from retrieval import losses
from retrieval.losses.compatible import CompatibilityInfluence

RECTANGULAR = ["ms", "contrastive", "triplet"]


def _batch(seed: int = 0, classes: int = 4, per_class: int = 4, dim: int = 16):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=generator)
    labels = torch.arange(classes).repeat_interleave(per_class)
    old = torch.nn.functional.normalize(centres[labels] + 0.5 * torch.randn(len(labels), dim, generator=generator))
    return old, labels, generator


@pytest.mark.parametrize("name", RECTANGULAR)
def test_the_influence_is_zero_when_the_new_model_is_the_old_one(name):
    old, labels, _ = _batch()
    influence = CompatibilityInfluence(losses.build(name), weight=2.0)
    assert influence(old.clone().requires_grad_(), labels, old).abs().item() < 1e-6


@pytest.mark.parametrize("name", RECTANGULAR)
def test_its_gradient_moves_new_embeddings_toward_the_old_space(name):
    old, labels, generator = _batch(1)
    rotation, _ = torch.linalg.qr(torch.randn(old.shape[1], old.shape[1], generator=generator))
    new = (old @ rotation).requires_grad_()  # as good a space, but another one
    influence = CompatibilityInfluence(losses.build(name))
    value = influence(new, labels, old)
    assert value.item() > 0  # new against old is worse than old against itself
    value.backward()
    stepped = torch.nn.functional.normalize(new.detach() - 0.5 * new.grad / new.grad.norm(dim=1, keepdim=True)
                                            .clamp_min(1e-12))
    before = torch.nn.functional.cosine_similarity(new.detach(), old).mean()
    after = torch.nn.functional.cosine_similarity(stepped, old).mean()
    assert after > before
    assert influence(stepped, labels, old) < value


def test_a_single_class_batch_gives_a_finite_influence():
    old, _, _ = _batch(2, classes=1, per_class=6)
    new = torch.nn.functional.normalize(old + 0.1).requires_grad_()
    value = CompatibilityInfluence(losses.build("ms"))(new, torch.zeros(6, dtype=torch.long), old)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(new.grad).all()


def test_a_loss_without_the_query_gallery_form_and_a_bad_weight_are_refused():
    with pytest.raises(ValueError, match="no query x gallery form"):
        CompatibilityInfluence(losses.build("lifted"))
    with pytest.raises(ValueError, match="must be > 0"):
        CompatibilityInfluence(losses.build("ms"), weight=0)


def test_a_projection_into_the_old_space_takes_the_influence_and_the_loss_keeps_the_own_embedding():
    """A new size: the embeddings' trailing columns are P(new); the loss reads the own columns only, the influence
    the projected ones, and its gradient reaches P."""
    from retrieval.distributed import GlobalBatchObjective
    from retrieval.models import CompatibleProjection

    old, labels, generator = _batch(3)  # the old model's 16-d embeddings
    new = torch.nn.functional.normalize(torch.randn(len(labels), 32, generator=generator)).requires_grad_()
    projection = CompatibleProjection(32, 16, seed=0)
    influence = CompatibilityInfluence(losses.build("ms"))
    objective = GlobalBatchObjective(losses.build("ms"), influence=influence, projected_dim=16)
    step = objective(torch.cat([new, projection(new)], dim=1), labels, old=old)
    assert step.local_terms["compatible"] == pytest.approx(influence(projection(new), labels, old).item(), rel=1e-6)
    assert step.total.item() == pytest.approx(losses.build("ms")(new, labels).item() +
                                              step.local_terms["compatible"].item(), rel=1e-6)
    step.backward.backward()
    assert projection.linear.weight.grad is not None and projection.linear.weight.grad.abs().sum() > 0
    assert new.grad is not None and torch.isfinite(new.grad).all()


def test_the_projection_starts_as_an_isometry_and_outputs_unit_vectors():
    from retrieval.models import CompatibleProjection

    wide = CompatibleProjection(16, 32, seed=0)  # into a larger old space: the angles are kept exactly
    x = torch.nn.functional.normalize(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
    assert torch.allclose(wide(x) @ wide(x).T, x @ x.T, atol=1e-5)
    narrow = CompatibleProjection(32, 16, seed=0)
    assert torch.allclose(narrow(torch.randn(4, 32)).norm(dim=1), torch.ones(4), atol=1e-5)
