"""The reference model of the docs on 8 host devices (tests/multidevice/reference.py): Auto
axes (each device's share of a micro-batch is a unit of the mean, the skip and the noise
scale) and Explicit axes (global micro-batches), every front end that takes a mesh."""

from __future__ import annotations

import os

import pytest
from launcher import run_program

CASES = int(os.environ.get("JAXACCUM_REFERENCE_MESH_CASES", "8"))


@pytest.fixture(scope="module")
def out():
    return run_program("reference", str(CASES), devices=8, timeout=900)


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_every_front_end_on_a_mesh_gives_the_documented_result(out, axes):
    r = out[axes]
    assert r["checks"] >= CASES * 4
    wrong = [f["text"] for f in r["failures"] if f["asserted"]]
    assert not wrong, "\n\n".join(wrong)
    if r["failures"]:  # only exceptions: a crash, not a wrong result
        raise RuntimeError("\n\n".join(f["text"] for f in r["failures"]))
    # float32 rounding of a 32-example mean (~1e-7); a device using its eighth of the table
    # is off by O(1)
    assert r["gathered_argument_rel"] <= 1e-5
