"""The documentation site as a reader gets it: ``mkdocs build --strict`` into a temporary directory, then the
generated HTML is read back.

- every ``<placeholder>`` of a page's Markdown (``results/<run-id>.h5``, ``--label``'s ``<time>-<label>-<random>``)
  is text on the built page, not an unknown HTML tag the browser drops; the README, rendered by the same
  Markdown library, too;
- every table sits in the scrolling container of ``docs/hooks.py``, and the site's stylesheet lets that container
  scroll (the theme hides whatever is wider than the page);
- every code block has a language, command blocks (``bash``) wrap and all blocks scroll, so the home page's two
  commands are whole on screen.

``.ci/run`` builds the site too (links, anchors, navigation); this test checks what the build made of the pages.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

DOCS = REPO / "docs"
IN_CI = os.environ.get("CI", "").lower() == "true"

#: HTML the pages may write on purpose (none do today): these are not placeholders
HTML_IN_PAGES = {"a", "br", "img", "details", "summary", "sup", "sub", "kbd", "span", "div", "p", "em", "strong"}
#: ``<word ...>`` as a Markdown renderer reads it: a tag (or an autolink with ``:``); ``<=``, ``a < b`` are text
_PLACEHOLDER = re.compile(r"<([A-Za-z][^<>\n]*)>")


def _hook_table_class() -> str:
    """The container class ``docs/hooks.py`` wraps tables in (read from the hook, not repeated here)."""
    m = re.search(r'^TABLE_CLASS = "([\w-]+)"$', (DOCS / "hooks.py").read_text(), re.M)
    assert m, "docs/hooks.py names no TABLE_CLASS"
    return m.group(1)


TABLE_CLASS = _hook_table_class()


def _mkdocs():
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        if IN_CI:
            pytest.fail("CI=true but mkdocs is not installed (it is in the test extra)")
        pytest.skip("mkdocs is not installed: .venv/bin/pip install -e '.[test]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    _mkdocs()
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def pages():
    """Every Markdown page of the site (paths relative to docs/)."""
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def built(site: Path, page: str) -> str:
    """The HTML MkDocs made of ``page`` (directory URLs: ``guide/runs.md`` -> ``guide/runs/index.html``)."""
    stem = page[:-3]
    path = site / ("index.html" if stem == "index" else
                   f"{stem[:-len('index')]}index.html" if stem.endswith("/index") else f"{stem}/index.html")
    return path.read_text()


def main_content(page_html: str) -> str:
    """The page's own content (the theme's ``role="main"`` block), without navigation and footer."""
    start = page_html.index('role="main"')
    end = page_html.index("<footer", start)
    return page_html[start:end]


def placeholders(markdown: str) -> list:
    """The ``<...>`` of a Markdown source that are placeholders: entities resolved first (a page that writes
    ``&lt;host&gt;`` means ``<host>``), comments, autolinks and the page's own HTML left out."""
    text = html.unescape(markdown)
    found = []
    for m in _PLACEHOLDER.finditer(text):
        inner = m.group(1)
        name = inner.split()[0].lower() if inner.split() else ""
        if "://" in inner or inner.startswith("mailto:") or name in HTML_IN_PAGES:
            continue
        found.append(inner)
    return found


def lost(markdown: str, rendered: str) -> list:
    """The placeholders of ``markdown`` that ``rendered`` does not show as text."""
    return sorted({p for p in placeholders(markdown) if f"&lt;{html.escape(p, quote=False)}&gt;" not in rendered
                   and f"&lt;{html.escape(p)}&gt;" not in rendered})


def test_a_raw_placeholder_is_caught():
    """The check itself: Python-Markdown drops ``<run-id>`` outside code (the reference's old help text) and keeps
    the escaped form and the one in a code span."""
    markdown = pytest.importorskip("markdown")
    raw = "write results/<run-id>.h5 and a summary, `results/<host>.yaml`"
    assert lost(raw, markdown.markdown(raw)) == ["run-id"]
    assert lost(raw.replace("<run-id>", "&lt;run-id&gt;"),
                markdown.markdown(raw.replace("<run-id>", "&lt;run-id&gt;"))) == []
    assert placeholders("<!-- example: x -->, <https://x.org/>, a<b, x <= 3, <br>") == []


def test_no_page_loses_a_placeholder(site):
    problems, shown = {}, 0
    for page in pages():
        source = (DOCS / page).read_text()
        missing = lost(source, main_content(built(site, page)))
        shown += len(placeholders(source))
        if missing:
            problems[page] = missing
    assert problems == {}, ("placeholders rendered as HTML tags (write them as &lt;name&gt; or in backticks): "
                            f"{problems}")
    # the generated reference has them (results/<run-id>.h5, <results-dir>/index.jsonl, ...): the check has work
    assert len(placeholders((DOCS / "reference" / "cli.md").read_text())) >= 8 and shown > 20


def test_the_readme_loses_no_placeholder():
    markdown = pytest.importorskip("markdown")
    source = (REPO / "README.md").read_text()
    assert lost(source, markdown.markdown(source, extensions=["tables", "fenced_code"])) == []


def _css_rules(css: str) -> list:
    """``(selectors, declarations)`` of a stylesheet (no nesting, comments dropped)."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    rules = []
    for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css):
        decls = dict((k.strip(), v.strip()) for k, v in (d.split(":", 1) for d in body.split(";") if ":" in d))
        rules.append(([s.strip() for s in selectors.split(",")], decls))
    return rules


def _sets(rules, selector_part: str, prop: str, values) -> bool:
    return any(any(s.endswith(selector_part) for s in sels) and decls.get(prop) in values for sels, decls in rules)


def test_every_page_links_the_stylesheet_that_scrolls_and_wraps(site):
    rules = _css_rules((site / "css" / "extra.css").read_text())
    for page in pages():
        depth = page.count("/") + (0 if page == "index.md" else 1)
        assert f'href="{"../" * depth}css/extra.css"' in built(site, page), page
    assert _sets(rules, f".{TABLE_CLASS}", "overflow-x", ("auto", "scroll")), "the table container does not scroll"
    assert _sets(rules, "pre code", "overflow-x", ("auto", "scroll")), "code blocks do not scroll"
    assert _sets(rules, "code.language-bash", "white-space", ("pre-wrap", "break-spaces")), "commands do not wrap"


def test_every_table_is_in_the_scrolling_container(site):
    tables = 0
    for page in pages():
        content = main_content(built(site, page))
        n = content.count("<table")
        wrapped = len(re.findall(rf'<div class="{TABLE_CLASS}">\s*<table\b', content))
        assert wrapped == n, f"{page}: {n - wrapped} of {n} table(s) outside <div class=\"{TABLE_CLASS}\">"
        tables += n
    assert tables > 50


def test_every_code_block_has_a_language_and_the_home_page_commands_are_whole(site):
    """A block without a language gets none of the rules (and none of the documented-command test's reading)."""
    bare = {page: n for page in pages() if (n := main_content(built(site, page)).count("<pre><code>"))}
    assert bare == {}, f"code blocks without a language (fence them as bash, console or text): {bare}"
    home = main_content(built(site, "index.md"))
    blocks = re.findall(r'<pre><code class="language-bash">(.*?)</code></pre>', home, re.S)
    source = (DOCS / "index.md").read_text()
    section = source.split("## Two commands on a fresh machine", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^```bash\n(.*)\n```$", section, re.M)
    assert len(commands) == 2 and [html.unescape(b).strip() for b in blocks[:2]] == commands
