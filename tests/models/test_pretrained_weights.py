"""Pretrained weights online and offline: torchvision's and timm's own loaders and caches, and an
offline mode that never touches the network. Nothing here downloads: caches are fakes under tmp_path and every
way out to the network is patched to fail and to say so."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path
from urllib.error import URLError

import pytest
import timm.models._hub as timm_hub
import torch
import torchvision
from click.testing import CliRunner

from retrieval.models import PretrainedWeightsMissing, WeightsDownloadFailed, create_embedder, load_embedder
from retrieval.models.checkpoint import CHECKPOINT_FORMAT
from retrieval.models.weights import OFFLINE_ENV_VARS, resolve_weights

RESNET18 = torchvision.models.ResNet18_Weights.DEFAULT
RESNET18_FILE = RESNET18.url.rsplit("/", 1)[-1]  # resnet18-f37072fd.pth: the name torch.hub caches it under
TIMM_MODEL = "test_resnet"  # timm's tiny test network (weights in timm/test_resnet.r160_in1k)
HF_HUB_DOWNLOAD = timm_hub.hf_hub_download  # timm's binding of huggingface_hub's download (patched below)


@pytest.fixture
def network(monkeypatch) -> list[str]:
    """Every way to the network fails and is recorded: sockets, urllib, torch.hub's download, timm's hub calls."""
    calls: list[str] = []

    def refuse(name: str):
        def fail(*args, **kwargs):
            calls.append(name)
            raise OSError(f"test: {name} must not be called")
        return fail

    monkeypatch.setattr(socket.socket, "connect", refuse("socket.connect"))
    monkeypatch.setattr(urllib.request, "urlopen", refuse("urllib.request.urlopen"))
    monkeypatch.setattr(torch.hub, "urlopen", refuse("torch.hub.urlopen"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse("torch.hub.download_url_to_file"))
    monkeypatch.setattr(timm_hub, "hf_hub_download", refuse("hf_hub_download"))
    return calls


@pytest.fixture
def online(monkeypatch):
    """The environment asks for no offline mode (the suite's conftest sets RETRIEVAL_OFFLINE=1)."""
    for name in OFFLINE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def torch_home(tmp_path, monkeypatch) -> Path:
    """An empty torch.hub cache: TORCH_HOME=tmp_path/torch, so the weights go to tmp_path/torch/hub/checkpoints."""
    home = tmp_path / "torch"
    monkeypatch.setenv("TORCH_HOME", str(home))
    return home


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache (huggingface_hub reads HF_HUB_CACHE at import: its constant is what counts)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_resnet18(torch_home: Path) -> dict[str, torch.Tensor]:
    """A randomly initialised torchvision resnet18 saved where torchvision's loader looks for its weights."""
    torch.manual_seed(1)
    state = torchvision.models.resnet18().state_dict()
    folder = torch_home / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(state, folder / RESNET18_FILE)
    return state


def test_offline_takes_torchvision_weights_from_the_torch_hub_cache(torch_home, network):
    state = cache_resnet18(torch_home)
    model = create_embedder("resnet18", 8, pretrained=True, offline=True)
    torch.testing.assert_close(model.backbone.conv1.weight, state["conv1.weight"])
    torch.testing.assert_close(model.backbone.layer4[1].bn2.running_var, state["layer4.1.bn2.running_var"])
    assert network == []


def test_online_reads_the_cache_without_downloading(torch_home, online, network):
    state = cache_resnet18(torch_home)
    model = create_embedder("resnet18", 8, pretrained=True)
    torch.testing.assert_close(model.backbone.conv1.weight, state["conv1.weight"])
    assert network == []


def test_online_downloads_through_torchvision_with_its_hash_check(torch_home, online, monkeypatch):
    """The download torchvision's builders do: torch.hub's cache and the hash in the file name checked; a failure
    (no network) is one clear message that suggests offline mode and pretrained=False."""
    calls = []

    def unreachable(url, dst, hash_prefix=None, progress=True):
        calls.append((url, Path(dst), hash_prefix, progress))
        raise URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(torch.hub, "download_url_to_file", unreachable)
    with pytest.raises(WeightsDownloadFailed) as info:
        create_embedder("resnet18", 8, pretrained=True)
    expected = torch_home / "hub" / "checkpoints" / RESNET18_FILE
    assert calls == [(RESNET18.url, expected, RESNET18_FILE.split("-")[1].split(".")[0], True)]  # check_hash=True
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)  # the command line shows it as one line
    for part in ("'resnet18'", RESNET18.url, str(expected), "name resolution", "offline=True", "pretrained=False",
                 "efficientnet_lite0"):
        assert part in message, (part, message)
    assert not expected.exists()


def test_offline_with_an_empty_cache_fails_before_building(torch_home, network, monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("the model was built before the missing weights were noticed")

    monkeypatch.setattr(torchvision.models, "get_model", built)
    with pytest.raises(PretrainedWeightsMissing) as info:
        create_embedder("resnet50", 8, pretrained=True, offline=True)
    message = str(info.value)
    path = torch_home / "hub" / "checkpoints" / torchvision.models.ResNet50_Weights.DEFAULT.url.rsplit("/", 1)[-1]
    for part in ("'resnet50'", str(path), "offline=True", "run", "efficientnet_lite0", "pretrained=False",
                 "weights=PATH"):
        assert part in message, (part, message)
    assert network == []


@pytest.mark.parametrize("variable", OFFLINE_ENV_VARS)
def test_the_environment_turns_offline_mode_on(variable, torch_home, online, network, monkeypatch):
    monkeypatch.setenv(variable, "1")
    with pytest.raises(PretrainedWeightsMissing, match=f"offline mode is on \\({variable}=1\\)"):
        create_embedder("convnext_tiny", 8, pretrained=True)
    assert network == []


def test_hf_hub_offline_with_timm_and_no_cache_says_where_it_looked(hf_cache, online, network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PretrainedWeightsMissing) as info:
        create_embedder(f"timm:{TIMM_MODEL}", 8, pretrained=True)
    message = str(info.value)
    for part in (f"'timm:{TIMM_MODEL}'", str(hf_cache / "models--timm--test_resnet.r160_in1k"), "HF_HUB_OFFLINE=1",
                 "timm/test_resnet.r160_in1k", "pretrained=False"):
        assert part in message, (part, message)
    assert network == []


def test_offline_timm_weights_come_from_the_hugging_face_cache(hf_cache, network, monkeypatch):
    """A cache laid out as huggingface_hub writes it (refs/main -> snapshots/<commit>/model.safetensors)."""
    import safetensors.torch
    import timm

    monkeypatch.setattr(timm_hub, "hf_hub_download", HF_HUB_DOWNLOAD)  # the real one: offline it reads the cache

    torch.manual_seed(2)
    state = timm.create_model(TIMM_MODEL).state_dict()
    repo = hf_cache / "models--timm--test_resnet.r160_in1k"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    safetensors.torch.save_file(state, repo / "snapshots" / commit / "model.safetensors")
    model = create_embedder(f"timm:{TIMM_MODEL}", 8, pretrained=True, offline=True)
    torch.testing.assert_close(model.backbone.conv1[0].weight, state["conv1.0.weight"])
    assert resolve_weights(f"timm:{TIMM_MODEL}", offline=True).cached
    assert network == []  # sockets and urllib stayed untouched


def test_efficientnet_lite0_works_offline(torch_home, hf_cache, network):
    from retrieval.models import efficientnet_lite0_classifier

    model = create_embedder("efficientnet_lite0", 8, pretrained=True, offline=True)
    reference = efficientnet_lite0_classifier(pretrained=True).state_dict()
    torch.testing.assert_close(model.backbone.net._conv_stem.weight, reference["_conv_stem.weight"])
    assert resolve_weights("efficientnet_lite0", offline=True).source == "package"
    assert network == []


def test_a_checkpoint_loads_without_any_weights_source(tmp_path, torch_home, online, network):
    """evaluate and export rebuild from the checkpoint: no pretrained weights, so no cache and no network."""
    model = create_embedder("resnet18", 8)
    path = tmp_path / "m.pt"
    torch.save({"format": CHECKPOINT_FORMAT, "model_config": model.config.to_json(),
                "state_dict": model.state_dict()}, path)
    loaded = load_embedder(path)
    torch.testing.assert_close(loaded.backbone.conv1.weight, model.backbone.conv1.weight)
    assert network == []


def test_train_offline_fails_before_any_work(tmp_path, torch_home, online, network):
    from retrieval.cli.main import main

    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["train", "--offline", "--backbone", "resnet18", "--dataset", "digits",
                                       "--epochs", "1", "--out", str(out)])
    assert result.exit_code == 1, result.output
    expected = torch_home / "hub" / "checkpoints" / RESNET18_FILE
    assert "Error: pretrained weights for backbone 'resnet18'" in result.output and str(expected) in result.output
    assert "Traceback" not in result.output and not out.exists()
    assert network == []
