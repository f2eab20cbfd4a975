"""Online packing: :func:`pack_stream` and its resumable iterator, :class:`PackStream`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from jaxaccum import _validation
from jaxaccum.packing._layout import (
    PACK_STREAM,
    Packed,
    _assemble,
    _BestFit,
    _pad_id,
    _sequence,
)


def pack_stream(
    sequences: Iterable[Any],
    *,
    rows: int,
    length: int,
    max_microbatches: int,
    lookahead: int = 32,
    pad_id: int = 0,
    state: dict[str, Any] | None = None,
) -> PackStream:
    """Packs a stream of sequences into steps of at most ``max_microbatches`` micro-batches.

    Each step takes sequences in order of arrival and puts each in the row with the least
    free space that holds it (best fit, online: arrival order, not longest first), opening
    rows up to ``max_microbatches * rows``. A sequence that fits nowhere waits in a buffer of
    ``lookahead`` sequences while later ones are tried; the step ends when every buffered
    sequence has failed (or the stream ran dry). The sequences left wait for the next step,
    which tries them first, on empty rows: none waits more than one step, and with
    ``lookahead=1`` the order of arrival is kept exactly.

    Args:
      sequences: an iterable of 1-D integer arrays of token ids, each of 1 to ``length``
        tokens; read lazily, at most ``lookahead`` ahead of what is yielded.
      rows: the rows in a micro-batch.
      length: the tokens in a row.
      max_microbatches: M, the micro-batches in every step yielded.
      lookahead: how many sequences may wait to be placed (>= 1).
      pad_id: the token id of padding.
      state: to resume: what :meth:`PackStream.get_state` returned. ``sequences`` must then
        start at the sequence numbered ``state["arrived"]`` (the sequences read before are
        either packed or held in the state), and the steps that follow are those the
        uninterrupted stream would have yielded, bitwise.

    Returns:
      A :class:`PackStream`: an iterator of :class:`Packed`, one a step, each of shape
      ``(M, rows, length)`` with a count of used micro-batches between 1 and M;
      ``sequence_index`` holds each sequence's arrival index in the stream (0-based). It
      stops when the stream is exhausted. Its ``get_state()`` between steps is a small,
      JSON-serialisable dict to checkpoint with the model.

    Raises:
      ValueError: when called, ``rows``, ``length``, ``max_microbatches`` or ``lookahead``
        < 1; while iterating, a sequence longer than ``length``, empty or not 1-D (naming its
        arrival index).
      TypeError: a count or ``pad_id`` not an int; while iterating, a sequence not of integers.

    Examples:
      >>> import numpy as np
      >>> from jaxaccum.packing import pack_stream
      >>> seqs = (np.arange(n) for n in [3, 4, 2, 5, 1])
      >>> steps = pack_stream(seqs, rows=1, length=5, max_microbatches=2)
      >>> [(p.num_microbatches, np.unique(p.sequence_index[p.segment_ids > 0]).tolist())
      ...  for p in steps]
      [(2, [0, 1, 2, 4]), (1, [3])]
    """
    rows = _validation.positive_int(rows, "rows", PACK_STREAM)
    length = _validation.positive_int(length, "length", PACK_STREAM)
    max_microbatches = _validation.positive_int(max_microbatches, "max_microbatches",
                                                PACK_STREAM)
    lookahead = _validation.positive_int(lookahead, "lookahead", PACK_STREAM)
    pad = _pad_id(PACK_STREAM, pad_id)
    stream = PackStream(iter(sequences), rows, length, max_microbatches, lookahead, pad)
    if state is not None:
        stream.set_state(state)
    return stream


class PackStream(Iterator[Packed]):
    """The iterator :func:`pack_stream` returns: steps of packed rows, with a state that
    saves and restores (``get_state`` / ``set_state``, as a Grain iterator's).

    The state between two steps is the number of sequences read from the stream
    (``"arrived"``) and the sequences read but not yet packed (``"waiting"``: at most
    ``lookahead``, each as its arrival index and its token ids), plain ints and lists.
    """

    def __init__(self, it: Iterator[Any], rows: int, length: int, microbatches: int,
                 lookahead: int, pad_id: int, *, entry: str = PACK_STREAM,
                 name: str = "sequences") -> None:
        # entry and name: whose error it is and what the sequences are called in it
        # (jaxaccum.grain.PackIterDataset's iterator reads its parent's elements)
        self._entry, self._name = entry, name
        self._it = it
        self._rows, self._length, self._microbatches = rows, length, microbatches
        self._lookahead, self._pad_id = lookahead, pad_id
        self._waiting: list[tuple[int, np.ndarray]] = []  # (arrival index, sequence)
        self._arrived = 0
        self._exhausted = False

    def __iter__(self) -> PackStream:
        return self

    def get_state(self) -> dict[str, Any]:
        """What to save to resume after the last step yielded (JSON-serialisable)."""
        return {"arrived": self._arrived,
                "waiting": [[i, seq.tolist()] for i, seq in self._waiting]}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resumes from :meth:`get_state`'s dict; the stream given must start at sequence
        ``state["arrived"]``. Any state of the stream will do, into this iterator whatever it
        did before (it may have run past the state, or to its end): one saved after the end
        gives no more steps, one saved earlier the steps that followed it."""
        try:
            arrived, waiting = int(state["arrived"]), state["waiting"]
            held = [(int(i), _sequence(self._entry, seq, int(i), self._length, self._name))
                    for i, seq in waiting]
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"{self._entry}: state must be a dict from PackStream.get_state() "
                f"({{'arrived': int, 'waiting': [[index, tokens], ...]}}); got {state!r:.200}"
            ) from e
        order = [i for i, _ in held]
        if arrived < 0 or len(held) > self._lookahead or len(set(order)) < len(order) or any(
                not 0 <= i < arrived for i in order):
            raise ValueError(
                f"{self._entry}: state holds {len(held)} waiting sequences with indices "
                f"{order[:8]} after {arrived} arrived; a state of this stream has at most "
                f"lookahead={self._lookahead} of them, distinct, each below 'arrived'; resume "
                "with the lookahead and the state the stream was saved with"
            )
        self._arrived, self._waiting, self._exhausted = arrived, held, False

    def _read(self) -> None:
        """Fills the waiting sequences up to ``lookahead`` from the stream."""
        while not self._exhausted and len(self._waiting) < self._lookahead:
            try:
                value = next(self._it)
            except StopIteration:
                self._exhausted = True
                return
            seq = _sequence(self._entry, value, self._arrived, self._length, self._name)
            self._waiting.append((self._arrived, seq))
            self._arrived += 1

    def __next__(self) -> Packed:
        fit = _BestFit(self._length, max_rows=self._microbatches * self._rows)
        index: list[int] = []
        seqs: list[np.ndarray] = []
        row_of: list[int] = []
        i = 0
        while not fit.full:
            self._read()
            if i >= len(self._waiting):
                break
            row = fit.place(self._waiting[i][1].size)
            if row is None:
                i += 1
                continue
            j, seq = self._waiting.pop(i)
            index.append(j)
            seqs.append(seq)
            row_of.append(row)
        if not seqs:  # the first waiting sequence always fits empty rows: nothing is left
            raise StopIteration
        return _assemble(seqs, np.asarray(index), np.asarray(row_of), len(fit.used),
                         microbatches=self._microbatches, rows=self._rows, length=self._length,
                         pad_id=self._pad_id)

