"""The tiled contrastive losses by a ring over 8 host devices (``axis_name`` inside
``jax.shard_map``), on Auto and Explicit data meshes: value and gradients (both sides, scale,
bias) against one device; the compiled program's collectives; and through
``jaxaccum.coupled_value_and_grad`` against one device."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._xla import hlo as _hlo
from jaxaccum.contrastive import clip_loss, pairwise_logsumexp, pairwise_sum, siglip_loss

from .common import emit, hlo_text, memory

B, D, E, TILE = 8 * 24, 12, 6, 10  # tiles that do not divide a device's 24 rows


def rel(a: Any, b: Any) -> list[float]:
    """Per leaf: max |a - b| over max(|b|, 1) (the scale and bias gradients are sums of B^2
    terms of size ~1: an absolute floor of 1 on the denominator keeps a near-0 leaf honest)."""
    return [float(np.max(np.abs(np.asarray(x) - np.asarray(y)))
                  / max(1.0, float(np.max(np.abs(np.asarray(y))))))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]


def losses(mesh: jax.sharding.Mesh, a: Any, b: Any, s: Any, t: Any, mask: Any) -> dict[str, Any]:
    """Value and gradients of both losses by the ring, and their compiled HLO."""
    def ring(name: str) -> Any:
        def local(a: jax.Array, b: jax.Array, s: jax.Array, t: jax.Array,
                  m: jax.Array) -> jax.Array:
            if name == "clip":
                return clip_loss(a, b, s, tile=TILE, mask=m, axis_name="data")
            return siglip_loss(a, b, s, t, tile=TILE, mask=m, axis_name="data")
        return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data"), P(), P(),
                                                         P("data")), out_specs=P())

    out = {}
    for name in ("clip", "siglip"):
        fn = jax.jit(jax.value_and_grad(ring(name), argnums=(0, 1, 2, 3)))
        out[name] = (fn(a, b, s, t, mask), hlo_text(fn.lower(a, b, s, t, mask).compile()))
    return out


U16 = 2.0**-8  # bfloat16's unit roundoff
EPS32 = float(np.finfo(np.float32).eps)


def bf16_errors(got: Any, one: Any, ref: Any) -> list[dict[str, float]]:
    """Per leaf of a bfloat16 run: its largest error, one device's (the same loss on one
    device, same bf16 inputs) and the bound for it: one device's error, plus one final
    rounding for a bf16 leaf (U16 of the leaf's largest value; the float32 value and scale
    and bias gradients are never rounded), plus float32's reordering (64 eps32 of it).
    ``ref``: the loss in float32 on the same bf16 values (exact inputs, float32 sums: far
    closer to the truth than either bf16 run)."""
    out = []
    for x, o, r in zip(*(map(jax.tree.leaves, (got, one, ref))), strict=True):
        rounding = U16 if x.dtype == jnp.bfloat16 else 0.0
        x, o, r = (np.asarray(v, np.float64) for v in (x, o, r))
        big = float(np.max(np.abs(r)))
        out.append({"error": float(np.max(np.abs(x - r))),
                    "one_device": float(np.max(np.abs(o - r))),
                    "bound": float(np.max(np.abs(o - r))) + (rounding + 64 * EPS32) * big})
    return out


def one_device(a: Any, b: Any, s: Any, t: Any, mask: Any) -> dict[str, Any]:
    return {
        "clip": jax.jit(jax.value_and_grad(lambda a, b, s, t: clip_loss(
            a, b, s, tile=TILE, mask=mask), argnums=(0, 1, 2, 3)))(a, b, s, t),
        "siglip": jax.jit(jax.value_and_grad(lambda a, b, s, t: siglip_loss(
            a, b, s, t, tile=TILE, mask=mask), argnums=(0, 1, 2, 3)))(a, b, s, t),
    }


def main() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, B, E)).astype(np.float32)
    mask = rng.uniform(size=B) > 0.2
    s, t = np.float32(1.1), np.float32(-2.0)
    ref = one_device(a, b, s, t, mask)
    # bfloat16 representations: every sum float32 on both sides, each gradient rounded once
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    ref16 = one_device(a16, b16, s, t, mask)
    exact16 = one_device(np.asarray(a16, np.float32), np.asarray(b16, np.float32), s, t, mask)
    out: dict[str, Any] = {"reps_bytes": B * E * 4}
    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
        with jax.set_mesh(mesh):
            rows = NamedSharding(mesh, P("data"))
            got = losses(mesh, jax.device_put(a, rows), jax.device_put(b, rows), s, t,
                         jax.device_put(mask, rows))
            got16 = losses(mesh, jax.device_put(a16, rows), jax.device_put(b16, rows), s, t,
                           jax.device_put(mask, rows))
        for name, ((value, grads), _) in got16.items():
            out[f"{name}-bf16/{kind.name.lower()}"] = {
                "leaves": bf16_errors((value, grads), ref16[name], exact16[name]),
                "dtypes": [str(x.dtype) for x in jax.tree.leaves((value, grads))]}
        for name, ((value, grads), hlo) in got.items():
            ops = _hlo.collectives(hlo)
            out[f"{name}/{kind.name.lower()}"] = {
                "rel": rel((value, grads), ref[name]),
                "collectives": sorted({op for op, _, _, _ in ops}),
                "all_gather_bytes": max([size for op, _, size, _ in ops if op == "all-gather"],
                                        default=0),
            }
        with jax.set_mesh(mesh):
            for name, r in blocks(mesh).items():
                out[f"{name}/{kind.name.lower()}"] = r
    out["coupled"] = coupled()
    out["memory"] = ring_memory()
    emit(out)


N_B = 8 * 5 + 3  # the whole other side: tiles (TILE) that divide neither it nor a device's 24


def block_score(p: Any, x: Any, y: jax.Array) -> jax.Array:
    """A pytree side and pytree params: ``exp(p["t"]) * x["u"] . y + p["c"] * |x["v"]|``."""
    dot = jnp.einsum("id,jd->ij", x["u"], y, preferred_element_type=jnp.float32)
    return jnp.exp(p["t"]) * dot + p["c"] * jnp.sum(x["v"] ** 2, axis=1)[:, None]


def block_term(p: Any, x: Any, y: jax.Array, positive: jax.Array) -> jax.Array:
    return jnp.tanh(block_score(p, x, y))  # positive: local indices per device, not used


def blocks(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """The building blocks called per device inside ``jax.shard_map`` (a sharded over the
    data axis; b, its mask and the params replicated): ``pairwise_logsumexp`` of this device's
    rows of a against the whole b, and ``pairwise_sum`` of this device's rows against all of b,
    psum'ed, against one device: value and gradients (params, a, b). Their scan carries must
    be typed varying from the start (the scores vary over the axis), and the replicated inputs'
    cotangents summed over the devices."""
    rng = np.random.default_rng(2)
    a = {"u": rng.normal(size=(B, E)).astype(np.float32),
         "v": rng.normal(size=(B, 2)).astype(np.float32)}
    b = rng.normal(size=(N_B, E)).astype(np.float32)
    p = {"t": np.float32(0.3), "c": np.float32(-0.2)}
    mask_a, mask_b = rng.uniform(size=B) > 0.2, rng.uniform(size=N_B) > 0.2

    def lse(p: Any, a: Any, b: Any, mb: Any) -> jax.Array:
        return pairwise_logsumexp(block_score, p, a, b, tile=TILE, mask=mb)

    def total(p: Any, a: Any, b: Any, ma: Any, mb: Any) -> jax.Array:
        return pairwise_sum(block_term, p, a, b, tile=TILE, mask_a=ma, mask_b=mb)

    def lse_loss(fn: Any) -> Any:  # a nonlinear use of every row's log-sum-exp
        return lambda p, a, b: jnp.sum(jnp.sin(fn(p, a, b, mask_b)))

    ring_lse = jax.shard_map(lse, mesh=mesh, in_specs=(P(), P("data"), P(), P()),
                             out_specs=P("data"))
    ring_total = jax.shard_map(lambda *args: jax.lax.psum(total(*args), "data"), mesh=mesh,
                               in_specs=(P(), P("data"), P(), P("data"), P()), out_specs=P())
    rows = NamedSharding(mesh, P("data"))
    a_rows, ma_rows = jax.device_put(a, rows), jax.device_put(mask_a, rows)
    out = {}
    for name, fn, ref_fn in (
            ("lse", lse_loss(ring_lse), lse_loss(lse)),
            ("sum", lambda p, a, b: ring_total(p, a, b, ma_rows, mask_b),
             lambda p, a, b: total(p, a, b, mask_a, mask_b))):
        got = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(p, a_rows, b)
        ref = jax.jit(jax.value_and_grad(ref_fn, argnums=(0, 1, 2)))(p, a, b)
        out[f"{name}-block"] = {"rel": rel(got, ref)}
    values = jax.jit(ring_lse)(p, a_rows, b, mask_b)
    out["lse-block"]["rows"] = rel(values, lse(p, a, b, mask_b))
    return out


def ring_memory() -> dict[str, Any]:
    """Per-device compiled temp of each loss's value and gradients by the ring, B = 8 x 4096,
    d = 64, tile 128, against one device's share of the representations (its rows of both
    sides): the tile buffers are small beside the share, so the share dominates."""
    n, d, tile = 8 * 4096, 64, 128
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    a = jax.device_put(np.zeros((n, d), np.float32), NamedSharding(mesh, P("data")))
    s, t = np.float32(2.0), np.float32(-1.0)
    out: dict[str, Any] = {"share": 2 * (n // 8) * d * 4}
    for name in ("clip", "siglip"):
        def local(a: jax.Array, b: jax.Array, s: jax.Array, t: jax.Array,
                  name: str = name) -> jax.Array:
            if name == "clip":
                return clip_loss(a, b, s, tile=tile, axis_name="data")
            return siglip_loss(a, b, s, t, tile=tile, axis_name="data")

        ring = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data"), P(), P()),
                             out_specs=P())
        compiled = jax.jit(jax.value_and_grad(ring, argnums=(0, 1, 2, 3))).lower(
            a, a, s, t).compile()
        out[name] = memory(compiled).temp_size_in_bytes
    return out


def coupled() -> dict[str, Any]:
    """A two-tower model whose loss is the ring CLIP loss, through coupled_value_and_grad on
    an Auto (8,) mesh, against the same step with the tiled loss on one device."""
    rng = np.random.default_rng(1)
    params = {"a": (rng.normal(size=(D, E)) / 3).astype(np.float32),
              "b": (rng.normal(size=(D, E)) / 3).astype(np.float32),
              "logit_scale": np.float32(1.5)}
    x = rng.normal(size=(B, D)).astype(np.float32)
    batch = (x, (x + 0.3 * rng.normal(size=(B, D))).astype(np.float32))

    def encode(p: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
        za, zb = jnp.tanh(batch[0] @ p["a"]), jnp.tanh(batch[1] @ p["b"])
        return (za / jnp.linalg.norm(za, axis=1, keepdims=True),
                zb / jnp.linalg.norm(zb, axis=1, keepdims=True))

    def one_device(p: Any, reps: Any, batch: Any) -> jax.Array:
        return clip_loss(reps[0], reps[1], p["logit_scale"], tile=TILE)

    ref = jax.jit(jaxaccum.coupled_value_and_grad(encode, one_device, num_microbatches=4))(
        params, batch)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def on_ring(p: Any, reps: Any, batch: Any) -> jax.Array:
        return jax.shard_map(
            lambda a, b, s: clip_loss(a, b, s, tile=TILE, axis_name="data"), mesh=mesh,
            in_specs=(P("data"), P("data"), P()), out_specs=P())(reps[0], reps[1],
                                                                 p["logit_scale"])

    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        bt = jax.device_put(batch, NamedSharding(mesh, P("data")))
        fn = jax.jit(jaxaccum.coupled_value_and_grad(encode, on_ring, num_microbatches=4,
                                                     mesh=mesh))
        got = fn(p, bt)
        hlo = hlo_text(fn.lower(p, bt).compile())
    return {"rel": rel(got, ref), "reductions": _hlo.gradient_reductions(hlo, 8),
            "collectives": sorted({op for op, _, _, _ in _hlo.collectives(hlo)})}


if __name__ == "__main__":
    main()
