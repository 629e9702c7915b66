"""The docs stay true to the code: docs/flags.md is what `python -m sobrio.flags_doc` writes from the config
fields today, and every relative link in README.md and docs/*.md points to a file that exists (and, with a
`#fragment` into a Markdown page, to one of its headings)."""

import re
from pathlib import Path

from sobrio import flags_doc

ROOT = Path(__file__).resolve().parents[2]
# [text](target) and [text](target "title"), not images' remote URLs or in-page anchors
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_flags_page_is_generated_from_the_config_fields():
    page = ROOT / "docs" / "flags.md"
    assert page.read_text(encoding="utf-8") == flags_doc.render(), (
        f"docs/flags.md is stale: run `{flags_doc.COMMAND}` and commit it")


def test_the_flags_page_lists_every_serve_flag_with_its_default():
    text = flags_doc.render()
    for action in flags_doc.serve_parser()._actions[1:]:
        name = action.option_strings[0] if action.option_strings else action.metavar
        assert name.removeprefix("--") in text, name
    assert "| `--port` | `8000` | port to listen on" in text
    assert "| `--[no-]engine-process` | on |" in text


def without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links and no headings


def relative_links(page: Path) -> list[str]:
    """Links to files, with any #fragment; links to other sites and within the page itself left out."""
    targets = LINK.findall(without_code(page.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def anchors(page: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+ (.+)$", without_code(page.read_text(encoding="utf-8")), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def is_broken(page: Path, target: str) -> bool:
    path, _, fragment = target.partition("#")
    file = page.parent / path
    if not file.exists():
        return True
    return bool(fragment) and file.suffix == ".md" and fragment not in anchors(file)


def test_every_relative_link_in_the_readme_and_docs_points_to_a_file():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in pages for target in relative_links(page)
              if is_broken(page, target)]
    assert not broken, broken
    assert len(relative_links(ROOT / "README.md")) >= 8  # the front page links to its feature pages


def test_the_readme_keeps_the_test_command_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make test" in readme and "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 12 * 1024, "the README is a front page: move reference text to docs/"
