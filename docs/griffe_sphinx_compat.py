"""A griffe extension for the API pages: jaxaccum's Sphinx roles, read as intended.

mkdocs.yml loads it (mkdocstrings' python handler, ``extensions:``). It changes only how the
docstrings are read for the site, not the docstrings, and it hides no warning:

- Sphinx roles (``:func:`x```, ``:class:`x```, ``:mod:`x```, ...) become inline code ``x``:
  Markdown has no roles, and would otherwise print ``:func:`` before the name.
- A signature's annotation that names a public class through the private module defining it
  (``_train_step.TrainStep``) shows the public name (``TrainStep``): the pages show the
  public API only.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_PRIVATE = re.compile(r"^_\w+\.(\w+)$")
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")


def rewrite(text: str) -> str:
    """The docstring text with Sphinx roles as inline code."""
    return _ROLE.sub(r"`\1`", text)


class SphinxCompat(griffe.Extension):
    """Rewrites each docstring (see the module's docstring) before it is parsed."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        docstring = getattr(obj, "docstring", None)
        if docstring is not None:
            docstring.value = rewrite(docstring.value)
        if isinstance(obj, griffe.Function):
            obj.returns = public(obj.returns, obj)
            for parameter in obj.parameters:
                parameter.annotation = public(parameter.annotation, obj)


def public(annotation: Any, parent: Any) -> Any:
    """``annotation`` with a private module's prefix dropped (``_records.StepInfo`` ->
    ``StepInfo``); other annotations as they are."""
    match = _PRIVATE.match(str(annotation)) if annotation is not None else None
    return griffe.ExprName(match.group(1), parent=parent) if match else annotation
