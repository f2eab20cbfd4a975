"""Every option of ``value_and_grad`` and ``train_step`` on 8 host devices (data=8 and data x
model = 4 x 2, Auto and Explicit axes) equals one device, or is refused on both with the same
message (tests/multidevice/mesh_parity.py: the one-device run each mesh must equal, and the
float32 reordering bounds, are derived there)."""

from __future__ import annotations

import pytest
from launcher import run_program


@pytest.fixture(scope="module")
def out():
    return run_program("mesh_parity", devices=8, timeout=900)


def assert_parity(out, checks):
    wrong = [f["text"] for f in out["failures"] if f["asserted"]]
    assert not wrong, "\n\n".join(wrong)
    if out["failures"]:  # only exceptions: a crash, not a wrong result
        raise RuntimeError("\n\n".join(f["text"] for f in out["failures"]))
    assert out["checks"] >= checks  # every case on every mesh it names ran


def test_every_option_on_a_mesh_equals_one_device(out):
    assert_parity(out, 43)


@pytest.mark.slow
def test_every_option_on_a_mesh_equals_one_device_deep():
    """The other combinations (steps of every option, the data x model mesh for more)."""
    assert_parity(run_program("mesh_parity", "deep", devices=8, timeout=1200), 85)


def test_refusals_are_the_same_on_a_mesh_and_on_one_device(out):
    refusals = out["refusals"]
    same = {tag: r for tag, r in refusals.items() if not r["documented"]}
    assert same, "the cases refused everywhere ran nowhere"
    for tag, r in same.items():
        assert r["mesh"] == r["one_device"], tag
    # what a placement documents it cannot honour, while one device runs it
    documented = {tag for tag, r in refusals.items() if r["documented"]}
    assert any("noise_scale" in t and "explicit" in t for t in documented), documented
    assert any("carry" in t and "auto" in t for t in documented), documented
    assert all(r["one_device_ran"] for r in refusals.values() if r["documented"])
