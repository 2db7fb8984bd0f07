"""The REST parsers: DRF's JSON parser, with a body nested too deeply answered as malformed (400). Its own
module: DRF's APIView imports the parsers while gradient.rest imports DRF's views."""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions, parsers

# A JSON body nested deeper than this is refused (400): no route takes more than a few levels, and the
# standard library's parser overflows the stack (RecursionError, a 500) near 1 000.
MAX_JSON_DEPTH = 32


def _depth_exceeds(value: Any, limit: int) -> bool:
    """True when `value` nests lists and objects deeper than `limit` (iteratively: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, with a body too deeply nested to parse (RecursionError) or deeper than
    MAX_JSON_DEPTH answered as malformed (400) instead of a server error."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError(
                f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels"
            ) from None
        if _depth_exceeds(data, MAX_JSON_DEPTH):
            raise exceptions.ParseError(f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels")
        return data
