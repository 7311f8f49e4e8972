"""Several training processes (torchrun / torch.distributed): the process group, the rank's device, the launcher.

The training entry point is the ``retrieval`` command itself, run by torchrun once per rank:

    torchrun --nproc-per-node 8 -m retrieval train --config run.toml            # one machine, 8 GPUs
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 -m retrieval train ...

``retrieval train ... --nproc N`` launches the same on this machine (``torch.distributed.run --standalone``).
Each process reads RANK, WORLD_SIZE and LOCAL_RANK (set by torchrun); backend NCCL with one GPU per process
(``cuda:LOCAL_RANK``), gloo on CPU. Without WORLD_SIZE > 1 training runs in one process, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from retrieval.distributed import rank_and_world
from retrieval.inference import resolve_device
from retrieval.losses.regularizers import feature_distillation
from retrieval.train.config import TrainConfig, new_run_folder


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: rank, world size, local rank and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # the collectives of host values (a batch's counts, its labels): a gloo group beside NCCL's, so that they do not
    # wait for the GPU to finish the work queued before them; None: the default group, which is gloo already
    host_group: Any = None

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes checkpoints, metrics.jsonl and the report."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (e.g. the metrics rank 0 computed)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class TrainStep(nn.Module):
    """What a step trains, as one module for DDP: the embedder run by the feature source's ``forward`` (the head
    on cached features, else the whole model; frozen parameters are left out of DDP), the per-sample terms of this
    rank (the auxiliary head; feature distillation toward ``teacher``, weighted ``distill``) and the loss (its
    parameters, if any, are kept in sync; it is called on the gathered batch by ``GlobalBatchObjective``, not here).

    ``backbone_fixed`` (LP-FT's first phase) runs the backbone without gradients, in eval mode: only the head
    learns."""

    def __init__(self, net: nn.Module, forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                 aux: nn.Module | None, loss: nn.Module, teacher: nn.Module | None = None,
                 distill: float = 0.0) -> None:
        super().__init__()
        self.net = net
        self.net_forward = forward
        self.aux = aux
        self.loss = loss
        self.teacher = teacher  # frozen: DDP leaves its parameters alone (requires_grad False)
        self.distill = distill
        self.channels_last = False
        self.backbone_fixed = False

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor,
                amp: torch.dtype | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(float32 embeddings [b, D] (followed by their projection into the old space, [b, D + d_old], where the
        model has one), name -> mean over this rank's b samples of each per-sample term)."""
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        terms = {}
        with torch.autocast(inputs.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            if self.teacher is None and not self.backbone_fixed:
                embeddings = self.net_forward(self.net, inputs)
            else:
                with torch.set_grad_enabled(torch.is_grad_enabled() and not self.backbone_fixed):
                    features = self.net.backbone(inputs)
                embeddings = self.net.head(features)
                if self.teacher is not None and not self.backbone_fixed:  # LP-FT's head phase: student = teacher
                    with torch.no_grad():
                        target = self.teacher(inputs)
                    terms["distill"] = self.distill * feature_distillation(features.float(), target.float())
        embeddings = embeddings.float()
        if self.aux is not None:
            terms["aux_ce"] = self.aux(embeddings, labels)
        projection = getattr(self.net, "compatible", None)
        if projection is not None:
            # the projection into the old space rides behind the embedding's columns, so that the chunked and the
            # gathered paths carry it (and its gradient) unchanged; GlobalBatchObjective splits them again
            embeddings = torch.cat([embeddings, projection(embeddings)], dim=1)
        return embeddings, terms


class DataParallelStep:
    """Runs ``TrainStep`` on this rank: through DistributedDataParallel (gradients averaged over the ranks) when
    there are several, as it is in one process."""

    def __init__(self, net: nn.Module, forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                 aux: nn.Module | None, loss: nn.Module, ctx: DistContext, sync_bn: bool = False,
                 channels_last: bool = False, compile_step: bool = False, teacher: nn.Module | None = None,
                 distill: float = 0.0, phases: bool = False) -> None:
        """``phases``: the backbone is fixed for a while (LP-FT), so DDP must expect parameters without gradients."""
        self.ctx = ctx
        module = TrainStep(net, forward, aux, loss, teacher, distill)
        self.inner = module
        if channels_last:  # gpu_options refused it without CUDA
            module.channels_last = True
            net.to(memory_format=torch.channels_last)
        if sync_bn:
            if ctx.device.type != "cuda":
                raise ValueError("--sync-bn needs CUDA GPUs (torch's SyncBatchNorm runs on GPUs only); leave it out "
                                 "on CPU (BatchNorm is frozen by default: --freeze-bn)")
            module.net = nn.SyncBatchNorm.convert_sync_batchnorm(module.net)
        self.module = torch.compile(module) if compile_step else module
        if ctx.distributed:
            self.module = DistributedDataParallel(
                self.module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                find_unused_parameters=phases)

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor, amp: torch.dtype | None):
        return self.module(inputs, labels, amp)

    def chunked(self, inputs: torch.Tensor, labels: torch.Tensor, amp: torch.dtype | None,
                chunks: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """The gradient cache (Gao et al. 2021, --chunks): the batch's embeddings computed chunk by chunk without
        keeping activations, as a leaf that takes the loss's gradient, and ``replay()``, which runs each chunk
        again with its activations and pushes its rows of that gradient into the weights. The sum over the chunks
        is the whole batch's gradient: the step equals the unchunked one where the forward is deterministic
        (frozen BatchNorm). Random layers (dropout, drop connect) draw their masks per chunk; the replay restores
        each chunk's random state, so its gradient is that of the masks its first pass drew."""
        input_parts, label_parts = inputs.tensor_split(chunks), labels.tensor_split(chunks)
        states, outputs = [], []
        with torch.no_grad():
            for x, y in zip(input_parts, label_parts, strict=True):
                states.append(_random_state(x.device))
                outputs.append(self.module(x, y, amp)[0] if len(x) else x.new_zeros((0, 0)))
        after = _random_state(inputs.device)
        embeddings = torch.cat([o for o in outputs if len(o)]).requires_grad_(True)
        sizes = [len(o) for o in outputs]

        def replay() -> None:
            grads = embeddings.grad.split(sizes) if embeddings.grad is not None else [None] * len(sizes)
            last = max(i for i, n in enumerate(sizes) if n)
            for i, (x, y, state, grad) in enumerate(zip(input_parts, label_parts, states, grads, strict=True)):
                if not len(x) or grad is None:
                    continue
                _set_random_state(state, x.device)
                # DDP reduces the gradients once, after the last chunk's backward
                defer = self.ctx.distributed and i < last
                with self.module.no_sync() if defer else contextlib.nullcontext():
                    self.module(x, y, amp)[0].backward(grad)
            _set_random_state(after, inputs.device)

        return embeddings, replay

    def fix_backbone(self, fixed: bool) -> None:
        """LP-FT: run the backbone without gradients (True) or train it with the rest (False)."""
        self.inner.backbone_fixed = fixed

    def batch_counts(self, labels: torch.Tensor | None, unreadable: int, gather: bool) -> tuple[bool, int, int]:
        """(whether every rank trains on this batch, its images, its unreadable images), over the global batch.

        A step needs at least 2 images in all (gathered) or on each rank (local), and at least one on each rank;
        the ranks decide together, since a rank cannot skip a step the others take."""
        count = 0 if labels is None else len(labels)
        if not self.ctx.distributed:
            return count >= 2, count, unreadable
        short = int(count < (1 if gather else 2))
        sums = torch.tensor([count, unreadable, short], dtype=torch.int64)  # on the host: read back, no GPU wait
        dist.all_reduce(sums, group=self.ctx.host_group)
        count, unreadable, short = (int(v) for v in sums.tolist())
        return short == 0, count, unreadable

    def all_records(self, records: list[dict]) -> list[dict]:
        """Every rank's ``records`` (e.g. the unreadable images each met), rank 0's first."""
        if not self.ctx.distributed:
            return records
        everyone: list = [None] * self.ctx.world_size
        dist.all_gather_object(everyone, records)
        return [record for part in everyone for record in part]


def _random_state(device: torch.device) -> tuple:
    """The CPU (and the device's CUDA) random state, to replay a forward's random draws."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_random_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def gpu_options(amp: bool | str, channels_last: bool, compile_step: bool, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``--amp`` (None: full precision); refuses the GPU-only options without CUDA."""
    cuda = device.type == "cuda"
    asked = [name for name, on in (("--amp " + str(amp), amp in ("fp16", "bf16")), ("--channels-last", channels_last),
                                   ("--compile", compile_step)) if on]
    if asked and not cuda:
        raise ValueError(f"{', '.join(asked)} need(s) a CUDA GPU but this run is on {device}: leave them out "
                         "(or run where torch.cuda.is_available())")
    if amp == "bf16":
        return torch.bfloat16
    if amp == "fp16" or (amp in (True, "auto") and cuda):
        return torch.float16
    return None


def env_world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def ensure_run_folder(cfg: TrainConfig) -> None:
    """Give a run without ``out`` a new folder of its own; under torchrun every process must be given the same one."""
    if cfg.out is None:
        if env_world_size() > 1:
            raise ValueError("under torchrun, give --out: every process must write the same run folder")
        cfg.out = new_run_folder()


# set by ``launch`` in the ranks it starts: the launcher, not rank 0, says the run's summary
LAUNCHED = "RETRIEVAL_LAUNCHED_BY_NPROC"


def launched() -> bool:
    """True in a rank that ``launch`` (``--nproc``) started: the launcher prints the summary once the job has ended.

    Rank 0 cannot: torchrun restarts every rank when one dies, even after rank 0 finished and printed it (a rank
    killed at its exit), and the restarted rank 0 resumes the finished run and prints it again."""
    return os.environ.get(LAUNCHED) == "1"


def restarted() -> bool:
    """True in a worker that torchrun restarted (``--max-restarts``): the run continues from last.pt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Join the process group torchrun describes (if WORLD_SIZE > 1 and not joined yet); the rank's device.

    ``timeout_s`` bounds every collective: a rank that waits longer for a peer fails with an error instead of
    hanging (torchrun also stops the other ranks as soon as one process dies).
    """
    world = env_world_size()
    if world <= 1:
        return DistContext(0, 1, 0, resolve_device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but no CUDA GPU is available; use --device cpu")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) here: start at most one "
                "process per GPU (--nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
        target = torch.device("cuda", local_rank)
    else:
        target = resolve_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        # torchrun's store outlives a restart (--max-restarts): keys of the dead attempt would be read as this
        # one's (gloo then dials the old ranks' addresses), so every attempt uses keys of its own
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"retrieval/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout, device_id=target if use_cuda else None)
    rank, world = rank_and_world()
    host_group = None
    if dist.get_backend() != "gloo":  # every rank creates it, in the same order: a collective
        host_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return DistContext(rank, world, local_rank, target, host_group)


def launch(nproc: int, cfg_dict: dict[str, Any], out: Path, max_restarts: int = 0,
           extra_args: tuple[str, ...] = ()) -> int:
    """Run ``retrieval train`` in ``nproc`` processes on this machine through torchrun; returns its exit code.

    The configuration travels as a JSON file (``out/launch.json``), so every rank runs exactly it; ``extra_args``
    are the command's own options (``--offline``), which are not part of it. The ranks print no summary
    (``launched``): the caller says it once this returns.
    """
    if nproc < 2:
        raise ValueError(f"--nproc must be >= 2 to launch several processes, got {nproc}")
    out.mkdir(parents=True, exist_ok=True)
    config = out / "launch.json"
    config.write_text(json.dumps(cfg_dict, indent=1))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", "-m", "retrieval", "train", "--config", str(config), *extra_args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env[LAUNCHED] = "1"
    return subprocess.run(command, env=env).returncode
