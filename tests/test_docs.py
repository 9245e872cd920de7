"""The README and docs/ cannot rot: every code block runs, every link resolves, every option
named in a runtime's options table is that runtime's.

Fence conventions (docs/README.md says the same to writers):

- ```python   run. A page's python blocks run in order in one fresh interpreter (one
              namespace, like a notebook), in an empty temp dir that is the working dir
              and TMPDIR (so what the examples leave is removed with it).
- ```bash     run with ``bash -euo pipefail`` in an empty temp dir, this venv's bin first on PATH.
- ```toml / ```json   parsed (tomllib / json).
- ```console  output shown to the reader, never run (no commands in it).
- ```<lang> skip: <reason>   a block that cannot run here (a cluster, a batch system,
              root, the network, a 20-minute suite). It is still syntax-checked
              (``compile`` / ``bash -n`` / parsed), and each one is a skipped test that
              names the page, the line and the reason, so ``-ra`` lists them all.

Any other fence (or none) fails the suite, so nothing escapes this test silently.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(["README.md"] + [os.path.relpath(os.path.join(d, f), ROOT)
                                for d, _, files in os.walk(DOCS) for f in files
                                if f.endswith(".md")])
RUN, PARSE, SHOWN = {"python", "bash"}, {"toml", "json"}, {"console"}
#: A fence, indented or not (inside a list item too); ``~~~`` fences are refused below.
FENCE = re.compile(r"^\s*```(.*)$")

#: The runtimes, the class each page documents, and the page.
RUNTIME_PAGES = {
    "mpirun": ("hetflow.executors.mpirun", "MpirunExecutor"),
    "parsl": ("hetflow.executors.parsl_htex", "ParslMPIExecutor"),
    "radical": ("hetflow.executors.radical", "RadicalExecutor"),
    "pool": ("hetflow.executors.pool", "PoolExecutor"),
    "slurm": ("hetflow.executors.slurm", "SlurmExecutor"),
    "debug": ("hetflow.executors.debug", "DebugExecutor"),
}


def blocks(page: str):
    """``[(language, skip reason or None, first line number, code)]`` of a page's fences."""
    found, current = [], None
    with open(os.path.join(ROOT, page)) as fh:
        lines = fh.read().splitlines()
    for number, line in enumerate(lines, 1):
        match = FENCE.match(line)
        if current is None and match:
            info = match.group(1).strip()
            lang, _, rest = info.partition(" ")
            reason = None
            if rest.strip().startswith("skip:"):
                reason = rest.strip()[len("skip:"):].strip()
            elif rest.strip():
                lang = info       # unknown info string: reported as such
            current = (lang, reason, number + 1, [])
        elif current is None and line.lstrip().startswith("~~~"):
            raise AssertionError(f"{page}:{number}: use ``` fences (the doc test reads only those)")
        elif current is not None and line.strip().startswith("```"):
            # A fence indented inside a list item: its code loses the common indentation.
            found.append((*current[:3], textwrap.dedent("\n".join(current[3]) + "\n")))
            current = None
        elif current is not None:
            current[3].append(line)
    assert current is None, f"{page}: unclosed code block from line {current[2] - 1}"
    return found


ALL = [(page, *b) for page in PAGES for b in blocks(page)]


def _id(page, line):
    return f"{page}:{line}"


def test_pages_exist():
    """The pages the README promises (one per runtime) are there."""
    for name in ["api", "engine", "reliability", "security", "experiments", "architecture",
                 "install"] + [f"runtimes/{r}" for r in RUNTIME_PAGES]:
        assert f"docs/{name}.md" in PAGES, name


def test_every_fence_is_known():
    """Every block runs, is parsed, is output, or is skipped with a reason."""
    bad = [f"{_id(p, n)} ```{lang}" for p, lang, reason, n, _ in ALL
           if lang not in RUN | PARSE | SHOWN or (reason is not None and lang in SHOWN)
           or reason == ""]
    assert not bad, "unknown fence or skip without a reason: " + ", ".join(bad)


def test_readme_is_short():
    with open(os.path.join(ROOT, "README.md")) as fh:
        assert len(fh.read().splitlines()) <= 200


# --------------------------------------------------------------------------- python pages
PY_PAGES = sorted({p for p, lang, reason, *_ in ALL if lang == "python" and reason is None})

_RUNNER = r"""
import sys
page, blocks = sys.argv[1], __import__("json").loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for line, code in blocks:
    print(f"--- {page}:{line}", flush=True)
    exec(compile(code, f"{page}:{line}", "exec"), namespace)
"""


@pytest.mark.parametrize("page", PY_PAGES)
def test_python_blocks_run(page, tmp_path):
    """The page's python blocks, in order, in one interpreter: each must run cleanly."""
    code = [(n, src) for p, lang, reason, n, src in ALL
            if p == page and lang == "python" and reason is None]
    # The page's temp files (tempfile.mkdtemp() in examples, run dirs) land in tmp_path too.
    env = dict(os.environ, HETFLOW_PROGRESS="0", PYTHONPATH="", TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _RUNNER, page], input=json.dumps(code),
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240)
    assert proc.returncode == 0, f"{page}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


# --------------------------------------------------------------------------- bash blocks
BASH = [(p, n, src) for p, lang, reason, n, src in ALL if lang == "bash" and reason is None]


@pytest.mark.parametrize("page,line,code", BASH, ids=[_id(p, n) for p, n, _ in BASH])
def test_bash_blocks_run(page, line, code, tmp_path):
    env = dict(os.environ, HETFLOW_PROGRESS="0", TMPDIR=str(tmp_path),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, f"{page}:{line}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


# --------------------------------------------------------------------------- parsed blocks
PARSED = [(p, lang, n, src) for p, lang, reason, n, src in ALL if lang in PARSE]


@pytest.mark.parametrize("page,lang,line,code", PARSED, ids=[_id(p, n) for p, _, n, _ in PARSED])
def test_data_blocks_parse(page, lang, line, code):
    data = tomllib.loads(code) if lang == "toml" else json.loads(code)
    entry = (data.get("project") or {}).get("entry-points", {}).get("hetflow.executors")
    if entry:   # an entry-point example must name real classes
        for target in entry.values():
            module, _, name = target.partition(":")
            assert getattr(__import__(module, fromlist=[name]), name)


# --------------------------------------------------------------------------- skipped blocks
SKIPPED = [(p, lang, reason, n, src) for p, lang, reason, n, src in ALL if reason]


@pytest.mark.parametrize("page,lang,reason,line,code", SKIPPED,
                         ids=[_id(p, n) for p, _, _, n, _ in SKIPPED])
def test_skipped_blocks(page, lang, reason, line, code):
    """Not run here (the reason says why), but they must at least be well-formed."""
    if lang == "python":
        compile(code, f"{page}:{line}", "exec")
    elif lang == "bash":
        subprocess.run(["bash", "-n", "-c", code], check=True)
    pytest.skip(f"{page}:{line} ```{lang}: {reason}")


# --------------------------------------------------------------------------- links
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_exist(page):
    """Every relative link points at a file or folder of the checkout (and, with a
    ``#anchor`` into a markdown page, at one of its headings)."""
    text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, page)).read(), flags=re.S)
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path \
            else os.path.join(ROOT, page)
        if not os.path.exists(where):
            missing.append(target)
        elif anchor and where.endswith(".md") and anchor not in _anchors(where):
            missing.append(target)
    assert not missing, f"{page}: broken links {missing}"


def _anchors(path: str) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for line in open(path).read().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


# --------------------------------------------------------------------------- options tables
def options_table(page: str, heading: str) -> dict:
    """``{name: default cell}`` from the table under ``heading`` (first column `name`)."""
    text = open(os.path.join(ROOT, page)).read()
    assert heading in text, f"{page}: no {heading!r} section"
    rows = {}
    for line in text[text.index(heading):].splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def check_against(signature: inspect.Signature, rows: dict, where: str) -> None:
    """Names both ways; each default cell starts with the default as a Python literal."""
    params = {name: p for name, p in signature.parameters.items()
              if name != "self" and p.kind is not p.VAR_KEYWORD and p.kind is not p.VAR_POSITIONAL}
    assert set(rows) == set(params), (f"{where}: documented but not in the code "
                                      f"{sorted(set(rows) - set(params))}, in the code but not "
                                      f"documented {sorted(set(params) - set(rows))}")
    for name, cell in rows.items():
        literal = re.match(r"`([^`]*)`", cell)
        assert literal, f"{where}: {name}'s default cell {cell!r} must start with `literal`"
        default = params[name].default
        if default is inspect.Parameter.empty:
            assert literal.group(1) == "required", f"{where}: {name} has no default"
        else:
            assert ast.literal_eval(literal.group(1)) == default, \
                f"{where}: {name} defaults to {default!r}, documented {literal.group(1)}"


@pytest.mark.parametrize("runtime", sorted(RUNTIME_PAGES))
def test_runtime_page_documents_every_option(runtime):
    import importlib

    module, name = RUNTIME_PAGES[runtime]
    cls = getattr(importlib.import_module(module), name)
    page = f"docs/runtimes/{runtime}.md"
    check_against(inspect.signature(cls.__init__), options_table(page, "## Options"), page)


def test_api_page_documents_mpi_app_and_runtime():
    import hetflow

    check_against(inspect.signature(hetflow.mpi_app), options_table("docs/api.md", "## `mpi_app`"),
                  "docs/api.md mpi_app")
    check_against(inspect.signature(hetflow.runtime),
                  options_table("docs/api.md", "## `hetflow.runtime`"), "docs/api.md runtime")


def test_api_page_names_every_error():
    import hetflow

    text = open(os.path.join(DOCS, "api.md")).read()
    missing = [e for e in hetflow._ERRORS + ("InvalidResourceSpec",) if f"`{e}`" not in text]
    assert not missing, missing


def test_readme_table_has_one_row_per_runtime():
    import hetflow

    text = open(os.path.join(ROOT, "README.md")).read()
    rows = re.findall(r"^\| \[`(\w+)`\]\(docs/runtimes/(\w+)\.md\)", text, re.M)
    assert sorted(r for r, _ in rows) == sorted(hetflow.available_runtimes()) \
        == sorted(RUNTIME_PAGES)
    assert all(a == b for a, b in rows)


def test_readme_commands_are_the_makefiles():
    """The two commands the README gives are the Makefile's targets that .ci/run calls."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    for target in ("demo", "test"):
        assert re.search(rf"^make {target}\b", readme, re.M), target
        assert re.search(rf"^{target}:", makefile, re.M), target
    assert re.search(r"^make test$", ci, re.M)
