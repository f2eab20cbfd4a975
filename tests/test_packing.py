"""jaxaccum.packing: sequences packed into micro-batches, and losses that stay exact over them.

- Layout: every token of every sequence lands exactly once, whole, contiguous, in one row, with
  consistent segment ids and positions, and ``sequence_index`` maps it back (seeded Zipf-like
  lengths, edge cases, a Hypothesis property); the errors name the entry point, the argument,
  what was expected and received, and the fix.
- Efficiency: best-fit decreasing is checked against a naive best-fit (same rows, same fills),
  against the 11/9 OPT + 4 worst-case bound on instances whose optimum is known, and on a Zipf
  corpus of mean length ~length/2.
- ``pack_stream``: every sequence once, in order with ``lookahead=1``, steps filled greedily.
- Masking: in a tiny packed transformer (tests/transformer.py) one sequence's tokens change no
  other sequence's loss (bit for bit), and a sequence's loss packed equals its loss alone within
  float32 rounding (bounded by the float32 error of the unpacked run against float64).
- Normalisation: ``token_mean``/``sequence_mean`` pairs combined as ``sum(v w) / sum(w)`` over
  micro-batches (by hand and through ``jaxaccum.value_and_grad(weighted=True)``, gradients
  included) equal the unpacked batch's means within float32 rounding; the mean of per-micro-batch
  means does not.
"""

from __future__ import annotations

import json
import math
import threading
import tracemalloc
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import packing_strategies as strategies
import pytest
import transformer
from conftest import (
    EPS32,
    assert_within_rounding,
    examples,
    max_rel_diff,
    refuses,
    rounding_error_ratio,
    to_float64,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxaccum
from jaxaccum import packing
from jaxaccum.packing import (
    Packed,
    attention_mask,
    pack,
    pack_epoch,
    pack_stream,
    sequence_mean,
    token_mean,
)

VOCAB = 13


def zipf_lengths(rng, n, length, a=1.5):
    """Lengths ``ceil(length * u**0.1 / rank)``, rank ~ Zipf(a) (capped at length), u ~ U(0, 1):
    a few long sequences, many short ones. With a = 1.5 the mean is about length / 2:
    E[1/rank] = zeta(2.5) / zeta(1.5) = 0.51, E[u**0.1] = 1/1.1, plus the ceiling (0.47 to
    0.50 of length measured for length 16 to 512)."""
    rank = np.minimum(rng.zipf(a, n), length)
    return np.maximum(1, np.ceil(length * rng.uniform(0, 1, n) ** 0.1 / rank)).astype(int)


def random_sequences(rng, lengths, vocab=VOCAB):
    return [rng.integers(0, vocab, size=k).astype(np.int32) for k in lengths]


def check_packed(packed, seqs, *, rows, length, pad_id=0, index=None):
    """Asserts the whole layout contract of ``packed`` for ``seqs`` (their sequence_index
    values are ``index``, default 0..n-1): each sequence whole, once, contiguous, in one row,
    in order; padding exactly where sequence_index is -1, last in each row, pad_id and position
    0 there; segment ids 1, 2, ... starting exactly where positions restart, the sequences of
    a row in input order; the micro-batch count and fill as the arrays say."""
    index = range(len(seqs)) if index is None else index
    assert isinstance(packed, Packed)
    m = packed.tokens.shape[0]
    arrays = (packed.tokens, packed.segment_ids, packed.positions, packed.sequence_index)
    for a in arrays:
        assert a.shape == (m, rows, length) and a.dtype == np.int32
    tok, seg, pos, sidx = (a.reshape(-1, length) for a in arrays)
    pad = seg == 0
    np.testing.assert_array_equal(pad, sidx == -1)
    assert np.all(tok[pad] == pad_id) and np.all(pos[pad] == 0)
    real = (~pad).sum(axis=1)
    np.testing.assert_array_equal(~pad, np.arange(length) < real[:, None])  # padding last
    total = 0
    for i, s in zip(index, seqs, strict=True):
        r, c = np.nonzero(sidx == i)  # row-major: sorted by row, then column
        assert r.size == len(s), f"sequence {i}: {r.size} tokens packed, {len(s)} given"
        assert np.all(r == r[0]), f"sequence {i} is split over rows"
        np.testing.assert_array_equal(c, c[0] + np.arange(len(s)))  # contiguous
        np.testing.assert_array_equal(pos[r, c], np.arange(len(s)))
        np.testing.assert_array_equal(tok[r, c], s)
        assert np.unique(seg[r, c]).size == 1
        total += len(s)
    assert int((~pad).sum()) == total  # no token from anywhere else, none twice
    for row in range(tok.shape[0]):
        n = real[row]
        if n == 0:
            continue
        starts = pos[row, :n] == 0
        np.testing.assert_array_equal(seg[row, :n], np.cumsum(starts))
        np.testing.assert_array_equal(starts[1:], sidx[row, 1:n] != sidx[row, : n - 1])
        assert np.all(np.diff(sidx[row, :n][starts]) > 0)  # in a row, in input order
    used = np.flatnonzero(real)
    np.testing.assert_array_equal(used, np.arange(used.size))  # rows filled from the first
    assert packed.num_microbatches == -(-used.size // rows)
    assert packed.num_tokens == total
    slots = packed.num_microbatches * rows * length
    assert packed.fill == (total / slots if slots else 0.0)


def row_fills(packed):
    """Tokens per used row."""
    real = (packed.segment_ids > 0).reshape(-1, packed.tokens.shape[-1]).sum(axis=1)
    return real[real > 0]


def naive_best_fit_decreasing(lengths, length):
    """O(n * rows) best-fit decreasing: the fills of the rows, as a reference."""
    fills: list[int] = []
    for k in sorted(lengths, reverse=True):
        free = [length - f if length - f >= k else length + 1 for f in fills]
        best = int(np.argmin(free)) if free else -1
        if best < 0 or free[best] > length:
            fills.append(k)
        else:
            fills[best] += k
    return sorted(fills)


# --- layout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,rows,length", [(0, 4, 64), (1, 3, 50), (2, 1, 17), (3, 8, 7)])
def test_zipf_layout(seed, rows, length):
    rng = np.random.default_rng(seed)
    seqs = random_sequences(rng, zipf_lengths(rng, 150, length))
    packed = pack(seqs, rows=rows, length=length)
    check_packed(packed, seqs, rows=rows, length=length)
    assert sorted(row_fills(packed)) == naive_best_fit_decreasing([len(s) for s in seqs], length)


def test_pack_example_by_hand():
    """Best-fit decreasing on 3, 2, 4 tokens in rows of 5: 4 opens row 0, 3 fits nowhere and
    opens row 1, 2 goes to the tightest row it fits (row 1, 2 free; row 0 has 1)."""
    seqs = [np.array([5, 6, 7]), np.array([8, 9]), np.array([1, 2, 3, 4])]
    packed = pack(seqs, rows=1, length=5)
    np.testing.assert_array_equal(packed.sequence_index[:, 0],
                                  [[2, 2, 2, 2, -1], [0, 0, 0, 1, 1]])
    check_packed(packed, seqs, rows=1, length=5)
    assert packed.num_microbatches == 2


def test_sequence_of_exactly_length():
    rng = np.random.default_rng(4)
    seqs = random_sequences(rng, [8, 3, 8, 5, 8])
    packed = pack(seqs, rows=2, length=8)
    check_packed(packed, seqs, rows=2, length=8)
    assert sorted(row_fills(packed)) == [8, 8, 8, 8]  # the 3 and the 5 share a row


def test_empty_list():
    packed = pack([], rows=2, length=8)
    assert packed.tokens.shape == (0, 2, 8) and packed.num_microbatches == 0
    assert packed.fill == 0.0
    padded = pack([], rows=2, length=8, max_microbatches=3, pad_id=5)
    check_packed(padded, [], rows=2, length=8, pad_id=5)
    assert padded.tokens.shape == (3, 2, 8) and padded.num_microbatches == 0


def test_one_sequence():
    seq = np.array([3, 1, 4], np.int64)
    packed = pack([seq], rows=4, length=6)
    check_packed(packed, [seq], rows=4, length=6)
    assert packed.tokens.shape == (1, 4, 6) and packed.num_microbatches == 1
    assert packed.fill == 3 / 24


def test_max_microbatches_pads_with_empty_microbatches():
    rng = np.random.default_rng(5)
    seqs = random_sequences(rng, zipf_lengths(rng, 30, 16))
    used = pack(seqs, rows=2, length=16).num_microbatches
    packed = pack(seqs, rows=2, length=16, max_microbatches=used + 2, pad_id=-1)
    check_packed(packed, seqs, rows=2, length=16, pad_id=-1)
    assert packed.tokens.shape[0] == used + 2 and packed.num_microbatches == used
    assert np.all(packed.segment_ids[used:] == 0) and np.all(packed.tokens[used:] == -1)
    assert np.any(packed.segment_ids[used - 1])


def test_inputs_of_other_integer_types():
    seqs = [[1, 2, 3], np.array([7, 8], np.uint8), np.array([2**31 - 1], np.int64)]
    packed = pack(seqs, rows=1, length=4)
    check_packed(packed, [np.asarray(s) for s in seqs], rows=1, length=4)


@settings(max_examples=examples(60), deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), max_size=30),
    length=st.integers(1, 12),
    rows=st.integers(1, 4),
    spare=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
    block=st.sampled_from([1, 7, 24, None]),
    mapped=st.booleans(),
    pad_id=st.sampled_from([0, -3]),
)
def test_property_layout(lengths, length, rows, spare, seed, block, mapped, pad_id):
    """The layout contract, whatever the size of the blocks pack writes its rows in (one row
    at a time up to all at once, padded ahead on a second thread or not) and however its
    output memory is allocated: pack's output does not depend on how it is written."""
    lengths = [min(k, length) for k in lengths]
    seqs = random_sequences(np.random.default_rng(seed), lengths)
    used = pack(seqs, rows=rows, length=length).num_microbatches
    layout = packing._layout
    with (mock.patch.object(layout, "_BLOCK_TOKENS", block or layout._BLOCK_TOKENS),
          mock.patch.object(layout, "_MAPPED_BYTES", 1 if mapped else layout._MAPPED_BYTES)):
        packed = pack(seqs, rows=rows, length=length, max_microbatches=max(used + spare, 1),
                      pad_id=pad_id)
    check_packed(packed, seqs, rows=rows, length=length, pad_id=pad_id)
    fills = sorted(row_fills(packed))
    assert fills == naive_best_fit_decreasing(lengths, length)
    assert len(fills) <= len(seqs)  # never more rows than one sequence per row
    assert len(fills) < 2 or fills[0] + fills[1] > length  # any fit: two rows never merge


@pytest.mark.parametrize("failing", [1, 2, 20, 21])
def test_an_error_while_padding_reaches_the_caller(failing):
    """pack pads on a second thread when it writes several blocks: an exception there, at
    any block or in the unused micro-batches padded last (here once every row is written),
    is raised by pack (and the writer waiting for the next block does not wait forever)."""
    seqs = random_sequences(np.random.default_rng(0), [4] * 40)  # 40 rows: 20 blocks of 2
    calls, written = [], []
    all_written = threading.Event()

    def failing_pad(out, pad_id):
        calls.append(threading.current_thread().name)
        if len(calls) == failing:
            if failing == 21:
                assert all_written.wait(timeout=60)
            raise MemoryError("no memory for the padding")
        return pad(out, pad_id)

    def counted_fill(*args):
        fill(*args)
        written.append(1)
        if len(written) == 20:
            all_written.set()

    def run():
        try:
            pack(seqs, rows=4, length=4, max_microbatches=11)
        except BaseException as e:  # noqa: BLE001 - judged below
            raised.append(e)

    pad, fill = packing._layout._pad, packing._layout._fill
    raised: list[BaseException] = []
    with (mock.patch.object(packing._layout, "_BLOCK_TOKENS", 8),
          mock.patch.object(packing._layout, "_pad", failing_pad),
          mock.patch.object(packing._layout, "_fill", counted_fill)):
        caller = threading.Thread(target=run, daemon=True)
        caller.start()
        caller.join(timeout=30)  # a few ms when it works
        assert not caller.is_alive(), "pack waits forever after an error while padding"
    assert [type(e) for e in raised] == [MemoryError], raised
    assert str(raised[0]) == "no memory for the padding"
    assert len(calls) == failing  # the padding stopped at the error
    assert calls[-1] != threading.current_thread().name  # on the other thread


# --- errors ------------------------------------------------------------------------------------


def test_pad_id_takes_every_int32_value():
    for pad_id in (-(2**31), 2**31 - 1):
        packed = pack([np.arange(1, 3)], rows=1, length=4, pad_id=pad_id)
        assert packed.tokens[0, 0].tolist() == [1, 2, pad_id, pad_id]


def test_packing_options_are_keyword_only():
    """A count passed by position is Python's TypeError, never taken as another option."""
    with refuses(TypeError, match="positional argument"):
        pack([np.arange(1, 3)], 2, 8)
    with refuses(TypeError, match="positional argument"):
        pack_stream([np.arange(1, 3)], 2, 8, 2)


def test_a_3d_array_of_sequences_is_refused_naming_the_first():
    with refuses(ValueError, match=r"sequences\[0\] must be a 1-D array of token ids; got "
                                   r"shape \(3, 4\)"):
        pack(np.ones((2, 3, 4), np.int32), rows=1, length=8)


def test_too_long_sequence():
    seqs = [np.arange(3), np.arange(8), np.arange(9)]
    with refuses(ValueError, match=(
            r"^jaxaccum\.packing\.pack: sequences\[2\] has 9 tokens, more "
                       r"than a row holds \(length=8\); truncate it .* or raise length to at "
                       r"least 9$")):
        pack(seqs, rows=2, length=8)


def test_too_many_microbatches():
    seqs = [np.arange(4)] * 7  # 7 rows of length 4: 4 micro-batches of 2 rows
    with refuses(ValueError, match=(
            r"^jaxaccum\.packing\.pack: sequences: the 7 sequences \(28 "
                       r"tokens\) need 7 rows of length=4, 4 micro-batches of rows=2; expected "
                       r"at most max_microbatches=3 \(6 rows\)\. Pass fewer sequences per call "
                       r".* or raise max_microbatches to at least 4$")):
        pack(seqs, rows=2, length=4, max_microbatches=3)
    check_packed(pack(seqs, rows=2, length=4, max_microbatches=4), seqs, rows=2, length=4)


@pytest.mark.parametrize("sequences,error,message", [
    ([np.zeros((2, 3), int)], ValueError, r"sequences\[0\] must be a 1-D array .* got shape "
     r"\(2, 3\)"),
    ([np.arange(2), np.array(4)], ValueError, r"sequences\[1\] must be a 1-D .* got shape \(\)"),
    ([np.arange(2.0)], TypeError, r"sequences\[0\] must hold integer token ids; got dtype "
     r"float64 \(convert it"),
    ([np.arange(2), np.array([], int)], ValueError, r"sequences\[1\] is empty; .*drop the "
     r"empty ones"),
    ([np.array([2**40])], ValueError, r"sequences\[0\] holds token ids outside int32"),
    (np.arange(3), TypeError, r"sequences must be a list of 1-D arrays, one per sequence; got "
     r"a 1-D array \(wrap a single sequence in a list"),
])
def test_bad_sequences(sequences, error, message):
    with refuses(error, match=r"^jaxaccum\.packing\.pack: " + message):
        pack(sequences, rows=2, length=8)


@pytest.mark.parametrize("kwargs,error,message", [
    ({"rows": 0}, ValueError, r"rows must be >= 1; got rows=0"),
    ({"length": 2.0}, TypeError, r"length must be a positive int; got 2.0"),
    ({"max_microbatches": 0}, ValueError, r"max_microbatches must be >= 1"),
    ({"pad_id": 2**31}, ValueError, r"pad_id must fit in int32"),
    ({"pad_id": None}, TypeError, r"pad_id must be an int"),
])
def test_bad_arguments(kwargs, error, message):
    with refuses(error, match=r"^jaxaccum\.packing\.pack: " + message):
        pack([np.arange(2)], **{"rows": 2, "length": 8, **kwargs})


# --- efficiency --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,max_pieces", [(0, 3), (1, 5), (2, 8)])
def test_within_worst_case_bound_of_known_optimum(seed, max_pieces):
    """Cut R full rows into pieces and shuffle them: the optimum is exactly R rows (the pieces
    fill R rows, and hold R * length tokens). Best-fit decreasing uses at most
    11/9 OPT + 4 rows (Johnson, Demers, Ullman, Garey, Graham 1974), whatever the input."""
    rng = np.random.default_rng(seed)
    length, opt = 100, 300
    lengths = []
    for _ in range(opt):
        cuts = np.sort(rng.choice(np.arange(1, length), rng.integers(0, max_pieces), False))
        lengths += np.diff(np.concatenate([[0], cuts, [length]])).tolist()
    rng.shuffle(lengths)
    packed = pack(random_sequences(rng, lengths), rows=4, length=length)
    used = row_fills(packed).size
    assert opt <= used <= 11 / 9 * opt + 4


def test_zipf_corpus_fill():
    """A Zipf-like corpus of mean length ~length/2. OPT >= LB = max(ceil(tokens / length),
    sequences longer than length/2 (no two share a row)), so ``used <= 11/9 LB + 4`` is
    stricter than the worst-case bound and holds here; then ``fill >= tokens / (length *
    (11/9 LB + 4 + rows - 1))`` (the last micro-batch may hold rows - 1 empty rows), which is
    >= 0.8 for this corpus because its volume bound is tight (tokens / (length LB) ~ 1: 9/11
    ~ 0.82 in the worst case). Best fit is in fact near optimal here (fill ~ 0.99)."""
    rng = np.random.default_rng(7)
    length, rows = 512, 8
    lengths = zipf_lengths(rng, 2000, length)
    assert 0.4 <= lengths.mean() / length <= 0.6
    packed = pack(random_sequences(rng, lengths), rows=rows, length=length)
    fills = row_fills(packed)
    tokens = int(lengths.sum())
    lb = max(-(-tokens // length), int(np.sum(lengths > length / 2)))
    assert fills.sum() == tokens
    assert fills.size <= 11 / 9 * lb + 4
    assert fills.size <= lengths.size  # naive: one sequence per row
    assert np.sort(fills)[:2].sum() > length  # any fit: no two rows could be merged
    bound = tokens / (length * (11 / 9 * lb + 4 + rows - 1))
    assert packed.fill >= bound >= 0.8
    assert sorted(fills) == naive_best_fit_decreasing(lengths.tolist(), length)


# --- pack_epoch --------------------------------------------------------------------------------


@settings(max_examples=examples(30), deadline=None)
@given(rows=st.integers(1, 3), length=st.integers(2, 24), m=st.integers(1, 4),
       pad_id=st.integers(-2, 2), data=st.data())
def test_epoch_steps_are_packs_rows_cut_into_steps(rows, length, m, pad_id, data):
    """pack_epoch's steps, concatenated, are pack's output padded to whole steps; each step is
    a valid layout of the sequences it holds, with M micro-batches and its own count."""
    lengths = data.draw(st.lists(st.integers(1, length), max_size=60))
    seqs = random_sequences(np.random.default_rng(len(lengths)), lengths)
    steps = list(pack_epoch(seqs, rows=rows, length=length, max_microbatches=m, pad_id=pad_id))
    whole = pack(seqs, rows=rows, length=length, pad_id=pad_id)
    if pad_id == 0:  # the documented default of both: the same rows without pad_id=
        for got, want in zip(pack_epoch(seqs, rows=rows, length=length, max_microbatches=m),
                             steps, strict=True):
            np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(pack(seqs, rows=rows, length=length).tokens, whole.tokens)
    assert len(steps) == -(-whole.num_microbatches // m)
    if not steps:
        return
    padded = pack(seqs, rows=rows, length=length, pad_id=pad_id,
                  max_microbatches=len(steps) * m)
    for field in ("tokens", "segment_ids", "positions", "sequence_index"):
        np.testing.assert_array_equal(
            np.concatenate([getattr(p, field) for p in steps]), getattr(padded, field))
    for i, p in enumerate(steps):
        held = stream_indices(p).tolist()
        check_packed(p, [seqs[j] for j in held], rows=rows, length=length, pad_id=pad_id,
                     index=held)
        assert p.tokens.shape[0] == m
        assert p.num_microbatches == (m if i < len(steps) - 1 else
                                      whole.num_microbatches - m * (len(steps) - 1))


def test_epoch_memory_is_one_step_past_the_input():
    """Iterating pack_epoch allocates, past the input, the plan (a few integers a sequence)
    and one step's arrays: far below pack's output for the whole corpus."""
    rng = np.random.default_rng(5)
    length, rows, m = 512, 4, 2
    seqs = random_sequences(rng, zipf_lengths(rng, 20_000, length))
    step_bytes = 4 * 4 * m * rows * length  # four int32 arrays
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        steps = 0
        for _ in pack_epoch(seqs, rows=rows, length=length, max_microbatches=m):
            steps += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    whole_output = steps * step_bytes
    bound = 128 * len(seqs) + 8 * step_bytes  # the plan, and a few steps' worth of temporaries
    assert peak <= bound < whole_output / 4, (peak, bound, whole_output)


def test_epoch_refuses_bad_input_when_called():
    with pytest.raises(ValueError, match=r"pack_epoch: sequences\[1\] has 9 tokens"):
        pack_epoch([np.arange(3), np.arange(9)], rows=1, length=8, max_microbatches=1)
    with pytest.raises(TypeError, match=r"pack_epoch: sequences must be a list of 1-D"):
        pack_epoch(np.arange(3), rows=1, length=8, max_microbatches=1)
    with pytest.raises(ValueError, match=r"pack_epoch.*max_microbatches"):
        pack_epoch([np.arange(3)], rows=1, length=8, max_microbatches=0)


# --- pack_stream -------------------------------------------------------------------------------


def stream_indices(packed):
    """The arrival indices of the sequences of one step, in no particular order."""
    return np.unique(packed.sequence_index[packed.segment_ids > 0])


def test_stream_with_a_long_lookahead_packs_every_sequence_once():
    """A lookahead of 300 that fills (every waiting sequence tried and failed before the step
    ends): the waiting sequences go to the next steps, each once, in arrival order."""
    seqs = [np.full(6, 1, np.int32)] + [np.full(5, 2, np.int32)] * 300
    steps = list(pack_stream(iter(seqs), rows=1, length=10, max_microbatches=1, lookahead=300))
    assert [stream_indices(p).tolist() for p in steps] == (
        [[0]] + [[i, i + 1] for i in range(1, 301, 2)])


@pytest.mark.parametrize("lookahead", [1, 4, 32])
def test_stream_every_sequence_once(lookahead):
    rng = np.random.default_rng(8)
    length, rows, m = 32, 2, 3
    seqs = random_sequences(rng, zipf_lengths(rng, 200, length))
    steps = list(pack_stream(iter(seqs), rows=rows, length=length, max_microbatches=m,
                             lookahead=lookahead))
    seen = []
    for packed in steps:
        idx = stream_indices(packed)
        assert packed.tokens.shape == (m, rows, length)
        assert 1 <= packed.num_microbatches <= m
        check_packed(packed, [seqs[i] for i in idx], rows=rows, length=length, index=idx)
        # the step tries the sequences left waiting first, on empty rows: the oldest one left
        # always goes in, so none waits more than one step
        assert idx.min() == min(set(range(len(seqs))) - set(seen))
        seen += idx.tolist()
    assert sorted(seen) == list(range(len(seqs)))
    if lookahead == 1:
        order = np.concatenate([stream_indices(p) for p in steps])
        np.testing.assert_array_equal(order, np.arange(len(seqs)))  # arrival order kept
        # greedy: a step ends only when the next sequence fits in none of its rows, all
        # m * rows of them open
        for packed, nxt in zip(steps, steps[1:], strict=False):
            fills = row_fills(packed)
            assert fills.size == m * rows
            assert length - fills.min() < len(seqs[stream_indices(nxt)[0]])


@settings(max_examples=examples(40), deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=0, max_size=60),
       rows=st.integers(1, 3), m=st.integers(1, 3), lookahead=st.integers(1, 8),
       stop=st.integers(0, 30), seed=st.integers(0, 2**16))
def test_stream_resumed_from_its_state_yields_the_uninterrupted_steps(lengths, rows, m,
                                                                     lookahead, stop, seed):
    """Stopped after any step, its state saved as JSON, and resumed on the stream from
    ``state["arrived"]`` on: the same steps, bitwise; every sequence packed exactly once."""
    seqs = random_sequences(np.random.default_rng(seed), np.asarray(lengths, int))
    options = dict(rows=rows, length=12, max_microbatches=m, lookahead=lookahead)
    whole = list(pack_stream(iter(seqs), **options))
    first = pack_stream(iter(seqs), **options)
    before = [next(first) for _ in range(min(stop, len(whole)))]
    state = json.loads(json.dumps(first.get_state()))
    # the documented state: "arrived" read, "waiting" at most lookahead of them, distinct
    held = [i for i, _ in state["waiting"]]
    assert len(held) <= lookahead and len(set(held)) == len(held)
    assert all(0 <= i < state["arrived"] <= len(seqs) for i in held)
    after = list(pack_stream(iter(seqs[state["arrived"]:]), state=state, **options))
    assert len(before) + len(after) == len(whole)
    for got, want in zip(before + after, whole, strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    seen = np.concatenate([stream_indices(p) for p in before + after] or [np.zeros(0, int)])
    assert sorted(seen.tolist()) == list(range(len(seqs)))


def test_packed_microbatches_is_the_stack_a_runtime_count_step_takes():
    """``Packed.microbatches(*fields)``: the named arrays as they lie (micro-batch i is
    ``field[i]``) and ``num_microbatches`` as an int32 count; the default fields tokens,
    segment ids and positions; a name that is no array field refused."""
    rng = np.random.default_rng(3)
    packed = pack(random_sequences(rng, [5, 3, 8, 2, 7]), rows=2, length=8, max_microbatches=4)
    default = packed.microbatches()
    assert len(default.data) == 3
    for got, want in zip(default.data, (packed.tokens, packed.segment_ids, packed.positions),
                         strict=True):
        assert got is want
    mb = packed.microbatches("segment_ids", "sequence_index")
    assert mb.data[0] is packed.segment_ids and mb.data[1] is packed.sequence_index
    assert mb.count.dtype == np.int32 and int(mb.count) == packed.num_microbatches
    with refuses(ValueError, match=r"Packed.microbatches: fields must name arrays .* "
                                   r"got \['num_microbatches'\]"):
        packed.microbatches("tokens", "num_microbatches")


def test_a_2d_array_is_a_list_of_sequences():
    """A 2-D array of token ids is its rows, one sequence each (only a 1-D array, a single
    sequence, is refused)."""
    rows = np.arange(1, 13).reshape(3, 4)
    got = pack(rows, rows=1, length=8)
    want = pack(list(rows), rows=1, length=8)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_stream_state_that_is_not_one_is_refused():
    with refuses(ValueError, match=r"pack_stream: state must be a dict from "
                                   r"PackStream.get_state\(\)"):
        pack_stream([], rows=1, length=4, max_microbatches=1, state={"arrived": 3})
    # a state this stream could not have saved: more waiting than its lookahead (saved with
    # another lookahead), an index twice, an index not yet arrived
    waiting = [[0, [1, 2]], [1, [3]], [2, [4, 5]]]
    for arrived, held, lookahead in ((3, waiting, 2), (3, waiting[:1] * 2, 4), (2, waiting, 4)):
        with refuses(ValueError, match=r"pack_stream: state holds .* waiting sequences .* "
                                       r"at most lookahead=\d+ of them, distinct"):
            pack_stream([], rows=1, length=4, max_microbatches=1, lookahead=lookahead,
                        state={"arrived": arrived, "waiting": held})
    stream = pack_stream([], rows=1, length=4, max_microbatches=1, lookahead=3,
                         state={"arrived": 3, "waiting": waiting})
    assert [int(i) for i in np.concatenate([stream_indices(p) for p in stream])] == [0, 1, 2]


def test_stream_fills_steps_with_lookahead():
    """With a lookahead the later short sequences fill the gaps: fewer steps than in order."""
    rng = np.random.default_rng(9)
    seqs = random_sequences(rng, zipf_lengths(rng, 300, 32))
    count = {k: len(list(pack_stream(seqs, rows=2, length=32, max_microbatches=2,
                                     lookahead=k))) for k in (1, 16)}
    assert count[16] < count[1]
    assert count[16] >= math.ceil(sum(map(len, seqs)) / (2 * 2 * 32))  # the token budget


def test_stream_edge_cases_and_errors():
    assert list(pack_stream([], rows=2, length=4, max_microbatches=2)) == []
    with refuses(ValueError, match=(
            r"^jaxaccum\.packing\.pack_stream: lookahead must be >= "
            r"1")):
        pack_stream([], rows=2, length=4, max_microbatches=2, lookahead=0)  # at the call
    steps = pack_stream([np.arange(3), np.arange(4), np.arange(5)], rows=1, length=4,
                        max_microbatches=1, lookahead=1)
    np.testing.assert_array_equal(next(steps).tokens[0, 0], [0, 1, 2, 0])
    np.testing.assert_array_equal(next(steps).tokens[0, 0], [0, 1, 2, 3])
    with refuses(ValueError, match=r"^jaxaccum\.packing\.pack_stream: sequences\[2\] has 5 "
                       r"tokens, more than a row holds \(length=4\); truncate"):
        next(steps)  # read (and checked) when a step reaches it


# --- pack_stream against its docstring's model, and its state at every point ------------------


def steps_equal(got, want):
    """Two lists of steps, bitwise (every array, and the count)."""
    assert len(got) == len(want)
    for s, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.num_microbatches == b.num_microbatches, f"step {s}"
        for name in ("tokens", "segment_ids", "positions", "sequence_index"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name),
                                          err_msg=f"step {s} {name}")


def ends(stream):
    """The stream is at its end, and stays there: StopIteration, and again."""
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(stream)
    return True


# the edges: one token, exactly length, a corpus smaller than one row, one ending mid-step
EDGES = [([1], dict(rows=1, length=1, max_microbatches=1, lookahead=1, pad_id=0)),
         ([4], dict(rows=2, length=4, max_microbatches=2, lookahead=1, pad_id=3)),
         ([1, 2], dict(rows=3, length=8, max_microbatches=2, lookahead=4, pad_id=-1)),
         ([4, 4, 4, 4, 4, 1], dict(rows=2, length=4, max_microbatches=2, lookahead=2, pad_id=7)),
         ([1] * 9 + [3], dict(rows=1, length=3, max_microbatches=3, lookahead=6, pad_id=0)),
         # best fit, not any fit: the 1 must go to the row with 1 free (the 3's), so that
         # the last 2 fits the other row; put in the row with 2 free, it waits a step
         ([2, 3, 1, 2], dict(rows=2, length=4, max_microbatches=1, lookahead=1, pad_id=0))]


def with_edges(test):
    for lengths, options in EDGES:
        test = example(options=options, lengths=lengths)(test)
    return test


@settings(max_examples=examples(100), deadline=None)
@with_edges
@given(options=strategies.stream_options(), lengths=st.data())
def test_stream_steps_are_its_docstrings_best_fit_for_every_option(options, lengths):
    """Every value of every option (rows, length, max_microbatches, lookahead from 1, pad_id
    negative, 0, a real token id, int32's largest): each step holds the sequences the
    docstring's online best fit puts there (``stream_model``), laid out by the layout contract
    (pad_id in padding), ``(M, rows, length)`` with ``ceil(rows opened / rows)`` micro-batches
    used; the stream is read lazily (at most ``lookahead`` sequences read and not yet yielded);
    every sequence once; and at the end it stays ended."""
    if not isinstance(lengths, list):
        lengths = lengths.draw(strategies.lengths_for(options["length"]))
    seqs = strategies.corpus(lengths)
    source = strategies.Seekable(seqs)
    stream = pack_stream(source, **options)
    rows, length, m = options["rows"], options["length"], options["max_microbatches"]
    packed_so_far = 0
    for placed, opened in strategies.stream_model(lengths, **options):
        packed = next(stream)
        idx = stream_indices(packed)
        assert idx.tolist() == sorted(placed)
        assert packed.tokens.shape == (m, rows, length)
        assert packed.num_microbatches == -(-opened // rows)
        check_packed(packed, [seqs[i] for i in idx], rows=rows, length=length,
                     pad_id=options["pad_id"], index=idx)
        packed_so_far += len(placed)
        assert source.position - packed_so_far <= options["lookahead"]
    assert ends(stream)
    assert source.position == len(seqs)


@settings(max_examples=examples(60), deadline=None)
@with_edges
@given(options=strategies.stream_options(), lengths=st.data())
def test_a_stream_state_saved_anywhere_restores_into_a_fresh_or_the_same_stream(options,
                                                                                lengths):
    """A state saved after 0, 1, ..., n steps and after the end (StopIteration reached, and
    next called past it again), through JSON: restored into a fresh stream on the sequences
    from ``state["arrived"]``, into the same stream once it ran to its end, and into one that
    ran a step further, the steps that follow are the uninterrupted stream's, bitwise (after
    the end: none, and StopIteration again); every sequence packed exactly once."""
    if not isinstance(lengths, list):
        lengths = lengths.draw(strategies.lengths_for(options["length"]))
    seqs = strategies.corpus(lengths, seed=1)
    whole = list(pack_stream(iter(seqs), **options))
    for stop in range(len(whole) + 3):
        first = pack_stream(iter(seqs), **options)
        before = [next(first) for _ in range(min(stop, len(whole)))]
        if stop >= len(whole) + 1:  # saved once it raised StopIteration (once or twice)
            for _ in range(stop - len(whole)):
                with pytest.raises(StopIteration):
                    next(first)
        state = json.loads(json.dumps(first.get_state()))
        assert 0 <= state["arrived"] - sum(stream_indices(p).size for p in before) <= (
            options["lookahead"])
        fresh = pack_stream(iter(seqs[state["arrived"]:]), state=state, **options)
        after = list(fresh)
        assert ends(fresh)
        steps_equal(before + after, whole)
        seen = [int(i) for p in before + after for i in stream_indices(p)]
        assert sorted(seen) == list(range(len(seqs)))
        # the same stream, on a source put back at "arrived" (as Grain puts back a parent):
        # once exhausted, and one step past the state (when there is one)
        for further in (None, stop + 1):
            source = strategies.Seekable(seqs)
            same = pack_stream(source, **options)
            ran = list(same) if further is None else [
                next(same) for _ in range(min(further, len(whole)))]
            assert len(ran) <= len(whole)
            source.seek(state["arrived"])
            same.set_state(state)
            steps_equal(before + list(same), whole)
            assert ends(same)


# --- loss helpers: unit checks -----------------------------------------------------------------


def test_attention_mask_definition():
    rng = np.random.default_rng(10)
    packed = pack(random_sequences(rng, zipf_lengths(rng, 12, 8)), rows=2, length=8)
    mask = np.asarray(attention_mask(packed.segment_ids))
    seg = packed.segment_ids
    assert mask.shape == (*seg.shape, 8) and mask.dtype == bool
    for m, r in np.ndindex(seg.shape[:2]):
        for q in range(8):
            for k in range(8):
                expected = k <= q and seg[m, r, q] == seg[m, r, k] and seg[m, r, q] > 0
                assert mask[m, r, q, k] == expected


@pytest.mark.parametrize("corpus", ["zipf", "one-token"])
@pytest.mark.parametrize("length", [16, 15])  # rows of odd length too
def test_token_and_sequence_mean_match_float64(length, corpus):
    """Against float64 NumPy. Error bound: the losses are positive, so a float32 sum of n
    terms is within (n - 1) eps32 of the exact sum, relatively; a division adds eps32. The
    token mean sums N = all real tokens: (N + 1) eps32. The sequence mean sums at most
    ``length`` terms per sequence, divides, then sums S sequence means and divides:
    (length + S + 2) eps32. Corpora: Zipf lengths, and sequences of one token (rows holding
    ``length`` sequences, the most a row can, beside rows of padding)."""
    rng = np.random.default_rng(11)
    lengths = zipf_lengths(rng, 40, length) if corpus == "zipf" else [1] * (3 * length + 5)
    packed = pack(random_sequences(rng, lengths), rows=3, length=length)
    seg = packed.segment_ids
    loss = rng.exponential(size=seg.shape).astype(np.float32)
    loss[seg == 0] = np.nan  # padding values must not leak in
    n = int((seg > 0).sum())
    tv, tw = token_mean(loss, seg)
    assert float(tw) == n and tw.dtype == jnp.float32
    exact = np.sum(loss[seg > 0], dtype=np.float64) / n
    assert abs(float(tv) - exact) <= (n + 1) * EPS32 * exact
    means = [np.mean(loss[m, r][seg[m, r] == s], dtype=np.float64)
             for m, r in np.ndindex(seg.shape[:2]) for s in np.unique(seg[m, r]) if s > 0]
    sv, sw = sequence_mean(loss, seg)
    assert float(sw) == len(means) == len(lengths)
    exact = np.mean(means)
    assert abs(float(sv) - exact) <= (length + len(means) + 2) * EPS32 * exact
    # per micro-batch, combined with the weights: the same (the leading axes count as rows)
    pairs = np.array([sequence_mean(loss[m], seg[m]) for m in range(seg.shape[0])], np.float64)
    for m in range(seg.shape[0]):
        assert pairs[m, 1] == sum(np.unique(seg[m, r][seg[m, r] > 0]).size for r in range(3))
    combined = pairs[:, 0] @ pairs[:, 1] / pairs[:, 1].sum()
    assert abs(combined - exact) <= (length + len(means) + 2) * EPS32 * exact


def test_all_padding_gives_zero_weight_and_no_nan():
    seg = jnp.zeros((2, 8), jnp.int32)
    for fn in (token_mean, sequence_mean):
        value, weight = fn(jnp.ones((2, 8)), seg)
        assert float(value) == 0.0 and float(weight) == 0.0
        g = jax.grad(lambda x, fn=fn: fn(x, seg)[0])(jnp.ones((2, 8)))
        assert np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize("fn", [token_mean, sequence_mean])
@pytest.mark.parametrize("loss_shape,seg_shape", [((2, 8), (2, 7)), ((8,), (2, 8)), ((), ())])
def test_loss_helpers_refuse_what_their_docstrings_say(fn, loss_shape, seg_shape):
    """Raises (their docstrings): "the two shapes differ, or are scalars"."""
    with refuses(ValueError, match=rf"^jaxaccum\.packing\.{fn.__name__}: per_token_loss and "
                 r"segment_ids must have one shape \(\.\.\., length\)"):
        fn(jnp.ones(loss_shape), jnp.ones(seg_shape, jnp.int32))


def test_attention_mask_refuses_a_scalar():
    with refuses(ValueError, match=r"^jaxaccum\.packing\.attention_mask: segment_ids must "
                 r"have shape \(\.\.\., length\); got a scalar"):
        attention_mask(jnp.int32(1))


def test_loss_helper_errors():
    with refuses(ValueError, match=r"^jaxaccum\.packing\.token_mean: per_token_loss and "
                       r"segment_ids must have one shape .* got per_token_loss \(2, 8\) and "
                       r"segment_ids \(2, 7\)"):
        token_mean(jnp.ones((2, 8)), jnp.ones((2, 7), jnp.int32))
    with refuses(TypeError, match=(
            r"^jaxaccum\.packing\.sequence_mean: segment_ids must have an "
                       r"integer dtype")):
        sequence_mean(jnp.ones(8), jnp.ones(8))
    with refuses(TypeError, match=(
            r"^jaxaccum\.packing\.token_mean: per_token_loss must have a "
                       r"floating dtype")):
        token_mean(jnp.ones(8, jnp.int32), jnp.ones(8, jnp.int32))


# --- the packed transformer --------------------------------------------------------------------

LENGTH, ROWS = 16, 2
PARAMS = transformer.init_params(jax.random.key(0), vocab=VOCAB, max_len=LENGTH)


def causal_only(segment_ids):
    """A wrong mask: causal, padding excluded, but across segments."""
    n = segment_ids.shape[-1]
    return jnp.tril(jnp.ones((n, n), bool)) & (segment_ids[..., :, None] > 0)


def corpus(seed, n):
    rng = np.random.default_rng(seed)
    lengths = zipf_lengths(rng, n, LENGTH)
    lengths[:2] = [1, LENGTH]  # a sequence with no target, one filling a row
    return random_sequences(rng, lengths)


loss_fn = jax.jit(transformer.per_token_loss, static_argnames="mask_fn")


def packed_loss(params, packed, mask_fn=attention_mask):
    return np.asarray(loss_fn(params, packed.tokens, packed.segment_ids, packed.positions,
                              mask_fn=mask_fn))


@pytest.mark.parametrize("mask_fn", [attention_mask, causal_only])
def test_other_sequences_see_nothing(mask_fn):
    """Changing one sequence's tokens changes no other sequence's per-token loss, bit for
    bit; with the mask across segments (the control) the sequences after it in its row do
    change."""
    seqs = corpus(12, 14)
    packed = pack(seqs, rows=ROWS, length=LENGTH)
    base = packed_loss(PARAMS, packed, mask_fn)
    rng = np.random.default_rng(13)
    sidx, seg = packed.sequence_index, packed.segment_ids
    has_target = np.asarray(transformer.target_segment_ids(seg)) > 0
    changed_others, changed_later = [], []
    for i in range(len(seqs)):
        where = sidx == i
        (m,), (r,) = np.unique(np.nonzero(where)[0]), np.unique(np.nonzero(where)[1])
        if seg[m, r].max() < 2 or len(seqs[i]) < 2:
            continue  # alone in its row, or no target of its own
        tokens = packed.tokens.copy()
        tokens[where] = (tokens[where] + rng.integers(1, VOCAB, where.sum())) % VOCAB
        loss = packed_loss(PARAMS, packed._replace(tokens=tokens), mask_fn)
        others = (sidx != i) & (seg > 0)
        later = np.zeros_like(where)
        later[m, r] = (seg[m, r] > seg[where][0]) & has_target[m, r]
        assert not np.array_equal(loss[where], base[where])  # its own loss does change
        changed_others.append(not np.array_equal(loss[others], base[others]))
        if later.any():
            changed_later.append(not np.array_equal(loss[later], base[later]))
    assert len(changed_others) >= 4 and len(changed_later) >= 2
    if mask_fn is attention_mask:
        assert not any(changed_others)
    else:
        assert all(changed_later)


def plain_causal(segment_ids):
    """The mask of an unpacked batch: causal only, no segments (nor padding) looked at."""
    n = segment_ids.shape[-1]
    return jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (*segment_ids.shape, n))


def one_per_row(seqs):
    """The unpacked batch: sequence i alone at the start of row i, padding after it (which
    causal attention keeps it from seeing): tokens, segment ids (1, then 0), positions."""
    tokens = np.zeros((len(seqs), LENGTH), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    lengths = np.array([len(s) for s in seqs])
    seg = (np.arange(LENGTH) < lengths[:, None]).astype(np.int32)
    pos = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), tokens.shape)
    return tokens, seg, pos


def alone_losses(params, batch):
    """Per-token losses of each sequence run alone, plain causal mask (targets only kept: the
    rest are 0)."""
    return transformer.per_token_loss(params, *batch, mask_fn=plain_causal)


def per_sequence(losses, seqs):
    return [np.asarray(losses[i, : len(s) - 1], np.float64) for i, s in enumerate(seqs)]


@pytest.mark.parametrize("mask_fn", [attention_mask, causal_only])
def test_packed_loss_equals_alone(mask_fn):
    """Each sequence's per-token loss in the packed batch equals its loss run alone, as close
    to the float64 result as the float32 run alone is (10x its error + 16 eps32); the control
    mask (across segments) is far off."""
    seqs = corpus(14, 14)
    packed = pack(seqs, rows=ROWS, length=LENGTH)
    packed32 = packed_loss(PARAMS, packed, mask_fn)
    batch = one_per_row(seqs)
    alone32 = per_sequence(jax.jit(alone_losses)(PARAMS, batch), seqs)
    with jax.enable_x64(True):
        alone64 = per_sequence(jax.jit(alone_losses)(to_float64(PARAMS), batch), seqs)
    # the reference is the sequence run alone: in a row of its own length, the same
    for i in (1, 2):
        n = len(seqs[i])
        exact = loss_fn(PARAMS, seqs[i][None], jnp.ones((1, n), jnp.int32),
                        jnp.arange(n)[None], mask_fn=plain_causal)
        err, _, bound = rounding_error_ratio(exact[0, : n - 1], alone32[i], alone64[i])
        assert err <= bound
    target = transformer.target_segment_ids(packed.segment_ids)
    got = []
    for i, s in enumerate(seqs):
        where = (packed.sequence_index == i) & (np.asarray(target) > 0)
        got.append(packed32[where])  # row-major: in position order
        assert got[-1].shape == (len(s) - 1,)
    if mask_fn is attention_mask:
        assert_within_rounding(got, alone32, alone64)
    else:
        err, _, bound = rounding_error_ratio(got, alone32, alone64)
        assert err > 1000 * bound


# --- normalisation over micro-batches ----------------------------------------------------------


def unpacked_means(params, batch):
    """The unpacked batch's token mean and sequence mean: each sequence alone, its targets
    all its tokens but the last; sequences of one token have none and count for neither."""
    losses = alone_losses(params, batch)
    targets = jnp.sum(transformer.target_segment_ids(batch[1]) > 0, axis=1)
    present = targets > 0
    seq_means = jnp.sum(losses, axis=1) / jnp.maximum(targets, 1)
    return (jnp.sum(losses) / jnp.sum(targets),
            jnp.sum(jnp.where(present, seq_means, 0)) / jnp.sum(present))


@pytest.fixture(scope="module")
def normalisation_case():
    seqs = corpus(15, 16)
    packed = pack(seqs, rows=ROWS, length=LENGTH)
    packed = pack(seqs, rows=ROWS, length=LENGTH, max_microbatches=packed.num_microbatches + 1)
    batch = one_per_row(seqs)
    full32 = jax.jit(unpacked_means)(PARAMS, batch)
    with jax.enable_x64(True):
        ref64 = tuple(np.float64(v) for v in jax.jit(unpacked_means)(to_float64(PARAMS), batch))
    return seqs, packed, batch, full32, ref64


@pytest.mark.parametrize("which", [0, 1], ids=["token_mean", "sequence_mean"])
def test_weighted_microbatch_means_equal_unpacked_mean(normalisation_case, which):
    """sum_i v_i w_i / sum_i w_i over the micro-batches (one all padding) equals the unpacked
    mean within float32 rounding; the mean of the per-micro-batch means does not."""
    seqs, packed, _, full32, ref64 = normalisation_case
    helper = (token_mean, sequence_mean)[which]
    loss = packed_loss(PARAMS, packed)
    target = transformer.target_segment_ids(packed.segment_ids)
    pairs = [helper(loss[m], target[m]) for m in range(packed.tokens.shape[0])]
    v = np.array([p[0] for p in pairs], np.float32)
    w = np.array([p[1] for p in pairs], np.float32)
    assert packed.num_microbatches >= 3 and w[-1] == 0.0 and v[-1] == 0.0
    counts = [len(s) - 1 for s in seqs]
    assert w.sum() == (sum(counts) if which == 0 else sum(c > 0 for c in counts))
    combined = np.sum(v * w, dtype=np.float32) / np.sum(w, dtype=np.float32)
    err, _ = assert_within_rounding(combined, full32[which], ref64[which])
    naive = np.mean(v[: packed.num_microbatches])
    _, _, bound = rounding_error_ratio(naive, full32[which], ref64[which])
    assert max_rel_diff(naive, ref64[which]) > 100 * bound


@pytest.mark.parametrize("which", [0, 1], ids=["token_mean", "sequence_mean"])
def test_value_and_grad_weighted_over_packed_microbatches(normalisation_case, which):
    """jaxaccum.value_and_grad(weighted=True) over the packed micro-batches gives the loss and
    gradient of the unpacked batch within float32 rounding (float64 reference); unweighted
    (a mean of per-micro-batch means) the gradient is far off."""
    _, packed, unpacked, _, _ = normalisation_case
    helper = (token_mean, sequence_mean)[which]
    m = packed.tokens.shape[0]

    def loss(params, batch):
        tokens, seg, pos = batch
        per_token = transformer.per_token_loss(params, tokens, seg, pos)
        return helper(per_token, transformer.target_segment_ids(seg))

    # (M, rows, L) -> (rows * M, L) with row j of micro-batch i at j * M + i: value_and_grad
    # splits strided (micro-batch i takes i, i + M, ...), so it sees the packed micro-batches
    batch = tuple(jnp.asarray(a.transpose(1, 0, 2).reshape(-1, LENGTH))
                  for a in (packed.tokens, packed.segment_ids, packed.positions))
    got = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=m, weighted=True))(
        PARAMS, batch)
    reference = jax.jit(jax.value_and_grad(lambda p, s: unpacked_means(p, s)[which]))
    full32 = reference(PARAMS, unpacked)
    with jax.enable_x64(True):
        ref64 = jax.tree.map(lambda x: np.asarray(x, np.float64),
                             reference(to_float64(PARAMS), unpacked))
    assert_within_rounding(got, full32, ref64)
    naive = jax.jit(jaxaccum.value_and_grad(lambda p, b: loss(p, b)[0],
                                            num_microbatches=packed.num_microbatches))(
        PARAMS, tuple(a.reshape(ROWS, m, LENGTH)[:, : packed.num_microbatches]
                      .reshape(-1, LENGTH) for a in batch))
    _, _, bound = rounding_error_ratio(naive[1], full32[1], ref64[1])
    assert max_rel_diff(naive[1], ref64[1]) > 100 * bound


@pytest.mark.parametrize("length", [15, 16])
def test_sequence_mean_of_rows_full_of_one_token_sequences(length):
    """Every row holds ``length`` sequences of one token: each sequence's mean is its token,
    so the mean over sequences is the mean over tokens (float64 within (length + S + 2) eps)."""
    rng = np.random.default_rng(5)
    seg = np.tile(np.arange(1, length + 1, dtype=np.int32), (3, 1))
    loss = rng.exponential(size=seg.shape).astype(np.float32)
    value, weight = sequence_mean(loss, seg)
    exact = float(np.mean(loss, dtype=np.float64))
    assert float(weight) == seg.size
    assert abs(float(value) - exact) <= (length + seg.size + 2) * EPS32 * exact


def test_attention_mask_of_one_row_given_without_batch_axes():
    """``(..., length)`` segment ids: a single row of shape ``(length,)`` is masked as the
    same row inside a batch."""
    seg = jnp.array([1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(attention_mask(seg), attention_mask(seg[None])[0])
    assert attention_mask(seg).shape == (6, 6)
