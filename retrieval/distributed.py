"""Cross-rank batches for data-parallel training (plain ``torch.distributed``; one process per rank).

A metric loss couples the samples of a batch (every anchor against every negative), so the loss of each rank's
local part is not the loss of the global batch. ``GlobalBatchObjective`` all-gathers the embeddings and labels of
all ranks, keeps the gradient of the rank's own rows (the other rows are constants here: their rank
differentiates them) and scales the loss by the world size W. DDP then AVERAGES the ranks' gradients:

    (1 / W) sum_r W dL/dtheta |through rank r's rows = dL/dtheta  (the one-process gradient of the global batch)

Per-sample terms (the auxiliary cross-entropy head, feature distillation) stay local: their mean over the global
batch is sum_r (n_r / N) mean_r, so rank r scales its local mean by W n_r / N before DDP averages.

Without a process group (one process) everything here is the identity.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from retrieval.utils.reads import known_host_copy, known_on_host, to_device


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_range(size: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s contiguous part of ``range(size)``: parts differ by at most one item, none repeats one."""
    return range(rank * size // world_size, (rank + 1) * size // world_size)


def every_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True when ``flag`` holds on every rank: a decision all ranks must take together."""
    _, world = rank_and_world()
    if world == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def all_gather_rows(tensor: torch.Tensor, sizes: Sequence[int] | None = None, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` [n_r, ...] (n_r may differ between ranks), in rank order; no gradient.

    The ranks exchange their row counts first, pad to the largest and cut the padding off again, so the result
    holds each row exactly once. ``sizes``: every rank's count, when the caller knows them on the host (the exchanged
    counts of a GPU tensor are read back from the device, a wait). ``group``: the process group (None: the default).
    """
    rank, world = rank_and_world()
    if world == 1:
        return [tensor]
    if sizes is not None and (len(sizes) != world or sizes[rank] != tensor.shape[0]):
        raise ValueError(f"all_gather_rows: sizes {list(sizes)} must give each of the {world} ranks' row count, this "
                         f"rank's ({rank}) being {tensor.shape[0]}")
    if sizes is None:
        count = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        counts = [torch.empty_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=group)
        sizes = [int(c) for c in counts]
    padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return [part[:size] for part, size in zip(parts, sizes, strict=True)]


def gather_with_own_gradient(tensor: torch.Tensor, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """[N, ...] rows of all ranks in rank order; the rank's own rows are ``tensor`` itself, with its gradient.
    ``sizes``: every rank's row count, when known (``all_gather_rows``)."""
    rank, world = rank_and_world()
    if world == 1:
        return tensor
    parts = all_gather_rows(tensor.detach(), sizes)
    parts[rank] = tensor
    return torch.cat(parts)


@dataclass
class StepLoss:
    """One step's objective: ``backward`` for this rank's autograd, ``total`` / ``local_terms`` the values of the
    one-process objective on the global batch (detached, the same on every rank)."""

    backward: torch.Tensor
    total: torch.Tensor
    local_terms: dict[str, torch.Tensor]  # each per-sample term's mean over the global batch, by name


class GlobalBatchObjective(nn.Module):
    """``loss(embeddings, labels)`` over the global batch (``gather=True``) or each rank's part (``gather=False``:
    the local-batch loss that plain DDP computes; DDP then averages the ranks' losses), plus local per-sample terms
    (an auxiliary classifier, feature distillation), each the mean over this rank's samples.

    ``loss`` parameters are used directly by every rank on the same global batch, so each rank's gradient for
    them is already the whole one; a hook divides the W-fold scaled gradient back so that DDP's average is exact.

    ``influence(embeddings, labels, old)`` (backward-compatible training) is a term over the same batch as the
    loss, with ``old`` the frozen old model's embeddings of its images (gathered too, without gradient); its value
    is reported as the local term ``compatible``. ``projected_dim`` > 0: the embeddings' last ``projected_dim``
    columns are the model's projection into the old space (an old model of another size), which the influence
    takes; the loss takes the columns before them, the model's own embedding.
    """

    def __init__(self, loss: nn.Module, gather: bool = True, influence: nn.Module | None = None,
                 projected_dim: int = 0, host_group: Any = None) -> None:
        super().__init__()
        self.loss = loss
        self.gather = gather
        self.influence = influence
        self.projected_dim = int(projected_dim)
        # a gloo group for host tensors beside a GPU backend's default group (None: the default group, when gloo)
        self.host_group = host_group
        _, world = rank_and_world()
        if gather and world > 1:
            for parameter in loss.parameters():
                parameter.register_hook(lambda grad, w=world: grad / w)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor,
                local_terms: Mapping[str, torch.Tensor] | None = None, old: torch.Tensor | None = None) -> StepLoss:
        """``local_terms``: name -> the mean of this rank's per-sample values of that term (scalar tensors);
        ``old``: the old model's embeddings of this rank's images (with ``influence``)."""
        _, world = rank_and_world()
        terms = dict(local_terms or {})
        local = sum(terms.values(), embeddings.new_zeros(()))
        if (self.influence is None) != (old is None):
            raise ValueError("pass the old model's embeddings exactly when the objective has an influence term")
        if world == 1:
            own, projected = self._split(embeddings)
            loss = self.loss(own, labels)
            batch_terms = self._batch_terms(projected, labels, old)
            total = loss + local + sum(batch_terms.values(), embeddings.new_zeros(()))
            shown = {**terms, **batch_terms}
            return StepLoss(total, total.detach(), {name: value.detach() for name, value in shown.items()})
        if self.gather:
            everyone, known, sizes = self._gathered_labels(labels)
            share = labels.shape[0] / everyone.shape[0]  # n_r / N: this rank's weight in the global mean
            own, projected = self._split(gather_with_own_gradient(embeddings, sizes))
            with contextlib.nullcontext() if known is None else known_on_host(everyone, known):
                loss = self.loss(own, everyone)
                batch_terms = self._batch_terms(projected, everyone, None if old is None else torch.cat(
                    all_gather_rows(old.detach(), sizes)))
            batch = sum(batch_terms.values(), embeddings.new_zeros(()))
            backward = world * (loss + batch + share * local)
            parts = torch.stack([(loss + batch).detach() / world + share * local.detach(),
                                 *(share * value.detach() for value in terms.values()),
                                 *(value.detach() / world for value in batch_terms.values())])
        else:
            own, projected = self._split(embeddings)
            loss = self.loss(own, labels)
            batch_terms = self._batch_terms(projected, labels, old)
            backward = loss + local + sum(batch_terms.values(), embeddings.new_zeros(()))
            parts = torch.stack([backward.detach(), *(value.detach() for value in terms.values()),
                                 *(value.detach() for value in batch_terms.values())]) / world
        dist.all_reduce(parts)  # sum over ranks: the global objective and the global mean of each local term
        return StepLoss(backward, parts[0], dict(zip([*terms, *batch_terms], parts[1:], strict=True)))

    def _gathered_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None]:
        """(every rank's labels on ``labels``' device, their host copy, every rank's row count; both None where the
        labels' host copy is unknown). Gathered on the host when the caller knows the labels there (``known_on_host``)
        and a host group exists: then nothing of the device is read back, here or by a loss that pairs on the host."""
        host = known_host_copy(labels)
        if host is None or (self.host_group is None and dist.get_backend() != "gloo"):
            return torch.cat(all_gather_rows(labels)), None, None
        parts = all_gather_rows(host, group=self.host_group)
        known = torch.cat(parts)
        return to_device(known, labels.device), known, [len(part) for part in parts]

    def _split(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the model's own embedding, what the influence compares with the old model's: its projection into the
        old space where there is one, else the embedding itself)."""
        if not self.projected_dim:
            return embeddings, embeddings
        return embeddings[:, :-self.projected_dim], embeddings[:, -self.projected_dim:]

    def _batch_terms(self, embeddings: torch.Tensor, labels: torch.Tensor,
                     old: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The terms over the (gathered) batch besides the loss: the influence toward the old model's space."""
        if self.influence is None:
            return {}
        return {"compatible": self.influence(embeddings, labels, old)}


def embed_sharded(model: nn.Module, dataset, batch_size: int, device: torch.device, workers: int | None = None,
                  amp: bool = False, desc: str = "embed", progress: bool = True, bad_images=None):
    """``inference.embed_samples`` with the dataset split over the ranks: each embeds its contiguous part, then
    every rank gets all rows in dataset order, each image once (no padding duplicates), and every rank's
    unreadable images in ``bad_images``. One process: ``embed_samples`` itself."""
    from torch.utils.data import Subset

    from retrieval.data.dataset import BadImageLog
    from retrieval.inference import Embedded, embed_samples

    rank, world = rank_and_world()
    if world == 1:
        return embed_samples(model, dataset, batch_size, device, workers, amp, desc, progress, bad_images)
    if len(dataset) < world:
        raise ValueError(f"cannot split {len(dataset)} images over {world} processes: use fewer processes")
    bad_images = BadImageLog("fail") if bad_images is None else bad_images
    shard = shard_range(len(dataset), rank, world)
    part = embed_samples(model, Subset(dataset, list(shard)), batch_size, device, workers, amp,
                         f"{desc} [rank {rank}]", progress and rank == 0, bad_images)

    def gathered(array) -> torch.Tensor:
        return torch.cat([t.cpu() for t in all_gather_rows(torch.from_numpy(array).to(device))])

    everyone_bad: list = [None] * world
    dist.all_gather_object(everyone_bad, [replace(b, index=b.index + shard.start) for b in part.bad])
    bad = [sample for samples in everyone_bad for sample in samples]
    bad_images.add(bad)
    return Embedded(gathered(part.embeddings).numpy(), gathered(part.labels).numpy(),
                    gathered(part.indices + shard.start).numpy(), bad)
