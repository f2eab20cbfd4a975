"""Promises the reference model (``tests/reference.py``) does not reach, each with an
assertion on real numbers: options that are no accumulation semantics (Equinox fields, outer
gradients, keywords, carried scalars, the planner's total, the convolution rewrite, the NNX
optimizer's ``wrt``), bfloat16 aux sums over many micro-batches, and on 8 host devices
(``tests/multidevice/mesh_promises.py``) carried state refused on Auto axes, ZeRO-3's gather in
the loop, the micro-batch count of a data x model mesh, an Explicit skip decided by one
device's partial gradient, an Explicit FSDP reduce-scatter. The weighted means, skips, aux
reductions and NaN rules on one device and on meshes are the reference model's
(``test_reference.py``, ``test_reference_mesh.py``).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_apply, mlp_params, random_batch, refuses
from flax import nnx
from launcher import run_program

import jaxaccum
import jaxaccum.nnx

PARAMS = mlp_params(jax.random.key(0))
BATCH = random_batch(jax.random.key(1), 64)

@pytest.fixture(scope="module")
def mesh_results():
    return run_program("mesh_promises", devices=8, timeout=900)


# --- meshes -------------------------------------------------------------------------------------


def test_auto_mesh_refuses_carried_state(mesh_results):
    error = mesh_results["auto_carry_error"]
    assert error is not None and error.startswith("ValueError: jaxaccum.value_and_grad: "
                                                  "carry_argnums=(2,)")
    assert "use a mesh with Explicit axes" in error


def test_zero3_gathers_every_microbatch_inside_the_loop(mesh_results):
    r = mesh_results["zero3"]
    assert r["microbatch"]["counts"]["all-gather in loops"] >= 2, r  # w and v, per micro-batch
    assert r["step"]["counts"]["all-gather in loops"] == 0, r  # gathered once per step
    assert r["microbatch"]["temp"] < r["step"]["temp"], r
    assert r["microbatch"]["grads_rel"] <= 1e-5 and r["step"]["grads_rel"] <= 1e-5


def test_reported_microbatches_count_only_the_data_axes(mesh_results):
    r = mesh_results["data_model"]
    assert r["num_microbatches"] == 2 * 4  # k per device x 4 data devices (model axis: 2)
    assert r["grads_rel"] <= 1e-5


def test_explicit_mesh_skips_a_microbatch_whose_gradient_alone_is_nonfinite(mesh_results):
    """The loss is finite, one device's partial gradient is NaN: every device must agree to
    skip (the flag is reduced over the devices), and only that micro-batch is left out."""
    r = mesh_results["explicit_skip_gradient"]
    assert r["skipped"] == 1 and r["weight"] == 1.0 and r["loss_finite"]
    assert r["grads_rel"] <= 1e-5


def test_explicit_fsdp_gradient_is_reduce_scattered(mesh_results):
    r = mesh_results["explicit_fsdp"]
    assert r["counts"]["reduce-scatter"] >= 2, r["counts"]  # w and v
    assert r["grads_rel"] <= 1e-5


# --- aux reductions on one device ---------------------------------------------------------------


def test_bfloat16_aux_sum_is_accumulated_in_float32():
    """512 micro-batches each report 1.0 in bfloat16: a bfloat16 sum stalls at 256."""

    def fn(w, x):
        return jnp.mean(w * x), jnp.ones((), jnp.bfloat16)

    (_, total), _ = jax.jit(jaxaccum.value_and_grad(fn, num_microbatches=512, has_aux="sum"))(
        jnp.ones(()), jnp.ones(512))
    assert float(total) == 512.0


# --- options and front ends ---------------------------------------------------------------------


def test_weighted_and_skip_nonfinite_must_be_bools():
    for name in ("weighted", "skip_nonfinite"):
        with refuses(TypeError, match=f"jaxaccum.value_and_grad: {name} must be a bool"):
            jaxaccum.value_and_grad(lambda w, x: jnp.mean(w * x), num_microbatches=2,
                                    **{name: "no"})


class Scaled(eqx.Module):
    """An Equinox module with a plain float hyperparameter (a leaf, not an array)."""

    weight: jax.Array
    scale: float

    def __call__(self, x):
        return self.scale * jnp.tanh(x @ self.weight)


def test_equinox_float_fields_are_not_differentiated():
    """As ``eqx.filter_value_and_grad``: only inexact arrays get gradients; the float field's
    gradient is None, so an update leaves it exactly as it was."""
    model = Scaled(jax.random.normal(jax.random.key(0), (8, 4)) / 3, 2.0)
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))

    def loss(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    ref_loss, ref_grads = eqx.filter_value_and_grad(loss)(model, (x, y))
    value, grads = eqx.filter_jit(jaxaccum.value_and_grad(loss, num_microbatches=4))(
        model, (x, y))
    assert float(value) == pytest.approx(float(ref_loss), rel=1e-6)
    assert grads.scale is None and ref_grads.scale is None
    np.testing.assert_allclose(grads.weight, ref_grads.weight, rtol=1e-5, atol=1e-7)
    updated = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
    assert updated.scale == 2.0


def test_outer_gradient_of_the_loss_treats_weights_as_constants():
    """The returned value and gradient agree: differentiating the accumulated loss (as a
    hypergradient or a check would) gives the returned gradient, weights held constant, even
    when the weight depends on the parameters (a soft count)."""

    def soft(params, batch):
        x, y = batch
        w = jnp.sum(jax.nn.sigmoid(x @ params["layer0"]["w"][:, 0]))
        return jnp.mean((mlp_apply(params, x) - y) ** 2), w

    fn = jaxaccum.value_and_grad(soft, num_microbatches=4, weighted=True)
    _, grads = jax.jit(fn)(PARAMS, BATCH)
    outer = jax.jit(jax.grad(lambda p: fn(p, BATCH)[0]))(PARAMS)
    for a, b in zip(jax.tree.leaves(outer), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_keyword_arguments_with_defaults_reach_every_microbatch():
    """A keyword with a default (a loss scale) is passed to every micro-batch, not dropped
    (which would silently use the default)."""

    def loss(params, batch, scale=1.0):
        x, y = batch
        return scale * jnp.mean((mlp_apply(params, x) - y) ** 2)

    expected = jax.value_and_grad(loss)(PARAMS, BATCH, scale=3.0)
    value, grads = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4))(
        PARAMS, BATCH, scale=3.0)
    assert float(value) == pytest.approx(float(expected[0]), rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_multi_steps_passes_optional_extra_args_to_the_inner_transform():
    """An inner transform whose extra argument has a default (``scale=1.0``) gets the value
    given on the emitting call, not its default."""

    def update(updates, state, params=None, *, scale=1.0, **extra):
        return jax.tree.map(lambda u: scale * u, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    opt = jaxaccum.multi_steps(inner, 2)
    state = opt.init(jnp.zeros(3))
    g1, g2 = jnp.array([1.0, 2.0, 3.0]), jnp.array([3.0, 2.0, 1.0])
    _, state = jax.jit(opt.update)(g1, state, jnp.zeros(3), scale=3.0)
    out, state = jax.jit(opt.update)(g2, state, jnp.zeros(3), scale=3.0)
    np.testing.assert_allclose(out, [6.0, 6.0, 6.0])  # 3 x the mean (2, 2, 2)


def test_two_carried_scalars_in_reversed_order_are_not_swapped():
    """carry_argnums=(3, 2) with two carried values of the same structure: a swap would not
    fail loudly (as it does with different structures), it would compute with the wrong one."""

    def loss(params, batch, scale, shift):
        x, y = batch
        value = jnp.mean((mlp_apply(params, x) - y) ** 2) * scale + shift
        return value, (shift + 1.0, scale * 2.0)  # new values for 3 (shift), then 2 (scale)

    fn = jaxaccum.value_and_grad(loss, num_microbatches=4, carry_argnums=(3, 2))
    (value, (shift, scale)), _ = jax.jit(fn)(PARAMS, BATCH, jnp.asarray(3.0), jnp.asarray(0.5))
    assert float(scale) == 48.0 and float(shift) == 4.5
    micro = [jax.tree.map(lambda a, i=i: a[i::4], BATCH) for i in range(4)]
    expected = sum(
        jnp.mean((mlp_apply(PARAMS, m[0]) - m[1]) ** 2) * 3.0 * 2.0**i + 0.5 + i
        for i, m in enumerate(micro)
    ) / 4
    assert float(value) == pytest.approx(float(expected), rel=1e-6)


def test_plan_total_counts_donated_outputs_once():
    """With an optimizer the step donates params and state: outputs that reuse their buffers
    are counted once, so a budget of exactly that total fits."""

    params = {"w1": jnp.zeros((64, 256)), "w2": jnp.zeros((256, 1))}
    data = jax.ShapeDtypeStruct((512, 64), jnp.float32)

    def loss(p, x):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

    opt = optax.adam(1e-3)
    e = jaxaccum.plan_microbatches(loss, params, data, memory_budget=2**40, candidates=[4],
                                   optimizer=opt).estimates[4]
    assert e.alias_bytes >= 3 * 4 * (64 * 256 + 256)  # params and both Adam moments
    assert e.total_bytes == e.argument_bytes + e.output_bytes - e.alias_bytes + e.temp_bytes
    plan = jaxaccum.plan_microbatches(loss, params, data, memory_budget=e.total_bytes,
                                      candidates=[4], optimizer=opt)
    assert plan.num_microbatches == 4


def test_conv_rewrite_puts_batch_and_features_back_when_they_have_one_size():
    """NCHW output with as many examples as features (4 and 4): an output transposed back with
    batch and feature axes swapped would have the right shape and the wrong values."""
    from jaxaccum import _conv_layout

    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.randint(k1, (4, 3, 6, 6), -3, 4).astype(jnp.float32)
    w = jax.random.randint(k2, (4, 3, 3, 3), -3, 4).astype(jnp.float32)

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "VALID",
                                            dimension_numbers=("NCHW", "OIHW", "NCHW"))

    expected = jax.jit(conv)(x, w)
    assert expected.shape == (4, 4, 4, 4)
    np.testing.assert_array_equal(jax.jit(_conv_layout.canonical_convs(conv))(x, w), expected)


class Adapted(nnx.Module):
    """A frozen kernel and a low-rank adapter held in a Variable type of its own (LoRA-style):
    an optimizer with ``wrt=Adapter`` trains only the adapter."""

    def __init__(self):
        self.kernel = nnx.Param(jnp.ones((8, 4)) / 8)
        self.down = Adapter(jnp.ones((8, 2)) / 4)
        self.up = Adapter(jnp.ones((2, 4)) / 2)

    def __call__(self, x):
        return x @ self.kernel + (x @ self.down) @ self.up


class Adapter(nnx.Variable):
    pass


def test_nnx_step_trains_the_variables_the_optimizer_holds_even_if_not_params():
    x, y = random_batch(jax.random.key(1), 16, sizes=(8, 4))

    def loss_fn(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    model = Adapted()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=Adapter)
    jaxaccum.nnx.train_step(loss_fn, num_microbatches=4)(model, optimizer, (x, y))
    ref = Adapted()
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, Adapter))(ref, (x, y))
    np.testing.assert_array_equal(model.kernel[...], jnp.ones((8, 4)) / 8)  # frozen
    np.testing.assert_allclose(model.down[...], ref.down[...] - 0.1 * grads["down"][...],
                               rtol=1e-5)
    np.testing.assert_allclose(model.up[...], ref.up[...] - 0.1 * grads["up"][...], rtol=1e-5)
