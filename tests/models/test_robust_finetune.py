"""Robust fine-tuning maths: WiSE-FT, L2-SP, feature distillation, layer-wise lr decay, weight EMA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from retrieval.losses.regularizers import L2SPPenalty, feature_distillation
from retrieval.models.backbones import BACKBONES, create_backbone
from retrieval.models.ema import WeightEMA
from retrieval.models.layer_decay import backbone_layers, layerwise_param_groups
from retrieval.models.weight_space import interpolate_weights

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


# --- WiSE-FT --------------------------------------------------------------------------------------------------

def two_states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    a, b = mlp(0), mlp(1)
    b(torch.randn(8, 4))  # training mode: b's BatchNorm statistics and num_batches_tracked move
    return a.state_dict(), b.state_dict()


def test_interpolation_matches_formula_in_float64_loop():
    start, fine = two_states()
    alpha = 0.3
    out = interpolate_weights(start, fine, alpha)
    assert list(out) == list(fine)
    for key, f in fine.items():
        if not torch.is_floating_point(f):
            assert torch.equal(out[key], f)
            continue
        s64, f64 = start[key].double().flatten(), f.double().flatten()
        ref = torch.tensor([(1 - alpha) * s64[i].item() + alpha * f64[i].item() for i in range(s64.numel())],
                           dtype=torch.float64).view(f.shape)
        torch.testing.assert_close(out[key].double(), ref, rtol=1e-6, atol=1e-7)
        assert out[key].dtype == f.dtype


def test_interpolation_ends_are_bitwise_exact():
    start, fine = two_states()
    at0, at1 = interpolate_weights(start, fine, 0.0), interpolate_weights(start, fine, 1.0)
    for key in fine:
        expected0 = start[key] if torch.is_floating_point(fine[key]) else fine[key]
        assert torch.equal(at0[key], expected0), key
        assert torch.equal(at1[key], fine[key]), key
    assert torch.equal(at0["1.num_batches_tracked"], fine["1.num_batches_tracked"])
    assert not torch.equal(start["1.num_batches_tracked"], fine["1.num_batches_tracked"])


def test_interpolation_returns_new_tensors():
    start, fine = two_states()
    for alpha in (0.0, 0.5, 1.0):
        out = interpolate_weights(start, fine, alpha)
        for key, value in out.items():
            assert value.data_ptr() not in (fine[key].data_ptr(), start[key].data_ptr()), key
    out = interpolate_weights(start, fine, 1.0)
    before = fine["0.weight"].clone()
    out["0.weight"].add_(1.0)
    out["1.num_batches_tracked"].add_(1)
    assert torch.equal(fine["0.weight"], before)


def test_interpolation_keep_finetuned_and_dtype_of_finetuned():
    start, fine = two_states()
    start["3.weight"] = torch.zeros(2, 6)  # another head size: its start value is irrelevant when kept
    del start["3.bias"]
    fine64 = {k: (v.to(torch.float64) if torch.is_floating_point(v) else v) for k, v in fine.items()}
    out = interpolate_weights(start, fine64, 0.5, keep_finetuned=lambda key: key.startswith("3."))
    assert torch.equal(out["3.weight"], fine64["3.weight"]) and torch.equal(out["3.bias"], fine64["3.bias"])
    assert out["0.weight"].dtype == torch.float64
    torch.testing.assert_close(out["0.weight"], 0.5 * start["0.weight"].double() + 0.5 * fine64["0.weight"])


def test_interpolation_refuses_bad_inputs():
    start, fine = two_states()
    for alpha in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            interpolate_weights(start, fine, alpha)
    extra = dict(start, extra=torch.zeros(1))
    with pytest.raises(ValueError, match="extra"):
        interpolate_weights(extra, fine, 0.5)
    missing = {k: v for k, v in start.items() if k != "0.bias"}
    with pytest.raises(ValueError, match="0.bias"):
        interpolate_weights(missing, fine, 0.5)
    wrong = dict(start, **{"0.weight": torch.zeros(6, 5)})
    with pytest.raises(ValueError, match=r"0\.weight: \(6, 5\) vs \(6, 4\)"):
        interpolate_weights(wrong, fine, 0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_interpolation_follows_finetuned_device(device):
    start, fine = two_states()
    fine = {k: v.to(device) for k, v in fine.items()}
    out = interpolate_weights(start, fine, 0.25)
    assert all(v.device == fine[k].device for k, v in out.items())
    model = mlp()
    model.load_state_dict(out)  # a usable state dict


# --- L2-SP ----------------------------------------------------------------------------------------------------

def l2sp_reference(named: list[tuple[str, nn.Parameter]], anchors: dict[str, torch.Tensor], weight: float) -> float:
    total = 0.0
    for name, p in named:
        w, w0 = p.detach().double().flatten().tolist(), anchors[name].double().flatten().tolist()
        total += sum((a - b) ** 2 for a, b in zip(w, w0, strict=True))
    return weight / 2 * total


@pytest.mark.parametrize("device", DEVICES)
def test_l2sp_zero_at_start_then_matches_loop_and_gradient_points_home(device):
    model = mlp().to(device)
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("3.")]  # the head is not anchored
    anchors = {n: p.detach().clone() for n, p in named}
    penalty = L2SPPenalty(named, weight=0.7)
    value = penalty()
    assert value.dtype == torch.float32 and value.ndim == 0 and value.item() == 0.0
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    value = penalty()
    assert value.item() == pytest.approx(l2sp_reference(named, anchors, 0.7), rel=1e-5)
    value.backward()
    for name, p in named:
        torch.testing.assert_close(p.grad, 0.7 * (p.detach() - anchors[name]))
    assert model[3].weight.grad is None  # not anchored, not touched


def test_l2sp_anchor_is_a_copy_and_survives_state_dict_round_trip():
    model = mlp()
    penalty = L2SPPenalty(model.named_parameters(), weight=1.0)
    assert all("." not in name for name in penalty.state_dict())
    assert list(penalty.parameters()) == []
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the anchor is a detached copy: moving the weights moves the penalty
    drifted = penalty().item()
    assert drifted == pytest.approx(0.5 * model[0].weight.numel(), rel=1e-6)
    state = penalty.state_dict()
    # Resume: a new penalty anchors at the current (drifted) weights until the saved anchor is loaded.
    resumed = L2SPPenalty(model.named_parameters(), weight=1.0)
    assert resumed().item() == 0.0
    resumed.load_state_dict(state)
    assert resumed().item() == drifted


def test_l2sp_refusals_and_degenerate_inputs():
    p = nn.Parameter(torch.randn(3, 2))
    with pytest.raises(ValueError):
        L2SPPenalty([("a.b", p), ("a__b", p)], weight=1.0)
    with pytest.raises(ValueError):
        L2SPPenalty([("w", p)], weight=-1.0)
    assert L2SPPenalty([], weight=1.0)().item() == 0.0


# --- feature distillation -------------------------------------------------------------------------------------

def distill_reference(s: torch.Tensor, t: torch.Tensor) -> float:
    total = 0.0
    for i in range(s.shape[0]):
        a, b = s[i].double().tolist(), t[i].double().tolist()
        na, nb = max(sum(x * x for x in a) ** 0.5, 1e-12), max(sum(x * x for x in b) ** 0.5, 1e-12)
        total += sum((x / na - y / nb) ** 2 for x, y in zip(a, b, strict=True))
    return total / s.shape[0]


def test_distillation_matches_loop_and_cosine_form():
    torch.manual_seed(0)
    s, t = torch.randn(6, 5), torch.randn(6, 5)
    value = feature_distillation(s, t)
    assert value.item() == pytest.approx(distill_reference(s, t), rel=1e-5)
    cos = torch.nn.functional.cosine_similarity(s.double(), t.double(), dim=1)
    assert value.item() == pytest.approx((2 - 2 * cos).mean().item(), rel=1e-5)
    assert value.item() > 0
    assert feature_distillation(s, s.clone()).item() == 0.0
    assert feature_distillation(s, 3.0 * s).item() == pytest.approx(0.0, abs=1e-12)  # scale does not matter


def test_distillation_teacher_detached_and_gradcheck():
    torch.manual_seed(1)
    s = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    feature_distillation(s, t).backward()
    assert t.grad is None and s.grad is not None
    assert torch.autograd.gradcheck(lambda x: feature_distillation(x, t), (s,))


def test_distillation_degenerate_inputs_are_finite():
    s = torch.zeros(3, 4, requires_grad=True)
    t = torch.randn(3, 4)
    t[1] = 0.0
    value = feature_distillation(s, t)
    assert torch.isfinite(value) and value.item() == pytest.approx(distill_reference(s, t), rel=1e-6)
    value.backward()
    assert torch.isfinite(s.grad).all()
    empty = torch.zeros(0, 4, requires_grad=True)
    out = feature_distillation(empty, torch.zeros(0, 4))
    assert out.item() == 0.0
    out.backward()
    with pytest.raises(ValueError):
        feature_distillation(torch.zeros(2, 3), torch.zeros(2, 4))


# --- layer-wise lr decay --------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=BACKBONES.names())
def backbone(request) -> tuple[str, nn.Module]:
    torch.manual_seed(0)
    return request.param, create_backbone(request.param, pretrained=False).module


def test_layers_cover_every_trainable_parameter_once(backbone):
    name, module = backbone
    layers = backbone_layers(module)
    assert len(layers) >= 3 and all(layers)
    listed = [p for layer in layers for _, p in layer]
    assert len({id(p) for p in listed}) == len(listed)
    assert {id(p) for p in listed} == {id(p) for p in module.parameters() if p.requires_grad}
    named = dict(module.named_parameters())
    assert all(named[n] is p for layer in layers for n, p in layer)


def test_layers_follow_depth_for_known_backbones(backbone):
    name, module = backbone
    firsts = [{n.split(".")[0] if "." in n else n for n, _ in layer} for layer in backbone_layers(module)]
    if name.startswith("resnet"):
        assert firsts == [{"conv1", "bn1"}, {"layer1"}, {"layer2"}, {"layer3"}, {"layer4"}]
    if name == "efficientnet_lite0":
        names = [[n for n, _ in layer] for layer in backbone_layers(module)]
        assert {n.rsplit(".", 1)[0] for n in names[0]} == {"net._conv_stem", "net._bn0"}
        assert {n.rsplit(".", 1)[0] for n in names[-1]} == {"net._conv_head", "net._bn1"}
        assert len(names) == 2 + len(module.net._blocks)
        for i, layer in enumerate(names[1:-1]):
            assert all(n.startswith(f"net._blocks.{i}.") for n in layer)
    if name == "vit_b_16":
        layers = backbone_layers(module)
        assert {n for n, _ in layers[0]} >= {"class_token", "encoder.pos_embedding", "conv_proj.weight"}
        assert len(layers) == 2 + len(module.encoder.layers)


def test_frozen_parameters_are_left_out():
    module = create_backbone("resnet18", pretrained=False).module
    module.conv1.requires_grad_(False)
    module.layer1.requires_grad_(False)
    layers = backbone_layers(module)
    assert [n for n, _ in layers[0]] == ["bn1.weight", "bn1.bias"]
    assert len(layers) == 4  # layer1 had nothing trainable left


def test_generic_rule_without_block_list_uses_top_level_children():
    torch.manual_seed(0)
    module = nn.Module()
    module.a = nn.Linear(2, 2)
    module.relu = nn.ReLU()
    module.b = nn.Linear(2, 2)
    module.scale = nn.Parameter(torch.ones(1))
    layers = backbone_layers(module)
    assert [[n for n, _ in layer] for layer in layers] == [["scale"], ["a.weight", "a.bias"], ["b.weight", "b.bias"]]


@pytest.mark.parametrize("decay", [0.65, 1.0])
def test_param_groups_lrs_and_adamw(backbone, decay):
    name, module = backbone
    groups = layerwise_param_groups(module, 1e-3, decay, weight_decay=0.05)
    n = len(groups)
    assert groups[-1]["lr"] == 1e-3
    assert groups[0]["lr"] == pytest.approx(1e-3 * decay ** (n - 1), rel=1e-12)
    for i, group in enumerate(groups):
        assert group["name"] == f"backbone.layer{i}" and group["weight_decay"] == 0.05
        assert group["lr"] == pytest.approx(1e-3 * decay ** (n - 1 - i), rel=1e-12)
    if decay == 1.0:
        assert {g["lr"] for g in groups} == {1e-3}
    listed = [p for g in groups for p in g["params"]]
    assert len(listed) == len({id(p) for p in listed}) == sum(1 for p in module.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(groups)
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in groups]


def test_param_groups_refuse_bad_decay():
    module = mlp()
    for decay in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="decay"):
            layerwise_param_groups(module, 1e-3, decay)


# --- weight EMA -----------------------------------------------------------------------------------------------

def perturb(model: nn.Module, step: int) -> None:
    torch.manual_seed(100 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


def test_ema_matches_float64_loop_reference():
    model, decay = mlp().eval(), 0.9
    ema = WeightEMA(model, decay)
    reference: dict[str, list[float]] = {}
    for step in range(4):
        perturb(model, step)
        ema.update(model)
        for name, p in model.named_parameters():
            w = p.detach().double().flatten().tolist()
            if step == 0:  # AveragedModel's first update copies the model
                reference[name] = w
            else:
                reference[name] = [decay * e + (1 - decay) * x for e, x in zip(reference[name], w, strict=True)]
    assert ema.n_averaged == 4
    averaged = dict(ema.module.named_parameters())
    for name, values in reference.items():
        expected = torch.tensor(values, dtype=torch.float64).view(averaged[name].shape)
        torch.testing.assert_close(averaged[name].double(), expected, rtol=1e-5, atol=1e-6)
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_ema_resume_continues_identically():
    model_a, model_b = mlp().eval(), mlp().eval()
    straight = WeightEMA(model_a, 0.8)
    for step in range(3):
        perturb(model_a, step)
        straight.update(model_a)
    first = WeightEMA(model_b, 0.8)
    for step in range(2):
        perturb(model_b, step)
        first.update(model_b)
    state = first.state_dict()
    assert int(state["averaged"]["n_averaged"]) == 2
    resumed = WeightEMA(mlp(seed=5), 0.8)  # other weights: everything must come from the state dict
    resumed.load_state_dict(state)
    perturb(model_b, 2)
    resumed.update(model_b)
    for (name, a), (_, b) in zip(straight.module.state_dict().items(), resumed.module.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="decay"):
        WeightEMA(mlp(), 0.5).load_state_dict(state)


def test_ema_frozen_batchnorm_buffers_follow_model():
    model = mlp()
    model[1].running_mean.fill_(0.25)
    model[1].running_var.fill_(3.0)
    model.eval()  # frozen BatchNorm: its statistics never change
    ema = WeightEMA(model, 0.99)
    for step in range(3):
        perturb(model, step)
        model(torch.randn(5, 4))
        ema.update(model)
    assert torch.equal(ema.module[1].running_mean, model[1].running_mean)
    assert torch.equal(ema.module[1].running_var, model[1].running_var)
    # Training-mode statistics are averaged like weights (use_buffers=True), not copied.
    model.train()
    model(torch.randn(5, 4) + 10.0)
    ema.update(model)
    expected = 0.99 * torch.full((6,), 0.25) + 0.01 * model[1].running_mean
    torch.testing.assert_close(ema.module[1].running_mean, expected)


def test_ema_refuses_bad_decay():
    with pytest.raises(ValueError):
        WeightEMA(mlp(), 1.5)
