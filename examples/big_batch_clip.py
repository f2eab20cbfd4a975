"""CLIP with in-batch negatives at a batch of 65,536 on one CPU: the loss tile by tile.

Every image is scored against every text of the batch. Written plainly, the loss on the
representations holds the 65,536 x 65,536 logits (16 GiB in float32) and their cotangent: it
does not fit in this machine's memory. ``jaxaccum.contrastive.clip_loss`` computes the same
loss and gradient tile by tile (no B x B array), and ``jaxaccum.coupled_train_step`` runs the
towers micro-batch by micro-batch: the step's memory is the representations and one
micro-batch's activations.

Checks: on a batch small enough for the plain loss, the tiled step equals it (3 Adam steps);
then training at B = 65,536 (``--smoke``: 8,192), whose compiled temp stays below the size of
the plain loss's logits, and whose loss goes down.
Run: ``python examples/big_batch_clip.py [--smoke]``.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum
from jaxaccum.contrastive import clip_loss

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--smoke", action="store_true", help="B = 8,192 and 2 steps")
args = parser.parse_args()
B, K, E = (8_192, 8, 32) if args.smoke else (65_536, 16, 32)  # batch, micro-batches, width
STEPS = 2 if args.smoke else 5
rng = np.random.default_rng(0)
mix_img, mix_txt = rng.normal(size=(8, 24)), rng.normal(size=(8, 12))


def pairs(n):  # an "image" and a "text" vector, noisy views of one latent
    z = rng.normal(size=(n, 8))
    return tuple((z @ m + 0.5 * rng.normal(size=(n, m.shape[1]))).astype(np.float32)
                 for m in (mix_img, mix_txt))


def tower(a, b):
    return {"w1": jnp.asarray(rng.normal(size=(a, 64)) / a**0.5, jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(64, b)) / 8, jnp.float32)}


def apply_tower(p, x):
    z = jax.nn.gelu(x @ p["w1"]) @ p["w2"]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def encode(params, batch):  # per example: its two embeddings
    return apply_tower(params["img"], batch[0]), apply_tower(params["txt"], batch[1])


def tiled(params, reps, batch):  # the whole batch's representations, tile by tile
    return clip_loss(*reps, params["logit_scale"], tile=512)


def plain(params, reps, batch):  # the same loss, with the B x B logits
    logits = reps[0] @ reps[1].T * jnp.exp(params["logit_scale"])
    labels = jnp.arange(logits.shape[0])
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2


params = {"img": tower(24, E), "txt": tower(12, E), "logit_scale": jnp.float32(np.log(10))}
optimizer = optax.adam(1e-3)

# 1. Where the plain loss fits, the tiled step is the same step.
small = pairs(1024)
steps = [jaxaccum.coupled_train_step(encode, loss, optimizer, num_microbatches=4, donate=False)
         for loss in (tiled, plain)]
states = [(params, optimizer.init(params))] * 2
for _ in range(3):
    states = [step(p, o, small)[:2] for step, (p, o) in zip(steps, states, strict=True)]
err = max(float(jnp.max(jnp.abs(a - b)))
          for a, b in zip(jax.tree.leaves(states[0][0]), jax.tree.leaves(states[1][0]),
                          strict=True))
print(f"B = 1024, 3 Adam steps: tiled vs plain loss, max parameter difference {err:.1e}")
assert err < 1e-5, err  # float32 rounding of sums in another order; Adam steps are 1e-3

# 2. Far past it.
step = jaxaccum.coupled_train_step(encode, tiled, optimizer, num_microbatches=K)
batch = pairs(B)
opt_state = optimizer.init(params)
temp = step.lower(params, opt_state, batch).compile().memory_analysis().temp_size_in_bytes
logits_bytes = B * B * 4
print(f"B = {B:,}: compiled temp {temp / 2**20:.1f} MiB; the plain loss's logits alone would "
      f"be {logits_bytes / 2**30:.2f} GiB")
assert temp < logits_bytes / 4, (temp, logits_bytes)
losses = []
for _ in range(STEPS):
    params, opt_state, loss, _ = step(params, opt_state, batch)
    losses.append(float(loss))
print(f"CLIP towers (24 and 12 -> 64 -> {E}), B = {B:,} in {K} micro-batches: {STEPS} Adam "
      f"steps, loss {losses[0]:.4f} -> {losses[-1]:.4f} (chance: log B = {np.log(B):.2f})")
assert losses[-1] < losses[0], losses
print(f"OK: the tiled loss equals the plain one, and trains at B = {B:,} in "
      f"{temp / 2**20:.0f} MiB of temp")
