"""An Equinox model trained in micro-batches: pass the module whole to jaxaccum.value_and_grad.

A differentiated argument that is an Equinox module is filtered as
``eqx.filter_value_and_grad`` filters it: its inexact arrays are differentiated, everything
else (the activation function, ints) passes through and gets None in the gradient. So the
gradient is a module like the model, ready for optax and ``eqx.apply_updates``.

``jaxaccum.train_step`` takes the module whole too and returns the updated module. Its optimizer
state is the optimizer's state for the module's arrays: ``optimizer.init(eqx.filter(model,
eqx.is_array))``, as with Equinox and optax (``optimizer.init(model)`` fails inside optax on the
activation function).

Checks: the accumulated loss and gradient equal ``eqx.filter_value_and_grad`` on the full
batch; ``jaxaccum.train_step`` on the module takes the same step as an ``eqx.filter_jit`` step
written by hand, and then trains the model. Run: ``python examples/equinox_model.py [--smoke]``.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--smoke", action="store_true", help="a few steps only")
args = parser.parse_args()
K, BATCH, STEPS = 8, 256, (5 if args.smoke else 1000)

# Regression of a smooth function of 2 inputs.
rng = np.random.default_rng(0)
x_all = rng.uniform(-2, 2, size=(STEPS * BATCH, 2)).astype(np.float32)
y_all = (np.sin(2 * x_all[:, :1]) * np.cos(x_all[:, 1:])).astype(np.float32)

model = eqx.nn.MLP(2, 1, width_size=64, depth=3, activation=jax.nn.tanh, key=jax.random.key(0))
optimizer = optax.adam(1e-3)
# optax initialises the state for the module's arrays only (init(model) fails on the activation
# function); for a module whose arrays are all floating, the ones train_step differentiates
opt_state = optimizer.init(eqx.filter(model, eqx.is_array))


def loss_fn(model, batch):  # the mean over the examples it is given
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


grad_fn = jaxaccum.value_and_grad(loss_fn, num_microbatches=K)  # was eqx.filter_value_and_grad


@eqx.filter_jit
def step(model, opt_state, batch):
    loss, grads = grad_fn(model, batch)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def rel(a, b):  # max |a - b| over max |b|, over the arrays of two modules
    a, b = (jax.tree.leaves(eqx.filter(t, eqx.is_array)) for t in (a, b))
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True)) / max(
        float(np.max(np.abs(y))) for y in b)


# Check 1: the same loss and gradient as the full batch. float32 sums of 256 examples in
# another order agree to ~1e-7 relative; 1e-5 leaves room. A sum for a mean would be 8x off
# (relative 7), one micro-batch's gradient for the mean 0.8 (both measured).
first = (x_all[:BATCH], y_all[:BATCH])
loss, grads = eqx.filter_jit(grad_fn)(model, first)
ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, first)
errors = rel(loss, ref_loss), rel(grads, ref_grads)
print(f"accumulated ({K} micro-batches) vs eqx.filter_value_and_grad: loss {errors[0]:.1e}, "
      f"grads {errors[1]:.1e} (relative)")
assert max(errors) < 1e-5, errors
assert isinstance(grads, eqx.nn.MLP) and grads.activation is None  # filtered like Equinox

# Check 2: jaxaccum.train_step takes the module whole (filtered as eqx.filter_jit filters it)
# and returns the updated module; it takes the hand-written step. It donates the model and the
# optimizer state, so the hand-written step goes first.
train_step = jaxaccum.train_step(loss_fn, optimizer, num_microbatches=K)
ref_model, _, _ = step(model, opt_state, first)
model, opt_state, _, _ = train_step(model, opt_state, first)
error = rel(model, ref_model)
print(f"jaxaccum.train_step on the module vs the filter_jit step: {error:.1e}")
assert isinstance(model, eqx.nn.MLP) and model.activation is jax.nn.tanh, model
assert error < 1e-6  # the same computation, up to XLA's fusion choices
losses = []

for t in range(1, STEPS):
    model, opt_state, loss, _ = train_step(model, opt_state, (x_all[t * BATCH:(t + 1) * BATCH],
                                                              y_all[t * BATCH:(t + 1) * BATCH]))
    losses.append(float(loss))
    if t % 200 == 0:
        print(f"step {t}: loss {np.mean(losses[-200:]):.5f}")
print(f"eqx.nn.MLP (2 -> 3 x 64 -> 1), {STEPS} Adam steps of {BATCH} in {K} micro-batches: "
      f"loss {float(ref_loss):.4f} -> {np.mean(losses[-4:]):.5f} (mean of the last 4)")
assert np.mean(losses[-4:]) < (1.0 if args.smoke else 0.05) * float(ref_loss)
print("OK: an Equinox module passed whole is accumulated exactly")
