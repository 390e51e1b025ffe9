"""MkDocs hooks of the docs site (mkdocs.yml ``hooks:``): the docstrings' Sphinx roles, rendered readably.

The docstrings (Google style) name code with Sphinx roles, ``:class:`~tierstore.errors.FencedError```;
mkdocstrings renders Markdown, which leaves ``:class:`` before the code span. This drops the role and, as
Sphinx does for ``~``, keeps only the last component of the name; a paragraph ending in RST's ``::``
(a literal block follows) ends in one colon, as Sphinx shows it.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:meth|class|mod|func|attr|exc|data|obj|py:\w+):<code>(~)?([^<]+)</code>")


def _name(m: re.Match) -> str:
    name = m.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if m.group(1) else name}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub(_name, html).replace("::</p>", ":</p>")
