"""jaxaccum.grain: the packer as a Grain transformation, its state, and packed batches as
micro-batches (the promises of the module's docstrings)."""

from __future__ import annotations

import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


options = st.fixed_dictionaries({
    "rows": st.integers(1, 3), "length": st.integers(4, 12),
    "max_microbatches": st.integers(1, 4), "lookahead": st.integers(1, 6),
    "pad_id": st.integers(-1, 3)})


@settings(max_examples=25, deadline=None)
@given(options=options, data=st.data())
def test_the_dataset_yields_pack_streams_steps(options, data):
    """Every element is the step pack_stream yields for the same sequences, in order, whether
    the elements are the token ids or a mapping holding them under ``key``."""
    lengths = data.draw(st.lists(st.integers(1, options["length"]), min_size=0, max_size=30))
    seqs = corpus(lengths)
    expected = list(pack_stream(iter(seqs), **options))
    got = list(PackIterDataset(grain.MapDataset.source(seqs), **options))
    assert_same_steps(got, expected)
    mapped = grain.MapDataset.source([{"tokens": s, "other": 0} for s in seqs])
    assert_same_steps(list(PackIterDataset(mapped, key="tokens", **options)), expected)


@settings(max_examples=25, deadline=None)
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


def test_options_are_checked_when_the_dataset_is_made():
    docs = grain.MapDataset.source(corpus([3, 4]))
    with pytest.raises(ValueError, match=r"pack_stream.*rows"):
        PackIterDataset(docs, rows=0, length=4, max_microbatches=1)
    with pytest.raises(TypeError, match=r"PackIterDataset: parent must be a grain"):
        PackIterDataset(corpus([3]), rows=1, length=4, max_microbatches=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"PackIterDataset: key=.tokens. needs mapping"):
        list(PackIterDataset(docs, rows=1, length=4, max_microbatches=1, key="tokens"))


def grain_batches(lengths: list[int], length: int, bins: int, batch: int) -> list[dict]:
    docs = grain.MapDataset.source([{"tokens": s} for s in corpus(lengths, seed=2)])
    packed = FirstFitPackIterDataset(docs.to_iter_dataset(), length_struct={"tokens": length},
                                     num_packing_bins=bins)
    return list(packed.batch(batch, drop_remainder=False))


@settings(max_examples=20, deadline=None)
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
                                         r"Packed batch's own"):
        to_microbatches(packed, rows=2, max_microbatches=3)


def test_to_microbatches_refuses_what_it_cannot_lay_out():
    batch = {"tokens": np.ones((5, 4), np.int32), "segment_ids": np.ones((5, 4), np.int32),
             "positions": np.zeros((5, 4), np.int32)}
    with pytest.raises(ValueError, match=r"needs rows= and max_microbatches="):
        to_microbatches(batch)
    with pytest.raises(ValueError, match=r"5 rows, more than .* 2 \* 2: raise max_microbatches "
                                         r"to at least 3"):
        to_microbatches(batch, rows=2, max_microbatches=2)
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
