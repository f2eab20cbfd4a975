"""Data parallel: each device scans its shard, gradients are reduced once per optimizer step.

The programs (``tests/multidevice/data_parallel.py``, ``multiprocess.py``) run in fresh
processes: 8 CPU devices need XLA_FLAGS before JAX starts, and the multi-process test starts
two JAX processes that talk over 127.0.0.1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import accepts, refuses
from jax.sharding import PartitionSpec as P
from launcher import run_program

import jaxaccum


@pytest.fixture(scope="module")
def single_host():
    return run_program("data_parallel", "single_host", devices=8)


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


def test_two_processes_equal_single_process():
    multi = run_program("multiprocess", "data", devices=1, processes=2, timeout=240)
    single = run_program("multiprocess", "data_reference", devices=1, timeout=240)
    a = {k: np.asarray(v, np.float32) for k, v in multi["params"].items()}
    b = {k: np.asarray(v, np.float32) for k, v in single["params"].items()}
    for name in b:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert float(np.max(np.abs(b["w1"]))) > 0


def test_errors_name_arguments():
    msgs = run_program("data_parallel", "errors", devices=8)["messages"]
    assert "data_axis='model' is not an axis of the mesh" in msgs[0]
    assert "jaxaccum.value_and_grad: mesh has the axes ('data', 'model')" in msgs[1]
    assert "DataParallel(mesh, data_axis='data')" in msgs[1]
    assert "jaxaccum.value_and_grad: the batch size 12 is not divisible by the 8 devices" in msgs[2]


def test_data_parallel_takes_exactly_the_documented_data_axes():
    """``data_axis`` (DataParallel's docstring): the mesh axis, or tuple of axes, the batch is
    split over, omitted only on a one-axis mesh; anything else (no axes, an axis the mesh
    lacks, an empty tuple, omitted on a mesh of several axes) is refused naming DataParallel
    and the mesh's axes. Meshes of 0, 1 and 2 axes on one device."""
    device = np.array(jax.devices()[:1])
    for names in [(), ("data",), ("data", "model")]:
        mesh = jax.sharding.Mesh(device.reshape((1,) * len(names)), names)
        for data_axis in [None, "data", ("data",), ("model", "data"), "nope", ()]:
            wanted = (names if data_axis is None
                      else (data_axis,) if isinstance(data_axis, str) else data_axis)
            valid = (len(names) == 1 if data_axis is None
                     else bool(wanted) and all(a in names for a in wanted))
            if valid:
                assert jaxaccum.DataParallel(mesh, data_axis=data_axis).axes == wanted
            else:
                with refuses(ValueError, match=r"^jaxaccum\.DataParallel: .*mesh"):
                    jaxaccum.DataParallel(mesh, data_axis=data_axis)


def test_param_shardings_errors_name_the_argument():
    mesh1 = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    batch = (jnp.ones((8, 4)), jnp.ones((8, 2)))

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] + p["b"] - b[1]) ** 2)

    with refuses(TypeError, match="the option param_shardings= is gone.*DataParallel"):
        jaxaccum.value_and_grad(loss, num_microbatches=2, param_shardings={"w": P()})
    wrong = jaxaccum.value_and_grad(
        loss, num_microbatches=2,
        mesh=jaxaccum.DataParallel(mesh1, param_shardings={"w": P()}),
    )
    with refuses(TypeError, match=r"param_shardings for argument 0 must be a tree"):
        jax.jit(wrong)(params, batch)
    right = jaxaccum.value_and_grad(
        loss, num_microbatches=2,
        mesh=jaxaccum.DataParallel(mesh1, param_shardings={"w": P(), "b": P()}),
    )
    expected = jax.value_and_grad(loss)(params, batch)
    np.testing.assert_allclose(jax.jit(right)(params, batch)[0], expected[0], rtol=1e-6)


def test_param_shardings_are_refused_on_explicit_data_axes():
    """Explicit axes carry every parameter's sharding in its type: hints would be ignored, so
    they are refused; the same hints on Auto axes are taken."""
    for kind, taken in ((jax.sharding.AxisType.Explicit, False), (jax.sharding.AxisType.Auto,
                                                                  True)):
        mesh = jax.make_mesh((1,), ("data",), axis_types=(kind,))
        assert accepts(lambda m=mesh: jaxaccum.DataParallel(m, param_shardings={"w": P()})) \
            == taken
    with refuses(ValueError, match=r"^jaxaccum\.DataParallel: param_shardings is for Auto-axis "
                 r"meshes.*Explicit.*drop param_shardings"):
        jaxaccum.DataParallel(jax.make_mesh((1,), ("data",)), param_shardings={"w": P()})
