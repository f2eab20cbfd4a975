"""Argument checks shared by the public functions.

Every check raises a ``ValueError`` or ``TypeError`` whose message names the argument, what was
expected and what was received. They run at construction or trace time, never on device.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def positive_int(value: Any, name: str, entry: str | None = None) -> int:
    """Returns ``value`` as an ``int`` if it is a Python/NumPy integer >= 1."""
    where = f"{entry}: " if entry else ""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{where}{name} must be a positive int; got {value!r} of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(f"{where}{name} must be >= 1; got {name}={value}; pass a positive "
                         "count (1 is the plain full batch)")
    return int(value)


def exactly_one_count(
    num_microbatches: Any, microbatch_size: Any, entry: str, max_microbatches: Any = None,
    runtime_count: bool = True,
) -> None:
    """Checks that exactly one of the micro-batch counts is given, and that it is valid
    (``runtime_count``: ``entry`` takes ``max_microbatches``, so the message suggests it)."""
    given = [x is not None for x in (num_microbatches, microbatch_size, max_microbatches)]
    if sum(given) != 1:
        runtime = "" if not runtime_count else (
            " (or max_microbatches, for a count known at run time)")
        got = f"num_microbatches={num_microbatches!r}, microbatch_size={microbatch_size!r}"
        if runtime_count:
            got += f", max_microbatches={max_microbatches!r}"
        raise ValueError(
            f"{entry}: exactly one of num_microbatches and microbatch_size{runtime} must be "
            f"given; got {got}; pass one of them (num_microbatches=4 splits the batch into 4 "
            "micro-batches)"
        )
    if num_microbatches is not None:
        positive_int(num_microbatches, "num_microbatches", entry)
    if microbatch_size is not None:
        positive_int(microbatch_size, "microbatch_size", entry)
    if max_microbatches is not None:
        positive_int(max_microbatches, "max_microbatches", entry)


def resolve_num_microbatches(
    batch_size: int,
    num_microbatches: int | None,
    microbatch_size: int | None,
    entry: str = "jaxaccum",
    devices: int = 1,
    weights: bool = True,
) -> int:
    """Returns k, checking that it splits ``batch_size`` (per device) into equal micro-batches.

    ``batch_size`` is the per-device batch size on a mesh of ``devices`` data-parallel devices;
    the message then says so. ``weights``: ``entry`` takes ``weighted=True``, so the message
    suggests it.
    """
    where = (
        f"the per-device batch size {batch_size} (the batch of {batch_size * devices} over "
        f"{devices} devices: on a mesh k and microbatch_size are per device)"
        if devices > 1
        else f"the batch size {batch_size}"
    )
    pad = ("pad the batch and use weighted=True" if weights
           else "pad the batch and mask the padded examples inside the loss")
    if num_microbatches is not None:
        if batch_size % num_microbatches:
            raise ValueError(
                f"{entry}: num_microbatches={num_microbatches} does not divide {where}; choose "
                f"a divisor of {batch_size} or {pad}"
            )
        return num_microbatches
    assert microbatch_size is not None
    if batch_size % microbatch_size:
        raise ValueError(
            f"{entry}: microbatch_size={microbatch_size} does not divide {where}; choose a "
            f"divisor of {batch_size} or {pad}"
        )
    return batch_size // microbatch_size


def argnums_tuple(value: Any, name: str) -> tuple[int, ...]:
    """Normalises an ``int`` or sequence of ints (like ``jax.grad``'s ``argnums``)."""
    items: Sequence[Any] = value if isinstance(value, (tuple, list)) else (value,)
    try:
        out = tuple(operator.index(i) for i in items)
    except TypeError:
        raise TypeError(f"{name} must be an int or a tuple of ints; got {value!r}") from None
    if not out:
        raise ValueError(f"{name} must name at least one argument; got {value!r}")
    if any(i < 0 for i in out):
        raise ValueError(f"{name} must be non-negative; got {value!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat an index; got {value!r}")
    return out


def leading_batch_size(
    args: Sequence[Any], batch_argnums: tuple[int, ...], entry: str = "jaxaccum"
) -> int:
    """Returns the common leading-axis size of every leaf of the batch arguments."""
    sizes: dict[str, int] = {}
    for i in batch_argnums:
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            where = f"argument {i}{jax.tree_util.keystr(path)}"
            shape = np.shape(leaf)
            if not shape:
                raise ValueError(
                    f"{entry}: every leaf of a batch argument (batch_argnums={batch_argnums}) "
                    f"needs a leading batch axis; {where} is a scalar (pass a value shared by "
                    "every example as another argument, or by keyword: keywords are passed whole)"
                )
            sizes[where] = shape[0]
    if not sizes:
        raise ValueError(
            f"{entry}: batch_argnums={batch_argnums}: the batch arguments hold no array leaves"
        )
    distinct = set(sizes.values())
    if len(distinct) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(
            f"{entry}: the leaves of the batch arguments (batch_argnums={batch_argnums}) must "
            f"share one leading batch size; got {listing}; give every per-example leaf the "
            "batch's length, and pass values shared by every example as another argument"
        )
    (size,) = distinct
    if size == 0:
        raise ValueError(f"{entry}: the batch is empty (leading batch size 0); skip empty "
                         "batches before the step, or use max_microbatches=K with a count of 0")
    return int(size)


def scalar(value: Any, what: str, *, floating: bool) -> None:
    """Checks that an (abstract) value is a scalar (of a floating dtype when ``floating``)."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        hint = ""
        if isinstance(value, (tuple, list)) and len(value) == 2:
            hint = ("; a pair means (loss, aux) or (loss, weight): pass has_aux=True (or a "
                    "reduction such as has_aux='concat') for an aux, weighted=True for a weight")
        shown = jax.tree.map(lambda x: f"{x.dtype}{list(x.shape)}" if hasattr(x, "shape")
                             else x, value)  # (abstract values: no repr of their sharding)
        raise TypeError(
            f"{what} must be a scalar array; got {type(value).__name__}: "
            f"{repr(shown).replace(chr(39), '')}{hint}"
        )
    if shape != ():
        raise ValueError(
            f"{what} must be a scalar (the mean over the micro-batch); got shape {shape}; "
            "return its mean (jnp.mean), and per-example values as an aux (has_aux='concat')"
        )
    kinds = (jnp.floating,) if floating else (jnp.floating, jnp.integer, jnp.bool_)
    if not any(jnp.issubdtype(dtype, kind) for kind in kinds):
        expected = "a floating dtype" if floating else "a real dtype"
        raise TypeError(f"{what} must have {expected}; got dtype {dtype}")


def floating_leaves(tree: Any, what: str, why: str) -> None:
    """Checks that every leaf of ``tree`` has a floating (or complex) dtype, naming the leaf."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"{what}: leaf {jax.tree_util.keystr(path) or '.'} has dtype {dtype}; {why}"
            )


def same_structure(old: Any, new: Any, what: str) -> None:
    """Checks that ``new`` has the tree structure, shapes and dtypes of ``old``, naming both."""

    def describe(tree: Any) -> str:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        parts = [
            f"{jax.tree_util.keystr(p) or '.'}: {jnp.result_type(x)}{list(np.shape(x))}"
            for p, x in leaves
        ]
        return f"{jax.tree.structure(tree)} with leaves {{{', '.join(parts)}}}"

    if str(jax.tree.structure(old)) != str(jax.tree.structure(new)):
        raise TypeError(
            f"{what}: fun must return the carried value with the structure it came in with; "
            f"came in as {describe(old)}, came back as {describe(new)}"
        )
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(old)[0], jax.tree.leaves(new),
                            strict=True):
        if np.shape(a) != np.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise TypeError(
                f"{what}: leaf {jax.tree_util.keystr(path) or '.'} came in as "
                f"{jnp.result_type(a)}{list(np.shape(a))} and came back as "
                f"{jnp.result_type(b)}{list(np.shape(b))}; came in as {describe(old)}, came "
                f"back as {describe(new)}"
            )
