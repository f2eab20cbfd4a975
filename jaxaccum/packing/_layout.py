"""Packing's rows: the plan (best fit), the layout of sequences into rows and micro-batches,
and :func:`pack` / :func:`pack_epoch` (a corpus at once, or a step at a time)."""

from __future__ import annotations

import bisect
import mmap
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxaccum import _microbatches, _validation

PACK = "jaxaccum.packing.pack"
PACK_STREAM = "jaxaccum.packing.pack_stream"
PACK_EPOCH = "jaxaccum.packing.pack_epoch"
_BLOCK_TOKENS = 1 << 17  # pack's rows are written this many tokens (2 MiB) at a time
_INT32 = np.iinfo(np.int32)
# token arrays already int32-safe: a 1-D array of these needs no range check nor copy
_NARROW = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16))
_MAPPED_BYTES = 1 << 22  # output arrays this large are mapped (see _empty), smaller malloc'd
# an anonymous private mapping's flags, 0 where there is none (Windows): NumPy allocates then
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS if hasattr(mmap, "MAP_ANONYMOUS") else 0


class Packed(NamedTuple):
    """Sequences packed into micro-batches of rows: what :func:`pack` returns.

    Every array has the shape ``(M, rows, length)``: M micro-batches of ``rows`` rows of
    ``length`` tokens, ``M = max_microbatches`` when it was given, else ``num_microbatches``.
    In each row the sequences come first, one after another, and the padding last.

    Attributes:
      tokens: int32, the token ids; ``pad_id`` in padding.
      segment_ids: int32, 0 in padding and ``1, 2, ...`` for the sequences of a row, in the
        order they lie in the row. A sequence is ``(micro-batch, row, segment id)``.
      positions: int32, ``0 .. len - 1`` within each sequence, 0 in padding.
      sequence_index: int32, for every token the index of its sequence in the input (for
        :func:`pack_stream`, its arrival index in the stream), -1 in padding: the way back from
        a packed output to the sequence it belongs to.
      num_microbatches: the micro-batches actually used (M_real); those from ``M_real`` to
        ``M`` hold padding only.
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    sequence_index: np.ndarray
    num_microbatches: int

    def microbatches(self, *fields: str) -> _microbatches.Microbatches:
        """The batch argument of a ``max_microbatches=M`` step: a
        :class:`jaxaccum.Microbatches` whose data is the tuple of the named fields (default
        ``tokens, segment_ids, positions``; each ``(M, rows, length)``: micro-batch ``i`` is
        ``field[i]``) and whose count is ``num_microbatches`` (int32).

        Raises:
          ValueError: a name that is not an array field of ``Packed``.

        Examples:
          >>> import numpy as np
          >>> from jaxaccum.packing import pack
          >>> packed = pack([np.arange(1, 4), np.arange(1, 6)], rows=1, length=5,
          ...               max_microbatches=4)
          >>> mb = packed.microbatches("tokens", "segment_ids")
          >>> [x.shape for x in mb.data], int(mb.count)
          ([(4, 1, 5), (4, 1, 5)], 2)
        """
        names = fields or ("tokens", "segment_ids", "positions")
        arrays = self._fields[:-1]  # every field but the count
        bad = [n for n in names if n not in arrays]
        if bad:
            raise ValueError(
                f"jaxaccum.packing.Packed.microbatches: fields must name arrays of Packed "
                f"{arrays}; got {bad}"
            )
        return _microbatches.Microbatches(tuple(getattr(self, n) for n in names),
                                          np.asarray(self.num_microbatches, np.int32))

    @property
    def num_tokens(self) -> int:
        """The number of real (non-padding) tokens."""
        return int(np.count_nonzero(self.segment_ids))

    @property
    def fill(self) -> float:
        """The fraction of real tokens in the micro-batches used (``num_microbatches`` of
        them; 0.0 if none): the packing efficiency. The all-padding micro-batches past
        ``num_microbatches`` are left out, as a step with a runtime count skips them; over all
        M it is ``fill * num_microbatches / M``."""
        _, rows, length = self.tokens.shape
        slots = self.num_microbatches * rows * length
        return self.num_tokens / slots if slots else 0.0


class _BestFit:
    """Best fit over rows of ``length`` tokens: each sequence goes to the open row with the
    least free space that still holds it.

    The open rows are bucketed by their free space (an integer in ``1 .. length``) and the
    distinct free spaces kept sorted, so the tightest row is one binary search (``bisect``);
    within a bucket the row filled last is taken first. Rows with no free space leave the
    structure. With ``max_rows`` no row is opened past that many.
    """

    def __init__(self, length: int, max_rows: int | None = None) -> None:
        self.length = length
        self.max_rows = max_rows
        self.spaces: list[int] = []  # the distinct free spaces of open rows, ascending
        self.rows_at: dict[int, list[int]] = {}  # free space -> the open rows with it
        self.used: list[int] = []  # tokens placed in each row, rows in the order opened

    @property
    def full(self) -> bool:
        """No row can take another token."""
        return not self.spaces and self.max_rows is not None and len(self.used) >= self.max_rows

    def place(self, size: int) -> int | None:
        """Puts ``size`` tokens (1 <= size <= length) in the tightest row they fit, opening a
        row if none has room; returns the row, or None if no row has room and none may open."""
        i = bisect.bisect_left(self.spaces, size)
        if i < len(self.spaces):
            space = self.spaces[i]
            bucket = self.rows_at[space]
            row = bucket.pop()
            if not bucket:
                del self.rows_at[space], self.spaces[i]
        elif self.max_rows is None or len(self.used) < self.max_rows:
            row, space = len(self.used), self.length
            self.used.append(0)
        else:
            return None
        self.used[row] += size
        left = space - size
        if left:
            if left not in self.rows_at:
                bisect.insort(self.spaces, left)
                self.rows_at[left] = []
            self.rows_at[left].append(row)
        return row


def _sequence(entry: str, value: Any, index: int, length: int,
              name: str = "sequences") -> np.ndarray:
    """One input sequence, checked, as a 1-D int32 array; errors call it ``name[index]``."""
    if (type(value) is np.ndarray and value.dtype in _NARROW and value.ndim == 1
            and 0 < value.size <= length):
        return value.astype(np.int32, copy=False)  # the common case, without the checks below
    where = f"{entry}: {name}[{index}]"
    try:
        seq = np.asarray(value)
    except Exception as e:  # ragged nested lists and the like
        raise TypeError(
            f"{where} must be a 1-D array of integer token ids; got {type(value).__name__} "
            f"({e})"
        ) from None
    if seq.ndim != 1:
        raise ValueError(
            f"{where} must be a 1-D array of token ids; got shape {seq.shape} (pass a list of "
            "1-D arrays, one per sequence)"
        )
    if not np.issubdtype(seq.dtype, np.integer):
        raise TypeError(
            f"{where} must hold integer token ids; got dtype {seq.dtype} (convert it with "
            ".astype(np.int32))"
        )
    if seq.size == 0:
        raise ValueError(
            f"{where} is empty; every sequence needs at least 1 token (drop the empty ones "
            "before packing)"
        )
    if seq.size > length:
        raise ValueError(
            f"{where} has {seq.size} tokens, more than a row holds (length={length}); "
            f"truncate it (or split it) to at most {length} tokens, or raise length to at "
            f"least {seq.size}"
        )
    if not np.can_cast(seq.dtype, np.int32) and (seq.min() < _INT32.min or
                                                 seq.max() > _INT32.max):
        raise ValueError(
            f"{where} holds token ids outside int32 ({seq.min()} .. {seq.max()}); the packed "
            "tokens are int32"
        )
    return seq.astype(np.int32, copy=False)


def _pad_id(entry: str, pad_id: Any) -> int:
    if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)):
        raise TypeError(f"{entry}: pad_id must be an int; got {pad_id!r}")
    if not _INT32.min <= pad_id <= _INT32.max:
        raise ValueError(f"{entry}: pad_id must fit in int32; got pad_id={pad_id}")
    return int(pad_id)


def _empty(num_rows: int, length: int) -> tuple[np.ndarray, ...]:
    """Rows to be written: tokens, segment ids, positions, sequence indices.

    Each array of a large output is an anonymous mapping of its own, not NumPy's allocation:
    NumPy asks the kernel for huge pages (``madvise``), and on a machine whose free memory is
    fragmented the first write then waits for the kernel to compact memory (seconds for a
    corpus-sized output). A plain mapping gets huge pages only when they are free and never
    waits for them."""
    nbytes = 4 * num_rows * length
    if not (_MAP_FLAGS and nbytes and nbytes >= _MAPPED_BYTES):  # (no mapping of 0 bytes)
        return tuple(np.empty((num_rows, length), np.int32) for _ in range(4))
    # each mapping is kept alive by its array, and freed with it
    return tuple(np.frombuffer(mmap.mmap(-1, nbytes, flags=_MAP_FLAGS), np.int32)
                 .reshape(num_rows, length) for _ in range(4))


def _pad(out: tuple[np.ndarray, ...], pad_id: int) -> tuple[np.ndarray, ...]:
    """Fills rows with padding: ``pad_id``, segment id 0, position 0, sequence index -1."""
    for a, value in zip(out, (pad_id, 0, 0, -1), strict=True):
        a.fill(value)
    return out


def _fill(out: tuple[np.ndarray, ...], seqs: Sequence[np.ndarray], index: np.ndarray,
          row_of: np.ndarray) -> None:
    """Writes sequences into blank rows ``out`` given the row of each: in a row, in the order
    given, padding last."""
    n = len(seqs)
    if not n:
        return
    tokens, segment_ids, positions, sequence_index = out
    lengths = np.fromiter((s.size for s in seqs), np.int64, n)
    order = np.lexsort((np.arange(n), row_of))  # by row, then in the order given
    lens, row = lengths[order], row_of[order]
    # each row's tokens first, padding last: a boolean mask written in row-major order
    # takes the rows' tokens in the sorted order (no index per token)
    used = np.bincount(row, weights=lens, minlength=tokens.shape[0])
    real = np.arange(tokens.shape[1]) < used[:, None]
    first = np.ones(n, bool)
    first[1:] = row[1:] != row[:-1]
    segment = np.arange(n) - np.maximum.accumulate(np.where(first, np.arange(n), 0)) + 1
    starts = np.cumsum(lens) - lens
    tokens[real] = np.concatenate([seqs[i] for i in order])
    segment_ids[real] = np.repeat(segment.astype(np.int32), lens)
    positions[real] = (np.arange(starts[-1] + lens[-1], dtype=np.int32)
                       - np.repeat(starts.astype(np.int32), lens))
    sequence_index[real] = np.repeat(index[order].astype(np.int32), lens)


def _assemble(
    seqs: Sequence[np.ndarray],
    index: np.ndarray,
    row_of: np.ndarray,
    num_rows: int,
    *,
    microbatches: int,
    rows: int,
    length: int,
    pad_id: int,
) -> Packed:
    """Lays out sequences given the row of each: in a row, in the order given, padding last."""
    out = _pad(_empty(microbatches * rows, length), pad_id)
    _fill(out, seqs, index, row_of)
    return _packed(out, num_rows, microbatches=microbatches, rows=rows)


def _packed(out: tuple[np.ndarray, ...], num_rows: int, *, microbatches: int,
            rows: int) -> Packed:
    grid = (microbatches, rows, out[0].shape[1])
    tokens, segment_ids, positions, sequence_index = (a.reshape(grid) for a in out)
    return Packed(tokens, segment_ids, positions, sequence_index,
                  num_microbatches=-(-num_rows // rows))


class _Padder:
    """Pads ``out`` block by block (``per`` rows) on a thread of its own, then the rows past
    the first ``blocks`` blocks; :meth:`wait` returns once the next block is padded.

    NumPy releases the GIL while it fills, so on a second core the padding (the first touch of
    fresh memory: the kernel's page faults) overlaps the writing of the blocks before it. Used
    as a context manager, which waits for the thread on leaving; an exception on the thread is
    raised by :meth:`wait` (or on leaving)."""

    def __init__(self, out: tuple[np.ndarray, ...], pad_id: int, per: int, blocks: int) -> None:
        self._ready = threading.Semaphore(0)
        self._blocks = blocks
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(out, pad_id, per),
                                        name=f"{PACK} padding", daemon=True)

    def _run(self, out: tuple[np.ndarray, ...], pad_id: int, per: int) -> None:
        released = 0
        try:
            for block in range(self._blocks):
                _pad(tuple(a[block * per:(block + 1) * per] for a in out), pad_id)
                self._ready.release()
                released += 1
            _pad(tuple(a[self._blocks * per:] for a in out), pad_id)  # the micro-batches unused
        except BaseException as e:  # handed to the waiting thread, which would wait forever
            self._error = e
            if released < self._blocks:
                self._ready.release(self._blocks - released)

    def wait(self) -> None:
        self._ready.acquire()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> _Padder:
        if self._blocks > 1:
            self._thread.start()
        else:  # nothing to overlap: padded here, without a thread's start-up (~0.1 ms)
            self._thread.run()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self._thread.ident is not None:
            self._thread.join()
        if kind is None and self._error is not None:
            raise self._error


def _blocks(row_of: np.ndarray, blocks: int, per: int) -> Iterator[tuple[np.ndarray, int]]:
    """The sequences of each of the first ``blocks`` blocks of ``per`` rows (in row order,
    then input order) and the block's first row."""
    order = np.argsort(row_of, kind="stable")
    bounds = np.searchsorted(row_of[order], np.arange(0, (blocks + 1) * per, per))
    for block in range(blocks):
        yield order[bounds[block]:bounds[block + 1]], block * per


def _listed(entry: str, sequences: Any) -> Any:
    if isinstance(sequences, np.ndarray) and sequences.ndim < 2:
        raise TypeError(
            f"{entry}: sequences must be a list of 1-D arrays, one per sequence; got a "
            f"{sequences.ndim}-D array (wrap a single sequence in a list: [seq])"
        )
    return sequences


def _best_fit_decreasing(lengths: np.ndarray, length: int) -> tuple[np.ndarray, int]:
    """The row of each sequence, longest first (ties in input order), and the rows used."""
    fit = _BestFit(length)
    row_of = np.empty(lengths.size, np.int64)
    for i in np.argsort(-lengths, kind="stable").tolist():
        row = fit.place(int(lengths[i]))
        assert row is not None  # rows are unlimited here
        row_of[i] = row
    return row_of, len(fit.used)


def pack(
    sequences: Sequence[Any],
    *,
    rows: int,
    length: int,
    max_microbatches: int | None = None,
    pad_id: int = 0,
) -> Packed:
    """Packs whole sequences into rows of ``length`` tokens, ``rows`` rows a micro-batch.

    The packing is **best-fit decreasing**: the sequences, longest first (ties in input
    order), each go into the row with the least free space that still holds them, a new row
    opening when none does. It uses at most ``11/9 OPT + 4`` rows, OPT the fewest possible
    (Johnson, Demers, Ullman, Garey and Graham 1974, the worst-case bound of first-fit
    decreasing too; best fit fills the tightest gap rather than the first), and every two rows
    together hold more than ``length`` tokens (no two could be merged). Each placement is a
    binary search over the distinct free spaces of the open rows (at most ``length`` of
    them), so a call is O(n log n) with the sort. Sequences are never split; in a row they lie
    in input order, padding last; rows are numbered in the order opened and grouped in that
    order, so only the last used micro-batch can hold all-padding rows. Memory: the output
    (16 bytes a slot) and the plan (about 100 bytes a sequence), the rows being written a
    block of about 2^17 tokens at a time, while a second thread writes the padding ahead of
    them: the first touch of the fresh output memory, which costs the operating system as
    much as the writing, overlaps it on a second core. To keep memory
    bounded, :func:`pack_epoch` yields the same rows a step at a time, in one step's memory.

    Args:
      sequences: a list of 1-D integer arrays of token ids, each of 1 to ``length`` tokens.
      rows: the rows in a micro-batch (the micro-batch size).
      length: the tokens in a row (the sequence length the model runs at).
      max_microbatches: a fixed number M of micro-batches to return (those past the ones used
        hold padding only), for a step compiled once for M; None returns just those used.
      pad_id: the token id of padding.

    Returns:
      A :class:`Packed` of ``(M, rows, length)`` int32 arrays and the count of micro-batches
      used.

    Raises:
      ValueError: a sequence longer than ``length``, empty or not 1-D; more micro-batches
        needed than ``max_microbatches``; ``rows``, ``length`` or ``max_microbatches`` < 1.
      TypeError: a sequence that is not of integers; a count or ``pad_id`` that is not an int.

    Examples:
      >>> import numpy as np
      >>> from jaxaccum.packing import pack
      >>> seqs = [np.array([5, 6, 7]), np.array([8, 9]), np.array([1, 2, 3, 4])]
      >>> packed = pack(seqs, rows=2, length=5)
      >>> packed.tokens.shape, packed.num_microbatches, packed.fill
      ((1, 2, 5), 1, 0.9)
      >>> packed.tokens[0]
      array([[1, 2, 3, 4, 0],
             [5, 6, 7, 8, 9]], dtype=int32)
      >>> packed.segment_ids[0]
      array([[1, 1, 1, 1, 0],
             [1, 1, 1, 2, 2]], dtype=int32)
      >>> packed.positions[0]
      array([[0, 1, 2, 3, 0],
             [0, 1, 2, 0, 1]], dtype=int32)
      >>> packed.sequence_index[0]
      array([[ 2,  2,  2,  2, -1],
             [ 0,  0,  0,  1,  1]], dtype=int32)
    """
    rows = _validation.positive_int(rows, "rows", PACK)
    length = _validation.positive_int(length, "length", PACK)
    if max_microbatches is not None:
        max_microbatches = _validation.positive_int(max_microbatches, "max_microbatches", PACK)
    pad = _pad_id(PACK, pad_id)
    seqs = [_sequence(PACK, s, i, length) for i, s in enumerate(_listed(PACK, sequences))]
    n = len(seqs)
    lengths = np.fromiter((s.size for s in seqs), np.int64, n)
    row_of, num_rows = _best_fit_decreasing(lengths, length)
    used = -(-num_rows // rows)
    if max_microbatches is not None and used > max_microbatches:
        raise ValueError(
            f"{PACK}: sequences: the {n} sequences ({int(lengths.sum())} tokens) need {num_rows} "
            f"rows of length={length}, {used} micro-batches of rows={rows}; expected at most "
            f"max_microbatches={max_microbatches} ({max_microbatches * rows} rows). Pass fewer "
            "sequences per call (jaxaccum.packing.pack_stream takes as many as fit per step) "
            f"or raise max_microbatches to at least {used}"
        )
    microbatches = used if max_microbatches is None else max_microbatches
    out = _empty(microbatches * rows, length)
    # a block of rows at a time, padded and then written: each slot is written twice at most,
    # the temporaries stay ~2^17 tokens whatever the corpus. Padding, the pass that first
    # touches (page-faults) the fresh output, runs ahead of them on a second thread.
    per = max(1, _BLOCK_TOKENS // length)
    blocks = -(-num_rows // per)  # the padding and the writing take the same blocks
    with _Padder(out, pad, per, blocks) as padded:
        for index, base in _blocks(row_of, blocks, per):
            padded.wait()
            _fill(tuple(a[base:base + per] for a in out), [seqs[i] for i in index], index,
                  row_of[index] - base)
    return _packed(out, num_rows, microbatches=microbatches, rows=rows)


def pack_epoch(
    sequences: Sequence[Any],
    *,
    rows: int,
    length: int,
    max_microbatches: int,
    pad_id: int = 0,
) -> Iterator[Packed]:
    """:func:`pack`'s packing of a whole corpus, yielded a step at a time, in bounded memory.

    The rows are :func:`pack`'s (best-fit decreasing over every sequence), and so is their
    order; they are cut into steps of ``max_microbatches`` micro-batches of ``rows`` rows:
    step ``s`` holds rows ``s * M * rows`` to ``(s + 1) * M * rows - 1``. Concatenated along
    the micro-batch axis, the steps are :func:`pack`'s output (padded to whole steps). Only
    one step's arrays exist at a time: past the sequences given (read, not copied), the
    memory is the plan, O(n) (about 100 bytes a sequence while it is made, 16 after), plus
    one step's output (``16 * M * rows * length`` bytes), whatever the corpus.

    Args:
      sequences: a sequence (indexable, e.g. a list) of 1-D integer arrays of token ids,
        each of 1 to ``length`` tokens; each is read twice (its length, then its tokens).
      rows: the rows in a micro-batch.
      length: the tokens in a row.
      max_microbatches: M, the micro-batches in every step.
      pad_id: the token id of padding.

    Returns:
      An iterator of :class:`Packed`, each ``(M, rows, length)``: every step but the last
      has ``num_microbatches == M``; ``sequence_index`` is the index in ``sequences``.

    Raises:
      ValueError: when called (the whole corpus is planned first): a sequence longer than
        ``length``, empty or not 1-D; ``rows``, ``length`` or ``max_microbatches`` < 1.
      TypeError: when called: a sequence that is not of integers; a count or ``pad_id`` that
        is not an int.

    Examples:
      >>> import numpy as np
      >>> from jaxaccum.packing import pack_epoch
      >>> seqs = [np.arange(1, n + 1) for n in [3, 4, 2, 5, 1, 5, 2]]
      >>> [(p.tokens.shape, p.num_microbatches)
      ...  for p in pack_epoch(seqs, rows=1, length=5, max_microbatches=2)]
      [((2, 1, 5), 2), ((2, 1, 5), 2), ((2, 1, 5), 1)]
    """
    rows = _validation.positive_int(rows, "rows", PACK_EPOCH)
    length = _validation.positive_int(length, "length", PACK_EPOCH)
    steps = _validation.positive_int(max_microbatches, "max_microbatches", PACK_EPOCH)
    pad = _pad_id(PACK_EPOCH, pad_id)
    sequences = _listed(PACK_EPOCH, sequences)
    lengths = np.fromiter((_sequence(PACK_EPOCH, s, i, length).size
                           for i, s in enumerate(sequences)), np.int64)
    row_of, num_rows = _best_fit_decreasing(lengths, length)
    return _epoch_steps(sequences, row_of, num_rows, rows=rows, length=length,
                        microbatches=steps, pad_id=pad)


def _epoch_steps(sequences: Sequence[Any], row_of: np.ndarray, num_rows: int, *, rows: int,
                 length: int, microbatches: int, pad_id: int) -> Iterator[Packed]:
    """Assembles :func:`pack_epoch`'s steps one at a time, from the row of each sequence."""
    per_step = microbatches * rows
    for index, base in _blocks(row_of, -(-num_rows // per_step), per_step):
        seqs = [_sequence(PACK_EPOCH, sequences[i], int(i), length) for i in index]
        yield _assemble(seqs, index, row_of[index] - base, min(num_rows - base, per_step),
                        microbatches=microbatches, rows=rows, length=length, pad_id=pad_id)

