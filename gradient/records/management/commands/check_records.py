"""`python manage.py check_records [--settle] [--job KEY ...]`: fold every unsettled record (or the
named ones) and report each job whose rows disagree with its fold. Exits 1 when any does."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from gradient.records.errors import UnknownRecord
from gradient.records.services import CheckReport, RecordProblem, record_check_one, records_check


class Command(BaseCommand):
    help = "Fold every unsettled job record and report jobs whose rows disagree with their fold."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--settle", action="store_true", help="Also settle records whose settled predicate holds."
        )
        parser.add_argument(
            "--job", action="append", default=[], metavar="KEY", help="Check only this job key (repeatable)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        now = timezone.now()
        settle: bool = options["settle"]
        if options["job"]:
            report = CheckReport()
            for job_key in options["job"]:
                try:
                    problems, settled = record_check_one(job_key=job_key, now=now, settle=settle)
                except UnknownRecord:
                    raise CommandError(f"no record for {job_key}") from None
                report.checked += 1
                report.settled += int(settled)
                if problems:
                    report.problems.append(RecordProblem(job_key=job_key, problems=problems))
        else:
            report = records_check(now=now, settle=settle)
        for problem in report.problems:
            self.stdout.write(f"{problem.job_key}:")
            for line in problem.problems:
                self.stdout.write(f"  - {line}")
        self.stdout.write(
            f"checked {report.checked} records, settled {report.settled}, {len(report.problems)} disagree"
        )
        if report.problems:
            raise CommandError(f"{len(report.problems)} jobs disagree with their records")
