"""Shared test helpers: one tree comparison, a small MLP with a mean loss, random data."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import types
from collections.abc import Iterator

# bfloat16 and float16 are rounded as GPUs and TPUs round them: by default XLA:CPU keeps their
# intermediate results in float32 ("excess precision"), which hides a missing
# preferred_element_type or a sum kept in a 16-bit dtype from every CPU test. Set before JAX
# starts; the multi-device programs inherit it (tests/launcher.py keeps other XLA flags).
NO_EXCESS_PRECISION = "--xla_allow_excess_precision=false"
if NO_EXCESS_PRECISION not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_EXCESS_PRECISION}".strip()

# The suite's cost is compiling, not running: its shapes are small. Two settings cut it by about
# a third and change no result a test checks.
# - LLVM's optimisation level 0 for the CPU code. XLA's HLO passes (fusion, layout, buffer
#   assignment: the memory the tests read) still run; only the machine code is less tuned.
#   JAXACCUM_TEST_COMPILER=default keeps XLA's default, the code users run.
# - One compilation cache for the session, its xdist workers and its multi-device programs:
#   the same program (same HLO, same flags) compiled by two tests is compiled once. Set here,
#   in the process that starts the workers, so they all inherit one directory.
CODEGEN_LEVEL = "--xla_backend_optimization_level=0"
if os.environ.get("JAXACCUM_TEST_COMPILER", "fast") == "fast":
    if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += f" {CODEGEN_LEVEL}"
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        _cache = tempfile.mkdtemp(prefix="jaxaccum-tests-jit-")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)  # (only its creator's exit)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
        # every program, however quick to compile or small
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import Phase, settings

# Hypothesis profiles (JAXACCUM_HYPOTHESIS_PROFILE; "ci" unless set):
# - "ci", the default: derandomized (every run, CI's included, sees the same examples, so a
#   failure reproduces and a pass means the same thing each time) with each test's own count;
# - "deep": random draws, EXAMPLES_SCALE (10) times each test's count, for longer local runs;
# - "no-shrink": mutation testing (tools/mutation/verdict.py) needs a failing example, not
#   the smallest: shrinking would recompile the program for every candidate. Derandomized too.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("deep", derandomize=False, deadline=None)
settings.register_profile("no-shrink", derandomize=True, deadline=None,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate))
HYPOTHESIS_PROFILE = os.environ.get("JAXACCUM_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)
EXAMPLES_SCALE = 10 if HYPOTHESIS_PROFILE == "deep" else 1


def examples(n: int) -> int:
    """A test's number of Hypothesis examples under the loaded profile: ``n`` in CI, ten times
    that in the "deep" profile. Use it for every ``max_examples``."""
    return n * EXAMPLES_SCALE

# the reference model's checks live in a helper module: rewritten, their failures say why
pytest.register_assert_rewrite("reference")

jax.config.update("jax_default_matmul_precision", "highest")

ROOT = pathlib.Path(__file__).resolve().parents[1]
if "JAXACCUM_MNIST_DIR" not in os.environ and (ROOT.parent / "shared" / "mnist").is_dir():
    os.environ["JAXACCUM_MNIST_DIR"] = str(ROOT.parent / "shared" / "mnist")


def max_rel_diff(actual, expected) -> float:
    """Max abs difference over all leaves, relative to the max |expected| (at least 1e-30)."""
    a_leaves, a_def = jax.tree.flatten(actual)
    e_leaves, e_def = jax.tree.flatten(expected)
    assert a_def == e_def, f"tree structures differ: {a_def} vs {e_def}"
    diff = max(
        (
            float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(e, np.float64))))
            for a, e in zip(a_leaves, e_leaves, strict=True)
            if np.size(e)
        ),
        default=0.0,
    )
    scale = max(
        (float(np.max(np.abs(np.asarray(e, np.float64)))) for e in e_leaves if np.size(e)),
        default=0.0,
    )
    return diff / max(scale, 1e-30)


def assert_trees_close(actual, expected, rtol: float) -> float:
    """Asserts max |actual - expected| <= rtol * max |expected| over the whole tree."""
    d = max_rel_diff(actual, expected)
    assert d <= rtol, f"max abs difference relative to max |expected| is {d:.3e} > {rtol:.1e}"
    return d


EPS32 = float(np.finfo(np.float32).eps)


def rounding_error_ratio(actual, full32, ref64) -> tuple[float, float, float]:
    """Errors against a float64 reference, relative to its max magnitude.

    Returns ``(err_actual, err_full32, bound)`` where ``bound = ROUNDING_FACTOR * err_full32 +
    ROUNDING_FLOOR * eps32``: the error float32 rounding already makes in the full-batch run,
    times a small factor, plus a floor of a few float32 ulps for runs where that error is 0.
    """
    err_actual = max_rel_diff(actual, ref64)
    err_full = max_rel_diff(full32, ref64)
    return err_actual, err_full, ROUNDING_FACTOR * err_full + ROUNDING_FLOOR * EPS32


# Error analysis: accumulation reorders float32 sums (k partial sums of B/k terms instead of one
# sum of B terms); its rounding error is of the same order as the full batch's own (both
# O(eps32 * log B) per reduction, amplified alike by the optimizer, Adam's near-zero-gradient
# parameters included, since both runs see the same noise level). A factor 10 over the
# full-batch float32 error leaves room for the two error realisations to differ; real bugs
# (a mean of means, a step per micro-batch, a schedule advanced k times) are errors of 1e-3 and
# more, 4+ orders of magnitude above either.
ROUNDING_FACTOR = 10.0
ROUNDING_FLOOR = 16.0


def assert_within_rounding(actual, full32, ref64) -> tuple[float, float]:
    """Asserts ``actual`` is as close to the float64 reference as float32 rounding allows.

    ``full32`` is the full-batch float32 run, ``ref64`` the same computation in float64. Both
    errors are relative to max |ref64| over the tree. Returns ``(err_actual, err_full32)``.
    """
    err_actual, err_full, bound = rounding_error_ratio(actual, full32, ref64)
    assert err_actual <= bound, (
        f"error vs the float64 reference {err_actual:.3e} > {ROUNDING_FACTOR:g} x the full "
        f"batch's own float32 error {err_full:.3e} + {ROUNDING_FLOOR:g} eps32"
    )
    return err_actual, err_full


def full_and_reference(loss_of_batch, params, batch):
    """``jax.value_and_grad`` of the full batch in float32 and in float64 (the rounding
    reference of :func:`assert_within_rounding`)."""
    full32 = jax.jit(jax.value_and_grad(loss_of_batch))(params, batch)
    with jax.enable_x64(True):
        ref = jax.jit(jax.value_and_grad(loss_of_batch))(to_float64(params), to_float64(batch))
        ref64 = jax.tree.map(lambda a: np.asarray(a, np.float64), ref)
    return full32, ref64


def to_float64(tree):
    """Casts every floating leaf to float64 (call inside ``jax.enable_x64(True)``)."""
    return jax.tree.map(
        lambda x: jnp.asarray(x, jnp.float64) if jnp.issubdtype(jnp.result_type(x), jnp.floating)
        else x,
        tree,
    )


def float64_trajectory(loss_fn, make_optimizer, params, batches):
    """The full-batch trajectory computed in float64: the reference for rounding checks.

    Runs with x64 enabled and a fresh optimizer; returns the final params as float64 NumPy.
    """
    with jax.enable_x64(True):
        out = full_batch_trajectory(
            loss_fn, make_optimizer(), to_float64(params), [to_float64(b) for b in batches]
        )
        return jax.tree.map(lambda x: np.asarray(x, np.float64), out)


def mlp_params(key, sizes=(8, 16, 4), dtype=jnp.float32):
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        key, k1, k2 = jax.random.split(key, 3)
        params[f"layer{i}"] = {
            "w": (jax.random.normal(k1, (m, n)) / np.sqrt(m)).astype(dtype),
            "b": (0.1 * jax.random.normal(k2, (n,))).astype(dtype),
        }
    return params


def mlp_apply(params, x):
    n = len(params)
    for i in range(n):
        layer = params[f"layer{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < n - 1:
            x = jnp.tanh(x)
    return x


def mse_loss(params, batch):
    """Mean over the examples it is given."""
    x, y = batch
    return jnp.mean((mlp_apply(params, x) - y) ** 2)


def random_batch(key, batch_size, sizes=(8, 16, 4)):
    kx, ky = jax.random.split(key)
    return (
        jax.random.normal(kx, (batch_size, sizes[0])),
        jax.random.normal(ky, (batch_size, sizes[-1])),
    )


def optimizers():
    """The optimizers the trajectory tests run: name -> factory (fresh transform per call)."""
    schedule = lambda: optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 5)  # noqa: E731
    return {
        "sgd": lambda: optax.sgd(0.05),
        "momentum": lambda: optax.sgd(0.05, momentum=0.9),
        "adam": lambda: optax.adam(1e-2),
        "adamw_schedule": lambda: optax.adamw(schedule(), weight_decay=1e-2),
        "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
        "adagrad": lambda: optax.adagrad(0.05),
    }


def grad_and_update(loss_fn, optimizer):
    """A jitted ``(params, state, batch) -> (params, state)``: plain gradient, one update."""

    @jax.jit
    def step(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def full_batch_trajectory(loss_fn, optimizer, params, batches):
    """The reference: plain jax.grad on each full batch and one update."""
    step = grad_and_update(loss_fn, optimizer)
    state = optimizer.init(params)
    for batch in batches:
        params, state = step(params, state, batch)
    return params


def mnist_unavailable(why: str) -> None:
    """Skips an MNIST test on a machine without the data (a user's fresh clone, offline), with
    the reason and the fix; fails it where the data must be there (CI, which sets
    ``JAXACCUM_REQUIRE_MNIST=1``: its MNIST tests never skip silently)."""
    if os.environ.get("JAXACCUM_REQUIRE_MNIST") == "1":
        pytest.fail(f"{why} (JAXACCUM_REQUIRE_MNIST=1: the MNIST tests must run here)")
    pytest.skip(f"{why}; to run the MNIST tests set JAXACCUM_MNIST_DIR to a folder holding the "
                "four MNIST .gz files, or run them once with network access (MNIST is then "
                "prepared in tensorflow-datasets' data_dir, $TFDS_DATA_DIR or "
                "~/tensorflow_datasets, and read from there)")


@pytest.fixture(scope="session")
def mnist_data_dir(tmp_path_factory) -> pathlib.Path:
    """A tensorflow-datasets ``data_dir`` in which MNIST is prepared. With
    ``$JAXACCUM_MNIST_DIR`` (the four ``.gz`` files): a temporary one, prepared once per session
    from them. Without: TFDS' own (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``), where MNIST
    is read if prepared there before and otherwise downloaded and prepared."""
    import tensorflow_datasets as tfds

    from jaxaccum.experiment import data

    tfds.disable_progress_bar()
    manual = os.environ.get(data.MANUAL_DIR_ENV)
    if manual:
        if not pathlib.Path(manual).is_dir():
            pytest.fail(f"{data.MANUAL_DIR_ENV}={manual} is not a folder")
        data_dir: pathlib.Path | None = tmp_path_factory.mktemp("tfds")
    else:
        data_dir = None  # TFDS' default data_dir, its cache
    try:
        data.mnist("test", data_dir=data_dir, manual_dir=manual or None)  # prepares both splits
    except data.MnistDownloadError as e:
        mnist_unavailable(f"no MNIST: {data.MANUAL_DIR_ENV} is not set and "
                          f"{str(e).splitlines()[0]}")
    builder = data.JaxaccumMnist(data_dir=None if data_dir is None else str(data_dir))
    return pathlib.Path(builder.data_dir_root)


@pytest.fixture(scope="session")
def mnist(mnist_data_dir):
    """Real MNIST (train and test), read from :func:`mnist_data_dir`."""
    from jaxaccum.experiment import gist

    return gist.Mnist.load(str(mnist_data_dir))


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """Input a test gives outside ``refuses`` is valid: jaxaccum refusing it (its own
    ``ValueError``/``TypeError``, whose message names the entry point) breaks the promise that
    only bad input is refused, and fails the test as an assertion saying so."""
    outcome = yield
    error = outcome.excinfo[1] if outcome.excinfo else None
    if isinstance(error, (TypeError, ValueError)) and str(error).startswith("jaxaccum"):
        outcome.force_exception(AssertionError(f"jaxaccum refused valid input: {error}"))


def accepts(call) -> bool:
    """Whether jaxaccum accepts an input: True when ``call()`` returns, False when jaxaccum
    refuses it (its own ``ValueError``/``TypeError``, whose message names the entry point).
    Any other exception propagates: a crash is not a refusal. For the tests of a validator's
    documented domain, ``assert accepts(...) == documented``: both directions at once."""
    try:
        call()
    except (TypeError, ValueError) as error:
        if not str(error).startswith("jaxaccum"):
            raise
        return False
    return True


@contextlib.contextmanager
def refuses(kind, match: str | None = None) -> Iterator[types.SimpleNamespace]:
    """Like ``pytest.raises``, but any other exception, or a message that does not match, is
    an assertion failure: a promise of a clear error is broken as much by a crash elsewhere
    (a NumPy reshape error, a tracer error) as by no error at all."""
    info = types.SimpleNamespace(value=None)
    try:
        yield info
    except Exception as error:  # noqa: BLE001 - the point is to judge any exception
        assert isinstance(error, kind), (
            f"expected {kind}, got {type(error).__name__}: {str(error)[:500]}")
        assert match is None or re.search(match, str(error)), (
            f"the message does not match {match!r}: {str(error)[:500]}")
        info.value = error
        return
    raise AssertionError(f"DID NOT RAISE {kind}")
