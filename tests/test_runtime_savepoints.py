"""runtime.savepoints.part: a part of the caller's transaction that fails alone, also when the failing
write is the ORM's own (which marks the whole transaction for rollback: without clearing that mark the
ROLLBACK TO SAVEPOINT itself was refused, and the batch or claim around it failed whole)."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from gradient.runtime import savepoints
from gradient.scheduling.models import Project

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_failed_orm_write_rolls_back_its_part_alone_and_the_transaction_goes_on() -> None:
    with transaction.atomic(durable=True):
        Project.objects.create(name="before")
        with pytest.raises(IntegrityError), savepoints.part():
            Project.objects.create(name="inside")
            Project.objects.create(name="before")  # unique name: refused by the ORM's save
        Project.objects.create(name="after")
    assert sorted(Project.objects.values_list("name", flat=True)) == ["after", "before"]


def test_a_part_that_succeeds_is_kept_and_outside_a_transaction_it_only_passes_the_error_on() -> None:
    with transaction.atomic():
        with savepoints.part():
            Project.objects.create(name="kept")
    with pytest.raises(IntegrityError), savepoints.part():
        Project.objects.create(name="kept")
    assert list(Project.objects.values_list("name", flat=True)) == ["kept"]
