"""jaxaccum._xla.hlo.collective_counts on a small HLO module text."""

from __future__ import annotations

from jaxaccum._xla.hlo import collective_counts

HLO = """
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

%inner (p: f32[4]) -> f32[4] {
  ROOT %ar2 = f32[4] all-reduce(%p), to_apply=%add
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %x = f32[4] get-tuple-element(%t), index=1
  %ar = f32[4] all-reduce(%x), to_apply=%add
  %c = f32[4] call(%ar), to_apply=%inner
  ROOT %r = (s32[], f32[4]) tuple(%i, %c)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: f32[4]) -> f32[8] {
  %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
  %done = f32[4] all-reduce-start(%a), to_apply=%add
  ROOT %g = f32[8] all-gather(%done), dimensions={0}
}
"""


def test_counts_inside_and_outside_loops():
    counts = collective_counts(HLO)
    assert counts["all-reduce"] == 3  # two in the loop (one via a called computation), one out
    assert counts["all-reduce in loops"] == 2
    assert counts["all-gather"] == 1 and counts["all-gather in loops"] == 0
    assert counts["reduce-scatter"] == 0


def test_no_loops():
    counts = collective_counts(
        "ENTRY %main (a: f32[4]) -> f32[4] {\n  ROOT %b = f32[4] all-reduce(%a), to_apply=%add\n}\n"
    )
    assert counts["all-reduce"] == 1 and counts["all-reduce in loops"] == 0
