"""Every bad input the docs list (Guarantees, "Bad input fails at trace time", and the removed
options) raises an error whose message starts with the entry point, names the argument, says
what was expected and received, and gives a fix: tried through each front end that takes it."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import refuses

import jaxaccum

# a fix is an instruction: one of these verbs
FIX = re.compile(r"\b(use|pass|write|call|set|return|give|choose|raise|wrap|remove|drop|build|"
                 r"name|split|pad|reshape|add|keep|make|cast|put|lower|divide|resume|start|"
                 r"compute|mask|read|run)\b", re.IGNORECASE)


def loss(params: Any, batch: Any) -> jax.Array:
    x, y = batch
    return jnp.mean((x @ params["w"] - y) ** 2)


PARAMS = {"w": jnp.ones((3, 1))}
BATCH = (jnp.ones((8, 3)), jnp.ones((8, 1)))


def value_and_grad(fn: Callable[..., Any] = loss, params: Any = PARAMS, batch: Any = BATCH,
                   **options: Any) -> Any:
    return jaxaccum.value_and_grad(fn, **options)(params, batch)


def train_step(fn: Callable[..., Any] = loss, params: Any = PARAMS, batch: Any = BATCH,
               **options: Any) -> Any:
    optimizer = optax.sgd(0.1)
    return jaxaccum.train_step(fn, optimizer, donate=False, **options)(
        params, optimizer.init(params), batch)


FRONTS = {"jaxaccum.value_and_grad": value_and_grad, "jaxaccum.train_step": train_step}

# (case, keyword arguments of the front end, exception type, a name the message must contain)
CASES: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("k does not divide the batch", {"num_microbatches": 3}, ValueError, "num_microbatches"),
    ("k < 1", {"num_microbatches": 0}, ValueError, "num_microbatches"),
    ("both counts", {"num_microbatches": 2, "microbatch_size": 4}, ValueError,
     "microbatch_size"),
    ("no count", {}, ValueError, "num_microbatches"),
    ("leaves of different batch sizes",
     {"num_microbatches": 2, "batch": (jnp.ones((8, 3)), jnp.ones((6, 1)))}, ValueError,
     "batch"),
    ("an empty batch", {"num_microbatches": 2, "batch": (jnp.ones((0, 3)), jnp.ones((0, 1)))},
     ValueError, "batch"),
    ("a non-scalar loss",
     {"num_microbatches": 2, "fn": lambda p, b: (b[0] @ p["w"] - b[1]) ** 2}, ValueError,
     "loss"),
    ("integer parameters", {"num_microbatches": 2, "params": {"w": jnp.ones((3, 1), jnp.int32)}},
     TypeError, "int32"),
    ("a weighted loss that returns a plain loss", {"num_microbatches": 2, "weighted": True},
     TypeError, "weighted"),
    ("an unknown option", {"num_microbatches": 2, "num_microbatch": 2}, TypeError,
     "did you mean num_microbatches="),
    *[(f"the removed option {name}=", {"num_microbatches": 2, name: value}, TypeError, name)
      for name, value in (("remat", True), ("aux_reduce", "sum"), ("data_axis", "data"),
                          ("fsdp", "step"), ("param_shardings", None))],
]


@pytest.mark.parametrize("front", list(FRONTS))
@pytest.mark.parametrize(("case", "kwargs", "kind", "names"), CASES, ids=[c[0] for c in CASES])
def test_documented_bad_input_says_where_what_and_how_to_fix(front, case, kwargs, kind, names):
    with pytest.raises(kind) as info:
        FRONTS[front](**kwargs)
    message = str(info.value)
    assert message.startswith(front), f"{case}: the message does not name {front}: {message}"
    assert names in message, f"{case}: the message does not name {names!r}: {message}"
    assert FIX.search(message.split(":", 1)[1]), f"{case}: the message gives no fix: {message}"
    assert "ShapeDtypeStruct" not in message and "Traced<" not in message, (
        f"{case}: the message shows JAX internals: {message}")


def test_coupled_options_it_cannot_honour_name_the_one_that_can():
    for option in ("noise_scale", "weighted", "skip_nonfinite", "max_microbatches"):
        value = 4 if option == "max_microbatches" else True
        with pytest.raises(TypeError) as info:
            jaxaccum.coupled_value_and_grad(lambda p, b: b[0], lambda p, z, b: jnp.sum(z),
                                            num_microbatches=2, **{option: value})
        message = str(info.value)
        assert message.startswith("jaxaccum.coupled_value_and_grad") and option in message
        assert FIX.search(message.split(":", 1)[1]), message


@pytest.mark.parametrize("entry", ["jaxaccum.coupled_value_and_grad",
                                   "jaxaccum.coupled_train_step"])
@pytest.mark.parametrize("counts", [{"num_microbatches": 3}, {"microbatch_size": 3}, {}])
def test_coupled_count_errors_suggest_only_options_it_takes(entry, counts):
    """A bad count on a coupled entry point: the fix it gives never names an option that entry
    point refuses (jaxaccum._coupled.NOT_COUPLED)."""
    from jaxaccum._coupled import NOT_COUPLED

    encode = lambda p, b: b[0] @ p["w"]  # noqa: E731
    coupled_loss = lambda p, z, b: jnp.mean(z ** 2)  # noqa: E731
    with pytest.raises(ValueError) as info:
        if entry.endswith("value_and_grad"):
            jaxaccum.coupled_value_and_grad(encode, coupled_loss, **counts)(PARAMS, BATCH)
        else:
            opt = optax.sgd(0.1)
            jaxaccum.coupled_train_step(encode, coupled_loss, opt, donate=False, **counts)(
                PARAMS, opt.init(PARAMS), BATCH)
    message = str(info.value)
    assert message.startswith(entry), message
    assert FIX.search(message.split(":", 1)[1]), message
    assert not [name for name in NOT_COUPLED if name in message], message


@pytest.mark.parametrize("entry", ["jaxaccum.value_and_grad", "jaxaccum.train_step",
                                   "jaxaccum.statistics_first",
                                   "jaxaccum.statistics_first_train_step"])
def test_a_count_that_divides_nothing_suggests_weights_where_they_are_taken(entry):
    """k not dividing the batch, on an entry point that takes ``weighted``: padding the batch
    with weighted=True is one of the fixes offered (statistics-first's forward pass included,
    which meets the batch first)."""
    loss = lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2)  # noqa: E731
    stats = lambda p, b: {"n": jnp.asarray(b[0].shape[0], jnp.float32)}  # noqa: E731
    with_totals = lambda p, b, totals: loss(p, b) / totals["n"]  # noqa: E731
    opt = optax.sgd(0.1)
    odd = jax.tree.map(lambda x: x[:-1], BATCH)  # one example short of a multiple of 2
    builds = {
        "jaxaccum.value_and_grad": lambda: jaxaccum.value_and_grad(loss, num_microbatches=2)(
            PARAMS, odd),
        "jaxaccum.train_step": lambda: jaxaccum.train_step(
            loss, opt, num_microbatches=2, donate=False)(PARAMS, opt.init(PARAMS), odd),
        "jaxaccum.statistics_first": lambda: jaxaccum.statistics_first(
            stats, with_totals, num_microbatches=2)(PARAMS, odd),
        "jaxaccum.statistics_first_train_step": lambda: jaxaccum.statistics_first_train_step(
            stats, with_totals, opt, num_microbatches=2, donate=False)(
                PARAMS, opt.init(PARAMS), odd),
    }
    with pytest.raises(ValueError) as info:
        builds[entry]()
    message = str(info.value)
    assert message.startswith(entry) and "weighted=True" in message, message


def test_microbatches_and_weights_say_what_to_do():
    with pytest.raises(ValueError) as info:
        jaxaccum.microbatches((np.ones((8, 3)), np.ones((6, 1))), microbatch_size=2,
                              max_microbatches=4)
    assert str(info.value).startswith("jaxaccum.microbatches") and FIX.search(str(info.value))
    opt = jaxaccum.multi_steps(optax.sgd(0.1), every_k=2)
    with pytest.raises(ValueError) as info:
        opt.update(PARAMS, opt.init(PARAMS), PARAMS, weight=-1.0)
    message = str(info.value)
    assert message.startswith("jaxaccum.multi_steps(...).update: weight"), message
    assert FIX.search(message.split(":", 1)[1]), message


def test_weighted_and_skip_nonfinite_must_be_bools():
    for name in ("weighted", "skip_nonfinite"):
        with refuses(TypeError, match=f"jaxaccum.value_and_grad: {name} must be a bool"):
            jaxaccum.value_and_grad(lambda w, x: jnp.mean(w * x), num_microbatches=2,
                                    **{name: "no"})
