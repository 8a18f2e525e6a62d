"""The docs site builds with `mkdocs build --strict`, and what it builds reads without network:
every formula is MathML (no LaTeX, no `$$` left over, no math script from a CDN), headings
hold no math, and the derivation pages cite the design notes the site has.

Needs the `docs` extra (`pip install -e '.[docs]'`); skipped without it.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPS = sorted(p.stem for p in (ROOT / "docs" / "ops").glob("*.md"))

pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytest.importorskip("latex2mathml")


def _hook():
    spec = importlib.util.spec_from_file_location("mathml_hook", ROOT / "docs/hooks/mathml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert not warnings, "\n".join(warnings)
    return out


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def _main(page: str) -> str:
    """The article of a built page (the theme's navigation and scripts left out)."""
    match = re.search(r'<article class="md-content__inner[^"]*">(.*?)</article>', page, re.DOTALL)
    assert match, "no article in the page"
    return match.group(1)


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


RAW_LATEX = re.compile(r"\$\$|\\\(|\\\)|\\\[|\\\]|\\frac|\\mathrm|\\sum|\\left|\\bar|\\text")


@pytest.mark.parametrize("op", OPS)
def test_op_page_math_is_mathml(site: Path, op: str) -> None:
    article = _main(_page(site, f"ops/{op}"))
    assert 'class="arithmatex"' not in article
    leftover = RAW_LATEX.findall(article)
    assert not leftover, f"ops/{op}: raw LaTeX left in the built page: {leftover[:5]}"
    assert article.count('<math xmlns="http://www.w3.org/1998/Math/MathML"') >= 10
    assert '<math xmlns="http://www.w3.org/1998/Math/MathML" display="block">' in article
    # names are whole identifiers, not products of letters
    assert "<mi>rstd</mi>" in article or "<mi>x</mi>" in article
    assert not re.search(r'(<mi mathvariant="normal">[a-z]</mi>){2}', article)


def test_multi_letter_names_are_one_identifier(site: Path) -> None:
    article = _main(_page(site, "ops/layernorm"))
    for name in ("rstd", "mean", "weight", "x&#x0005F;hat",
                 "sum&#x0005F;dy&#x0005F;weight&#x0005F;weight&#x0005F;offset"):
        assert f"<mi>{name}</mi>" in article, name


def test_no_page_loads_a_script_or_font_from_the_network(site: Path) -> None:
    for path in site.rglob("*.html"):
        page = path.read_text()
        for tag in re.findall(r"<(?:script|link)\b[^>]*>", page):
            remote = re.search(r'(?:src|href)="(?:https?:)?//', tag)
            assert not remote or 'rel="canonical"' in tag, f"{path.relative_to(site)}: {tag}"
        assert "mathjax" not in page.lower() and "katex" not in page.lower(), path


def test_headings_hold_no_math(site: Path) -> None:
    for path in site.rglob("index.html"):
        page = path.read_text()
        titles = re.findall(r"<h[1-6][^>]*>(.*?)</h[1-6]>", page, re.DOTALL)
        titles += re.findall(r'<span class="md-ellipsis">(.*?)</span>', page, re.DOTALL)
        for title in titles:
            text = _text(title)
            assert "$" not in text and "\\" not in text and "<math" not in title, \
                f"{path.relative_to(site)}: heading {text.strip()!r}"


def test_op_pages_cite_the_design_page(site: Path) -> None:
    design = _page(site, "design")
    for anchor in ("reverse-mode-rules", "reduction-algebra", "the-irs-canonical-form"):
        assert f'id="{anchor}"' in design, anchor
    for op in OPS:
        source = (ROOT / "docs" / "ops" / f"{op}.md").read_text()
        assert "DESIGN.md" not in source
        assert "(../design.md#reverse-mode-rules)" in source, op


def _nav_pages(entries: object) -> list[str]:
    """Every page path of mkdocs.yml's nav, at any depth ("title: page", a bare page, a
    section's list)."""
    if isinstance(entries, str):
        return [entries]
    if isinstance(entries, list):
        return [page for entry in entries for page in _nav_pages(entry)]
    if isinstance(entries, dict):
        return [page for value in entries.values() for page in _nav_pages(value)]
    return []


def test_every_page_is_in_the_nav() -> None:
    """A page under docs/ is reachable from the site's navigation: the derivation and layer
    pages `derive` writes included. Pages are the Markdown files; docs/hooks/ is excluded from
    the site (`exclude_docs`), and images, stylesheets and the tutorial's spec files are not
    pages."""
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = ROOT / config.get("docs_dir", "docs")
    excluded = [line.strip().strip("/") for line in config.get("exclude_docs", "").splitlines()
                if line.strip()]
    pages = sorted(path.relative_to(docs).as_posix() for path in docs.rglob("*.md")
                   if not any(path.relative_to(docs).as_posix().startswith(f"{folder}/")
                              for folder in excluded))
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), f"pages listed twice in nav: {nav}"
    missing = [page for page in pages if page not in nav]
    assert not missing, f"pages under docs/ that mkdocs.yml's nav leaves out: {missing}"
    absent = [page for page in nav if not (docs / page).is_file()]
    assert not absent, f"nav entries with no page under docs/: {absent}"
    assert "ops/dropout_add_rmsnorm.md" in nav


def test_hand_written_pages_are_for_users() -> None:
    pages = [*(ROOT / "docs").rglob("*.md"), ROOT / "benchmarks" / "README.md"]
    for path in pages:
        text = path.read_text()
        assert not re.search(r"\bsess" r"ions?\b", text, re.IGNORECASE), path
        assert ".whl/" not in text, path
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(benchmarks.splitlines()) <= 400


def test_hook_rejects_what_it_cannot_draw() -> None:
    hook = _hook()
    assert "<mi>rstd</mi>" in hook.to_mathml(r"\mathrm{rstd}", "inline")
    with pytest.raises(hook.MathError):
        hook.to_mathml(r"\left( x", "inline")
    with pytest.raises(hook.MathError):
        hook.to_mathml(r"\unknowncommand{x}", "block")
    page = ('<p><span class="arithmatex">\\(a &lt; b\\)</span></p>'
            '<div class="arithmatex">\\[ \\frac{1}{N} \\]</div>')
    out = hook.render(page)
    assert "arithmatex" not in out and "\\" not in out
    assert "<mo>&lt;</mo>" in out or "&#x0003C;" in out
    assert '<div class="math-display"><math' in out
