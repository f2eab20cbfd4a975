"""The per-token losses, here or with the vocabulary split over a mesh axis by this call."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxaccum._cross_entropy import _checks
from jaxaccum._cross_entropy._vjp import Config, per_token, per_token_into
from jaxaccum.contrastive import _tiles


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


def over_mesh(config: Config, hidden: jax.Array, weight: jax.Array, bias: jax.Array | None,
              labels: jax.Array, active: jax.Array, tap: jax.Array | None) -> jax.Array:
    """:func:`losses` inside ``jax.shard_map`` over every axis of the context mesh, whose axes
    are Explicit: each array split as its type says (the tokens over the data axes, the
    vocabulary over ``config.axis_name``), the per-token loss split as the labels."""
    operands = {"hidden": hidden, "weight": weight, "labels": labels, "active": active,
                **{k: v for k, v in (("bias", bias), ("tap", tap)) if v is not None}}
    # (a parameter jaxaccum reduces once per step is typed reduced over the data axes; the
    # spec keeps that, which shard_map takes only over every axis of the mesh)
    specs = {k: jax.typeof(v).sharding.spec for k, v in operands.items()}
    _checks.layout("jaxaccum.linear_cross_entropy", config.axis_name, config.vocab_axis, specs)

    def local(o: dict[str, jax.Array]) -> jax.Array:
        # the head's gradient comes from this device's tokens: typed varying over their axes,
        # which custom_vjp demands of the cotangent it returns for the weight
        tokens = _tiles.varying(o["hidden"], o["labels"])
        o = {k: _tiles.vary(tokens, v) if k in ("weight", "bias", "tap") else v
             for k, v in o.items()}
        return losses(config, o["hidden"], o["weight"], o.get("bias"), o["labels"],
                      o["active"], o.get("tap"))

    return jax.shard_map(local, in_specs=(specs,),  # type: ignore[no-any-return]
                         out_specs=specs["labels"])(operands)
