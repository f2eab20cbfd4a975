"""Counting collectives in compiled HLO text, inside and outside loops (tests, benchmarks)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_REF = re.compile(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%?([\w.\-,% ]+)\}?")
_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def computations(hlo: str) -> dict[str, list[str]]:
    """An HLO module's text split into its computations: name -> body lines."""
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


_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_SHAPE = re.compile(r"\b(f64|s64|u64|f32|s32|u32|bf16|f16|s16|u16|s8|u8|pred)\[([\d,]*)\]")


def _result_shapes(line: str, op: str) -> list[tuple[str, tuple[int, ...]]]:
    """The op's result shape(s), ``(dtype, dims)`` each: the text between '=' and its name."""
    head = line.split("=", 1)[-1].split(f" {op}", 1)[0]
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _SHAPE.findall(head)]


def _result_bytes(line: str, op: str) -> int:
    """Bytes of the op's result shape(s)."""
    total = 0
    for dtype, dims in _result_shapes(line, op):
        size = 1
        for d in dims:
            size *= d
        total += size * _BYTES[dtype]
    return total


def _loop_computations(comps: dict[str, list[str]]) -> set[str]:
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
    return in_loop


def _group_size(line: str) -> int:
    """The number of devices in each replica group (-1: all devices, ``{}``; 0: none named)."""
    if "replica_groups={}" in line:
        return -1
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:  # replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}
        sizes = {name: int(n) for name, n in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        size = 1
        for name in re.findall(r"'([^']+)'", mesh.group(2)):
            size *= sizes.get(name, 1)
        return size
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    return len(listed.group(1).split(",")) if listed else 0


def collectives(hlo: str) -> list[tuple[str, bool, int, int]]:
    """Every collective op in an HLO module's text.

    Returns ``(op, inside a loop body, result bytes, replica group size)`` per op;
    ``-start``/``-done`` pairs count once (at the start).
    """
    comps = computations(hlo)
    in_loop = _loop_computations(comps)
    found = []
    for name, lines in comps.items():
        for line in lines:
            op = _op_name(line)
            if op:
                found.append((op, name in in_loop, _result_bytes(line, op), _group_size(line)))
    return found


def reduced_shapes(hlo: str) -> list[tuple[bool, list[tuple[int, ...]]]]:
    """Every reduction (all-reduce, reduce-scatter) as ``(inside a loop body, the shape of each
    array it reduces)``: XLA combines reductions into tuples and splits them as it likes, so a
    gradient leaf is found by its shape, not by a count of ops."""
    comps = computations(hlo)
    in_loop = _loop_computations(comps)
    return [(name in in_loop, [dims for _, dims in _result_shapes(line, op)])
            for name, lines in comps.items() for line in lines
            for op in [_op_name(line)] if op in ("all-reduce", "reduce-scatter")]


def gradient_reductions(
    hlo: str, group_size: int | Collection[int], min_bytes: int = 64
) -> dict[str, int]:
    """Counts the reductions (all-reduce, reduce-scatter) over ``group_size`` devices.

    ``group_size`` is the number of devices along the data axes (or several sizes, one per
    subset of several data axes: an FSDP leaf sharded over one of them is reduce-scattered
    over it and summed over the others): a model's own tensor-parallel reductions (over the
    model axis) have other groups. ``replica_groups={}`` (every device)
    counts too. Scalars (a loss averaged over a
    sharded batch, weights, counters) fall below ``min_bytes``; a gradient does not.

    Returns:
      ``{"total": n, "in loops": m, "bytes": b, "bytes in loops": c}``.
    """
    sizes = {group_size} if isinstance(group_size, int) else set(group_size)
    rows = [
        (in_loop, size)
        for op, in_loop, size, group in collectives(hlo)
        if op in ("all-reduce", "reduce-scatter")
        and size >= min_bytes
        and (group == -1 or group in sizes)
    ]
    return {
        "total": len(rows),
        "in loops": sum(1 for in_loop, _ in rows if in_loop),
        "bytes": sum(size for _, size in rows),
        "bytes in loops": sum(size for in_loop, size in rows if in_loop),
    }


def collective_counts(hlo: str) -> dict[str, int]:
    """Counts collective ops in an HLO module's text, and how many of them sit in loop bodies.

    An op in a ``while`` body runs once per iteration: for gradient accumulation, an all-reduce
    there is an all-reduce per micro-batch.

    Returns:
      ``{"all-reduce": n, "all-reduce in loops": m, "all-gather": ..., ...}`` (zero counts kept).
    """
    counts: Counter[str] = Counter({op: 0 for op in _OPS})
    counts.update({f"{op} in loops": 0 for op in _OPS})
    for op, in_loop, _, _ in collectives(hlo):
        counts[op] += 1
        if in_loop:
            counts[f"{op} in loops"] += 1
    return dict(counts)


_DIM_LABELS = re.compile(r"\sconvolution\(.*dim_labels=([\w>\-]+)")


def convolutions(hlo: str) -> list[tuple[str, bool]]:
    """Every convolution in an HLO module's text: ``(dim_labels, inside a loop body)``.

    XLA:CPU runs a convolution in a fast library only with the labels ``b01f_01io->b01f``
    (NHWC x HWIO, any number of spatial dimensions); see :mod:`jaxaccum._xla.conv_layout`.
    """
    comps = computations(hlo)
    in_loop = _loop_computations(comps)
    return [
        (match.group(1), name in in_loop)
        for name, lines in comps.items()
        for line in lines
        if (match := _DIM_LABELS.search(line))
    ]
