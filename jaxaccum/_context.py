"""What a jaxaccum step tells the ops in its loss while the loss is traced: the mesh axes its
batch is split over, manual there (an Auto mesh's ``shard_map``). An op that splits something
else over a named axis (``linear_cross_entropy(axis_name=...)``) refuses those axes: every
device of them holds other tokens, and the step's ``shard_map`` does not type them so
(``check_vma=False``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_active = threading.local()


@contextlib.contextmanager
def data_axes(axes: tuple[str, ...]) -> Iterator[None]:
    """The batch is split over ``axes`` for the loss traced inside the ``with``."""
    before = getattr(_active, "axes", ())
    _active.axes = (*before, *axes)
    try:
        yield
    finally:
        _active.axes = before


def split_data_axes() -> tuple[str, ...]:
    """The axes the running step splits its batch over (none outside a step's trace)."""
    return getattr(_active, "axes", ())  # type: ignore[no-any-return]
