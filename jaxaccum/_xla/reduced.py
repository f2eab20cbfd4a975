"""Explicit meshes: parameters cast to ``reduced`` over the data axes, so that each
micro-batch's gradient comes out ``unreduced`` (per-device partial sums, added without
communication) and is reduced once per step. What JAX does not do for it yet lives here:

- :func:`jax_refuses_reduced`: the one place that recognises JAX refusing a reduced type;
- :func:`reduced_compatible`: an elementwise op between a reduced parameter and a batch-sharded
  activation (a bias add, a LayerNorm scale) reshards the parameter like the activation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxaccum import _specs
from jaxaccum._xla import jaxpr as _jaxpr


def jax_refuses_reduced(error: BaseException) -> bool:
    """Whether ``error`` is JAX refusing a reduced/unreduced type (jax 0.10), in one of the
    forms it takes: a ``ShardingTypeError`` (not public in jax: recognised by its class
    name) for an op between a reduced and a sharded operand; a ``NotImplementedError`` from
    a primitive without a reduced rule (``conv_general_dilated``); a ``ValueError`` from a
    ``shard_map`` in the loss (``linear_cross_entropy`` on an Explicit mesh) whose specs were
    fixed for plain types and which :func:`reduced_compatible` re-evaluates on reduced ones;
    or the ``ValueError`` of JAX code that reads a reduced ``PartitionSpec`` as a plain one
    (indexing a reduced table, ``table[tokens]``). Tested for each."""
    if type(error).__name__ == "ShardingTypeError":
        return True
    if isinstance(error, ValueError) and "reduced present on the in_aval" in str(error):
        return True  # a shard_map traced for plain types, re-evaluated on reduced ones
    if isinstance(error, ValueError) and "Using *pspec is dangerous" in str(error):
        return True  # an op that reads a reduced spec as a plain one (``table[tokens]``)
    return isinstance(error, NotImplementedError) and "unreduced/reduced rule" in str(error)


def is_reduced(x: Any) -> bool:
    sharding = getattr(jax.typeof(x), "sharding", None)
    return bool(sharding is not None and sharding.spec.reduced)


def _without_reduced(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s type with its ``reduced`` axes dropped (the same data: a replicated array)."""
    sharding = jax.typeof(x).sharding
    spec = P(*sharding.spec.partitions, unreduced=sharding.spec.unreduced)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(sharding.mesh, spec))


def _resolve(eqn: Any, invals: list[Any]) -> list[Any] | None:
    """An elementwise op between a reduced operand (a parameter) and an operand sharded over
    the same axes (a batch-sharded activation): the reduced one is broadcast to the output's
    shape and resharded like the other, a free slice whose transpose keeps the gradient
    unreduced. JAX's own error message suggests this reshard."""
    try:
        return _jaxpr.bind(eqn, invals)
    except Exception as error:
        if not jax_refuses_reduced(error):
            raise
        shape = eqn.outvars[0].aval.shape if len(eqn.outvars) == 1 else None
        like = [v for v in invals if not is_reduced(v) and jnp.shape(v) == shape]
        if shape is None or not like or not any(map(is_reduced, invals)) or _has_body(eqn):
            raise  # not elementwise (a loop in the model): the placement falls back
        target = jax.typeof(like[0]).sharding
        return _jaxpr.bind(eqn, [_sharded_like(v, shape, target) if is_reduced(v) else v
                                 for v in invals])


def _has_body(eqn: Any) -> bool:
    """Whether ``eqn`` runs a sub-program (a ``scan``, ``while``, ``cond``): its operands keep
    their own shapes inside, so a parameter broadcast to the output's shape would not fit."""
    return any(isinstance(p, (jex.ClosedJaxpr, jex.Jaxpr)) or (
        isinstance(p, (tuple, list)) and any(isinstance(q, (jex.ClosedJaxpr, jex.Jaxpr))
                                             for q in p))
               for p in eqn.params.values())


def _sharded_like(v: jax.Array, shape: tuple[int, ...], target: NamedSharding) -> jax.Array:
    """A reduced ``v`` broadcast to ``shape`` with the sharding ``target``, never materialised
    whole: along a dimension sharded over n devices that ``v`` broadcasts (size 1), ``v`` is
    broadcast to n, resharded (each device keeps one copy) and expanded locally. Under
    transposition the gradient is summed locally and stays unreduced, n values per device."""
    v = jnp.reshape(v, (1,) * (len(shape) - jnp.ndim(v)) + jnp.shape(v))
    spec = _specs.padded(P(*target.spec.partitions), len(shape))
    split = {}
    for d, e in enumerate(spec):
        n = math.prod(target.mesh.shape[a] for a in _specs.names(e))
        if n > 1 and v.shape[d] == 1 and shape[d] % n == 0:
            split[d] = n
    small = tuple(split.get(d, size) for d, size in enumerate(shape))
    v = jax.reshard(jnp.broadcast_to(v, small), target)
    if not split:
        return v
    ones = [s for d, size in enumerate(small) for s in ((size, 1) if d in split else (size,))]
    full = [s for d, size in enumerate(small)
            for s in ((size, shape[d] // size) if d in split else (size,))]
    return jnp.broadcast_to(v.reshape(ones), full).reshape(shape)


def reduced_compatible(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` for reduced parameters: the ops that mix a reduced parameter with a data-sharded
    activation (a bias add, a LayerNorm scale) reshard the parameter there (see
    :func:`_resolve`); nested ``jit`` calls are inlined. Traced once as written with plain
    (replicated) types, then re-evaluated on the reduced arguments."""

    def wrapped(*args: Any) -> Any:
        traced = _jaxpr.trace(fun, args, as_type=_without_reduced)
        return traced.evaluate(*traced.arrays, rule=_resolve, inline=lambda eqn: True)

    return wrapped
