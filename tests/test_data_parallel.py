"""Data parallel: each device scans its shard, gradients are reduced once per optimizer step.

Run in subprocesses: 8 CPU devices need XLA_FLAGS before JAX starts, and the multi-process
test starts two JAX processes that talk over 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum

COMMON = """
import json, jax, jax.numpy as jnp, numpy as np, optax, jaxaccum
from jaxaccum import _hlo
jax.config.update("jax_default_matmul_precision", "highest")

def params_and_batch(batch_size):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (8, 32)) / 3, "w2": jax.random.normal(k2, (32, 4)) / 6}
    x = jax.random.normal(k3, (batch_size, 8))
    y = jax.random.normal(k4, (batch_size, 4))
    mask = (jnp.arange(batch_size) % 5 < 2).astype(jnp.float32).at[: batch_size // 4].set(0.0)
    return params, (x, y), mask

def loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

def masked(p, batch):
    x, y, m = batch
    per = jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2, axis=-1)
    return jnp.sum(per * m) / jnp.maximum(jnp.sum(m), 1.0), jnp.sum(m)

def rel(a, b):
    d = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return d / max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))
"""

SINGLE_HOST = (
    COMMON
    + """
mesh = jax.make_mesh((8,), ("data",))  # Explicit axes: the default of current JAX
auto = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
params, batch, mask = params_and_batch(256)
ref = jax.value_and_grad(loss)(params, batch)
ref_w = jax.value_and_grad(lambda p, b: masked(p, b)[0])(params, (*batch, mask))
out = {"devices": len(jax.devices())}
for k in (1, 4, 16):
    fn = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k, mesh=mesh, data_axis="data"))
    fw = jax.jit(jaxaccum.value_and_grad(masked, num_microbatches=k, weighted=True, mesh=mesh))
    with jax.set_mesh(mesh):  # explicit sharding mode needs the mesh in context
        out[k] = {
            "rel": rel(fn(params, batch), ref),
            "rel_weighted": rel(fw(params, (*batch, mask)), ref_w),
            "counts": _hlo.collective_counts(fn.lower(params, batch).compile().as_text()),
            "reductions": _hlo.gradient_reductions(
                fn.lower(params, batch).compile().as_text(), 8),
        }
    # the same with an Auto-axis mesh (the older default)
    fa = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k, mesh=auto, data_axis="data"))
    out[k]["rel_auto_mesh"] = rel(fa(params, batch), ref)
    out[k]["auto_counts"] = _hlo.collective_counts(fa.lower(params, batch).compile().as_text())
    # the naive way: a scan over micro-batches of a batch-sharded array under plain jit
    sharded = jax.device_put(batch, jax.NamedSharding(auto, jax.P("data")))
    naive = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=k))
    naive_hlo = naive.lower(params, sharded).compile().as_text()
    out[k]["naive_counts"] = _hlo.collective_counts(naive_hlo)
print(json.dumps(out))
"""
)


def run_python(code, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def single_host():
    return run_python(SINGLE_HOST, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})


def test_eight_devices(single_host):
    assert single_host["devices"] == 8


@pytest.mark.parametrize("k", ["1", "4", "16"])
def test_equals_single_device_full_batch(single_host, k):
    assert single_host[k]["rel"] <= 1e-6
    assert single_host[k]["rel_weighted"] <= 1e-6
    assert single_host[k]["rel_auto_mesh"] <= 1e-6


@pytest.mark.parametrize("k", ["4", "16"])
def test_one_reduction_per_step(single_host, k):
    counts, base = single_host[k]["counts"], single_host["1"]["counts"]
    reductions, base_reductions = single_host[k]["reductions"], single_host["1"]["reductions"]
    # Explicit mesh: gradient-sized reductions once per step (the scalar loss, averaged over
    # the sharded micro-batch by the model itself, is all-reduced per micro-batch: 4 bytes).
    assert reductions["total"] == base_reductions["total"] >= 1
    assert reductions["in loops"] == 0
    # the same gradient bytes; at k = 1 XLA fuses the 4-byte loss into the same all-reduce
    assert abs(reductions["bytes"] - base_reductions["bytes"]) <= 16
    assert counts["all-gather"] == 0 and base["all-gather"] == 0
    auto = single_host[k]["auto_counts"]
    assert auto["all-reduce"] == single_host["1"]["auto_counts"]["all-reduce"]
    assert auto["all-reduce in loops"] == 0 and auto["all-gather"] == 0


def test_naive_sharded_scan_reduces_per_microbatch(single_host):
    """The anchor we beat: plain jit over a scan of a batch-sharded array.

    GSPMD either all-reduces inside the loop (once per micro-batch) or, as on this CPU with
    JAX 0.10, all-gathers the batch so that every device computes every micro-batch.
    """
    naive = single_host["16"]["naive_counts"]
    assert naive["all-reduce in loops"] >= 1 or naive["all-gather"] >= 1


MULTI_PROCESS = (
    COMMON
    + """
import sys
pid, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=60)
mesh = jax.make_mesh((2,), ("data",))
params, batch, _ = params_and_batch(64)
sharding = jax.NamedSharding(mesh, jax.P("data"))
local = jax.tree.map(lambda x: np.asarray(x)[pid * 32 : (pid + 1) * 32], batch)
global_batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)
opt = optax.adam(1e-2)
step = jaxaccum.train_step(loss, opt, num_microbatches=4, mesh=mesh, data_axis="data")
p = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
state = opt.init(p)
for _ in range(3):
    p, state, value, _ = step(p, state, global_batch)
if pid == 0:
    np.savez(out_path, **{k: np.asarray(v) for k, v in p.items()})
jax.distributed.shutdown()
"""
)

SINGLE_PROCESS = (
    COMMON
    + """
import sys
params, batch, _ = params_and_batch(64)
opt = optax.adam(1e-2)
step = jaxaccum.train_step(loss, opt, num_microbatches=8)
state = opt.init(params)
for _ in range(3):
    params, state, value, _ = step(params, state, batch)
np.savez(sys.argv[1], **{k: np.asarray(v) for k, v in params.items()})
print("{}")
"""
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_single_process(tmp_path):
    port = free_port()
    outs = [str(tmp_path / f"p{i}.npz") for i in range(2)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MULTI_PROCESS, str(i), str(port), outs[i]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    single = str(tmp_path / "single.npz")
    subprocess.run(
        [sys.executable, "-c", SINGLE_PROCESS, single],
        check=True,
        timeout=240,
        capture_output=True,
        env=env,
    )
    a, b = np.load(outs[0]), np.load(single)
    for name in b.files:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert float(np.max(np.abs(b["w1"]))) > 0


def test_errors_name_arguments():
    code = COMMON + textwrap.dedent("""
    mesh = jax.make_mesh((8,), ("data",))
    params, batch, _ = params_and_batch(12)
    msgs = []
    for kwargs in ({"mesh": mesh, "data_axis": "model"}, {"data_axis": "data"}, {"mesh": mesh}):
        try:
            jaxaccum.value_and_grad(loss, num_microbatches=1, **kwargs)(params, batch)
        except ValueError as e:
            msgs.append(str(e))
    print(json.dumps(msgs))
    """)
    msgs = run_python(code, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert "data_axis='model' is not an axis of the mesh" in msgs[0]
    assert "data_axis='data' was given without a mesh" in msgs[1]
    assert "batch size 12 is not divisible by the 8 devices" in msgs[2]


def test_param_shardings_errors_name_the_argument():
    mesh1 = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    batch = (jnp.ones((8, 4)), jnp.ones((8, 2)))

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] + p["b"] - b[1]) ** 2)

    with pytest.raises(ValueError, match="param_shardings was given without a mesh"):
        jaxaccum.value_and_grad(loss, num_microbatches=2, param_shardings={"w": P()})
    wrong = jaxaccum.value_and_grad(
        loss, num_microbatches=2, mesh=mesh1, param_shardings={"w": P()}
    )
    with pytest.raises(TypeError, match=r"param_shardings for argument 0 must be a tree"):
        jax.jit(wrong)(params, batch)
    right = jaxaccum.value_and_grad(
        loss, num_microbatches=2, mesh=mesh1, param_shardings={"w": P(), "b": P()}
    )
    expected = jax.value_and_grad(loss)(params, batch)
    np.testing.assert_allclose(jax.jit(right)(params, batch)[0], expected[0], rtol=1e-6)
