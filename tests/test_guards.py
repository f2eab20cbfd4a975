# ruff: noqa: E501  (the subprocess script below is kept as one readable block)
"""Guards written from mutation testing (``benchmarks/mutants.py``): each test kills a
realistic bug the rest of the suite let through, with an assertion on real numbers.

The mesh checks run in one subprocess with 8 host CPU devices (XLA_FLAGS must be set before
JAX starts) and are asserted on below: aux reductions and the skipped count across the devices
of an Auto mesh, the reported micro-batch count on a data x model mesh, ``skip_nonfinite`` and
negative weights on an Explicit mesh, ZeRO-3's per-micro-batch gather staying in the loop, and
an Explicit FSDP gradient reduce-scattered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mlp_apply, mlp_params, random_batch, refuses
from flax import nnx

import jaxaccum
import jaxaccum.nnx

PARAMS = mlp_params(jax.random.key(0))
BATCH = random_batch(jax.random.key(1), 64)

SCRIPT = r"""
import json, jax, jax.numpy as jnp, numpy as np, optax, jaxaccum
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxaccum import _hlo
jax.config.update("jax_default_matmul_precision", "highest")
rng = np.random.default_rng(0)
B = 64
PARAMS = {"w": rng.normal(size=(16, 32)).astype(np.float32) / 4,
          "v": rng.normal(size=(32, 8)).astype(np.float32) / 6}
X = rng.normal(size=(B, 16)).astype(np.float32)
Y = rng.normal(size=(B, 8)).astype(np.float32)
IDX = np.arange(B, dtype=np.float32)

def mse(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)

def loss(p, b):
    return mse(p, b[0], b[1])

def explicit_loss(p, b):  # a model written for Explicit axes: reduced parameters, unreduced grads
    h = jnp.tanh(jnp.einsum("bd,dh->bh", b[0], p["w"], out_sharding=P("data", None)))
    out = jnp.einsum("bh,ho->bo", h, p["v"], out_sharding=P("data", None))
    return jnp.mean((out - b[1]) ** 2)

def aux_loss(p, b):
    x, y, i = b
    return mse(p, x, y), {"last": jnp.max(i), "max": jnp.max(i), "mean": jnp.mean(i), "cat": i}

def root(p, x, y):  # a finite loss whose gradient is NaN at an all-zero example (sqrt at 0)
    return mse(p, x, y) + jnp.mean(jnp.sqrt(jnp.abs(x @ p["w"][:, 0])))

def explicit_root_loss(p, b):
    h = jnp.einsum("bd,dh->bh", b[0], p["w"], out_sharding=P("data", None))
    out = jnp.einsum("bh,ho->bo", jnp.tanh(h), p["v"], out_sharding=P("data", None))
    return jnp.mean((out - b[1]) ** 2) + jnp.mean(jnp.sqrt(jnp.abs(h[:, 0])))

def weighted_loss(p, b):
    x, y, w = b
    return explicit_loss(p, (x, y)), jnp.sum(w)

def carry_loss(p, b, c):
    return loss(p, b), c + 1.0

def mesh_of(shape, names, kind):
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))

def put(mesh, tree, spec):
    return jax.device_put(tree, NamedSharding(mesh, spec))

def sgd_step(fn_loss, params, batch, **kw):  # one SGD(1) step: grads = params - new
    opt = optax.sgd(1.0)
    step = jaxaccum.train_step(fn_loss, opt, donate=False, **kw)
    new, _, value, info = step(params, opt.init(params), batch)
    grads = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), params, new)
    return float(value), grads, info

def rel(grads, x, y, f=mse):
    ref = jax.grad(f)(PARAMS, x, y)
    return max(float(np.max(np.abs(grads[k] - np.asarray(ref[k])))) for k in ref) / max(
        float(np.max(np.abs(np.asarray(r)))) for r in ref.values())

out = {}
AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit

# 1. Auto (8,) mesh, k = 2 per device: aux reductions across devices (device d holds examples
#    8d..8d+7; its micro-batch 1 the odd ones).
mesh = mesh_of((8,), ("data",), AUTO)
with jax.set_mesh(mesh):
    batch = put(mesh, (X, Y, IDX), P("data"))
    fn = jax.jit(jaxaccum.value_and_grad(aux_loss, num_microbatches=2, mesh=mesh,
                 has_aux={"last": "last", "max": "max", "mean": "mean", "cat": "concat"}))
    (value, aux), grads = fn(put(mesh, PARAMS, P()), batch)
    out["auto_aux"] = {k: np.asarray(v).tolist() for k, v in aux.items()}
    out["auto_aux_grads_rel"] = rel({k: np.asarray(v) for k, v in grads.items()}, X, Y)

# 2. Auto (8,) mesh, skip_nonfinite: NaNs in micro-batch 1 of device 3 and micro-batch 0 of
#    device 5 (none on device 0); the left-out examples are those micro-batches' own.
    bad = X.copy(); bad[25, 0] = np.nan; bad[40, 1] = np.nan
    value, grads, info = sgd_step(loss, put(mesh, PARAMS, P()), put(mesh, (bad, Y), P("data")),
                                  num_microbatches=2, mesh=mesh, skip_nonfinite=True)
    keep = np.ones(B, bool); keep[[25, 27, 29, 31, 40, 42, 44, 46]] = False
    out["auto_skip"] = {"skipped": int(info.skipped), "weight": float(info.weight),
                        "grads_rel": rel(grads, X[keep], Y[keep]),
                        "loss_rel": abs(value - float(mse(PARAMS, X[keep], Y[keep]))) / float(mse(PARAMS, X[keep], Y[keep]))}

# 3. Auto mesh: carried state is refused, saying why
    try:
        jax.jit(jaxaccum.value_and_grad(carry_loss, num_microbatches=2, mesh=mesh, carry_argnums=2))(
            put(mesh, PARAMS, P()), put(mesh, (X, Y), P("data")), jnp.zeros(()))
        out["auto_carry_error"] = None
    except Exception as e:
        out["auto_carry_error"] = f"{type(e).__name__}: {e}"

# 4. ZeRO-3 on an Auto mesh: the gather of each FSDP kernel stays in the loop
    fsdp = {"w": P("data", None), "v": P("data", None)}
    sharded = {k: put(mesh, v, fsdp[k]) for k, v in PARAMS.items()}
    opt = optax.sgd(0.1)
    zero3 = {}
    for option in ("step", "microbatch"):
        step = jaxaccum.train_step(loss, opt, num_microbatches=4,
                                   mesh=jaxaccum.DataParallel(mesh, fsdp=option))
        compiled = step.lower(sharded, opt.init(sharded), put(mesh, (X, Y), P("data"))).compile()
        zero3[option] = {"counts": _hlo.collective_counts(compiled.as_text()),
                         "temp": compiled.memory_analysis().temp_size_in_bytes}
        value, grads, _ = sgd_step(loss, sharded, put(mesh, (X, Y), P("data")), num_microbatches=4,
                                   mesh=jaxaccum.DataParallel(mesh, fsdp=option))
        zero3[option]["grads_rel"] = rel(grads, X, Y)
    out["zero3"] = zero3

# 5. Auto (4, 2) data x model mesh: k per device times the 4 data devices
mesh = mesh_of((4, 2), ("data", "model"), AUTO)
with jax.set_mesh(mesh):
    value, grads, info = sgd_step(loss, put(mesh, PARAMS, P()), put(mesh, (X, Y), P("data")),
                                  num_microbatches=2, mesh=jaxaccum.DataParallel(mesh, data_axis="data"))
    out["data_model"] = {"num_microbatches": int(info.num_microbatches), "grads_rel": rel(grads, X, Y)}

# 6. Explicit (8,) mesh, skip_nonfinite: micro-batch i is global (examples i, i + k, ...);
#    the NaN at example 25 (k = 2: micro-batch 1) lives on device 3
mesh = mesh_of((8,), ("data",), EXPLICIT)
with jax.set_mesh(mesh):
    bad = X.copy(); bad[25, 0] = np.nan
    value, grads, info = sgd_step(explicit_loss, put(mesh, PARAMS, P()), put(mesh, (bad, Y), P("data")),
                                  num_microbatches=2, mesh=mesh, skip_nonfinite=True)
    out["explicit_skip"] = {"skipped": int(info.skipped), "weight": float(info.weight),
                            "grads_rel": rel(grads, X[0::2], Y[0::2]),
                            "finite": bool(all(np.all(np.isfinite(g)) for g in grads.values()))}

# 6b. The same with a finite loss and a NaN gradient (an all-zero example, sqrt at 0): only the
#     device holding it sees the NaN, in its partial gradient; the flag must be reduced
    zero = X.copy(); zero[25] = 0.0
    value, grads, info = sgd_step(explicit_root_loss, put(mesh, PARAMS, P()), put(mesh, (zero, Y), P("data")),
                                  num_microbatches=2, mesh=mesh, skip_nonfinite=True)
    out["explicit_skip_gradient"] = {"skipped": int(info.skipped), "weight": float(info.weight),
                                     "loss_finite": bool(np.isfinite(value)),
                                     "grads_rel": rel(grads, X[0::2], Y[0::2], root)}

# 7. Explicit mesh, a traced negative weight: the result is NaN, never a silent number
    w = np.ones(B, np.float32); w[3] = -100.0  # micro-batch 1 (odd examples): weight 31 - 100
    fn = jax.jit(jaxaccum.value_and_grad(weighted_loss, num_microbatches=2, mesh=mesh, weighted=True))
    value, grads = fn(put(mesh, PARAMS, P()), put(mesh, (X, Y, w), P("data")))
    out["explicit_negative"] = {"loss_nan": bool(np.isnan(float(value))),
                                "grads_nan": bool(all(np.all(np.isnan(np.asarray(g))) for g in grads.values()))}

# 8. Explicit FSDP ("step"): each kernel's gradient is reduce-scattered once per step
    sharded = {k: put(mesh, v, P("data", None)) for k, v in PARAMS.items()}
    fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4, mesh=mesh))
    batch = put(mesh, (X, Y), P("data"))
    value, grads = fn(sharded, batch)
    out["explicit_fsdp"] = {"counts": _hlo.collective_counts(fn.lower(sharded, batch).compile().as_text()),
                            "grads_rel": rel({k: np.asarray(v) for k, v in grads.items()}, X, Y)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def mesh_results():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- meshes -------------------------------------------------------------------------------------


def test_auto_mesh_aux_reductions_span_every_device(mesh_results):
    """k = 2 per device, 8 devices: 'last' is device 7's micro-batch 1 (max index 63), 'max'
    the largest over devices (not their sum), 'mean' the mean over all 16 micro-batches,
    'concat' the batch in its own order."""
    aux = mesh_results["auto_aux"]
    assert aux["last"] == 63.0
    assert aux["max"] == 63.0
    assert aux["mean"] == pytest.approx(31.5, rel=1e-6)
    assert aux["cat"] == list(range(64))
    assert mesh_results["auto_aux_grads_rel"] <= 1e-5


def test_auto_mesh_skipped_count_is_summed_over_devices(mesh_results):
    r = mesh_results["auto_skip"]
    assert r["skipped"] == 2  # one micro-batch each on devices 3 and 5, none on device 0
    assert r["weight"] == 14.0  # 16 micro-batches, 2 left out
    assert r["grads_rel"] <= 1e-5 and r["loss_rel"] <= 1e-5


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


def test_explicit_mesh_skips_a_nonfinite_microbatch_on_one_device(mesh_results):
    r = mesh_results["explicit_skip"]
    assert r["skipped"] == 1 and r["weight"] == 1.0
    assert r["finite"] and r["grads_rel"] <= 1e-5  # the even examples alone


def test_explicit_mesh_skips_a_microbatch_whose_gradient_alone_is_nonfinite(mesh_results):
    """The loss is finite, one device's partial gradient is NaN: every device must agree to
    skip (the flag is reduced over the devices), and only that micro-batch is left out."""
    r = mesh_results["explicit_skip_gradient"]
    assert r["skipped"] == 1 and r["weight"] == 1.0 and r["loss_finite"]
    assert r["grads_rel"] <= 1e-5


def test_explicit_mesh_negative_weight_poisons_the_gradient(mesh_results):
    r = mesh_results["explicit_negative"]
    assert r["loss_nan"] and r["grads_nan"]


def test_explicit_fsdp_gradient_is_reduce_scattered(mesh_results):
    r = mesh_results["explicit_fsdp"]
    assert r["counts"]["reduce-scatter"] >= 2, r["counts"]  # w and v
    assert r["grads_rel"] <= 1e-5


# --- aux reductions on one device ---------------------------------------------------------------


def _aux_fn(params, batch):
    x, y = batch
    loss = jnp.mean((mlp_apply(params, x) - y) ** 2)
    return loss, {"n": jnp.asarray(x.shape[0]), "top": jnp.max(x[:, 0]), "sum": jnp.sum(x[:, 0])}


def test_a_skipped_microbatch_adds_nothing_to_any_reduced_aux():
    x, y = BATCH
    bad = (x.at[2, 1].set(jnp.nan), y)  # strided micro-batch 2 of 4 (x[:, 0] stays finite)
    spec = {"n": "sum", "top": "max", "sum": "sum"}
    (_, aux), _ = jax.jit(jaxaccum.value_and_grad(
        _aux_fn, num_microbatches=4, has_aux=spec, skip_nonfinite=True))(PARAMS, bad)
    kept = np.concatenate([np.asarray(x[i::4, 0]) for i in (0, 1, 3)])
    assert int(aux["n"]) == 48
    assert float(aux["top"]) == float(np.max(kept))
    assert float(aux["sum"]) == pytest.approx(float(np.sum(kept)), rel=1e-5)


def _masked_fn(params, batch):
    """Mean over the valid examples and their count; the aux is a per-token mean too (0/0 in
    an empty micro-batch)."""
    x, y, mask = batch
    per = jnp.mean((mlp_apply(params, x) - y) ** 2, axis=-1)
    n = jnp.sum(mask)
    return (jnp.sum(mask * per) / n, n), {"err": jnp.sum(mask * per) / n}


def test_weighted_mean_aux_of_an_empty_microbatch_adds_nothing():
    mask = jnp.ones(64).at[2::4].set(0.0)  # strided micro-batch 2 of 4 is empty: its aux 0/0
    batch = (*BATCH, mask)
    fn = jaxaccum.value_and_grad(_masked_fn, num_microbatches=4, weighted=True,
                                 has_aux="weighted_mean")
    ((loss, aux)), _ = jax.jit(fn)(PARAMS, batch)
    x, y = BATCH
    per = jnp.mean((mlp_apply(PARAMS, x) - y) ** 2, axis=-1)
    expected = float(jnp.sum(mask * per) / jnp.sum(mask))
    assert float(aux["err"]) == pytest.approx(expected, rel=1e-5)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


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
