"""Re-evaluating a function's jaxpr equation by equation, with a rule for some equations.

Two rewrites that XLA or JAX do not do for the micro-step use it: canonical convolution
layouts for XLA:CPU (:mod:`jaxaccum._xla.conv_layout`) and, on Explicit meshes, a bias added to
a batch-sharded activation with its parameter kept ``reduced`` (:mod:`jaxaccum._xla.reduced`).
Equations the rule leaves alone are bound as they are, so a function the rule never touches
computes exactly what it did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jex

# A rule: given an equation and its input values, the output values, or None to bind as is.
Rule = Callable[[Any, list[Any]], "list[Any] | None"]
CALLS = ("jit", "pjit", "closed_call", "core_call")


def bind(eqn: Any, invals: list[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """Binds ``eqn``'s primitive to ``invals`` (with ``params``, default the equation's)."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    subfuns: tuple[Any, ...] = ()
    if isinstance(bind_params, tuple):  # older jax returns (subfuns, params)
        subfuns, bind_params = bind_params
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    with manager if manager is not None else contextlib.nullcontext():
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def called_jaxpr(eqn: Any) -> Any:
    """The closed jaxpr of a nested ``jit`` (or closed call) equation, else None."""
    sub = eqn.params.get("jaxpr")
    return sub if eqn.primitive.name in CALLS and isinstance(sub, jex.ClosedJaxpr) else None


def evaluate(
    jaxpr: Any,
    consts: Any,
    *args: Any,
    rule: Rule,
    inline: Callable[[Any], bool] = lambda eqn: False,
) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args``; ``rule`` may replace any equation's evaluation.

    A nested ``jit`` for which ``inline(eqn)`` holds is evaluated in place (XLA inlines it
    anyway), so the rule also sees its equations.
    """
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        sub = called_jaxpr(eqn)
        if sub is not None and inline(eqn):
            outs = evaluate(sub.jaxpr, sub.consts, *invals, rule=rule, inline=inline)
        else:
            replaced = rule(eqn, invals)
            outs = bind(eqn, invals) if replaced is None else replaced
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


class Traced(NamedTuple):
    """A function traced on the array leaves of its arguments (every other leaf closed over).

    Attributes:
      closed: the closed jaxpr.
      out_tree: the structure of the function's output.
      arrays: the array leaves of the arguments, in the order of the jaxpr's inputs.
      call: the function of those array leaves, as written.
    """

    closed: Any
    out_tree: Any
    arrays: list[Any]
    call: Callable[..., Any]

    def evaluate(self, *arrays: Any, rule: Rule, inline: Callable[[Any], bool]) -> Any:
        """The function's output for ``arrays``, with ``rule`` applied (see :func:`evaluate`)."""
        out = evaluate(self.closed.jaxpr, self.closed.consts, *arrays, rule=rule, inline=inline)
        return jax.tree.unflatten(self.out_tree, out)


def trace(
    fun: Callable[..., Any], args: tuple[Any, ...], as_type: Callable[[Any], Any] | None = None
) -> Traced:
    """Traces ``fun(*args)`` as a function of the array leaves of ``args``; ``as_type`` maps
    each array to the type it is traced with (default: its own)."""
    leaves, tree = jax.tree.flatten(args)
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]

    def call(*xs: Any) -> Any:
        full = list(leaves)
        for i, x in zip(dynamic, xs, strict=True):
            full[i] = x
        return fun(*jax.tree.unflatten(tree, full))

    arrays = [leaves[i] for i in dynamic]
    types = arrays if as_type is None else [as_type(x) for x in arrays]
    closed, shape = jax.make_jaxpr(call, return_shape=True)(*types)
    return Traced(closed, jax.tree.structure(shape), arrays, call)
