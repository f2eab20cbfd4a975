"""jaxaccum.plan_microbatches: compile-time estimates choose the smallest k that fits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import refuses

import jaxaccum

WIDTH, BATCH = 256, 512
PARAMS = {
    "w1": jnp.zeros((64, WIDTH)),
    "w2": jnp.zeros((WIDTH, WIDTH)),
    "w3": jnp.zeros((WIDTH, 1)),
}
DATA = jax.ShapeDtypeStruct((BATCH, 64), jnp.float32)


def loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    h = jnp.tanh(h @ params["w2"])
    return jnp.mean((h @ params["w3"]) ** 2)


def estimate(k, **kwargs):
    plan = jaxaccum.plan_microbatches(
        loss, PARAMS, DATA, memory_budget=2**40, candidates=[k], **kwargs
    )
    return plan.estimates[k]


def test_estimates_shrink_with_k():
    totals = [estimate(k).total_bytes for k in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]
    e = estimate(1)
    assert e.total_bytes == e.argument_bytes + e.output_bytes - e.alias_bytes + e.temp_bytes
    assert e.argument_bytes >= BATCH * 64 * 4


def test_full_batch_budget_gives_k1():
    plan = jaxaccum.plan_microbatches(loss, PARAMS, DATA, memory_budget=estimate(1).total_bytes)
    assert plan.num_microbatches == 1
    assert list(plan.estimates) == [1]


def test_budget_between_candidates_gives_next_k():
    budget = (estimate(2).total_bytes + estimate(4).total_bytes) // 2
    plan = jaxaccum.plan_microbatches(loss, PARAMS, DATA, memory_budget=budget)
    assert plan.num_microbatches == 4
    assert list(plan.estimates) == [1, 2, 4]
    assert plan.estimates[4].total_bytes <= budget < plan.estimates[2].total_bytes


def test_impossible_budget():
    with refuses(ValueError, match=r"memory_budget=1000 bytes is too small: the smallest"):
        jaxaccum.plan_microbatches(loss, PARAMS, DATA, memory_budget=1000, candidates=[64, 512])


def test_with_optimizer_counts_state_and_donation():
    e = estimate(4, optimizer=optax.adam(1e-3))
    assert e.alias_bytes >= 3 * sum(p.size * 4 for p in jax.tree.leaves(PARAMS))
    assert e.argument_bytes > estimate(4).argument_bytes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_budget": 0}, r"memory_budget must be >= 1; got memory_budget=0"),
        ({"memory_budget": 10, "candidates": [3]}, r"num_microbatches=3 does not divide"),
    ],
)
def test_bad_arguments(kwargs, message):
    with refuses(ValueError, match=message):
        jaxaccum.plan_microbatches(loss, PARAMS, DATA, **kwargs)


def test_candidates_are_tried_smallest_first_in_any_order_given():
    generous = 2**31
    plan = jaxaccum.plan_microbatches(loss, PARAMS, DATA, memory_budget=generous,
                                      candidates=[8, 2, 4])
    assert plan.num_microbatches == 2
    assert list(plan.estimates) == [2]


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
