"""This project's mutation operators (``tools/mutation/operators.py``): each finds the
places of its slip, makes it there, compiles, and does not fire where the slip is not (inside
a type annotation, on another function, on a one-sided name); ``cr.py`` serves them to
cosmic-ray beside the built-in operators, in the process that applies the mutants."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

cosmic_ray = pytest.importorskip("cosmic_ray")  # (the dev extra: CI installs it)

from cosmic_ray.ast import ast_nodes, get_ast  # noqa: E402
from cosmic_ray.mutating import mutate_code  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tools" / "mutation"))

import operators  # noqa: E402

OPS = operators.OPERATORS


def positions(op: str, source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Every place ``op`` mutates ``source``, in cosmic-ray's order (its init's walk)."""
    return [p for node in ast_nodes(get_ast(source)) for p in OPS[op]().mutation_positions(node)]


def mutants(op: str, source: str) -> list[str]:
    """Every mutant ``op`` makes of ``source``, each applied as cosmic-ray's exec applies it."""
    out = [mutate_code(source, OPS[op](), i) for i in range(len(positions(op, source)))]
    for code in out:
        ast.parse(code)  # each one compiles: a mutant that does not is no slip
    return out


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_operator_makes_its_documented_examples(name):
    examples = OPS[name].examples()
    assert examples, f"{name} documents no example"
    for e in examples:
        assert mutate_code(e.pre_mutation_code, OPS[name](), e.occurrence) == \
            e.post_mutation_code, (name, e)
        assert len(positions(name, e.pre_mutation_code)) > e.occurrence


# each case: operator, source, the mutants expected (in order); [] where it must not fire
CASES = [
    ("RemoveFloat32Cast", "z = x.astype(jnp.float32)\nw = x.astype(jnp.int32)\n",
     ["z = x\nw = x.astype(jnp.int32)\n"]),
    ("RemoveFloat32Cast", "z = f(x).astype(np.float64).sum()\n", ["z = f(x).sum()\n"]),
    ("DropPreferredElementType", "c = lax.dot(a, b, preferred_element_type=t, precision=p)\n",
     ["c = lax.dot(a, b, precision=p)\n"]),
    ("DropDtypeKeyword", "n = jnp.sum(real, dtype=acc)\nm = jnp.sum(real, axis=0)\n",
     ["n = jnp.sum(real)\nm = jnp.sum(real, axis=0)\n"]),
    ("PromoteTypesToInput", "t = jnp.promote_types(dtype, accumulator_dtype)\n",
     ["t = dtype\n"]),
    ("PromoteTypesToInput", "t = jnp.result_type(dtype, jnp.float32)\n", []),
    ("WhereToTrueBranch", "z = jnp.where(ok, lse, 0.0) + 1\nw = jnp.where(ok)\n",
     ["z = lse + 1\nw = jnp.where(ok)\n"]),
    ("WhereToFalseBranch", "z = jnp.where(ok, x, 0).reshape(-1)\n", ["z = (0).reshape(-1)\n"]),
    ("WhereToFalseBranch", "z = np.where(ok, x, y) * 2\n", ["z = y * 2\n"]),
    ("IsfiniteToTrue", "ok = np.isfinite(v)\nbad = jnp.isnan(v)\n",
     ["ok = np.ones_like(v, dtype=bool)\nbad = jnp.isnan(v)\n"]),
    ("ClampToOperand", "d = jnp.maximum(n, 1) + jnp.minimum(a, b)\n",
     ["d = n + jnp.minimum(a, b)\n", "d = jnp.maximum(n, 1) + a\n",
      "d = jnp.maximum(n, 1) + b\n"]),
    ("ClampToOperand", "d = max(items)\ne = jnp.maximum(x, 1, out=o)\n", []),
    ("DropPassedOnOption", "g(x, rows=rows, cols=n)\n", ["g(x, cols=n)\n"]),
    ("DropPassedOnOption", "g(\n    x,\n    rows=rows,\n)\n", ["g(\n    x,\n)\n"]),
    ("CountOtherPredicate", "n = jnp.sum(lens > 0) + jnp.mean(lens > 0)\n",
     ["n = jnp.sum(lens >= 0) + jnp.mean(lens > 0)\n"]),
    ("CountOtherPredicate", "n = jnp.sum(x, axis=int(a > 0))\nk = np.sum(a == b)\n",
     ["n = jnp.sum(x, axis=int(a > 0))\nk = np.sum(a != b)\n"]),
    ("CountOtherPredicate", "n = jnp.count_nonzero(~pad)\n", ["n = jnp.count_nonzero(pad)\n"]),
    # the predicate is the first argument, whatever follows; not another argument
    ("CountOtherPredicate", "n = jnp.sum(a > 0, axis=0) + jnp.sum(x, a < 1)\n",
     ["n = jnp.sum(a >= 0, axis=0) + jnp.sum(x, a < 1)\n"]),
    # a predicate assigned to a name that its function counts (the name, not another)
    ("CountOtherPredicate",
     "def f(s):\n    real = s > 0\n    w = s < 3\n    return jnp.sum(real), w\n",
     ["def f(s):\n    real = s >= 0\n    w = s < 3\n    return jnp.sum(real), w\n"]),
    ("CountOtherPredicate", "m = (seg != 1).sum() + (seg > 1).mean()\n",
     ["m = (seg == 1).sum() + (seg > 1).mean()\n"]),
]


@pytest.mark.parametrize("name,source,expected", CASES)
def test_an_operator_mutates_exactly_its_places(name, source, expected):
    assert mutants(name, source) == expected


SWAP = '''\
def tile(a, b, n_a: int, n_b: int, rows, cols) -> Pair_a:
    off = n_a - 1
    data = a.data
    return a[:off] @ b[:n_b], rows


def other(n_a):
    def inner(n_b):
        return n_b
    return n_a, lambda x: x
'''


def test_swap_paired_name_swaps_reads_within_one_function_only():
    got = mutants("SwapPairedName", SWAP)
    body = "    return a[:off] @ b[:n_b], rows\n"
    # every read of a name whose pair is in the same function, and nothing else: not the
    # parameters (definitions), not the annotations (int, Pair_a: never evaluated), not the
    # attribute ``.data`` nor the unpaired ``data``/``off``, not ``other``'s ``n_a`` (only
    # the function inside it has an ``n_b``, which ``other`` cannot see), not its lambda's
    # ``x`` (no ``y`` anywhere)
    assert got == [SWAP.replace("off = n_a - 1", "off = n_b - 1"),
                   SWAP.replace("data = a.data", "data = b.data"),
                   SWAP.replace(body, "    return b[:off] @ b[:n_b], rows\n"),
                   SWAP.replace(body, "    return a[:off] @ a[:n_b], rows\n"),
                   SWAP.replace(body, "    return a[:off] @ b[:n_a], rows\n"),
                   SWAP.replace(body, "    return a[:off] @ b[:n_b], cols\n"),
                   # the function inside sees the one around it: its n_b read as n_a
                   SWAP.replace("        return n_b\n", "        return n_a\n")]


def test_swap_paired_name_pairs_by_one_side_only():
    assert operators.partners("n_a") == ["n_b"]
    assert operators.partners("ta") == ["tb"]
    assert operators.partners("row_ids") == ["col_ids"]
    assert operators.partners("nrows") == ["ncols"]
    assert operators.partners("x") == ["y"]
    assert operators.partners("data") == ["datb"]  # (fires only where a ``datb`` is read too)
    assert operators.partners("count") == []
    assert operators.partners("data_x") == ["data_y"]  # a trailing a/b only on the last part


RESTORE = '''\
class Stream:
    def set_state(self, state):
        self._arrived, self._waiting, self._exhausted = state["n"], state["w"], False
        self._parent.set_state(state["p"])
        self.n: int = 0

    def get_state(self):
        self._arrived = 0
'''


def test_forget_restored_field_leaves_out_one_field_of_a_restore_only():
    line = '        self._arrived, self._waiting, self._exhausted = state["n"], state["w"], False\n'
    assert mutants("ForgetRestoredField", RESTORE) == [
        RESTORE.replace(line, '        self._waiting, self._exhausted = state["w"], False\n'),
        RESTORE.replace(line, '        self._arrived, self._exhausted = state["n"], False\n'),
        RESTORE.replace(line, '        self._arrived, self._waiting = state["n"], state["w"]\n'),
    ]  # not get_state's assignment; not the annotated one (an annassign, not a plain "=")
    one = "class S:\n    def __setstate__(self, s):\n        self.n = s\n"
    assert mutants("ForgetRestoredField", one) == [
        "class S:\n    def __setstate__(self, s):\n        pass\n"]


ANNOTATED = '''\
from __future__ import annotations


def f(x: jnp.where(a, b, c) = None, *, n_a: max(n_a, n_b) = 0) -> jnp.maximum(x, 1):
    v: jnp.isfinite(x).astype(jnp.float32) = g(dtype=dtype)
    return v
'''


@pytest.mark.parametrize("name", sorted(set(OPS) - {"DropDtypeKeyword", "DropPassedOnOption"}))
def test_no_operator_fires_inside_a_type_annotation(name):
    assert positions(name, ANNOTATED) == []


def test_keyword_operators_fire_outside_annotations_only():
    assert mutants("DropDtypeKeyword", ANNOTATED) == mutants("DropPassedOnOption", ANNOTATED) \
        == [ANNOTATED.replace("g(dtype=dtype)", "g()")]  # the value, not the annotation


def test_cr_registers_the_operators_beside_the_built_in_ones_for_init_and_exec():
    import cosmic_ray.plugins
    import cr
    from cosmic_ray.config import load_config
    from cosmic_ray.work_item import MutationSpec

    cr.register()
    names = cosmic_ray.plugins.operator_names()
    assert {f"jaxaccum/{n}" for n in OPS} <= set(names)
    assert "core/NumberReplacer" in names
    assert cosmic_ray.plugins.get_operator("jaxaccum/SwapPairedName") is OPS["SwapPairedName"]
    # cr.py exec runs the local distributor: it applies the mutants in this process (which
    # cr.py patched) through mutate_and_test
    root = pathlib.Path(__file__).parents[1]
    assert load_config(str(root / "tools/mutation/cosmic-ray.toml")).distributor_name \
        == "local"
    import cosmic_ray.distribution.local as local
    import cosmic_ray.mutating as mutating

    assert local.mutate_and_test is mutating.mutate_and_test  # (it looks the operator up
    # in cosmic_ray.plugins when it applies a mutant: the mapping cr.py added ours to)
    spec = MutationSpec(module_path=pathlib.Path("x.py"), operator_name="jaxaccum/ClampToOperand",
                        occurrence=0, start_pos=(1, 0), end_pos=(1, 1))
    op = cosmic_ray.plugins.get_operator(spec.operator_name)()
    assert mutate_code("d = jnp.maximum(n, 1)\n", op, spec.occurrence) == "d = n\n"
