"""Variable work per step: packed sequences with a traced number of micro-batches, against
padded fixed batches; the cost of the traced count and of the noise scale.

A synthetic corpus of token sequences with Zipf-distributed lengths (mean about half of T) is
run through a small causal transformer LM (token-mean cross-entropy, ``weighted=True``):

- ``padded``: one sequence per row, padded to T; fixed steps of K micro-batches of ``rows``
  rows (``num_microbatches=K``): the program most training loops run.
- ``packed``: ``jaxaccum.packing.pack_stream`` fills rows with whole sequences (segment ids
  keep them apart); each step holds up to K micro-batches, the real count a runtime value
  (``max_microbatches=K``, ``jaxaccum.Microbatches``): one compiled program for every count.

Measured, in one run: real tokens per second over the same corpus (target >= 1.8x for
packed), the compilations over 100 packed steps (target 1), the traced-count step at count K
against the fixed-k program (target <= 1.05x), the traced count against masking (all K micro-
batches run, the padded ones with weight 0) at count K/2, and ``noise_scale=True`` against
without (target <= 3% overhead). Writes results/variable.json and variable.png.

    python benchmarks/variable.py              # ~4 min on 2 cores
    python benchmarks/variable.py --quick      # ~1 min: fewer sequences and rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import machine, result_path, save

import jaxaccum
from jaxaccum import packing

T, ROWS, K = 128, 8, 8
VOCAB, WIDTH, HEADS, LAYERS = 256, 64, 4, 2


# --- the model: a small causal transformer LM on packed rows -----------------------------------


def init(key: jax.Array) -> dict[str, Any]:
    keys = iter(jax.random.split(key, 4 + 4 * LAYERS))
    dense = lambda a, b: jax.random.normal(next(keys), (a, b)) / np.sqrt(a)  # noqa: E731
    return {"embed": jax.random.normal(next(keys), (VOCAB, WIDTH)) * 0.02,
            "pos": jax.random.normal(next(keys), (T, WIDTH)) * 0.02,
            "blocks": [{"qkv": dense(WIDTH, 3 * WIDTH), "out": dense(WIDTH, WIDTH),
                        "up": dense(WIDTH, 4 * WIDTH), "down": dense(4 * WIDTH, WIDTH)}
                       for _ in range(LAYERS)],
            "head": dense(WIDTH, VOCAB)}


def norm(x: jax.Array) -> jax.Array:
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def per_token_loss(p: dict[str, Any], tokens: jax.Array, seg: jax.Array,
                   pos: jax.Array) -> jax.Array:
    """Next-token cross-entropy within each sequence (0 where there is no next token)."""
    x = p["embed"][tokens] + p["pos"][pos]
    mask = packing.attention_mask(seg)[:, None]  # (rows, 1, T, T): causal, same segment
    for b in p["blocks"]:
        q, k, v = jnp.split(norm(x) @ b["qkv"], 3, axis=-1)
        split = lambda t: t.reshape(*t.shape[:2], HEADS, -1).swapaxes(1, 2)  # noqa: E731
        att = jnp.einsum("bhqd,bhkd->bhqk", split(q), split(k)) / np.sqrt(WIDTH // HEADS)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bhkd->bhqd", att, split(v)).swapaxes(1, 2).reshape(x.shape)
        x = x + out @ b["out"]
        x = x + jax.nn.gelu(norm(x) @ b["up"]) @ b["down"]
    logp = jax.nn.log_softmax(norm(x) @ p["head"])
    nll = -jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    has_next = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return jnp.pad(jnp.where(has_next, nll, 0.0), ((0, 0), (0, 1)))


def loss(p: dict[str, Any], batch: Any) -> tuple[jax.Array, jax.Array]:
    """Token mean over the micro-batch's predicted tokens, and their count (``weighted``)."""
    tokens, seg, pos = batch
    return packing.token_mean(per_token_loss(p, tokens, seg, pos),
                              packing.next_token_segments(seg))


# --- the corpus and the two ways of feeding it --------------------------------------------------


def corpus(n: int, seed: int = 0) -> list[np.ndarray]:
    """Zipf lengths on 2..T: P(L) ~ L^-0.2 (mean 59 tokens, 46% of T), random tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.arange(2, T + 1)
    p = lengths ** -0.2
    sizes = rng.choice(lengths, size=n, p=p / p.sum())
    return [rng.integers(1, VOCAB, size=s).astype(np.int32) for s in sizes]


def padded_steps(seqs: list[np.ndarray]) -> list[tuple[np.ndarray, ...]]:
    """One sequence per row, steps of K micro-batches of ROWS rows (the tail dropped)."""
    per_step = K * ROWS
    steps = []
    for start in range(0, len(seqs) - per_step + 1, per_step):
        tokens = np.zeros((per_step, T), np.int32)
        seg = np.zeros((per_step, T), np.int32)
        for r, s in enumerate(seqs[start:start + per_step]):
            tokens[r, :len(s)], seg[r, :len(s)] = s, 1
        pos = np.where(seg > 0, np.arange(T), 0).astype(np.int32)
        steps.append((tokens, seg, pos))
    return steps


def packed_steps(seqs: list[np.ndarray]) -> list[jaxaccum.Microbatches]:
    return [jaxaccum.Microbatches((p.tokens, p.segment_ids, p.positions),
                                  np.int32(p.num_microbatches))
            for p in packing.pack_stream(seqs, rows=ROWS, length=T, max_microbatches=K)]


def real_tokens(batch: Any) -> int:
    seg = batch.data[1][:int(batch.count)] if isinstance(batch, jaxaccum.Microbatches) else batch[1]
    return int(np.count_nonzero(seg))


# --- timing --------------------------------------------------------------------------------------


def run_all(step: Any, params: Any, state: Any, batches: list[Any]) -> float:
    """Seconds to run every batch through the step (after a warm-up compile)."""
    params, state, value, _ = step(params, state, batches[0])
    jax.block_until_ready(value)
    start = time.perf_counter()
    for b in batches:
        params, state, value, _ = step(params, state, b)
    jax.block_until_ready((params, value))
    return time.perf_counter() - start


def per_step(step: Any, params: Any, state: Any, batch: Any, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        params, state, value, _ = step(params, state, batch)
        jax.block_until_ready((params, value))
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, rounds = (2048, 5) if args.quick else (6144, 11)
    seqs = corpus(n)
    params = init(jax.random.key(0))
    opt = optax.adam(1e-3)
    state = opt.init(params)
    make = lambda **o: jaxaccum.train_step(loss, opt, weighted=True, donate=False, **o)  # noqa: E731

    padded, packed = padded_steps(seqs), packed_steps(seqs)
    fixed = make(num_microbatches=K)
    traced = make(max_microbatches=K)
    t_padded = run_all(fixed, params, state, padded)
    t_packed = run_all(traced, params, state, packed)
    tok_padded = sum(real_tokens(b) for b in padded)
    tok_packed = sum(real_tokens(b) for b in packed)
    compiled_packed = traced.num_programs
    counts = [int(b.count) for b in packed]

    # 100 steps of varying counts through one program: each step packs a random number of
    # sequences (a token budget that changes from step to step)
    rng = np.random.default_rng(1)
    hundred = []
    for _ in range(100):
        chunk = [seqs[i] for i in rng.choice(len(seqs), rng.integers(4, 110))]
        p = packing.pack(chunk, rows=ROWS, length=T, max_microbatches=K)
        hundred.append(jaxaccum.Microbatches((p.tokens, p.segment_ids, p.positions),
                                             np.int32(p.num_microbatches)))
    fresh = make(max_microbatches=K)
    run_all(fresh, params, state, hundred)

    # the traced count at count K against the fixed-k program on the same K micro-batches
    full = next(b for b in packed if int(b.count) == K)
    flat = tuple(np.swapaxes(x, 0, 1).reshape(-1, T) for x in full.data)  # strided split = data[i]
    noise = make(max_microbatches=K, noise_scale=True)
    half = jaxaccum.Microbatches(full.data, np.int32(K // 2))
    valid = np.zeros((K, ROWS, T), np.int32)
    valid[: K // 2] = 1
    masked_data = (full.data[0], full.data[1] * valid, full.data[2])  # weight 0 past K/2
    masked_flat = tuple(np.swapaxes(x, 0, 1).reshape(-1, T) for x in masked_data)
    cases = {
        "fixed_k": (fixed, flat), "traced_k": (traced, full), "noise_k": (noise, full),
        "traced_half": (traced, half), "masked_half": (fixed, masked_flat),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for step, batch in cases.values():  # compile
        per_step(step, params, state, batch, 1)
    for _ in range(rounds):  # interleaved rounds
        for name, (step, batch) in cases.items():
            times[name] += per_step(step, params, state, batch, 1)
    med = {name: statistics.median(v) for name, v in times.items()}

    result = {
        "config": {"T": T, "rows": ROWS, "max_microbatches": K, "sequences": n,
                   "mean_length": float(np.mean([len(s) for s in seqs])), "rounds": rounds,
                   "model": f"{LAYERS}-layer transformer, width {WIDTH}, {HEADS} heads, "
                            f"vocab {VOCAB}"},
        "padded": {"steps": len(padded), "seconds": t_padded, "real_tokens": tok_padded,
                   "tokens_per_second": tok_padded / t_padded,
                   "fill": tok_padded / (len(padded) * K * ROWS * T)},
        "packed": {"steps": len(packed), "seconds": t_packed, "real_tokens": tok_packed,
                   "tokens_per_second": tok_packed / t_packed,
                   "fill": tok_packed / (sum(counts) * ROWS * T), "counts": counts,
                   "programs": compiled_packed},
        "throughput_ratio": (tok_packed / t_packed) / (tok_padded / t_padded),
        "programs_over_100_steps": fresh.num_programs,
        "distinct_counts_over_100_steps": len({int(b.count) for b in hundred}),
        "step_ms": {name: 1e3 * v for name, v in med.items()},
        "traced_over_fixed_at_k": med["traced_k"] / med["fixed_k"],
        "noise_scale_overhead": med["noise_k"] / med["traced_k"] - 1.0,
        "masked_over_traced_at_half": med["masked_half"] / med["traced_half"],
        "machine": machine(),
    }
    save("variable", result)
    plot(result)
    print({k: v for k, v in result.items() if k not in ("machine", "packed", "padded")})


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = ["padded, fixed K", "packed, traced count"]
    a.bar(names, [result["padded"]["tokens_per_second"], result["packed"]["tokens_per_second"]],
          color=["tab:gray", "tab:blue"])
    a.set_ylabel("real tokens / s")
    a.set_title(f"throughput ({result['throughput_ratio']:.2f}x)")
    ms = result["step_ms"]
    labels = ["fixed k=K", "traced, count K", "+ noise scale", "traced, K/2", "masked, K/2"]
    keys = ["fixed_k", "traced_k", "noise_k", "traced_half", "masked_half"]
    b.bar(labels, [ms[k] for k in keys], color="tab:blue")
    b.set_ylabel("ms per step")
    b.tick_params(axis="x", rotation=20)
    b.set_title("one step")
    fig.tight_layout()
    fig.savefig(result_path("variable", "png"), dpi=110)


if __name__ == "__main__":
    main()
