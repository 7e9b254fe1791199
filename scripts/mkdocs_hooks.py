"""MkDocs hook: the docstrings' Sphinx cross-reference roles (``:class:`~snapckpt.events.SaveStats```) shown as
code, as Sphinx shows them, instead of the role's literal text (mkdocstrings' Google style parser leaves roles as
they are). A ``~`` keeps the last dotted part only, as in Sphinx."""
from __future__ import annotations

import re

_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj|py:\w+):<code>(~?)([^<]*)</code>")


def _code(m: "re.Match[str]") -> str:
    name = m[2].rsplit(".", 1)[-1] if m[1] else m[2]
    return f"<code>{name}</code>"


def on_page_content(html: str, **kwargs) -> str:
    """Replace each role by its code text (``page``, ``config`` and ``files`` are not needed)."""
    return _ROLE.sub(_code, html)
