"""jaxaccum.grain: the packer as a Grain transformation, its state, and packed batches as
micro-batches (the promises of the module's docstrings)."""

from __future__ import annotations

import functools
import json
import pathlib
import tempfile

import grain
import jax
import jax.numpy as jnp
import numpy as np
import packing_strategies as strategies
import pytest
from conftest import EPS32, examples
from grain.experimental import FirstFitPackIterDataset
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxaccum
from jaxaccum.grain import PackIterDataset, to_microbatches
from jaxaccum.packing import Packed, pack_stream, token_mean

FIELDS = ("tokens", "segment_ids", "positions", "sequence_index")


def corpus(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 50, size=n).astype(np.int32) for n in lengths]


def assert_same_steps(got: list[Packed], expected: list[Packed]) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.num_microbatches == b.num_microbatches, i
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f"step {i} {f}")


# every option over its documented domain: a length of 1, a lookahead of 1, pad_id negative,
# 0, a real token id (3, 7: the corpus draws 1..49) or int32's largest
options = strategies.stream_options()


@settings(max_examples=examples(25), deadline=None)
@given(options=options, data=st.data())
def test_the_dataset_yields_pack_streams_steps(options, data):
    """Every element is the step pack_stream yields for the same sequences, in order, whether
    the elements are the token ids or a mapping holding them under ``key``."""
    lengths = data.draw(strategies.lengths_for(options["length"], max_size=30))
    seqs = corpus(lengths)
    expected = list(pack_stream(iter(seqs), **options))
    got = list(PackIterDataset(grain.MapDataset.source(seqs), **options))
    assert_same_steps(got, expected)
    mapped = grain.MapDataset.source([{"tokens": s, "other": 0} for s in seqs])
    assert_same_steps(list(PackIterDataset(mapped, key="tokens", **options)), expected)


@settings(max_examples=examples(25), deadline=None)
@given(options=options, data=st.data())
def test_a_restored_iterator_continues_bitwise_and_every_sequence_is_packed_once(options, data):
    """Stopped after any number of steps, its state saved as JSON and restored into a fresh
    iterator of the same (shuffled) dataset: the steps that follow are the uninterrupted
    iterator's, bitwise, and across the restart every sequence is packed exactly once."""
    lengths = data.draw(st.lists(st.integers(1, options["length"]), min_size=1, max_size=30))
    seqs = corpus(lengths, seed=1)
    shuffled = grain.MapDataset.source(seqs).shuffle(seed=3).to_iter_dataset()
    dataset = PackIterDataset(shuffled, **options)
    whole = list(dataset)
    stop = data.draw(st.integers(0, len(whole)))
    first = iter(dataset)
    before = [next(first) for _ in range(stop)]
    state = json.loads(json.dumps(first.get_state()))
    resumed = iter(dataset)
    resumed.set_state(state)
    after = list(resumed)
    assert_same_steps(before + after, whole)
    # the arrival indices of the sequences packed: each of 0..n-1 once, and the tokens are
    # the shuffled dataset's element of that index
    order = list(shuffled)
    seen = []
    for p in before + after:
        for i in np.unique(p.sequence_index[p.segment_ids > 0]):
            seen.append(int(i))
            np.testing.assert_array_equal(p.tokens[p.sequence_index == i], order[i])
    assert sorted(seen) == list(range(len(seqs)))


# --- the iterator's state at every point of the stream ------------------------------------


def finished(it) -> bool:
    """The iterator is at its end and stays there: StopIteration, and again."""
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    return True


def grain_checkpoint(it, directory: pathlib.Path, restore_into) -> None:
    """Saves ``it`` and restores into ``restore_into`` through Grain's own checkpoint handler
    (the one Orbax's ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore`` use)."""
    directory.mkdir()
    grain.checkpoint.CheckpointHandler().save(directory, item=it)
    grain.checkpoint.CheckpointHandler().restore(directory, item=restore_into)


@settings(max_examples=examples(30), deadline=None)
@given(options=strategies.stream_options(), data=st.data())
def test_a_state_saved_anywhere_even_after_the_end_restores_fresh_or_same_iterators(options,
                                                                                     data):
    """States saved after 0, 1, ..., n elements and after the end (StopIteration reached, and
    next called past it again), through JSON (and, for the first and the last, Grain's
    checkpoint handler), restored into a fresh iterator, into the same iterator once it ran to
    its end, and into one that ran an element further: the elements that follow are the
    uninterrupted iterator's, bitwise; every sequence is packed exactly once across the
    restart; after the end nothing follows and StopIteration is raised again."""
    lengths = data.draw(strategies.lengths_for(options["length"], max_size=12))
    seqs = corpus(lengths, seed=4)
    # read on this thread, in an order of our own: Grain's default prefetch starts a thread
    # pool for each of the many iterators made here, and its shuffle costs ~10 ms an element
    # (both are the test above's)
    order = [seqs[i] for i in np.random.default_rng(5).permutation(len(seqs))]
    unthreaded = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    dataset = PackIterDataset(grain.MapDataset.source(order).to_iter_dataset(unthreaded),
                              **options)
    whole = list(dataset)
    exhausted = iter(dataset)
    assert len(list(exhausted)) == len(whole)
    for stop in range(len(whole) + 3):
        first = iter(dataset)
        before = [next(first) for _ in range(min(stop, len(whole)))]
        if stop > len(whole):  # saved once StopIteration was raised (once, or twice)
            for _ in range(stop - len(whole)):
                with pytest.raises(StopIteration):
                    next(first)
        state = json.loads(json.dumps(first.get_state()))
        # the exhausted one is the same iterator for every stop: each restore runs it to its
        # end again, so it is restored once exhausted, again and again
        targets = {"fresh": iter(dataset), "exhausted": exhausted, "further": iter(dataset)}
        for _ in range(min(stop + 1, len(whole))):
            next(targets["further"])
        for name, it in targets.items():
            if name == "fresh" and stop in (0, len(whole) + 2):
                with tempfile.TemporaryDirectory() as tmp:
                    grain_checkpoint(first, pathlib.Path(tmp) / "data", it)
            else:
                it.set_state(state)
            after = list(it)
            assert finished(it), name
            assert_same_steps(before + after, whole)
            seen = []
            for p in before + after:
                for i in np.unique(p.sequence_index[p.segment_ids > 0]):
                    seen.append(int(i))
                    np.testing.assert_array_equal(p.tokens[p.sequence_index == i], order[i])
            assert sorted(seen) == list(range(len(seqs))), name


# --- packed batches as micro-batches: empty ones anywhere, float fields -----------------------


LENGTH = 6
EMB = np.random.default_rng(7).normal(size=(50, 3)).astype(np.float32)


@functools.cache
def token_mean_grad(k: int):
    """A max_microbatches=k value_and_grad of the weighted token mean of a linear model's
    squared output, ``weights * (EMB[tokens] @ w) ** 2`` per token (one compile per k)."""

    def loss(w, data):
        tokens, segment_ids, weights = data
        per_token = weights.astype(jnp.float32) * (jnp.asarray(EMB)[tokens] @ w) ** 2
        return token_mean(per_token, segment_ids)

    return jax.jit(jaxaccum.value_and_grad(loss, max_microbatches=k, weighted=True))


@st.composite
def grain_batch(draw):
    """A batch as Grain's packers give it, ``(n, LENGTH)`` arrays: micro-batches of ``rows``
    rows, each all padding or holding real rows (an empty one first, between real ones, last,
    or all of them), padding rows among them, the last micro-batch possibly short (n < K *
    rows); a float field of per-token loss weights (float32 or bfloat16) next to the tokens."""
    # K = 3: an empty micro-batch can be first, between real ones, last (one K, two rows,
    # two dtypes: four compiles)
    rows, k = draw(st.integers(1, 2)), 3
    real_mb = draw(st.lists(st.booleans(), min_size=k, max_size=k))
    n = draw(st.integers((k - 1) * rows + 1, k * rows))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    segment_ids = np.zeros((n, LENGTH), np.int32)
    for r in range(n):
        if real_mb[r // rows] and (r % rows == 0 or draw(st.booleans())):
            cuts = np.sort(rng.integers(0, LENGTH + 1, size=2))
            segment_ids[r, :cuts[0] or 1] = 1  # a first sequence of at least one token
            segment_ids[r, max(cuts[0], 1):cuts[1]] = 2
    tokens = np.where(segment_ids > 0, rng.integers(1, 50, size=(n, LENGTH)), 0)
    dtype = draw(st.sampled_from([np.float32, jnp.bfloat16]))
    weights = np.where(segment_ids > 0, rng.uniform(0.25, 2.0, size=(n, LENGTH)), 0)
    batch = {"tokens": tokens.astype(np.int32), "tokens_segment_ids": segment_ids,
             "loss_weights": weights.astype(dtype)}
    return batch, rows, k


@settings(max_examples=examples(20), deadline=None)
@given(case=grain_batch())
def test_empty_microbatches_anywhere_and_float_fields_give_the_token_mean(case):
    """to_microbatches of a batch whose empty micro-batches lie anywhere (first, between,
    last, all) with a float field of loss weights (float32 or bfloat16): every field keeps
    its dtype and values, padded with zeros to ``(K, rows, LENGTH)``; the count runs to the
    last micro-batch holding a real token; a weighted ``max_microbatches=K`` value_and_grad
    over it is the weighted token mean over the real tokens of the whole batch (float64
    reference), and with no real token at all zero loss and gradient."""
    batch, rows, k = case
    fields = ("tokens", "tokens_segment_ids", "loss_weights")
    mb = to_microbatches(batch, rows=rows, max_microbatches=k, fields=fields,
                         segment_ids="tokens_segment_ids")
    n = batch["tokens"].shape[0]
    used = [r // rows for r in range(n) if batch["tokens_segment_ids"][r].any()]
    assert mb.count.dtype == np.int32 and int(mb.count) == (max(used) + 1 if used else 0)
    for name, stacked in zip(fields, mb.data, strict=True):
        assert stacked.dtype == batch[name].dtype and stacked.shape == (k, rows, LENGTH)
        flat = stacked.reshape(k * rows, LENGTH)
        np.testing.assert_array_equal(flat[:n], batch[name])
        assert not flat[n:].astype(np.float32).any()
    w = jnp.asarray([0.5, -1.0, 0.75], jnp.float32)
    value, grad = token_mean_grad(k)(w, mb)
    assert value.dtype == grad.dtype == jnp.float32
    real = batch["tokens_segment_ids"] > 0
    count = int(real.sum())
    if not count:
        assert float(value) == 0.0 and not np.asarray(grad).any()
        return
    # float64 reference over the real tokens: the weights as stored (bfloat16 values are
    # exact in float64), h = EMB[t] @ w per token, loss sum(c h^2) / N, grad sum(2 c h EMB[t]) / N
    c = batch["loss_weights"].astype(np.float64)[real]
    e = EMB.astype(np.float64)[batch["tokens"][real]]
    h = e @ np.asarray(w, np.float64)
    want_value = np.sum(c * h**2) / count
    terms = 2 * (c * h)[:, None] * e
    want_grad = terms.sum(axis=0) / count
    # float32 error: each term a few roundings (dot of 3, square, product: <= 8 eps |term|),
    # summed over the N tokens in some order (<= N eps sum|terms|), then the division and the
    # weighted combination over at most K micro-batches (<= (K + 4) eps): all within
    # (N + K + 12) eps * sum|terms| / N, an absolute bound from the terms' own magnitude
    bound = (count + k + 12) * EPS32
    assert abs(float(value) - want_value) <= bound * np.sum(np.abs(c * h**2)) / count
    assert np.all(np.abs(np.asarray(grad, np.float64) - want_grad)
                  <= bound * np.abs(terms).sum(axis=0) / count)


def test_options_are_checked_when_the_dataset_is_made():
    docs = grain.MapDataset.source(corpus([3, 4]))
    for bad in ("rows", "length", "max_microbatches", "lookahead"):
        counts = {"rows": 1, "length": 4, "max_microbatches": 1, bad: 0}
        with pytest.raises(ValueError, match=rf"^jaxaccum\.grain\.PackIterDataset: {bad} "
                                             r"must be >= 1"):
            PackIterDataset(docs, **counts)
    with pytest.raises(TypeError, match=r"^jaxaccum\.grain\.PackIterDataset: pad_id must be"):
        PackIterDataset(docs, rows=1, length=4, max_microbatches=1, pad_id=0.5)
    with pytest.raises(TypeError, match=r"PackIterDataset: parent must be a grain"):
        PackIterDataset(corpus([3]), rows=1, length=4, max_microbatches=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"PackIterDataset: key=.tokens. needs mapping"):
        list(PackIterDataset(docs, rows=1, length=4, max_microbatches=1, key="tokens"))
    # read while iterating: errors name this entry point and the element by its index
    with pytest.raises(ValueError, match=r"^jaxaccum\.grain\.PackIterDataset: parent\[1\] "
                                         r"has 4 tokens, more than a row holds \(length=3\)"):
        list(PackIterDataset(docs, rows=1, length=3, max_microbatches=1))
    mapped = grain.MapDataset.source([{"ids": s} for s in corpus([3, 4])])
    with pytest.raises(KeyError, match=r"PackIterDataset: key='tokens': an element of the "
                                       r"parent has no such key; its keys are \['ids'\]"):
        list(PackIterDataset(mapped, rows=1, length=4, max_microbatches=1, key="tokens"))


def grain_batches(lengths: list[int], length: int, bins: int, batch: int) -> list[dict]:
    docs = grain.MapDataset.source([{"tokens": s} for s in corpus(lengths, seed=2)])
    packed = FirstFitPackIterDataset(docs.to_iter_dataset(), length_struct={"tokens": length},
                                     num_packing_bins=bins)
    return list(packed.batch(batch, drop_remainder=False))


@settings(max_examples=examples(20), deadline=None)
@given(rows=st.integers(1, 3), extra=st.integers(0, 3), empty=st.integers(0, 4),
       lengths=st.lists(st.integers(1, 8), min_size=1, max_size=20))
def test_a_grain_batch_becomes_the_microbatches_of_its_rows(rows, extra, empty, lengths):
    """Grain's packed rows, ``rows`` a micro-batch, in order, padded with zeros to K
    micro-batches; the count is up to the last micro-batch holding a real token."""
    batch = grain_batches(lengths, 8, 4, 64)[0]
    batch = {key: np.concatenate([v, np.zeros((empty, 8), v.dtype)]) for key, v in batch.items()}
    n = batch["tokens"].shape[0]
    k = -(-n // rows) + extra
    fields = ("tokens", "tokens_segment_ids", "tokens_positions")
    mb = to_microbatches(batch, rows=rows, max_microbatches=k, fields=fields,
                         segment_ids="tokens_segment_ids")
    real = n - empty
    assert int(mb.count) == -(-real // rows)
    assert mb.count.dtype == np.int32
    for name, stacked in zip(fields, mb.data, strict=True):
        assert stacked.shape == (k, rows, 8)
        flat = stacked.reshape(k * rows, 8)
        np.testing.assert_array_equal(flat[:n], batch[name])
        assert not flat[n:].any()


def test_a_packed_batch_becomes_its_own_microbatches():
    packed = next(iter(PackIterDataset(grain.MapDataset.source(corpus([3, 5, 2, 7])), rows=2,
                                       length=8, max_microbatches=3)))
    mb = to_microbatches(packed)
    expected = packed.microbatches()
    assert int(mb.count) == packed.num_microbatches == int(expected.count)
    for a, b in zip(mb.data, expected.data, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"to_microbatches: rows and max_microbatches are a "
                                         r"Packed batch's own \(2 and 3\)"):
        to_microbatches(packed, rows=2, max_microbatches=3)
    # padding is token 0 unless pad_id says otherwise, as in jaxaccum.packing
    assert (packed.segment_ids == 0).any() and not packed.tokens[packed.segment_ids == 0].any()


def test_to_microbatches_refuses_what_it_cannot_lay_out():
    batch = {"tokens": np.ones((5, 4), np.int32), "segment_ids": np.ones((5, 4), np.int32),
             "positions": np.zeros((5, 4), np.int32)}
    with pytest.raises(ValueError, match=r"needs rows= and max_microbatches="):
        to_microbatches(batch)
    with pytest.raises(ValueError, match=r"5 rows, more than .* 2 \* 2: raise max_microbatches "
                                         r"to at least 3"):
        to_microbatches(batch, rows=2, max_microbatches=2)
    seven = {k: np.ones((7, 4), np.int32) for k in batch}  # 3 * 2 < 7 rows (< 3 ** 2)
    with pytest.raises(ValueError, match=r"7 rows, more than .* 3 \* 2: raise max_microbatches "
                                         r"to at least 4"):
        to_microbatches(seven, rows=2, max_microbatches=3)
    with pytest.raises(ValueError, match=r"has no \['weights'\]"):
        to_microbatches(batch, rows=1, max_microbatches=5, fields=("tokens", "weights"))
    with pytest.raises(ValueError, match=r"all of one shape"):
        to_microbatches({**batch, "positions": np.zeros((4, 4))}, rows=1, max_microbatches=5)
    with pytest.raises(ValueError, match=r"Packed or a mapping"):
        to_microbatches([1, 2], rows=1, max_microbatches=5)


def test_a_grain_batch_through_a_runtime_count_step_is_the_token_mean():
    """Grain's packed batch, as micro-batches of a ``max_microbatches`` value_and_grad with
    the token-mean loss: the loss and gradient of the token mean over the whole batch."""
    batch = grain_batches([3, 7, 2, 8, 5, 1, 6, 4, 2], 8, 3, 16)[0]
    emb = jax.random.normal(jax.random.key(0), (50, 4))

    def per_token(w, tokens):
        return (emb[tokens] @ w) ** 2

    def loss(w, data):
        tokens, segment_ids = data
        return token_mean(per_token(w, tokens), segment_ids)

    w = jnp.linspace(-1.0, 1.0, 4)
    mb = to_microbatches(batch, rows=2, max_microbatches=4, fields=("tokens",
                         "tokens_segment_ids"), segment_ids="tokens_segment_ids")
    got = jaxaccum.value_and_grad(loss, max_microbatches=4, weighted=True)(w, mb)

    def full(w):
        real = batch["tokens_segment_ids"] > 0
        return jnp.sum(jnp.where(real, per_token(w, batch["tokens"]), 0)) / real.sum()

    expected = jax.value_and_grad(full)(w)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    scale = np.abs(expected[1]).max()
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6 * scale)
