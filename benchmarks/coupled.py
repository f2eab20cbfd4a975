"""Batch-coupled losses: a two-tower CLIP encoder, B = 1024, k = 1..64, four ways side by side.

- ``full batch``: ``jax.value_and_grad`` of the CLIP loss on the whole batch;
- ``jaxaccum.coupled_value_and_grad``: exact (a forward pass for the representations, the loss
  on all of them, a second pass pulling the cotangents back through each micro-batch);
- ``plain accumulation``: ``jaxaccum.value_and_grad`` of the same loss per micro-batch (B/k - 1
  negatives per example: another objective, shown for its cost only);
- ``coupled, tiled loss``: ``jaxaccum.coupled_value_and_grad`` with
  ``jaxaccum.contrastive.clip_loss`` (the same loss, tile by tile: no B x B array).

The tiled loss alone (``loss_alone``): value and gradient of the CLIP loss on random
representations, plain and tiled, at B = 1024 and 4096 (time in the same rounds, temp); and
(``big``) the tiled coupled step at B = 65,536, d = 32 on one device: temp and one timed run
(the plain loss's B x B logits alone would be 16 GiB).

The JSON also records the temp bytes of the coupled loss alone on the representations (its
B x B logits and their softmax), which no number of micro-batches divides.

Time per step (median of interleaved rounds, ratio to the full batch in the same rounds) and
the compiled program's temp bytes. Targets: time <= 1.4x the full batch (one extra forward);
temp <= the representations + 1.2 x the full batch's temp / k. Writes results/coupled.json and
coupled.png.

    python benchmarks/coupled.py                 # ~8 min on 2 cores
    python benchmarks/coupled.py --ks 1 8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import machine, result_path, save

import jaxaccum
from jaxaccum import contrastive

B, D, H, E = 1024, 256, 512, 128
TILE = 256


def tower(rng: np.random.Generator) -> dict[str, jax.Array]:
    return {"w1": jnp.asarray(rng.normal(size=(D, H)) / np.sqrt(D), jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(H, H)) / np.sqrt(H), jnp.float32),
            "w3": jnp.asarray(rng.normal(size=(H, E)) / np.sqrt(H), jnp.float32)}


def apply_tower(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ p["w1"])
    h = jax.nn.gelu(h @ p["w2"])
    z = h @ p["w3"]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def encode(p: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    return apply_tower(p["img"], batch[0]), apply_tower(p["txt"], batch[1])


def clip_loss(p: Any, reps: tuple[jax.Array, jax.Array], batch: Any) -> jax.Array:
    z_img, z_txt = reps
    logits = z_img @ z_txt.T * jnp.exp(p["log_t"])
    diag = jnp.diagonal(jax.nn.log_softmax(logits, axis=1))
    diag_t = jnp.diagonal(jax.nn.log_softmax(logits, axis=0))
    return -(jnp.mean(diag) + jnp.mean(diag_t)) / 2


def tiled_clip_loss(p: Any, reps: tuple[jax.Array, jax.Array], batch: Any) -> jax.Array:
    return contrastive.clip_loss(*reps, p["log_t"], tile=TILE)


def full_loss(p: Any, batch: Any) -> jax.Array:
    return clip_loss(p, encode(p, batch), batch)


def ways(k: int) -> dict[str, Any]:
    return {
        "full batch": jax.jit(jax.value_and_grad(full_loss)),
        "jaxaccum.coupled_value_and_grad": jax.jit(
            jaxaccum.coupled_value_and_grad(encode, clip_loss, num_microbatches=k)),
        "plain accumulation": jax.jit(jaxaccum.value_and_grad(full_loss, num_microbatches=k)),
        "coupled, tiled loss": jax.jit(
            jaxaccum.coupled_value_and_grad(encode, tiled_clip_loss, num_microbatches=k)),
    }


def loss_alone(n: int, rounds: int) -> dict[str, Any]:
    """The CLIP loss's value and gradient on (n, E) representations, plain and tiled."""
    rng = np.random.default_rng(1)
    z = [jnp.asarray(rng.normal(size=(n, E)) / np.sqrt(E), jnp.float32) for _ in range(2)]
    p = {"log_t": jnp.asarray(2.0)}
    fns = {name: jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
           for name, fn in (("plain", clip_loss), ("tiled", tiled_clip_loss))}
    temp = {name: fn.lower(p, z, None).compile().memory_analysis().temp_size_in_bytes
            for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        jax.block_until_ready(fn(p, z, None))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(p, z, None))
            times[name].append(time.perf_counter() - start)
    plain = statistics.median(times["plain"])
    return {name: {"ms": statistics.median(t) * 1e3, "ratio_to_plain": statistics.median(t) /
                   plain, "temp_bytes": temp[name]} for name, t in times.items()}


def big(n: int = 65_536, d: int = 32, k: int = 16) -> dict[str, Any]:
    """The tiled coupled step at batch n with d-dimensional representations: temp, one run."""
    rng = np.random.default_rng(2)
    p = {"img": {"w": jnp.asarray(rng.normal(size=(16, d)), jnp.float32)},
         "txt": {"w": jnp.asarray(rng.normal(size=(16, d)), jnp.float32)},
         "log_t": jnp.asarray(2.0)}

    def enc(p: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
        za, zb = batch[0] @ p["img"]["w"], batch[1] @ p["txt"]["w"]
        return (za / jnp.linalg.norm(za, axis=1, keepdims=True),
                zb / jnp.linalg.norm(zb, axis=1, keepdims=True))

    batch = tuple(jnp.asarray(rng.normal(size=(n, 16)), jnp.float32) for _ in range(2))
    fn = jax.jit(jaxaccum.coupled_value_and_grad(enc, tiled_clip_loss, num_microbatches=k))
    compiled = fn.lower(p, batch).compile()
    start = time.perf_counter()
    value, _ = jax.block_until_ready(fn(p, batch))
    return {"batch": n, "dim": d, "k": k, "tile": TILE,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "representation_and_cotangent_bytes": 4 * n * d * 4,
            "plain_logits_bytes": n * n * 4, "first_run_s": time.perf_counter() - start,
            "loss": float(value)}


def run_k(k: int, params: Any, batch: Any, rounds: int) -> dict[str, Any]:
    fns = ways(k)
    temp = {name: fn.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
            for name, fn in fns.items()}
    for fn in fns.values():  # compile and warm up
        jax.block_until_ready(fn(params, batch))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(params, batch))
            times[name].append(time.perf_counter() - start)
    full_ms = statistics.median(times["full batch"]) * 1e3
    return {name: {"ms": statistics.median(t) * 1e3,
                   "ratio_to_full": statistics.median(t) * 1e3 / full_ms,
                   "temp_bytes": temp[name]} for name, t in times.items()}


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [int(k) for k in results["by_k"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in results["by_k"][str(ks[0])]:
        ax1.plot(ks, [results["by_k"][str(k)][name]["ratio_to_full"] for k in ks], "o-",
                 label=name)
        ax2.plot(ks, [results["by_k"][str(k)][name]["temp_bytes"] / 2**20 for k in ks], "o-",
                 label=name)
    ax1.axhline(1.4, color="grey", ls=":", label="target 1.4x")
    ax2.plot(ks, [results["target_temp_bytes"][str(k)] / 2**20 for k in ks], ":",
             color="grey", label="target temp")
    for ax, label in ((ax1, "time / full batch"), (ax2, "temp MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (micro-batches)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"CLIP two-tower, B={B}: {results['machine']['backend']}")
    fig.tight_layout()
    fig.savefig(result_path("coupled", "png"), dpi=110)


def table(results: dict[str, Any]) -> str:
    """The guide's table (docs/guides/coupled.md) from a run's results: time as a ratio to the
    full batch in the same rounds, compiled temp in MiB."""
    names = {"jaxaccum.coupled_value_and_grad": "coupled", "coupled, tiled loss": "tiled",
             "plain accumulation": "plain"}
    head = ["k", "full batch ms"] + [f"{n} (x full)" for n in names.values()] + [
        "full temp MiB"] + [f"{n} temp MiB" for n in names.values()]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for k, row in results["by_k"].items():
        full = row["full batch"]
        cells = [k, f"{full['ms']:.1f}"]
        cells += [f"{row[n]['ms']:.1f} ({row[n]['ratio_to_full']:.2f}x)" for n in names]
        cells += [f"{row[n]['temp_bytes'] / 2**20:.2f}" for n in ("full batch", *names)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-big", action="store_true", help="skip the B = 65,536 run")
    parser.add_argument("--table", action="store_true",
                        help="print the guide's table from the committed results; run nothing")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(result_path("coupled", "json").read_text())), end="")
        return
    rng = np.random.default_rng(0)
    params = {"img": tower(rng), "txt": tower(rng), "log_t": jnp.asarray(2.0)}
    x = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)
    batch = (x, x + 0.3 * jnp.asarray(rng.normal(size=(B, D)), jnp.float32))
    reps_bytes = 2 * B * E * 4
    # what the coupled loss itself needs on the (B, E) representations (its B x B logits and
    # their softmax): no k divides it
    reps = jax.eval_shape(encode, params, batch)
    loss_temp = jax.jit(jax.value_and_grad(clip_loss, argnums=(0, 1))).lower(
        params, reps, batch).compile().memory_analysis().temp_size_in_bytes
    tiled_temp = jax.jit(jax.value_and_grad(tiled_clip_loss, argnums=(0, 1))).lower(
        params, reps, batch).compile().memory_analysis().temp_size_in_bytes
    results: dict[str, Any] = {"machine": machine(), "batch": B, "rounds": args.rounds,
                               "representation_bytes": reps_bytes,
                               "loss_on_representations_temp_bytes": loss_temp,
                               "tiled_loss_on_representations_temp_bytes": tiled_temp,
                               "tile": TILE, "by_k": {}, "target_temp_bytes": {}}
    for k in args.ks:
        row = run_k(k, params, batch, args.rounds)
        full_temp = row["full batch"]["temp_bytes"]
        results["by_k"][str(k)] = row
        results["target_temp_bytes"][str(k)] = reps_bytes + 1.2 * full_temp / k
        print(f"k={k:3d}  " + "  ".join(
            f"{name}: {r['ms']:8.2f} ms ({r['ratio_to_full']:4.2f}x) temp "
            f"{r['temp_bytes'] / 2**20:6.2f} MiB" for name, r in row.items()), flush=True)
    results["loss_alone"] = {str(n): loss_alone(n, args.rounds) for n in (1024, 4096)}
    print("loss alone:", {n: {w: f"{r['ms']:.1f} ms {r['temp_bytes'] / 2**20:.1f} MiB"
                              for w, r in row.items()}
                          for n, row in results["loss_alone"].items()}, flush=True)
    if not args.no_big:
        results["big"] = big()
        print("big:", results["big"], flush=True)
    print(f"wrote {save('coupled', results)}")
    print(table(results), end="")
    plot(results)


if __name__ == "__main__":
    main()
