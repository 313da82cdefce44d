"""The API reference's docstrings are written for Sphinx: ``:class:`Producer``` and a
paragraph ending in ``::`` before a literal block. mkdocstrings shows them as Markdown, where
the role would stay as text (``:class:Producer``) and the ``::`` as two colons: this MkDocs
hook drops the role, keeping the name as code, and turns ``::`` into ``:`` (a ``::`` alone,
into nothing)."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj|const|ref):(?=<code>)")
_LITERAL = re.compile(r"(?<=\S)::</p>")
_ALONE = re.compile(r"<p>::</p>\s*")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    if not page.file.src_uri.startswith("reference/"):
        return html
    return _ALONE.sub("", _LITERAL.sub(":</p>", _ROLE.sub("", html)))
