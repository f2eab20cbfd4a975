"""plan_microbatches on an (8,) FSDP mesh: the compiled totals it chooses among, and its choice."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._plan import memory_estimate

from .common import accumulation_options, emit


def loss(p: dict[str, Any], x: jax.Array) -> jax.Array:
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2)


def main() -> None:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    sharded = NamedSharding(mesh, P("data"))
    params = {
        "w1": jax.ShapeDtypeStruct((64, 1024), jnp.float32, sharding=sharded),
        "w2": jax.ShapeDtypeStruct((1024, 64), jnp.float32, sharding=sharded),
    }
    batch = jax.ShapeDtypeStruct((1024, 64), jnp.float32, sharding=sharded)
    opt = optax.sgd(0.1)
    state = jax.eval_shape(opt.init, params)
    totals = {}
    for k in (1, 2, 4, 8):
        for option in ("step", "microbatch"):
            step = jaxaccum.train_step(
                loss, opt, num_microbatches=k, **accumulation_options(mesh, fsdp=option)
            )
            compiled = step.lower(params, state, batch).compile()
            totals[f"{k}/{option}"] = memory_estimate(compiled, k).total_bytes
    budget = totals["4/microbatch"]
    plan = jaxaccum.plan_microbatches(
        loss,
        params,
        batch,
        memory_budget=budget,
        optimizer=opt,
        **accumulation_options(mesh, fsdp=("step", "microbatch")),
    )
    emit(
        {
            "totals": totals,
            "budget": budget,
            "k": plan.num_microbatches,
            "fsdp": plan.fsdp,
            "tried": [list(key) for key in plan.estimates],
        }
    )


if __name__ == "__main__":
    main()
