"""What the front ends accept as parameters: plain pytrees, Equinox modules (filtered as
``eqx.filter_value_and_grad`` does), and clear errors for objects that belong to another front
end (an NNX module, a linen ``TrainState``)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_nnx_module(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX graph node (module, optimizer, rngs)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and bool(nnx.graph.is_graph_node(x))


def is_train_state(x: Any) -> bool:
    """Whether ``x`` looks like a linen ``TrainState`` (params, opt_state, tx, apply_fn)."""
    return all(hasattr(x, a) for a in ("params", "opt_state", "tx", "apply_fn"))


def is_equinox_module(x: Any) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.Module)


def check_parameters(entry: str, tree: Any, what: str) -> None:
    """Refuses an object that belongs to another front end, naming the one to use."""
    if is_nnx_module(tree):
        raise TypeError(
            f"{entry}: {what} is a Flax NNX {type(tree).__name__}; use jaxaccum.nnx."
            "value_and_grad(loss_fn, ...)(model, batch) or jaxaccum.nnx.train_step, which split "
            "the module into its nnx.Param (differentiated) and the rest (carried)"
        )
    if is_train_state(tree):
        raise TypeError(
            f"{entry}: {what} is a {type(tree).__name__} (a linen TrainState); use "
            "jaxaccum.linen.train_step(loss_fn, ...)(state, batch), or pass state.params"
        )


ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)  # what a jit can take


def _is_inexact_array(x: Any) -> bool:
    return isinstance(x, ARRAYS) and jnp.issubdtype(x.dtype, jnp.inexact)


def needs_filter(tree: Any) -> bool:
    """Whether ``tree`` is differentiated filtered (an Equinox module, or leaves that are no
    arrays: functions, activation objects)."""
    return is_equinox_module(tree) or has_non_arrays(tree)


def has_non_arrays(tree: Any) -> bool:
    """Whether ``tree`` holds leaves a jitted function cannot take as arguments (functions,
    activation objects); an Equinox module already partitioned (None there) holds none."""
    return any(
        not isinstance(x, (*ARRAYS, int, float, complex, bool))
        for x in jax.tree.leaves(tree)
    )


def partition(tree: Any) -> tuple[Any, Any]:
    """``(arrays, static)`` as ``eqx.partition(tree, eqx.is_inexact_array)``: inexact arrays
    (differentiated) and everything else (passed through), None where the other holds a leaf."""
    arrays = jax.tree.map(lambda x: x if _is_inexact_array(x) else None, tree)
    static = jax.tree.map(lambda x: None if _is_inexact_array(x) else x, tree)
    return arrays, static


def combine(arrays: Any, static: Any) -> Any:
    """The inverse of :func:`partition`."""
    return jax.tree.map(
        lambda a, s: s if a is None else a, arrays, static, is_leaf=lambda x: x is None
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Static:
    """The static part of partitioned parameters, hashable for ``jax.jit``'s static arguments:
    equal when its structure and leaves are (functions compare by identity)."""

    tree: Any
    key: tuple[Any, ...]

    @classmethod
    def of(cls, entry: str, tree: Any) -> Static:
        leaves, treedef = jax.tree.flatten(tree)
        try:
            hash(tuple(leaves))
        except TypeError:
            raise TypeError(
                f"{entry}: params holds leaves that are neither floating arrays nor hashable "
                f"({type(tree).__name__}: integer arrays, say), which a jitted step cannot "
                "take; pass eqx.filter(model, eqx.is_inexact_array) and close over the rest"
            ) from None
        return cls(tree, (treedef, *leaves))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and self.key == other.key
