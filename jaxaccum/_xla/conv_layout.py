"""Convolutions in NHWC x HWIO -> NHWC form inside loop bodies, for XLA:CPU.

XLA:CPU runs a convolution fast (YNNPACK or Eigen) only when its dimension numbers are
canonical: input NHWC, kernel HWIO, output NHWC. Its ``ConvCanonicalization`` pass rewrites
every other convolution into transposes around a canonical one, but it visits only the entry
computation. The gradient convolutions that autodiff emits are not canonical (input gradient:
kernel ``01oi``; kernel gradient: ``f01b_i01o->01bf``), so inside a ``lax.scan`` body they are
emitted as naive loops, ~20x slower. :func:`canonical_convs` does on the jaxpr what that pass
does on the entry computation: exactly the same values (transposes only), on CPU only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from jaxaccum._xla import jaxpr as _jaxpr

_CONV = jex.primitives.conv_general_dilated_p


def _canonical_specs(n: int) -> tuple[tuple[int, ...], ...]:
    spatial = tuple(range(1, n - 1))
    return (0, n - 1, *spatial), (n - 1, n - 2, *range(n - 2)), (0, n - 1, *spatial)


def _noncanonical(eqn: Any) -> bool:
    if eqn.primitive is not _CONV:
        return False
    dn = eqn.params["dimension_numbers"]
    specs = (tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec))
    return specs != _canonical_specs(len(dn.lhs_spec))


def has_conv(jaxpr: Any) -> bool:
    """Whether a (closed) jaxpr holds, at any depth, a convolution: its gradient then holds
    convolutions in another form (autodiff's), which :func:`canonical_convs` rewrites."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return any(
        eqn.primitive is _CONV or any(map(has_conv, jex.jaxprs_in_params(eqn.params)))
        for eqn in jaxpr.eqns
    )


def has_noncanonical_conv(jaxpr: Any) -> bool:
    """Whether a (closed) jaxpr holds, at any depth, a convolution not in NHWC/HWIO form."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return any(
        _noncanonical(eqn) or any(map(has_noncanonical_conv, jex.jaxprs_in_params(eqn.params)))
        for eqn in jaxpr.eqns
    )


def _canonical_conv(lhs: Any, rhs: Any, *, dimension_numbers: Any, **params: Any) -> Any:
    """The same convolution as transpose -> NHWC x HWIO -> NHWC convolution -> transpose."""
    n = lhs.ndim
    lb, lf, *ls = dimension_numbers.lhs_spec
    ro, ri, *rs = dimension_numbers.rhs_spec
    ob, of, *os_ = dimension_numbers.out_spec
    out = _CONV.bind(
        jnp.transpose(lhs, (lb, *ls, lf)),
        jnp.transpose(rhs, (*rs, ri, ro)),
        dimension_numbers=jax.lax.ConvDimensionNumbers(*_canonical_specs(n)),
        **params,
    )
    perm = [0] * n
    perm[ob], perm[of] = 0, n - 1
    for i, axis in enumerate(os_):
        perm[axis] = i + 1
    return jnp.transpose(out, perm)


def _rewrite(sub: Any) -> Any:
    """A jaxpr-valued parameter (scan/while/cond bodies, remat...) with its convs rewritten."""
    if not isinstance(sub, (jex.ClosedJaxpr, jex.Jaxpr)) or not has_noncanonical_conv(sub):
        return sub
    closed = sub if isinstance(sub, jex.ClosedJaxpr) else jex.ClosedJaxpr(sub, ())
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
    new = jax.make_jaxpr(functools.partial(_eval, closed.jaxpr, closed.consts))(*avals)
    if isinstance(sub, jex.ClosedJaxpr):
        return new
    return sub if new.consts else new.jaxpr  # an open jaxpr takes no consts: leave it as it was


def _rule(eqn: Any, invals: list[Any]) -> list[Any] | None:
    if _noncanonical(eqn):
        return [_canonical_conv(*invals, **eqn.params)]
    if not any(map(has_noncanonical_conv, jex.jaxprs_in_params(eqn.params))):
        return None
    # scan, while, cond, remat, custom rules: the same primitive, bodies rewritten
    params = {
        key: type(v)(map(_rewrite, v)) if isinstance(v, (tuple, list)) else _rewrite(v)
        for key, v in eqn.params.items()
    }
    return _jaxpr.bind(eqn, invals, params)


def _inline(eqn: Any) -> bool:
    return has_noncanonical_conv(_jaxpr.called_jaxpr(eqn))


def _eval(jaxpr: Any, consts: Any, *args: Any) -> list[Any]:
    return _jaxpr.evaluate(jaxpr, consts, *args, rule=_rule, inline=_inline)


def rewrite_jaxpr(fun: Callable[..., Any], *args: Any) -> Any:
    """``fun(*args)`` computed with every convolution in canonical form, on any platform."""
    traced = _jaxpr.trace(fun, args)
    return traced.evaluate(*traced.arrays, rule=_rule, inline=_inline)


def canonical_convs(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` with its convolutions in NHWC x HWIO -> NHWC form when lowered for CPU.

    A function without another convolution form is called unchanged (the same program); on
    other platforms (whose compilers canonicalise every computation) ``fun`` is lowered as it
    is, through ``jax.lax.platform_dependent`` (resolved at lowering, no conditional in the
    program). Array leaves of the arguments are traced; every other leaf is closed over.
    """

    @functools.wraps(fun)
    def wrapped(*args: Any) -> Any:
        traced = _jaxpr.trace(fun, args)
        if not has_noncanonical_conv(traced.closed):
            return fun(*args)

        def rewritten(*xs: Any) -> Any:
            return traced.evaluate(*xs, rule=_rule, inline=_inline)

        return jax.lax.platform_dependent(*traced.arrays, cpu=rewritten, default=traced.call)

    return wrapped
