"""One contract for every front end: the same facts, reported the same way.

Every step returns its loss and a ``jaxaccum.StepInfo``; every ``value_and_grad`` returns jax's
``(value, grads)`` and ``(value, grads, info)`` with ``return_info=True``; no option changes a
shape; an option an entry point cannot honour is refused when it is built; one program per
count in every step; the mesh set by every step; Equinox modules whole wherever the docs say;
out-of-range counts refused. The numbers themselves are the reference model's business
(``test_reference.py``); this file holds the shapes, the refusals and the promises around them.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import refuses
from flax import nnx
from flax.training import train_state

import jaxaccum
import jaxaccum.linen
import jaxaccum.nnx


def loss(w, batch):
    x, y = batch
    return jnp.mean((x @ w - y) ** 2)


def batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(n, 3)), jnp.float32),
            jnp.asarray(rng.normal(size=(n,)), jnp.float32))


W = np.asarray([0.3, -0.2, 0.5], np.float32)  # NumPy: a donating step copies it


def nnx_loss(model, b):
    return loss(model.w[...], b)


class Linear(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.asarray(W))


def all_steps(**options):
    """Every step, each called once on the same batch: name -> (loss, info)."""
    sgd = optax.sgd(0.1)
    out = {}
    model = Linear()
    out["nnx.train_step"] = jaxaccum.nnx.train_step(nnx_loss, **options)(
        model, nnx.Optimizer(model, sgd, wrt=nnx.Param), batch())
    state = train_state.TrainState.create(apply_fn=None, params=W, tx=sgd)
    _, value, info = jaxaccum.linen.train_step(loss, **options)(state, batch())
    out["linen.train_step"] = value, info
    for name, make in PLAIN_STEPS.items():
        if name == "coupled_train_step" and {"noise_scale", "skip_nonfinite"} & set(options):
            continue  # refused when built (test_coupled_losses_refuse_...)
        _, _, value, info = make(sgd, **options)(W, sgd.init(W), batch())
        out[name] = value, info
    return out


# the (params, opt_state, batch) steps other than train_step, with the same loss
PLAIN_STEPS = {
    "train_step": lambda opt, **o: jaxaccum.train_step(loss, opt, **o),
    "statistics_first_train_step": lambda opt, **o: jaxaccum.statistics_first_train_step(
        lambda w, b: {"n": jnp.float32(b[0].shape[0])}, lambda w, b, t: loss(w, b), opt, **o),
    "coupled_train_step": lambda opt, **o: jaxaccum.coupled_train_step(
        lambda w, b: b[0] @ w - b[1], lambda w, r, b: jnp.mean(r**2), opt, **o),
}


@pytest.mark.parametrize("name", list(PLAIN_STEPS))
@pytest.mark.parametrize("donate", [None, True, False])
def test_every_step_donates_params_and_opt_state_unless_told_not_to(name, donate):
    """``donate=True`` by default: the arrays passed in are consumed, the new ones are not."""
    adam = optax.adam(0.1)
    params = jnp.asarray(W)
    state = adam.init(params)
    step = PLAIN_STEPS[name](adam, num_microbatches=2,
                             **({} if donate is None else {"donate": donate}))
    new_params, new_state, _, _ = step(params, state, batch())
    consumed = donate is not False
    assert params.is_deleted() == consumed, name
    assert all(s.is_deleted() == consumed for s in jax.tree.leaves(state)), name
    assert not any(x.is_deleted() for x in jax.tree.leaves((new_params, new_state))), name


@pytest.mark.parametrize("options", [{}, {"noise_scale": True}, {"skip_nonfinite": True}])
def test_every_step_returns_its_loss_and_one_step_info(options):
    results = all_steps(num_microbatches=4, **options)
    full = float(loss(W, batch()))
    for name, (value, info) in results.items():
        assert jnp.shape(value) == () and float(value) == pytest.approx(full, rel=1e-5), name
        assert isinstance(info, jaxaccum.StepInfo), name
        assert int(info.num_microbatches) == 4 and int(info.skipped) == 0, name
        assert float(info.weight) == 4.0, name
        assert (info.noise_scale is not None) == bool(options.get("noise_scale")), name


VALUE_AND_GRADS = {
    "jaxaccum.value_and_grad": lambda **o: jaxaccum.value_and_grad(loss, **o),
    "jaxaccum.statistics_first": lambda **o: jaxaccum.statistics_first(
        lambda w, b: {"n": jnp.float32(b[0].shape[0])}, lambda w, b, t: loss(w, b), **o),
    "jaxaccum.coupled_value_and_grad": lambda **o: jaxaccum.coupled_value_and_grad(
        lambda w, b: b[0] @ w - b[1], lambda w, r, b: jnp.mean(r**2), **o),
}


@pytest.mark.parametrize("name", list(VALUE_AND_GRADS))
def test_every_value_and_grad_keeps_jax_shape_and_adds_the_info_when_asked(name):
    make = VALUE_AND_GRADS[name]
    full = jax.value_and_grad(loss)(W, batch())
    plain = jax.jit(make(num_microbatches=4))(W, batch())
    assert len(plain) == 2
    value, grads, info = jax.jit(make(num_microbatches=4, return_info=True))(W, batch())
    np.testing.assert_allclose(value, full[0], rtol=1e-5)
    np.testing.assert_allclose(grads, full[1], rtol=1e-5, atol=1e-6)
    assert isinstance(info, jaxaccum.StepInfo)
    assert int(info.num_microbatches) == 4 and int(info.skipped) == 0
    assert float(info.weight) == 4.0 and info.weight.dtype == jnp.float32


def test_nnx_value_and_grad_adds_the_info_when_asked():
    value, grads, info = nnx.jit(jaxaccum.nnx.value_and_grad(
        nnx_loss, num_microbatches=4, return_info=True))(Linear(), batch())
    assert isinstance(info, jaxaccum.StepInfo) and int(info.num_microbatches) == 4
    np.testing.assert_allclose(grads["w"][...], jax.grad(loss)(W, batch()), rtol=1e-5)


@pytest.mark.parametrize("make", [
    lambda **o: jaxaccum.value_and_grad(loss, **o),
    lambda **o: jaxaccum.nnx.value_and_grad(nnx_loss, **o),
    lambda **o: jaxaccum.statistics_first(lambda w, b: {}, lambda w, b, t: loss(w, b), **o),
])
def test_noise_scale_without_return_info_is_refused_when_built(make):
    with refuses(TypeError, match="return_info=True"):
        make(num_microbatches=4, noise_scale=True)


@pytest.mark.parametrize("option", [{"noise_scale": True}, {"max_microbatches": 4},
                                    {"weighted": True}, {"skip_nonfinite": True}])
@pytest.mark.parametrize("make", [
    lambda **o: jaxaccum.coupled_value_and_grad(lambda w, b: b, lambda w, r, b: 0.0, **o),
    lambda **o: jaxaccum.coupled_train_step(lambda w, b: b, lambda w, r, b: 0.0,
                                            optax.sgd(0.1), **o),
])
def test_coupled_losses_refuse_what_they_cannot_honour_when_built(make, option):
    counts = {} if "max_microbatches" in option else {"num_microbatches": 4}
    with refuses(TypeError, match=f"{next(iter(option))}= is not taken"):
        make(**counts, **option)


def counting_sgd():
    """SGD whose update counts its traces: once per compiled step program."""
    sgd, traces = optax.sgd(0.1), []

    def update(updates, state, params=None):
        traces.append(1)
        return sgd.update(updates, state, params)

    return optax.GradientTransformation(sgd.init, update), traces


def test_every_step_compiles_one_program_for_every_kind_of_count():
    k, m = 4, 2
    x, y = batch(k * m)
    stack = (x.reshape(k, m, 3), y.reshape(k, m))
    counts = [2, np.int32(3), np.int64(1), jnp.asarray(4), jnp.asarray(0)]
    for name in ("train_step", "nnx.train_step", "linen.train_step"):
        opt, traces = counting_sgd()
        if name == "nnx.train_step":
            step = jaxaccum.nnx.train_step(nnx_loss, max_microbatches=k)
            model = Linear()
            optimizer = nnx.Optimizer(model, opt, wrt=nnx.Param)
            for c in counts:
                step(model, optimizer, jaxaccum.Microbatches(stack, c))
        elif name == "train_step":
            step = jaxaccum.train_step(loss, opt, max_microbatches=k)
            params, state = jnp.asarray(W), opt.init(jnp.asarray(W))
            for c in counts:
                params, state, _, _ = step(params, state, jaxaccum.Microbatches(stack, c))
        else:
            step = jaxaccum.linen.train_step(loss, max_microbatches=k)
            state = train_state.TrainState.create(apply_fn=None, params=jnp.asarray(W), tx=opt)
            for c in counts:
                state, _, _ = step(state, jaxaccum.Microbatches(stack, c))
        assert len(traces) == 1, (name, len(traces))


@pytest.mark.parametrize("count", [5, 9, -1])
def test_a_concrete_count_outside_0_to_k_is_refused(count):
    stack = (jnp.ones((4, 2, 3)), jnp.ones((4, 2)))
    sgd = optax.sgd(0.1)
    with refuses(ValueError, match="between 0 and max_microbatches=4"):
        jaxaccum.value_and_grad(loss, max_microbatches=4)(W, jaxaccum.Microbatches(stack, count))
    with refuses(ValueError, match="between 0 and max_microbatches=4"):
        jaxaccum.train_step(loss, sgd, max_microbatches=4)(
            W, sgd.init(W), jaxaccum.Microbatches(stack, count))


def test_a_traced_count_outside_0_to_k_is_clipped_as_documented():
    rng = np.random.default_rng(1)
    stack = (jnp.asarray(rng.normal(size=(4, 2, 3)), jnp.float32),
             jnp.asarray(rng.normal(size=(4, 2)), jnp.float32))
    fn = jax.jit(lambda w, s, c: jaxaccum.value_and_grad(loss, max_microbatches=4)(
        w, jaxaccum.Microbatches(s, c)))
    all_four = fn(W, stack, 4)
    np.testing.assert_array_equal(fn(W, stack, 9)[1], all_four[1])
    assert float(fn(W, stack, -1)[0]) == 0.0


def test_an_equinox_module_passes_whole_to_train_step_and_value_and_grad():
    model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))

    def eqx_loss(m, b):
        return jnp.mean((jax.vmap(m)(b[0])[:, 0] - b[1]) ** 2)

    opt = optax.sgd(0.1)
    step = jaxaccum.train_step(eqx_loss, opt, num_microbatches=4)
    state = opt.init(eqx.filter(model, eqx.is_array))
    full = eqx.filter_value_and_grad(eqx_loss)(model, batch())
    want = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, full[1]))
    want = jax.tree.map(np.asarray, eqx.filter(want, eqx.is_array))  # the step donates model
    new, state, value, info = step(model, state, batch())
    assert isinstance(new, eqx.nn.MLP) and int(info.num_microbatches) == 4
    np.testing.assert_allclose(value, full[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(eqx.filter(new, eqx.is_array)), jax.tree.leaves(want),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    new, state, _, _ = step(new, state, batch(seed=1))  # the same program again
    assert step.num_programs == 1


class Shifted(eqx.Module):
    """A module with a plain int field (a hyperparameter: static for the step, as for
    ``eqx.filter_jit``)."""

    weight: jax.Array
    shift: int

    def __call__(self, x):
        return jnp.tanh(x @ self.weight)[:, 0] + self.shift


@pytest.mark.parametrize("shifts", [(-1, -2), (-2, -1), (3, 4)])
def test_each_distinct_static_part_gets_its_own_program(shifts):
    """Two modules that differ only in a static field run two programs, each equal to
    ``eqx.filter_value_and_grad``, in either order, whatever their hashes (in CPython
    ``hash(-1) == hash(-2)``, so only equality tells those two apart)."""
    opt = optax.sgd(0.1)

    def eqx_loss(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    step = jaxaccum.train_step(eqx_loss, opt, num_microbatches=4, donate=False)
    weight = jax.random.normal(jax.random.key(0), (3, 1))
    for shift in shifts:
        model = Shifted(weight, shift)
        want = eqx.filter_value_and_grad(eqx_loss)(model, batch())[0]
        _, _, value, _ = step(model, opt.init(eqx.filter(model, eqx.is_array)), batch())
        np.testing.assert_allclose(value, want, rtol=1e-5)
    assert step.num_programs == 2


def test_every_step_sets_an_explicit_mesh_itself():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    sgd = optax.sgd(0.1)
    out = {}
    _, _, out["train_step"], _ = jaxaccum.train_step(loss, sgd, num_microbatches=4, mesh=mesh)(
        W, sgd.init(W), batch())
    model = Linear()
    out["nnx"], _ = jaxaccum.nnx.train_step(nnx_loss, num_microbatches=4, mesh=mesh)(
        model, nnx.Optimizer(model, sgd, wrt=nnx.Param), batch())
    state = train_state.TrainState.create(apply_fn=None, params=W, tx=sgd)
    _, out["linen"], _ = jaxaccum.linen.train_step(loss, num_microbatches=4, mesh=mesh)(
        state, batch())
    full = float(loss(W, batch()))
    for name, value in out.items():
        assert float(value) == pytest.approx(full, rel=1e-5), name


@pytest.mark.parametrize("front", ["value_and_grad", "train_step"])
def test_a_sharding_error_of_the_model_reaches_the_user_as_jax_raised_it(front):
    """jaxaccum tries a few ways of typing the parameters on Explicit axes and moves on when
    JAX refuses one; an error of the model itself (here an illegally sharded product) must
    still reach the user as JAX's own error, as ``jax.grad`` gives it, not be swallowed or
    replaced."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def bad_loss(w, x):
        y = x @ w
        return jnp.mean(y * jax.sharding.reshard(y, jax.sharding.PartitionSpec(None, "data")))

    w, x = jnp.ones((4, 3)), jnp.ones((8, 4))
    errors = []
    with jax.set_mesh(mesh):
        x = jax.device_put(x, jax.sharding.PartitionSpec("data"))
        for call in (lambda: jax.jit(jax.grad(bad_loss))(w, x),
                     lambda: jax.jit(jaxaccum.value_and_grad(
                         bad_loss, num_microbatches=2, mesh=mesh))(w, x)
                     if front == "value_and_grad" else jaxaccum.train_step(
                         bad_loss, optax.sgd(0.1), num_microbatches=2, mesh=mesh)(
                         w, optax.sgd(0.1).init(w), x)):
            try:
                call()
            except Exception as error:  # noqa: BLE001 - the point is which error
                errors.append(error)
            else:
                errors.append(None)
    plain, ours = errors
    assert type(plain).__name__ == "ShardingTypeError", plain
    assert type(ours) is type(plain), f"{type(ours).__name__}: {ours}"
    assert "illegally sharded" in str(ours), ours


def test_check_takes_a_step_without_a_count_and_a_zero_gradient_quietly():
    step = jaxaccum.value_and_grad(loss, num_microbatches=4)
    report = jaxaccum.check(loss, W, batch(), step=step)
    assert report.ok, report.problems
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero = jaxaccum.check(lambda w, b: jnp.sum(w) * 0.0, W, batch(), num_microbatches=4)
    assert not [str(w.message) for w in caught], "check warned on an exactly zero gradient"
    assert zero.ok, zero.problems
    assert zero.error == 0.0, zero.error


def test_check_compares_the_loss_too():
    def wrong_loss(w, b):  # the right gradient, the loss off by 1
        value, grads = jaxaccum.value_and_grad(loss, num_microbatches=4)(w, b)
        return value + 1.0, grads

    report = jaxaccum.check(loss, W, batch(), step=wrong_loss)
    assert not report.ok and report.error > 0.1


def test_concat_on_an_aux_leaf_that_is_not_per_example_is_refused():
    with refuses(ValueError, match="per-example values back in batch order"):
        jaxaccum.value_and_grad(lambda w, b: (loss(w, b), jnp.sum(b[1])), num_microbatches=4,
                                has_aux="concat")(W, batch())
    with refuses(ValueError, match="per-example values back in batch order"):
        jaxaccum.nnx.value_and_grad(lambda m, b: (nnx_loss(m, b), jnp.sum(b[1])),
                                    num_microbatches=4, has_aux="concat")(Linear(), batch())


def test_carry_argnums_overlapping_argnums_or_the_batch_is_refused():
    with refuses(ValueError, match="carry_argnums=0 overlaps"):
        jaxaccum.value_and_grad(loss, num_microbatches=2, carry_argnums=0)
    with refuses(ValueError, match="carry_argnums=1 overlaps"):
        jaxaccum.value_and_grad(loss, num_microbatches=2, carry_argnums=1)


def test_the_float32_accumulator_default_keeps_bf16_gradients_within_one_rounding():
    """bf16 parameters, 64 micro-batches: each micro-batch gradient is a bf16 value; summed
    in float32 (the default) the mean rounds once to bf16, so it is within one bf16 rounding
    of the float64 mean of those same micro-batch gradients. Summing in bf16 (``None``) rounds
    64 times and is documented to do so."""
    k = 64
    rng = np.random.default_rng(3)
    x = rng.uniform(0.5, 1.5, size=(k, 8)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(8,)), jnp.bfloat16)

    def linear(w, b):
        return jnp.mean(b.astype(jnp.bfloat16) @ w)

    micro = np.stack([np.asarray(jax.grad(linear)(w, x[i:i + 1]), np.float64) for i in range(k)])
    want = micro.mean(0)
    got = np.asarray(jaxaccum.value_and_grad(linear, num_microbatches=k)(w, x)[1], np.float64)
    bf16_none = np.asarray(jaxaccum.value_and_grad(linear, num_microbatches=k,
                                                   accumulator_dtype=None)(w, x)[1], np.float64)
    half_ulp = np.abs(want) * 2.0**-8
    assert np.all(np.abs(got - want) <= half_ulp * 1.01), (got, want)
    assert np.max(np.abs(bf16_none - want) / np.abs(want)) > 2.0**-8  # why float32 matters


def test_the_weight_is_float32_whatever_the_loss_dtype():
    """A bf16 loss with float32 counts: 257 tokens per micro-batch (bf16 would round to 256)."""
    def bf16_loss(w, b):
        x, y, m = b
        per = ((x @ w - y) ** 2).astype(jnp.bfloat16)
        return jnp.sum(per * m.astype(jnp.bfloat16)) / jnp.sum(m).astype(jnp.bfloat16), jnp.sum(m)

    x, y = batch(514)
    value, _, info = jaxaccum.value_and_grad(bf16_loss, num_microbatches=2, weighted=True,
                                             return_info=True)(W, (x, y, jnp.ones(514)))
    assert info.weight.dtype == jnp.float32 and float(info.weight) == 514.0
    assert value.dtype == jnp.bfloat16


def test_a_runtime_count_reads_the_stack_where_it_lies():
    """No copy of the batch: the runtime-count program's compiled temp is the fixed-k
    program's (the batch here is 526 KB, six times the fixed program's temp)."""
    k, m, d = 8, 64, 256

    def mlp_loss(w, b):
        x, y = b
        return jnp.mean((jnp.tanh(x @ w).sum(1) - y) ** 2)

    w = jnp.zeros((d, 16))
    x, y = jnp.ones((k * m, d)), jnp.ones((k * m,))

    def temp(fn, *args):
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    fixed = temp(jaxaccum.value_and_grad(mlp_loss, num_microbatches=k), w, (x, y))
    stack = jaxaccum.Microbatches((x.reshape(k, m, d), y.reshape(k, m)), jnp.int32(k))
    runtime = temp(jaxaccum.value_and_grad(mlp_loss, max_microbatches=k), w, stack)
    assert runtime <= fixed + 4096, (runtime, fixed, x.nbytes + y.nbytes)


def test_a_count_that_is_not_a_scalar_is_refused_by_every_step():
    stack = (jnp.ones((4, 2, 3)), jnp.ones((4, 2)))
    sgd = optax.sgd(0.1)
    with refuses(TypeError, match="Microbatches.count must be an integer scalar"):
        jaxaccum.train_step(loss, sgd, max_microbatches=4)(
            W, sgd.init(W), jaxaccum.Microbatches(stack, np.array([1, 2])))


def test_a_mesh_without_data_axis_is_refused_with_the_first_axis_as_example():
    mesh = jax.make_mesh((1, 1), ("batch", "model"))
    with refuses(ValueError, match=r"e\.g\. DataParallel\(mesh, data_axis='batch'\)"):
        jaxaccum.DataParallel(mesh)


def _enc(w, b):
    return b[0] @ w


def _pair(w, r, b):
    return jnp.mean(r**2)


def _stats(w, b):
    return {"n": jnp.float32(b[0].shape[0])}


def _with_stats(w, b, t):
    return loss(w, b)


SGD = optax.sgd(0.1)
# every entry point with one positional argument past the last it takes
POSITIONAL = {
    "value_and_grad": lambda: jaxaccum.value_and_grad(loss, 0),
    "train_step": lambda: jaxaccum.train_step(loss, SGD, 4),
    "coupled_value_and_grad": lambda: jaxaccum.coupled_value_and_grad(_enc, _pair, 4),
    "coupled_train_step": lambda: jaxaccum.coupled_train_step(_enc, _pair, SGD, 4),
    "statistics_first": lambda: jaxaccum.statistics_first(_stats, _with_stats, 4),
    "statistics_first_train_step": lambda: jaxaccum.statistics_first_train_step(
        _stats, _with_stats, SGD, 4),
    "nnx.value_and_grad": lambda: jaxaccum.nnx.value_and_grad(nnx_loss, 4),
    "nnx.train_step": lambda: jaxaccum.nnx.train_step(nnx_loss, 4),
    "nnx.coupled_value_and_grad": lambda: jaxaccum.nnx.coupled_value_and_grad(_enc, _pair, 4),
    "nnx.statistics_first": lambda: jaxaccum.nnx.statistics_first(_stats, _with_stats, 4),
    "linen.train_step": lambda: jaxaccum.linen.train_step(loss, 4),
}


def test_an_explicit_mesh_under_another_mesh_in_context_is_refused():
    """value_and_grad on Explicit axes needs its own mesh in context, not just any mesh."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    other = jax.make_mesh((1, 1), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    fn = jaxaccum.value_and_grad(loss, num_microbatches=2, mesh=mesh)
    with jax.set_mesh(other), refuses(ValueError, match=r"call it inside `with "
                                                          r"jax.set_mesh\(mesh\):`"):
        fn(W, batch())


@pytest.mark.parametrize("name", list(POSITIONAL))
def test_options_are_keyword_only_in_every_entry_point(name):
    """An option passed by position is Python's TypeError, never taken as another option."""
    with refuses(TypeError, match="positional argument"):
        POSITIONAL[name]()


TYPED = [jaxaccum.value_and_grad, jaxaccum.train_step, jaxaccum.coupled_value_and_grad,
         jaxaccum.coupled_train_step, jaxaccum.statistics_first,
         jaxaccum.statistics_first_train_step, jaxaccum.check, jaxaccum.nnx.value_and_grad,
         jaxaccum.nnx.train_step, jaxaccum.nnx.coupled_value_and_grad,
         jaxaccum.nnx.statistics_first, jaxaccum.linen.train_step]


@pytest.mark.parametrize("fn", TYPED, ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_every_entry_point_types_its_options(fn):
    """``**options`` is ``Unpack[OptionsDict]`` everywhere: type checkers and editors see
    the options' names and types, and the TypedDict holds exactly the options."""
    hints = typing.get_type_hints(fn, include_extras=True)
    assert hints["options"] == typing.Unpack[jaxaccum.OptionsDict]
    assert set(typing.get_type_hints(jaxaccum.OptionsDict)) == {
        f.name for f in dataclasses.fields(jaxaccum.Options)}


def test_every_choice_is_a_literal_with_one_implementation_each():
    """The names ``has_aux`` and ``fsdp`` take are ``Literal`` types, and each name the type
    lists is implemented (and nothing else)."""
    from jaxaccum import _options, _reductions

    assert set(typing.get_args(_reductions.AuxReductionName)) == set(_reductions.AUX_REDUCTIONS)
    assert typing.get_args(_options.FsdpMode) == _options.FSDP_MODES == ("step", "microbatch")


@pytest.mark.parametrize("out", [lambda v, c: v, lambda v, c: (v,), lambda v, c: (v, c, c)])
def test_a_loss_with_carry_that_does_not_return_a_pair_is_refused(out):
    def bad(w, b, c):
        return out(loss(w, b), c)

    with refuses(TypeError, match=r"must return \(output, new_carry\)"):
        jaxaccum.value_and_grad(bad, num_microbatches=2, carry_argnums=2)(
            W, batch(), jnp.zeros(()))


@pytest.mark.parametrize("options, out", [
    ({"weighted": True}, lambda v: (v, 1.0, 2.0)), ({"weighted": True}, lambda v: (v,)),
    ({"has_aux": True}, lambda v: (v, {"a": v}, v)), ({"has_aux": True}, lambda v: v)])
def test_a_loss_output_that_is_not_the_documented_pair_is_refused(options, out):
    """``weighted``: ``(loss, weight)``; ``has_aux``: ``(loss, aux)``; not 1 or 3 values."""
    with refuses(TypeError, match=r"the loss function must return \((loss|output), "):
        jaxaccum.value_and_grad(lambda w, b: out(loss(w, b)), num_microbatches=2,
                                **options)(W, batch())


@pytest.mark.parametrize("new, got", [(lambda c: {"c": c}, "dict"), (lambda c: (c,), "tuple of 1"),
                                      (lambda c: [c, c, c], "list of 3")])
def test_new_carry_of_the_wrong_kind_or_length_is_named(new, got):
    def bad(w, b, c, d):
        return loss(w, b), new(c)  # new_carry must be a tuple of 2 values

    with refuses(TypeError, match=f"new_carry must be a tuple of 2 values.*; got {got}$"):
        jaxaccum.value_and_grad(bad, num_microbatches=2, carry_argnums=(2, 3))(
            W, batch(), jnp.zeros(()), jnp.zeros(()))


def test_an_installed_package_holds_every_module_and_its_types():
    """What pip installs from a wheel: every subpackage of jaxaccum (an explicit package list
    once left one out, which an editable install hides) and ``py.typed``, so that users' type
    checkers read the typed options. (setuptools' find matches the dotted names against the
    ``include`` patterns with fnmatch, as here; setuptools itself is not in every venv.)"""
    import fnmatch
    import pathlib

    import tomllib

    root = pathlib.Path(jaxaccum.__file__).parent
    config = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(root.parent).parts)
               for p in root.rglob("__init__.py")}
    listed = config.get("packages")  # an explicit list, or find's patterns
    found = set(listed) if isinstance(listed, list) else {
        name for name in on_disk
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in listed["find"]["include"])}
    assert on_disk <= found, on_disk - found
    assert (root / "py.typed").is_file() and "py.typed" in config["package-data"]["jaxaccum"]
