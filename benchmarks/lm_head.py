"""The output layer of a language model: dense logits, jax-cce, tokamax and jaxaccum's loss.

- ``alone``: value and gradient (hidden and weight) of the token-mean cross-entropy of
  ``hidden @ weight.T`` at V = 32,768, D = 512, 2,048 tokens, float32: the dense loss
  (``optax.softmax_cross_entropy_with_integer_labels`` on the logits), ``jax-cce`` (an optional
  dependency: ``pip install jax-cce``) and ``jaxaccum.linear_cross_entropy`` at the same
  vocabulary chunks, and ``tokamax.linear_softmax_cross_entropy_loss``'s XLA implementation
  (optional: ``pip install -e ".[bench]"``; it takes the weight as ``(D, V)``, transposed
  inside the timed function). Compiled temp bytes, and time in the same interleaved rounds.
- ``alone_large_vocab``: the same at V = 128,256 (Llama 3's vocabulary), D = 512.
- ``step``: an Adam ``jaxaccum.train_step`` of a small model ending in that head (embedding,
  one MLP block, the head), 8,192 tokens in k = 4 micro-batches, with the dense head and with
  the chunked one: temp and time in the same rounds.
- ``large``: compile only, V = 128,256, D = 4,096, 8,192 tokens in k = 4 micro-batches, float32
  and bfloat16: the step's temp beside its float32 accumulator.

Writes results/lm_head.json; ``table`` prints the guide's table from it.

    python benchmarks/lm_head.py               # ~10 min on 2 cores
    python benchmarks/lm_head.py --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import machine, save

import jaxaccum

V, D, TOKENS = 32_768, 512, 2_048
CHUNKS = (1_024, 2_048, 4_096)
LARGE_V = 128_256


def dense_loss(h: jax.Array, w: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(h @ w.T, y).mean()


def timed(fns: dict[str, Callable[..., Any]], args: tuple[Any, ...],
          rounds: int) -> dict[str, float]:
    """Median seconds of each function, in interleaved rounds after a warm-up."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def tokamax_loss() -> Callable[..., Any] | None:
    """tokamax's op, XLA implementation, on a ``(V, D)`` weight; None without tokamax."""
    try:
        import tokamax
        from absl import flags
    except ImportError:
        return None
    if not flags.FLAGS.is_parsed():  # (tokamax reads its absl flags, else parses sys.argv)
        flags.FLAGS.mark_as_parsed()

    def loss(h: jax.Array, w: jax.Array, y: jax.Array) -> jax.Array:
        return tokamax.linear_softmax_cross_entropy_loss(h, y, w.T, reduction="mean",
                                                         implementation="xla")
    return loss


def alone(rounds: int, vocab: int = V) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.normal(size=(TOKENS, D)), jnp.float32),
            jnp.asarray(rng.normal(size=(vocab, D)) * 0.05, jnp.float32),
            jnp.asarray(rng.integers(0, vocab, TOKENS), jnp.int32))
    losses: dict[str, Callable[..., Any]] = {"dense": dense_loss}
    try:
        import jax_cce
    except ImportError:
        jax_cce = None
    for c in CHUNKS:
        losses[f"jaxaccum {c}"] = functools.partial(jaxaccum.linear_cross_entropy,
                                                    vocab_chunk=c)
        if jax_cce is not None:
            losses[f"jax-cce {c}"] = functools.partial(jax_cce.linear_cross_entropy,
                                                       chunk_size=c)
    tokamax = tokamax_loss()
    if tokamax is not None:
        losses["tokamax (XLA)"] = tokamax
    fns = {name: jax.jit(jax.value_and_grad(f, argnums=(0, 1))) for name, f in losses.items()}
    temp = {name: fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
            for name, fn in fns.items()}
    seconds = timed(fns, args, rounds)
    return {name: {"ms": seconds[name] * 1e3, "ratio_to_dense": seconds[name] / seconds["dense"],
                   "temp_bytes": temp[name]} for name in fns}


def model(head: str) -> Callable[..., Any]:
    """Embedding, one MLP block, then the head: ``(mean over tokens, tokens)``."""
    def loss(p: Any, batch: Any) -> Any:
        tokens, labels = batch
        h = p["embed"][tokens]
        h = h + jax.nn.gelu(h @ p["up"]) @ p["down"]
        if head == "dense":
            value = optax.softmax_cross_entropy_with_integer_labels(h @ p["head"].T, labels)
            return jnp.mean(value), jnp.asarray(labels.size, jnp.float32)
        return jaxaccum.linear_cross_entropy(h, p["head"], labels, reduction="weighted")
    return loss


def params(vocab: int, width: int, dtype: Any, rng: np.random.Generator | None) -> Any:
    shapes = {"embed": (vocab, width), "up": (width, 4 * width), "down": (4 * width, width),
              "head": (vocab, width)}
    if rng is None:
        return {n: jax.ShapeDtypeStruct(s, dtype) for n, s in shapes.items()}
    return {n: jnp.asarray(rng.normal(size=s) * 0.02, dtype) for n, s in shapes.items()}


def step(rounds: int, tokens: int = 8_192, k: int = 4) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    p = params(V, D, jnp.float32, rng)
    batch = (jnp.asarray(rng.integers(0, V, tokens), jnp.int32),
             jnp.asarray(rng.integers(0, V, tokens), jnp.int32))
    opt = optax.adam(1e-3)
    state = opt.init(p)
    fns = {head: jax.jit(jaxaccum.train_step(model(head), opt, num_microbatches=k,
                                             weighted=True))
           for head in ("dense", "jaxaccum")}
    temp = {name: fn.lower(p, state, batch).compile().memory_analysis().temp_size_in_bytes
            for name, fn in fns.items()}
    seconds = timed(fns, (p, state, batch), rounds)
    return {"tokens": tokens, "k": k, "by_head": {
        name: {"ms": seconds[name] * 1e3, "ratio_to_dense": seconds[name] / seconds["dense"],
               "temp_bytes": temp[name]} for name in fns}}


def large(vocab: int = 128_256, width: int = 4_096, tokens: int = 8_192,
          k: int = 4) -> dict[str, Any]:
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        shapes = (jax.ShapeDtypeStruct((vocab, width), dtype),
                  (jax.ShapeDtypeStruct((tokens, width), dtype),
                   jax.ShapeDtypeStruct((tokens,), jnp.int32)))

        def loss(w: Any, batch: Any) -> Any:
            return jaxaccum.linear_cross_entropy(batch[0], w, batch[1], reduction="weighted")

        fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k, weighted=True))
        memory = fn.lower(*shapes).compile().memory_analysis()
        out[jnp.dtype(dtype).name] = {"temp_bytes": memory.temp_size_in_bytes,
                                      "accumulator_bytes": vocab * width * 4}
    return {"vocab": vocab, "width": width, "tokens": tokens, "k": k, "by_dtype": out}


def table(results: dict[str, Any]) -> str:
    """The guide's table: the head alone, then the step, from a run's results."""
    lines: list[str] = []
    for key, vocab in (("alone", results["vocab"]), ("alone_large_vocab", LARGE_V)):
        lines += [*([""] if lines else []),
                  f"| value and gradient, V = {vocab:,}, 2,048 tokens | time (x dense) | "
                  "temp MiB |", "| --- | --- | --- |"]
        for name, row in results[key].items():
            lines.append(f"| {name} | {row['ms']:.0f} ms ({row['ratio_to_dense']:.2f}x) | "
                         f"{row['temp_bytes'] / 2**20:,.1f} |")
    s = results["step"]
    lines += ["", f"| Adam step, {s['tokens']:,} tokens, k = {s['k']} | time (x dense) | "
              "temp MiB |", "| --- | --- | --- |"]
    for name, row in s["by_head"].items():
        lines.append(f"| {name} head | {row['ms']:.0f} ms ({row['ratio_to_dense']:.2f}x) | "
                     f"{row['temp_bytes'] / 2**20:.1f} |")
    g = results["large"]
    lines += ["", f"| V = {g['vocab']:,}, D = {g['width']:,}, {g['tokens']:,} tokens, k = "
              f"{g['k']} (compiled) | temp MiB | float32 accumulator MiB |", "| --- | --- | --- |"]
    for dtype, row in g["by_dtype"].items():
        lines.append(f"| {dtype} weight | {row['temp_bytes'] / 2**20:,.0f} | "
                     f"{row['accumulator_bytes'] / 2**20:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = {"machine": machine(), "vocab": V, "width": D, "tokens": TOKENS,
               "alone": alone(args.rounds),
               "alone_large_vocab": alone(args.rounds, LARGE_V),
               "step": step(args.rounds), "large": large()}
    path = save("lm_head", results)
    print(table(results))
    print(results["large"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
