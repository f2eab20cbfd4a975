"""A reference model of jaxaccum's documented semantics, in plain NumPy float64.

Written from the docs (``jaxaccum.Options``, ``value_and_grad``, ``train_step``,
``Microbatches``, ``NoiseScale``, ``StepInfo``), not from the code. One model serves every
front end: a least-squares loss ``l_j = (x_j . w - y_j)^2`` with per-example weights ``m_j``
(``weighted``), whose gradient ``2 r_j x_j`` NumPy computes exactly in float64, and an aux
of four leaves of different kinds:

- ``res``: per example, the residual ``r_j`` (float32);
- ``avg``: the micro-batch's mean residual (a float32 scalar);
- ``pos``: how many residuals are positive (an int32 scalar);
- ``half``: ``avg * [1, 2]`` in bfloat16.

The documented rules it encodes:

- micro-batch ``i`` of a batch split into ``k`` holds the examples ``i, i + k, ...``
  (strided); with ``max_microbatches`` it is ``data[i]`` of the stack, and only the first
  ``count`` run;
- unweighted: each micro-batch's mean, averaged with weight 1 each; ``weighted``: the loss
  returns ``(mean over valid items, their count W_i)`` and the result is ``sum W_i L_i /
  sum W_i``; a micro-batch with ``W_i == 0`` adds nothing, not even a NaN; a negative or NaN
  ``W_i`` makes the result NaN (never a silent skip);
- ``skip_nonfinite``: a micro-batch of nonzero weight whose loss or gradient is not finite,
  or whose weight is invalid, is left out and counted in ``skipped``; the mean is over the
  others, 0 if none is left (a total weight of 0: the steps make no update);
- aux: reductions over the micro-batches kept; ``stack``/``concat`` hold every evaluated one;
  float sums and means in float32, integer sums in their dtype, integer means in float32;
- the noise scale (McCandlish et al. app. A, sizes ``n_i`` = examples, or ``W_i`` when
  weighted; skipped and empty micro-batches are no samples): ``tr = (sum n_i |g_i|^2 - N
  |G|^2) / (M - 1)``, ``|G|^2_est = |G|^2 - tr / N``, NaN with fewer than 2 samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import jaxaccum
import jaxaccum.linen
import jaxaccum.nnx

AUX_LEAVES = ("res", "avg", "pos", "half")
REDUCTIONS = ("stack", "concat", "sum", "mean", "weighted_mean", "max", "min", "last")
EPS32 = float(np.finfo(np.float32).eps)
EPS16 = 2.0 ** -8  # bfloat16's unit roundoff is half of its 2^-7 epsilon; 2^-8 per rounding


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One accumulated step: the data, the parameters, and the options under test."""

    x: np.ndarray  # (B, D) float32, may hold NaN
    y: np.ndarray  # (B,)
    m: np.ndarray  # (B,) per-example weights (weighted), may be 0, negative or NaN
    w: np.ndarray  # (D,) parameters
    k: int  # micro-batches (the stack's K with a runtime count)
    count: int | None = None  # a runtime count (max_microbatches=k), else None
    weighted: bool = False
    skip_nonfinite: bool = False
    aux: dict[str, str] | None = None  # leaf -> reduction name, or None (no aux)
    noise_scale: bool = False
    shards: int = 1  # devices of an Auto mesh: each evaluates its share of every micro-batch
    # the dtype of the parameters and of the float inputs x, y (the weights m stay float32: a
    # count); float32 for the float64 model above, bfloat16 for tests/test_precision.py
    dtype: Any = np.float32

    @property
    def options(self) -> dict[str, Any]:
        """The jaxaccum options of this scenario."""
        out: dict[str, Any] = {"weighted": self.weighted, "skip_nonfinite": self.skip_nonfinite,
                               "noise_scale": self.noise_scale}
        if self.count is None:
            out["num_microbatches"] = self.k
        else:
            out["max_microbatches"] = self.k
        if self.aux is not None:
            out["has_aux"] = dict(self.aux)
        return out

    def microbatch_indices(self) -> list[np.ndarray]:
        """The examples of each evaluated micro-batch (each device's share of one, with
        ``shards`` devices on an Auto mesh), device-major: indices into the batch (with a
        runtime count, into the stack flattened to ``(K * m, ...)``)."""
        return [idx for _, i, idx in self.units() if i < self.evaluated]

    @property
    def evaluated(self) -> int:
        """Micro-batches evaluated per device."""
        return self.k if self.count is None else self.count

    def units(self) -> list[tuple[int, int, np.ndarray]]:
        """``(device, micro-batch, examples)`` for every slot of every device, device-major
        (slots past a runtime count included)."""
        b = self.x.shape[0]
        out = []
        for d in range(self.shards):
            if self.count is None:  # each device's block of the batch, split strided
                lo = d * b // self.shards
                out += [(d, i, lo + np.arange(i, b // self.shards, self.k))
                        for i in range(self.k)]
            else:  # micro-batch i is row i of the stack; each device holds a block of m
                m = b // self.k
                lo = d * m // self.shards
                out += [(d, i, i * m + lo + np.arange(m // self.shards)) for i in range(self.k)]
        return out

    def batch(self) -> Any:
        """The batch as the front ends take it: ``(x, y, m)``, or a ``Microbatches`` stack."""
        data = (self.x.astype(self.dtype), self.y.astype(self.dtype), self.m)
        if self.count is None:
            return data
        m = self.x.shape[0] // self.k
        stack = tuple(a.reshape(self.k, m, *a.shape[1:]) for a in data)
        return jaxaccum.Microbatches(stack, self.count)


def loss_fn(weighted: bool, leaves: Any = None):
    """The scenario's loss in JAX, returning what the options say it returns (the aux leaves
    named in ``leaves``; no aux if None)."""

    def loss(w, batch):
        x, y, m = batch
        r = x @ w - y
        sq = r**2
        if weighted:
            weight = jnp.sum(m)
            value = (jnp.sum(m * sq) / weight, weight)
        else:
            value = jnp.mean(sq)
        if leaves is None:
            return value
        avg = jnp.mean(r)
        aux = {"res": r, "avg": avg, "pos": jnp.sum(r > 0).astype(jnp.int32),
               "half": (avg * jnp.array([1.0, 2.0])).astype(jnp.bfloat16)}
        return value, {name: aux[name] for name in leaves}

    return loss


@dataclasses.dataclass
class Expected:
    """What every front end must report for a scenario (float64, NaN where documented)."""

    loss: float
    grads: np.ndarray
    weight: float
    skipped: int
    num_microbatches: int
    aux: dict[str, Any] | None
    aux_dtypes: dict[str, Any] | None
    noise: tuple[float, float, float, float] | None  # gradient_sq, trace, small, big
    # float32 rounding bounds (absolute), from the magnitudes of the summed terms
    loss_bound: float
    grads_bound: np.ndarray
    stepped: bool  # whether a step updates the parameters (total weight != 0)


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def expected(s: Scenario) -> Expected:
    """The documented result of scenario ``s``."""
    x, y, m, w = (np.asarray(a, np.float64) for a in (s.x, s.y, s.m, s.w))
    d = x.shape[1]
    rows = []
    for idx in s.microbatch_indices():
        xi, yi, mi = x[idx], y[idx], m[idx]
        with np.errstate(all="ignore"):
            r = xi @ w - yi
            sq, g = r**2, 2 * r[:, None] * xi
            # magnitudes for the rounding bound: the same sums over absolute values
            r_abs = np.abs(xi) @ np.abs(w) + np.abs(yi)
            sq_abs, g_abs = r_abs**2, 2 * r_abs[:, None] * np.abs(xi)
            if s.weighted:
                wt = float(np.sum(mi))
                loss, grad = np.sum(mi * sq) / wt, np.sum(mi[:, None] * g, 0) / wt
                loss_abs = np.sum(np.abs(mi) * sq_abs) / abs(wt) if wt else 0.0
                grad_abs = np.sum(np.abs(mi)[:, None] * g_abs, 0) / abs(wt) if wt else 0 * w
            else:
                wt = 1.0
                loss, grad = np.mean(sq), np.mean(g, 0)
                loss_abs, grad_abs = np.mean(sq_abs), np.mean(g_abs, 0)
            avg = float(np.mean(r))
        finite = bool(np.isfinite(loss) and np.all(np.isfinite(grad)))
        values = {"res": r, "avg": avg, "pos": int(np.sum(r > 0)),
                  "half": _bf16(np.float32(avg) * np.array([1.0, 2.0]))}
        rows.append(dict(wt=wt, loss=loss, grad=grad, finite=finite, aux=values, n=len(idx),
                         loss_abs=loss_abs, grad_abs=grad_abs, idx=idx))

    c = combine(s, rows, d)
    skipped, kept, total, loss, grads = c["skipped"], c["kept"], c["total"], c["loss"], c["grads"]
    loss_mag, grad_mag = c["loss_mag"], c["grad_mag"]
    # float32 evaluation: each micro-batch's terms are sums of at most B + D products, then at
    # most k additions and a division; gamma_n = n eps32 bounds each against the sum of |terms|
    n_ops = x.shape[0] + d + s.k + 4
    scale = 1.0 / total if total and np.isfinite(total) else 0.0
    loss_bound = 2 * n_ops * EPS32 * loss_mag * scale + 1e-30
    grads_bound = 2 * n_ops * EPS32 * grad_mag * scale + 1e-30

    aux: dict[str, Any] | None = None
    dtypes: dict[str, Any] | None = None
    if s.aux is not None:
        aux, dtypes = _expected_aux(s, rows, kept)
    noise = _expected_noise(s, rows, kept, grads) if s.noise_scale else None
    evaluated = len(rows)
    return Expected(float(loss), grads, float(total), skipped, evaluated, aux, dtypes, noise,
                    loss_bound, grads_bound, stepped=bool(total != 0))


def combine(s: Scenario, rows: list[dict], d: int,
            magnitudes: Any = lambda row: (row["loss_abs"], row["grad_abs"])) -> dict[str, Any]:
    """The documented combination of the micro-batch ``rows`` (each ``wt``, ``loss``,
    ``grad``, ``finite``) in float64: which are skipped and kept, the total weight, the loss
    and gradients (0 for a total of 0, NaN for an invalid weight), and the weighted sums of
    the terms' ``magnitudes(row)`` (the rounding bounds' scale)."""
    skipped = 0
    total, loss_sum, grad_sum = 0.0, 0.0, np.zeros(d)
    loss_mag, grad_mag = 0.0, np.zeros(d)
    kept = []
    for row in rows:
        wt = row["wt"]
        if s.skip_nonfinite and wt != 0 and not (row["finite"] and wt > 0):
            skipped += 1
            continue
        kept.append(row)
        if wt == 0:
            continue  # adds nothing, not even a NaN
        if not wt > 0:  # negative or NaN: the result is NaN
            total, loss_sum, grad_sum = np.nan, np.nan, grad_sum * np.nan
            continue
        total += wt
        loss_sum += wt * row["loss"]
        grad_sum = grad_sum + wt * row["grad"]
        loss_abs, grad_abs = magnitudes(row)
        loss_mag += wt * loss_abs
        grad_mag = grad_mag + wt * grad_abs
    with np.errstate(all="ignore"):
        loss, grads = (0.0, np.zeros(d)) if total == 0 else (loss_sum / total, grad_sum / total)
    return dict(skipped=skipped, kept=kept, total=total, loss=loss, grads=grads,
                loss_mag=loss_mag, grad_mag=grad_mag)


# the reduction names each aux leaf of the scenarios may take (every one its kind allows)
LEAF_NAMES = {
    "res": ("stack", "concat"),
    "avg": ("stack", "sum", "mean", "weighted_mean", "max", "min", "last"),
    "pos": ("stack", "sum", "mean", "max", "min", "last"),
    "half": ("stack", "sum", "mean", "weighted_mean", "max", "min", "last"),
}


_DTYPES = {"res": np.float32, "avg": np.float32, "pos": np.int32, "half": ml_dtypes.bfloat16}


def _expected_aux(s: Scenario, rows: list[dict], kept: list[dict]) -> tuple[dict, dict]:
    out, dtypes = {}, {}
    assert s.aux is not None
    for leaf, name in s.aux.items():
        dtype = np.dtype(_DTYPES[leaf])
        floating = leaf != "pos"
        values = [np.asarray(r["aux"][leaf], np.float64) for r in kept]
        shape = np.shape(rows[0]["aux"][leaf]) if rows else ((2,) if leaf == "half" else ())
        wide = np.dtype(np.float32) if floating else dtype
        if name == "stack":  # each device's slots (zeros past a runtime count), device-major
            evaluated, slots = iter(rows), []
            for _, i, idx in s.units():
                slots.append(np.asarray(next(evaluated)["aux"][leaf], np.float64)
                             if i < s.evaluated
                             else np.zeros((len(idx),) if leaf == "res" else shape))
            out[leaf], dtypes[leaf] = np.stack(slots), dtype
        elif name == "concat":  # batch order (with a runtime count: the stack's, zeros past it)
            full = np.zeros(s.x.shape[0])
            for r in rows:
                full[r["idx"]] = r["aux"]["res"]
            out[leaf] = full if s.count is None else full.reshape(s.k, -1)
            dtypes[leaf] = dtype
        elif name == "sum":
            out[leaf] = np.sum(values, 0) if values else np.zeros(shape)
            dtypes[leaf] = wide
        elif name == "mean":
            out[leaf] = np.mean(values, 0) if values else np.zeros(shape)
            dtypes[leaf] = np.dtype(np.float32)
        elif name == "weighted_mean":
            num, den = np.zeros(shape), 0.0
            for r, v in zip(kept, values, strict=True):
                if r["wt"] == 0:
                    continue
                wt = r["wt"] if r["wt"] > 0 else np.nan
                num, den = num + wt * v, den + wt
            with np.errstate(all="ignore"):
                out[leaf] = num / den if den != 0 else np.zeros(shape)
            dtypes[leaf] = np.dtype(np.float32)
        elif name in ("max", "min"):
            pick = np.max if name == "max" else np.min
            if values:
                out[leaf] = pick(np.stack(values), 0)
            elif floating:
                out[leaf] = np.full(shape, -np.inf if name == "max" else np.inf)
            else:
                info = np.iinfo(dtype)
                out[leaf] = np.full(shape, info.min if name == "max" else info.max, np.float64)
            dtypes[leaf] = dtype
        elif name == "last":
            out[leaf] = values[-1] if values else np.zeros(shape)
            dtypes[leaf] = dtype
        else:
            raise ValueError(name)
    return out, dtypes


def _expected_noise(s: Scenario, rows: list[dict], kept: list[dict],
                    grads: np.ndarray) -> tuple[float, float, float, float]:
    weighted_sq, big, samples = np.float64(0), np.float64(0), np.float64(0)
    for r in kept:
        n = r["wt"] if s.weighted else float(r["n"])
        if not n > 0:
            if s.weighted and r["wt"] != 0:  # an invalid weight: NaN everywhere
                return (np.nan,) * 4
            continue
        weighted_sq += n * float(np.sum(r["grad"] ** 2))
        big += n
        samples += 1
    g_big = float(np.sum(grads**2))
    with np.errstate(all="ignore"):
        trace = (weighted_sq - big * g_big) / (samples - 1.0) if samples > 1 else np.nan
        return (float(g_big - trace / big), float(trace), float(big / samples), float(big))


def assert_close(name: str, got: Any, want: Any, bound: Any) -> None:
    """``got`` equals ``want`` within ``bound`` (absolute, per element); NaN where ``want`` is."""
    got = np.asarray(np.asarray(got).astype(np.float64))
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{name}: NaN at {np.isnan(got)}, expected {nan}"
    ok = ~nan
    with np.errstate(all="ignore"):
        same = (got[ok] == want[ok]) | (np.abs(got[ok] - want[ok]) <= np.broadcast_to(bound,
                                                                                      want.shape)[ok])
    assert np.all(same), f"{name}: got {got}, expected {want} (bound {bound})"


# --- every front end, driven the same way ---------------------------------------------------

D = 3


class Linear(nnx.Module):
    def __init__(self, w: np.ndarray) -> None:
        self.w = nnx.Param(jnp.asarray(w))


def _nnx_loss(loss):
    return lambda model, batch: loss(model.w[...], batch)


def _totals_loss(loss, weighted: bool, examples: int):
    """``loss`` times ``totals["n"] / examples``: 1 exactly when the statistics are the sum
    of every evaluated micro-batch's example count, as ``statistics_first`` promises."""

    def fun(w, batch, totals):
        out = loss(w, batch)
        factor = totals["n"] / examples
        if isinstance(out, tuple) and isinstance(out[0], tuple):  # ((loss, weight), aux)
            (value, weight), aux = out
            return (value * factor, weight), aux
        if isinstance(out, tuple):
            return (out[0] * factor, out[1])
        return out * factor

    return fun


def _stats(w, batch):
    return {"n": jnp.asarray(batch[0].shape[0], jnp.float32)}


def run(front: str, s: Scenario, mesh: Any = None) -> dict[str, Any]:
    """Runs scenario ``s`` through ``front`` (on ``mesh``, if given); returns loss, grads,
    info, aux and the parameters after one SGD(1) step (steps only)."""
    loss = loss_fn(s.weighted, None if s.aux is None else tuple(s.aux))
    opts = s.options if mesh is None else {**s.options, "mesh": mesh}
    w = jnp.asarray(s.w.astype(s.dtype))
    batch = s.batch()
    sgd = optax.sgd(1.0)
    out: dict[str, Any] = {}
    if front == "value_and_grad":
        value, grads, info = jax.jit(jaxaccum.value_and_grad(loss, return_info=True, **opts))(
            w, batch)
        out.update(value=value, grads=grads, info=info)
    elif front == "statistics_first":
        examples = s.x.shape[0] if s.count is None else s.count * (s.x.shape[0] // s.k)
        fn = jaxaccum.statistics_first(_stats, _totals_loss(loss, s.weighted, max(examples, 1)),
                                       return_info=True, **opts)
        value, grads, info = jax.jit(fn)(w, batch)
        out.update(value=value, grads=grads, info=info)
    elif front == "train_step":
        step = jaxaccum.train_step(loss, sgd, **opts)
        params, _, value, info = step(w, sgd.init(w), batch)
        out.update(value=value, info=info, params=params)
    elif front == "nnx.value_and_grad":
        model = Linear(s.w.astype(s.dtype))
        fn = nnx.jit(jaxaccum.nnx.value_and_grad(_nnx_loss(loss), return_info=True, **opts))
        value, grads, info = fn(model, batch)
        out.update(value=value, grads=grads["w"][...], info=info)
    elif front == "nnx.train_step":
        model = Linear(s.w.astype(s.dtype))
        optimizer = nnx.Optimizer(model, sgd, wrt=nnx.Param)
        value, info = jaxaccum.nnx.train_step(_nnx_loss(loss), **opts)(model, optimizer, batch)
        out.update(value=value, info=info, params=model.w[...])
    elif front == "linen.train_step":
        state = train_state.TrainState.create(apply_fn=None, params=w, tx=sgd)
        state, value, info = jaxaccum.linen.train_step(loss, **opts)(state, batch)
        out.update(value=value, info=info, params=state.params)
    else:
        raise ValueError(front)
    return out


FRONT_ENDS = ("value_and_grad", "statistics_first", "train_step", "nnx.value_and_grad",
              "nnx.train_step", "linen.train_step")
STEPS = ("train_step", "nnx.train_step", "linen.train_step")


def check(front: str, s: Scenario, mesh: Any = None) -> None:
    """Asserts that ``front`` gives what the reference model says for ``s`` (on ``mesh``)."""
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        got = run(front, s, mesh)  # a refusal of this valid input fails (conftest)
    verify(front, s, got)


def verify(front: str, s: Scenario, got: dict[str, Any]) -> None:
    """Asserts that ``got`` (what :func:`run` returned for ``front``) is what the reference
    model says for ``s``."""
    want = expected(s)
    info = got["info"]
    # one contract: the info's fields and dtypes, whatever the options
    assert isinstance(info, jaxaccum.StepInfo), type(info)
    assert info.skipped.dtype == jnp.int32 and info.num_microbatches.dtype == jnp.int32
    assert info.weight.dtype == jnp.float32
    assert int(info.skipped) == want.skipped
    assert int(info.num_microbatches) == want.num_microbatches
    assert_close("info.weight", info.weight, want.weight, 4 * EPS32 * abs(want.weight))
    value = got["value"]
    if front in STEPS:  # a step returns the loss alone; the aux is in the info
        loss, aux = value, info.aux
    else:
        loss, aux = (value if s.aux is not None else (value, None))
    assert jnp.shape(loss) == () and jnp.asarray(loss).dtype == jnp.float32
    assert_close("loss", loss, want.loss, want.loss_bound)
    if "grads" in got:
        assert_close("grads", got["grads"], want.grads, want.grads_bound)
    if "params" in got:  # SGD(1): w - grads, or w unchanged when the total weight is 0
        after = s.w - want.grads if want.stepped else s.w
        bound = want.grads_bound + 2 * EPS32 * np.abs(s.w) if want.stepped else 0.0
        assert_close("params", got["params"], after, bound)
    if s.aux is None:
        assert aux is None
    else:
        _check_aux(s, aux, want)
    if s.noise_scale:
        _check_noise(info.noise_scale, want)
    else:
        assert info.noise_scale is None


def _check_aux(s: Scenario, aux: Any, want: Any) -> None:
    assert s.aux is not None
    assert set(aux) == set(s.aux), (set(aux), set(s.aux))
    scale = max([1.0] + [float(np.nanmax(np.abs(v))) for v in want.aux.values()
                         if np.size(v) and np.any(np.isfinite(v))])
    for leaf, name in s.aux.items():
        got = aux[leaf]
        assert np.dtype(got.dtype) == np.dtype(want.aux_dtypes[leaf]), (
            f"aux {leaf!r} ({name}): dtype {got.dtype}, expected {want.aux_dtypes[leaf]}")
        if leaf == "pos" and name not in ("mean", "weighted_mean"):
            bound = 0.0
        elif leaf == "half":
            bound = 4 * (s.k + 1) * EPS16 * scale
        else:
            bound = 8 * (s.x.shape[0] + D + s.k) * EPS32 * scale * max(1.0, np.abs(s.w).sum())
        assert_close(f"aux {leaf!r} ({name})", got, want.aux[leaf], bound)


def _check_noise(noise: Any, want: Any) -> None:
    assert isinstance(noise, jaxaccum.NoiseScale)
    g2, trace, small, big = want.noise
    assert_close("noise big_batch", noise.big_batch, big, 4 * EPS32 * abs(big))
    assert_close("noise small_batch", noise.small_batch, small, 8 * EPS32 * abs(small))
    # the estimators subtract sums of squared norms; float32 loses eps32 times their size
    mag = (abs(g2) + abs(trace) * 4 + 1.0) * 1e3 * EPS32 * big
    assert_close("noise trace", noise.trace, trace, mag)
    assert_close("noise gradient_sq", noise.gradient_sq, g2, mag)
