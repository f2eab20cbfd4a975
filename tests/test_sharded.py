"""Sharded training: TP and FSDP parameter shardings are kept, gradients reduced once per step.

One process with 8 host CPU devices runs every mesh case (``tests/multidevice/sharded.py``)
and reports numbers; the tests below assert on them. Meshes: (8,) data; (4, 2) data x model
with tensor-parallel kernels; (8,) FSDP (kernels sharded over the data axis); (2, 4) data x
fsdp with ``data_axis=("data", "fsdp")``; and FSDP + TP: (4, 2) data x model with kernels
sharded over both, (8, 1) data x model with FSDP kernels. Each on an Auto and an Explicit mesh
(the Explicit model writes its contractions with ``out_sharding=``).
"""

from __future__ import annotations

import numpy as np
import pytest
from launcher import run_program

L = 3  # layers of tests/multidevice/parameter_ops.py's stacked kernels


@pytest.fixture(scope="module")
def results():
    return run_program("sharded", devices=8, timeout=900)


CASES = [
    (mesh, axis_type, fsdp)
    for mesh in ("data", "data_model", "fsdp", "data_fsdp")
    for axis_type in ("auto", "explicit")
    for fsdp in (("step", "microbatch") if "fsdp" in mesh else ("step",))
]


@pytest.mark.parametrize("mesh,axis_type,fsdp", CASES)
@pytest.mark.parametrize("k", [1, 4, 16])
def test_equals_single_device_full_batch(results, mesh, axis_type, fsdp, k):
    r = results[f"{mesh}/{axis_type}/{fsdp}/{k}"]
    assert r["loss_rel"] <= 1e-5
    assert r["grads_rel"] <= 1e-5
    assert r["grad_shardings_kept"]
    if axis_type == "auto":
        unnamed = results[f"{mesh}/{axis_type}/{fsdp}/unnamed"]
        assert unnamed["loss_rel"] <= 1e-5 and unnamed["grads_rel"] <= 1e-5


@pytest.mark.parametrize("mesh,axis_type,fsdp", CASES)
def test_train_step_keeps_shardings(results, mesh, axis_type, fsdp):
    r = results[f"{mesh}/{axis_type}/{fsdp}/train"]
    assert r["params_kept"] and r["state_kept"]
    assert r["params_rel"] <= 1e-5  # 3 Adam steps, k=4, vs the single-device full batch


@pytest.mark.parametrize("mesh,axis_type,fsdp", CASES)
def test_one_gradient_reduction_per_step(results, mesh, axis_type, fsdp):
    """Gradient-sized reductions over the data axes: as many for k = 4, 16 as for k = 1."""
    base = results[f"{mesh}/{axis_type}/{fsdp}/1"]["reductions"]
    for k in (4, 16):
        red = results[f"{mesh}/{axis_type}/{fsdp}/{k}"]["reductions"]
        if fsdp == "microbatch":  # ZeRO-3: a reduce-scatter per micro-batch, by design
            assert red["in loops"] >= 1
            continue
        assert red["total"] == base["total"] >= 1
        assert red["in loops"] == 0
        assert abs(red["bytes"] - base["bytes"]) <= 16  # k = 1 may fuse the 4-byte loss in


@pytest.mark.parametrize("mesh", ["data", "data_model"])
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_temp_memory_no_higher_than_plain_jit(results, mesh, axis_type):
    for k in (4, 16):
        r = results[f"{mesh}/{axis_type}/step/{k}"]
        assert r["temp"] <= r["plain"]["temp"], (r["temp"], r["plain"]["temp"])


@pytest.mark.parametrize("mesh", ["fsdp", "data_fsdp"])
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_fsdp_memory_both_options_side_by_side(results, mesh, axis_type):
    """Arguments arrive sharded; ZeRO-3 ("microbatch") needs less temp than "step" and than
    the plain-jit full-batch step. On Auto meshes the shardings are known to train_step (read
    before tracing), so its compiled step is measured; on Explicit ones, value_and_grad."""
    key = "train" if axis_type == "auto" else "4"
    step = results[f"{mesh}/{axis_type}/step/{key}"]
    zero3 = results[f"{mesh}/{axis_type}/microbatch/{key}"]
    plain = results[f"{mesh}/{axis_type}/step/4"]["plain"]["temp"]
    replicated = results[f"data/{axis_type}/step/4"]
    assert results[f"{mesh}/{axis_type}/step/4"]["argument"] < replicated["argument"]
    assert zero3["temp"] < step["temp"]
    assert zero3["temp"] <= plain


def test_two_processes_data_by_model_mesh_equal_single_process():
    """2 processes x 4 CPU devices, a (data=4, model=2) mesh with TP kernels, 3 momentum steps."""
    multi = run_program("multiprocess", "data_model", devices=4, processes=2, timeout=300)
    single = run_program("multiprocess", "data_model_reference", devices=1, timeout=300)
    a = {k: np.asarray(v, np.float32) for k, v in multi["params"].items()}
    b = {k: np.asarray(v, np.float32) for k, v in single["params"].items()}
    scale = max(float(np.max(np.abs(b[n]))) for n in b)
    assert max(float(np.max(np.abs(a[n] - b[n]))) for n in b) <= 1e-5 * scale
    assert float(np.max(np.abs(b["b1"]))) > 0  # the step moved the parameters


def test_plan_chooses_fsdp_option_with_k():
    r = run_program("plan", devices=8, timeout=300)
    order = [f"{k}/{o}" for k in (1, 2, 4, 8) for o in ("step", "microbatch")]
    expected = next(key for key in order if r["totals"][key] <= r["budget"])
    assert f"{r['k']}/{r['fsdp']}" == expected
    assert r["tried"][-1] == [r["k"], r["fsdp"]]
    # ZeRO-3 is what makes the budget reachable at a smaller k than "step" alone would need
    assert r["totals"]["4/microbatch"] < r["totals"]["4/step"]


def test_carried_state_and_aux_reductions_on_a_mesh_equal_single_device():
    """Explicit mesh, 8 devices: every micro-batch is one global array, so the carried state
    and the reduced aux equal the single-device run's (k = 4 on both)."""
    r = run_program("carry", devices=8, timeout=300)
    assert r["grads"] <= 1e-5 and r["loss"] <= 1e-5 and r["stats"] <= 1e-5, r
    assert r["count"] == 4 and r["n"] == r["n_single"] == 256 and r["first"] <= 1e-5
    assert "use a mesh with Explicit axes" in r["auto_error"]


def test_explicit_parameters_mixed_with_activations():
    """On an Explicit mesh a bias or a scale meets a batch-sharded activation elementwise;
    jaxaccum reshards the (reduced) parameter there, so its gradient too is reduced once per
    step, at the top level and in nested jits. Inside the model's own scan over layers the
    parameters fall back to a reduction per micro-batch: still the right gradient. So does a
    model with a convolution (JAX 0.10 has no reduced rule for it). Parameters sharded over
    the data and a model axis in one dimension are exact in either order."""
    out = run_program("parameter_ops", devices=8, timeout=600)
    for name in ("top_level", "scanned", "loop_bias", "conv"):  # conv: every leaf falls back
        assert out[name]["grads_rel"] <= 1e-5 and out[name]["loss_rel"] <= 1e-5, out
    assert out["top_level"]["reductions"]["in loops"] == 0, out
    assert out["top_level"]["reductions"]["total"] >= 1, out
    assert out["scanned"]["reductions"]["in loops"] >= 1, out  # the documented fallback
    # only "such parameters" fall back: the bias the loop closes over is reduced per
    # micro-batch, the 2-D and 3-D kernels outside the loop still once per step
    r, size = out["loop_bias"]["reductions"], out["bytes"]
    assert 0 < r["bytes in loops"] <= size["bias"], (r, size)
    assert r["bytes"] - r["bytes in loops"] >= size["w"] // L + size["w3"] + size["w2"], (r, size)
    # a dimension sharded over the data and the model axis together, in either order: exact,
    # the gradient sharded like the parameter (Explicit), and no reduction per micro-batch
    for kind in ("auto", "explicit"):
        c = out["compound"][kind]
        assert c["grads_rel"] <= 1e-5 and c["loss_rel"] <= 1e-5, c
        assert c["reductions"]["in loops"] == 0, c
    assert out["compound"]["explicit"]["specs_kept"], out["compound"]


@pytest.mark.parametrize("mesh", ["fsdp", "data_fsdp"])
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_fsdp_gradients_are_reduce_scattered(results, mesh, axis_type):
    """A kernel sharded over a data axis gets its gradient by a reduce-scatter (each device
    receives only its shard), not an all-reduce of the whole gradient and a slice."""
    r = results[f"{mesh}/{axis_type}/step/4"]
    replicated = results[f"data/{axis_type}/step/4"]["reductions"]["bytes"]
    assert r["counts"]["reduce-scatter"] >= 2, r["counts"]  # w1 and w2
    # HSDP (data x fsdp): a reduce-scatter over fsdp, then an all-reduce of the shard over data
    assert r["reductions"]["bytes"] <= replicated / 2, (r["reductions"], replicated)


# -- FSDP + TP: kernels sharded over the data axis and a model axis -------------------------
# (4, 2) data x model: w1 P("data", "model"), b1 P("model"), w2 P("model", "data");
# (8, 1) data x model: w1 and w2 P("data", None). Both fsdp options, k = 1, 4, Auto and Explicit.


def fsdp_tp_cases(check: str) -> list:
    return [
        (mesh, axis_type, fsdp)
        for mesh in ("fsdp_model", "fsdp_8x1")
        for axis_type in ("auto", "explicit")
        for fsdp in ("step", "microbatch")
    ]


def fsdp_tp_result(results, case: str, row: str) -> dict:
    """One row of a case; a case the library raised on has only its error."""
    error = results.get(f"{case}/error")
    assert error is None, error["error"]
    return results[f"{case}/{row}"]


@pytest.mark.parametrize("mesh,axis_type,fsdp", fsdp_tp_cases("other"))
@pytest.mark.parametrize("k", [1, 4])
def test_fsdp_tp_equals_single_device_full_batch(results, mesh, axis_type, fsdp, k):
    r = fsdp_tp_result(results, f"{mesh}/{axis_type}/{fsdp}", str(k))
    assert r["loss_rel"] <= 1e-5
    assert r["grads_rel"] <= 1e-5
    assert r["grad_shardings_kept"]


@pytest.mark.parametrize("mesh,axis_type,fsdp", fsdp_tp_cases("other"))
def test_fsdp_tp_train_step_keeps_shardings(results, mesh, axis_type, fsdp):
    r = fsdp_tp_result(results, f"{mesh}/{axis_type}/{fsdp}", "train")
    assert r["params_kept"] and r["state_kept"]
    assert r["params_rel"] <= 1e-5  # 3 Adam steps, k=4, vs the single-device full batch


@pytest.mark.parametrize("mesh,axis_type,fsdp", fsdp_tp_cases("other"))
def test_fsdp_tp_temp_memory_no_higher_than_plain_jit(results, mesh, axis_type, fsdp):
    """k = 4: "microbatch" needs no more temp than plain jit of the full batch; "step" may add
    the full size of the largest parameter (its documented transient gather)."""
    r = fsdp_tp_result(results, f"{mesh}/{axis_type}/{fsdp}", "4")
    allowed = r["plain"]["temp"] + (r["plain"]["largest_param"] if fsdp == "step" else 0)
    assert r["temp"] <= allowed, (r["temp"], r["plain"])


@pytest.mark.parametrize("mesh,axis_type,fsdp", fsdp_tp_cases("no_model_gather"))
def test_fsdp_tp_no_all_gather_over_the_model_axis(results, mesh, axis_type, fsdp):
    """The FSDP gather runs over the data axis only: a tensor-parallel shard stays one."""
    for row in ("4", "train"):
        r = fsdp_tp_result(results, f"{mesh}/{axis_type}/{fsdp}", row)
        assert r["model_all_gathers"] == [], (row, r["model_all_gathers"])  # result bytes
