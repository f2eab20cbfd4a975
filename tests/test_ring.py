"""The tiled contrastive losses by a ring over 8 host devices (tests/multidevice/ring.py):
equal to one device (value and gradients of both sides, the scale and the bias; Auto and
Explicit meshes; inside coupled_value_and_grad); the representations travel by
collective-permute, never all-gathered; the coupled step reduces its gradient once."""

from __future__ import annotations

import pytest
from launcher import run_program

# float32 sums over 192 x 192 pairs in another order: measured ~3e-7 (relative to the
# largest of each leaf, or 1); a missing block or a double-counted one is O(1e-1).
EXACT = 1e-5


@pytest.fixture(scope="module")
def out():
    return run_program("ring", devices=8, timeout=600)


@pytest.mark.parametrize("case", ["clip/auto", "clip/explicit", "siglip/auto",
                                  "siglip/explicit"])
def test_the_ring_equals_one_device_and_gathers_nothing(out, case):
    r = out[case]
    assert max(r["rel"]) <= EXACT, r["rel"]
    assert "collective-permute" in r["collectives"], r["collectives"]
    assert r["all_gather_bytes"] == 0 and "all-gather" not in r["collectives"], r


def test_the_ring_loss_in_the_coupled_step_equals_one_device_and_reduces_once(out):
    r = out["coupled"]
    assert max(r["rel"]) <= EXACT, r["rel"]
    assert "all-gather" not in r["collectives"] and "collective-permute" in r["collectives"]
    assert r["reductions"]["total"] == 1 and r["reductions"]["in loops"] == 0, r["reductions"]


def test_no_device_holds_much_more_than_twice_its_share(out):
    """Per device, the ring's backward holds the cotangent of its own rows (half its share),
    the visiting block's rows and their cotangent (its share) and the next block arriving
    (about its share again), plus tile buffers (tile^2 floats): about twice its share of the
    representations, however many devices the ring has (one block visits at a time)."""
    r = out["memory"]
    for name in ("clip", "siglip"):
        assert r[name] <= 2.5 * r["share"], (name, r[name] / r["share"])
