"""Batch-coupled losses: a two-tower CLIP encoder, B = 1024, k = 1..64, three ways side by side.

- ``full batch``: ``jax.value_and_grad`` of the CLIP loss on the whole batch;
- ``jaxaccum.coupled_value_and_grad``: exact (a forward pass for the representations, the loss
  on all of them, a second pass pulling the cotangents back through each micro-batch);
- ``plain accumulation``: ``jaxaccum.value_and_grad`` of the same loss per micro-batch (B/k - 1
  negatives per example: another objective, shown for its cost only).

The JSON also records the temp bytes of the coupled loss alone on the representations (its
B x B logits and their softmax), which no number of micro-batches divides.

Time per step (median of interleaved rounds, ratio to the full batch in the same rounds) and
the compiled program's temp bytes. Targets: time <= 1.4x the full batch (one extra forward);
temp <= the representations + 1.2 x the full batch's temp / k. Writes results/coupled.json and
coupled.png.

    python benchmarks/coupled.py                 # ~5 min on 2 cores
    python benchmarks/coupled.py --ks 1 8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import machine, result_path, save

import jaxaccum

B, D, H, E = 1024, 256, 512, 128


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


def full_loss(p: Any, batch: Any) -> jax.Array:
    return clip_loss(p, encode(p, batch), batch)


def ways(k: int) -> dict[str, Any]:
    return {
        "full batch": jax.jit(jax.value_and_grad(full_loss)),
        "jaxaccum.coupled_value_and_grad": jax.jit(
            jaxaccum.coupled_value_and_grad(encode, clip_loss, num_microbatches=k)),
        "plain accumulation": jax.jit(jaxaccum.value_and_grad(full_loss, num_microbatches=k)),
    }


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
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
    results: dict[str, Any] = {"machine": machine(), "batch": B, "rounds": args.rounds,
                               "representation_bytes": reps_bytes,
                               "loss_on_representations_temp_bytes": loss_temp, "by_k": {},
                               "target_temp_bytes": {}}
    for k in args.ks:
        row = run_k(k, params, batch, args.rounds)
        full_temp = row["full batch"]["temp_bytes"]
        results["by_k"][str(k)] = row
        results["target_temp_bytes"][str(k)] = reps_bytes + 1.2 * full_temp / k
        print(f"k={k:3d}  " + "  ".join(
            f"{name}: {r['ms']:8.2f} ms ({r['ratio_to_full']:4.2f}x) temp "
            f"{r['temp_bytes'] / 2**20:6.2f} MiB" for name, r in row.items()), flush=True)
    print(f"wrote {save('coupled', results)}")
    plot(results)


if __name__ == "__main__":
    main()
