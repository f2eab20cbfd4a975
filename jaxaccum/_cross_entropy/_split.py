"""The per-token losses, here or with the vocabulary split over a mesh axis by this call."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxaccum._cross_entropy._vjp import Config, per_token, per_token_into


def losses(config: Config, hidden: jax.Array, weight: jax.Array, bias: jax.Array | None,
           labels: jax.Array, active: jax.Array, tap: jax.Array | None) -> jax.Array:
    """The loss per token, the weight's gradient added into ``tap`` when there is one."""
    if tap is None:
        return per_token(config, hidden, weight, bias, labels, active)  # type: ignore[no-any-return]
    return per_token_into(config, hidden, weight, bias, labels, active, tap)  # type: ignore[no-any-return]


def over_axis(config: Config, hidden: jax.Array, weight: jax.Array, bias: jax.Array | None,
              labels: jax.Array, active: jax.Array, tap: jax.Array | None) -> jax.Array:
    """:func:`losses` inside ``jax.shard_map`` over ``config.axis_name`` of the context mesh:
    each device its slice of the weight, the bias and the accumulator, the same tokens.

    The accumulator goes in beside the weight, sliced the same way: each device adds its
    slice's gradient into its slice of it, so no weight-sized gradient exists on any device
    (a ``shard_map`` of the user's own cannot do that: inside it the weight is a new value
    that the accumulator is not registered with)."""
    name = config.axis_name
    vocab = (name, None) if config.vocab_axis == 0 else (None, name)
    # (None operands travel as closed-over constants: a spec cannot name an absent array)
    present = {k: v for k, v in (("bias", bias), ("tap", tap)) if v is not None}
    specs = {"bias": (name,), "tap": vocab}

    def local(hidden: jax.Array, weight: jax.Array, labels: jax.Array, active: jax.Array,
              rest: dict[str, jax.Array]) -> jax.Array:
        return losses(config, hidden, weight, rest.get("bias"), labels, active, rest.get("tap"))

    return jax.shard_map(  # type: ignore[no-any-return]
        local, in_specs=(P(), P(*vocab), P(), P(), {k: P(*specs[k]) for k in present}),
        out_specs=P(), axis_names={name})(hidden, weight, labels, active, present)
