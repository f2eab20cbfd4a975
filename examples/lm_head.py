"""A small decoder LM with a 32,768-token vocabulary, its head computed chunk by chunk.

The dense head's logits (tokens x vocabulary) dominate the step's memory. With
``jaxaccum.linear_cross_entropy`` they never exist, so ``jaxaccum.plan_microbatches`` finds a
smaller k within the same memory budget. Checks: the planner's k for both heads (the chunked one
needs fewer micro-batches); the chunked step's loss equals the dense loss on the same batch;
training lowers the loss.
Run: ``python examples/lm_head.py [--smoke]``.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--smoke", action="store_true", help="a few steps only")
args = parser.parse_args()
V, D, L, ROWS = 32_768, 64, 64, 64  # vocabulary, width, sequence length, sequences a step
BUDGET = 384 * 2**20  # the memory the step may use
STEPS = 3 if args.smoke else 60
rng = np.random.default_rng(0)


def init():
    def normal(*shape, scale):
        return jnp.asarray(scale * rng.normal(size=shape), jnp.float32)
    return {"embed": normal(V, D, scale=1.0), "pos": normal(L, D, scale=0.1),
            "mix": normal(D, D, scale=D**-0.5), "up": normal(D, 4 * D, scale=D**-0.5),
            "down": normal(4 * D, D, scale=(4 * D)**-0.5), "head": normal(V, D, scale=D**-0.5)}


def hidden(p, tokens):
    """A causal mix of the previous positions, then an MLP: a stand-in decoder block."""
    h = p["embed"][tokens] + p["pos"]
    causal = jnp.tril(jnp.ones((L, L))) / jnp.arange(1, L + 1)[:, None]
    h = h + jnp.tanh(causal @ h @ p["mix"])
    return h + jax.nn.gelu(h @ p["up"]) @ p["down"]


def loss(head):
    def fun(p, tokens):  # next-token prediction; the last position has no target
        h = hidden(p, tokens)
        labels = jnp.concatenate([tokens[:, 1:], jnp.full((tokens.shape[0], 1), -100)], 1)
        if head == "chunked":
            return jaxaccum.linear_cross_entropy(h, p["head"], labels, reduction="weighted")
        per_token = optax.softmax_cross_entropy_with_integer_labels(h @ p["head"].T,
                                                                    jnp.maximum(labels, 0))
        n = jnp.sum(labels >= 0)
        return jnp.sum(jnp.where(labels >= 0, per_token, 0)) / n, n.astype(jnp.float32)
    return fun


def batch():  # sequences that count up by a step of their own, modulo V
    start, stride = rng.integers(V, size=(ROWS, 1)), rng.integers(1, 4, size=(ROWS, 1))
    return jnp.asarray((start + stride * np.arange(L)) % V, jnp.int32)


params, opt = init(), optax.adam(3e-3)
shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
tokens = jax.ShapeDtypeStruct((ROWS, L), jnp.int32)
k = {}
for head in ("dense", "chunked"):
    plan = jaxaccum.plan_microbatches(loss(head), shapes, tokens, memory_budget=BUDGET,
                                      optimizer=opt, weighted=True)
    k[head] = plan.num_microbatches
    print(f"{head} head: k = {k[head]} fits {BUDGET // 2**20} MiB "
          f"({plan.estimates[k[head]].total_bytes / 2**20:.0f} MiB)")
assert k["chunked"] < k["dense"], k

step = jax.jit(jaxaccum.train_step(loss("chunked"), opt, num_microbatches=k["chunked"],
                                   weighted=True))
state = opt.init(params)
first = batch()
dense_loss = float(loss("dense")(params, first)[0])
losses = []
for i in range(STEPS):
    params, state, value, _ = step(params, state, first if i == 0 else batch())
    losses.append(float(value))
assert abs(losses[0] - dense_loss) <= 1e-5 * abs(dense_loss), (losses[0], dense_loss)
assert losses[-1] < losses[0], losses
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {STEPS} steps "
      f"(the dense loss on the first batch: {dense_loss:.3f})")
print(f"OK: with the chunked head k = {k['chunked']} fits where the dense head needs "
      f"k = {k['dense']}; its loss equals the dense loss")
