"""An optax.MultiSteps training loop switched to jaxaccum.multi_steps by changing one line.

A loop that feeds one micro-batch per call and lets the optimizer step every k calls:

    optimizer = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4)      # before
    optimizer = jaxaccum.multi_steps(optax.adam(1e-2), every_k_schedule=4)  # after

Same state fields, same keywords, same ``has_updated``. What changes: Adam runs only on the
calls that step (optax runs it on every call), micro-batches can carry weights, and
``update(..., emit=True)`` ends a window early: here, an epoch's last, partial window.

Checks: after 2 windows the parameters equal optax.MultiSteps'; an epoch of 10 micro-batches with
k = 4 makes 3 steps (4 + 4 + 2), the last on the mean of its 2 gradients.
Run: ``python examples/multi_steps_dropin.py [--smoke]``.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--smoke", action="store_true", help="one epoch only")
args = parser.parse_args()
EVERY_K, MICRO, EPOCHS = 4, 16, (1 if args.smoke else 200)

rng = np.random.default_rng(0)
x = rng.normal(size=(10 * MICRO, 8)).astype(np.float32)  # an epoch: 10 micro-batches of 16
y = np.tanh(x @ rng.normal(size=(8, 2))).astype(np.float32)
micro_batches = [(x[i:i + MICRO], y[i:i + MICRO]) for i in range(0, len(x), MICRO)]
init_params = {"w": jnp.asarray(0.1 * rng.normal(size=(8, 2)), jnp.float32), "b": jnp.zeros(2)}


def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)


def train(optimizer, batches):
    """The existing loop: one micro-batch per call; the optimizer decides when to step."""

    @jax.jit
    def train_step(params, opt_state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = init_params, optimizer.init(init_params)
    for batch in batches:
        params, opt_state = train_step(params, opt_state, batch)
    return params, opt_state


def rel(a, b):  # max |a - b| over max |b|, over whole pytrees
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True)) / max(
        float(np.max(np.abs(y))) for y in b)


# Check 1: 2 windows of 4 micro-batches, optax.MultiSteps against jaxaccum.multi_steps.
two_windows = micro_batches[:2 * EVERY_K]
theirs, their_state = train(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=EVERY_K),
                            two_windows)
ours, our_state = train(jaxaccum.multi_steps(optax.adam(1e-2), every_k_schedule=EVERY_K),
                        two_windows)
no_accumulation, _ = train(optax.adam(1e-2), two_windows)  # 8 steps: what the check tells apart
print(f"after 2 windows: jaxaccum vs optax.MultiSteps {rel(ours, theirs):.1e}; plain Adam on "
      f"every micro-batch vs optax.MultiSteps {rel(no_accumulation, theirs):.1e} (relative)")
# optax keeps a running mean, we a sum divided once: the mean gradients differ by float32
# rounding (~1e-7 relative), and so do 2 Adam steps on them. 1e-5 leaves room.
assert rel(ours, theirs) < 1e-5 and int(our_state.gradient_step) == 2
assert rel(no_accumulation, theirs) > 1e-2

# Check 2: an epoch of 10 micro-batches with k = 4. The last window holds 2 when the epoch ends;
# emit=True (a traced flag: one compiled step) makes the step on the mean of those 2 now.
optimizer = jaxaccum.multi_steps(optax.adam(1e-2), every_k=EVERY_K)


@jax.jit
def train_step(params, opt_state, batch, last):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params, emit=last)
    return optax.apply_updates(params, updates), opt_state


params, opt_state = init_params, optimizer.init(init_params)
for epoch in range(EPOCHS):
    for i, batch in enumerate(micro_batches):
        params, opt_state = train_step(params, opt_state, batch, jnp.asarray(i == 9))
    if epoch == 0:
        # The reference: Adam on the mean gradient of each window, windows of 4, 4 and 2.
        adam = optax.adam(1e-2)
        ref, ref_state = init_params, adam.init(init_params)
        for window in (micro_batches[0:4], micro_batches[4:8], micro_batches[8:10]):
            grads = [jax.grad(loss_fn)(ref, b) for b in window]
            updates, ref_state = adam.update(jax.tree.map(lambda *g: sum(g) / len(g), *grads),
                                             ref_state, ref)
            ref = optax.apply_updates(ref, updates)
        steps, pending = int(opt_state.gradient_step), int(opt_state.mini_step)
        print(f"epoch of 10 micro-batches, k={EVERY_K}, emit on the last: {steps} optimizer "
              f"steps, {pending} micro-batches pending; vs Adam on the 3 window means: "
              f"{rel(params, ref):.1e}")
        assert steps == 3 and pending == 0 and rel(params, ref) < 1e-5  # as in check 1
        _, their_state = train(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=EVERY_K),
                               micro_batches)
        print(f"(optax.MultiSteps, without emit: {int(their_state.gradient_step)} steps, "
              f"{int(their_state.mini_step)} micro-batches left in its accumulator)")
print(f"a tanh layer 8 -> 2, {EPOCHS} epoch(s) of 10 micro-batches of {MICRO}, Adam every "
      f"{EVERY_K}: loss {float(loss_fn(init_params, (x, y))):.4f} -> "
      f"{float(loss_fn(params, (x, y))):.4f}")
if not args.smoke:
    assert loss_fn(params, (x, y)) < 0.2 * loss_fn(init_params, (x, y))
print("OK: jaxaccum.multi_steps is a drop-in for optax.MultiSteps, and emit ends a window")
