"""Shared strategies and plain models for the packer's tests (tests/test_packing.py,
tests/test_grain.py): the options every documented value of which is drawn, corpora with the
edge lengths (1 token, exactly ``length``), and :func:`stream_model`, pack_stream's docstring
written as the plainest code (no buckets, no binary search)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from hypothesis import strategies as st

LENGTH_MAX = 10


def stream_options(length_max: int = LENGTH_MAX) -> st.SearchStrategy[dict[str, Any]]:
    """pack_stream's options, each over its documented domain at small sizes: ``rows``,
    ``length``, ``max_microbatches`` and ``lookahead`` >= 1 (1 included: one row, one token,
    one micro-batch, arrival order), ``pad_id`` any int (negative, 0, positive, and equal to a
    real token id: the tokens are drawn from 0..12)."""
    return st.fixed_dictionaries({
        "rows": st.integers(1, 3), "length": st.integers(1, length_max),
        "max_microbatches": st.integers(1, 3), "lookahead": st.integers(1, 6),
        "pad_id": st.sampled_from([0, -1, 3, 7, 2**31 - 1])})


def lengths_for(length: int, max_size: int = 24) -> st.SearchStrategy[list[int]]:
    """Sequence lengths in 1..length, drawn so that 1 and ``length`` are frequent, mixed with
    the others; from none (an empty corpus) to ``max_size``."""
    edge = st.sampled_from(sorted({1, length}))
    return st.lists(st.one_of(edge, st.integers(1, length)), max_size=max_size)


def corpus(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    """Token sequences of these lengths, ids in 0..12 (so 0, 3 and 7 are real tokens too)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 13, size=n).astype(np.int32) for n in lengths]


def stream_model(lengths: list[int], *, rows: int, length: int, max_microbatches: int,
                 lookahead: int, **_: Any) -> list[tuple[list[int], int]]:
    """pack_stream's docstring as plain code: for each step, the arrival indices of its
    sequences in the order placed and the number of rows it opened.

    "Each step takes sequences in order of arrival and puts each in the row with the least
    free space that holds it (best fit), opening rows up to max_microbatches * rows. A
    sequence that fits nowhere waits in a buffer of lookahead sequences while later ones are
    tried; the step ends when every buffered sequence has failed (or the stream ran dry). The
    sequences left wait for the next step, which tries them first."

    Which of several rows with the same free space takes a sequence is left open by the
    docstring; it changes neither the free spaces left (a multiset) nor so what fits next, so
    the model's steps are the implementation's whatever it picks.
    """
    waiting: list[int] = []
    arrived, steps = 0, []
    while True:
        free: list[int] = []  # the free space of each row opened, in order
        placed: list[int] = []
        i = 0
        while True:
            while len(waiting) < lookahead and arrived < len(lengths):
                waiting.append(arrived)
                arrived += 1
            if i >= len(waiting):
                break
            size = lengths[waiting[i]]
            fits = [r for r, f in enumerate(free) if f >= size]
            if fits:
                free[min(fits, key=lambda r: free[r])] -= size
            elif len(free) < max_microbatches * rows:
                free.append(length - size)
            else:
                i += 1
                continue
            placed.append(waiting.pop(i))
        if not placed:
            return steps
        steps.append((placed, len(free)))


class Seekable(Iterator[Any]):
    """A list read as an iterator that can be moved (``seek``) and counts what was read:
    a source that a restored packer can be put back on, as Grain restores a parent."""

    def __init__(self, items: list[Any]) -> None:
        self.items, self.position, self.reads = items, 0, 0

    def seek(self, position: int) -> None:
        self.position = position

    def __next__(self) -> Any:
        self.reads += 1
        if self.position >= len(self.items):
            raise StopIteration
        self.position += 1
        return self.items[self.position - 1]
