"""Names people read and compare (projects, workers, users): no control or format characters.

A zero-width space, a right-to-left override or a soft hyphen makes two names that look the same differ
(`ci` and `c\\u200bi`), or one name look like another; a control character garbles a log line. Refused
everywhere a name is made: the REST routes and the admin (users already are: Django's username validator
takes letters, digits and `@.+-_` only).
"""

from __future__ import annotations

import unicodedata
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


class NameCheckedForm(forms.ModelForm):  # type: ignore[type-arg]
    """An admin form whose `name` field refuses control and format characters."""

    def clean_name(self) -> Any:
        value = self.cleaned_data["name"]
        if isinstance(value, str):
            refuse_invisible_characters(value)
        return value
