"""The way through the library, as a reader follows one call: how many jaxaccum frames stand
between a user's call and the user's loss, and which modules the placements may import."""

from __future__ import annotations

import ast
import pathlib
import traceback

import jax.numpy as jnp
import optax
import pytest

import jaxaccum

PACKAGE = pathlib.Path(jaxaccum.__file__).parent
# jaxaccum frames at the loss in the deepest trace (the loop body's, through XLA:CPU's
# convolution-layout pass), one device: measured, a bound that may only fall
MOST_FRAMES = {"value_and_grad": 5, "train_step": 6}


def frames_at_the_loss(front: str) -> list[str]:
    seen: list[list[str]] = []

    def loss(w, x):
        seen.append([f"{pathlib.Path(f.filename).relative_to(PACKAGE)}:{f.lineno} {f.name}"
                     for f in traceback.extract_stack()
                     if pathlib.Path(f.filename).is_relative_to(PACKAGE)])
        return jnp.mean((x @ w) ** 2)

    w, x = jnp.ones((3,)), jnp.ones((8, 3))
    if front == "value_and_grad":
        jaxaccum.value_and_grad(loss, num_microbatches=4)(w, x)
    else:
        sgd = optax.sgd(0.1)
        jaxaccum.train_step(loss, sgd, num_microbatches=4, donate=False)(w, sgd.init(w), x)
    return max(seen, key=len)  # (the loop body's trace: the deepest)


@pytest.mark.parametrize("front", list(MOST_FRAMES))
def test_few_frames_stand_between_the_call_and_the_loss(front):
    stack = frames_at_the_loss(front)
    print(f"jaxaccum.{front} -> loss:", *stack, sep="\n  ")
    assert len(stack) <= MOST_FRAMES[front], stack


def imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_placements_never_reach_back_into_the_pipeline():
    """A placement wraps the per-device pipeline it is handed: no module of the package
    imports the pipeline (or a front end that would)."""
    above = {"jaxaccum._pipeline", "jaxaccum._value_and_grad", "jaxaccum._train_step",
             "jaxaccum._coupled", "jaxaccum.nnx", "jaxaccum.linen"}
    for path in sorted((PACKAGE / "_placement").glob("*.py")):
        assert not imports(path) & above, (path.name, imports(path) & above)


def test_no_placement_is_completed_after_it_is_built():
    """A placement is built whole, once per call: no ``dataclasses.replace`` in the package;
    and it rebuilds no accumulation (``with_fun``): what it wraps of the loss function goes
    down in its ``LeafOps``."""
    for path in sorted((PACKAGE / "_placement").glob("*.py")):
        calls = [n for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Attribute) and (n.attr == "with_fun" or (
                     n.attr == "replace" and isinstance(n.value, ast.Name)
                     and n.value.id == "dataclasses"))]
        assert not calls, (path.name, [ast.unparse(c) for c in calls])


def test_the_library_never_tests_an_entry_points_name():
    """What a front end accepts is a field of its record, never read off its name."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("startswith", "endswith")
                    and "entry" in ast.unparse(node.func.value)):
                pytest.fail(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
            if (isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn))
                                                      for op in node.ops)
                    and any("entry" in ast.unparse(c) for c in node.comparators)):
                pytest.fail(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")


def test_the_records_a_call_passes_down_are_frozen():
    """What a call decides once (the options, the accumulation of the loss, the placement)
    is a frozen record: nothing along the way can complete or change it."""
    import dataclasses

    import jax

    from jaxaccum import _arguments, _placement

    options = jaxaccum.Options(num_microbatches=2)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    records = [options, jaxaccum.DataParallel(mesh), _arguments.make("x", len, options),
               _placement.for_call(_arguments.make(
                   "x", len, jaxaccum.Options(num_microbatches=2, mesh=mesh)), ())]
    for record in records:
        field = dataclasses.fields(record)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, field, None)
