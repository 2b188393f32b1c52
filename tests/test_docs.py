"""The documentation stays navigable: README.md short, every relative link and #anchor in
README.md, docs/*.md and benchmarks/results/README.md resolves, every `make TARGET` the docs
mention exists in the Makefile, every repository path they name exists, and every README/docs
reference in an hvd_topk error message points to an existing file and heading.

Plain Python (no torch, no MPI); a second or less."""

import ast
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 300


def doc_pages():
    """The user-facing pages: README.md and docs/*.md."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def linked_pages():
    """Pages whose links are checked: the user-facing ones and the results index."""
    index = ROOT / "benchmarks" / "results" / "README.md"
    return doc_pages() + ([index] if index.exists() else [])


# ---- markdown parsing ------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than - and _
    removed, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    """Every anchor GitHub makes for the headings of a markdown file (duplicates get -1, -2)."""
    seen, out = {}, set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_errors(page):
    """Broken relative links and anchors of one markdown page, as readable strings."""
    errors = []
    text = page.read_text(encoding="utf-8")
    for number, line in prose_lines(text):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                errors.append(f"{where}: no such file")
                continue
            if anchor:
                if dest.suffix != ".md":
                    errors.append(f"{where}: anchor on a file that is not markdown")
                elif anchor not in anchors(dest):
                    errors.append(f"{where}: no heading with anchor #{anchor} in "
                                  f"{dest.relative_to(ROOT)}")
    return errors


# ---- README length ---------------------------------------------------------------------------

def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): "
                                       "move detail into docs/")


# ---- links and anchors -----------------------------------------------------------------------

@pytest.mark.parametrize("page", linked_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    errors = link_errors(page)
    assert not errors, "broken links:\n" + "\n".join(errors)


def test_link_checker_catches_a_broken_link_and_anchor(tmp_path, monkeypatch):
    """The checker itself: a missing file and a missing heading are both reported."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# A heading, with `code` (and punctuation)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-code-and-punctuation)\n"
                    "[self](#title)\n# Title\n"
                    "[gone](missing.md)\n[bad anchor](other.md#nope)\n"
                    "```\n[inside a fence](ignored.md)\n```\n")
    errors = link_errors(page)
    assert len(errors) == 2, errors
    assert "missing.md: no such file" in errors[0]
    assert "#nope" in errors[1]


def test_slug_follows_github_rules():
    assert slug("`hvd_topk.DistributedOptimizer` (error feedback)") == \
        "hvd_topkdistributedoptimizer-error-feedback"
    assert slug("Overhead, 2026-11-23: before and after 8c3d761") == \
        "overhead-2026-11-23-before-and-after-8c3d761"
    assert slug("A transformer with AdamW (`examples/pytorch_gpt.py`)") == \
        "a-transformer-with-adamw-examplespytorch_gptpy"


# ---- make targets ----------------------------------------------------------------------------

def makefile_targets():
    """(explicit targets, pattern-rule prefixes such as 'bench-')."""
    names, patterns = set(), set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.%\- ]+):(?!=)", line)
        if not m or line.startswith((".", "\t")):
            continue
        for name in m.group(1).split():
            (patterns if "%" in name else names).add(name)
    return names, patterns


MAKE_MENTION = re.compile(r"(?:`|^\s*|\$ )make ((?:[\w.-]+)(?: [\w.-]+)*)")


def make_mentions():
    """(page, line number, target) for every `make TARGET` in README.md and docs/*.md, in
    inline code or at the start of a code line."""
    for page in doc_pages():
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in re.finditer(r"`make ([^`]+)`", line):
                for target in m.group(1).split():
                    if not target.startswith("-") and "=" not in target:
                        yield page, number, target
            m = re.match(r"^\s*make ([\w-][\w.-]*)", line)
            if m:
                yield page, number, m.group(1)


def test_make_targets_exist():
    names, patterns = makefile_targets()
    errors = []
    for page, number, target in make_mentions():
        if target in names:
            continue
        pattern = next((p for p in patterns if target.startswith(p.split("%")[0])), None)
        if pattern is not None:
            stem = target[len(pattern.split("%")[0]):]
            # bench-% runs benchmarks/STEM.py; NAME is the docs' placeholder
            if stem == "NAME" or (ROOT / "benchmarks" / f"{stem}.py").exists():
                continue
        errors.append(f"{page.relative_to(ROOT)}:{number}: make {target}")
    assert not errors, "targets not in the Makefile:\n" + "\n".join(errors)


def test_make_targets_checker_sees_the_targets():
    names, patterns = makefile_targets()
    assert {"demo", "test"} <= names and "bench-%" in patterns
    mentioned = {t for _, _, t in make_mentions()}
    assert {"demo", "test"} <= mentioned


# ---- repository paths ------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w/.~-])((?:examples|benchmarks|tests|docker|hvd_topk|docs|tools|\.ci)/"
                  r"[\w./*-]*[\w*/])")


def path_mentions():
    for page in doc_pages():
        text = page.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            for m in PATH.finditer(line):
                path = m.group(1)
                rest = line[m.end():m.end() + 1]
                if "NAME" in path or rest in ("{", "<"):  # placeholders and brace patterns
                    continue
                yield page, number, path


def test_named_paths_exist():
    errors = []
    for page, number, path in path_mentions():
        if "*" in path:
            ok = bool(glob.glob(str(ROOT / path)))
        else:
            ok = (ROOT / path).exists()
        if not ok:
            errors.append(f"{page.relative_to(ROOT)}:{number}: {path}")
    assert not errors, "paths that do not exist:\n" + "\n".join(errors)


def test_path_checker_sees_the_examples():
    named = {p for _, _, p in path_mentions()}
    assert any(p.startswith("examples/") for p in named)
    assert any(p.startswith("benchmarks/") for p in named)


# ---- distributed checks the pages name ---------------------------------------------------------

CHECK_CITATION = re.compile(r"`(check_\w+): ([^`]+)`")
CHECK_NAME = re.compile(r"""^\s*\(\s*(["'])(.+?)\1\s*,""", re.M)
STRING = re.compile(r"""(["'])((?:(?!\1).)+)\1""")


def check_names(script):
    """The names of ``tests/dist/<script>.py``'s checks (its CHECKS entries), and every string
    literal in it (names built in a loop: ``optimizer("groups=2", ...)``)."""
    text = (ROOT / "tests" / "dist" / f"{script}.py").read_text()
    return {m.group(2) for m in CHECK_NAME.finditer(text)}, {m.group(2) for m in STRING.finditer(text)}


def check_citations(pages):
    """``(page, script, name)`` for every `check_x: name` a page cites, whitespace collapsed;
    those abbreviated with "..." are left out."""
    for page in pages:
        for m in CHECK_CITATION.finditer(page.read_text()):
            name = " ".join(m.group(2).split())
            if "..." not in name and "\u2026" not in name:
                yield page, m.group(1), name


def cited_check_exists(script, name):
    """A cited check exists: a check of that name, or one it begins (a family of checks), or
    a name built from a literal its last part matches."""
    if not (ROOT / "tests" / "dist" / f"{script}.py").exists():
        return False
    names, literals = check_names(script)
    return any(n.startswith(name) for n in names) or name.rsplit(": ", 1)[-1] in literals


def test_cited_checks_exist():
    missing = [f"{page.relative_to(ROOT)}: `{script}: {name}`" for page, script, name in check_citations(doc_pages())
               if not cited_check_exists(script, name)]
    assert not missing, "the pages cite checks that do not exist:\n" + "\n".join(missing)


def test_check_citation_checker_sees_citations_and_a_missing_one():
    cited = list(check_citations(doc_pages()))
    assert len(cited) > 50
    assert cited_check_exists("check_ddp", "DDP rebuilds later buckets, keeps the first")
    assert not cited_check_exists("check_ddp", "residual decay under auto: never sent whole")
    assert not cited_check_exists("check_nothing", "bad input")


# ---- documentation references in hvd_topk's messages -------------------------------------------

DOC_REF = re.compile(r"((?:README|docs/[\w-]+)\.md)(#[\w-]+)?")


def message_strings():
    """(file, line, text) for every string constant in hvd_topk/ that is not a docstring."""
    for source in sorted((ROOT / "hvd_topk").rglob("*.py")):
        tree = ast.parse(source.read_text(encoding="utf-8"))
        docstrings = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    docstrings.add(id(body[0].value))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings):
                yield source, node.lineno, node.value


def message_ref_errors(strings):
    errors = []
    for source, line, text in strings:
        where = f"{source.relative_to(ROOT) if source.is_relative_to(ROOT) else source}:{line}"
        for m in DOC_REF.finditer(text):
            target = ROOT / m.group(1)
            if not target.exists():
                errors.append(f"{where}: {m.group(0)}: no such file")
            elif m.group(2) and m.group(2)[1:] not in anchors(target):
                errors.append(f"{where}: {m.group(0)}: no such heading")
        bare = DOC_REF.sub("", text)
        if re.search(r"README|\bdocs\b/?", bare):
            errors.append(f"{where}: names the documentation without a file (and anchor): "
                          f"{text[:80]!r}")
    return errors


def test_error_messages_point_to_existing_docs():
    errors = message_ref_errors(message_strings())
    assert not errors, "\n".join(errors)


def test_message_checker_catches_a_missing_section():
    fake = ROOT / "hvd_topk" / "fake.py"
    errors = message_ref_errors([
        (fake, 1, "see docs/install.md#no-such-heading"),
        (fake, 2, "see README 'Installing'"),
        (fake, 3, "see docs/nowhere.md"),
        (fake, 4, "see README.md#limits"),
    ])
    assert len(errors) == 3, errors

