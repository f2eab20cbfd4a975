"""The experiment: does accumulating micro-batch gradients reproduce the full-batch update?

A JAX reproduction of a TensorFlow 1 experiment on MNIST (784-100-10 ReLU MLP, MSE on one-hot
targets, SGD lr 1e-2, kernels from uniform(-0.025, 0.025) with NumPy seed 123456, data seed
764847), with answers to the questions it left open (dropout, momentum/Adam/Adagrad, time).

Run ``jaxaccum-gist`` (or ``python -m jaxaccum.experiment.gist``); ``--help`` lists the options.
It prints the checks and a table, and writes ``results.json`` and ``loss_curves.png`` to
``--out``.

"Equal up to float rounding" is judged against a float64 reference: the same full-batch
trajectory run with plain ``jax.grad`` in float64. Accumulating reorders float32 sums, so its
error against that reference must be of the order of the error the float32 full-batch run makes
itself: at most ``ROUNDING_FACTOR`` times it plus ``ROUNDING_FLOOR`` float32 ulps (the criterion
of the tests' ``assert_within_rounding``). A fixed tolerance cannot say this: how far float32
rounding carries along a trajectory depends on the optimizer (Adam divides by the root of tiny
second moments) and on the CPU's kernels.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxaccum
from jaxaccum.experiment import data, models

DATA_SEED = 764847
TEST_SEED = 1
LEARNING_RATE = 1e-2
EVAL_BATCHES, EVAL_BATCH_SIZE = 10, 128
EPS32 = float(np.finfo(np.float32).eps)
# Accumulation's error vs the float64 reference may be this many times the float32 full batch's
# own error, plus this many float32 ulps (relative to max |reference|); see the module docstring.
ROUNDING_FACTOR = 10.0
ROUNDING_FLOOR = 16.0


@dataclass
class Mnist:
    """Both splits as float32 (n, 784) images in [0, 1] and int32 labels."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray

    @classmethod
    def load(cls, data_dir: str | None = None, manual_dir: str | None = None) -> Mnist:
        train = data.mnist("train", data_dir=data_dir, manual_dir=manual_dir)
        test = data.mnist("test", data_dir=data_dir, manual_dir=manual_dir)
        return cls(*train, *test)

    def train_stream(self, seed: int = DATA_SEED) -> data.ExampleStream:
        return data.ExampleStream(self.train_images, self.train_labels, seed)

    def test_batches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        stream = data.ExampleStream(self.test_images, self.test_labels, TEST_SEED)
        return [stream.next_batch(EVAL_BATCH_SIZE) for _ in range(EVAL_BATCHES)]


def float64_enabled(dtype: Any) -> AbstractContextManager[Any]:
    """``jax.enable_x64(True)`` for float64 work, a no-op context otherwise."""
    return jax.enable_x64(True) if np.dtype(dtype) == np.float64 else nullcontext()


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Casts the floating leaves of ``tree`` to ``dtype`` (call under x64 for float64)."""

    def cast(x: Any) -> Any:
        return jnp.asarray(x, dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x

    return jax.tree.map(cast, tree)


def gist_model(dtype: Any = jnp.float32) -> tuple[Callable[..., jax.Array], Any]:
    """The experiment's MLP as ``(apply, params)``, params cast to ``dtype``."""
    apply, params = models.functional(models.GistMLP())
    return apply, params if np.dtype(dtype) == np.float32 else cast_floats(params, dtype)


def gist_loss(apply: Callable[..., jax.Array]) -> Callable[..., Any]:
    """MSE against one-hot labels; aux is the sum of the input pixels (the device-side hash)."""

    def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        x, y = batch
        return models.mse_one_hot(apply(params, x), y), jnp.sum(x)

    return loss


def _leaves64(tree: Any) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest absolute difference over all leaves of two pytrees (computed in float64)."""
    pairs = zip(_leaves64(a), _leaves64(b), strict=True)
    return float(max(np.max(np.abs(x - y)) for x, y in pairs))


def max_rel_diff(a: Any, b: Any) -> float:
    """``max_abs_diff(a, b)`` relative to the largest magnitude in ``b``."""
    scale = max(float(np.max(np.abs(y))) for y in _leaves64(b))
    return max_abs_diff(a, b) / max(scale, 1e-30)


# --- checks 1-4 ----------------------------------------------------------------------------


def check_gradient_structure(mnist: Mnist) -> bool:
    """1. The gradient pytree lines up leaf for leaf (path, shape, dtype) with the parameters."""
    apply, params = gist_model()
    x, y = mnist.train_stream().next_batch(8)
    grads = jax.grad(lambda p: gist_loss(apply)(p, (x, y))[0])(params)

    def describe(tree: Any) -> list[tuple[str, Any, Any]]:
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [(jax.tree_util.keystr(p), v.shape, v.dtype) for p, v in flat]

    return describe(grads) == describe(params)


def check_reinit() -> float:
    """2. Re-initialising gives identical weights: the max abs difference (0 when identical)."""
    return max_abs_diff(gist_model()[1], gist_model()[1])


def check_stream(mnist: Mnist) -> bool:
    """3. 10 batches of 10 then one example == 100 batches of 1 then one example."""
    a, b = mnist.train_stream(), mnist.train_stream()
    first = np.concatenate([a.next_batch(10)[0] for _ in range(10)])
    second = np.concatenate([b.next_batch(1)[0] for _ in range(100)])
    return bool(
        np.array_equal(first, second) and np.array_equal(a.next_batch(1)[0], b.next_batch(1)[0])
    )


def check_accumulation(mnist: Mnist, batch_sizes: Sequence[int] = (1, 10, 64)) -> dict[int, float]:
    """4. Gradients accumulated one example at a time vs the full batch: max abs difference."""
    apply, params = gist_model()
    loss = gist_loss(apply)
    full = jax.jit(jax.grad(lambda p, b: loss(p, b)[0]))
    out = {}
    for n in batch_sizes:
        batch = tuple(map(jnp.asarray, mnist.train_stream().next_batch(n)))
        accumulated = jax.jit(jaxaccum.value_and_grad(loss, microbatch_size=1, has_aux=True))
        out[n] = max_abs_diff(accumulated(params, batch)[1], full(params, batch))
    return out


# --- check 5: training ---------------------------------------------------------------------


@dataclass
class Evaluation:
    """A model's numbers on the test batches."""

    accuracy: float
    loss_mean: float
    loss_std: float
    outputs: np.ndarray = field(repr=False)  # (examples, 10), float64 copy of the outputs


def evaluate(apply: Callable[..., jax.Array], params: Any, batches: list[Any]) -> Evaluation:
    """Accuracy over the test batches, the mean and std of their losses, and the outputs.

    The images are cast to the parameters' dtype (call under x64 for float64 parameters).
    """
    dtype = jax.tree.leaves(params)[0].dtype

    @jax.jit
    def stats(params: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, ...]:
        out = apply(params, x)
        return models.mse_one_hot(out, y), jnp.sum(jnp.argmax(out, -1) == y), out

    results = [stats(params, np.asarray(x, dtype), y) for x, y in batches]
    losses = np.array([float(r[0]) for r in results])
    correct = sum(int(r[1]) for r in results)
    return Evaluation(
        accuracy=correct / sum(len(y) for _, y in batches),
        loss_mean=float(losses.mean()),
        loss_std=float(losses.std()),
        outputs=np.concatenate([np.asarray(r[2], np.float64) for r in results]),
    )


@dataclass
class TrainResult:
    """One training configuration's numbers."""

    name: str
    batch: int
    microbatches: int
    steps: int
    accuracy: float
    loss_mean: float
    loss_std: float
    hash_host: float
    hash_device: float
    seconds: float
    train_losses: list[float] = field(repr=False)
    params: Any = field(repr=False)
    test_outputs: np.ndarray = field(repr=False)

    def row(self) -> dict[str, Any]:
        hidden = ("params", "train_losses", "test_outputs")
        return {k: v for k, v in self.__dict__.items() if k not in hidden}


def train(
    mnist: Mnist,
    batch: int,
    microbatches: int,
    steps: int,
    optimizer: optax.GradientTransformation | None = None,
    progress: Callable[[], None] | None = None,
) -> TrainResult:
    """Trains the gist MLP for ``steps`` optimizer steps of ``batch * microbatches`` examples.

    ``(batch, microbatches)`` is the experiment's (actual batch, micro-batches): each step draws
    ``batch * microbatches`` examples from the seeded stream and splits them into
    ``microbatches`` micro-batches of ``batch`` examples, accumulated by ``jaxaccum.train_step``.
    """
    optimizer = optimizer or optax.sgd(LEARNING_RATE)
    apply, params = gist_model()
    step = jaxaccum.train_step(
        gist_loss(apply), optimizer, num_microbatches=microbatches, has_aux=True
    )
    opt_state = optimizer.init(params)
    stream = mnist.train_stream()
    hash_host, hash_device, losses = 0.0, jnp.zeros((), jnp.float32), []
    start = time.perf_counter()
    for _ in range(steps):
        x, y = stream.next_batch(batch * microbatches)
        hash_host += float(np.sum(x, dtype=np.float64))
        params, opt_state, loss, info = step(params, opt_state, (x, y))
        hash_device = hash_device + jnp.sum(info.aux)
        losses.append(loss)
        if progress:
            progress()
    losses_host = [float(v) for v in losses]
    seconds = time.perf_counter() - start
    ev = evaluate(apply, params, mnist.test_batches())
    return TrainResult(
        name=f"({batch}, {microbatches})",
        batch=batch,
        microbatches=microbatches,
        steps=steps,
        accuracy=ev.accuracy,
        loss_mean=ev.loss_mean,
        loss_std=ev.loss_std,
        hash_host=hash_host,
        hash_device=float(hash_device),
        seconds=seconds,
        train_losses=losses_host,
        params=params,
        test_outputs=ev.outputs,
    )


# --- the float64 reference -----------------------------------------------------------------


def plain_trajectory(
    loss: Callable[..., jax.Array],
    optimizer: optax.GradientTransformation,
    params: Any,
    batches: Iterable[Any],
) -> Any:
    """Full-batch training without jaxaccum: ``jax.grad`` of each batch and one update."""

    @jax.jit
    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any]:
        grads = jax.grad(loss)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = optimizer.init(params)
    for batch in batches:
        params, state = step(params, state, batch)
    return params


@dataclass
class Reference:
    """A plain full-batch run (float64 for the reference): final params and test numbers."""

    params: Any = field(repr=False)  # NumPy leaves in the run's dtype
    evaluation: Evaluation


def reference_train(
    mnist: Mnist,
    examples: int,
    steps: int,
    make_optimizer: Callable[[], optax.GradientTransformation] | None = None,
    dtype: Any = jnp.float64,
) -> Reference:
    """The gist MLP trained on the same stream with plain ``jax.grad``, in ``dtype``.

    ``steps`` updates of ``examples`` examples each, the same examples as :func:`train` with
    ``batch * microbatches == examples``; float64 by default (x64 enabled inside).
    """
    make_optimizer = make_optimizer or (lambda: optax.sgd(LEARNING_RATE))
    with float64_enabled(dtype):
        apply, params = gist_model(dtype)
        loss = gist_loss(apply)
        stream = mnist.train_stream()
        batches = (cast_floats(stream.next_batch(examples), dtype) for _ in range(steps))
        params = plain_trajectory(lambda p, b: loss(p, b)[0], make_optimizer(), params, batches)
        evaluation = evaluate(apply, params, mnist.test_batches())
        return Reference(jax.tree.map(np.asarray, params), evaluation)


def ambiguous_predictions(reference: np.ndarray, *outputs: np.ndarray) -> int:
    """How many test predictions float rounding could flip between the runs ``outputs``.

    Where every output of every run is within ``d`` of the reference's, an example whose
    reference top-2 margin exceeds ``2 d`` is predicted alike by all runs. So two runs' numbers
    of correct predictions differ by at most the count of the other examples, returned here.
    """
    d = max(float(np.max(np.abs(o - reference))) for o in outputs)
    top2 = np.sort(reference, axis=-1)[:, -2:]
    return int(np.sum(top2[:, 1] - top2[:, 0] <= 2 * d))


def compare_to_float64(full: TrainResult, accumulated: TrainResult, ref: Reference) -> dict:
    """The float64-reference criterion for (B, 1) vs (1, B), with its numbers.

    ``error_*`` are max |params - reference| relative to max |reference|; ``bound`` is
    ``ROUNDING_FACTOR * error_full + ROUNDING_FLOOR * eps32``. ``within_rounding`` holds when
    the accumulated run's error is within the bound and the two accuracies differ by no more
    than the ``ambiguous_test_predictions`` allow.
    """
    err_acc = max_rel_diff(accumulated.params, ref.params)
    err_full = max_rel_diff(full.params, ref.params)
    bound = ROUNDING_FACTOR * err_full + ROUNDING_FLOOR * EPS32
    ambiguous = ambiguous_predictions(
        ref.evaluation.outputs, full.test_outputs, accumulated.test_outputs
    )
    examples = len(ref.evaluation.outputs)
    correct_gap = round(abs(full.accuracy - accumulated.accuracy) * examples)
    return {
        "error_accumulated_vs_float64": err_acc,
        "error_full_vs_float64": err_full,
        "bound": bound,
        "ambiguous_test_predictions": ambiguous,
        "accuracy_float64": ref.evaluation.accuracy,
        "within_rounding": bool(err_acc <= bound and correct_gap <= ambiguous),
    }


# --- open questions ------------------------------------------------------------------------


def dropout_model(seed: int = 0) -> tuple[Callable[..., jax.Array], Any]:
    return models.functional(models.DropoutMLP(nnx.Rngs(seed)))


def dropout_loss(apply: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """MSE of the softmax output; dropout masks from the per-example keys in the batch."""

    def loss(params: Any, batch: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        x, y, keys = batch
        return models.mse_one_hot(apply(params, x, keys), y)

    return loss


def dropout_gradients(mnist: Mnist, k: int = 64, batch: int = 64) -> dict[str, float]:
    """Max abs gradient difference k=1 vs k, with per-example keys and with one batch key."""
    apply, params = dropout_model()
    loss = dropout_loss(apply)
    x, y = map(jnp.asarray, mnist.train_stream().next_batch(batch))
    keys = jaxaccum.per_example_keys(jax.random.key(0), batch)

    def grads(fn: Callable[..., Any], k: int, *args: Any) -> Any:
        return jax.jit(jaxaccum.value_and_grad(fn, num_microbatches=k))(params, *args)[1]

    reference = grads(loss, 1, (x, y, keys))
    per_example = max_abs_diff(grads(loss, k, (x, y, keys)), reference)

    def batch_key_loss(params: Any, batch: Any, key: jax.Array) -> jax.Array:
        bx, by = batch  # the usual way: one key per call, split over the examples it sees
        return loss(params, (bx, by, jax.random.split(key, bx.shape[0])))

    key = jax.random.key(0)
    batch_key = max_abs_diff(
        grads(batch_key_loss, k, (x, y), key), grads(batch_key_loss, 1, (x, y), key)
    )
    scale = float(max(jnp.max(jnp.abs(g)) for g in jax.tree.leaves(reference)))
    return {"per_example_keys": per_example, "batch_key": batch_key, "max_abs_grad": scale}


def dropout_batches(mnist: Mnist, steps: int, batch: int, dtype: Any = jnp.float32) -> Iterator:
    """The dropout runs' batches: images (cast to ``dtype``), labels, per-example keys."""
    stream, base = mnist.train_stream(), jax.random.key(42)
    for i in range(steps):
        x, y = stream.next_batch(batch)
        keys = jaxaccum.per_example_keys(jax.random.fold_in(base, i), batch)
        yield cast_floats(x, dtype), y, keys


def dropout_training(
    mnist: Mnist, steps: int, k: int = 64, batch: int = 64, lr: float = 0.5
) -> dict[str, Any]:
    """Trains the dropout MLP with k=1 and with k micro-batches; compares the final params.

    Both are also compared with the same full-batch training in float64 (plain ``jax.grad``,
    the same dropout masks): see :func:`compare_to_float64` for the criterion.
    """
    finals = {}
    for micro in (1, k):
        apply, params = dropout_model()
        optimizer = optax.sgd(lr)
        step = jaxaccum.train_step(dropout_loss(apply), optimizer, num_microbatches=micro)
        opt_state = optimizer.init(params)
        for x, y, keys in dropout_batches(mnist, steps, batch):
            params, opt_state, _, _ = step(params, opt_state, (x, y, keys))
        finals[micro] = (params, evaluate(apply, params, mnist.test_batches()))
    apply, params = dropout_model()
    with jax.enable_x64(True):
        ref = plain_trajectory(
            dropout_loss(apply),
            optax.sgd(lr),
            cast_floats(params, jnp.float64),
            dropout_batches(mnist, steps, batch, jnp.float64),
        )
        ref_eval = evaluate(apply, ref, mnist.test_batches())
        ref = jax.tree.map(np.asarray, ref)
    err = {micro: max_rel_diff(finals[micro][0], ref) for micro in (1, k)}
    bound = ROUNDING_FACTOR * err[1] + ROUNDING_FLOOR * EPS32
    return {
        "steps": steps,
        "k": k,
        "max_rel_param_diff": max_rel_diff(finals[k][0], finals[1][0]),
        "accuracy_k1": finals[1][1].accuracy,
        f"accuracy_k{k}": finals[k][1].accuracy,
        "accuracy_float64": ref_eval.accuracy,
        f"error_k{k}_vs_float64": err[k],
        "error_k1_vs_float64": err[1],
        "bound": bound,
        "within_rounding": bool(err[k] <= bound),
    }


OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "momentum": lambda: optax.sgd(LEARNING_RATE, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adagrad": lambda: optax.adagrad(0.05),
}


def optimizer_comparison(mnist: Mnist, steps: int, k: int = 64) -> dict[str, dict[str, Any]]:
    """(k, 1) vs (1, k) with stateful optimizers: accumulation happens before the optimizer.

    Each pair is also judged against the float64 full-batch run (:func:`compare_to_float64`).
    """
    out = {}
    for name, make in OPTIMIZERS.items():
        full = train(mnist, k, 1, steps, make())
        accumulated = train(mnist, 1, k, steps, make())
        out[name] = {
            "max_rel_param_diff": max_rel_diff(accumulated.params, full.params),
            "loss_mean_full": full.loss_mean,
            "loss_mean_accumulated": accumulated.loss_mean,
            "accuracy_full": full.accuracy,
            "accuracy_accumulated": accumulated.accuracy,
            **compare_to_float64(full, accumulated, reference_train(mnist, k, steps, make)),
        }
    return out


def timing(mnist: Mnist, rounds: int = 30) -> dict[str, float]:
    """Median time of one update on 64 examples, ways interleaved round by round."""
    apply, params = gist_model()
    loss = gist_loss(apply)
    optimizer = optax.sgd(LEARNING_RATE)
    steps = {
        k: jaxaccum.train_step(loss, optimizer, num_microbatches=k, has_aux=True, donate=False)
        for k in (1, 2, 64)
    }
    x, y = map(jnp.asarray, mnist.train_stream().next_batch(64))
    opt_state = optimizer.init(params)
    ways: dict[str, Callable[[], Any]] = {
        "batch 64": lambda: steps[1](params, opt_state, (x, y)),
        "2 batches of 32 (2 steps)": lambda: [
            steps[1](params, opt_state, (x[i : i + 32], y[i : i + 32])) for i in (0, 32)
        ],
        "64 as 2 micro-batches": lambda: steps[2](params, opt_state, (x, y)),
        "64 as 64 micro-batches": lambda: steps[64](params, opt_state, (x, y)),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds + 3):
        for name, fn in ways.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t[3:]) * 1e3 for name, t in times.items()}
    base = med["batch 64"]
    return {
        **{f"{n} [ms]": v for n, v in med.items()},
        **{f"{n} / batch 64": v / base for n, v in med.items() if n != "batch 64"},
    }


# --- the command ---------------------------------------------------------------------------


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str], Callable[[], None]]]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description:<34}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task("", total=total)

        def stage(description: str) -> Callable[[], None]:
            bar.update(task, description=description)
            return lambda: bar.advance(task)

        yield stage


def plot(results: list[TrainResult], path: pathlib.Path) -> None:
    """The training losses per example seen; (B, 1) and (1, B) drawn so that both show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    style: dict[str, Any]
    for r in results:
        per = r.batch * r.microbatches
        examples = np.arange(1, len(r.train_losses) + 1) * per
        losses = np.asarray(r.train_losses)
        if per == 1:  # single examples are noisy: a running mean over up to 64 steps
            window = min(64, len(losses))
            losses = np.convolve(losses, np.ones(window) / window, mode="valid")
            examples = examples[window - 1 :]
            style = dict(color="tab:green", linewidth=1.2)
            label = f"{r.name}: 1 example per step, running mean over {window} steps"
        elif r.microbatches == 1:  # wide and pale, circles: the curve drawn over it shows through
            every = max(1, len(losses) // 12)
            style = dict(
                color="tab:blue",
                linewidth=6,
                alpha=0.35,
                marker="o",
                markersize=9,
                markevery=(0, every),
                markerfacecolor="none",
                markeredgewidth=1.5,
            )
            label = f"{r.name}: one batch of {per} per step"
        else:  # thin dashed, crosses between the circles
            every = max(1, len(losses) // 12)
            style = dict(
                color="tab:orange",
                linewidth=1.5,
                linestyle="--",
                marker="x",
                markersize=7,
                markevery=(every // 2, every),
            )
            label = f"{r.name}: {r.microbatches} accumulated micro-batches of {r.batch} per step"
        ax.plot(examples, losses, label=label, **style)
    ax.set_xlabel("training examples seen")
    ax.set_ylabel("training loss (MSE)")
    ax.set_title("GistMLP on MNIST: accumulation reproduces the big batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class DataUnavailable(Exception):
    """MNIST could not be loaded; the message says why in one line."""


def load(args: argparse.Namespace) -> Mnist:
    """MNIST for the command: a missing or bad data source becomes :class:`DataUnavailable`."""
    try:
        return Mnist.load(args.data_dir, args.manual_dir)
    except data.MnistDownloadError as e:
        raise DataUnavailable(str(e)) from e
    except ValueError as e:  # a manual dir without the files, a file with the wrong checksum
        raise DataUnavailable(str(e).splitlines()[0]) from e


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tensorflow_datasets as tfds
    from rich.console import Console
    from rich.table import Table

    tfds.disable_progress_bar()
    console = Console(width=120)
    with console.status("loading MNIST through tensorflow-datasets"):
        mnist = load(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    k = args.microbatches
    configs = [(k, 1, args.steps), (1, k, args.steps), (1, 1, args.steps * k)]
    total = sum(s for _, _, s in configs)
    results: dict[str, Any] = {"config": vars(args)}
    with _progress(total) as stage:
        checks = {
            "1 gradient tree matches params": check_gradient_structure(mnist),
            "2 re-init max abs diff": check_reinit(),
            "3 stream independent of batch size": check_stream(mnist),
            "4 accumulated vs full, max abs diff": {
                str(n): v for n, v in check_accumulation(mnist).items()
            },
        }
        runs = [
            train(mnist, b, m, s, progress=stage(f"training ({b}, {m})")) for b, m, s in configs
        ]
    a, b, c = runs
    results["checks"] = checks
    results["training"] = [r.row() for r in runs]
    with console.status("float64 reference, dropout, optimizers, timing"):
        results["float64_reference"] = {
            "max_rel_param_diff": max_rel_diff(b.params, a.params),
            **compare_to_float64(a, b, reference_train(mnist, k, args.steps)),
        }
        results["dropout_gradients"] = dropout_gradients(mnist, k)
        results["dropout_training"] = dropout_training(mnist, args.dropout_steps, k)
        results["optimizers"] = optimizer_comparison(mnist, args.steps, k)
        results["timing"] = timing(mnist)
    results["equivalent"] = bool(
        a.hash_host == b.hash_host and results["float64_reference"]["within_rounding"]
    )
    results["differs_without_accumulation"] = bool(
        abs(c.loss_mean - a.loss_mean) > 1e-6 or c.accuracy != a.accuracy
    )

    for name, value in checks.items():
        console.print(f"check {name}: {value}")
    table = Table(title=f"GistMLP on MNIST, {args.steps} optimizer steps of {k} examples")
    for col in (
        "(batch, micro)",
        "steps",
        "accuracy",
        "loss mean",
        "loss std",
        "hash (host)",
        "hash (device)",
        "time [s]",
    ):
        table.add_column(col, justify="right")
    for r in runs:
        table.add_row(
            r.name,
            str(r.steps),
            f"{r.accuracy:.6f}",
            f"{r.loss_mean:.6f}",
            f"{r.loss_std:.6f}",
            f"{r.hash_host:.2f}",
            f"{r.hash_device:.2f}",
            f"{r.seconds:.2f}",
        )
    console.print(table)
    console.print(
        f"({k}, 1) and (1, {k}) equivalent: {results['equivalent']}; "
        f"(1, 1) differs: {results['differs_without_accumulation']}"
    )
    console.print(
        f"error vs float64 (max |p - p64| / max |p64|): "
        f"criterion ({k}, 1) x {ROUNDING_FACTOR:g} + {ROUNDING_FLOOR:g} eps32 >= (1, {k})"
    )
    for name, row in [
        ("sgd", results["float64_reference"]),
        *results["optimizers"].items(),
    ]:
        console.print(
            f"  {name}: ({k}, 1) {row['error_full_vs_float64']:.2e}, (1, {k}) "
            f"{row['error_accumulated_vs_float64']:.2e}, bound {row['bound']:.2e}; "
            f"(1, {k}) vs ({k}, 1) {row['max_rel_param_diff']:.2e}; within: "
            f"{row['within_rounding']}"
        )
    console.print(f"dropout gradients, k=1 vs k={k}: {results['dropout_gradients']}")
    console.print(f"dropout training: {results['dropout_training']}")
    console.print(
        "timing (median ms, ratios):", {n: round(v, 3) for n, v in results["timing"].items()}
    )
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    plot(runs, out / "loss_curves.png")
    console.print(f"wrote {out / 'results.json'} and {out / 'loss_curves.png'}")
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxaccum-gist", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per configuration")
    p.add_argument("--microbatches", type=int, default=64, help="k, examples per step (64)")
    p.add_argument("--dropout-steps", type=int, default=400, help="dropout training steps")
    p.add_argument(
        "--out",
        default="results",
        help="output folder for results.json and loss_curves.png (default: ./results)",
    )
    data.add_arguments(p)  # --data-dir, --manual-dir
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("steps", "microbatches", "dropout_steps"):
        if getattr(args, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    try:
        results = run(args)
    except DataUnavailable as e:
        print(f"jaxaccum-gist: {e}", file=sys.stderr)
        return 2
    return 0 if results["equivalent"] and results["differs_without_accumulation"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
