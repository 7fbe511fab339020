"""Every code block of the documentation runs, as a real program, so the docs cannot drift.

The blocks are the fenced ```python and ```bash blocks of README.md, docs/*.md and
docs/backends/*.md. A python block without a directive must run: on its own with python, or,
when it builds a mesh of more than one rank (``init_device_mesh((2, 4), ...)``), under meshrun
with that many ranks. A bash block runs only when marked ``run``. An HTML comment on the line
just before the fence changes that; the syntax is in docs/index.md ("Code blocks are tested"):

    <!-- doctest: skip (needs a GPU) -->         not run; the reason is required
    <!-- doctest: ranks=4 -->                    under meshrun with 4 ranks
    <!-- doctest: ranks=2 backend=mpi -->        meshrun --backend mpi
    <!-- doctest: continue -->                   appended to the block before it (one program)
    <!-- doctest: rounds=5 timeout=60 -->        run 5 times (races), seconds per run
    <!-- doctest: free-port=STORE_PORT -->       a free TCP port in $STORE_PORT
    <!-- doctest: file=train.py -->              the program's file name (a later bash block
                                                 of the same page that is marked run finds it)
    <!-- doctest: run -->                        a bash block that runs
    <!-- doctest: ranks=8
    import numpy as np                           lines after the first: hidden setup code,
    # after the block:                           run before the block, and after this
    assert z.tolist() == [14.0] * 3              line hidden checks run after it, e.g. of
    -->                                          the values its comments claim (python only)

Fences with any other language, or none (diagrams, printed output), are text.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PAGES += sorted((REPO / "docs" / "backends").glob("*.md"))

PYTHON_LANGS = {"python", "py"}
BASH_LANGS = {"bash", "sh", "shell"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,})(?P<lang>[\w+-]*)\s*$")
DIRECTIVE_START = re.compile(r"^\s*<!--\s*doctest:(?P<rest>.*)$")
# init_device_mesh((2, 4), ...) or init_device_mesh(mesh_shape=(8,)): the world the block needs.
MESH_SHAPE = re.compile(r"init_device_mesh\(\s*(?:mesh_shape=)?\(([\d,\s]+)\)")
AFTER = "# after the block:"
# Seconds per run of a block: a mesh of 8 ranks starts in well under a second here; the slowest
# blocks import torch or jax in every rank (several seconds each on 2 busy cores).
DEFAULT_TIMEOUT = 90.0


@dataclass
class Directive:
    """What the HTML comment before a fence says; the defaults are a block without one."""

    skip: str | None = None
    ranks: int | None = None
    backend: str | None = None
    cont: bool = False
    rounds: int = 1
    timeout: float = DEFAULT_TIMEOUT
    free_port: str | None = None
    file: str | None = None
    run: bool = False
    setup: str = ""
    after: str = ""


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str  # "python" or "bash"
    code: str
    directive: Directive
    chained: list[Block] = field(default_factory=list)  # `continue` blocks that follow

    @property
    def where(self) -> str:
        lines = "+".join(str(b.line) for b in [self, *self.chained])
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{lines}"


def parse_directive(text: str, where: str) -> Directive:
    """Parse ``<!-- doctest: ... -->`` (``text`` is what lies between ``doctest:`` and
    ``-->``); a mistake raises ValueError naming ``where``, so a typo cannot silently skip."""
    first, _, hidden = text.partition("\n")
    setup, marker, after = f"\n{hidden}".partition(f"\n{AFTER}\n")
    if not marker and hidden.rstrip().endswith(AFTER):
        raise ValueError(f"{where}: nothing after {AFTER!r}")
    d = Directive(setup=setup.strip("\n"), after=after.strip("\n"))
    skip = re.search(r"\bskip\s*\(([^)]*)\)", first)
    if skip:
        if not skip.group(1).strip():
            raise ValueError(f"{where}: skip needs a reason: skip (why)")
        d.skip = skip.group(1).strip()
        first = first[: skip.start()] + first[skip.end() :]
    for token in first.split():
        key, eq, value = token.partition("=")
        try:
            if token == "skip":
                raise ValueError("skip needs a reason: skip (why)")
            if token == "continue":
                d.cont = True
            elif token == "run":
                d.run = True
            elif key == "ranks" and eq:
                d.ranks = int(value)
            elif key == "rounds" and eq:
                d.rounds = int(value)
            elif key == "timeout" and eq:
                d.timeout = float(value)
            elif key == "backend" and eq:
                d.backend = value
            elif key == "free-port" and eq:
                d.free_port = value
            elif key == "file" and eq:
                d.file = value
            else:
                raise ValueError(f"unknown directive {token!r}")
        except ValueError as exc:
            raise ValueError(f"{where}: {exc} in <!-- doctest:{text} -->") from None
    if (d.ranks is not None and d.ranks < 1) or d.rounds < 1:
        raise ValueError(f"{where}: bad directive <!-- doctest:{text} -->")
    return d


def parse_page(page: Path) -> list[Block]:
    """The python and bash blocks of one page, `continue` blocks folded into their heads."""
    lines = page.read_text(encoding="utf-8").split("\n")
    rel = page.relative_to(REPO) if page.is_relative_to(REPO) else page
    blocks: list[Block] = []
    pending: tuple[Directive, int] | None = None  # a directive and the line it ended on
    i = 0
    while i < len(lines):
        m = DIRECTIVE_START.match(lines[i])
        if m:
            start = i
            body = [m.group("rest")]
            while "-->" not in body[-1]:
                i += 1
                if i == len(lines):
                    raise ValueError(f"{rel}:{start + 1}: unclosed <!-- doctest: comment")
                body.append(lines[i])
            body[-1] = body[-1][: body[-1].index("-->")]
            pending = (parse_directive("\n".join(body), f"{rel}:{start + 1}"), i)
            i += 1
            continue
        m = FENCE.match(lines[i])
        if not m:
            if pending is not None and lines[i].strip():
                raise ValueError(f"{rel}:{pending[1] + 1}: a doctest comment must come just "
                                 "before a fence")  # fmt: skip
            i += 1
            continue
        # Find the closing fence: as many backticks or more, nothing else on the line.
        opening, indent, lang = i, len(m.group("indent")), m.group("lang").lower()
        i += 1
        while i < len(lines) and not re.fullmatch(rf"\s*{m.group('fence')}`*\s*", lines[i]):
            i += 1
        code = "\n".join(line[indent:] for line in lines[opening + 1 : i]) + "\n"
        i += 1
        directive, pending = (pending[0] if pending else Directive()), None
        if lang not in PYTHON_LANGS | BASH_LANGS:
            continue
        kind = "python" if lang in PYTHON_LANGS else "bash"
        block = Block(page, opening + 1, kind, code, directive)
        if directive.cont:
            if not blocks or blocks[-1].lang != kind:
                raise ValueError(f"{block.where}: continue needs a {kind} block before it")
            blocks[-1].chained.append(block)
        else:
            blocks.append(block)
    if pending is not None:
        raise ValueError(f"{rel}:{pending[1] + 1}: a doctest comment with no fence after it")
    return blocks


def _params() -> list[object]:
    params: list[object] = []
    for page in PAGES:
        try:
            blocks = parse_page(page)
        except ValueError as exc:
            # A broken directive fails as a test of its own rather than stopping collection.
            params.append(pytest.param(None, str(exc), id=f"{page.relative_to(REPO)}:parse"))
            continue
        for b in blocks:
            params.append(pytest.param(b, "", id=b.where))
    return params


def program(block: Block) -> str:
    """The program a python block runs: setup, code and checks, then each chained block's."""
    parts = []
    for b in [block, *block.chained]:
        if b.directive.setup:
            parts.append(f"# doctest setup ({b.where})\n{b.directive.setup}\n")
        parts.append(b.code)
        if b.directive.after:
            parts.append(f"# doctest checks ({b.where})\n{b.directive.after}\n")
    return "\n".join(parts)


def ranks_of(block: Block) -> int:
    """Ranks from the directive, else from a literal mesh shape in the program, else 1."""
    if block.directive.ranks is not None:
        return block.directive.ranks
    shapes = [
        math.prod(int(n) for n in m.group(1).replace(",", " ").split())
        for m in MESH_SHAPE.finditer(program(block))
    ]
    return max(shapes, default=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environment() -> dict[str, str]:
    env = dict(os.environ)
    # The checkout's meshcomm, and this interpreter's console scripts (meshrun) on PATH, as
    # a reader who installed the package has them.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    # A program started by the suite must not inherit a launcher's variables from a parent.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def meshrun(nproc: int, backend: str | None) -> list[str]:
    script = BIN / "meshrun"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "meshcomm.run"]
    argv += ["--nproc-per-node", str(nproc)]
    return argv + (["--backend", backend] if backend else [])


def write_named_files(block: Block, where: Path) -> None:
    """Write the page's ``file=`` python blocks before ``block`` into ``where``: the programs
    a bash block runs by name."""
    for b in parse_page(block.page):
        if b.line >= block.line:
            break
        if b.lang == "python" and b.directive.file:
            (where / b.directive.file).write_text(program(b), encoding="utf-8")


def check_output(block: Block, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
    d = block.directive
    # A session of its own, so that a block that hangs takes its launcher, mpiexec and every
    # rank with it when the timeout kills the group.
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=d.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{block.where} did not finish in {d.timeout:g} s: {shlex.join(argv)}\n"
                    f"{stdout}\n{stderr}")  # fmt: skip
    text = stdout + stderr
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{text}"
    # A doc example that prints a warning teaches the reader to ignore warnings.
    warnings = [line for line in text.splitlines() if "Warning" in line]
    assert not warnings, f"{block.where} printed warnings:\n" + "\n".join(warnings)


@pytest.mark.parametrize(("block", "error"), _params())
def test_doc_block_runs(block: Block | None, error: str, tmp_path: Path) -> None:
    if block is None:
        pytest.fail(error)
    d = block.directive
    if d.skip:
        pytest.skip(d.skip)
    if block.lang == "bash" and not d.run:
        pytest.skip("bash blocks run only when marked <!-- doctest: run -->")
    env = environment()
    if block.lang == "bash":
        write_named_files(block, tmp_path)
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    else:
        name = d.file or "doc_block.py"
        (tmp_path / name).write_text(program(block), encoding="utf-8")
        n = ranks_of(block)
        argv = ([sys.executable] if n == 1 and not d.backend else meshrun(n, d.backend)) + [name]
    for _ in range(d.rounds):
        if d.free_port:
            env[d.free_port] = str(free_port())
        check_output(block, argv, tmp_path, env)


def test_every_page_has_blocks_to_run() -> None:
    """The parser sees the blocks: a change to the fence syntax must not empty the test."""
    blocks = [b for p in PAGES for b in parse_page(p) if b.lang == "python"]
    assert len(blocks) >= 15, [b.where for b in blocks]
    assert any(b.page.name == "store.md" and b.directive.rounds >= 5 for b in blocks)


# -- links ------------------------------------------------------------------------------------
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens.

    Example: ``## How the hierarchy is chosen`` is ``#how-the-hierarchy-is-chosen``.
    """
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of ``page``: its headings' slugs (repeats numbered, as GitHub does)."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in prose_lines(page):
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def prose_lines(page: Path) -> list[str]:
    """The lines of ``page`` outside fenced code blocks and doctest directives."""
    out, fence, comment = [], "", False
    for line in page.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if m and (not fence or (m.group("fence").startswith(fence) and not m.group("lang"))):
            fence = "" if fence else m.group("fence")
            continue
        if comment or DIRECTIVE_START.match(line):
            comment = "-->" not in line
            continue
        if not fence:
            out.append(line)
    return out


def _name(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else page.name


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or #anchor does not exist."""
    broken = []
    for line in prose_lines(page):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            target = m.group("target")
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{_name(page)}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{_name(page)}: {target}: no heading #{anchor}")
    return broken


#: Known drift in pages this test's author could not edit (issue 33), each fixed by its
#: page's owner; an entry that is no longer true fails the test, so the list only shrinks.
PENDING: set[str] = set()


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = {b for page in PAGES for b in broken_links(page)}
    assert not broken - PENDING, "\n".join(sorted(broken - PENDING))
    fixed = {p for p in PENDING if "#" in p and p not in broken}
    assert not fixed, f"fixed: remove from PENDING: {fixed}"


def test_the_link_check_sees_links_and_anchors(tmp_path: Path) -> None:
    page = _page(tmp_path, "# A `b` c?\n\n## Same\n\n## Same\n\n[x](#a-b-c) [y](#same-1)\n"
                 "[z](#nope) [w](missing.md) ![img](missing.png) `[q](no.md)`\n"
                 "```python\n# [r](no.md)\n```\n")  # fmt: skip
    assert [b.split(": ", 1)[1] for b in broken_links(page)] == [
        "#nope: no heading #nope",
        "missing.md: no such file",
    ]


# -- stale words -------------------------------------------------------------------------------
#: Sentences that said a backend or feature did not exist after it did (issue 33).
STALE = [
    re.compile(r"NCCL is not written"),
    re.compile(r"\*\*nccl\*\* \(not yet\)"),
    re.compile(r"nccl \(not yet\)"),
    re.compile(r"as the NCCL backend will need"),
]


def test_no_page_says_what_is_built_is_missing() -> None:
    stale = set()
    for page in PAGES:
        text = " ".join(page.read_text(encoding="utf-8").split())  # across line breaks
        stale |= {f"{_name(page)}: {m.group(0)}" for p in STALE for m in p.finditer(text)}
    assert not stale - PENDING, "\n".join(sorted(stale - PENDING))
    fixed = {p for p in PENDING if "#" not in p and p not in stale}
    assert not fixed, f"fixed: remove from PENDING: {fixed}"


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return page


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- doctest: rank=2 -->\n```python\npass\n```\n", "unknown directive 'rank=2'"),
        ("<!-- doctest: skip -->\n```python\npass\n```\n", "skip needs a reason"),
        ("<!-- doctest: skip () -->\n```python\npass\n```\n", "skip needs a reason"),
        ("<!-- doctest: ranks=2 -->\n\nprose\n```python\npass\n```\n", "just before a fence"),
        ("text\n<!-- doctest: ranks=2 -->\n", "no fence after it"),
        ("<!-- doctest: continue -->\n```python\npass\n```\n", "continue needs a python"),
    ],
)
def test_a_bad_directive_is_an_error_not_a_skip(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_page(_page(tmp_path, text))


def test_directives_setup_and_chains(tmp_path: Path) -> None:
    text = (
        "<!-- doctest: ranks=2 rounds=3 timeout=5 free-port=P file=a.py\nx = 1\n-->\n"
        "```python\ny = x\n```\n\n```text\nnot code\n```\n"
        "<!-- doctest: continue -->\n```python\nprint(y)\n```\n"
        "  ```bash\n  echo indented\n  ```\n"
    )
    head, bash = parse_page(_page(tmp_path, text))
    d = head.directive
    assert (d.ranks, d.rounds, d.timeout, d.free_port, d.file) == (2, 3, 5.0, "P", "a.py")
    assert [b.line for b in head.chained] == [12] and head.where.endswith("page.md:4+12")
    assert program(head).split("\n")[1:] == ["x = 1", "", "y = x", "", "print(y)", ""]
    after = parse_directive(" ranks=2\nimport a\n# after the block:\nassert b\n", "w")
    assert (after.setup, after.after) == ("import a", "assert b")
    only = parse_directive(" continue\n# after the block:\nassert b", "w")
    assert (only.setup, only.after, only.cont) == ("", "assert b", True)
    assert (bash.lang, bash.code, bash.directive.run) == ("bash", "echo indented\n", False)
    assert ranks_of(Block(head.page, 1, "python", "init_device_mesh((2, -1, 4))", Directive())) == 1
    code = "m = init_device_mesh(mesh_shape=(2, 4), mesh_dim_names=('a', 'b'))"
    assert ranks_of(Block(head.page, 1, "python", code, Directive())) == 8
