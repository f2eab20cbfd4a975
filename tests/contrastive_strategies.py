"""Hypothesis strategies for the documented input space of jaxaccum.contrastive (shared by
tests/test_contrastive.py): one or two side lengths and a tile (tiles that divide neither side,
a tile longer than one side but not the other, one tile for everything), masks whose padding
fills the first tile, a middle tile, the last tile or everything but one example (a tile of
padding only), pytree sides and float params. Small shapes: every draw compiles."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

# where a mask's False entries are (padding): none, scattered, or whole tiles of it
MASKS = ("none", "random", "first tile", "middle tile", "last tile", "all but one")


@st.composite
def lengths(draw: Any, equal: bool, many_tiles: bool = False) -> tuple[int, int, int]:
    """``(n_a, n_b, tile)``. ``equal``: one length for both sides (clip_loss, siglip_loss).
    ``many_tiles``: at least 5 tiles a side (sums over many tiles, for the bf16 checks)."""
    if many_tiles:
        tile = draw(st.integers(2, 5))
        n_a = draw(st.integers(5 * tile + 1, 36))
        return n_a, n_a if equal else draw(st.integers(5 * tile + 1, 36)), tile
    kind = draw(st.sampled_from(["divides neither", "between the sides", "one tile"]))
    if kind == "divides neither":  # several tiles each way, the last of each side short
        tile = draw(st.integers(2, 7))
        sides = [draw(st.integers(tile + 1, 30).filter(lambda n: n % tile)) for _ in "ab"]
    elif kind == "between the sides" and not equal:  # n_short < tile <= n_long
        short = draw(st.integers(1, 10))
        tile = draw(st.integers(short + 1, 14))
        sides = [short, draw(st.integers(tile, 30))]
        if draw(st.booleans()):
            sides.reverse()
    else:  # a tile longer than both sides (the tile is cut to them)
        sides = [draw(st.integers(1, 20)) for _ in "ab"]
        tile = draw(st.integers(max(sides), 40))
    if equal:
        sides[1] = sides[0]
    return sides[0], sides[1], tile


@st.composite
def masks(draw: Any, n: int, tile: int) -> np.ndarray:
    """A ``(n,)`` boolean mask (True: kept) for a side of ``n`` examples cut in tiles of
    ``tile``, with at least one example kept; its padding as :data:`MASKS` says."""
    t = min(tile, n)
    rows = -(-n // t)
    kind = draw(st.sampled_from(MASKS))
    mask = np.ones(n, bool)
    if kind == "random":
        mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
    elif kind == "first tile":
        mask[:t] = False
    elif kind == "middle tile":
        r = draw(st.integers(0, rows - 1)) if rows < 3 else draw(st.integers(1, rows - 2))
        mask[r * t:(r + 1) * t] = False
    elif kind == "last tile":
        mask[(rows - 1) * t:] = False
    elif kind == "all but one":
        mask[:] = False
        mask[draw(st.integers(0, n - 1))] = True
    if not mask.any():  # the padding filled the only tile: keep one example (a loss needs one)
        mask[draw(st.integers(0, n - 1))] = True
    return mask


def normal(seed: int, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


@st.composite
def pair_cases(draw: Any, many_tiles: bool = False) -> dict[str, Any]:
    """clip_loss / siglip_loss inputs: ``a``, ``b`` ``(n, d)`` float32, one mask, a tile, float
    ``logit_scale`` and ``logit_bias``."""
    n, _, tile = draw(lengths(equal=True, many_tiles=many_tiles))
    d, seed = draw(st.integers(1, 5)), draw(st.integers(0, 2**16))
    return {"a": normal(seed, n, d), "b": normal(seed + 1, n, d), "tile": tile,
            "mask": draw(masks(n, tile)),
            "logit_scale": np.float32(draw(st.floats(-1.0, 2.0, width=32))),
            "logit_bias": np.float32(draw(st.floats(-5.0, 2.0, width=32)))}


@st.composite
def block_cases(draw: Any, many_tiles: bool = False) -> dict[str, Any]:
    """pairwise_logsumexp / pairwise_sum inputs: pytree sides ``a = {"u": (n_a, d), "v":
    (n_a, k)}`` and ``b = (y (n_b, d), w (n_b, k))``, float params ``{"t", "c"}``, a tile and a
    mask for each side."""
    n_a, n_b, tile = draw(lengths(equal=False, many_tiles=many_tiles))
    d, k, seed = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(0, 2**16))
    return {"a": {"u": normal(seed, n_a, d), "v": normal(seed + 1, n_a, k)},
            "b": (normal(seed + 2, n_b, d), normal(seed + 3, n_b, k, scale=0.5)),
            "params": {"t": np.float32(draw(st.floats(-1.0, 1.0, width=32))),
                       "c": np.float32(draw(st.floats(-1.0, 1.0, width=32)))},
            "tile": tile, "mask_a": draw(masks(n_a, tile)), "mask_b": draw(masks(n_b, tile))}
