"""A tiny causal transformer language model in pure JAX, for the packing tests.

Params are a dict of arrays (the number of heads is read from their shapes), so ``jax.grad``
and the float64 casts of ``conftest.to_float64`` apply as they are. Every op but attention
works token by token; attention uses :func:`jaxaccum.packing.attention_mask` (causal, same
segment, not padding), with masked scores set to the dtype's most negative finite value, so a
masked entry gets exactly 0 weight and a padding query (no key allowed) stays finite.

The targets are the **next tokens within the same segment**: position t of segment s predicts
token t + 1 if that token is in segment s too. The last token of each sequence and padding have
no target; their loss is 0 and :func:`target_segment_ids` gives 0 there, the segment ids to
pass to ``token_mean``/``sequence_mean`` so that exactly the predicted tokens are counted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum.packing import attention_mask, next_token_segments


def init_params(key, *, vocab=13, d_model=16, heads=2, layers=2, max_len=32,
                dtype=jnp.float32):
    """Random parameters: token and learned position embeddings, ``layers`` pre-norm blocks
    (multi-head attention and a tanh MLP), a final norm and the output projection."""
    d_head = d_model // heads
    keys = iter(jax.random.split(key, 3 + 6 * layers))

    def normal(shape, scale):
        return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

    params = {
        "embed": normal((vocab, d_model), 1.0),
        "pos": normal((max_len, d_model), 0.5),
        "out_norm": jnp.ones(d_model, dtype),
        "out": normal((d_model, vocab), 1 / np.sqrt(d_model)),
    }
    for i in range(layers):
        params[f"block{i}"] = {
            "norm1": jnp.ones(d_model, dtype),
            "wq": normal((heads, d_model, d_head), 1 / np.sqrt(d_model)),
            "wk": normal((heads, d_model, d_head), 1 / np.sqrt(d_model)),
            "wv": normal((heads, d_model, d_head), 1 / np.sqrt(d_model)),
            "wo": normal((heads, d_head, d_model), 1 / np.sqrt(d_model)),
            "norm2": jnp.ones(d_model, dtype),
            "w1": normal((d_model, 2 * d_model), 1 / np.sqrt(d_model)),
            "w2": normal((2 * d_model, d_model), 1 / np.sqrt(2 * d_model)),
        }
    return params


def _norm(x, scale):
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale


def _attention(block, x, mask):
    q = jnp.einsum("...ld,hdk->...hlk", x, block["wq"])
    k = jnp.einsum("...ld,hdk->...hlk", x, block["wk"])
    v = jnp.einsum("...ld,hdk->...hlk", x, block["wv"])
    scores = jnp.einsum("...hqk,...hsk->...hqs", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask[..., None, :, :], scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    heads = jnp.einsum("...hqs,...hsk->...hqk", weights, v)
    return jnp.einsum("...hqk,hkd->...qd", heads, block["wo"])


def logits(params, tokens, segment_ids, positions, *, mask_fn=attention_mask):
    """Logits ``(..., length, vocab)`` for int ``(..., length)`` tokens, segment ids and
    positions. ``mask_fn(segment_ids)`` gives the attention mask (the tests swap in a wrong one
    to show that they notice)."""
    mask = mask_fn(segment_ids)
    x = params["embed"][tokens] + params["pos"][positions]
    i = 0
    while f"block{i}" in params:
        block = params[f"block{i}"]
        x = x + _attention(block, _norm(x, block["norm1"]), mask)
        h = _norm(x, block["norm2"])
        x = x + jnp.tanh(h @ block["w1"]) @ block["w2"]
        i += 1
    return _norm(x, params["out_norm"]) @ params["out"]


target_segment_ids = next_token_segments  # the library's helper


def per_token_loss(params, tokens, segment_ids, positions, *, mask_fn=attention_mask):
    """Next-token cross-entropy per position, ``(..., length)``: position t predicts token
    t + 1 of its own segment; 0 where there is no such target (see :func:`target_segment_ids`).
    """
    logp = jax.nn.log_softmax(logits(params, tokens, segment_ids, positions, mask_fn=mask_fn))
    targets = jnp.concatenate([tokens[..., 1:], jnp.zeros_like(tokens[..., :1])], axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.where(target_segment_ids(segment_ids) > 0, nll, 0)
