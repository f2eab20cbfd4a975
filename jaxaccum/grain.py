"""jaxaccum's packer inside a Grain pipeline: ``import jaxaccum.grain``.

This module imports `grain` (``pip install 'jaxaccum[grain]'``; the rest of jaxaccum does not).
:class:`PackIterDataset` packs a Grain ``IterDataset`` of token sequences into the steps of a
``max_microbatches`` step, as :func:`jaxaccum.packing.pack_stream` does, and its iterator saves
and restores its position the way every Grain iterator does (``get_state`` / ``set_state``, so
Grain's own checkpointing and ``orbax`` handle it): a job restarted mid-epoch neither loses
nor repeats a sequence. :func:`to_microbatches` turns a packed batch, jaxaccum's or one of
Grain's own packers', into the :class:`jaxaccum.Microbatches` such a step takes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from jaxaccum import _microbatches, _validation, packing
from jaxaccum.packing import _layout

__all__ = ["PackIterDataset", "to_microbatches"]

PACK = "jaxaccum.grain.PackIterDataset"
TO_MICROBATCHES = "jaxaccum.grain.to_microbatches"


class PackIterDataset(grain.IterDataset):
    """Packs a dataset of sequences into steps of at most ``max_microbatches`` micro-batches.

    The packing is :func:`jaxaccum.packing.pack_stream`'s (best fit in order of arrival, a
    ``lookahead`` of waiting sequences, none waits more than one step), and so is every
    element: a :class:`jaxaccum.packing.Packed` of shape ``(max_microbatches, rows, length)``
    whose ``sequence_index`` counts the parent's elements from 0 (from the start of the
    iteration, not of the dataset).

    The iterator's state is its parent's plus the packer's (the number of elements read and
    the sequences read but not yet packed: at most ``lookahead``), plain ints and lists: the
    elements after a ``set_state`` are bitwise those the uninterrupted iterator yields. A
    state saved at any point (after the end too: nothing follows it) restores into any
    iterator of the same dataset, a fresh one or one that ran on or to its end.

    Args:
      parent: a Grain ``IterDataset`` (or a ``MapDataset``, turned into one) of sequences:
        each element a 1-D integer array of 1 to ``length`` tokens, or a mapping holding one
        under ``key``.
      rows: the rows in a micro-batch.
      length: the tokens in a row.
      max_microbatches: M, the micro-batches in every element.
      lookahead: how many sequences may wait to be placed (>= 1).
      pad_id: the token id of padding.
      key: with mapping elements, the key of the token ids (e.g. ``"tokens"``); ``None`` for
        elements that are the token ids themselves.

    Raises:
      ValueError: ``rows``, ``length``, ``max_microbatches`` or ``lookahead`` < 1; while
        iterating, a sequence longer than ``length``, empty or not 1-D (named by its index
        among the parent's elements, ``parent[i]``).
      TypeError: ``parent`` not a Grain dataset, a count or ``pad_id`` not an int, ``key`` not
        a string; while iterating, an element that is not a mapping when ``key`` is given, or
        a sequence not of integers.
      KeyError: while iterating, a mapping element without ``key``.

    Examples:
      >>> import grain, numpy as np
      >>> from jaxaccum.grain import PackIterDataset
      >>> docs = grain.MapDataset.source([np.arange(1, n + 1) for n in [3, 4, 2, 5, 1]])
      >>> steps = PackIterDataset(docs, rows=1, length=5, max_microbatches=2)
      >>> [p.num_microbatches for p in steps]
      [2, 1]
    """

    def __init__(self, parent: grain.IterDataset | grain.MapDataset, *, rows: int, length: int,
                 max_microbatches: int, lookahead: int = 32, pad_id: int = 0,
                 key: str | None = None) -> None:
        if isinstance(parent, grain.MapDataset):
            parent = parent.to_iter_dataset()
        if not isinstance(parent, grain.IterDataset):
            raise TypeError(
                f"{PACK}: parent must be a grain.IterDataset or grain.MapDataset; got "
                f"{type(parent).__name__} (for a plain iterable, use "
                "jaxaccum.packing.pack_stream)"
            )
        if key is not None and not isinstance(key, str):
            raise TypeError(f"{PACK}: key must be a string or None; got {key!r}")
        super().__init__(parent)
        # checked now, naming this entry point (the parent is not read until iterated)
        self._options = {
            "rows": _validation.positive_int(rows, "rows", PACK),
            "length": _validation.positive_int(length, "length", PACK),
            "max_microbatches": _validation.positive_int(max_microbatches, "max_microbatches",
                                                         PACK),
            "lookahead": _validation.positive_int(lookahead, "lookahead", PACK),
            "pad_id": _layout._pad_id(PACK, pad_id)}
        self._key = key

    def __iter__(self) -> _PackDatasetIterator:
        return _PackDatasetIterator(self._parent.__iter__(), self._options, self._key)

    def __str__(self) -> str:
        options = ", ".join(f"{name}={value}" for name, value in self._options.items())
        return f"PackIterDataset({options}, key={self._key!r})"


class _Sequences(Iterator[Any]):
    """The parent iterator's elements as token sequences; it holds no position of its own, so
    restoring the parent's state restores it."""

    def __init__(self, parent: grain.DatasetIterator, key: str | None) -> None:
        self._parent, self._key = parent, key

    def __next__(self) -> Any:
        element = next(self._parent)
        if self._key is None:
            return element
        if not isinstance(element, Mapping):
            raise TypeError(
                f"{PACK}: key={self._key!r} needs mapping elements; got "
                f"{type(element).__name__} (give key=None for elements that are token ids)"
            )
        if self._key not in element:
            raise KeyError(
                f"{PACK}: key={self._key!r}: an element of the parent has no such key; its "
                f"keys are {sorted(map(str, element))} (name the token ids' key with key=)"
            )
        return element[self._key]


class _PackDatasetIterator(grain.DatasetIterator):
    """:class:`PackIterDataset`'s iterator: a :class:`jaxaccum.packing.PackStream` reading
    the parent iterator, with the state of both."""

    def __init__(self, parent: grain.DatasetIterator, options: dict[str, Any],
                 key: str | None) -> None:
        super().__init__(parent)
        # errors name this entry point, and a sequence by its index among the parent's
        # elements (counted from the start of the iteration)
        self._stream = packing.PackStream(
            _Sequences(parent, key), options["rows"], options["length"],
            options["max_microbatches"], options["lookahead"], options["pad_id"], entry=PACK,
            name="parent")

    def __next__(self) -> packing.Packed:
        return next(self._stream)

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent.get_state(), "packer": self._stream.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._stream.set_state(state["packer"])


def to_microbatches(batch: Any, *, rows: int | None = None,
                    max_microbatches: int | None = None,
                    fields: Sequence[str] = ("tokens", "segment_ids", "positions"),
                    segment_ids: str = "segment_ids") -> _microbatches.Microbatches:
    """A packed batch as the :class:`jaxaccum.Microbatches` of a ``max_microbatches`` step.

    Args:
      batch: a :class:`jaxaccum.packing.Packed` (``rows`` and ``max_microbatches`` are then
        its own: leave them out), or a mapping of ``(n, length)`` arrays, as Grain's packers
        batched with ``.batch(n)`` give (``FirstFitPackIterDataset``,
        ``BestFitPackIterDataset``, ``ConcatThenSplitIterDataset``: keys such as ``"tokens"``,
        ``"tokens_segment_ids"``, ``"tokens_positions"``).
      rows: for a mapping, the rows in a micro-batch.
      max_microbatches: for a mapping, K, the step's compiled maximum: the ``n`` rows (``n <=
        K * rows``) are padded with zeros to ``K * rows``.
      fields: the names of the arrays the step gets, in order: fields of ``Packed``, or keys
        of the mapping.
      segment_ids: for a mapping, the key of its segment ids (0 in padding): the count is the
        number of micro-batches up to the last that holds a real token.

    Returns:
      A :class:`jaxaccum.Microbatches` whose data is the tuple of ``fields``, each
      ``(K, rows, length)``, and whose count is the micro-batches used (int32).

    Raises:
      ValueError: ``rows`` or ``max_microbatches`` given with a ``Packed`` or missing with a
        mapping, < 1, or ``n`` rows more than ``K * rows``; a field the batch does not have;
        arrays that are not ``(n, length)`` with one ``n``.

    Examples:
      >>> import numpy as np
      >>> from jaxaccum.grain import to_microbatches
      >>> ids = np.array([[1, 1, 2], [1, 0, 0], [0, 0, 0]])  # 3 packed rows, the last empty
      >>> batch = {"tokens": ids * 7, "tokens_segment_ids": ids}
      >>> mb = to_microbatches(batch, rows=1, max_microbatches=4,
      ...                      fields=("tokens", "tokens_segment_ids"),
      ...                      segment_ids="tokens_segment_ids")
      >>> [x.shape for x in mb.data], int(mb.count)
      ([(4, 1, 3), (4, 1, 3)], 2)
    """
    if isinstance(batch, packing.Packed):
        if rows is not None or max_microbatches is not None:
            raise ValueError(
                f"{TO_MICROBATCHES}: rows and max_microbatches are a Packed batch's own "
                f"({batch.tokens.shape[1]} and {batch.tokens.shape[0]}); got rows={rows}, "
                f"max_microbatches={max_microbatches}: leave them out"
            )
        return batch.microbatches(*fields)
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"{TO_MICROBATCHES}: batch must be a jaxaccum.packing.Packed or a mapping of "
            f"(rows, length) arrays (a batch of Grain's packers); got {type(batch).__name__}"
        )
    if rows is None or max_microbatches is None:
        raise ValueError(
            f"{TO_MICROBATCHES}: a mapping batch needs rows= and max_microbatches= (the rows "
            f"of a micro-batch and the step's K); got rows={rows}, "
            f"max_microbatches={max_microbatches}"
        )
    rows = _validation.positive_int(rows, "rows", TO_MICROBATCHES)
    k = _validation.positive_int(max_microbatches, "max_microbatches", TO_MICROBATCHES)
    missing = [f for f in (*fields, segment_ids) if f not in batch]
    if missing:
        raise ValueError(
            f"{TO_MICROBATCHES}: the batch has no {missing}; its keys are {sorted(batch)} "
            "(name the arrays with fields= and segment_ids=)"
        )
    arrays = {f: np.asarray(batch[f]) for f in (*fields, segment_ids)}
    shapes = {f: a.shape for f, a in arrays.items()}
    n = arrays[segment_ids].shape[0] if arrays[segment_ids].ndim == 2 else -1
    if n < 0 or any(len(s) != 2 or s != shapes[segment_ids] for s in shapes.values()):
        raise ValueError(
            f"{TO_MICROBATCHES}: every array must be (rows, length), all of one shape; got "
            f"{shapes}"
        )
    if n > k * rows:
        raise ValueError(
            f"{TO_MICROBATCHES}: the batch has {n} rows, more than max_microbatches * rows = "
            f"{k} * {rows}: raise max_microbatches to at least {-(-n // rows)}"
        )
    used = np.flatnonzero(np.any(arrays[segment_ids] != 0, axis=1))
    count = 0 if used.size == 0 else int(used[-1]) // rows + 1

    def stack(a: np.ndarray) -> np.ndarray:
        padded = np.zeros((k * rows, a.shape[1]), a.dtype)
        padded[:n] = a
        return padded.reshape(k, rows, a.shape[1])

    return _microbatches.Microbatches(tuple(stack(arrays[f]) for f in fields),
                                      np.asarray(count, np.int32))
