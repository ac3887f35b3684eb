"""Formulas rendered at build time: each `$...$` / `$$...$$` (left by pymdownx.arithmatex as `\\(...\\)` and
`\\[...\\]` in `arithmatex` elements) becomes MathML (latex2mathml), which browsers draw natively. The site then
needs no script and no network for its maths (clusters, air-gapped machines); a formula latex2mathml cannot read
fails the build, naming the page and the formula."""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

_INLINE = re.compile(r'<span class="arithmatex">\\\((.*?)\\\)</span>', re.S)
_BLOCK = re.compile(r'<div class="arithmatex">\\\[(.*?)\\\]</div>', re.S)


def _mathml(latex: str, display: str, page) -> str:
    source = html.unescape(latex).strip()
    try:
        return convert(source, display=display)
    except Exception as exc:  # noqa: BLE001 - any parser failure is the page's formula, named
        raise ValueError(f"{page.file.src_path}: the formula {source!r} cannot be rendered ({exc})") from None


def on_page_content(html_text: str, page, config, files) -> str:
    html_text = _BLOCK.sub(lambda m: f'<div class="arithmatex">{_mathml(m.group(1), "block", page)}</div>',
                           html_text)
    return _INLINE.sub(lambda m: f'<span class="arithmatex">{_mathml(m.group(1), "inline", page)}</span>',
                       html_text)
