"""Compiled temp bytes of representative programs: the gist MLP's train_step (plain and
weighted, B = 64 and 1024, k = 1..64), a runtime-count step and a coupled CLIP loss.

Temp is deterministic for a given JAX, so two checkouts compare exactly: ``PYTHONPATH=<tree>
python benchmarks/temp_programs.py NAME`` writes ``benchmarks/results/temp_programs-NAME.json``.
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

rng = np.random.default_rng(0)
out = {}
def mlp_loss(p, b):
    x, y = b
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)
def wloss(p, b):
    x, y, m = b
    per = jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2, -1)
    return jnp.sum(per * m) / jnp.sum(m), jnp.sum(m)
p = {"w1": jnp.asarray(rng.normal(size=(784, 100)) / 30, jnp.float32),
     "w2": jnp.asarray(rng.normal(size=(100, 10)) / 10, jnp.float32)}
opt = optax.adam(1e-3)
for B in (64, 1024):
    x, y, m = jnp.ones((B, 784)), jnp.ones((B, 10)), jnp.ones(B)
    for k in (1, 4, 16, 64):
        if B % k:
            continue
        step = jaxaccum.train_step(mlp_loss, opt, num_microbatches=k, donate=True)
        c = step.lower(p, opt.init(p), (x, y)).compile()
        out[f"gist B={B} k={k}"] = c.memory_analysis().temp_size_in_bytes
        step = jaxaccum.train_step(wloss, opt, num_microbatches=k, weighted=True)
        c = step.lower(p, opt.init(p), (x, y, m)).compile()
        out[f"gist weighted B={B} k={k}"] = c.memory_analysis().temp_size_in_bytes
K, mm = 16, 64
stack = (jnp.ones((K, mm, 784)), jnp.ones((K, mm, 10)))
step = jaxaccum.train_step(mlp_loss, opt, max_microbatches=K)
c = step.lower(p, opt.init(p), jaxaccum.Microbatches(stack, jnp.int32(K))).compile()
out[f"runtime count K={K} m={mm}"] = c.memory_analysis().temp_size_in_bytes
def enc(w, x): return jnp.tanh(x @ w)
def clip(w, z, x): return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(z @ z.T)))
w = jnp.asarray(rng.normal(size=(64, 32)) / 8, jnp.float32)
xs = jnp.ones((512, 64))
for k in (1, 8):
    fn = jax.jit(jaxaccum.coupled_value_and_grad(enc, clip, num_microbatches=k))
    compiled = fn.lower(w, xs).compile()
    out[f"coupled CLIP B=512 k={k}"] = compiled.memory_analysis().temp_size_in_bytes
name = sys.argv[1] if len(sys.argv) > 1 else "current"
with open(f"benchmarks/results/temp_programs-{name}.json", "w") as f:
    json.dump(out, f, indent=1)
print(json.dumps(out))
