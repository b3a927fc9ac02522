"""Shared by the dashboard tests: the start tags of an HTML string, for asserting on rendered panels."""

from __future__ import annotations

from html.parser import HTMLParser


class Elements(HTMLParser):
    """Every start tag as (tag, attributes, text directly inside it)."""

    def __init__(self, markup: str):
        super().__init__()
        self.found: list[tuple[str, dict, str]] = []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs), ""))

    def handle_data(self, data):
        if self.found:
            tag, attrs, text = self.found[-1]
            self.found[-1] = (tag, attrs, text + data)

    def cells(self) -> dict[int, tuple[dict, str]]:
        """Block id -> (attributes, text) of every cell that names one block (data-block)."""
        return {int(a["data-block"]): (a, text) for _, a, text in self.found if "data-block" in a}
