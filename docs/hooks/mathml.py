"""MkDocs hook: every formula becomes MathML when the site is built.

`pymdownx.arithmatex` (generic mode) wraps `$...$` in `<span class="arithmatex">\\(...\\)</span>`
and `$$...$$` in `<div class="arithmatex">\\[...\\]</div>`. This hook replaces each of them with
the MathML that latex2mathml makes of the LaTeX, so browsers draw the math themselves: no
script, no network. A formula latex2mathml cannot convert, or one with a command it does not
know, fails the build with the page and the formula.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

_INLINE = re.compile(r'<span class="arithmatex">\\\((.*?)\\\)</span>', re.DOTALL)
_BLOCK = re.compile(r'<div class="arithmatex">\\\[(.*?)\\\]</div>', re.DOTALL)
# latex2mathml writes \mathrm{rstd} as one upright <mi> per letter; a name is one identifier
_UPRIGHT_LETTERS = re.compile(r'<mrow>((?:<mi mathvariant="normal">[^<]*</mi>){2,})</mrow>')
_UPRIGHT_LETTER = re.compile(r'<mi mathvariant="normal">([^<]*)</mi>')


class MathError(ValueError):
    """A formula that latex2mathml could not convert."""


def to_mathml(latex: str, display: str, where: str = "") -> str:
    """MathML for one formula (`latex` as arithmatex left it: HTML-escaped)."""
    source = html.unescape(latex).strip()
    try:
        mathml = convert(source, display=display)
    except Exception as error:  # latex2mathml raises its own exception classes and others
        raise MathError(f"{where}: cannot convert to MathML: {source!r}: {error}") from error
    if "\\" in mathml:  # latex2mathml passes a command it does not know through as text
        raise MathError(f"{where}: a LaTeX command has no MathML form: {source!r}: {mathml}")
    # a multi-letter <mi> is upright by default (MathML Core), so the name needs no mathvariant
    return _UPRIGHT_LETTERS.sub(
        lambda m: "<mi>" + "".join(_UPRIGHT_LETTER.findall(m.group(1))) + "</mi>", mathml)


def render(page_html: str, where: str = "") -> str:
    """page_html with every arithmatex span and div replaced by MathML."""
    page_html = _BLOCK.sub(
        lambda m: f'<div class="math-display">{to_mathml(m.group(1), "block", where)}</div>',
        page_html)
    return _INLINE.sub(lambda m: to_mathml(m.group(1), "inline", where), page_html)


def on_page_content(html_text: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs API)
    return render(html_text, page.file.src_uri)
