"""No code comment, docstring, Makefile, pyproject or doc page cites a file or anchor that
does not exist.

What counts as a citation:

- a repository path: `shared/streams.py`, `services/*/settings.py` (a glob: something must
  match), `deploy/minio/`, each optionally with `#anchor`;
- a Markdown link in a `.md` file: `[text](../docs/x.md#anchor)`, relative to that file;
- a document by its name: `README.md`, `DESIGN.md`, `CONVENTIONS.md` (at the repository's
  root, beside the citing file, or in docs/), with a section: `README.md#anchor`,
  `DESIGN.md §3`, `DESIGN.md "Hot paths"`, `README: "The collector"`, `(README, Methods)`.

Anchors are computed the way the site (MkDocs with pymdownx's GitHub-style slugs, as
mkdocs.yml sets) and GitHub compute them, from the headings, after the generated references
(docs/hooks/reference.py) are expanded. A failure names each citing file:line and what it
cites.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from pymdownx.slugs import slugify

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import reference  # noqa: E402  (the generated pages' text)

# What is scanned: the code, its configuration and the docs; not task data, recordings,
# installed packages or build output.
SCANNED_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".cfg", ".ini", ".example"}
SCANNED_NAMES = {"Makefile"}
SKIPPED_DIRS = {".git", ".venv", ".venv-vllm", ".agents", "node_modules", "site", "__pycache__",
                ".pytest_cache", ".mypy_cache", ".ruff_cache", ".nextstate", "build", "dist"}
SKIPPED_PATHS = ("services/envs/tasks/", "tests/data/")
TOP = ("shared", "services", "tests", "bench", "deploy", "docs")

PATH = re.compile(
    r"(?<![\w./\-<{$])((?:" + "|".join(TOP) + r")/(?:[\w.*/\-]|<[^>\s]+>|\{[^}\s]+\})*(?:[\w*/>}]))"
    r"(#[\w\-]+)?"
)
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
DOC_NAME = re.compile(r"(?<![\w./\-])([A-Z][A-Z_\-]*\.md|[A-Za-z][\w\-]*\.md)(#[\w\-]+)?")
SECTION = re.compile(
    r"(?<![\w./\-])(README|DESIGN|CONVENTIONS)(?:\.md)?(?:'s)?(?:[,:]\s*|\s+)"
    r"(?:(§\s*[\w.]+)|[\"“]([^\"”\n]{2,80})[\"”])"
)
# A section cited after a Markdown file's path or name: `docs/x.md §3`, `x.md "Title"`.
TRAILING_SECTION = re.compile(r"(?:'s)?(?:[,:]\s*|\s+)(?:(§\s*[\w.]+)|[\"“]([^\"”\n]{2,80})[\"”])")
# "(README, Methods)" writes the doc name inside the parenthesis.
PAREN_SECTION = re.compile(r"\((README|DESIGN|CONVENTIONS)(?:\.md)?,\s*([A-Z][\w :]{2,60})\)")


@dataclass(frozen=True)
class Citation:
    file: Path
    line: int
    text: str  # as written
    target: Path | None  # the file it names (None: could not be resolved)
    anchor: str | None = None  # without '#'
    section: str | None = None  # a section cited by its title or §number

    def where(self, root: Path) -> str:
        return f"{self.file.relative_to(root)}:{self.line}"


def scanned_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        # other venvs (.venv-latest, …) and the caches (.cache: the lock tools, the models)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith((".venv", ".cache")))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel.startswith(SKIPPED_PATHS):
                continue
            if (path.suffix in SCANNED_SUFFIXES or name in SCANNED_NAMES
                    or name.startswith("Dockerfile")):
                yield path


def _doc_file(root: Path, citing: Path, name: str) -> Path:
    """Where a document cited by its bare name is: beside the citing file, at the root, in docs/."""
    for candidate in (citing.parent / name, root / name, root / "docs" / name):
        if candidate.exists():
            return candidate
    return root / name


def _section_after(line: str, m: re.Match[str]) -> tuple[str, int] | None:
    """A section cited right after a match (`§3`, `"Title"`), and where it ends."""
    after = TRAILING_SECTION.match(line, m.end())
    if not after:
        return None
    return next(g for g in after.groups() if g), after.end()


def citations(root: Path, path: Path) -> Iterator[Citation]:
    try:
        text = path.read_text()
    except (UnicodeDecodeError, OSError):
        return
    is_md = path.suffix == ".md"
    for n, line in enumerate(text.splitlines(), 1):
        if is_md:
            for m in LINK.finditer(line):
                url = m.group(1)
                if re.match(r"[a-z][a-z0-9+.\-]*:", url) or url.startswith(("//", "<")):
                    continue
                target, _, anchor = url.partition("#")
                dest = (path.parent / target).resolve() if target else path
                yield Citation(path, n, m.group(0), dest, anchor or None)
        for m in PATH.finditer(line):
            rel, anchor = m.group(1), m.group(2)
            rel = re.sub(r"<[^>]+>|\{[^}]+\}", "*", rel)  # `v<version>/`, f"{role}.json": any value
            section = _section_after(line, m) if rel.endswith(".md") and not anchor else None
            yield Citation(path, n, line[m.start():section[1]] if section else m.group(0), root / rel,
                           anchor[1:] if anchor else None, section[0] if section else None)
        sections = [m.span() for m in (*SECTION.finditer(line), *PAREN_SECTION.finditer(line))]
        if is_md:
            sections += [m.span() for m in LINK.finditer(line)]
        for m in DOC_NAME.finditer(line):
            if m.start() > 0 and line[m.start() - 1] == "/":
                continue
            if any(a <= m.start() < b for a, b in sections):
                continue  # cited with its section, below
            section = None if m.group(2) else _section_after(line, m)
            yield Citation(path, n, line[m.start():section[1]] if section else m.group(0),
                           _doc_file(root, path, m.group(1)), m.group(2)[1:] if m.group(2) else None,
                           section[0] if section else None)
        for m in SECTION.finditer(line):
            section = next(g for g in m.groups()[1:] if g)
            yield Citation(path, n, m.group(0), _doc_file(root, path, m.group(1) + ".md"),
                           section=section.strip())
        for m in PAREN_SECTION.finditer(line):
            yield Citation(path, n, m.group(0), _doc_file(root, path, m.group(1) + ".md"),
                           section=m.group(2).strip())


def _plain(heading: str) -> str:
    """A heading's text as rendered: no code marks, emphasis, links or tags."""
    text = re.sub(r"\s*\{[^}]*\}\s*$", "", heading)  # attr_list
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("`", "").replace("**", "").replace("*", "").strip()


_SLUG = slugify(case="lower")


@cache
def headings(path: Path) -> tuple[tuple[str, ...], frozenset[str]]:
    """(heading titles, anchors) of a Markdown file, generated references expanded."""
    text = path.read_text()
    if reference.MARKER.search(text):
        text = reference.expand(text)
    titles: list[str] = []
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fence = None
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            mark = stripped[:3]
            fence = None if fence == mark else (fence or mark)
            continue
        if fence:
            continue
        m = re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            raw = m.group(2)
            explicit = re.search(r"\{[^}]*#([\w\-]+)[^}]*\}\s*$", raw)
            title = _plain(raw)
            titles.append(title)
            slug = explicit.group(1) if explicit else _SLUG(title, "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug)
            if count:  # duplicates: MkDocs appends _1, GitHub -1
                anchors.update({f"{slug}_{count}", f"{slug}-{count}"})
        for m in re.finditer(r"<a\s+(?:id|name)=\"([^\"]+)\"", line):
            anchors.add(m.group(1))
    return tuple(titles), frozenset(anchors)


def problem(c: Citation) -> str | None:
    """Why a citation does not resolve, or None when it does."""
    target = c.target
    if target is None:
        return "cannot be resolved"
    if any(ch in str(target) for ch in "*?["):
        rel = target.relative_to(ROOT).as_posix()
        return None if any(ROOT.glob(rel.rstrip("/"))) else f"{rel} matches no file"
    if not target.exists():
        shown = target.relative_to(ROOT) if target.is_relative_to(ROOT) else target
        return f"{shown} does not exist"
    if c.anchor or c.section:
        if target.is_dir() or target.suffix != ".md":
            return f"{c.anchor or c.section} cites a section of {target.name}, which is not a Markdown page"
        titles, anchors = headings(target)
        if c.anchor and c.anchor not in anchors:
            return f"{target.relative_to(ROOT)} has no anchor #{c.anchor}"
        if c.section:
            if c.section.startswith("§"):
                return f"{target.relative_to(ROOT)} has no numbered sections: cite a heading's anchor"
            wanted = _SLUG(_plain(c.section), "-")
            if wanted not in anchors and not any(_plain(t).lower() == c.section.lower() for t in titles):
                return f"{target.relative_to(ROOT)} has no section {c.section!r}"
    return None


# Paths that name no file of this repository, each with why.
EXEMPT = {
    ("tests/unit/test_envs_tasks.py", "tests/test_parity.py"):
        "a file of the swe task's own little repository, inside the episode's sandbox",
}
SELF = Path(__file__).resolve()  # its docstring and tests spell dangling references on purpose


def dangling(root: Path) -> list[str]:
    out = []
    for path in scanned_files(root):
        if path.resolve() == SELF:
            continue
        rel = path.relative_to(root).as_posix()
        for c in citations(root, path):
            if (rel, c.text) in EXEMPT:
                continue
            why = problem(c)
            if why:
                out.append(f"{c.where(root)}: cites {c.text!r}: {why}")
    return out


def test_no_file_cites_a_missing_file_or_anchor() -> None:
    found = dangling(ROOT)
    assert not found, (
        "dangling references (cite a file or heading that exists — the design is docs/design.md; "
        "a path that names no file of this repository on purpose goes into EXEMPT here, with why):\n  "
        + "\n  ".join(found)
    )


# -- the scanner itself finds what it must ------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "shared").mkdir()
    (tmp_path / "docs" / "design.md").write_text(
        "# Design\n\n## Stream contracts\n\n```\n# not a heading\n```\n\n## The `up` command\n\n## Twice\n\n## Twice\n")
    (tmp_path / "README.md").write_text("# nextstate\n\n## Try it\n\nSee [the design](docs/design.md#stream-contracts).\n")
    (tmp_path / "shared" / "real.py").write_text("")
    return tmp_path


def _scan(tree: Path, source: str, name: str = "shared/mod.py") -> list[str]:
    (tree / name).write_text(source)
    return [line for line in dangling(tree) if line.startswith(name)]


def test_the_scanner_accepts_what_exists(tree: Path) -> None:
    ok = ('"""See shared/real.py, docs/design.md#stream-contracts, docs/design.md#the-up-command,\n'
          'docs/design.md#twice_1, README.md#try-it, README: "Try it", shared/*.py, docs/."""\n')
    assert _scan(tree, ok) == []


@pytest.mark.parametrize(("source", "reason"), [
    ('"""The bus (DESIGN.md, "Streams and keys")."""', "DESIGN.md does not exist"),
    ("# as CONVENTIONS.md allows", "CONVENTIONS.md does not exist"),
    ("# see shared/missing.py", "shared/missing.py does not exist"),
    ("# docs/design.md#hot-paths", "docs/design.md has no anchor #hot-paths"),
    ("# docs/design.md#not-a-heading", "docs/design.md has no anchor #not-a-heading"),
    ('# See README: "The collector".', "README.md has no section 'The collector'"),
    ("# (README, Methods)", "README.md has no section 'Methods'"),
    ("# README.md#install", "README.md has no anchor #install"),
    ("# docs/design.md §3", "has no numbered sections"),
    ("# services/*/worker.py", "matches no file"),
])
def test_the_scanner_finds_a_dangling_reference(tree: Path, source: str, reason: str) -> None:
    found = _scan(tree, source + "\n")
    assert len(found) == 1 and reason in found[0], found
    assert found[0].startswith("shared/mod.py:1: cites "), found


def test_markdown_links_resolve_relative_to_their_page(tree: Path) -> None:
    found = _scan(tree, "[a](design.md#stream-contracts) [b](design.md#nope) [c](gone.md)\n", "docs/page.md")
    assert [f.split(": ", 2)[-1] for f in found] == [
        "docs/design.md has no anchor #nope", "docs/gone.md does not exist"], found
