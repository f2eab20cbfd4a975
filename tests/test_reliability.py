"""Checkpoint and resume in the middle of an accumulation window; determinism across processes.

Each scenario runs in fresh Python processes, as a preempted job would.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

SCRIPT = """
import sys, jax, jax.numpy as jnp, numpy as np, optax, jaxaccum
mode, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
K, WINDOWS, STOP = 4, 5, 9   # 20 micro-batch calls; the first process stops after 9 (mid-window)

def loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

def data(i):
    key = jax.random.fold_in(jax.random.key(0), i)
    return jax.random.normal(key, (8, 6)), jax.random.normal(jax.random.fold_in(key, 1), (8, 3))

params = {"w1": jax.random.normal(jax.random.key(1), (6, 16)) / 3,
          "w2": jax.random.normal(jax.random.key(2), (16, 3)) / 4}
opt = jaxaccum.multi_steps(optax.adamw(optax.cosine_decay_schedule(1e-2, 5)), K)

@jax.jit
def call(params, state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

if mode == "train_step":  # the recommended path, for the determinism test
    step = jaxaccum.train_step(loss, optax.adam(1e-2), num_microbatches=K)
    state = optax.adam(1e-2).init(params)
    for i in range(WINDOWS):
        batch = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[data(K * i + j) for j in range(K)])
        params, state, _, _ = step(params, state, batch)
    np.savez(out, **{k: np.asarray(v) for k, v in params.items()})
    sys.exit(0)
state = opt.init(params)
start, stop = 0, K * WINDOWS
if mode == "first":
    stop = STOP
elif mode == "resume":
    import orbax.checkpoint as ocp
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
    restored = ocp.StandardCheckpointer().restore(path, target)
    params, state, start = restored["params"], restored["state"], STOP
    assert type(state) is type(opt.init(params)) and int(state.mini_step) == STOP % K
for i in range(start, stop):
    params, state = call(params, state, data(i))
if mode == "first":
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, {"params": params, "state": state})
np.savez(out, **{k: np.asarray(v) for k, v in params.items()},
         gradient_step=np.asarray(state.gradient_step))
"""


def run(*args):
    subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], check=True, timeout=300, capture_output=True
    )


def test_resume_mid_window_is_bitwise_equal(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run("first", ckpt, str(tmp_path / "first.npz"))
    run("resume", ckpt, str(tmp_path / "resumed.npz"))
    run("straight", ckpt, str(tmp_path / "straight.npz"))
    resumed, straight = np.load(tmp_path / "resumed.npz"), np.load(tmp_path / "straight.npz")
    first = np.load(tmp_path / "first.npz")
    assert int(first["gradient_step"]) == 2  # stopped inside the third window
    assert int(resumed["gradient_step"]) == int(straight["gradient_step"]) == 5
    for name in ("w1", "w2"):
        np.testing.assert_array_equal(resumed[name], straight[name])
    assert not np.array_equal(first["w1"], straight["w1"])


def test_two_processes_are_bitwise_equal(tmp_path):
    for mode in ("straight", "train_step"):
        for name in ("a", "b"):
            run(mode, "", str(tmp_path / f"{mode}-{name}.npz"))
        a, b = np.load(tmp_path / f"{mode}-a.npz"), np.load(tmp_path / f"{mode}-b.npz")
        for name in ("w1", "w2"):
            np.testing.assert_array_equal(a[name], b[name])
