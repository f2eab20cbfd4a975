"""This project's own cosmic-ray mutation operators: the slips an audit found surviving.

Each operator is a ``cosmic_ray.operators.operator.Operator`` over parso nodes, small and
named after the slip it makes: a value kept in the input's dtype where the code accumulates in
float32 (``RemoveFloat32Cast``, ``DropPreferredElementType``, ``PromoteTypesToInput``,
``DropDtypeKeyword``), a guard dropped (``WhereToTrueBranch``, ``WhereToFalseBranch``,
``IsfiniteToTrue``, ``ClampToOperand``), an offset or size taken from the other operand
(``SwapPairedName``), an option not passed on (``DropPassedOnOption``), a field left out of
a restore (``ForgetRestoredField``) and a count over another predicate
(``CountOtherPredicate``). ``PROVIDER`` serves them to cosmic-ray under the provider name
``jaxaccum`` (``cr.py`` registers it); none fires inside a type annotation.

Examples:
    >>> from cosmic_ray.mutating import mutate_code
    >>> mutate_code("y = jnp.where(ok, x, 0.0)\\n", WhereToTrueBranch(), 0)
    'y = x\\n'
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cosmic_ray.operators.operator import Example, Operator
from parso.python.tree import Keyword, Name, PythonNode
from parso.python.tree import Operator as Op
from parso.tree import BaseNode, NodeOrLeaf

Position = tuple[tuple[int, int], tuple[int, int]]

ARRAY_MODULES = ("jnp", "np")
# the accumulator dtypes a cast to which is the point of the cast
WIDE = {f"{m}.{t}" for m in ARRAY_MODULES for t in ("float32", "float64")}
# identifier parts that name the two sides of one thing
PAIRS = {"a": "b", "b": "a", "x": "y", "y": "x", "row": "col", "col": "row",
         "rows": "cols", "cols": "rows"}
RESTORERS = ("set_state", "restore", "__setstate__", "load_state_dict")
COUNTS = {(m, f) for m in ARRAY_MODULES for f in ("sum", "count_nonzero")}
# where an expression stands alone: no neighbour's precedence applies
ALONE = ("expr_stmt", "return_stmt", "arglist", "argument", "trailer", "simple_stmt",
         "testlist_star_expr", "testlist", "atom", "exprlist", "subscript", "subscriptlist")
FLIP = {">": ">=", ">=": ">", "<": "<=", "<=": "<", "!=": "==", "==": "!="}


# ---------------------------------------------------------------- parso helpers

def in_annotation(node: NodeOrLeaf) -> bool:
    """Whether ``node`` lies inside a parameter, return or variable annotation (never
    evaluated with ``from __future__ import annotations``: a mutant there is equivalent)."""
    child, parent = node, node.parent
    while parent is not None:
        kids = parent.children
        i = next(k for k, c in enumerate(kids) if c is child)
        if parent.type == "tfpdef" and i == 2:
            return True
        if parent.type == "funcdef" and i > 0 and getattr(kids[i - 1], "value", "") == "->":
            return True
        if parent.type == "annassign" and i == 1:
            return True
        child, parent = parent, parent.parent
    return False


def is_call(trailer: NodeOrLeaf) -> bool:
    return trailer.type == "trailer" and getattr(trailer.children[0], "value", "") == "("


def args_of(trailer: BaseNode) -> list[NodeOrLeaf]:
    """The arguments of a call trailer ``( ... )``, without the commas."""
    inner = trailer.children[1:-1]
    if not inner:
        return []
    if inner[0].type == "arglist":
        return [c for c in inner[0].children if getattr(c, "value", None) != ","]
    return [inner[0]]


def keyword(arg: NodeOrLeaf) -> str | None:
    """The keyword of a ``name=value`` argument (None for a positional one)."""
    if arg.type == "argument" and len(arg.children) == 3 and \
            getattr(arg.children[1], "value", "") == "=":
        return str(arg.children[0].value)
    return None


def positional(arg: NodeOrLeaf) -> bool:
    return arg.type != "argument"


def code(node: NodeOrLeaf) -> str:
    return node.get_code(include_prefix=False).strip()


def function_calls(node: NodeOrLeaf, names: set[tuple[str, str]]) -> Iterator[int]:
    """``k`` for each call ``module.name(...)`` of ``names`` that starts ``node``, an
    ``atom_expr``: ``node.children[k]`` is the call's argument trailer."""
    kids = getattr(node, "children", ())
    if node.type == "atom_expr" and len(kids) >= 3 and kids[0].type == "name" and \
            kids[1].type == "trailer" and kids[1].children[0].value == "." and is_call(kids[2]) \
            and (kids[0].value, kids[1].children[1].value) in names:
        yield 2


def builtin_calls(node: NodeOrLeaf, names: set[str]) -> Iterator[int]:
    kids = getattr(node, "children", ())
    if node.type == "atom_expr" and len(kids) >= 2 and kids[0].type == "name" and \
            kids[0].value in names and is_call(kids[1]):
        yield 1


def grouped(expr: NodeOrLeaf) -> NodeOrLeaf:
    """``expr`` in parentheses unless it is an atom already (it may take another's place
    inside an expression: precedence)."""
    if expr.type in ("name", "number", "string", "keyword", "atom", "atom_expr", "strings"):
        return expr
    first = expr.get_first_leaf()
    prefix, first.prefix = first.prefix, ""
    return PythonNode("atom", [Op("(", expr.start_pos, prefix), expr, Op(")", expr.end_pos)])


def replace_head(node: BaseNode, k: int, replacement: NodeOrLeaf) -> NodeOrLeaf:
    """``node`` (an ``atom_expr``) with ``children[:k + 1]`` replaced by ``replacement``
    (keeping the node's own prefix); the replacement itself if nothing follows."""
    first = replacement.get_first_leaf()
    first.prefix = node.get_first_leaf().prefix
    rest = node.children[k + 1:]
    if not rest:  # in parentheses unless it stands alone (a statement's value, an argument)
        alone = node.parent is not None and node.parent.type in ALONE
        return replacement if alone else grouped(replacement)
    if replacement.type not in ("name", "atom", "atom_expr", "string", "strings"):
        # (a number or an operation followed by a trailer: ``(0).reshape``, ``(a + b).sum``)
        first = replacement.get_first_leaf()
        prefix, first.prefix = first.prefix, ""
        replacement = PythonNode("atom", [Op("(", replacement.start_pos, prefix), replacement,
                                          Op(")", replacement.end_pos)])
    node.children = [replacement, *rest]
    replacement.parent = node
    return node


def drop_argument(trailer: BaseNode, arg: NodeOrLeaf) -> None:
    """Removes ``arg`` (and a comma beside it) from a call trailer."""
    inner = trailer.children[1]
    if inner is arg:
        trailer.children = [trailer.children[0], trailer.children[-1]]
        return
    kids = inner.children
    i = next(k for k, c in enumerate(kids) if c is arg)
    if i + 1 < len(kids):  # the comma after it goes, the next argument keeps its prefix
        del kids[i:i + 2]
    else:
        del kids[i - 1:i + 1]


# ---------------------------------------------------------------- dtype slips

class RemoveFloat32Cast(Operator):
    """``x.astype(jnp.float32)`` -> ``x``: the value stays in the input's dtype (bfloat16)."""

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        for k in self._casts(node):
            yield node.children[k - 1].start_pos, node.children[k].end_pos

    @staticmethod
    def _casts(node: Any) -> list[int]:
        kids = getattr(node, "children", ())
        if node.type != "atom_expr" or in_annotation(node):
            return []
        return [k for k in range(2, len(kids))
                if kids[k - 1].type == "trailer" and kids[k - 1].children[0].value == "."
                and kids[k - 1].children[1].value == "astype" and is_call(kids[k])
                and [code(a) for a in args_of(kids[k])] in ([w] for w in WIDE)]

    def mutate(self, node: Any, index: int) -> Any:
        k = self._casts(node)[index]
        del node.children[k - 1:k + 1]
        if len(node.children) == 1:
            only = node.children[0]
            only.get_first_leaf().prefix = node.get_first_leaf().prefix
            return only
        return node

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (Example("z = f(x).astype(jnp.float32)\n", "z = f(x)\n"),
                Example("z = x.astype(jnp.float32) + 1\n", "z = x + 1\n"))


class _DropKeyword(Operator):
    """A keyword argument dropped from a call (the callee's default then applies)."""

    def wanted(self, arg: Any) -> bool:
        raise NotImplementedError

    def _found(self, node: Any) -> list[Any]:
        if not is_call(node) or in_annotation(node):
            return []
        return [a for a in args_of(node) if keyword(a) is not None and self.wanted(a)]

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        for arg in self._found(node):
            yield arg.start_pos, arg.end_pos

    def mutate(self, node: Any, index: int) -> Any:
        drop_argument(node, self._found(node)[index])
        return node

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return ()


class DropPreferredElementType(_DropKeyword):
    """``preferred_element_type=...`` dropped: the product accumulates in the input dtype."""

    def wanted(self, arg: Any) -> bool:
        return keyword(arg) == "preferred_element_type"

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (Example("p = jnp.einsum('ij,jk', a, b, preferred_element_type=jnp.float32)\n",
                        "p = jnp.einsum('ij,jk', a, b)\n"),)


class DropDtypeKeyword(_DropKeyword):
    """``dtype=acc`` (or ``*_dtype=...``) dropped: the default (the input's) dtype applies."""

    def wanted(self, arg: Any) -> bool:
        name = keyword(arg) or ""
        return name == "dtype" or name.endswith("_dtype")

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (Example("n = jnp.sum(real, dtype=acc)\n", "n = jnp.sum(real)\n"),
                Example("n = f(x, mu_dtype=jnp.float32, k=1)\n", "n = f(x, k=1)\n"))


class PromoteTypesToInput(Operator):
    """``jnp.promote_types(d, jnp.float32)`` -> ``d``: a sum kept in the input's dtype."""

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        if self._kept(node) is not None:
            yield node.start_pos, node.children[2].end_pos

    @staticmethod
    def _kept(node: Any) -> Any:
        for k in function_calls(node, {(m, "promote_types") for m in ARRAY_MODULES}):
            args = args_of(node.children[k])
            if len(args) == 2 and all(map(positional, args)) and not in_annotation(node):
                return args[1] if code(args[0]) in WIDE else args[0]
        return None

    def mutate(self, node: Any, index: int) -> Any:
        return replace_head(node, 2, self._kept(node))

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (Example("t = jnp.promote_types(dtype, jnp.float32)\n", "t = dtype\n"),
                Example("t = jnp.promote_types(jnp.float32, x.dtype)\n", "t = x.dtype\n"))


# ---------------------------------------------------------------- dropped guards

class _WhereToBranch(Operator):
    branch = 1

    def _branch(self, node: Any) -> Any:
        for k in function_calls(node, {(m, "where") for m in ARRAY_MODULES}):
            args = args_of(node.children[k])
            if len(args) == 3 and all(map(positional, args)) and not in_annotation(node):
                return args[self.branch]
        return None

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        if self._branch(node) is not None:
            yield node.start_pos, node.children[2].end_pos

    def mutate(self, node: Any, index: int) -> Any:
        return replace_head(node, 2, self._branch(node))

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return ()


class WhereToTrueBranch(_WhereToBranch):
    """``jnp.where(c, x, y)`` -> ``x``: the guard dropped, its value always taken."""

    branch = 1

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (Example("z = jnp.where(ok, a + b, 0.0).sum()\n", "z = (a + b).sum()\n"),
                Example("z = -jnp.where(ok, a + b, 0.0)\n", "z = -(a + b)\n"))


class WhereToFalseBranch(_WhereToBranch):
    """``jnp.where(c, x, y)`` -> ``y``: the guarded value never taken."""

    branch = 2

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (Example("z = jnp.where(ok, x, y)\n", "z = y\n"),)


class IsfiniteToTrue(Operator):
    """``jnp.isfinite(x)`` -> all True (same shape): the finiteness guard dropped."""

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        if self._call(node) is not None:
            yield node.start_pos, node.children[self._call(node)].end_pos

    @staticmethod
    def _call(node: Any) -> int | None:
        names = {(m, "isfinite") for m in (*ARRAY_MODULES, "math")}
        for k in function_calls(node, names):
            if len(args_of(node.children[k])) == 1 and not in_annotation(node):
                return k
        return None

    def mutate(self, node: Any, index: int) -> Any:
        k = self._call(node)
        assert k is not None
        if node.children[0].value == "math":
            return replace_head(node, k, Keyword("True", node.start_pos))
        node.children[1].children[1].value = "ones_like"  # (module).ones_like(x, dtype=bool)
        call = node.children[k]
        arg = args_of(call)[0]
        call.children = [call.children[0],
                         PythonNode("arglist", [arg, Op(",", arg.end_pos),
                                                PythonNode("argument", [
                                                    Name("dtype", arg.end_pos, " "),
                                                    Op("=", arg.end_pos),
                                                    Name("bool", arg.end_pos)])]),
                         call.children[-1]]
        return node

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (Example("ok = jnp.isfinite(lse)\n", "ok = jnp.ones_like(lse, dtype=bool)\n"),
                Example("ok = math.isfinite(v) and v > 0\n", "ok = True and v > 0\n"))


class ClampToOperand(Operator):
    """``jnp.maximum(x, 1)`` / ``jnp.minimum`` / ``max`` / ``min`` -> ``x``: the clamp
    dropped (one mutant per operand that is not a number)."""

    def _operands(self, node: Any) -> tuple[int, list[Any]]:
        names = {(m, f) for m in ARRAY_MODULES for f in ("maximum", "minimum")}
        for k in (*function_calls(node, names), *builtin_calls(node, {"max", "min"})):
            args = args_of(node.children[k])
            if len(args) == 2 and all(map(positional, args)) and not in_annotation(node):
                return k, [a for a in args if a.type != "number"]
        return 0, []

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        k, operands = self._operands(node)
        for _ in operands:
            yield node.start_pos, node.children[k].end_pos

    def mutate(self, node: Any, index: int) -> Any:
        k, operands = self._operands(node)
        return replace_head(node, k, operands[index])

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (Example("d = n / jnp.maximum(count, 1)\n", "d = n / count\n"),
                Example("d = min(a, b)\n", "d = a\n"),
                Example("d = min(a, b)\n", "d = b\n", occurrence=1))


# ---------------------------------------------------------------- the other operand

def partners(name: str) -> list[str]:
    """The names that differ from ``name`` only by one side of a pair (``n_a``/``n_b``,
    ``ta``/``tb``, ``x``/``y``, ``rows``/``cols``, ``row_ids``/``col_ids``)."""
    lead = len(name) - len(name.lstrip("_"))
    parts = name[lead:].split("_")
    out = []
    for i, part in enumerate(parts):
        if part in PAIRS:
            out.append([*parts[:i], PAIRS[part], *parts[i + 1:]])
        elif len(part) >= 2 and part[-1] in "ab" and i == len(parts) - 1:  # ta/tb, n_a/n_b
            out.append([*parts[:i], part[:-1] + PAIRS[part[-1]]])
        else:
            for side in ("rows", "cols", "row", "col"):  # nrows/ncols
                if part.endswith(side) and part != side:
                    out.append([*parts[:i], part[:-len(side)] + PAIRS[side], *parts[i + 1:]])
                    break
    return [name[:lead] + "_".join(p) for p in out]


def is_reference(leaf: Any) -> bool:
    """A name read as a variable (not defined, not an attribute, not a keyword's name)."""
    parent = leaf.parent
    if leaf.type != "name" or parent is None:
        return False
    if parent.type == "trailer" and parent.children[0].value == ".":
        return False
    if parent.type == "argument" and parent.children[0] is leaf and keyword(parent):
        return False
    if parent.type in ("import_from", "import_as_name", "dotted_name", "global_stmt",
                       "nonlocal_stmt", "import_as_names", "dotted_as_name"):
        return False
    return not leaf.is_definition()


class SwapPairedName(Operator):
    """A name read where its pair was meant, within one function: ``n_a`` for ``n_b``,
    ``ta`` for ``tb``, ``rows`` for ``cols``, ``x`` for ``y`` (an offset or a size taken from
    the other operand)."""

    def __init__(self) -> None:
        self._names: dict[int, tuple[Any, set[str]]] = {}

    def _own_names(self, scope: Any) -> set[str]:
        """The names a function uses, not those local to a function inside it (only its
        name): a pair that only a nested function has is not in scope here."""
        if id(scope) not in self._names:  # (the scope is kept alive with it: ids unique)
            names: set[str] = set()
            stack = list(scope.children)
            while stack:
                n = stack.pop()
                if n.type in ("funcdef", "classdef", "lambdef"):
                    if n.type != "lambdef":
                        names.add(n.name.value)
                    continue
                if n.type == "name" and (is_reference(n) or n.is_definition()):
                    names.add(n.value)
                stack.extend(getattr(n, "children", ()))
            self._names[id(scope)] = (scope, names)
        return self._names[id(scope)][1]

    def _scope_names(self, leaf: Any) -> set[str]:
        """The names visible at ``leaf`` in its function and the functions around it (the
        lambdas' included); empty outside a function."""
        names: set[str] = set()
        scope, inside = leaf.parent, False
        while scope is not None:
            if scope.type in ("funcdef", "lambdef"):
                names |= self._own_names(scope)
                inside = inside or scope.type == "funcdef"
            scope = scope.parent
        return names if inside else set()

    def _swaps(self, node: Any) -> list[str]:
        if node.type != "name" or not is_reference(node) or in_annotation(node):
            return []
        here = self._scope_names(node)
        return [p for p in partners(node.value) if p in here and p != node.value]

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        for _ in self._swaps(node):
            yield node.start_pos, node.end_pos

    def mutate(self, node: Any, index: int) -> Any:
        node.value = self._swaps(node)[index]
        return node

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        src = "def f(a, b, n_a, n_b):\n    return a[:n_a] @ b\n"
        return (Example(src, "def f(a, b, n_a, n_b):\n    return b[:n_a] @ b\n"),
                Example(src, "def f(a, b, n_a, n_b):\n    return a[:n_b] @ b\n", occurrence=1),
                Example(src, "def f(a, b, n_a, n_b):\n    return a[:n_a] @ a\n", occurrence=2))


# ---------------------------------------------------------------- options and state

class DropPassedOnOption(_DropKeyword):
    """``f(..., name=name)`` -> ``f(...)``: an option not passed on (the callee's default)."""

    def wanted(self, arg: Any) -> bool:
        value = arg.children[2]
        return value.type == "name" and value.value == keyword(arg)

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (Example("g(x, name=name, k=k2)\n", "g(x, k=k2)\n"),
                Example("g(x, name=name)\n", "g(x)\n"),
                Example("g(name=name)\n", "g()\n"))


def _self_field(target: Any) -> bool:
    kids = getattr(target, "children", ())
    return target.type == "atom_expr" and len(kids) == 2 and kids[0].type == "name" and \
        kids[0].value == "self" and kids[1].children[0].value == "."


class ForgetRestoredField(Operator):
    """In ``set_state``/``restore``/``__setstate__``, one ``self.x = ...`` left out (in a
    tuple assignment, that field only): a field or flag not restored."""

    @staticmethod
    def _fields(node: Any) -> list[int]:
        if node.type != "expr_stmt" or len(node.children) != 3 or \
                getattr(node.children[1], "value", "") != "=":
            return []
        scope = node.parent
        while scope is not None and scope.type != "funcdef":
            scope = scope.parent
        if scope is None or scope.name.value not in RESTORERS:
            return []
        target, value = node.children[0], node.children[2]
        if _self_field(target):
            return [0]
        if target.type == "testlist_star_expr" and value.type in ("testlist_star_expr",
                                                                  "testlist"):
            ts = [c for c in target.children if getattr(c, "value", None) != ","]
            vs = [c for c in value.children if getattr(c, "value", None) != ","]
            if len(ts) == len(vs):
                return [i for i, t in enumerate(ts) if _self_field(t)]
        return []

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        for _ in self._fields(node):
            yield node.start_pos, node.end_pos

    def mutate(self, node: Any, index: int) -> Any:
        i = self._fields(node)[index]
        target, value = node.children[0], node.children[2]
        if target.type == "atom_expr":
            return Keyword("pass", node.start_pos, node.get_first_leaf().prefix)
        for side in (target, value):
            kids = side.children
            items = [k for k, c in enumerate(kids) if getattr(c, "value", None) != ","]
            at = items[i]
            prefix = kids[0].get_first_leaf().prefix
            if at + 1 < len(kids):
                del kids[at:at + 2]
            else:
                del kids[at - 1:at + 1]
            kids[0].get_first_leaf().prefix = prefix if side is target else " "
            if len(kids) == 1:
                kids[0].parent = node
                node.children[node.children.index(side)] = kids[0]
        return node

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        pre = "class S:\n    def set_state(self, s):\n        self.a, self.done = s, False\n"
        return (Example(pre, pre.replace("self.a, self.done = s, False", "self.done = False")),
                Example(pre, pre.replace("self.a, self.done = s, False", "self.a = s"),
                        occurrence=1),
                Example("def restore(self, s):\n    self.n = s\n",
                        "def restore(self, s):\n    pass\n"))


class CountOtherPredicate(Operator):
    """In the predicate of ``jnp.sum``/``np.sum``/``count_nonzero``/``.sum()`` (inline, or
    assigned to a name counted in the same function): ``a > 0`` -> ``a >= 0`` (and back,
    ``<``/``<=``), ``a != x`` -> ``a == x`` (and back), ``~m`` -> ``m``: a count over the
    wrong rows."""

    @staticmethod
    def _counts(node: Any, counted: Any) -> bool:
        """Whether ``node`` counts ``counted``: ``jnp.sum(counted, ...)``, ``counted.sum()``,
        or the same of a name ``counted`` is (``real = seg > 0 ... jnp.sum(real)``)."""
        kids = getattr(node, "children", ())
        if any(args_of(kids[k])[:1] == [counted] for k in function_calls(node, COUNTS)):
            return True
        return node.type == "atom_expr" and len(kids) >= 3 and kids[0] is counted and \
            kids[1].children[0].value == "." and kids[1].children[1].value == "sum" and \
            is_call(kids[2])

    def _counted(self, node: Any) -> bool:
        child, parent = node, node.parent
        while parent is not None and not in_annotation(node):
            call = parent.parent if parent.type == "arglist" else parent  # (several arguments)
            if call is not None and call.type == "trailer" and call.parent is not None and \
                    self._counts(call.parent, child):
                return True
            if self._counts(parent, child):
                return True
            kids = parent.children
            if parent.type == "expr_stmt" and len(kids) == 3 and kids[2] is child and \
                    kids[0].type == "name" and getattr(kids[1], "value", "") == "=":
                scope = parent.parent  # a name assigned the predicate, counted in its function
                while scope is not None and scope.type not in ("funcdef", "file_input"):
                    scope = scope.parent
                stack = list(getattr(scope, "children", ()))
                while stack:
                    n = stack.pop()
                    stack.extend(getattr(n, "children", ()))
                    kids = getattr(n, "children", ())
                    calls = [args_of(kids[k])[:1] for k in function_calls(n, COUNTS)]
                    heads = [kids[0]] if n.type == "atom_expr" else []
                    for c in [*(a[0] for a in calls if a), *heads]:
                        if c.type == "name" and c.value == parent.children[0].value and \
                                self._counts(n, c):
                            return True
                return False
            child, parent = parent, parent.parent
        return False

    def _kind(self, node: Any) -> str:
        if node.type == "operator" and node.value in FLIP and node.parent is not None and \
                node.parent.type == "comparison" and self._counted(node):
            return "flip"
        if node.type == "factor" and node.children[0].value == "~" and self._counted(node):
            return "invert"
        return ""

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        kind = self._kind(node)
        if kind == "flip":
            yield node.start_pos, node.end_pos
        elif kind == "invert":
            yield node.children[0].start_pos, node.children[0].end_pos

    def mutate(self, node: Any, index: int) -> Any:
        if self._kind(node) == "flip":
            node.value = FLIP[node.value]
            return node
        operand = node.children[1]
        operand.get_first_leaf().prefix = node.get_first_leaf().prefix
        return operand

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (Example("n = jnp.sum(lens > 0)\n", "n = jnp.sum(lens >= 0)\n"),
                Example("n = np.count_nonzero(ids != pad)\n", "n = np.count_nonzero(ids == pad)\n"),
                Example("n = jnp.sum(~m & ok)\n", "n = jnp.sum(m & ok)\n"))


OPERATORS: dict[str, type[Operator]] = {op.__name__: op for op in (
    RemoveFloat32Cast, DropPreferredElementType, PromoteTypesToInput, DropDtypeKeyword,
    WhereToTrueBranch, WhereToFalseBranch, IsfiniteToTrue, ClampToOperand, SwapPairedName,
    DropPassedOnOption, ForgetRestoredField, CountOtherPredicate)}


# the operators (by prefix) that make some of the very mutants one of ours makes, at the same
# place: sample.py runs such a mutant once, under our name
OVERLAPS: dict[str, tuple[str, ...]] = {
    "CountOtherPredicate": ("core/ReplaceComparisonOperator_", "core/ReplaceUnaryOperator_"),
    "DropPassedOnOption": ("jaxaccum/DropDtypeKeyword", "jaxaccum/DropPreferredElementType"),
}


class Provider:
    """cosmic-ray's operator-provider protocol (iterate the names, index by name)."""

    def __iter__(self) -> Iterator[str]:
        return iter(OPERATORS)

    def __getitem__(self, name: str) -> type[Operator]:
        return OPERATORS[name]


PROVIDER_NAME = "jaxaccum"
PROVIDER = Provider()
