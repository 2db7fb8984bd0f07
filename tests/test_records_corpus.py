"""The frozen corpus: control intents as builds wrote them must always decode, with the intent their
file names. The checksums keep anyone from "fixing" a file to suit a new build."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gradient.records.schemas import CONTROL_SCHEMA, decode_body, encode, intent_names, tag_of

CORPUS = Path(__file__).parent / "records_corpus"
FILES = sorted(CORPUS.glob("control-*.json"))


def _intent_of(path: Path) -> str:
    stem = path.stem.removeprefix("control-")
    return next(name for name in sorted(intent_names(), key=len, reverse=True) if stem.startswith(name))


def test_the_corpus_has_an_entry_for_every_control_intent() -> None:
    assert {_intent_of(p) for p in FILES} == set(intent_names())


def test_the_corpus_files_are_unchanged_since_they_were_frozen() -> None:
    listed = {}
    for line in (CORPUS / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        listed[name] = digest
    assert set(listed) == {p.name for p in FILES}, "every corpus file is listed, and only those"
    for path in FILES:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == listed[path.name], path.name


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_corpus_entry_decodes_with_the_intent_its_name_says(path: Path) -> None:
    intent = decode_body(CONTROL_SCHEMA, path.read_bytes())
    assert tag_of(intent) == _intent_of(path)


@pytest.mark.parametrize("intent", intent_names())
def test_this_build_still_writes_the_canonical_corpus_bytes(intent: str) -> None:
    path = CORPUS / f"control-{intent}.json"
    text = path.read_text()
    assert encode(decode_body(CONTROL_SCHEMA, text)) == text
