"""The ring-tiled contrastive losses on 8 host devices: per-device memory against B / 8.

``jaxaccum.contrastive.clip_loss`` and ``siglip_loss`` with ``axis_name="data"`` inside a
``jax.shard_map`` over an 8-device data mesh: each device keeps its B / 8 rows of both sides
and the column tiles travel around the ring. For B = 8,192 and 65,536 (d = 32, tile 512), the
compiled value-and-gradient program's per-device memory (XLA's ``memory_analysis()``, which
reports one device's buffers of an SPMD program): the arguments each device holds (its rows
of both sides), temp, and both against one device's share of the representations (B / 8 rows
of both sides, float32) and against the whole batch's. One run checks the value against the
one-device tiled loss. Compile-time numbers: the machine's load does not change them.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/ring_memory.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import machine, save  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxaccum.contrastive import clip_loss, siglip_loss  # noqa: E402

D, TILE, DEVICES = 32, 512, 8


def ring(name: str, mesh: jax.sharding.Mesh) -> Any:
    def local(a: jax.Array, b: jax.Array, s: jax.Array, t: jax.Array) -> jax.Array:
        if name == "clip":
            return clip_loss(a, b, s, tile=TILE, axis_name="data")
        return siglip_loss(a, b, s, t, tile=TILE, axis_name="data")

    return jax.jit(jax.value_and_grad(jax.shard_map(
        local, mesh=mesh, in_specs=(P("data"), P("data"), P(), P()), out_specs=P()),
        argnums=(0, 1, 2, 3)))


def one_device(name: str) -> Any:
    def loss(a: jax.Array, b: jax.Array, s: jax.Array, t: jax.Array) -> jax.Array:
        if name == "clip":
            return clip_loss(a, b, s, tile=TILE)
        return siglip_loss(a, b, s, t, tile=TILE)

    return jax.jit(loss)


def main() -> None:
    mesh = jax.make_mesh((DEVICES,), ("data",))
    rows = NamedSharding(mesh, P("data"))
    out: dict[str, Any] = {"machine": machine(), "d": D, "tile": TILE, "devices": DEVICES,
                           "cases": {}}
    for n in (8_192, 65_536):
        rng = np.random.default_rng(n)
        a, b = (rng.normal(size=(2, n, D)) / np.sqrt(D)).astype(np.float32)
        s, t = np.float32(2.0), np.float32(-1.0)
        share = 2 * (n // DEVICES) * D * 4  # one device's rows of both sides
        for name in ("clip", "siglip"):
            fn = ring(name, mesh)
            args = (jax.device_put(a, rows), jax.device_put(b, rows), s, t)
            mem = fn.lower(*args).compile().memory_analysis()
            value, _ = fn(*args)
            ref = float(one_device(name)(a, b, s, t))
            row = {
                "argument_bytes": mem.argument_size_in_bytes,
                "temp_bytes": mem.temp_size_in_bytes,
                "output_bytes": mem.output_size_in_bytes,
                "share_bytes": share,
                "batch_bytes": share * DEVICES,
                "value_rel_diff": abs(float(value) - ref) / abs(ref),
            }
            row["temp_over_share"] = row["temp_bytes"] / share
            row["held_over_share"] = (row["argument_bytes"] + row["temp_bytes"]) / share
            out["cases"][f"{name}/{n}"] = row
            print(f"{name} B={n}: per device args {row['argument_bytes'] / 2**20:.2f} MiB, "
                  f"temp {row['temp_bytes'] / 2**20:.2f} MiB, share (B/8 rows of both sides) "
                  f"{share / 2**20:.2f} MiB, whole batch {share * DEVICES / 2**20:.2f} MiB; "
                  f"value vs one device {row['value_rel_diff']:.1e}", flush=True)
    print(f"wrote {save('ring_memory', out)}")


if __name__ == "__main__":
    main()
