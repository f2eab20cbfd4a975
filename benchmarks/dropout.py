"""What k-invariant (per-example) dropout masks cost, against one key per call.

Dropout drawn per example from that example's own randomness gives the same masks whatever k
is; one key per (micro-)batch does not. The constructions compared, each a mask of x's shape:

- ``one key``: ``bernoulli(fold_in(key, salt), keep, x.shape)`` from one key passed whole to
  the step: every micro-batch draws the same masks, so XLA hoists the draw out of the loop (it
  is computed once per step, not k times: not a fair baseline, shown for that reason);
- ``one key per micro-batch``: the same from the micro-batch's first key, a key of the default
  PRNG implementation (one draw per call, as a per-call dropout does; not k-invariant): the
  baseline of the ratios;
- ``per-example bernoulli (per_example_keys)``: ``vmap`` over the examples' keys
  (``jaxaccum.per_example_keys``: threefry2x32 keys whatever the default implementation, since
  f943dd7) of ``bernoulli(fold_in(key_i, salt), keep, x.shape[1:])``: what
  ``jaxaccum.experiment`` does;
- ``per-example bits (per_example_keys)``: the same keys, ``jax.random.bits`` compared with
  ``keep * 2**32`` (no float uniform);
- ``per-example bernoulli, default-PRNG keys (before f943dd7)``: as the first, with keys
  ``fold_in(key, i)`` of the default implementation, as ``per_example_keys`` made them before
  f943dd7: under rbg/unsafe_rbg, ``vmap`` draws the whole batch from the first key, so these
  masks are not k-invariant (``invariance`` in the results);
- ``counter hash``: no keys at all: a stateless hash (two murmur3 finalizer rounds) of
  (the step's seed, salt, the example's global index, the position), compared with
  ``keep * 2**32``; the index is split with the batch, so it is k-invariant too.

Models: the dropout MLP (784-512-512-10, ReLU, keep 0.8 after each hidden layer, softmax, MSE;
batch 256) and the transformer LM of ``model_zoo.py`` with residual dropout (keep 0.9 after the
attention and the MLP of each layer; batch 32). Ways: ``jaxaccum.train_step`` with k = 8 (``--ks``),
and the full batch. Each PRNG implementation (threefry2x32, rbg, unsafe_rbg, set with
``jax_default_prng_impl``) runs in its own process. Writes benchmarks/results/dropout.json
(``--out``).

    python benchmarks/dropout.py              # ~6 min on 2 cores
    python benchmarks/dropout.py --rounds 9 --impls threefry2x32 --out dropout_threefry_r9
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
BASELINE = "one key per micro-batch"  # the ratios' denominator
ONE_KEY, BERNOULLI, BITS = (
    "one key",
    "per-example bernoulli (per_example_keys)",
    "per-example bits (per_example_keys)",
)
DEFAULT_KEYS = "per-example bernoulli, default-PRNG keys (before f943dd7)"
COUNTER = "counter hash"
MASKS = (ONE_KEY, BASELINE, BERNOULLI, BITS, DEFAULT_KEYS, COUNTER)


# --- the masks --------------------------------------------------------------------------------


def _threshold(keep: float) -> jax.Array:
    return jnp.uint32(min(round(keep * 2**32), 2**32 - 1))


def _fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a bijective avalanche mix of a uint32."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def counter_hash_bits(seed: jax.Array, index: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 bits of shape ``(len(index),) + shape`` from (seed[0], seed[1], index, position):
    stateless, so the bits of an example depend only on its global index, not on the split."""
    n = math.prod(shape)
    position = jnp.arange(n, dtype=jnp.uint32).reshape(shape)
    index = index.astype(jnp.uint32).reshape((-1,) + (1,) * len(shape))
    h = _fmix32(position ^ seed[0])
    h = _fmix32(h + index * jnp.uint32(0x9E3779B9) ^ seed[1])
    return _fmix32(h + (index ^ seed[0]))


def make_mask(kind: str) -> Callable[..., jax.Array]:
    """``mask(rng, x, keep, salt)``: booleans of x's shape; ``rng`` is what ``kind`` needs."""

    def one_key(key: Any, x: jax.Array, keep: float, salt: int) -> jax.Array:
        return jax.random.bernoulli(jax.random.fold_in(key, salt), keep, x.shape)

    def first_key(keys: Any, x: jax.Array, keep: float, salt: int) -> jax.Array:
        return one_key(keys[0], x, keep, salt)

    def bernoulli(keys: Any, x: jax.Array, keep: float, salt: int) -> jax.Array:
        p = jnp.asarray(keep, jnp.float32)
        draw = lambda k: jax.random.bernoulli(jax.random.fold_in(k, salt), p, x.shape[1:])  # noqa: E731
        return jax.vmap(draw)(keys)

    def bits(keys: Any, x: jax.Array, keep: float, salt: int) -> jax.Array:
        draw = lambda k: jax.random.bits(jax.random.fold_in(k, salt), x.shape[1:], jnp.uint32)  # noqa: E731
        return jax.vmap(draw)(keys) < _threshold(keep)

    def counter(seed_index: Any, x: jax.Array, keep: float, salt: int) -> jax.Array:
        seed, index = seed_index
        salted = seed ^ jnp.uint32((salt * 0x27D4EB2F) & 0xFFFFFFFF)
        return counter_hash_bits(salted, index, x.shape[1:]) < _threshold(keep)

    return {
        ONE_KEY: one_key,
        BASELINE: first_key,
        BERNOULLI: bernoulli,
        BITS: bits,
        DEFAULT_KEYS: bernoulli,
        COUNTER: counter,
    }[kind]


def dropout(x: jax.Array, rng: Any, kind: str, keep: float, salt: int) -> jax.Array:
    return jnp.where(make_mask(kind)(rng, x, keep, salt), x / keep, 0.0).astype(x.dtype)


def randomness(kind: str, batch_size: int, key: Any) -> tuple[Any, Any]:
    """``(per-example part, whole-batch part)``: what goes in the batch and what is passed whole."""
    import jaxaccum

    if kind == ONE_KEY:
        return None, key
    if kind in (BERNOULLI, BITS):
        return jaxaccum.per_example_keys(key, batch_size), None
    if kind in (BASELINE, DEFAULT_KEYS):  # keys of the default implementation
        return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch_size)), None
    seed = jax.random.bits(key, (2,), jnp.uint32)
    return jnp.arange(batch_size, dtype=jnp.uint32), seed


def _rng(kind: str, per_example: Any, whole: Any) -> Any:
    return (whole, per_example) if kind == COUNTER else (whole if kind == ONE_KEY else per_example)


# --- the models ---------------------------------------------------------------------------------


def mlp_params() -> list[tuple[jax.Array, jax.Array]]:
    sizes = (784, 512, 512, 10)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return [
        (0.01 * jax.random.truncated_normal(k, -2, 2, (m, n)), jnp.zeros(n))
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_loss(kind: str) -> Callable[..., Any]:
    def loss(params: Any, batch: Any, whole: Any) -> jax.Array:
        x, y, per_example = batch
        for salt, (w, b) in enumerate(params[:-1]):
            x = dropout(jax.nn.relu(x @ w + b), _rng(kind, per_example, whole), kind, 0.8, salt)
        w, b = params[-1]
        out = jax.nn.softmax(x @ w + b)
        return jnp.mean((out - jax.nn.one_hot(y, 10)) ** 2)

    return loss


def mlp_batch(size: int) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    return jax.random.uniform(kx, (size, 784)), jax.random.randint(ky, (size,), 0, 10)


def lm_loss(kind: str) -> Callable[..., Any]:
    from model_zoo import DIM, HEADS, layer_norm

    def loss(params: Any, batch: Any, whole: Any) -> jax.Array:
        tokens, targets, mask, per_example = batch
        rng = _rng(kind, per_example, whole)
        b, t = tokens.shape
        head_dim = DIM // HEADS
        x = params["embed"][tokens] + params["pos"][:t]
        causal = jnp.tril(jnp.ones((t, t), bool))
        for i, layer in enumerate(params["layers"]):
            h = layer_norm(x, layer["ln1"]) @ layer["qkv"]
            q, k, v = (z.reshape(b, t, HEADS, head_dim) for z in jnp.split(h, 3, axis=-1))
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
            probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
            attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, DIM) @ layer["out"]
            x = x + dropout(attn, rng, kind, 0.9, 2 * i)
            h = jax.nn.gelu(layer_norm(x, layer["ln2"]) @ layer["w1"] + layer["b1"])
            x = x + dropout(h @ layer["w2"] + layer["b2"], rng, kind, 0.9, 2 * i + 1)
        logits = layer_norm(x, params["ln_f"]) @ params["head"]
        ce = (
            jax.nn.logsumexp(logits, -1)
            - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
        )
        count = mask.sum()
        return (ce * mask).sum() / jnp.maximum(count, 1.0), count

    return loss


# --- the measurement ----------------------------------------------------------------------------


def child(impl: str, rounds: int, ks: list[int]) -> dict[str, Any]:
    jax.config.update("jax_default_prng_impl", impl)
    from model_zoo import lm_data, lm_params

    import jaxaccum

    models: dict[str, Any] = {
        "dropout MLP 784-512-512-10, keep 0.8, batch 256": (
            mlp_loss,
            mlp_params(),
            mlp_batch(256),
            False,
            optax.sgd(1e-2),
        ),
        "transformer LM 4x128, residual dropout keep 0.9, batch 32": (
            lm_loss,
            lm_params(jax.random.key(0)),
            tuple(lm_data(32)[n] for n in ("inputs", "targets", "mask")),
            True,
            optax.adam(1e-3),
        ),
    }
    out: dict[str, Any] = {"impl": impl, "models": {}}
    for name, (make_loss, params, data, weighted, opt) in models.items():
        size = data[0].shape[0]
        ways: dict[str, Any] = {}
        for kind in MASKS:
            per_example, whole = randomness(kind, size, jax.random.key(7))
            batch = (*data, per_example)
            loss = make_loss(kind)
            state = opt.init(params)
            for k in ks:
                step = jaxaccum.train_step(
                    loss, opt, num_microbatches=k, weighted=weighted, donate=False
                )
                ways[(kind, f"train_step k={k}")] = (
                    step.lower(params, state, batch, whole).compile(),
                    (params, state, batch, whole),
                )
            value = (lambda f: lambda p, b, w: f(p, b, w)[0])(loss) if weighted else loss

            def full(p: Any, s: Any, b: Any, w: Any, value: Any = value, opt: Any = opt) -> Any:
                updates, s = opt.update(jax.grad(value)(p, b, w), s, p)
                return optax.apply_updates(p, updates), s

            ways[(kind, "full batch")] = (
                jax.jit(full).lower(params, state, batch, whole).compile(),
                (params, state, batch, whole),
            )
        times: dict[Any, list[float]] = {w: [] for w in ways}
        for r in range(rounds + 1):
            for w, (fn, args) in ways.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                if r:
                    times[w].append(time.perf_counter() - start)
        med = {w: statistics.median(t) for w, t in times.items()}
        table: dict[str, Any] = {}
        for (kind, way), t in med.items():
            base = med[(BASELINE, way)]
            table.setdefault(way, {})[kind] = {"ms": t * 1e3, "ratio_to_baseline": t / base}
        out["models"][name] = table
        for way, row in table.items():
            cells = [
                f"{kind}: {v['ms']:.1f} ms ({v['ratio_to_baseline']:.2f}x)"
                for kind, v in row.items()
            ]
            print(
                f"[{impl}] {name[:24]:24s} {way:16s} " + "  ".join(cells),
                file=sys.stderr,
                flush=True,
            )
    out["invariance"] = invariance_check()
    out["hash_statistics"] = hash_statistics()
    return out


def invariance_check() -> dict[str, bool]:
    """Each per-example construction gives the same masks split in 1 or 8 micro-batches."""
    x = jnp.ones((16, 64))
    result = {}
    for kind in MASKS[2:]:
        per_example, whole = randomness(kind, 16, jax.random.key(3))
        full = make_mask(kind)(_rng(kind, per_example, whole), x, 0.8, 0)
        parts = []
        for i in range(8):
            sub = jax.tree.map(lambda a, i=i: a[i::8], per_example)
            parts.append(make_mask(kind)(_rng(kind, sub, whole), x[i::8], 0.8, 0))
        rebuilt = jnp.zeros_like(full)
        for i, part in enumerate(parts):
            rebuilt = rebuilt.at[i::8].set(part)
        result[kind] = bool(jnp.array_equal(full, rebuilt))
    return result


def hash_statistics() -> dict[str, float]:
    """Keep rate and neighbour correlations of the counter hash's masks (keep 0.8)."""
    seed = jax.random.bits(jax.random.key(11), (2,), jnp.uint32)
    m = np.asarray(counter_hash_bits(seed, jnp.arange(4096), (1024,)) < _threshold(0.8), float)
    c = lambda a, b: float(np.corrcoef(a.ravel(), b.ravel())[0, 1])  # noqa: E731
    return {
        "keep_rate": float(m.mean()),
        "corr_adjacent_positions": c(m[:, 1:], m[:, :-1]),
        "corr_adjacent_examples": c(m[1:], m[:-1]),
        "corr_other_salt": c(
            m,
            np.asarray(
                counter_hash_bits(seed ^ jnp.uint32(0x27D4EB2F), jnp.arange(4096), (1024,))
                < _threshold(0.8),
                float,
            ),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ks", nargs="+", type=int, default=[8])
    parser.add_argument("--child", choices=IMPLS)
    parser.add_argument("--out", default="dropout", help="results/OUT.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rounds, args.ks)))
        return
    from _common import machine, result_path, save

    results: dict[str, Any] = {"machine": machine(), "rounds": args.rounds, "by_impl": {}}
    for impl in args.impls:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                impl,
                "--rounds",
                str(args.rounds),
                "--ks",
                *map(str, args.ks),
            ],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        results["by_impl"][impl] = json.loads(proc.stdout)
    path = save(args.out, results)
    print(f"wrote {path}")
    del result_path


if __name__ == "__main__":
    main()
