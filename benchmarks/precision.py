"""The bfloat16 error of every entry point that computes, against float64, next to plain JAX's.

For docs/guides/precision.md's second table. One small problem (an MLP 8-16-1 on 128 examples,
k = 8 micro-batches of 16; a coupled log-sum-exp loss; a packed-token loss) in bfloat16, with
XLA's excess precision off (bfloat16 rounded at every op, as on GPUs and TPUs). For each
function: the error of its gradient (for a step, the gradient its optimizer received; for the
noise scale, its trace and |G|^2 estimates) as ``max |x - x64| / max |x64|`` over the tree,
and the same error of plain JAX computing it on the whole batch at once in bfloat16
(``jax.value_and_grad``; for the noise scale, the estimator's formula in bfloat16 on plain JAX's
micro-batch gradients). Seeds are fixed; the result is deterministic on one platform.

    python benchmarks/precision.py    # ~1.5 min on 2 cores; writes results/precision.json
"""

from __future__ import annotations

import os

# bfloat16 rounded as on GPUs/TPUs: set before JAX starts (tests/conftest.py does the same)
_FLAG = "--xla_allow_excess_precision=false"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402

import jaxaccum  # noqa: E402
import jaxaccum.linen  # noqa: E402
import jaxaccum.nnx  # noqa: E402
import jaxaccum.packing  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "results" / "precision.json"
B, D, H, K = 128, 8, 16, 8
BF = jnp.bfloat16


def rel(got: Any, want: Any) -> float:
    """``max |got - want| / max |want|`` over the leaves, in float64."""
    g = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(got)])
    w = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(want)])
    return float(np.max(np.abs(g - w)) / np.max(np.abs(w)))


def mlp_loss(p: Any, batch: Any) -> jax.Array:
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["W1"]) @ p["w2"] - y) ** 2)


def f64(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tree)


# an optimizer that keeps the gradient it receives as its state: a step's gradient, exactly
capture = optax.GradientTransformation(
    lambda p: jax.tree.map(jnp.zeros_like, p),
    lambda u, s, p=None: (jax.tree.map(jnp.zeros_like, u), u))


class MLP(nnx.Module):
    def __init__(self, p: Any) -> None:
        self.W1 = nnx.Param(p["W1"])
        self.w2 = nnx.Param(p["w2"])


def nnx_loss(model: MLP, batch: Any) -> jax.Array:
    return mlp_loss({"W1": model.W1[...], "w2": model.w2[...]}, batch)


def table(data: dict[str, Any]) -> str:
    """docs/guides/precision.md's measured table, from the JSON this script writes."""
    lines = ["| function | bf16 error | plain JAX full batch bf16 error | ratio |",
             "| --- | --- | --- | --- |"]
    lines += [f"| `{r['function']}` | {r['error']:.2e} | {r['plain_full_batch_error']:.2e} "
              f"| {r['ratio']:.2f} |" for r in data["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    start = time.time()
    rng = np.random.default_rng(20261203)
    p32 = {"W1": rng.normal(size=(D, H)) / np.sqrt(D), "w2": rng.normal(size=(H,)) / 4}
    x32, y32 = rng.normal(size=(B, D)), rng.normal(size=(B,))
    p = jax.tree.map(lambda a: jnp.asarray(a, BF), p32)
    batch = (jnp.asarray(x32, BF), jnp.asarray(y32, BF))
    with jax.enable_x64():
        p64, batch64 = f64(p), f64(batch)  # the bf16 inputs, exactly, in float64
        g64 = jax.grad(mlp_loss)(p64, batch64)
        micro64 = [jax.grad(mlp_loss)(p64, tuple(a[i::K] for a in batch64)) for i in range(K)]
    plain = rel(jax.jit(jax.grad(mlp_loss))(p, batch), g64)
    rows: list[dict[str, Any]] = []

    def row(name: str, error: float, plain_error: float) -> None:
        rows.append({"function": name, "error": error, "plain_full_batch_error": plain_error,
                     "ratio": error / plain_error})

    _, g, info = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_microbatches=K,
                                                 return_info=True, noise_scale=True))(p, batch)
    row("value_and_grad", rel(g, g64), plain)
    _, state, _, _ = jaxaccum.train_step(mlp_loss, capture, num_microbatches=K)(
        jax.tree.map(jnp.copy, p), capture.init(p), batch)
    row("train_step", rel(state, g64), plain)

    # the noise scale: trace and |G|^2 against the float64 estimator on float64 gradients
    def estimator(micro: list[Any], full: Any, dtype: Any) -> tuple[Any, Any]:
        sq = sum(jnp.asarray(B // K, dtype) * optax.tree.norm(m, squared=True).astype(dtype)
                 for m in micro)
        g2 = optax.tree.norm(full, squared=True).astype(dtype)
        trace = (sq - B * g2) / (K - 1)
        return trace, g2 - trace / B

    with jax.enable_x64():
        want = estimator(micro64, g64, jnp.float64)
    micro16 = [jax.jit(jax.grad(mlp_loss))(p, tuple(a[i::K] for a in batch)) for i in range(K)]
    full16 = jax.jit(jax.grad(mlp_loss))(p, batch)
    plain_noise = rel(estimator(micro16, full16, BF), want)
    noise = info.noise_scale
    row("NoiseScale (noise_scale=True)", rel((noise.trace, noise.gradient_sq), want),
        plain_noise)

    # statistics_first: the loss centred on the batch's mean target, a statistic of the batch
    def stats(p: Any, batch: Any) -> Any:
        return {"s": jnp.sum(batch[1]), "n": jnp.asarray(batch[1].shape[0], jnp.float32)}

    def centred(p: Any, batch: Any, totals: Any) -> jax.Array:
        x, y = batch
        mean = (totals["s"] / totals["n"]).astype(y.dtype)
        return mlp_loss(p, (x, y - mean))

    def centred_full(p: Any, batch: Any) -> jax.Array:
        return centred(p, batch, {"s": jnp.sum(batch[1].astype(jnp.float32)),
                                  "n": jnp.asarray(B, jnp.float32)})

    with jax.enable_x64():
        c64 = jax.grad(centred_full)(p64, batch64)
    c_plain = rel(jax.jit(jax.grad(centred_full))(p, batch), c64)
    _, g = jax.jit(jaxaccum.statistics_first(stats, centred, num_microbatches=K))(p, batch)
    row("statistics_first", rel(g, c64), c_plain)
    _, state, _, _ = jaxaccum.statistics_first_train_step(stats, centred, capture,
                                                          num_microbatches=K)(
        jax.tree.map(jnp.copy, p), capture.init(p), batch)
    row("statistics_first_train_step", rel(state, c64), c_plain)

    # coupled: a log-sum-exp over the whole batch's scores
    def encode(p: Any, batch: Any) -> jax.Array:
        return jnp.tanh(batch[0] @ p["W1"]) @ p["w2"]

    def coupled(p: Any, z: Any, batch: Any) -> jax.Array:
        return jax.nn.logsumexp(z) - jnp.mean(z * batch[1])

    def coupled_full(p: Any, batch: Any) -> jax.Array:
        return coupled(p, encode(p, batch), batch)

    with jax.enable_x64():
        k64 = jax.grad(coupled_full)(p64, batch64)
    k_plain = rel(jax.jit(jax.grad(coupled_full))(p, batch), k64)
    _, g = jax.jit(jaxaccum.coupled_value_and_grad(encode, coupled, num_microbatches=K))(p, batch)
    row("coupled_value_and_grad", rel(g, k64), k_plain)
    _, state, _, _ = jaxaccum.coupled_train_step(encode, coupled, capture, num_microbatches=K)(
        jax.tree.map(jnp.copy, p), capture.init(p), batch)
    row("coupled_train_step", rel(state, k64), k_plain)

    # Flax front ends
    model = MLP(p)
    _, g = nnx.jit(jaxaccum.nnx.value_and_grad(nnx_loss, num_microbatches=K))(model, batch)
    row("jaxaccum.nnx.value_and_grad", rel({"W1": g["W1"][...], "w2": g["w2"][...]}, g64), plain)
    model = MLP(p)
    optimizer = nnx.Optimizer(model, capture, wrt=nnx.Param)
    jaxaccum.nnx.train_step(nnx_loss, num_microbatches=K)(model, optimizer, batch)
    got = nnx.state(optimizer, nnx.optimizer.OptState)
    got = {n: jax.tree.leaves(got)[i] for i, n in enumerate(sorted(p))}
    row("jaxaccum.nnx.train_step", rel(got, g64), plain)
    state = train_state.TrainState.create(apply_fn=None, params=p, tx=capture)
    state, _, _ = jaxaccum.linen.train_step(mlp_loss, num_microbatches=K)(state, batch)
    row("jaxaccum.linen.train_step", rel(state.opt_state, g64), plain)

    # multi_steps: K calls, one micro-batch each
    opt = jaxaccum.multi_steps(capture, every_k=K)
    ms = opt.init(p)
    update = jax.jit(opt.update)
    for m in micro16:
        _, ms = update(m, ms, p)
    row("multi_steps", rel(ms.inner_opt_state, g64), plain)

    # token_mean / sequence_mean: packed rows of uneven real lengths, some padding-only
    seg = np.zeros((B // 4, 64), np.int32)
    for r in range(seg.shape[0]):
        if r % K == 3:
            continue  # a padding-only row
        cut = rng.integers(8, 40)
        seg[r, :cut], seg[r, cut:rng.integers(cut + 1, 65)] = 1, 2
    tokens = jnp.asarray(rng.normal(size=seg.shape), BF)
    wt = {"a": jnp.asarray(0.75, BF), "b": jnp.asarray(-0.5, BF)}
    for name in ("token_mean", "sequence_mean"):
        mean_fn = getattr(jaxaccum.packing, name)

        def loss(w: Any, batch: Any, mean_fn: Any = mean_fn) -> Any:
            t, s = batch
            return mean_fn(jnp.tanh(t * w["a"] + w["b"]) ** 2, s)

        def full(w: Any, batch: Any, loss: Any = loss) -> Any:
            return loss(w, batch)[0]

        data = (tokens, jnp.asarray(seg))
        with jax.enable_x64():
            want = jax.grad(full)(f64(wt), (f64(tokens), jnp.asarray(seg)))
        plain_p = rel(jax.jit(jax.grad(full))(wt, data), want)
        _, g = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=K, weighted=True))(wt, data)
        row(f"jaxaccum.packing.{name}", rel(g, want), plain_p)

    # linear_cross_entropy: a bfloat16 head of V = 1,000 on B tokens, 30 % ignored
    vocab, width = 1000, 16
    hidden = jnp.asarray(rng.normal(size=(B, width)), BF)
    head = jnp.asarray(rng.normal(size=(vocab, width)) * 0.3, BF)
    labels = rng.integers(0, vocab, B)
    labels[rng.random(B) < 0.3] = -100
    ce_batch = (hidden, jnp.asarray(labels, jnp.int32))

    def ce(w: Any, batch: Any) -> Any:
        return jaxaccum.linear_cross_entropy(batch[0], w, batch[1], reduction="weighted",
                                             vocab_chunk=64)

    def ce_dense(w: Any, batch: Any) -> Any:
        h, y = batch
        per = optax.softmax_cross_entropy_with_integer_labels(h @ w.T, jnp.maximum(y, 0))
        return jnp.sum(jnp.where(y >= 0, per, 0)) / jnp.sum(y >= 0)

    with jax.enable_x64():
        want = jax.grad(ce_dense)(f64(head), (f64(hidden), ce_batch[1]))
    plain_ce = rel(jax.jit(jax.grad(ce_dense))(head, ce_batch), want)
    _, g = jax.jit(jaxaccum.value_and_grad(ce, num_microbatches=K, weighted=True))(head, ce_batch)
    row("linear_cross_entropy", rel(g, want), plain_ce)

    data = {
        "what": "bfloat16 gradient error, max|x - x64| / max|x64|, excess precision off",
        "problem": f"MLP {D}-{H}-1, B={B}, k={K} (coupled: log-sum-exp; packing: {seg.shape})",
        "jax": jax.__version__, "platform": jax.default_backend(),
        "seconds": round(time.time() - start, 1), "rows": rows}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data), end="")  # paste between docs/guides/precision.md's precision markers


if __name__ == "__main__":
    main()
