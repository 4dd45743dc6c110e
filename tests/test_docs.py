"""The documentation stays true to the tree: links and anchors resolve, code cites pages that exist, and
docs/architecture.md lists every tracked source file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITED = re.compile(r"\b(docs/[\w.-]+\.md)(#[\w-]+)?")


def anchors(page: Path) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def check(target: str, page: Path) -> str | None:
    """None when `target` (a link or citation, relative to `page`'s folder) resolves, else why not."""
    if target.startswith(("http://", "https://", "mailto:")):
        return None
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.exists():
        return f"{target}: no such file"
    if anchor and anchor not in anchors(resolved):
        return f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}"
    return None


def test_every_link_resolves():
    broken = [
        f"{page.name}: {why}"
        for page in PAGES
        for target in LINK.findall(page.read_text())
        if (why := check(target, page))
    ]
    assert not broken, broken


def test_every_page_the_code_cites_exists():
    files = [p for part in ("headstart", "heads", "runtime", "train", "tests") for p in (ROOT / part).rglob("*.py")]
    broken = [
        f"{f.relative_to(ROOT)}: {why}"
        for f in files
        for doc, anchor in CITED.findall(f.read_text())
        if (why := check(doc + anchor, ROOT / "README.md"))
    ]
    assert not broken, broken


def test_readme_is_for_users():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) < 12_000, "measurements and diaries belong in docs/"
    assert "make test" in text and "make demo" in text


def test_architecture_lists_every_source_file():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:  # not a git checkout (an unpacked sdist): nothing to compare with
        return
    files = (ROOT / "docs" / "architecture.md").read_text().split("## Files", 1)[1]
    listed = set(re.findall(r"^([\w./-]+)\s{2,}", files, re.M))
    folders = {f for f in listed if f.endswith("/")}  # a fixture folder, listed once for every file in it
    wanted = {f for f in tracked if not f.endswith((".safetensors", ".png")) and f not in ("README.md", ".gitignore")}
    wanted = {f for f in wanted if not f.startswith(tuple(folders))}
    assert not sorted(wanted - listed), f"add to docs/architecture.md: {sorted(wanted - listed)}"
    stale = {f for f in listed - folders if f not in tracked} | {
        d for d in folders if not any(f.startswith(d) for f in tracked)
    }
    assert not sorted(stale), f"listed but not tracked: {sorted(stale)}"
