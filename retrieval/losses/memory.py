"""Cross-batch memory (XBM; Wang, Zhang, Huang & Scott, "Cross-Batch Memory for Embedding Learning", CVPR 2020).

Embeddings drift slowly once training has warmed up, so the embeddings of past batches are still good stand-ins
for the current model's: a FIFO queue of the last ``size`` embeddings (and labels) gives every step many more
positives and negatives than the batch holds, at the cost of a matrix product with the queue.

``CrossBatchMemory(loss, size, embedding_dim, warmup)`` wraps a loss: after ``warmup`` steps, the step's loss sees the
queue too; before, the batch alone. Then the batch enters the queue, oldest rows leaving first. The queue is buffers
of the module, so checkpoints hold it and ``--resume`` restores it.

Reading of the paper: XBM's loss (its eq. 5 and 7) sums a pair loss over the anchors of the mini-batch, each
against the batch and the memory: a B x (B + M) similarity matrix, the memory's rows constants (features with no
gradient). A loss with the rectangular form (``PairLoss.rectangular``; docs/LOSSES.md lists them) is called so:
``loss.query_gallery(E, y, (E, M), cat(y, y_M), self_index=arange(B))`` (the gallery cat(E, M) given as its two
blocks, so that no gradient is computed for the memory's rows), each batch row excluded as its own positive, for
O(B (B + M)) work instead of O((B + M)^2). The memory's rows are no anchors. Against the loss on
the concatenation, ``loss(cat(E, M), cat(y, y_M))`` (this module's form before), the value lacks the memory anchors'
terms and its normaliser counts the batch's anchors (pairs, triplets) only: for a mean over anchors,
B L = (B + M) L_cat - M L_mem, L_mem the memory anchors' mean against batch + memory; the gradient on the batch
rows is the concatenated form's minus what the memory anchors' terms gave them, rescaled the same way.

The other losses keep the concatenation, ``loss(cat(E, M), cat(y, y_M))``, the memory's rows constants: their terms
read rows of other samples than the anchor (``square_only`` says which: lifted structure's pair-level sums, HPHN's
and lifted-min's hardest pair, angular's x_j.x_k; DCDL's class-wise distributions), so a memory row in a term
needs its own row against the memory, and the (B + M)^2 form is their equation with the memory's rows as samples.
Under data parallelism the wrapped loss sees the gathered global batch, so every rank enqueues the same rows and
the queues stay equal.
"""

from __future__ import annotations

import torch
from torch import nn

from retrieval.errors import ParameterError
from retrieval.utils.reads import Stat


class CrossBatchMemory(nn.Module):
    """A loss with a queue of past embeddings and labels that the loss sees as extra rows after ``warmup`` steps."""

    def __init__(self, loss: nn.Module, size: int, embedding_dim: int, warmup: int = 0) -> None:
        super().__init__()
        if int(size) < 1:
            raise ParameterError("size", f"must be >= 1 embeddings, got {size}")
        if int(warmup) < 0:
            raise ParameterError("warmup", f"must be >= 0 steps, got {warmup}")
        self.loss = loss
        self.size, self.warmup = int(size), int(warmup)
        self.register_buffer("embeddings", torch.zeros(self.size, int(embedding_dim)))
        self.register_buffer("labels", torch.zeros(self.size, dtype=torch.long))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))  # rows in use
        self.register_buffer("position", torch.zeros((), dtype=torch.long))  # where the next row goes
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # batches seen
        self.last_stats: dict[str, Stat] = {}
        # (steps, filled, position) as the host knows them: the buffers are read once (after a load), then counted
        self._counts: tuple[int, int, int] | None = None

    def _load_from_state_dict(self, *args: object, **kwargs: object) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._counts = None  # the loaded buffers are read at the next step

    def counts(self) -> tuple[int, int, int]:
        """(batches seen, rows in use, where the next row goes), without reading the device after the first call."""
        if self._counts is None:
            steps, filled, position = torch.stack([self.steps, self.filled, self.position]).tolist()
            self._counts = (steps, filled, position)
        return self._counts

    @property
    def active(self) -> bool:
        """Whether the next batch sees the memory (the warm-up is over and the queue holds rows)."""
        steps, filled, _ = self.counts()
        return steps >= self.warmup and filled > 0

    def memory(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings [m, D], labels [m]) in the queue, oldest first."""
        _, filled, position = self.counts()
        order = torch.arange(position - filled, position, device=self.labels.device) % self.size
        return self.embeddings[order], self.labels[order]

    @property
    def batch_anchors(self) -> bool:
        """Whether only the batch's rows are anchors (the loss's rectangular form), else the concatenation's all."""
        return bool(getattr(self.loss, "rectangular", False))

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.active:
            value = self.loss(embeddings, labels)
        else:
            stored, stored_labels = self.memory()
            stored = stored.to(embeddings.dtype)
            gallery_labels = torch.cat([labels, stored_labels])
            if self.batch_anchors:  # eq. 5 and 7: the batch's anchors against batch + memory
                own_rows = torch.arange(len(labels), device=labels.device)
                value = self.loss.query_gallery(embeddings, labels, (embeddings, stored), gallery_labels, own_rows)
            else:
                value = self.loss(torch.cat([embeddings, stored]), gallery_labels)
        self.last_stats = {**getattr(self.loss, "last_stats", {}),
                           "memory_rows": float(self.counts()[1]) if self.active else 0.0}
        if self.training:  # before a deferred batch check is read: a failed check stops the run, queue and all
            self.enqueue(embeddings.detach(), labels)
        return value

    @torch.no_grad()
    def enqueue(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch to the queue (the newest ``size`` rows when the batch alone is larger)."""
        embeddings, labels = embeddings[-self.size:], labels[-self.size:]
        count = len(labels)
        steps, filled, position = self.counts()
        slots = (position + torch.arange(count, device=self.labels.device)) % self.size
        self.embeddings[slots] = embeddings.to(self.embeddings.dtype)
        self.labels[slots] = labels.to(self.labels.device)
        self._counts = (steps + 1, min(self.size, filled + count), (position + count) % self.size)
        self.steps.fill_(self._counts[0])
        self.filled.fill_(self._counts[1])
        self.position.fill_(self._counts[2])

    def extra_repr(self) -> str:
        return f"size={self.size}, warmup={self.warmup}"
