"""The README and docs/ tell the truth: every fenced python block runs, every link resolves,
the env-var table lists exactly the variables the code reads, and every ``pip install`` line
is one CI's own command proves.

A block runs as a script with ``python``, or on N ranks when the line before it is
``<!-- run: axolotl-dist -n N -->``: the README's first such block under the launcher itself
(the launcher's path, checked once here; its own tests check the rest), the others as
``__main__`` in the harness's forked ranks, which get the env the launcher gives (what a block
shows does not depend on how its ranks started); a block that needs an extra (accelerate, the
Hugging Face libraries, which read their env once imported) is launched too. A block that is
deliberately an excerpt says so with ``<!-- fragment: why -->`` (it must still compile)."""

from __future__ import annotations

import os
import re
import runpy
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import pytest

from axolotl_dist.env import KIT_ENV_VARS as KIT_VARS
from axolotl_dist.testing import run_distributed
from fixtures import ROOT, run, subprocess_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/design/ too
README_LIMIT = 250


class Block(NamedTuple):
    page: str
    line: int
    marker: Optional[str]  # "python", "axolotl-dist -n N", "fragment: why" or None
    code: str


def _blocks() -> List[Block]:
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start = i
                j = i + 1
                while lines[j].strip() != "```":
                    j += 1
                before = next((lines[k].strip() for k in range(start - 1, -1, -1)
                               if lines[k].strip()), "")
                m = re.fullmatch(r"<!-- (run: .+|fragment: .+) -->", before)
                marker = m.group(1) if m else None
                if marker and marker.startswith("run: "):
                    marker = marker[len("run: "):]
                found.append(Block(page.relative_to(ROOT).as_posix(), start + 1, marker,
                                   "\n".join(lines[start + 1:j]) + "\n"))
                i = j
            i += 1
    return found


BLOCKS = _blocks()
#: The block run under the launcher itself: the README's first that names it.
LAUNCHED = next(b for b in BLOCKS if b.page == "README.md" and b.marker
                and b.marker.startswith("axolotl-dist"))


#: What a forked block's ranks get beyond the launcher's env (the thread count a launched
#: block gets from ``subprocess_env``).
_RANK_ENV = {"OMP_NUM_THREADS": "1"}


def _run_as_main(script: str) -> None:
    """One rank of a block: the script as ``__main__``, in its directory, as a launch runs it."""
    os.chdir(os.path.dirname(script))
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def test_the_blocks_are_found_and_each_is_run_or_marked_as_a_fragment():
    assert len(BLOCKS) >= 15, [(b.page, b.line) for b in BLOCKS]
    for block in BLOCKS:
        assert block.marker is None or block.marker == "python" or \
            re.fullmatch(r"axolotl-dist -n [1-9]", block.marker) or \
            re.fullmatch(r"fragment: \S.{10,}", block.marker), block


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.line}" for b in BLOCKS])
def test_every_python_block_runs(block, tmp_path):
    if block.marker and block.marker.startswith("fragment: "):
        compile(block.code, f"{block.page}:{block.line}", "exec")  # an excerpt still parses
        return
    extras = _extras_needed(block.code)
    for module in extras:  # a core install (scripts/compat.sh) has none
        pytest.importorskip(module, reason=f"{block.page}:{block.line} needs {module} (an extra)")
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    launched = block.marker and block.marker.startswith("axolotl-dist")
    if launched and block != LAUNCHED and not extras:
        run_distributed(_run_as_main, int(block.marker.split()[-1]), args=(str(script),),
                        env=_RANK_ENV, init=False, timeout=150)
        return
    if launched:
        ranks = block.marker.split()[-1]
        cmd = [sys.executable, "-m", "axolotl_dist.launch", "-n", ranks, str(script)]
    else:
        cmd = [sys.executable, str(script)]
    code, out, err = run(cmd, subprocess_env(tmp_path), 180, cwd=tmp_path)
    assert code == 0, f"{block.page}:{block.line} exited {code}\n{out}\n{err[-4000:]}"
    assert "Traceback" not in err, f"{block.page}:{block.line}\n{err[-4000:]}"


#: What a block needs beyond the core, by the kit call that needs it.
_EXTRA_CALLS = {"shared_map(": "datasets", "ad.tqdm(": "tqdm", "merge_trace(": "matplotlib"}
_OPTIONAL = ("datasets", "transformers", "tokenizers", "tqdm", "accelerate", "matplotlib", "numpy")


def _extras_needed(code: str) -> list:
    imported = re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.M)
    return sorted({m for m in imported if m in _OPTIONAL}
                  | {module for call, module in _EXTRA_CALLS.items() if call in code})


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_LIMIT


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_every_link_resolves():
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: link to {target} (no such file)"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
                assert anchor in {_slug(h) for h in headings}, \
                    f"{page.name}: link to {target} (no such heading in {dest.name})"


def _code_variables() -> set:
    names = set()
    for path in (ROOT / "axolotl_dist").rglob("*.py"):
        names.update(re.findall(r"\bAXOLOTL_DIST_[A-Z_]*[A-Z]\b", path.read_text()))
    return names


def test_the_env_table_lists_exactly_the_variables_the_code_reads():
    table = (ROOT / "docs" / "env.md").read_text().split("## The launcher contract")[0]
    documented = set(re.findall(r"^\| `(AXOLOTL_DIST_[A-Z_]+)` \|", table, re.M))
    assert documented == set(KIT_VARS)
    assert _code_variables() == set(KIT_VARS)  # no reader outside the table


def test_every_pip_install_line_is_one_ci_runs():
    ci = re.search(r"<!-- test-command -->\n```bash\n(.+)\n```",
                   (ROOT / "README.md").read_text()).group(1)
    ci_extras = set(re.search(r'-e "\.\[([^\]]+)\]"', ci).group(1).split(","))
    ci_torch = re.search(r'"torch==([\d.]+)"', ci).group(1)
    extras_cfg = (ROOT / "setup.cfg").read_text().split("[options.extras_require]")[1]
    declared = set(re.findall(r"^(\w+) =$", extras_cfg.split("[options.entry_points]")[0], re.M))
    sources = PAGES + sorted((ROOT / "examples").glob("*.py"))
    for page in sources:
        for line in re.findall(r"pip install [^`\n]+", page.read_text()):
            assert "axolotl-dist[" not in line, f"{page.name}: {line} (not published: -e .[...])"
            for extras in re.findall(r'-e "?\.\[([^\]]+)\]', line):
                for extra in extras.split(","):
                    assert extra in declared, f"{page.name}: {line} (no extra {extra!r})"
                    needs = _extra_requirements(extras_cfg, extra)
                    covered = set().union(*(_extra_requirements(extras_cfg, e) for e in ci_extras))
                    assert needs <= covered, f"{page.name}: {line} needs {needs - covered}"
            pinned = re.search(r'"torch==([\d.]+)"', line)
            assert pinned is None or pinned.group(1) == ci_torch, f"{page.name}: {line}"


def _extra_requirements(extras_cfg: str, extra: str) -> set:
    body = re.search(rf"^{extra} =\n((?:    .+\n)+)", extras_cfg, re.M)
    assert body is not None, extra
    return {re.split(r"[<>=;\[ ]", line.strip())[0] for line in body.group(1).splitlines()}


#: docs/design/ is the current design, not its history (issue #57): an index (README.md) and
#: one page per topic, each of at most DESIGN_LIMIT lines of at most DESIGN_WIDTH characters
#: (issue #80); the changelog is one line per user-visible change, grouped as Keep a Changelog
#: does, each bullet at most CHANGELOG_BULLET characters.
DESIGN_LIMIT, DESIGN_WIDTH, CHANGELOG_LIMIT, CHANGELOG_BULLET = 300, 100, 300, 200


def test_the_design_doc_and_the_changelog_stay_short():
    pages = sorted((ROOT / "docs" / "design").glob("*.md"))
    assert ROOT / "docs" / "design" / "README.md" in pages and len(pages) > 1, pages
    for page in pages:
        design = page.read_text().splitlines()
        assert len(design) <= DESIGN_LIMIT, (page.name, len(design))
        wide = [f"{page.name}:{n}: {len(line)} characters"
                for n, line in enumerate(design, 1) if len(line) > DESIGN_WIDTH]
        assert wide == [], wide
    changelog = (ROOT / "CHANGELOG.md").read_text().splitlines()
    assert len(changelog) <= CHANGELOG_LIMIT, len(changelog)
    long = [f"CHANGELOG.md:{n}: {len(line)} characters: {line[:60]}..."
            for n, line in enumerate(changelog, 1)
            if line.startswith("- ") and len(line) > CHANGELOG_BULLET]
    assert long == [], long


def test_each_changelog_release_has_each_subsection_once():
    releases: dict = {}
    current = None
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        if line.startswith("## "):
            current = line
            releases[current] = []
        elif line.startswith("### ") and current is not None:
            releases[current].append(line[4:].strip())
    assert "## [Unreleased]" in releases, list(releases)
    for release, sections in releases.items():
        assert len(sections) == len(set(sections)), (release, sections)
        assert set(sections) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed",
                                 "Security"}, (release, sections)
