"""The REST parsers: DRF's JSON parser, with a body nested too deeply answered as malformed (400). Its own
module: DRF's APIView imports the parsers while gradient.rest imports DRF's views."""

from __future__ import annotations

import re
from typing import Any

from rest_framework import exceptions, parsers

# A JSON body nested deeper than this is refused (400): no route takes more than a few levels, and the
# standard library's parser overflows the stack (RecursionError, a 500) near 1 000.
MAX_JSON_DEPTH = 32
# JSON may escape a lone UTF-16 surrogate ("\ud800"); Python keeps it in the str, and no database or
# encoder takes it: a username holding one made the token route answer 500 (issue 36, finding 6).
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _problem(value: Any, limit: int) -> str | None:
    """Why `value` is refused: nested deeper than `limit` (walked iteratively: no recursion), or a string
    (a key too) that is no Unicode text; None when it is fine."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return "a string holds a lone surrogate (\\ud800-\\udfff): it is no Unicode text"
            continue
        if isinstance(item, dict):
            children: Any = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return f"nested deeper than {limit} levels"
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, str)))
    return None


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, with a body too deeply nested to parse (RecursionError), deeper than
    MAX_JSON_DEPTH, or holding a lone surrogate answered as malformed (400) instead of a server error."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError(
                f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels"
            ) from None
        if (problem := _problem(data, MAX_JSON_DEPTH)) is not None:
            raise exceptions.ParseError(f"JSON parse error - {problem}")
        return data
