"""Token-budget packing of variable-length sequences, and the losses that keep it exact.

:func:`pack` (:func:`pack_epoch` for a corpus, a step at a time, and :func:`pack_stream` for a
data pipeline) packs whole sequences of token ids
into rows of ``length`` tokens and groups the rows into micro-batches of ``rows`` rows, on the
host, with NumPy only. Each token carries its segment id (which sequence of its row it belongs
to, 0 for padding) and its position within its sequence; :func:`attention_mask` turns the
segment ids into the mask that keeps packed sequences from seeing each other.

Packing changes how many real tokens (and sequences) each micro-batch holds, so a mean over
each micro-batch, averaged over the micro-batches, is no longer the batch's mean: it weights the
tokens of sparse micro-batches more. :func:`token_mean` and :func:`sequence_mean` return
``(mean over the micro-batch's items, number of items)``, the pair the accumulation's
``weighted=True`` option takes; it then computes ``sum_i value_i * weight_i / sum_i weight_i``,
the exact mean over every item of every micro-batch, as one unpacked batch would.
"""

from jaxaccum.packing._layout import Packed, pack, pack_epoch
from jaxaccum.packing._losses import attention_mask, next_token_segments, sequence_mean, token_mean
from jaxaccum.packing._stream import PackStream, pack_stream

__all__ = ["PackStream", "Packed", "attention_mask", "next_token_segments", "pack", "pack_epoch",
           "pack_stream", "sequence_mean", "token_mean"]
