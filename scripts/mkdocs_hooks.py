"""mkdocs hooks (``hooks:`` in mkdocs.yml): the repository's CHANGELOG.md is a page of the site, ``changelog.md``.

The changelog lives at the repository's root, where GitHub and packaging tools look for it, and links to the docs as
``docs/PAGE.md``; on the site it sits beside those pages, so those links lose their ``docs/`` prefix there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"
PAGE = "changelog.md"
_DOCS_LINK = re.compile(r"\]\(docs/")


def on_files(files: Files, config: MkDocsConfig, **_: Any) -> Files:
    """Add CHANGELOG.md to the site as ``changelog.md``."""
    files.append(File.generated(config, PAGE, abs_src_path=str(CHANGELOG)))
    return files


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    """Rewrite the changelog's ``docs/PAGE.md`` links to the site's ``PAGE.md``."""
    if page.file.src_uri == PAGE:
        return _DOCS_LINK.sub("](", markdown)
    return markdown
