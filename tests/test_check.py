"""jaxaccum.check on one device: a correct step passes; a gradient scaled wrong, a coupled loss
accumulated as if it were not, and a step fed one micro-batch's gradient are each named."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import mlp_params, mse_loss, random_batch, refuses
from test_coupled import clip_data, clip_loss, encode, raw_keys

import jaxaccum

PARAMS, BATCH = mlp_params(jax.random.key(0)), random_batch(jax.random.key(1), 64)


def test_a_correct_step_passes_with_its_numbers():
    report = jaxaccum.check(mse_loss, PARAMS, BATCH, num_microbatches=8)
    assert report.ok and not report.problems
    assert report.error <= report.bound and abs(report.scale - 1) < 1e-5
    assert report.reductions == report.reductions_in_loops == 0  # one device


@pytest.mark.parametrize("factor", [2, 8, 0.5, 1.0005, 0.9995, -1])
def test_a_gradient_scaled_wrong_is_named_with_its_factor(factor):
    """Any factor other than 1, however close to it (the error is still far past float32's),
    or negative."""
    k = 8
    scaled = jaxaccum.value_and_grad(lambda p, b: factor * mse_loss(p, b), num_microbatches=k)
    report = jaxaccum.check(mse_loss, PARAMS, BATCH, step=scaled, num_microbatches=k)
    assert not report.ok
    assert abs(report.scale - factor) < 1e-4 * abs(factor)
    assert f"the gradient is {factor:.6g} times the full batch's" in report.problems[0]


def test_the_error_is_relative_to_the_largest_magnitude_of_the_reference():
    """On a loss whose values and gradients are all far below 1: a step off by a factor 2
    has the error 1 (``|2 g - g| / max |g|``), whatever the magnitudes."""
    def tiny(p, b):
        return 1e-4 * mse_loss(p, b)

    doubled = jaxaccum.value_and_grad(lambda p, b: 2 * tiny(p, b), num_microbatches=8)
    report = jaxaccum.check(tiny, PARAMS, BATCH, step=doubled, num_microbatches=8)
    assert report.error == pytest.approx(1.0, rel=1e-4)
    assert report.full_batch_error < 1e-5  # float32 rounding, relative as well


def test_the_bound_is_ten_full_batch_errors_plus_sixteen_ulps():
    """The documented bound, from the report's own numbers."""
    report = jaxaccum.check(mse_loss, PARAMS, BATCH, num_microbatches=8)
    eps32 = float(np.finfo(np.float32).eps)
    assert report.bound == pytest.approx(10 * report.full_batch_error + 16 * eps32, rel=1e-12)
    assert report.full_batch_error > 0  # float32 rounds: the bound is not the floor alone


def test_a_wrong_loss_with_the_right_gradient_is_not_called_a_scaled_gradient():
    """The gradient is the full batch's (scale 1); only the reported loss is off."""
    right = jaxaccum.value_and_grad(mse_loss, num_microbatches=8)

    def wrong_loss(p, b):
        value, grads = right(p, b)
        return value * 1.01, grads

    report = jaxaccum.check(mse_loss, PARAMS, BATCH, step=wrong_loss, num_microbatches=8)
    assert not report.ok and abs(report.scale - 1) < 1e-5
    assert "the loss and gradient differ from the full batch's" in report.problems[0]
    assert "times the full batch's" not in report.problems[0]


def test_only_the_last_microbatch_reaching_the_optimizer_is_caught():
    def last_only(p, b):
        micro = jax.tree.map(lambda a: a[7::8], b)
        return jax.value_and_grad(mse_loss)(p, micro)

    report = jaxaccum.check(mse_loss, PARAMS, BATCH, step=last_only, num_microbatches=8)
    assert not report.ok and "does not compute the full-batch gradient" in report.problems[0]


def test_a_coupled_loss_through_plain_accumulation_is_caught_and_the_fix_passes():
    params, batch = clip_data()

    def full(p, b):
        return clip_loss(p, encode(p, raw_keys(b)), b)

    plain = jaxaccum.check(full, params, batch, num_microbatches=4)
    assert not plain.ok and "coupled_value_and_grad" in plain.problems[0]
    coupled = jaxaccum.coupled_value_and_grad(lambda p, b: encode(p, raw_keys(b)), clip_loss,
                                              num_microbatches=4)
    assert jaxaccum.check(full, params, batch, step=coupled, num_microbatches=4).ok


def test_check_names_itself_in_option_errors():
    with refuses(TypeError, match="jaxaccum.check: unknown option"):
        jaxaccum.check(mse_loss, PARAMS, BATCH, k=4)
