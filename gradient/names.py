"""Names people read and compare (projects, workers, users): no control or format characters, and no
name that looks like another.

A zero-width space, a right-to-left override or a soft hyphen makes two names that look the same differ
(`ci` and `c\\u200bi`), or one name look like another; a control character garbles a log line. Refused
everywhere a name is made: the REST routes and the admin (users already are: Django's username validator
takes letters, digits and `@.+-_` only).

Look-alikes (issue 36, finding 7): two names are one when they are equal NFKC-normalized and case-folded
(`ｐｒｏｊA`, `𝐩𝐫𝐨𝐣A` and `PROJA` are `proja`), as the login lock compares user names; and a name may not
mix letters of several scripts (`projА` with a Cyrillic А: Unicode's TR 39 "mixed script" restriction),
which NFKC leaves apart.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from typing import Any

from django import forms
from django.core.exceptions import ValidationError

# Control, format, surrogate, private use, unassigned; line and paragraph separators.
REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def refuse_invisible_characters(value: str) -> None:
    """Django validator: raise ValidationError naming the first control or format character."""
    for ch in value:
        if unicodedata.category(ch) in REFUSED_CATEGORIES:
            name = unicodedata.name(ch, "unnamed")
            raise ValidationError(
                f"A name may not contain control or format characters: U+{ord(ch):04X} ({name}).",
                code="invisible_character",
            )


def name_key(value: str) -> str:
    """What two names are compared by: NFKC, case-folded, NFKC again (folding can denormalize)."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", value).casefold())


def _script(ch: str) -> str | None:
    """The script of a letter, as the first word of its Unicode name (LATIN, CYRILLIC, GREEK, ...);
    None for what is no letter (digits, punctuation, spaces belong to every script)."""
    if not unicodedata.category(ch).startswith("L"):
        return None
    return unicodedata.name(ch, "UNKNOWN").split(" ", 1)[0]


# Written beside Latin (and each other) in Chinese, Japanese and Korean names, and not mistaken for Latin
# letters: TR 39's "highly restrictive" level allows these combinations.
_EAST_ASIAN = frozenset({"CJK", "HIRAGANA", "KATAKANA", "HANGUL", "BOPOMOFO"})


def refuse_mixed_scripts(value: str) -> None:
    """Django validator: a name's letters come from one script (East Asian ones may join Latin)."""
    found = {s for ch in unicodedata.normalize("NFKC", value) if (s := _script(ch)) is not None}
    scripts = sorted(found - _EAST_ASIAN) if found - _EAST_ASIAN else []
    if len(scripts) > 1:
        raise ValidationError(
            f"A name may not mix letters of several scripts ({', '.join(s.title() for s in scripts)}): "
            "it would look like another name.",
            code="mixed_scripts",
        )


def refuse_lookalike(value: str, existing: Iterable[str], what: str) -> None:
    """Raise ValidationError when `value` is one of the `existing` names compared by `name_key`."""
    key = name_key(value)
    for name in existing:
        if name_key(name) == key:
            same = "already exists" if name == value else f"looks the same as the existing {name!r}"
            raise ValidationError(f"A {what} with that name {same}.", code="lookalike")


def check_name(value: str, existing: Iterable[str], what: str) -> None:
    """Every rule of a new name: no invisible characters, one script, no look-alike of an existing one."""
    refuse_invisible_characters(value)
    refuse_mixed_scripts(value)
    refuse_lookalike(value, existing, what)


class NameCheckedForm(forms.ModelForm):  # type: ignore[type-arg]
    """An admin form whose `name` field refuses control and format characters, mixed scripts, and a
    look-alike of another row's name."""

    def clean_name(self) -> Any:
        value = self.cleaned_data["name"]
        if isinstance(value, str):
            others = self._meta.model.objects.exclude(pk=self.instance.pk).values_list("name", flat=True)
            check_name(value, others, self._meta.model._meta.verbose_name)
        return value
