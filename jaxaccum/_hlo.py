"""Counting collectives in compiled HLO text, inside and outside loops (tests, benchmarks)."""

from __future__ import annotations

import re
from collections import Counter

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_REF = re.compile(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%?([\w.\-,% ]+)\}?")
_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _computations(hlo: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in hlo.splitlines():
        match = _HEADER.match(line.strip())
        if match and current is None:
            current = comps.setdefault(match.group(1), [])
        elif line.strip() == "}":
            current = None
        elif current is not None:
            current.append(line)
    return comps


def _op_name(line: str) -> str | None:
    for op in _OPS:
        if re.search(rf"\s{op}(?:-start)?\(", line):
            return op
    return None


def collective_counts(hlo: str) -> dict[str, int]:
    """Counts collective ops in an HLO module's text, and how many of them sit in loop bodies.

    An op in a ``while`` body runs once per iteration: for gradient accumulation, an all-reduce
    there is an all-reduce per micro-batch.

    Returns:
      ``{"all-reduce": n, "all-reduce in loops": m, "all-gather": ..., ...}`` (zero counts kept).
    """
    comps = _computations(hlo)
    in_loop: set[str] = set()
    frontier = [
        name
        for lines in comps.values()
        for line in lines
        if " while(" in line
        for name in re.findall(r"body=%?([\w.\-]+)", line)
    ]
    while frontier:
        name = frontier.pop()
        if name in in_loop or name not in comps:
            continue
        in_loop.add(name)
        for line in comps[name]:
            for group in _REF.findall(line):
                frontier.extend(n.strip().lstrip("%") for n in group.split(","))
    counts: Counter[str] = Counter({op: 0 for op in _OPS})
    counts.update({f"{op} in loops": 0 for op in _OPS})
    for name, lines in comps.items():
        for line in lines:
            op = _op_name(line)
            if op:
                counts[op] += 1
                if name in in_loop:
                    counts[f"{op} in loops"] += 1
    return dict(counts)
