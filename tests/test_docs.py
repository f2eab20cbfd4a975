"""The documentation: the site builds with warnings as errors, its API reference documents every
public name, and the Python examples of README.md and docs/ run.

- ``test_site_builds_strict``: ``mkdocs build --strict`` (mkdocs.yml; the API pages come from the
  docstrings through mkdocstrings), then every name of ``jaxaccum.__all__`` must have its entry
  in the built API page docs/api/core.md, and every public submodule (``jaxaccum.nnx``, ...) a
  page docs/api/<name>.md with an entry for each function and class it defines: a new public
  name without documentation fails here.
- ``test_code_blocks_fit_the_column``: no line of a code block in README.md, docs/ or
  examples/README.md is wider than the site's content column shows (80 characters).
- ``test_benchmarks_open_with_the_summary``: the Benchmarks page shows exactly what
  ``benchmarks/summary.py`` prints from the committed ``peers.json``.
- ``test_coupled_guide_shows_the_committed_run``: the coupled losses guide's table is
  ``python benchmarks/coupled.py --table`` on the committed ``coupled.json``.
- ``test_python_blocks_run``: every ```` ```python ```` block of README.md and of each
  ``docs/**/*.md`` page, in order, in one namespace per page, in a fresh interpreter per page
  (8 host CPU devices when the page builds a mesh). A block whose previous non-blank line is
  ``<!-- skip-test -->`` is not run: use it only for code that cannot run as it stands (a
  fragment, a listing of old code), and say so beside it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP_MARKER = "<!-- skip-test -->"
# Code that needs several devices: its page runs with 8 host CPU devices.
MULTI_DEVICE = re.compile(r"make_mesh|\bMesh\(|jax\.devices\(|device_count|DataParallel\(")
_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n]*)$")


def fenced_blocks(text: str) -> list[tuple[int, str, str, list[str]]]:
    """Every fenced code block: (1-based line of the fence, language, the previous non-blank
    line, the block's lines without the fence's indentation)."""
    lines = text.splitlines()
    blocks: list[tuple[int, str, str, list[str]]] = []
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        lang = (m.group("info").split() or [""])[0].lstrip(".{").lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                break
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1
        previous = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        blocks.append((start + 1, lang, previous, body))
    return blocks


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```` ```python ```` blocks not marked to skip, as (1-based line of the fence, code)."""
    return [(line, "\n".join(body) + "\n") for line, lang, previous, body in fenced_blocks(text)
            if lang in ("python", "py") and previous != SKIP_MARKER]


def pages() -> list[pathlib.Path]:
    """README.md and every Markdown page under docs/ that holds a Python block to run."""
    candidates = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in candidates if python_blocks(p.read_text(encoding="utf-8"))]


# Runs one page's blocks (JSON on stdin) in one namespace; prints one JSON line per block.
RUNNER = r"""
import json, sys, traceback
page, blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for line, code in blocks:
    try:
        exec(compile(code, f"{page}:{line}", "exec"), namespace)
    except BaseException as e:
        tb = traceback.format_exception(type(e), e, e.__traceback__.tb_next)  # not this frame
        print(json.dumps({"line": line, "error": "".join(tb[-6:])}), flush=True)
    else:
        print(json.dumps({"line": line, "error": None}), flush=True)
"""


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(page: pathlib.Path, tmp_path: pathlib.Path) -> None:
    name = page.relative_to(ROOT).as_posix()
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    env = dict(os.environ, MPLBACKEND="Agg")
    if any(MULTI_DEVICE.search(code) for _, code in blocks):
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
        env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([name, blocks]),
        capture_output=True,
        text=True,
        cwd=tmp_path,  # whatever the examples write lands here
        env=env,
        timeout=600,
    )
    results = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"line"')]
    failed = [r for r in results if r["error"]]
    report = "\n".join(f"--- {name}, block at line {r['line']}:\n{r['error']}" for r in failed)
    assert proc.returncode == 0, f"the runner crashed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    assert len(results) == len(blocks), f"ran {len(results)} of {len(blocks)} blocks"
    if failed:
        pytest.fail(
            f"{len(failed)} of {len(blocks)} Python blocks of {name} fail (blocks run in order in"
            f" one namespace; mark a block that cannot run with a {SKIP_MARKER} line before it):"
            f"\n{report}",
            pytrace=False,
        )


def _public(module_name: str) -> list[str]:
    """The module's ``__all__``, or else the functions and classes it defines whose names do
    not start with ``_``."""
    import importlib

    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == module_name
    ]


# Members of public classes that have their own entry on an API page: the public API of those
# classes. A member missing here (a property the library uses, a helper) must stay off the
# pages; a new public one is added here on purpose.
PUBLIC_MEMBERS = {
    "jaxaccum.TrainStep": {"num_programs", "lower", "trace"},
    "jaxaccum.NoiseScale": {"simple"},
    "jaxaccum.MultiStepsTransformation": {"gradient_transformation"},
    "jaxaccum.packing.Packed": {"num_tokens", "fill", "microbatches"},
    "jaxaccum.packing.PackStream": {"get_state", "set_state"},
}
_HEADING = re.compile(r'<h[1-6] id="([^"]+)" class="doc doc-heading"')
_PRIVATE_NAME = re.compile(r"\bjaxaccum\._[a-z]\w*|(?<![\w.])_[a-z]\w*\.[A-Za-z]\w*")


def _private_entries(module: str, names: list[str], html: str) -> list[str]:
    """The entries of an API page that are not the public API, and private names in its text."""
    allowed = {module, *(f"{module}.{n}" for n in names)}
    allowed |= {f"{cls}.{m}" for cls, members in PUBLIC_MEMBERS.items() for m in members}
    extra = [i for i in _HEADING.findall(html) if i not in allowed]
    text = re.sub(r"<[^>]+>", "", html)
    return extra + sorted(set(_PRIVATE_NAME.findall(text)))


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs and mkdocstrings are not installed (the dev extra has them)",
)
def test_site_builds_strict(tmp_path: pathlib.Path) -> None:
    import jaxaccum

    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-6000:]}"
    # The core page documents jaxaccum.__all__; each public submodule (jaxaccum.nnx, ...) has a
    # page docs/api/<name>.md documenting the functions and classes it defines.
    submodules = sorted(m.name for m in pkgutil.iter_modules(jaxaccum.__path__) if m.name[0] != "_")
    pages = {"jaxaccum": (site / "api" / "core" / "index.html", list(jaxaccum.__all__))}
    for sub in submodules:
        module = f"jaxaccum.{sub}"
        pages[module] = (site / "api" / sub / "index.html", _public(module))
    for module, (html, names) in pages.items():
        assert html.is_file(), f"{module} has no API page: add docs/api/{html.parent.name}.md"
        text = html.read_text(encoding="utf-8")
        missing = [n for n in names if f'id="{module}.{n}"' not in text]
        assert not missing, (
            f"public names of {module} without an entry in {html.relative_to(site)}: {missing};"
            " add them to docs/api/ (e.g. '::: jaxaccum.NAME' in docs/api/core.md)"
        )
        private = _private_entries(module, names, text)
        assert not private, (
            f"{html.relative_to(site)} shows what is not {module}'s public API: {private}; "
            "keep it out of __all__ and the page (mkdocstrings 'members:'), or add a public "
            "class member to PUBLIC_MEMBERS"
        )


CODE_WIDTH = 80  # characters of a code block the content column shows without scrolling


def test_code_blocks_fit_the_column() -> None:
    pages = [ROOT / "README.md", ROOT / "examples" / "README.md",
             *sorted((ROOT / "docs").rglob("*.md"))]
    wide = [f"{page.relative_to(ROOT)}:{line + n + 1}: {len(text)} columns"
            for page in pages
            for line, _, _, body in fenced_blocks(page.read_text(encoding="utf-8"))
            for n, text in enumerate(body) if len(text) > CODE_WIDTH]
    assert not wide, f"code lines wider than {CODE_WIDTH} columns (they scroll sideways): {wide}"


def generated(page: str, marker: str, script: str, make: str, results: str) -> None:
    """The part of ``page`` between the ``marker`` comments is what ``make`` (a function of
    ``benchmarks/<script>.py``) prints from the committed ``benchmarks/results/<results>``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        module = importlib.import_module(script)
    finally:
        sys.path.pop(0)
    committed = json.loads((ROOT / "benchmarks" / "results" / results).read_text())
    text = (ROOT / page).read_text(encoding="utf-8")
    shown = text.split(f"<!-- {marker}:start -->\n")[1].split(f"<!-- {marker}:end -->")[0]
    assert shown == getattr(module, make)(committed), (
        f"{page}'s {marker} differs from what benchmarks/{script}.py prints from {results}: "
        f"paste its output between the {marker} markers")


def test_benchmarks_open_with_the_summary() -> None:
    generated("docs/benchmarks/index.md", "summary", "summary", "summary", "peers.json")


def test_coupled_guide_shows_the_committed_run() -> None:
    generated("docs/guides/coupled.md", "coupled", "coupled", "table", "coupled.json")


def test_lm_head_guide_shows_the_committed_run() -> None:
    generated("docs/guides/lm_head.md", "lm_head", "lm_head", "table", "lm_head.json")
