"""Variants of the library for the loop study and the memory probe, made by patching it.

To measure "the library with one thing changed" (its micro-batches split before the loop, its
zero-weight skip always a select) these studies swap private
module-level functions of ``jaxaccum`` while a program is traced. That depends on names that
are not API, so every patch is checked: :func:`check` fails loudly if a patched name is gone,
and each variant fails if the library never called the replacement while tracing (a variant
that silently measured the library itself). The names patched, as of ``jaxaccum/_pipeline.py``:

- ``_pipeline.split(acc, args, k)`` / ``_pipeline.take(views, i)``: the split stage (a free
  ``(B/k, k, ...)`` view) and the gather of micro-batch ``i`` inside the loop;
- ``_reductions.step_unless_empty(total, step, old, *, donated)``: ``train_step``'s
  zero-weight skip (a ``lax.cond`` with donation, a select without).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _pipeline, _reductions

PATCHED = {
    (_pipeline, "split"): ["acc", "args", "k"],
    (_pipeline, "take"): ["views", "i"],
    (_reductions, "step_unless_empty"): ["total", "step", "old", "donated"],
    (_reductions, "unless_empty"): ["total", "old", "new"],
}


def check() -> None:
    """Raises if a function these variants patch is gone or has another signature."""
    for (module, name), params in PATCHED.items():
        fn = getattr(module, name, None)
        if fn is None or list(inspect.signature(fn).parameters) != params:
            raise RuntimeError(
                f"benchmarks/_variants.py patches {module.__name__}.{name}({', '.join(params)}),"
                " which the library no longer has: update the variants to the library's"
                " pipeline (or drop them) before measuring"
            )


class _Used:
    """Whether the library called a replacement while tracing."""

    def __init__(self) -> None:
        self.called: set[str] = set()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.called.add(name)
            return fn(*args, **kwargs)

        return wrapped

    def require(self, *names: str) -> None:
        missing = [n for n in names if n not in self.called]
        if missing:
            raise RuntimeError(
                f"the library never called the patched {', '.join(missing)} while tracing: "
                "this variant would measure the library itself (was the program traced "
                "inside the context, and does the pipeline still call these?)"
            )


def _split_before(split: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(``split``, ``take``) for micro-batches cut before the loop: ``swapaxes`` is a4b2f71^'s
    strided split (a transposed copy of the batch), ``contiguous`` cuts blocks (a free view);
    the loop then indexes the leading axis."""

    def view(x: Any, k: int) -> jax.Array:
        x = jnp.asarray(x)
        if split == "swapaxes":
            return jnp.swapaxes(x.reshape((x.shape[0] // k, k, *x.shape[1:])), 0, 1)
        return x.reshape((k, x.shape[0] // k, *x.shape[1:]))

    def split_fn(acc: Any, args: Any, k: int) -> tuple[Any, ...]:
        return tuple(jax.tree.map(lambda x: view(x, k), b) for b in acc.batch(args))

    def take(views: Any, i: Any) -> Any:
        return jax.tree.map(
            lambda v: jax.lax.dynamic_index_in_dim(v, i, axis=0, keepdims=False), views
        )

    return split_fn, take


@contextlib.contextmanager
def variant(split: str = "gather") -> Iterator[None]:
    """While tracing: the library with its micro-batches gathered inside the loop (``gather``:
    the library itself, nothing patched), split before the loop by a transposed copy as
    a4b2f71^ did (``swapaxes``), or cut into contiguous blocks (``contiguous``). Trace (lower)
    the program inside the context."""
    if split not in ("gather", "swapaxes", "contiguous"):
        raise ValueError(f"variant: split={split!r}; expected gather, swapaxes or contiguous")
    check()
    if split == "gather":
        yield
        return
    original = (_pipeline.split, _pipeline.take)
    used = _Used()
    split_fn, take = _split_before(split)
    _pipeline.split = used.wrap("_pipeline.split", split_fn)
    _pipeline.take = used.wrap("_pipeline.take", take)
    try:
        yield
    finally:
        _pipeline.split, _pipeline.take = original
    used.require("_pipeline.split", "_pipeline.take")


@contextlib.contextmanager
def skip_always_select() -> Iterator[None]:
    """While tracing: ``train_step``'s zero-weight skip always a select between the old and the
    new state (as before f62b962), never the ``lax.cond`` the library makes with donation."""
    check()
    original = _reductions.step_unless_empty
    used = _Used()

    def select(total: Any, step: Any, old: Any, *, donated: bool) -> Any:
        return _reductions.unless_empty(total, old, step(old))

    _reductions.step_unless_empty = used.wrap("_reductions.step_unless_empty", select)
    try:
        yield
    finally:
        _reductions.step_unless_empty = original
    used.require("_reductions.step_unless_empty")
