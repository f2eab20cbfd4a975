"""Convolutions inside the accumulation loop run in XLA:CPU's fast (canonical) layout, exactly.

XLA:CPU canonicalises convolution layouts only in the entry computation; jaxaccum rewrites the
micro-step's convolutions itself (``jaxaccum._xla.conv_layout``). These tests pin that (1) the
rewrite computes exactly the same convolution for every dimension order, stride, dilation and
grouping (integer-valued data: every sum is exact in float32, so equality is the criterion), (2)
a compiled accumulation step has only canonical convolutions in its loop, (3) a model with
convolutions still equals its full batch within float32 rounding, (4) a function without
convolutions is traced unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_within_rounding, to_float64

import jaxaccum
from jaxaccum._xla import conv_layout as _conv_layout
from jaxaccum._xla import hlo as _hlo

CANONICAL = {3: "b0f_0io->b0f", 4: "b01f_01io->b01f", 5: "b012f_012io->b012f"}


def integer_valued(key, shape):
    """Small integers as float32: products and sums of a few thousand stay exact."""
    return jax.random.randint(key, shape, -3, 4).astype(jnp.float32)


CASES = [
    # (lhs shape, rhs shape, dimension_numbers, strides, padding, lhs dil, rhs dil, groups)
    ((2, 9, 9, 3), (3, 3, 3, 4), ("NHWC", "HWIO", "NHWC"), (1, 1), "SAME", None, None, 1),
    ((2, 3, 9, 9), (4, 3, 3, 3), ("NCHW", "OIHW", "NCHW"), (2, 1), "VALID", None, None, 1),
    ((2, 9, 9, 4), (3, 3, 2, 6), ("NHWC", "HWIO", "NCHW"), (1, 2), "SAME", None, (2, 1), 2),
    (
        (9, 2, 9, 3),
        (3, 4, 3, 3),
        ("HNWC", "HOWI", "WHNC"),
        (1, 1),
        [(1, 2), (0, 1)],
        (2, 1),
        None,
        1,
    ),
    ((2, 11, 3), (3, 3, 5), ("NWC", "WIO", "NCW"), (2,), "SAME", None, None, 1),
    (
        (2, 3, 5, 5, 5),
        (4, 3, 2, 2, 2),
        ("NCDHW", "OIDHW", "NDHWC"),
        (1, 1, 1),
        "VALID",
        None,
        None,
        1,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[2][0] + "-" + c[2][2] for c in CASES])
def test_rewrite_is_exact_forward_and_gradients(case):
    lhs_shape, rhs_shape, dn, strides, padding, lhs_dil, rhs_dil, groups = case
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x, w = integer_valued(k1, lhs_shape), integer_valued(k2, rhs_shape)

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x,
            w,
            strides,
            padding,
            lhs_dilation=lhs_dil,
            rhs_dilation=rhs_dil,
            dimension_numbers=dn,
            feature_group_count=groups,
        )

    cotangent = integer_valued(k3, jax.eval_shape(conv, x, w).shape)

    def forward_and_vjp(x, w):
        out, vjp = jax.vjp(conv, x, w)
        return out, vjp(cotangent)

    expected = jax.jit(forward_and_vjp)(x, w)
    rewritten = _conv_layout.canonical_convs(forward_and_vjp)
    assert _conv_layout.has_noncanonical_conv(jax.make_jaxpr(forward_and_vjp)(x, w))
    assert not _conv_layout.has_noncanonical_conv(
        jax.make_jaxpr(functools.partial(_conv_layout.rewrite_jaxpr, forward_and_vjp))(x, w)
    )
    actual = jax.jit(rewritten)(x, w)
    jax.tree.map(np.testing.assert_array_equal, actual, expected)
    if groups == 1 and lhs_dil is None:
        # XLA's own passes turn grouped convolutions' kernel gradients into a 5-D convolution
        # and fold a transposed convolution's kernel reversal into another form: those two are
        # left to XLA (see _conv_layout's limits).
        hlo = jax.jit(rewritten).lower(x, w).compile().as_text()
        labels = {label for label, _ in _hlo.convolutions(hlo)}
        assert labels == {CANONICAL[len(lhs_shape)]}, labels


def cnn_params(key):
    k = jax.random.split(key, 3)
    return {
        "conv1": 0.5 * jax.random.normal(k[0], (3, 3, 1, 4)),
        "conv2": 0.3 * jax.random.normal(k[1], (3, 3, 4, 8)),
        "dense": 0.3 * jax.random.normal(k[2], (8, 3)),
    }


def cnn_loss(params, batch):
    x, y = batch
    h = jax.nn.relu(
        jax.lax.conv_general_dilated(
            x, params["conv1"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    )
    h = jax.nn.relu(
        jax.lax.conv_general_dilated(
            h, params["conv2"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    )
    return jnp.mean((h.mean((1, 2)) @ params["dense"] - y) ** 2)


PARAMS = cnn_params(jax.random.key(1))
BATCH = (
    jax.random.normal(jax.random.key(2), (32, 8, 8, 1)),
    jax.random.normal(jax.random.key(3), (32, 3)),
)


@pytest.mark.parametrize("k", [2, 8])
def test_accumulation_loop_runs_only_canonical_convolutions(k):
    step = jaxaccum.train_step(cnn_loss, optax.adam(1e-3), num_microbatches=k)
    opt_state = optax.adam(1e-3).init(PARAMS)
    hlo = step.lower(PARAMS, opt_state, BATCH).compile().as_text()
    in_loop = [label for label, loop in _hlo.convolutions(hlo) if loop]
    # forward x2, input gradient x1 (the first layer's is not needed), kernel gradient x2
    assert len(in_loop) == 5, in_loop
    assert set(in_loop) == {CANONICAL[4]}, in_loop


@pytest.mark.parametrize("k", [1, 2, 8, 32])
def test_cnn_equals_full_batch_within_rounding(k):
    full32 = jax.jit(jax.value_and_grad(cnn_loss))(PARAMS, BATCH)
    with jax.enable_x64(True):
        ref64 = jax.jit(jax.value_and_grad(cnn_loss))(to_float64(PARAMS), to_float64(BATCH))
        ref64 = jax.tree.map(lambda a: np.asarray(a, np.float64), ref64)
    actual = jax.jit(jaxaccum.value_and_grad(cnn_loss, num_microbatches=k))(PARAMS, BATCH)
    assert_within_rounding(actual, full32, ref64)


def test_scan_and_remat_inside_the_loss_are_rewritten():
    def layers(params, batch):
        x, y = batch
        w = jnp.stack([params["conv2"][:, :, :4, :4]] * 2)

        @jax.checkpoint
        def layer(h, wi):
            return jax.nn.relu(
                jax.lax.conv_general_dilated(
                    h, wi, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
            ), None

        h = jnp.tile(x, (1, 1, 1, 4))
        h, _ = jax.lax.scan(layer, h, w)
        return jnp.mean((h.mean((1, 2)) @ params["dense"][:4] - y) ** 2)

    hlo = (
        jax.jit(jaxaccum.value_and_grad(layers, num_microbatches=4))
        .lower(PARAMS, BATCH)
        .compile()
        .as_text()
    )
    labels = [label for label, loop in _hlo.convolutions(hlo) if loop]
    assert labels and set(labels) == {CANONICAL[4]}, labels
    full32 = jax.jit(jax.value_and_grad(layers))(PARAMS, BATCH)
    with jax.enable_x64(True):
        ref64 = jax.tree.map(
            lambda a: np.asarray(a, np.float64),
            jax.jit(jax.value_and_grad(layers))(to_float64(PARAMS), to_float64(BATCH)),
        )
    actual = jax.jit(jaxaccum.value_and_grad(layers, num_microbatches=4))(PARAMS, BATCH)
    assert_within_rounding(actual, full32, ref64)


def test_function_without_convolutions_is_traced_unchanged():
    def mlp(params, x):
        return jnp.tanh(x @ params["w"]).sum(), {"n": 3}

    params = {"w": jnp.ones((4, 2))}
    x = jnp.ones((5, 4))
    assert str(jax.make_jaxpr(_conv_layout.canonical_convs(mlp))(params, x)) == str(
        jax.make_jaxpr(mlp)(params, x)
    )
    assert _conv_layout.canonical_convs(mlp)(params, x)[1] == {"n": 3}


def test_convolutions_under_lax_cond_are_rewritten():
    """A convolution inside a ``lax.cond`` branch of the loss (a cond's branches are jaxprs in
    its params, as a scan's body is) is canonical in the compiled loop too."""

    def branchy(params, batch):
        x, y = batch
        w = params["conv2"][:, :, :4, :4]

        def conv(h):
            return jax.nn.relu(jax.lax.conv_general_dilated(
                h, w, (1, 1), "SAME", dimension_numbers=("NCHW", "HWIO", "NCHW")))

        h = jnp.tile(jnp.moveaxis(x, -1, 1), (1, 4, 1, 1))
        h = jax.lax.cond(jnp.sum(y) > -1e30, conv, lambda h: h * 2.0, h)
        return jnp.mean((h.mean((2, 3)) @ params["dense"][:4] - y) ** 2)

    hlo = jax.jit(jaxaccum.value_and_grad(branchy, num_microbatches=4)).lower(
        PARAMS, BATCH).compile().as_text()
    labels = [label for label, loop in _hlo.convolutions(hlo) if loop]
    assert labels and set(labels) == {CANONICAL[4]}, labels


def test_conv_rewrite_puts_batch_and_features_back_when_they_have_one_size():
    """NCHW output with as many examples as features (4 and 4): an output transposed back with
    batch and feature axes swapped would have the right shape and the wrong values."""
    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.randint(k1, (4, 3, 6, 6), -3, 4).astype(jnp.float32)
    w = jax.random.randint(k2, (4, 3, 3, 3), -3, 4).astype(jnp.float32)

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "VALID",
                                            dimension_numbers=("NCHW", "OIHW", "NCHW"))

    expected = jax.jit(conv)(x, w)
    assert expected.shape == (4, 4, 4, 4)
    np.testing.assert_array_equal(jax.jit(_conv_layout.canonical_convs(conv))(x, w), expected)


def test_convolutions_inside_nested_jits_are_rewritten():
    """A layer jitted inside a jitted block (as ``nnx.jit`` or ``eqx.filter_jit`` layers nest):
    the loop still runs only canonical convolutions, and the result equals the full batch."""
    def conv(x, w, stride):
        return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    @jax.jit
    def block(x, params):
        h = jax.nn.relu(jax.jit(conv, static_argnums=2)(x, params["conv1"], 1))
        return jax.nn.relu(jax.jit(conv, static_argnums=2)(h, params["conv2"], 2))

    def nested(params, batch):
        x, y = batch
        return jnp.mean((jax.jit(block)(x, params).mean((1, 2)) @ params["dense"] - y) ** 2)

    step = jaxaccum.train_step(nested, optax.adam(1e-3), num_microbatches=4)
    hlo = step.lower(PARAMS, optax.adam(1e-3).init(PARAMS), BATCH).compile().as_text()
    in_loop = [label for label, loop in _hlo.convolutions(hlo) if loop]
    assert in_loop and set(in_loop) == {CANONICAL[4]}, in_loop
    full32 = jax.jit(jax.value_and_grad(nested))(PARAMS, BATCH)
    with jax.enable_x64(True):
        ref64 = jax.jit(jax.value_and_grad(nested))(to_float64(PARAMS), to_float64(BATCH))
        ref64 = jax.tree.map(lambda a: np.asarray(a, np.float64), ref64)
    actual = jax.jit(jaxaccum.value_and_grad(nested, num_microbatches=4))(PARAMS, BATCH)
    assert_within_rounding(actual, full32, ref64)
