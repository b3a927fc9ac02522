"""docs/api.md, the API reference, is the code's: its table is what minivllm/docs_tables.py generates from
protocol.ACCEPTED_FIELDS, NOT_IMPLEMENTED and field_help.FIELD_HELP, with one row per field a route takes (and per
field refused unless off), so a field added to a route without its line of help, or without regenerating the docs
(`python -m minivllm.docs_tables --write`), fails here; and the README's API paragraph points to it."""

from __future__ import annotations

import re
from pathlib import Path

from minivllm import docs_tables
from minivllm.entrypoints.field_help import FIELD_HELP
from minivllm.entrypoints.protocol import ACCEPTED_FIELDS, NOT_IMPLEMENTED

ROOT = Path(__file__).resolve().parent.parent


def test_docs_api_md_holds_the_generated_table():
    found = docs_tables.blocks_in((ROOT / "docs" / "api.md").read_text(), docs_tables.API_TABLES)
    assert found == {"request fields": docs_tables.generated_block("request fields")}, (
        "docs/api.md's table is not what the code generates; run `python -m minivllm.docs_tables --write`")


def test_every_field_a_route_takes_has_a_row_with_its_routes_and_its_help():
    accepted = set().union(*ACCEPTED_FIELDS.values())
    assert set(FIELD_HELP) == accepted, "field_help.FIELD_HELP and protocol.ACCEPTED_FIELDS disagree"
    rows = {re.match(r"\| `(\w+)` \|", row).group(1): row.split(" | ")
            for row in docs_tables.request_fields_table().splitlines()[2:]}
    assert set(rows) == accepted | set(NOT_IMPLEMENTED)
    for name in accepted:
        cells = rows[name][1:1 + len(ACCEPTED_FIELDS)]
        assert [c == "yes" for c in cells] == [name in fields for fields in ACCEPTED_FIELDS.values()], name
    for name in ("return_token_ids", "return_tokens_as_token_ids", "truncation_side", "priority"):
        assert rows[name][1:3] == ["yes", "yes"], name              # both completion routes take vLLM's extras
    for name in ("echo", "prompt_logprobs"):
        assert rows[name][2] == "yes", name                         # chat takes them too


def test_the_readme_api_paragraph_links_the_reference():
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("**The API**"):].split("\n\n", 1)[0]
    assert "docs/api.md" in paragraph
