"""What the benchmarks share: the two models and one optimizer step per implementation.

Every implementation performs the same optimizer step: the gradient of the mean loss over a
batch of B examples, split into k micro-batches where it splits, then one SGD update.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum
from jaxaccum.experiment import models

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
KS = (1, 2, 4, 8, 16, 32, 64)
LR = 1e-2


@dataclass(frozen=True)
class Model:
    """An MLP benchmark configuration."""

    name: str
    sizes: tuple[int, ...]
    batch: int

    def params(self) -> list[tuple[jax.Array, jax.Array]]:
        keys = jax.random.split(jax.random.key(0), len(self.sizes) - 1)
        return [
            (jax.random.uniform(k, (m, n), minval=-0.025, maxval=0.025), jnp.zeros(n))
            for k, m, n in zip(keys, self.sizes[:-1], self.sizes[1:], strict=True)
        ]

    def data(self) -> tuple[jax.Array, jax.Array]:
        kx, ky = jax.random.split(jax.random.key(1))
        x = jax.random.uniform(kx, (self.batch, self.sizes[0]))
        y = jax.random.randint(ky, (self.batch,), 0, self.sizes[-1])
        return x, y

    def param_bytes(self) -> int:
        return sum(m * n * 4 + n * 4 for m, n in zip(self.sizes[:-1], self.sizes[1:], strict=True))


GIST = Model("gist MLP 784-100-10, batch 64", (784, 100, 10), 64)
COMPUTE = Model("MLP 784-512x4-10, batch 8192", (784, 512, 512, 512, 512, 10), 8192)
MODELS = {"gist": GIST, "compute": COMPUTE}


def loss(params: list[tuple[jax.Array, jax.Array]], batch: tuple[jax.Array, jax.Array]) -> Any:
    x, y = batch
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return models.mse_one_hot(x @ w + b, y, num_classes=w.shape[1])


def apply_update(optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    def apply(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return apply


def split(batch: Any, k: int) -> list[Any]:
    m = jax.tree.leaves(batch)[0].shape[0] // k
    return [jax.tree.map(lambda x, i=i: x[i * m : (i + 1) * m], batch) for i in range(k)]


class Impl:
    """One way to make an optimizer step over a batch split into k micro-batches.

    ``step(params, state, batch) -> (params, state, ...)`` runs it (``batch`` is already split
    for per-call ways, which donate ``params`` and ``state``: thread the outputs through);
    ``lower(...)`` lowers the program XLA runs (the per-call program for per-call ways).
    """

    per_call = False
    name = ""
    fn: Any = None

    def __init__(self, k: int) -> None:
        self.k = k
        self.optimizer = optax.sgd(LR)

    def init(self, params: Any) -> Any:
        return self.optimizer.init(params)

    def prepare(self, batch: Any) -> Any:
        return split(batch, self.k) if self.per_call else batch

    # single-program ways: self.fn is the jitted step
    def step(self, params: Any, state: Any, batch: Any) -> Any:
        return self.fn(params, state, batch)

    def lower(self, params: Any, state: Any, batch: Any) -> Any:
        return self.fn.lower(params, state, batch)


class Full(Impl):
    name = "full batch"

    def __init__(self, k: int) -> None:
        super().__init__(k)
        update = apply_update(self.optimizer)
        self.fn = jax.jit(lambda p, s, b: update(p, s, jax.grad(loss)(p, b)))


class TrainStep(Impl):
    name = "jaxaccum.train_step"

    def __init__(self, k: int, **kwargs: Any) -> None:
        super().__init__(k)
        self.fn = jaxaccum.train_step(
            loss, self.optimizer, num_microbatches=k, donate=False, **kwargs
        )


class Microbatching(Impl):
    name = "optax.microbatching"

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self._k = k
        update = apply_update(self.optimizer)

        def step(params: Any, state: Any, batch: Any) -> Any:
            size = jax.tree.leaves(batch)[0].shape[0] // self._k
            grad = optax.microbatching.microbatch(
                jax.grad(loss),
                argnums=1,
                microbatch_size=size,
                accumulator=optax.microbatching.AccumulationType.MEAN,
            )
            return update(params, state, grad(params, batch))

        self.fn = jax.jit(step)


class _PerCall(Impl):
    """Feeds one micro-batch per jitted call to an accumulating optax transform.

    Params and state are donated to each call, as a training loop would do.
    """

    per_call = True

    def __init__(self, k: int, optimizer: optax.GradientTransformation) -> None:
        super().__init__(k)
        self.optimizer = optimizer
        update = apply_update(optimizer)
        self.fn = jax.jit(lambda p, s, b: update(p, s, jax.grad(loss)(p, b)), donate_argnums=(0, 1))

    def step(self, params: Any, state: Any, micro_batches: Any) -> Any:
        for micro in micro_batches:
            params, state = self.fn(params, state, micro)
        return params, state

    def lower(self, params: Any, state: Any, micro_batches: Any) -> Any:
        return self.fn.lower(params, state, micro_batches[0])


class MultiSteps(_PerCall):
    name = "jaxaccum.multi_steps"

    def __init__(self, k: int) -> None:
        super().__init__(k, jaxaccum.multi_steps(optax.sgd(LR), k))


class OptaxMultiSteps(_PerCall):
    name = "optax.MultiSteps"

    def __init__(self, k: int) -> None:
        super().__init__(k, optax.MultiSteps(optax.sgd(LR), k).gradient_transformation())


class NaiveLoop(Impl):
    """k jitted gradient calls, a Python-side tree sum, one jitted update."""

    name = "naive Python loop"
    per_call = True

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.grad = jax.jit(jax.grad(loss))
        self.update = jax.jit(apply_update(self.optimizer))

    def step(self, params: Any, state: Any, micro_batches: Any) -> Any:
        total = None
        for micro in micro_batches:
            g = self.grad(params, micro)
            total = g if total is None else jax.tree.map(jnp.add, total, g)
        return self.update(params, state, jax.tree.map(lambda t: t / len(micro_batches), total))

    def lower(self, params: Any, state: Any, micro_batches: Any) -> Any:
        return self.grad.lower(params, micro_batches[0])


IMPLS: dict[str, type[Impl]] = {
    cls.name: cls
    for cls in (Full, TrainStep, MultiSteps, OptaxMultiSteps, Microbatching, NaiveLoop)
}


def machine() -> dict[str, Any]:
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "optax": optax.__version__,
        "processor": platform.processor() or platform.machine(),
        "cpu_count": __import__("os").cpu_count(),
    }


def result_path(name: str, ext: str) -> pathlib.Path:
    """``results/NAME.EXT`` on CPU, ``results/NAME-BACKEND.EXT`` elsewhere (e.g. ``-gpu``);
    ``results/NAME-SUFFIX.EXT`` when the environment sets ``BENCH_RESULTS_SUFFIX`` (a dry run
    of benchmarks/gpu.sh on CPU, say, that must not overwrite the CPU results)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    backend = os.environ.get("BENCH_RESULTS_SUFFIX") or jax.default_backend()
    return RESULTS / (f"{name}.{ext}" if backend == "cpu" else f"{name}-{backend}.{ext}")


def save(name: str, payload: dict[str, Any]) -> pathlib.Path:
    path = result_path(name, "json")
    path.write_text(json.dumps(payload, indent=2, default=_default))
    return path


def _default(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return str(value)


def plot_by_k(
    entries: dict[str, Any],
    series: Callable[[dict[str, Any], list[int]], list[tuple[str, list[int], list[float], str]]],
    ylabel: str,
    path: pathlib.Path,
) -> None:
    """One log-log panel per model: ``series(entry, ks)`` gives (label, ks, values, style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(entries), figsize=(6 * len(entries), 4), squeeze=False)
    for ax, entry in zip(axes[0], entries.values(), strict=True):
        ks = sorted(int(k) for k in entry["by_k"])
        for label, xs, ys, style in series(entry, ks):
            ax.plot(xs, ys, style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("k (micro-batches per optimizer step)")
        ax.set_ylabel(ylabel)
        ax.set_title(entry["name"])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
