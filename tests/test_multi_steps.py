"""jaxaccum.multi_steps: one micro-batch per call, one optimizer step per window."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    EPS32,
    assert_trees_close,
    assert_within_rounding,
    examples,
    float64_trajectory,
    full_batch_trajectory,
    grad_and_update,
    max_rel_diff,
    mlp_params,
    mse_loss,
    optimizers,
    random_batch,
    refuses,
    to_float64,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxaccum

PARAMS = mlp_params(jax.random.key(0))
BATCHES = [random_batch(jax.random.key(10 + i), 64) for i in range(5)]


def microbatches(batch, k):
    return [
        jax.tree.map(lambda x, i=i: x[i * (64 // k) : (i + 1) * (64 // k)], batch) for i in range(k)
    ]


def run_micro(optimizer, k, params=PARAMS, batches=BATCHES, loss_fn=mse_loss):
    """Feeds one micro-batch per jitted call; returns the final params and state."""
    call = grad_and_update(loss_fn, optimizer)
    state = optimizer.init(params)
    for batch in batches:
        for micro in microbatches(batch, k):
            params, state = call(params, state, micro)
    return params, state


@functools.cache
def references(name):
    """(full32, ref64): the full-batch float32 and float64 trajectories of optimizer ``name``."""
    full32 = full_batch_trajectory(mse_loss, optimizers()[name](), PARAMS, BATCHES)
    return full32, float64_trajectory(mse_loss, optimizers()[name], PARAMS, BATCHES)


# Measured on the 2-core dev CPU (jax 0.10.2): error vs the float64 reference, relative to its
# max |param|, of the full-batch float32 run / of ours at k = 4 and 16 (the bound is 10x the
# first + 16 eps32, 2.8e-6 to 7.0e-6): sgd 9.86e-8 / 9.86e-8, 9.86e-8; momentum 9.72e-8 /
# 9.72e-8, 9.72e-8; adam 4.82e-7 / 4.82e-7, 4.82e-7; adamw_schedule 2.57e-7 / 2.57e-7, 2.57e-7;
# clip_adam 5.07e-7 / 5.07e-7, 5.07e-7; adagrad 8.76e-8 / 8.76e-8, 8.76e-8. Ours and the full
# batch differ from each other by 3e-8 to 7e-8; a wrong mean or step count errs by 1e-3 and more.
@pytest.mark.parametrize(
    ("name", "k"), [(name, 4) for name in optimizers()] + [("adam", 16), ("adamw_schedule", 16)]
)
def test_trajectory_equals_full_batch(name, k):
    full32, ref64 = references(name)
    params, state = run_micro(jaxaccum.multi_steps(optimizers()[name](), k), k)
    assert_within_rounding(params, full32, ref64)
    assert int(state.gradient_step) == len(BATCHES)
    assert int(state.mini_step) == 0


@pytest.mark.parametrize("name", ["adamw_schedule"])
def test_equals_optax_multisteps(name):
    """Both are the full batch's trajectory up to float32 rounding (optax: a running mean)."""
    full32, ref64 = references(name)
    ours, _ = run_micro(jaxaccum.multi_steps(optimizers()[name](), 8), 8)
    theirs, _ = run_micro(optax.MultiSteps(optimizers()[name](), 8).gradient_transformation(), 8)
    assert_within_rounding(ours, full32, ref64)
    assert_within_rounding(theirs, full32, ref64)


def test_inner_counter_advances_once_per_optimizer_step():
    optimizer = jaxaccum.multi_steps(optax.adam(1e-3), 4)
    _, state = run_micro(optimizer, 4, batches=BATCHES[:3])
    assert int(state.inner_opt_state[0].count) == 3


def counting_transform(calls):
    """An identity transform that records each execution of its update on the host."""

    def update(updates, state, params=None):
        del params
        jax.debug.callback(lambda: calls.append(1))
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_inner_update_runs_only_when_emitting():
    ours, theirs = [], []
    run_micro(jaxaccum.multi_steps(counting_transform(ours), 4), 4, batches=BATCHES[:2])
    run_micro(
        optax.MultiSteps(counting_transform(theirs), 4).gradient_transformation(),
        4,
        batches=BATCHES[:2],
    )
    jax.effects_barrier()
    assert len(ours) == 2  # 8 calls, 2 optimizer steps
    assert len(theirs) == 8  # optax.MultiSteps evaluates the inner update on every call


def test_zero_updates_until_emit_and_has_updated():
    optimizer = jaxaccum.multi_steps(optax.sgd(0.1), 3)
    update = jax.jit(optimizer.update)
    state = optimizer.init(PARAMS)
    assert not bool(jaxaccum.has_updated(state))
    grads = jax.grad(mse_loss)(PARAMS, BATCHES[0])
    flags, method_flags, norms = [], [], []
    jitted_has_updated = jax.jit(optimizer.has_updated)
    for _ in range(6):
        updates, state = update(grads, state, PARAMS)
        flags.append(bool(jaxaccum.has_updated(state)))
        method_flags.append(bool(jitted_has_updated(state)))
        norms.append(float(optax.tree.norm(updates)))
    assert flags == method_flags == [False, False, True, False, False, True]
    assert norms[0] == norms[1] == norms[3] == 0.0
    np.testing.assert_allclose(norms[2], 0.1 * float(optax.tree.norm(grads)), rtol=1e-6)
    np.testing.assert_allclose(norms[5], norms[2], rtol=1e-6)
    assert int(state.gradient_step) == 2


def test_every_k_schedule():
    optimizer = jaxaccum.multi_steps(optax.sgd(0.1), lambda step: jnp.where(step < 1, 2, 3))
    update = jax.jit(optimizer.update)
    state = optimizer.init(PARAMS)
    grads = jax.grad(mse_loss)(PARAMS, BATCHES[0])
    flags = []
    for _ in range(8):
        _, state = update(grads, state, PARAMS)
        flags.append(bool(jaxaccum.has_updated(state)))
    assert flags == [False, True, False, False, True, False, False, True]


def test_every_k_schedule_below_one_counts_as_one():
    optimizer = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=lambda step: step - 1)
    g = micro_grads()
    outs, state = feed(optimizer, g[:3])  # k(0) = -1 and k(1) = 0 count as 1: every call steps
    assert_trees_close(outs[-1], jax.tree.map(lambda x: -x, g[2]), 1e-6)
    assert int(state.gradient_step) == 3 and int(state.mini_step) == 0


def masked_loss(params, batch):
    x, y, m = batch
    per_example = jnp.mean(
        (jnp.tanh(x @ params["layer0"]["w"]) @ params["layer1"]["w"] - y) ** 2, -1
    )
    return jnp.sum(per_example * m) / jnp.maximum(jnp.sum(m), 1)


def test_weighted_uneven_windows():
    counts = [5, 0, 11, 16]
    mask = jnp.asarray(np.concatenate([np.arange(16) < c for c in counts]), jnp.float32)
    x, y = BATCHES[0]
    batches = [(x, y, mask)]
    full32 = full_batch_trajectory(masked_loss, optax.adam(1e-2), PARAMS, batches)
    ref64 = float64_trajectory(masked_loss, lambda: optax.adam(1e-2), PARAMS, batches)
    acc = jaxaccum.multi_steps(optax.adam(1e-2), 4)

    @jax.jit
    def call(params, state, micro):
        grads = jax.grad(masked_loss)(params, micro)
        updates, state = acc.update(grads, state, params, weight=jnp.sum(micro[2]))
        return optax.apply_updates(params, updates), state

    params, state = PARAMS, acc.init(PARAMS)
    for micro in microbatches((x, y, mask), 4):
        params, state = call(params, state, micro)
    assert_within_rounding(params, full32, ref64)
    assert float(state.acc_weight) == 0.0 and int(state.gradient_step) == 1
    unweighted, _ = run_micro(
        jaxaccum.multi_steps(optax.adam(1e-2), 4), 4, batches=batches, loss_fn=masked_loss
    )
    assert max_rel_diff(unweighted, ref64) > 1e-3


def test_chainable_with_extra_args():
    """Inside optax.chain the weight keyword is forwarded; outer transforms see the emitted one."""
    inner = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    chained = optax.chain(inner, optax.scale(0.5))
    state = chained.init(PARAMS)
    grads = jax.grad(mse_loss)(PARAMS, BATCHES[0])
    update = jax.jit(chained.update)
    _, state = update(grads, state, PARAMS, weight=1.0)
    updates, state = update(jax.tree.map(lambda g: 3 * g, grads), state, PARAMS, weight=3.0)
    # weighted mean of g (w=1) and 3g (w=3) is 2.5 g; sgd(1.0) then scale(0.5): -1.25 g
    assert_trees_close(updates, jax.tree.map(lambda g: -1.25 * g, grads), 1e-6)
    assert bool(jaxaccum.has_updated(state[0]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_accumulator_dtype(dtype):
    params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
    state = jaxaccum.multi_steps(optax.sgd(0.1), 2).init(params)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state.acc_grads))
    state = jaxaccum.multi_steps(optax.sgd(0.1), 2, accumulator_dtype=None).init(params)
    assert all(a.dtype == dtype for a in jax.tree.leaves(state.acc_grads))
    assert state.mini_step.dtype == state.gradient_step.dtype == state.skipped.dtype == jnp.int32
    assert state.acc_weight.dtype == jnp.float32 and state.emitted.dtype == jnp.bool_


# --- argument checks -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1])
def test_every_k_below_one(bad):
    with refuses(ValueError, match=rf"every_k must be >= 1; got every_k={bad}"):
        jaxaccum.multi_steps(optax.sgd(0.1), bad)
    with refuses(ValueError, match=rf"every_k_schedule must be >= 1; got .*={bad}"):
        jaxaccum.multi_steps(optax.sgd(0.1), every_k_schedule=bad)


def test_every_k_wrong_type():
    with refuses(TypeError, match=r"every_k must be a positive int; got '4'"):
        jaxaccum.multi_steps(optax.sgd(0.1), "4")


def test_every_k_given_twice_or_never():
    with refuses(ValueError, match=r"not both; got every_k=2, every_k_schedule=3"):
        jaxaccum.multi_steps(optax.sgd(0.1), 2, every_k_schedule=3)
    with refuses(TypeError, match=r"needs every_k \(or its alias every_k_schedule\)"):
        jaxaccum.multi_steps(optax.sgd(0.1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_grad_mean": 1}, r"use_grad_mean must be a bool; got 1 of type int"),
        ({"skip_nonfinite": "yes"}, r"skip_nonfinite must be a bool; got 'yes'"),
        ({"should_skip_update_fn": True}, r"should_skip_update_fn must be a function.*got bool"),
    ],
)
def test_flags_type_checked(kwargs, message):
    with refuses(TypeError, match=message):
        jaxaccum.multi_steps(optax.sgd(0.1), 2, **kwargs)


def test_should_skip_update_fn_must_return_a_bool_scalar():
    optimizer = jaxaccum.multi_steps(
        optax.sgd(0.1), 2, should_skip_update_fn=lambda u, step, p: (jnp.zeros(2, bool), ())
    )
    with refuses(ValueError, match=r"boolean scalar first; got dtype bool and shape \(2,\)"):
        optimizer.update(PARAMS, optimizer.init(PARAMS), PARAMS)


def test_weight_not_scalar():
    optimizer = jaxaccum.multi_steps(optax.sgd(0.1), 2)
    with refuses(ValueError, match=r"weight must be a scalar.*shape \(2,\)"):
        optimizer.update(PARAMS, optimizer.init(PARAMS), PARAMS, weight=jnp.ones(2))


def test_inner_type_checked():
    with refuses(TypeError, match=r"inner must be an optax.GradientTransformation; got str"):
        jaxaccum.multi_steps("sgd", 2)


# --- non-finite gradients, dtypes ------------------------------------------------------------


def feed(optimizer, grads_list, params=PARAMS, weights=None):
    """Jitted updates with the given gradients (and weights); returns the updates and state."""
    update = jax.jit(optimizer.update)
    state = optimizer.init(params)
    outs = []
    for i, g in enumerate(grads_list):
        kwargs = {} if weights is None else {"weight": weights[i]}
        u, state = update(g, state, params, **kwargs)
        outs.append(u)
    return outs, state


def micro_grads(k=4):
    return [jax.grad(mse_loss)(PARAMS, m) for m in microbatches(BATCHES[0], k)]


def set_first(tree, value):
    return jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(value), tree)


def assert_zero(tree):
    assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(tree))


def assert_equal_trees(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_skip_nonfinite_renormalises():
    grads = micro_grads()
    bad = set_first(grads[1], jnp.nan)
    outs, state = feed(
        jaxaccum.multi_steps(optax.sgd(1.0), 4, skip_nonfinite=True),
        [grads[0], bad, grads[2], grads[3]],
    )
    mean_of_rest = jax.tree.map(lambda a, b, c: -(a + b + c) / 3, grads[0], grads[2], grads[3])
    assert_trees_close(outs[-1], mean_of_rest, 1e-6)
    assert int(state.skipped) == 1 and int(state.gradient_step) == 1


def test_skip_nonfinite_whole_window_makes_no_step():
    bad = jax.tree.map(lambda g: g * jnp.inf, micro_grads()[0])
    outs, state = feed(jaxaccum.multi_steps(optax.adam(1e-2), 2, skip_nonfinite=True), [bad, bad])
    assert_zero(outs[-1])
    assert int(state.gradient_step) == 0 and int(state.inner_opt_state[0].count) == 0
    assert int(state.skipped) == 2 and int(state.mini_step) == 0


def test_nan_propagates_without_skip():
    grads = micro_grads()
    outs, _ = feed(
        jaxaccum.multi_steps(optax.sgd(1.0), 2), [grads[0], set_first(grads[1], jnp.nan)]
    )
    assert bool(jnp.isnan(outs[-1]["layer0"]["w"][0, 0]))


def test_integer_gradients_rejected():
    optimizer = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    params = {"w": jnp.zeros(3, jnp.int32)}
    with refuses(TypeError, match=r"leaf \['w'\] has dtype int32"):
        optimizer.update(params, optimizer.init({"w": jnp.zeros(3)}), params)


def test_bfloat16_gradients_float32_accumulator():
    keys = jax.random.split(jax.random.key(3), 64)
    grads = [jax.random.normal(k, (256,)).astype(jnp.bfloat16) * 1e-2 + 1.0 for k in keys]
    reference = np.sum([np.asarray(g, np.float64) for g in grads], axis=0)
    errors = {}
    for name, acc in (("float32", jnp.float32), ("bfloat16", None)):
        _, state = feed(
            jaxaccum.multi_steps(optax.sgd(1.0), 128, accumulator_dtype=acc),
            grads,
            params=jnp.zeros(256, jnp.bfloat16),
        )
        errors[name] = max_rel_diff(state.acc_grads, reference)
    assert errors["float32"] <= 1e-3
    assert errors["bfloat16"] > 10 * errors["float32"] and errors["bfloat16"] > 1e-3
    outs, _ = feed(
        jaxaccum.multi_steps(optax.sgd(1.0), 2), grads[:2], params=jnp.zeros(256, jnp.bfloat16)
    )
    assert outs[-1].dtype == jnp.bfloat16  # the emitted update is cast back


def test_none_leaves():
    params = {"w": PARAMS, "frozen": None}
    grads = {"w": micro_grads()[0], "frozen": None}
    outs, state = feed(jaxaccum.multi_steps(optax.adam(1e-2), 2), [grads, grads], params=params)
    assert outs[-1]["frozen"] is None and state.acc_grads["frozen"] is None
    assert float(optax.tree.norm(outs[-1]["w"])) > 0


# --- issue 9 bugs: each test failed before its fix ------------------------------------------


@pytest.mark.parametrize(("name", "dtype"), [("adam", jnp.bfloat16), ("momentum", jnp.float16)])
def test_inner_state_dtype_change_compiles_once(name, dtype):
    """Low-precision params, float32 gradients: the inner update would promote its state.

    Before the fix: "cond branches must have equal output types". The state keeps the dtypes
    of inner.init (as optax.MultiSteps does), so a jitted loop compiles once and matches optax.
    """
    params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
    grads32 = micro_grads()  # float32 gradients
    runs = {}
    for who, opt in (
        ("ours", jaxaccum.multi_steps(optimizers()[name](), 2, use_grad_mean=False)),
        ("optax", optax.MultiSteps(optimizers()[name](), 2, use_grad_mean=False)),
    ):
        update = jax.jit(opt.update)
        p, state = params, opt.init(params)
        init_types = [(x.dtype, x.shape) for x in jax.tree.leaves(state.inner_opt_state)]
        for g in grads32 * 2:
            u, state = update(g, state, p)
            p = optax.apply_updates(p, u)
        types = [(x.dtype, x.shape) for x in jax.tree.leaves(state.inner_opt_state)]
        assert types == init_types
        runs[who] = (p, update._cache_size())
    assert runs["ours"][1] == 1  # one compilation for 8 calls, 4 of them optimizer steps
    # Same sums in the same order, same casts: the params can differ only where a float32
    # value rounds to the other neighbour in ``dtype``, i.e. by at most one ulp of it.
    assert_trees_close(runs["ours"][0], runs["optax"][0], float(jnp.finfo(dtype).eps))
    assert all(x.dtype == dtype for x in jax.tree.leaves(runs["ours"][0]))


@pytest.mark.parametrize(
    ("name", "mode"), [("adam", "eager"), ("clip_adam", "jit"), ("adam", "jit_weighted_skip")]
)
def test_python_float_leaf(name, mode):
    """Before the fix: "'float' object has no attribute 'dtype'"."""
    params = {"w": jnp.ones(3), "s": 1.0}
    grads = [{"w": jnp.full(3, 1.0), "s": 1.0}, {"w": jnp.full(3, 2.0), "s": 3.0}]
    mean = {"w": jnp.full(3, 1.5), "s": 2.0}
    weighted = mode == "jit_weighted_skip"
    opt = jaxaccum.multi_steps(optimizers()[name](), 2, skip_nonfinite=weighted)
    update = opt.update if mode == "eager" else jax.jit(opt.update)
    state = opt.init(params)
    for g in grads:
        u, state = update(g, state, params, **({"weight": 1.0} if weighted else {}))
    plain = optimizers()[name]()
    expected, _ = jax.jit(plain.update)(mean, plain.init(params), params)
    assert_trees_close(u, expected, 1e-6)
    assert float(jnp.abs(u["s"])) > 0


@pytest.mark.parametrize("how", ["nonfinite", "zero_weight", "rejected"])
def test_has_updated_false_after_skipped_window(how):
    """Before the fix has_updated was True here (mini_step == 0 and a step made earlier)."""
    opt = jaxaccum.multi_steps(
        optax.sgd(0.1),
        2,
        skip_nonfinite=how == "nonfinite",
        should_skip_update_fn=optax.skip_not_finite if how == "rejected" else None,
    )
    good = micro_grads()[0]
    bad = good if how == "zero_weight" else jax.tree.map(lambda g: g * jnp.inf, good)
    w_bad = 0.0 if how == "zero_weight" else 1.0
    outs, state = feed(opt, [good, good, bad, bad], weights=[1.0, 1.0, w_bad, w_bad])
    assert int(state.gradient_step) == 1
    assert not bool(jaxaccum.has_updated(state)) and not bool(opt.has_updated(state))
    assert_zero(outs[-1])
    assert int(state.mini_step) == 0
    assert int(state.skipped) == (0 if how == "zero_weight" else 2)


@pytest.mark.parametrize("skip", [False, True])
def test_zero_weight_window_makes_no_step(skip):
    """Before the fix (without skip_nonfinite) Adam got a zero gradient: count and moments moved."""
    opt = jaxaccum.multi_steps(optax.adam(1e-1), 2, skip_nonfinite=skip)
    g = micro_grads()
    outs, state = feed(opt, [g[0], g[1], g[2], g[3]], weights=[2.0, 1.0, 0.0, 0.0])
    _, after_first = feed(opt, g[:2], weights=[2.0, 1.0])
    assert_zero(outs[-1])
    assert int(state.gradient_step) == 1 and int(state.mini_step) == 0
    assert float(state.acc_weight) == 0.0 and int(state.skipped) == 0
    assert_equal_trees(state.inner_opt_state, after_first.inner_opt_state)
    assert_zero(state.acc_grads)
    # the next window steps from where the first left off
    outs2, _ = feed(
        opt, [g[0], g[1], g[2], g[3], g[0], g[1]], weights=[2.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    )
    outs3, _ = feed(opt, [g[0], g[1], g[0], g[1]], weights=[2.0, 1.0, 1.0, 1.0])
    assert_equal_trees(outs2[-1], outs3[-1])


def test_zero_weight_nonfinite_micro_batch_not_counted():
    """A 0/0 gradient with weight 0 is nothing to skip; before the fix it counted in skipped."""
    g = micro_grads()
    opt = jaxaccum.multi_steps(optax.sgd(1.0), 3, skip_nonfinite=True)
    outs, state = feed(opt, [g[0], set_first(g[1], jnp.nan), g[2]], weights=[1.0, 0.0, 3.0])
    assert int(state.skipped) == 0 and int(state.gradient_step) == 1
    expected = jax.tree.map(lambda a, c: -(a + 3 * c) / 4, g[0], g[2])
    assert_trees_close(outs[-1], expected, 1e-6)


@pytest.mark.parametrize(
    ("weight", "shown"),
    [(-1, "-1"), (np.float32(-2.0), "-2.0"), (jnp.asarray(-3.0), "-3.0"), (float("nan"), "nan")],
)
def test_concrete_negative_weight_rejected(weight, shown):
    """Before the fix a negative weight was accepted and cancelled other micro-batches."""
    opt = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    with refuses(ValueError, match=rf"weight must be .*>= 0; got weight={shown}"):
        opt.update(PARAMS, opt.init(PARAMS), PARAMS, weight=weight)


def test_traced_negative_weight_poisons_the_total():
    """Weights 2 and -2 must not sum to a total of 0 (a window skipped silently): NaN steps."""
    g = micro_grads()
    opt = jaxaccum.multi_steps(optax.sgd(1.0), 3)
    _, state = feed(opt, g[:2], weights=[2.0, -2.0])
    assert bool(jnp.isnan(state.acc_weight))
    outs, state = feed(jaxaccum.multi_steps(optax.sgd(1.0), 2), g[:2], weights=[2.0, -2.0])
    assert all(bool(jnp.all(jnp.isnan(u))) for u in jax.tree.leaves(outs[-1]))
    assert bool(jaxaccum.has_updated(state)) and int(state.gradient_step) == 1


@pytest.mark.parametrize("skip", [False, True])
def test_traced_negative_weight(skip):
    """A traced negative weight poisons the window (NaN) or, with skip_nonfinite, is skipped."""
    g = micro_grads()
    opt = jaxaccum.multi_steps(optax.sgd(1.0), 3, skip_nonfinite=skip)
    outs, state = feed(opt, [g[0], g[1], g[2]], weights=[2.0, -2.0, 1.0])
    if skip:
        assert int(state.skipped) == 1 and int(state.gradient_step) == 1
        assert_trees_close(outs[-1], jax.tree.map(lambda a, c: -(2 * a + c) / 3, g[0], g[2]), 1e-6)
    else:
        assert all(bool(jnp.all(jnp.isnan(u))) for u in jax.tree.leaves(outs[-1]))
        assert int(state.gradient_step) == 1 and int(state.skipped) == 0
    assert bool(jaxaccum.has_updated(state))


# --- extra args --------------------------------------------------------------------------------


def scale_by_value():
    """An inner transform that needs an extra arg: multiplies updates by ``value=``."""

    def update(updates, state, params=None, *, value, **extra_args):
        del params, extra_args
        return jax.tree.map(lambda u: u * value, updates), state + value

    return optax.GradientTransformationExtraArgs(lambda params: jnp.zeros(()), update)


def test_extra_args_reach_inner_on_emit():
    opt = jaxaccum.multi_steps(scale_by_value(), 2)
    update = jax.jit(opt.update)
    g = micro_grads()
    state = opt.init(PARAMS)
    u1, state = update(g[0], state, PARAMS, value=5.0)
    u2, state = update(g[1], state, PARAMS, value=3.0)
    assert_zero(u1)
    assert_trees_close(u2, jax.tree.map(lambda a, b: 3.0 * (a + b) / 2, g[0], g[1]), 1e-6)
    assert float(state.inner_opt_state) == 3.0  # only the emitting call's value reached inner


def test_reduce_on_plateau_inner_matches_optax():
    """optax.contrib.reduce_on_plateau reads value=; the scale halves after a plateau."""
    make = lambda: optax.chain(  # noqa: E731
        optax.sgd(1.0), optax.contrib.reduce_on_plateau(factor=0.5, patience=1, cooldown=0)
    )
    g = micro_grads()[0]
    scales = {}
    for who, opt in (
        ("ours", jaxaccum.multi_steps(make(), 2)),
        ("optax", optax.MultiSteps(make(), 2).gradient_transformation()),
    ):
        update = jax.jit(opt.update)
        state = opt.init(PARAMS)
        for _ in range(8):  # 4 windows, constant loss: a plateau
            _, state = update(g, state, PARAMS, value=jnp.asarray(1.0))
        scales[who] = float(state.inner_opt_state[1].scale)
    assert scales["ours"] == scales["optax"] < 1.0


# --- drop-in for optax.MultiSteps --------------------------------------------------------------


def test_dropin_names():
    assert jaxaccum.MultiStepsState._fields[:5] == optax.MultiStepsState._fields
    opt = jaxaccum.multi_steps(optax.sgd(0.1), every_k_schedule=2)
    assert isinstance(opt, optax.GradientTransformationExtraArgs)
    assert opt.gradient_transformation() is opt
    init, update = opt  # still the (init, update) pair optax's combinators unpack
    assert init is opt.init and update is opt.update
    state = opt.init(PARAMS)
    assert state.skip_state == ()
    skipping = jaxaccum.multi_steps(
        optax.sgd(0.1), 2, should_skip_update_fn=optax.skip_not_finite
    ).init(PARAMS)
    theirs = optax.MultiSteps(optax.sgd(0.1), 2, should_skip_update_fn=optax.skip_not_finite)
    assert_equal_trees(skipping.skip_state, theirs.init(PARAMS).skip_state)


def test_inject_hyperparams_read_and_modified_between_steps():
    """state.inner_opt_state.hyperparams works as with optax.MultiSteps: 3 windows of 2 calls."""
    make = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1)  # noqa: E731
    g = micro_grads()
    grads = [g[0], g[1], g[2], g[3], g[0], g[1]]
    new_lr = {2: 0.01, 4: 0.0}  # set before calls 2 and 4, i.e. for windows 2 and 3

    def before(i, state):
        if i in new_lr:
            hyperparams = state.inner_opt_state.hyperparams
            hyperparams["learning_rate"] = jnp.asarray(
                new_lr[i], hyperparams["learning_rate"].dtype
            )

    results = {}
    for who, opt in (
        ("ours", jaxaccum.multi_steps(make(), every_k_schedule=2)),
        ("optax", optax.MultiSteps(make(), every_k_schedule=2)),
    ):
        update = jax.jit(opt.update)
        params, state = PARAMS, opt.init(PARAMS)
        lrs, before_last_window = [], None
        for i, grad in enumerate(grads):
            before(i, state)
            if i % 2 == 0:
                lrs.append(float(state.inner_opt_state.hyperparams["learning_rate"]))
            if i == 4:
                before_last_window = params
            u, state = update(grad, state, params)
            params = optax.apply_updates(params, u)
        assert lrs == pytest.approx([0.1, 0.01, 0.0])
        results[who] = (params, before_last_window, update._cache_size(), state)
    params, before_last_window, compiles, state = results["ours"]
    assert_equal_trees(params, before_last_window)  # lr 0 in the last window: no move
    assert compiles == 1 and int(state.inner_opt_state.count) == 3
    assert max_rel_diff(params, PARAMS) > 1e-3
    ref64 = optax_run64(make, 2, grads, before=before)
    assert_within_rounding(params, results["optax"][0], ref64)


def optax_run64(make, k, grads, before=None, **kwargs):
    """optax.MultiSteps in float64 on the same gradients: a reference free of float32 rounding.

    ``before(i, state)`` runs before call ``i`` (to change a hyperparameter, say).
    """
    with jax.enable_x64(True):
        opt = optax.MultiSteps(make(), k, **kwargs)
        update = jax.jit(opt.update)
        params = to_float64(PARAMS)
        state = opt.init(params)
        for i, g in enumerate(grads):
            if before is not None:
                before(i, state)
            u, state = update(to_float64(g), state, params)
            params = optax.apply_updates(params, u)
        return jax.tree.map(lambda x: np.asarray(x, np.float64), params)


def scaled_grads(scales):
    """Micro-batch gradients at PARAMS times ``scales`` (inf or 1e2 to trigger skipping)."""
    g = micro_grads()
    return [jax.tree.map(lambda x, s=s: x * s, g[i % 4]) for i, s in enumerate(scales)]


SKIP_FNS = {
    "skip_not_finite": (optax.skip_not_finite, [1, jnp.inf, 1, 1, 1, 1, 1, jnp.nan, 1, 1]),
    "skip_large_updates": (
        functools.partial(optax.skip_large_updates, max_squared_norm=100.0),
        [1, 1, 1e2, 1, 1, 1e2, 1, 1, 1, 1],
    ),
}


@pytest.mark.parametrize(
    ("fn_name", "use_grad_mean"), [("skip_not_finite", True), ("skip_large_updates", False)]
)
def test_should_skip_update_fn_matches_optax(fn_name, use_grad_mean):
    """optax's skip functions: a rejected call is as if it never happened, as in optax."""
    fn, scales = SKIP_FNS[fn_name]
    grads = scaled_grads(scales)
    make = lambda: optax.adam(1e-2)  # noqa: E731
    final = {}
    for who, opt in (
        (
            "ours",
            jaxaccum.multi_steps(
                make(), every_k_schedule=4, use_grad_mean=use_grad_mean, should_skip_update_fn=fn
            ),
        ),
        (
            "optax",
            optax.MultiSteps(
                make(), every_k_schedule=4, use_grad_mean=use_grad_mean, should_skip_update_fn=fn
            ),
        ),
    ):
        update = jax.jit(opt.update)
        params, state = PARAMS, opt.init(PARAMS)
        for g in grads:
            u, state = update(g, state, params)
            params = optax.apply_updates(params, u)
        final[who] = (params, state)
    (ours, ours_state), (theirs, theirs_state) = final["ours"], final["optax"]
    # 10 calls, 2 rejected: 2 optimizer steps, and the third window holds 0 micro-batches
    assert int(ours_state.gradient_step) == int(theirs_state.gradient_step) == 2
    assert int(ours_state.mini_step) == int(theirs_state.mini_step) == 0
    assert int(ours_state.skipped) == 2
    assert_trees_close(ours_state.skip_state, theirs_state.skip_state, 1e-6)
    assert int(ours_state.inner_opt_state[0].count) == 2
    ref64 = optax_run64(make, 4, grads, should_skip_update_fn=fn, use_grad_mean=use_grad_mean)
    assert_within_rounding(ours, theirs, ref64)
    assert max_rel_diff(ours, PARAMS) > 1e-3


def test_resumed_with_smaller_k():
    """A state holding 3 micro-batches, resumed with k=2: a rejected call still does nothing,
    the next kept call ends the window with all 4."""
    g = micro_grads()
    _, state = feed(jaxaccum.multi_steps(optax.sgd(1.0), 4), g[:3])
    opt = jaxaccum.multi_steps(optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite)
    update = jax.jit(opt.update)
    u, state = update(jax.tree.map(lambda x: x * jnp.nan, g[3]), state, PARAMS)
    assert_zero(u)
    assert int(state.mini_step) == 3 and not bool(opt.has_updated(state))
    u, state = update(g[3], state, PARAMS)
    assert_trees_close(u, jax.tree.map(lambda *x: -sum(x) / 4, *g), 1e-6)
    assert int(state.mini_step) == 0 and int(state.gradient_step) == 1


def test_use_grad_mean_false_emits_the_weighted_sum():
    g = micro_grads()
    opt = jaxaccum.multi_steps(optax.sgd(1.0), 3, use_grad_mean=False)
    outs, state = feed(opt, g[:3], weights=[1.0, 0.0, 2.0])
    assert_trees_close(outs[-1], jax.tree.map(lambda a, c: -(a + 2 * c), g[0], g[2]), 1e-6)
    outs, state = feed(opt, g[:3])
    assert_trees_close(outs[-1], jax.tree.map(lambda a, b, c: -(a + b + c), *g[:3]), 1e-6)
    assert bool(jaxaccum.has_updated(state))


def test_has_updated_differs_from_optax_after_a_rejected_call():
    """The documented difference: optax says True after a rejected call following a step."""
    fn = optax.skip_not_finite
    grads = scaled_grads([1, 1, jnp.inf])
    ours = jaxaccum.multi_steps(optax.sgd(0.1), 2, should_skip_update_fn=fn)
    theirs = optax.MultiSteps(optax.sgd(0.1), 2, should_skip_update_fn=fn)
    _, state = feed(ours, grads)
    _, their_state = feed(theirs.gradient_transformation(), grads)
    assert not bool(ours.has_updated(state))
    assert bool(theirs.has_updated(their_state))


def test_apply_if_finite_skips_only_the_window_with_a_nan():
    """An inner optax.apply_if_finite skips the NaN window; the next window steps (the
    accumulator is reset to zeros, not multiplied, so no NaN is left behind)."""
    opt = jaxaccum.multi_steps(optax.apply_if_finite(optax.sgd(1.0), 10), every_k=2)
    params = jnp.zeros(1)
    state = opt.init(params)
    moved = []
    for g in (1.0, jnp.nan, 1.0, 1.0):
        updates, state = opt.update(jnp.array([g]), state, params)
        moved.append(float(updates[0]))
    assert moved == [0.0, 0.0, 0.0, -1.0]
    assert int(state.inner_opt_state.total_notfinite) == 1
    assert float(state.acc_grads[0]) == 0.0


def test_acc_grads_holds_the_weighted_sum_mid_window():
    """The docstring's promise: mid-window, acc_grads is sum(w_i g_i) and acc_weight sum(w_i)."""
    opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=3)
    state = opt.init(jnp.zeros(2))
    _, state = opt.update(jnp.array([1.0, 2.0]), state, weight=2.0)
    _, state = opt.update(jnp.array([3.0, 5.0]), state, weight=1.0)
    np.testing.assert_allclose(state.acc_grads, [5.0, 9.0])
    assert float(state.acc_weight) == 3.0


# --- caller-owned windows: update(..., emit=True) ---------------------------------------------


def tree_mean(trees, weights=None):
    """The (weighted) mean of gradient trees, summed in order in float32, then divided once."""
    weights = [1.0] * len(trees) if weights is None else weights
    total = jax.tree.map(lambda *x: sum(w * xi for w, xi in zip(weights, x, strict=True)), *trees)
    return jax.tree.map(lambda t: t / sum(weights), total)


def leafwise_diff(actual, expected):
    """Max over the leaves of max |a - e| / max |e|; integer leaves (counts) must be equal."""
    worst = 0.0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype
        if not np.issubdtype(e.dtype, np.floating):
            np.testing.assert_array_equal(a, e)
            continue
        scale = max(float(np.max(np.abs(e.astype(np.float64)))), 1e-30)
        worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - e))) / scale)
    return worst


def assert_leafwise_close(actual, expected, rtol=4 * EPS32):
    d = leafwise_diff(actual, expected)
    assert d <= rtol, f"max leafwise difference relative to the leaf's max is {d:.3e} > {rtol:.1e}"


def plain_steps(params, means, make=lambda: optax.adam(1e-2)):
    """The plain optimizer, one step per mean gradient: the reference for caller-ended windows.

    Returns the params after each step and the final inner state.
    """
    opt = make()
    update = jax.jit(opt.update)
    state, trajectory = opt.init(params), []
    for mean in means:
        u, state = update(mean, state, params)
        params = optax.apply_updates(params, u)
        trajectory.append(params)
    return trajectory, state


@pytest.mark.parametrize(
    ("name", "weighted"), [("adam", False), ("adam", True), ("momentum", False)]
)
def test_emit_ends_a_window_early_with_one_step_on_its_mean(name, weighted):
    """A window of 3 (k = 4) ended by emit=True is one inner step on the mean of its 3 gradients
    (params and inner state); the next window starts empty and ends at k as always."""
    make = optimizers()[name]
    g = micro_grads()
    weights = [2.0, 1.0, 5.0, 3.0, 1.0, 4.0, 2.0] if weighted else [1.0] * 7
    grads = [g[0], g[1], g[2], g[3], g[0], g[1], g[2]]
    emits = [False, False, True, False, False, False, False]
    opt = jaxaccum.multi_steps(make(), every_k=4)
    update = jax.jit(opt.update)
    params, state = PARAMS, opt.init(PARAMS)
    outs, flags = [], []
    for grad, w, e in zip(grads, weights, emits, strict=True):
        kwargs = {"weight": w} if weighted else {}
        u, state = update(grad, state, params, emit=jnp.asarray(e), **kwargs)
        params = optax.apply_updates(params, u)
        outs.append(u)
        flags.append(bool(opt.has_updated(state)))
        if e:
            after_first = (params, state)
    assert flags == [False, False, True, False, False, False, True]
    for i in (0, 1, 3, 4, 5):
        assert_zero(outs[i])
    means = [tree_mean(grads[:3], weights[:3]), tree_mean(grads[3:], weights[3:])]
    trajectory, ref_state = plain_steps(PARAMS, means, make)
    params1, state1 = after_first
    assert int(state1.mini_step) == 0 and int(state1.gradient_step) == 1
    assert float(state1.acc_weight) == 0.0
    assert_zero(state1.acc_grads)
    assert_leafwise_close(params1, trajectory[0])
    ref_state1 = plain_steps(PARAMS, means[:1], make)[1]
    assert_leafwise_close(state1.inner_opt_state, ref_state1)
    # the second window held exactly its own 4 gradients (nothing left over from the first)
    assert_leafwise_close(params, trajectory[1])
    assert_leafwise_close(state.inner_opt_state, ref_state)
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0
    # a mean divided by k = 4 instead of the window's 3 would be far off (Adam's first step is
    # scale-free, but not its moments, nor the momentum step)
    wrong_params, wrong_state = plain_steps(
        PARAMS, [jax.tree.map(lambda m: m * 3 / 4, means[0])], make
    )
    assert leafwise_diff(state1.inner_opt_state, wrong_state) > 0.1
    if name == "momentum":
        assert max_rel_diff(params1, wrong_params[0]) > 1e-3


@pytest.mark.parametrize("every_k", [100, None])
def test_random_length_windows_equal_adam_on_each_windows_mean(every_k):
    """10 windows of seeded random lengths 1..7, each ended by emit=True: the same params
    trajectory as 10 optax.adam steps on each window's mean gradient."""
    lengths = np.random.default_rng(1234).integers(1, 8, size=10).tolist()
    assert len(set(lengths)) >= 4 and sum(lengths) < 100  # uneven, and no window reaches k
    micro = [random_batch(jax.random.key(100 + i), 8) for i in range(sum(lengths))]
    grad_fn = jax.jit(jax.grad(mse_loss))
    opt = jaxaccum.multi_steps(optax.adam(1e-2), every_k=every_k)
    update = jax.jit(opt.update)
    params, state = PARAMS, opt.init(PARAMS)
    ours, ref_params, ref_opt = [], PARAMS, optax.adam(1e-2)
    ref_update = jax.jit(ref_opt.update)
    ref_state, reference = ref_opt.init(PARAMS), []
    calls = iter(micro)
    for n in lengths:
        window = [next(calls) for _ in range(n)]
        for j, batch in enumerate(window):
            u, state = update(grad_fn(params, batch), state, params, emit=jnp.asarray(j == n - 1))
            assert bool(opt.has_updated(state)) == (j == n - 1)
            params = optax.apply_updates(params, u)
        ours.append(params)
        # the reference, by hand: plain Adam on the window's mean, at the reference's params
        mean = tree_mean([grad_fn(ref_params, batch) for batch in window])
        u, ref_state = ref_update(mean, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
        reference.append(ref_params)
    for step, (p, r) in enumerate(zip(ours, reference, strict=True)):
        d = max_rel_diff(p, r)
        assert d <= 1e-6, f"window {step} (length {lengths[step]}): {d:.3e}"
    assert_leafwise_close(state.inner_opt_state, ref_state, 1e-6)
    assert int(state.gradient_step) == 10 and int(state.mini_step) == 0
    assert int(state.inner_opt_state[0].count) == 10
    assert update._cache_size() == 1
    assert max_rel_diff(params, PARAMS) > 1e-3  # the trajectory moved


def test_traced_emit_compiles_once_and_matches_eager():
    """A traced emit flag: one trace and one compilation serve both values; the results equal
    eager calls with Python bools. Windows end by emit (calls 1, 5) and at k = 3 (call 4)."""
    g = micro_grads()
    grads = [g[i % 4] for i in range(7)]
    emits = [False, True, False, False, False, True, False]
    opt = jaxaccum.multi_steps(optax.adam(1e-2), every_k=3)
    traces = []

    @jax.jit
    def step(grad, state, params, flag):
        traces.append(1)  # runs once per trace, not per call
        u, state = opt.update(grad, state, params, emit=flag)
        return optax.apply_updates(params, u), state

    runs = {}
    for mode in ("jit", "eager"):
        params, state = PARAMS, opt.init(PARAMS)
        flags, trajectory = [], []
        for grad, e in zip(grads, emits, strict=True):
            if mode == "jit":
                params, state = step(grad, state, params, jnp.asarray(e))
            else:
                u, state = opt.update(grad, state, params, emit=e)
                params = optax.apply_updates(params, u)
            flags.append(bool(opt.has_updated(state)))
            trajectory.append(params)
        runs[mode] = (flags, trajectory, state)
    assert len(traces) == 1 and step._cache_size() == 1
    (jit_flags, jit_traj, jit_state), (eager_flags, eager_traj, eager_state) = runs.values()
    assert jit_flags == eager_flags == [False, True, False, False, True, True, False]
    for a, b in zip(jit_traj, eager_traj, strict=True):
        assert_trees_close(a, b, 4 * EPS32)
    assert_trees_close(jit_state, eager_state, 4 * EPS32)
    assert int(jit_state.gradient_step) == 3 and int(jit_state.mini_step) == 1
    # Python bools through jax.jit are traced too: still one compilation
    update = jax.jit(opt.update)
    state = opt.init(PARAMS)
    for e in (True, False, True):
        _, state = update(g[0], state, PARAMS, emit=e)
    assert update._cache_size() == 1 and int(state.gradient_step) == 2


def test_emit_false_or_at_k_is_unchanged():
    """emit=False (Python or traced) changes nothing, nor does emit=True on the k-th call."""
    g = micro_grads()
    opt = jaxaccum.multi_steps(optax.adam(1e-2), every_k=2)
    plain, plain_state = feed(opt, g)
    for emit in (False, jnp.asarray(False)):
        update = jax.jit(functools.partial(opt.update, emit=emit))
        state, outs = opt.init(PARAMS), []
        for grad in g:
            u, state = update(grad, state, PARAMS)
            outs.append(u)
        assert_equal_trees(outs, plain)
        assert_equal_trees(state, plain_state)
    state, outs = opt.init(PARAMS), []
    for i, grad in enumerate(g):  # emit on each window's last call: the same windows
        u, state = jax.jit(opt.update)(grad, state, PARAMS, emit=jnp.asarray(i % 2 == 1))
        outs.append(u)
    assert_equal_trees(outs, plain)
    assert_equal_trees(state, plain_state)


def test_every_k_none_windows_end_only_at_emit():
    g = micro_grads()
    opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=None)
    outs, state = feed(opt, g + g)  # 8 calls, none emitting: one window of 8
    for u in outs:
        assert_zero(u)
    assert int(state.mini_step) == 8 and int(state.gradient_step) == 0
    u, state = opt.update(g[0], state, PARAMS, emit=True)
    assert_trees_close(u, jax.tree.map(lambda m: -m, tree_mean(g + g + [g[0]])), 4 * EPS32)
    assert int(state.mini_step) == 0 and int(state.gradient_step) == 1


def test_emit_ends_the_window_even_if_this_call_is_left_out():
    """A rejected (should_skip_update_fn) or non-finite (skip_nonfinite) last call: the window
    still ends, with what it held; a window holding nothing ends without a step."""
    g = micro_grads()
    bad = jax.tree.map(lambda x: x * jnp.nan, g[2])
    expected = jax.tree.map(lambda a, b: -(a + b) / 2, g[0], g[1])
    for kwargs in ({"should_skip_update_fn": optax.skip_not_finite}, {"skip_nonfinite": True}):
        opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=None, **kwargs)
        update = jax.jit(opt.update)
        state = opt.init(PARAMS)
        for grad in g[:2]:
            _, state = update(grad, state, PARAMS, emit=jnp.asarray(False))
        u, state = update(bad, state, PARAMS, emit=jnp.asarray(True))
        assert_trees_close(u, expected, 4 * EPS32)
        assert int(state.skipped) == 1 and int(state.gradient_step) == 1
        assert int(state.mini_step) == 0 and bool(opt.has_updated(state))
        u, state = update(bad, state, PARAMS, emit=jnp.asarray(True))  # an empty window
        assert_zero(u)
        assert int(state.gradient_step) == 1 and not bool(opt.has_updated(state))
        assert int(state.mini_step) == 0 and int(state.skipped) == 2


def test_emit_on_a_window_of_total_weight_zero_makes_no_step():
    g = micro_grads()
    opt = jaxaccum.multi_steps(optax.adam(1e-2), every_k=4)
    outs, state = feed(opt, g[:2], weights=[0.0, 0.0])
    u, state = opt.update(g[2], state, PARAMS, weight=0.0, emit=True)
    assert_zero(u)
    assert int(state.gradient_step) == 0 and int(state.inner_opt_state[0].count) == 0
    assert int(state.mini_step) == 0 and not bool(opt.has_updated(state))


@pytest.mark.parametrize(
    ("emit", "error", "message"),
    [
        (jnp.ones(3), TypeError, r"dtype float32 and shape \(3,\)"),
        (jnp.asarray(1.0), TypeError, r"dtype float32 and shape \(\)"),
        (np.int32(1), TypeError, r"dtype int32 and shape \(\)"),
        (1, TypeError, r"got 1 of type int"),
        ("yes", TypeError, r"got 'yes' of type str"),
        (jnp.ones(2, bool), ValueError, r"one flag for the call; got an array of dtype bool and "),
    ],
)
def test_bad_emit_rejected(emit, error, message):
    opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=2)
    expected = r"emit must be None, a bool or a boolean scalar array \(dtype bool, shape \(\)\)"
    with refuses(error, match=r"jaxaccum\.multi_steps\(\.\.\.\)\.update: " + expected):
        opt.update(PARAMS, opt.init(PARAMS), PARAMS, emit=emit)
    with refuses(error, match=message):
        opt.update(PARAMS, opt.init(PARAMS), PARAMS, emit=emit)


def test_bad_traced_emit_rejected_at_trace_time():
    opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=2)
    update = jax.jit(opt.update)
    with refuses(TypeError, match=r"multi_steps\(\.\.\.\)\.update: emit .*dtype float32"):
        update(PARAMS, opt.init(PARAMS), PARAMS, emit=jnp.ones(3))


def test_every_k_none_validation():
    with refuses(ValueError, match=r"jaxaccum\.multi_steps: .*not both; got every_k=None"):
        jaxaccum.multi_steps(optax.sgd(0.1), None, every_k_schedule=3)
    with refuses(TypeError, match=r"jaxaccum\.multi_steps needs every_k .*every_k=None"):
        jaxaccum.multi_steps(optax.sgd(0.1), every_k_schedule=None)
    state = jaxaccum.multi_steps(optax.sgd(0.1), every_k=None).init(PARAMS)
    assert int(state.mini_step) == 0


# --- two skip mechanisms together: should_skip_update_fn and skip_nonfinite ------------------

D = 3
LARGE = 50.0  # should_skip_update_fn below rejects a gradient whose squared norm exceeds this


def _reject_large(updates, gradient_step, params):
    """Rejects a large (finite) gradient; a NaN one is not large (NaN > x is False), so
    skip_nonfinite is what leaves it out. Counts its rejections in skip_state."""
    sq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(updates))
    return sq > LARGE, ()


def _model_both(calls, k, hook, skip_nonfinite):
    """The docstring's semantics, in float64: per call (update, state fields) expected.

    - ``should_skip_update_fn`` rejecting a call: not accumulated, not a call of the window
      (mini_step unchanged), never ends it, counted in ``skipped``;
    - ``skip_nonfinite``: a kept call whose gradient is not finite (and whose weight is not 0)
      is left out of the mean but still a call of the window, counted in ``skipped``;
    - a micro-batch left out by both counts once; a weight-0 one adds nothing, uncounted;
    - the window ends at k kept calls: the update is -(sum w g / sum w) (SGD(1)), no step and
      zero updates if the total weight is 0.
    """
    out, acc, total, mini, steps, skipped = [], np.zeros(D), 0.0, 0, 0, 0
    for g, w in calls:
        finite = bool(np.all(np.isfinite(g)))
        rejected = hook == "large" and finite and float(np.sum(g**2)) > LARGE
        rejected |= hook == "not_finite" and not finite
        nonfinite_out = skip_nonfinite and w != 0 and not finite
        skipped += int(rejected or nonfinite_out)
        emitted = False
        update = np.zeros(D)
        if not rejected:
            mini += 1
            if w != 0 and not nonfinite_out:
                acc, total = acc + w * g, total + w
            if mini >= k:
                if total != 0:
                    update, emitted, steps = -acc / total, True, steps + 1
                acc, total, mini = np.zeros(D), 0.0, 0
        out.append(dict(update=update, mini=mini, steps=steps, skipped=skipped,
                        emitted=emitted, total=total))
    return out


@settings(max_examples=examples(8), deadline=None, report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), k=st.integers(1, 3), n=st.integers(1, 7),
       hook=st.sampled_from(["large", "not_finite"]), skip_nonfinite=st.booleans(),
       weighted=st.booleans())
def test_should_skip_update_fn_and_skip_nonfinite_together(seed, k, n, hook, skip_nonfinite,
                                                           weighted):
    """Both skip mechanisms switched on at once against the float64 model of the docstring:
    which calls are kept, the window's length, the skipped count and the emitted update."""
    rng = np.random.default_rng(seed)
    calls = []
    for _ in range(n):
        g = rng.normal(size=D).astype(np.float32)
        kind = rng.choice(["plain", "plain", "large", "nan"])
        if kind == "large":
            g = g * 0 + 6.0  # squared norm 36 D > LARGE
        elif kind == "nan":
            g[rng.integers(D)] = np.nan
        w = float(rng.choice([0.0, 1.0, 2.0])) if weighted else 1.0
        calls.append((g, w))
    fn = _reject_large if hook == "large" else optax.skip_not_finite
    opt = jaxaccum.multi_steps(optax.sgd(1.0), every_k=k, should_skip_update_fn=fn,
                               skip_nonfinite=skip_nonfinite)
    params = jnp.zeros(D, jnp.float32)
    state = opt.init(params)
    update = jax.jit(opt.update)
    for (g, w), want in zip(calls, _model_both(calls, k, hook, skip_nonfinite), strict=True):
        u, state = update(jnp.asarray(g), state, params,
                          weight=jnp.float32(w) if weighted else None)
        assert int(state.mini_step) == want["mini"]
        assert int(state.gradient_step) == want["steps"]
        assert int(state.skipped) == want["skipped"]
        assert bool(state.emitted) == want["emitted"] == bool(opt.has_updated(state))
        assert float(state.acc_weight) == want["total"]  # sums of small integers: exact
        # the mean of <= k float32 gradients: float32 rounding of |terms| (k + 4 roundings)
        # (NaN where the model says NaN: a NaN gradient without skip_nonfinite reaches the update)
        finite = want["update"][np.isfinite(want["update"])]
        size = float(np.max(np.abs(finite))) if finite.size else 0.0
        bound = 2 * (k + 4) * np.finfo(np.float32).eps * size + 1e-30
        np.testing.assert_allclose(np.asarray(u, np.float64), want["update"], rtol=0,
                                   atol=bound, equal_nan=True)


def test_multi_steps_unknown_keyword_names_the_fix():
    with refuses(TypeError, match=r"jaxaccum\.multi_steps: unknown keyword argument "
                 r"skip_non_finite=True; did you mean skip_nonfinite=\? .*takes \['every_k'"):
        jaxaccum.multi_steps(optax.sgd(1.0), every_k=2, skip_non_finite=True)
    with refuses(TypeError, match=r"unknown keyword argument weighted=True \(an option of "
                 r"jaxaccum\.Options: .*update\(\.\.\., weight=n\)\)"):
        jaxaccum.multi_steps(optax.sgd(1.0), every_k=2, weighted=True)
    with refuses(TypeError, match=r"unknown keyword argument colour='red'; multi_steps"):
        jaxaccum.multi_steps(optax.sgd(1.0), every_k=2, colour="red")


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
