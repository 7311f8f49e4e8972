"""The zero-shot tower's class bridge against a loop over its definition: each class's cosine is its best text's, the
top classes' rows weighed by the softmax of their cosines over the temperature."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from retrieval.text.tower import ClassBridge


def reference(sentence: np.ndarray, features: np.ndarray, owner: list[int], rows: np.ndarray, temperature: float,
              top: int) -> np.ndarray:
    """One sentence's bridge vector, float64, by loops."""
    unit = sentence / math.sqrt(sum(x * x for x in sentence))
    cosine = {}
    for text, cls in zip(features, owner, strict=True):
        value = sum(a * b for a, b in zip(unit, text / math.sqrt(sum(x * x for x in text)), strict=True))
        cosine[cls] = max(cosine.get(cls, -math.inf), value)
    best = sorted(cosine, key=lambda c: -cosine[c])[:top or len(cosine)]
    weights = [math.exp(cosine[c] / temperature) for c in best]
    total = sum(weights)
    unit_rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return sum(w / total * unit_rows[c] for w, c in zip(weights, best, strict=True))


@pytest.mark.parametrize(("temperature", "top"), [(0.1, 3), (0.05, 1), (1.0, None), (0.1, 5)])
def test_the_bridge_equals_a_loop_over_its_definition(temperature, top):
    rng = np.random.default_rng(0)
    owner = [0, 0, 1, 2, 2, 2, 3, 4]  # classes with one to three texts
    features, rows, sentences = rng.normal(size=(8, 6)), rng.normal(size=(5, 4)), rng.normal(size=(3, 6))
    bridge = ClassBridge.of_texts(torch.from_numpy(features), torch.tensor(owner), torch.from_numpy(rows),
                                  temperature, top).double()
    got = bridge(torch.from_numpy(sentences)).numpy()  # its buffers are float32, as exported
    for sentence, vector in zip(sentences, got, strict=True):
        np.testing.assert_allclose(vector, reference(sentence, features, owner, rows, temperature, top), atol=1e-6)


def test_a_class_without_a_text_or_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match="every class needs"):
        ClassBridge.of_texts(torch.randn(3, 4), torch.tensor([0, 0, 2]), torch.randn(3, 5))
    with pytest.raises(ValueError, match="temperature > 0"):
        ClassBridge.of_texts(torch.randn(3, 4), torch.tensor([0, 1, 2]), torch.randn(3, 5), temperature=0.0)
    with pytest.raises(ValueError, match="top"):
        ClassBridge.of_texts(torch.randn(3, 4), torch.tensor([0, 1, 2]), torch.randn(3, 5), top=4)


def test_a_zero_sentence_gives_a_finite_vector():
    bridge = ClassBridge.of_texts(torch.randn(4, 6), torch.tensor([0, 1, 2, 3]), torch.randn(4, 5), top=2)
    assert torch.isfinite(bridge(torch.zeros(2, 6))).all()


def test_a_bridge_over_every_class_exports_as_pytorch_computes_it_even_where_classes_tie(tmp_path):
    import onnxruntime as ort

    # two classes with the same texts tie for every sentence: a cut between them would pick one at random
    features = torch.randn(6, 8)
    features[3] = features[2]
    bridge = ClassBridge.of_texts(features, torch.tensor([0, 1, 2, 3, 4, 5]), torch.randn(6, 4), 0.1).eval()
    sentences = torch.randn(5, 8)
    torch.onnx.export(bridge, (sentences,), str(tmp_path / "bridge.onnx"), dynamo=False, input_names=["s"],
                      output_names=["v"], dynamic_axes={"s": {0: "b"}})
    onnx_out = ort.InferenceSession(str(tmp_path / "bridge.onnx")).run(None, {"s": sentences.numpy()})[0]
    np.testing.assert_allclose(onnx_out, bridge(sentences).detach().numpy(), atol=1e-5)
