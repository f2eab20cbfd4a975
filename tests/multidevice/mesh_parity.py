"""Every option of ``jaxaccum.value_and_grad`` and ``jaxaccum.train_step`` on 8 host devices
equals one device, or is refused on both with the same message.

Four meshes: data=8 and data x model = 4 x 2, each with Auto and with Explicit axes. The one-
device run each mesh is compared with is the documented one:

- Explicit axes: the micro-batches are global, so it is the same call (``num_microbatches``
  and ``microbatch_size`` are per device on a mesh: a per-device ``microbatch_size`` s is a
  global micro-batch of ``n * s`` examples on ``n`` data devices);
- Auto axes: each device evaluates its own share of every micro-batch, and the shares are the
  units of the mean, the skip, the aux reductions and the noise scale. The one-device run is
  given those shares as its micro-batches: ``n * k`` of them, the batch permuted so that its
  strided micro-batch ``d * k + i`` is device d's share of micro-batch i (a stack of ``K``
  micro-batches of ``m`` becomes ``n * K`` of ``m / n``, count ``n * c``); its per-example
  aux is permuted back, its stacked aux reordered device-major.

Every case also carries non-batch arguments as users send them: a scalar ``scale`` with a
replicated sharding and a lookup ``table`` sharded over the data axis (``P("data")``), which
every device must use whole. Options a placement documents it cannot honour (``noise_scale``
on Explicit axes, carried state on Auto axes, ``noise_scale`` with ``fsdp="microbatch"``) are
checked to be refused with their documented message while one device runs them.

Bounds (float32 reordering): both results are within ``n_ops * eps * M`` of the exact value,
where ``M`` is the same weighted sum taken over the absolute values of every term (computed
here in float64 from the per-example gradient formulas with absolute values) and ``n_ops``
counts the terms of the longest chain of sums (the examples, the forward pass's D + H, the
micro-batches and devices, a few divisions), as ``tests/reference.py`` does; their difference
is within twice that. A slip (a mean of means over unequal units, a share of the table, a
count over the wrong rows, an option dropped on one path) is off by 1e-2 or more.

Prints ``{"checks", "failures", "refusals", "seconds"}`` as JSON on its last line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import traceback
from typing import Any, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from tests.launcher import raised_in_library

from .common import emit

D, H, T = 8, 4, 8  # input width, hidden width, table entries (one per device of data=8)
EPS32 = float(np.finfo(np.float32).eps)
EPS16 = 2.0 ** -8  # bfloat16's unit roundoff
B = 16
AUX_TREE = {"stack": "stack", "concat": "concat", "sum": "sum", "mean": "mean",
            "weighted_mean": "weighted_mean", "max": "max", "min": "min", "last": "last",
            "count": "sum"}


# --- the model: a per-example loss, its aux, and the magnitudes of its gradient terms ---------

def forward(p: Any, x: Any, i: Any, scale: Any, table: Any) -> Any:
    """Per-example residual ``scale * t_i * sum(tanh(x W + b)) - y`` without the ``- y``."""
    h = jnp.tanh(x @ p["w"] + p["b"])
    # the lookup as a one-hot product: Explicit axes refuse a gather of a replicated table by
    # batch-sharded indices (JAX asks for an out_sharding), a matmul's sharding is resolved
    return scale * (jax.nn.one_hot(i, T, dtype=table.dtype) @ table) * jnp.sum(h, -1)


def outputs(r: Any, m: Any, weighted: bool, aux: Any) -> Any:
    sq = r * r
    value = (jnp.sum(m * sq) / jnp.sum(m), jnp.sum(m)) if weighted else jnp.mean(sq)
    if aux is None:
        return value
    avg = jnp.mean(r)
    leaves = {"stack": r, "concat": r, "sum": avg, "mean": avg, "weighted_mean": avg,
              "max": avg, "min": avg, "last": avg, "count": jnp.sum(r > 0).astype(jnp.int32)}
    if aux is True or isinstance(aux, str):  # one name for the whole aux: a scalar leaf
        return value, {"avg": avg} if aux != "concat" else {"r": r}
    return value, {name: leaves[name] for name in aux}


def loss_plain(weighted: bool, aux: Any):
    def loss(p, batch, scale, table):
        x, y, m, i = batch
        return outputs(forward(p, x, i, scale, table) - y, m, weighted, aux)
    return loss


def loss_positions(weighted: bool, aux: Any):
    """argnums=(0, 2) (the parameters and the scale), batch_argnums=(1, 3)."""
    def loss(p, x, scale, rest, table):
        y, m, i = rest
        return outputs(forward(p, x, i, scale, table) - y, m, weighted, aux)
    return loss


def loss_carry(weighted: bool, aux: Any):
    """carry_argnums=4: a decaying, data-dependent state (its order matters)."""
    def loss(p, batch, scale, table, c):
        x, y, m, i = batch
        out = outputs(forward(p, x, i, scale, table) - y, m, weighted, aux)
        return out, {"s": 0.5 * c["s"] + jnp.mean(x[:, 0]), "n": c["n"] + 1}
    return loss


def loss_refused_concat(weighted: bool, aux: Any):  # "concat" of a scalar: refused everywhere
    def loss(p, batch, scale, table):
        x, y, m, i = batch
        r = forward(p, x, i, scale, table) - y
        return jnp.mean(r * r), {"avg": jnp.mean(r)}
    return loss


def loss_refused_vector(weighted: bool, aux: Any):  # a loss that is not a scalar
    def loss(p, batch, scale, table):
        x, y, m, i = batch
        return (forward(p, x, i, scale, table) - y) ** 2
    return loss


def magnitudes(p: dict, x: np.ndarray, y: np.ndarray, i: np.ndarray, scale: float,
               table: np.ndarray) -> tuple[dict, np.ndarray, np.ndarray]:
    """Per example, float64: the gradient formulas with absolute values (``|1 - h^2| <= 1``),
    ``|r|``'s bound and ``|r|^2`` (the loss term)."""
    w, b = (np.asarray(p[k], np.float64) for k in ("w", "b"))
    x = np.asarray(x, np.float64)
    with np.errstate(all="ignore"):
        h_abs = np.minimum(1.0, np.abs(x) @ np.abs(w) + np.abs(b))  # |tanh z| <= min(1, |z|)
        t = np.abs(np.asarray(table, np.float64)[i]) * abs(scale)
        r_abs = t * h_abs.sum(-1) + np.abs(np.asarray(y, np.float64))
        g = 2 * r_abs * t  # d sq / d z, in absolute value
        grads = {"w": g[:, None, None] * np.abs(x)[:, :, None] * np.ones(H),
                 "b": g[:, None] * np.ones(H),
                 "scale": 2 * r_abs * np.abs(np.asarray(table, np.float64)[i]) * h_abs.sum(-1)}
    return grads, r_abs, r_abs**2


# --- cases ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    front: str = "vg"  # "vg" (value_and_grad under jax.jit) or "step" (train_step)
    options: tuple[tuple[str, Any], ...] = (("num_microbatches", 2),)
    aux: Any = None  # None, True, a name, or a tuple of AUX_TREE names
    weighted: bool = False
    data: str = "plain"  # "plain", "zero_share" (device 0's examples weigh 0), "nan"
    counts: tuple[int, ...] = ()  # runtime counts (max_microbatches=K): the batch is a stack
    positions: bool = False  # argnums=(0, 2), batch_argnums=(1, 3)
    carry: bool = False
    # the kernel sharded over the data axis, with this mode
    fsdp: Literal["step", "microbatch"] | None = None
    param_shardings: bool = False
    bf16: bool = False
    return_info: bool = True
    loss: Any = loss_plain
    refused: bool = False  # refused on one device and on every mesh, with the same message
    meshes: tuple[str, ...] = ("auto8", "explicit8", "auto4x2", "explicit4x2")
    deep: bool = False  # run only with the argument "deep" (tests/test_mesh_parity.py, slow)

    @property
    def opts(self) -> dict[str, Any]:
        out = dict(self.options)
        if self.aux is not None:
            out["has_aux"] = ({n: AUX_TREE[n] for n in self.aux} if isinstance(self.aux, tuple)
                              else self.aux)
        if self.weighted:
            out["weighted"] = True
        return out


EVERY = tuple(AUX_TREE)
SMALL = ("auto8", "explicit8")  # the data x model meshes for the cases that shard params
CASES = [
    Case("plain k=2", options=(("num_microbatches", 2),), return_info=False, meshes=SMALL),
    Case("plain k=2 step", front="step", meshes=SMALL, deep=True),
    # one micro-batch per device: each device's share of a micro-batch is one example
    Case("microbatch_size=1", options=(("microbatch_size", 1),), aux=("concat", "count")),
    Case("microbatch_size=1 step", front="step", options=(("microbatch_size", 1),),
         meshes=SMALL, deep=True),
    Case("aux tree, weighted, zero share, unroll=2",
         options=(("num_microbatches", 2), ("unroll", 2)), aux=EVERY, weighted=True,
         data="zero_share", meshes=SMALL),
    Case("has_aux=True, unroll=True", options=(("num_microbatches", 2), ("unroll", True)),
         aux=True, meshes=SMALL, deep=True),
    Case("has_aux='concat' k=1", options=(("num_microbatches", 1),), aux="concat",
         meshes=SMALL, deep=True),
    Case("has_aux='mean' weighted step", front="step", aux="mean", weighted=True,
         meshes=SMALL, deep=True),
    Case("skip_nonfinite with a NaN example",
         options=(("num_microbatches", 2), ("skip_nonfinite", True)), aux=EVERY, data="nan",
         meshes=SMALL),
    Case("skip_nonfinite weighted step", front="step",
         options=(("num_microbatches", 2), ("skip_nonfinite", True)), weighted=True,
         data="nan", aux=("sum", "last", "count"), meshes=SMALL, deep=True),
    Case("max_microbatches, aux tree", options=(("max_microbatches", 2),), counts=(2, 1, 0),
         aux=EVERY, weighted=True, meshes=SMALL),
    Case("max_microbatches step", front="step", options=(("max_microbatches", 2),),
         counts=(1, 2), meshes=SMALL, deep=True),
    Case("noise_scale", options=(("num_microbatches", 2), ("noise_scale", True))),
    Case("noise_scale weighted step", front="step",
         options=(("num_microbatches", 2), ("noise_scale", True)), weighted=True,
         meshes=SMALL, deep=True),
    Case("bf16 parameters, float32 accumulator", bf16=True, aux=("mean",), meshes=SMALL),
    Case("bf16 parameters, accumulator_dtype=None step", front="step", bf16=True,
         options=(("num_microbatches", 2), ("accumulator_dtype", None)), meshes=SMALL),
    Case("argnums=(0, 2), batch_argnums=(1, 3)", positions=True, aux=("concat", "sum"),
         loss=loss_positions, meshes=SMALL),
    Case("carry_argnums", carry=True, loss=loss_carry),
    Case("carry_argnums step", front="step", carry=True, loss=loss_carry, meshes=SMALL,
         deep=True),
    Case("fsdp=step, param_shardings", fsdp="step", param_shardings=True, deep=True),
    Case("fsdp=microbatch, param_shardings", fsdp="microbatch", param_shardings=True,
         aux=("sum",)),
    Case("fsdp=step step", front="step", fsdp="step"),
    Case("fsdp=microbatch step", front="step", fsdp="microbatch", deep=True),
    Case("noise_scale with fsdp=microbatch", fsdp="microbatch",
         options=(("num_microbatches", 2), ("noise_scale", True)), meshes=("auto8",)),
    Case("refused: concat of a scalar", loss=loss_refused_concat, aux="concat", refused=True,
         meshes=("auto8", "explicit8")),
    Case("refused: a loss that is no scalar", front="step", loss=loss_refused_vector,
         refused=True, meshes=("auto8", "explicit8")),
]


def documented_refusal(case: Case, mesh: str) -> str | None:
    """The start of the message a placement documents for what it cannot honour, or None."""
    opts = case.opts
    if opts.get("noise_scale") and mesh.startswith("explicit"):
        return "noise_scale=True is not available on a mesh whose data axes"
    if opts.get("noise_scale") and case.fsdp == "microbatch":
        return "noise_scale=True with fsdp='microbatch'"
    if case.carry and mesh.startswith("auto"):
        return "carry_argnums=(4,) with a mesh whose data axes"
    return None


# --- data ----------------------------------------------------------------------------------

def make_data(case: Case) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    p = {"w": (rng.normal(size=(D, H)) / 3).astype(np.float32),
         "b": (rng.normal(size=(H,)) / 4).astype(np.float32)}
    x = rng.normal(size=(B, D)).astype(np.float32)
    y = rng.normal(size=(B,)).astype(np.float32)
    m = rng.choice(np.array([1.0, 2.0, 3.0], np.float32), size=B)
    i = rng.integers(0, T, size=B).astype(np.int32)
    if case.data == "zero_share":
        m[:2] = 0.0  # device 0's examples on data=8: an empty share (or half of one)
    elif case.data == "nan":
        x[[1, 3], 0] = np.nan  # micro-batch 1 of 2 (odd examples): on devices 0 and 1 of
        # data=8 (two shares skipped, summed over devices), on device 0 of data=4
    table = np.linspace(0.5, 2.0, T).astype(np.float32)  # the loss needs every entry
    return {"p": p, "batch": (x, y, m, i), "scale": np.float32(0.75), "table": table,
            "carry": {"s": np.float32(0.25), "n": np.int32(0)}}


def permutation(n: int, k: int) -> np.ndarray:
    """perm[q]: the example at position q of the one-device batch whose strided micro-batch
    ``d * k + i`` (of ``n * k``) is device d's share of micro-batch i on an Auto mesh."""
    big, share = n * k, B // n
    q = np.arange(B)
    unit, j = q % big, q // big
    return (unit // k) * share + unit % k + k * j


# --- running -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Where:
    """A placement: one device, or a mesh of ``n`` data devices (Auto or Explicit)."""

    name: str
    mesh: Any = None
    n: int = 1

    @property
    def explicit(self) -> bool:
        return self.mesh is not None and self.name.startswith("explicit")


def meshes() -> dict[str, Where]:
    out = {}
    for kind, types in (("auto", AxisType.Auto), ("explicit", AxisType.Explicit)):
        out[f"{kind}8"] = Where(f"{kind}8", jax.make_mesh((8,), ("data",), (types,)), 8)
        out[f"{kind}4x2"] = Where(f"{kind}4x2", jax.make_mesh((4, 2), ("data", "model"),
                                                             (types, types)), 4)
    return out


def shardings(case: Case, where: Where) -> dict[str, Any]:
    """Where every argument lives on the mesh (specs): FSDP kernels over the data axis,
    tensor-parallel leaves over "model" on the 4 x 2 mesh, the table over the data axis."""
    model = "model" if "model" in where.mesh.axis_names else None
    w = P("data" if case.fsdp else None, model)
    return {"p": {"w": w, "b": P(model)}, "x": P("data"), "stack": P(None, "data"),
            "table": P("data"), "scale": P()}


def put(where: Where, tree: Any, spec: P) -> Any:
    return jax.device_put(tree, NamedSharding(where.mesh, spec))


BUILT: dict[Any, Any] = {}


def call(case: Case, where: Where, data: dict[str, Any], opts: dict[str, Any],
         count: int | None) -> dict[str, Any]:
    """One run of ``case`` at ``where``; every output as NumPy, with its dtype."""
    loss = case.loss(case.weighted, case.aux)
    p = data["p"]
    if case.bf16:
        p = jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16), p)
    batch, scale, table, carry = data["batch"], data["scale"], data["table"], data["carry"]
    if where.mesh is not None:
        specs = shardings(case, where)
        hints = case.param_shardings and not where.explicit  # Explicit: refused (in types)
        dp = jaxaccum.DataParallel(where.mesh, data_axis="data", fsdp=case.fsdp or "step",
                                   param_shardings=specs["p"] if hints else None)
        opts = {**opts, "mesh": dp}
        p = {k: put(where, v, specs["p"][k]) for k, v in p.items()}
        batch = put(where, batch, specs["stack"] if count is not None else specs["x"])
        table = put(where, table, specs["table"])
        scale = put(where, scale, specs["scale"])
        carry = put(where, carry, P())
    if count is not None:
        batch = jaxaccum.Microbatches(batch, np.int32(count))
    context = jax.set_mesh(where.mesh) if where.mesh is not None else contextlib.nullcontext()
    # one function per case, placement and options: the runtime counts reuse its program
    key = (case.name, where.name, repr(sorted(opts.items(), key=lambda kv: kv[0])))
    with context:
        if case.front == "vg":
            args: tuple[Any, ...]
            if case.positions:
                args = (p, batch[0] if count is None else _part(batch, 0), scale,
                        batch[1:] if count is None else _part(batch, slice(1, None)), table)
                fn = jaxaccum.value_and_grad(loss, argnums=(0, 2), batch_argnums=(1, 3),
                                             return_info=case.return_info, **opts)
            elif case.carry:
                args = (p, batch, scale, table, carry)
                fn = jaxaccum.value_and_grad(loss, carry_argnums=4,
                                             return_info=case.return_info, **opts)
            else:
                args = (p, batch, scale, table)
                fn = jaxaccum.value_and_grad(loss, return_info=case.return_info, **opts)
            out = BUILT.setdefault(key, jax.jit(fn))(*args)
            value, grads = out[0], out[1]
            info = out[2] if case.return_info else None
            result = {"value": value, "grads": grads, "info": info}
        else:
            opt = optax.sgd(1.0, momentum=0.5)
            step = BUILT.setdefault(key, jaxaccum.train_step(
                loss, opt, donate=False, carry_argnums=4 if case.carry else (), **opts))
            rest = (scale, table, carry) if case.carry else (scale, table)
            new, state, value, info = step(p, opt.init(p), batch, *rest)
            result = {"value": value, "params": new, "state": state, "info": info}
    return jax.tree.map(lambda a: np.asarray(a), result)


def _part(stack: Any, at: Any) -> Any:
    return jaxaccum.Microbatches(stack.data[at], stack.count)


def reference_inputs(case: Case, where: Where, data: dict[str, Any], count: int | None
                     ) -> tuple[dict[str, Any], dict[str, Any], int | None, Any]:
    """The one-device run that ``where`` must equal: its data, options, count and the map of
    its outputs back to the mesh's layout (``remap(name, array)``)."""
    opts = dict(case.opts)
    n = where.n
    if where.explicit:  # global micro-batches: a per-device microbatch_size is n times that
        if "microbatch_size" in opts:
            opts["microbatch_size"] *= n
        return data, opts, count, lambda name, a: a
    if count is not None:  # K micro-batches of m -> n K of m / n, row i * n + d
        k = opts["max_microbatches"]
        opts["max_microbatches"] = k * n
        batch = tuple(np.asarray(a).reshape(k * n, B // (k * n), *np.shape(a)[2:])
                      for a in _stacked(data["batch"], k))

        def remap(name: str, a: np.ndarray) -> np.ndarray:
            if name == "stack":  # one's row i * n + d -> the mesh's d * K + i
                return a.reshape(k, n, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
            if name in ("concat", "r"):  # (n K, m / n) -> (K, m)
                return a.reshape(k, -1)
            return a

        return {**data, "batch": batch}, opts, count * n, remap
    share = B // n
    k = opts.pop("num_microbatches", None)
    if k is None:
        k = share // opts["microbatch_size"]
    else:
        opts["num_microbatches"] = k * n
    perm = permutation(n, k)
    batch = tuple(np.asarray(a)[perm] for a in data["batch"])

    def unpermute(name: str, a: np.ndarray) -> np.ndarray:
        if name in ("concat", "r"):
            out = np.empty_like(a)
            out[perm] = a
            return out
        return a

    return {**data, "batch": batch}, opts, None, unpermute


def _stacked(batch: tuple[np.ndarray, ...], k: int) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(a).reshape(k, B // k, *np.shape(a)[1:]) for a in batch)


def run_at(case: Case, where: Where, data: dict[str, Any], count: int | None) -> Any:
    d = data if count is None else {**data, "batch": _stacked(data["batch"],
                                                              case.opts["max_microbatches"])}
    return call(case, where, d, case.opts, count)


# --- comparing -----------------------------------------------------------------------------

def bounds(case: Case, where: Where, data: dict[str, Any], count: int | None) -> dict[str, Any]:
    """Absolute bounds on |mesh - one device| per output (see the module docstring)."""
    x, y, m, i = (np.asarray(a) for a in data["batch"])
    evaluated = np.arange(B)
    if count is not None:
        per = B // case.opts["max_microbatches"]
        evaluated = np.arange(count * per)
    grads, r_abs, sq_abs = magnitudes(data["p"], x, y, i, float(data["scale"]), data["table"])
    finite = np.isfinite(x).all(1)
    keep = np.zeros(B, bool)
    keep[evaluated] = True
    keep &= finite  # a non-finite example's unit is skipped or NaN on both
    if case.weighted:
        c = np.where(keep, np.abs(m), 0.0)
        c = c / max(c.sum(), 1e-30)  # |m_j| / total weight (the kept weight is at least that)
    else:
        c = keep / max(len(evaluated) - (~finite).sum(), 1)  # each example once in the mean
    mag = {k: np.tensordot(c, np.nan_to_num(v), axes=(0, 0)) for k, v in grads.items()}
    loss_mag = float(np.sum(c * np.nan_to_num(sq_abs)))
    k = dict(case.opts).get("num_microbatches") or dict(case.opts).get("max_microbatches") or B
    n_ops = B + D + H + k * where.n + where.n + 8
    eps = EPS16 if case.bf16 and "accumulator_dtype" in dict(case.opts) else EPS32
    grad_rel = 2 * n_ops * eps + (2 * EPS16 if case.bf16 else 0.0)  # bf16: each micro-batch's
    # (or share's) gradient is rounded to bfloat16 before it is summed, once a side
    out = {"loss": 2 * n_ops * EPS32 * loss_mag + 1e-30,
           "grads": {k: grad_rel * v + 1e-30 for k, v in mag.items()},
           "bf16_final": 2 * EPS16 if case.bf16 else 0.0,  # one rounding to bf16 per side
           "aux": 2 * n_ops * EPS32 * (float(np.max(np.nan_to_num(r_abs))) * B + 1.0),
           "carry": 2 * (B + k) * EPS32 * (np.max(np.abs(np.nan_to_num(x))) + 1.0)}
    return out


def compare(name: str, got: Any, want: Any, bound: Any, failures: list[str]) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype:
        failures.append(f"{name}: dtype {got.dtype}, one device {want.dtype}")
        return
    if got.shape != want.shape:
        failures.append(f"{name}: shape {got.shape}, one device {want.shape}")
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    if not np.array_equal(np.isnan(g), np.isnan(w)):
        failures.append(f"{name}: NaN at {np.argwhere(np.isnan(g)).tolist()}, one device at "
                        f"{np.argwhere(np.isnan(w)).tolist()}")
        return
    ok = ~np.isnan(w)
    with np.errstate(all="ignore"):
        diff = np.where(ok, np.abs(g - w), 0.0)
        bad = (diff > np.broadcast_to(bound, w.shape)) & (g != w)
    if np.any(bad):
        worst = np.unravel_index(np.argmax(np.where(bad, diff, 0)), w.shape) if w.ndim else ()
        failures.append(f"{name}: {g[worst]} on the mesh, {w[worst]} on one device (bound "
                        f"{np.broadcast_to(bound, w.shape)[worst]:.3g}); mesh {g.ravel()[:8]}, "
                        f"one device {w.ravel()[:8]}")


def compare_results(case: Case, where: Where, got: dict, want: dict, remap: Any,
                    bnd: dict, failures: list[str]) -> None:
    tag = f"{case.name} @ {where.name}"
    value = got["value"]
    want_value = want["value"]
    if case.carry and case.front == "vg":
        (value, carry), (want_value, want_carry) = value, want_value
        for key in carry:
            compare(f"{tag}: carry {key}", carry[key], want_carry[key], bnd["carry"], failures)
    has_aux = case.aux is not None and case.front == "vg"
    loss, aux = value if has_aux else (value, None)
    want_loss, want_aux = want_value if has_aux else (want_value, None)
    compare(f"{tag}: loss", loss, want_loss, bnd["loss"], failures)
    if "grads" in got:
        gg, wg = got["grads"], want["grads"]
        if case.positions:  # (grads of p, grad of scale)
            compare(f"{tag}: grads scale", gg[1], wg[1],
                    bnd["grads"]["scale"] + 1e-30, failures)
            gg, wg = gg[0], wg[0]
        for key in ("w", "b"):
            bound = bnd["grads"][key] + bnd["bf16_final"] * np.abs(wg[key].astype(np.float64))
            compare(f"{tag}: grads {key}", gg[key], wg[key], bound, failures)
    else:  # SGD(1) with momentum 0.5, first step: params - g, trace g
        for key in ("w", "b"):
            wp = want["params"][key].astype(np.float64)
            bound = (bnd["grads"][key] + 2 * EPS32 * np.abs(wp)
                     + bnd["bf16_final"] * (np.abs(wp) + 1.0))
            compare(f"{tag}: params {key}", got["params"][key], want["params"][key], bound,
                    failures)
            gs = jax.tree.leaves(got["state"])
            ws = jax.tree.leaves(want["state"])
            for n, (a, b) in enumerate(zip(gs, ws, strict=True)):
                compare(f"{tag}: opt_state leaf {n}", a, b,
                        bnd["grads"]["w" if np.shape(b) == (D, H) else "b"]
                        + bnd["bf16_final"] * np.abs(b.astype(np.float64)), failures)
    info, want_info = got["info"], want["info"]
    if info is not None or want_info is not None:
        if case.front == "step" and case.aux is not None:
            aux, want_aux = info.aux, want_info.aux
        for field in ("skipped", "num_microbatches"):
            compare(f"{tag}: info.{field}", getattr(info, field), getattr(want_info, field), 0,
                    failures)
        compare(f"{tag}: info.weight", info.weight, want_info.weight,
                8 * EPS32 * abs(float(want_info.weight)), failures)
        if (info.noise_scale is None) != (want_info.noise_scale is None):
            failures.append(f"{tag}: noise_scale {info.noise_scale}, one device "
                            f"{want_info.noise_scale}")
        elif info.noise_scale is not None:
            compare_noise(tag, info.noise_scale, want_info.noise_scale, failures)
        if case.carry and case.front == "step":
            for key in info.carry:
                compare(f"{tag}: info.carry {key}", info.carry[key], want_info.carry[key],
                        bnd["carry"], failures)
    if aux is not None or want_aux is not None:
        if aux is None or want_aux is None or set(aux) != set(want_aux):
            failures.append(f"{tag}: aux {aux}, one device {want_aux}")
            return
        for key in aux:
            exact = key == "count"  # an integer sum: exact
            compare(f"{tag}: aux {key}", aux[key], remap(key, want_aux[key]),
                    0 if exact else bnd["aux"], failures)


def compare_noise(tag: str, got: Any, want: Any, failures: list[str]) -> None:
    """The noise scale subtracts sums of squared norms: float32 loses eps times their size
    (each share's gradient is within n_ops eps of the other side's; tests/reference.py's
    bound for the same estimators)."""
    big, small = float(want.big_batch), float(want.small_batch)
    compare(f"{tag}: noise big_batch", got.big_batch, want.big_batch, 4 * EPS32 * abs(big),
            failures)
    compare(f"{tag}: noise small_batch", got.small_batch, want.small_batch,
            8 * EPS32 * abs(small), failures)
    mag = (abs(float(want.gradient_sq)) + 4 * abs(float(want.trace)) + 1.0) * 1e3 * EPS32 * big
    compare(f"{tag}: noise trace", got.trace, want.trace, mag, failures)
    compare(f"{tag}: noise gradient_sq", got.gradient_sq, want.gradient_sq, mag, failures)


def message(error: BaseException) -> str:
    """A refusal's message with the entry point taken out (the same on every placement)."""
    text = str(error).split("\n")[0]
    return f"{type(error).__name__}: {text.split(': ', 1)[-1]}"


def main() -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    start = time.perf_counter()
    only = sys.argv[1] if len(sys.argv) > 1 else ""  # "deep": every case; else a name part
    places = meshes()
    failures: list[dict[str, Any]] = []
    refusals: dict[str, Any] = {}
    checks = 0
    times: dict[str, float] = {}
    one = Where("one")
    for case in CASES:
        if (case.deep and only != "deep") or (only not in ("", "deep") and only not in case.name):
            continue
        data = make_data(case)
        for count in case.counts or (None,):
            refs: dict[Any, Any] = {}
            for mesh_name in case.meshes:
                where = places[mesh_name]
                tag = f"{case.name} @ {mesh_name}" + ("" if count is None else f" count={count}")
                checks += 1
                began = time.perf_counter()
                try:
                    ref_data, ref_opts, ref_count, remap = reference_inputs(case, where, data,
                                                                            count)
                    key = (repr(sorted(ref_opts.items())), ref_count, where.explicit, where.n
                           if not where.explicit else 0)
                    if key not in refs:
                        try:
                            d = ref_data  # (a stack already on Auto axes)
                            if ref_count is not None and where.explicit:
                                d = {**ref_data, "batch": _stacked(
                                    ref_data["batch"], ref_opts["max_microbatches"])}
                            refs[key] = call(case, one, d, ref_opts, ref_count)
                        except (ValueError, TypeError) as error:
                            refs[key] = error
                    want = refs[key]
                    documented = documented_refusal(case, mesh_name)
                    try:
                        got = run_at(case, where, data, count)
                    except (ValueError, TypeError) as error:
                        got = error
                    if documented is not None:
                        ok = isinstance(got, ValueError) and documented in str(got)
                        refusals[tag] = {"documented": True, "mesh": message(got) if isinstance(
                            got, Exception) else None, "one_device_ran":
                            not isinstance(want, Exception)}
                        assert ok, f"{tag}: expected the documented refusal {documented!r}; " \
                            f"got {got!r}"
                        assert not isinstance(want, Exception), f"{tag}: one device refused " \
                            f"{want!r}"
                        continue
                    if isinstance(want, Exception) or isinstance(got, Exception):
                        assert isinstance(want, Exception) and isinstance(got, Exception), (
                            f"{tag}: refused on one side only: mesh {got!r}, one device "
                            f"{want!r}")
                        refusals[tag] = {"documented": False, "mesh": message(got),
                                         "one_device": message(want)}
                        assert message(got) == message(want), (
                            f"{tag}: refused with different messages:\n mesh: {got}\n one "
                            f"device: {want}")
                        assert case.refused, f"{tag}: valid input refused: {got}"
                        continue
                    assert not case.refused, f"{tag}: expected a refusal on both"
                    wrong: list[str] = []
                    compare_results(case, where, got, want, remap,
                                    bounds(case, where, data, count), wrong)
                    assert not wrong, "\n".join(wrong)
                except Exception as error:  # noqa: BLE001 - reported with the case
                    failures.append({"case": tag, "asserted": isinstance(error, AssertionError)
                                     and not raised_in_library(error),
                                     "text": traceback.format_exc()[-2500:]})
                finally:
                    times[tag] = round(time.perf_counter() - began, 2)
    emit({"checks": checks, "failures": failures, "refusals": refusals, "times": times,
          "seconds": time.perf_counter() - start})


if __name__ == "__main__":
    main()
