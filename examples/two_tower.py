"""A CLIP-style two-tower model: a contrastive loss with in-batch negatives, accumulated exactly.

Every image is scored against every text of the batch, so the loss couples all examples: the
mean of micro-batch losses would see only the negatives inside each micro-batch. Instead
``jaxaccum.coupled_train_step(encode, loss, optimizer, num_microbatches=k)`` (GradCache)
encodes the micro-batches without gradients, computes the loss and its gradient with respect to
the embeddings on the whole batch, then replays each micro-batch's forward pass and pulls its
slice of that gradient back: exact, for one extra forward pass.

Checks: the gradient equals the full batch's; plain ``jaxaccum.value_and_grad`` on the same loss
differs (printed); ``jaxaccum.check`` flags the plain one.
Run: ``python examples/two_tower.py [--smoke]``.
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
B, K, E, STEPS = 128, 4, 16, (3 if args.smoke else 400)  # batch, micro-batches, embedding

# Paired data: an "image" and a "text" vector, both noisy views of one latent (the pair's content).
rng = np.random.default_rng(0)
mix_img, mix_txt = rng.normal(size=(8, 24)), rng.normal(size=(8, 12))


def pairs(n):
    z = rng.normal(size=(n, 8))
    noisy = [z @ m + 0.5 * rng.normal(size=(n, m.shape[1])) for m in (mix_img, mix_txt)]
    return tuple(a.astype(np.float32) for a in noisy)


def tower(sizes):  # [(w, b), ...] as jax arrays (numpy ones: a 2nd program after step 1)
    return [(jnp.asarray(rng.normal(size=(a, b)) / a**0.5, jnp.float32), jnp.zeros(b))
            for a, b in zip(sizes[:-1], sizes[1:], strict=True)]


def apply_tower(layers, x):
    for w, b in layers[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = layers[-1]
    z = x @ w + b
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def encode(params, batch):  # per example: its two embeddings
    x_img, x_txt = batch
    return apply_tower(params["img"], x_img), apply_tower(params["txt"], x_txt)


def clip_loss(params, reps, batch):  # the whole batch: every image against every text
    z_img, z_txt = reps
    logits = z_img @ z_txt.T * jnp.exp(params["log_t"])
    labels = jnp.arange(logits.shape[0])
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2


def full_loss(params, batch):  # the same loss, written for one pass over the whole batch
    return clip_loss(params, encode(params, batch), batch)


def rel(a, b):  # max |a - b| over max |b|, over whole pytrees
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True)) / max(
        float(np.max(np.abs(y))) for y in b)


params = {"img": tower((24, 64, E)), "txt": tower((12, 64, E)),
          "log_t": jnp.array(np.log(10), jnp.float32)}  # not weak-typed: one compiled step
batch = pairs(B)

full = jax.jit(jax.value_and_grad(full_loss))(params, batch)
coupled_fn = jaxaccum.coupled_value_and_grad(encode, clip_loss, num_microbatches=K)
coupled = jax.jit(coupled_fn)(params, batch)
plain = jax.jit(jaxaccum.value_and_grad(full_loss, num_microbatches=K))(params, batch)
# float32: the coupled gradient sums the towers' pullbacks in another order, ~1e-7 relative.
print(f"coupled vs full batch: loss {rel(coupled[0], full[0]):.1e}, grads "
      f"{rel(coupled[1], full[1]):.1e} (relative)")
print(f"plain value_and_grad (negatives only within each micro-batch of {B // K}) vs full "
      f"batch: loss {float(plain[0]):.4f} vs {float(full[0]):.4f}, grads "
      f"{rel(plain[1], full[1]):.1e} (relative)")
assert rel(coupled[0], full[0]) < 1e-5 and rel(coupled[1], full[1]) < 1e-5
assert rel(plain[1], full[1]) > 1e-2  # measured 1e-1: a different loss, not rounding

# jaxaccum.check, a startup self-check, compares a step with the float64 full batch: on the
# plain step it names the problem and the fix (on coupled_fn it reports ok).
report = jaxaccum.check(full_loss, params, batch, num_microbatches=K)  # plain value_and_grad
print(f"jaxaccum.check on the plain step: ok={report.ok}: {report.problems[0][:150]}...")
assert not report.ok

# Training: one jitted, donating step per batch of 128 pairs, 4 micro-batches of 32.
optimizer = optax.adam(3e-3)
step = jaxaccum.coupled_train_step(encode, clip_loss, optimizer, num_microbatches=K)
opt_state, losses = optimizer.init(params), []
for t in range(STEPS):
    params, opt_state, loss, _ = step(params, opt_state, pairs(B))
    losses.append(float(loss))
    if t % 100 == 0:
        print(f"step {t}: loss {loss:.4f}")
test = pairs(B)
z_img, z_txt = jax.jit(encode)(params, test)
recall = float(jnp.mean(jnp.argmax(z_img @ z_txt.T, axis=1) == jnp.arange(B)))
print(f"two towers, {STEPS} Adam steps of {B} pairs in {K} micro-batches: loss "
      f"{losses[0]:.3f} -> {losses[-1]:.3f}; image->text top-1 among {B}: {recall:.2f} "
      f"(chance {1 / B:.3f})")
if not args.smoke:
    assert losses[-1] < 0.5 * losses[0] and recall > 0.3
print("OK: the coupled gradient is the full batch's; the plain one is not")
