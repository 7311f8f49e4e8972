"""An int8 export's memory is planned whole before anything is read: the calibration images, the quantizer's
calibration run, the verification images and the batches in flight. At a large input the batches, then the
verification images are lowered to fit, the plan saying so; beyond that it refuses with the numbers and the most
calibration images that fit. Arithmetic only: no model, no image."""

from __future__ import annotations

from dataclasses import replace

import pytest

from retrieval.errors import ParameterError
from retrieval.export.int8_export import (
    CALIBRATION_BATCH,
    INT8_MEMORY_BYTES,
    MIN_HELD_OUT,
    READ_BATCH,
    VERIFY_IMAGES,
    plan_memory,
)

MODEL_BYTES = 13_562_498  # EfficientNet-Lite0's export


def test_a_small_input_keeps_every_batch_and_verification_image():
    plan = plan_memory(224, MODEL_BYTES, 256)
    assert (plan.batch, plan.calibration_batch, plan.verify_images, plan.lowered) == \
        (READ_BATCH, CALIBRATION_BATCH, VERIFY_IMAGES, ())
    assert plan.total <= INT8_MEMORY_BYTES


@pytest.mark.parametrize("size", [512, 768, 1024])
def test_a_large_input_lowers_the_batches_then_the_verification_images_to_fit(size):
    plan = plan_memory(size, MODEL_BYTES, 16)
    assert plan.total <= INT8_MEMORY_BYTES
    assert plan.calibration_batch < CALIBRATION_BATCH and plan.batch < READ_BATCH
    assert f"calibration batch {CALIBRATION_BATCH} -> {plan.calibration_batch}" in plan.lowered
    if plan.verify_images < VERIFY_IMAGES:  # lowered only once the batches are at one image
        assert plan.batch == 1 and plan.verify_images >= MIN_HELD_OUT
        assert f"verification images {VERIFY_IMAGES} -> {plan.verify_images}" in plan.lowered
    assert plan.record()["lowered"] == list(plan.lowered) and plan.record()["planned_bytes"] == plan.total


def test_the_verification_images_are_counted_in_the_plan():
    """At 1024 px, 16 calibration images take 192 MiB, but 256 verification images 3 GiB: they are what is
    lowered, and the plan's total holds them."""
    plan = plan_memory(1024, MODEL_BYTES, 16)
    image = 3 * 1024**2 * 4
    assert plan.parts()["verification images"] == plan.verify_images * image
    assert MIN_HELD_OUT <= plan.verify_images < VERIFY_IMAGES
    assert replace(plan, verify_images=VERIFY_IMAGES).total > INT8_MEMORY_BYTES
    assert replace(plan, verify_images=plan.verify_images + 1).total > INT8_MEMORY_BYTES  # the most that fit


def test_a_plan_over_the_budget_is_refused_with_the_most_calibration_images_that_fit():
    with pytest.raises(ParameterError, match=r"64 images at 1024 px would hold .* GiB at once.*more than the 4.00 "
                                             r"GiB an int8 export plans for; give at most (\d+)") as refused:
        plan_memory(1024, MODEL_BYTES, 64)
    most = int(str(refused.value).rsplit("give at most ", 1)[1].split()[0])
    assert plan_memory(1024, MODEL_BYTES, most).total <= INT8_MEMORY_BYTES
    with pytest.raises(ParameterError):
        plan_memory(1024, MODEL_BYTES, most + 1)


def test_an_input_too_large_for_any_calibration_asks_for_a_smaller_export():
    with pytest.raises(ParameterError, match=r"even 16 images do not fit: quantize a model exported at a smaller "
                                             r"--image-size"):
        plan_memory(2048, MODEL_BYTES, 16)


def test_a_calibration_that_holds_every_batch_is_planned_for_all_of_them():
    """Percentile and entropy calibration keep every batch's activations until the end: 256 images at 224 px would
    hold tens of GiB, refused with the most that fit and MinMax named."""
    with pytest.raises(ParameterError, match=r"every batch held.*at most (\d+).*calibrate by MinMax") as refused:
        plan_memory(224, MODEL_BYTES, 256, every_batch=True)
    most = int(str(refused.value).rsplit("give at most ", 1)[1].split()[0])
    assert plan_memory(224, MODEL_BYTES, most, every_batch=True).total <= INT8_MEMORY_BYTES
    assert plan_memory(224, MODEL_BYTES, 256).total <= INT8_MEMORY_BYTES  # MinMax: one batch at a time
