"""The reference worker, `python -m gradient.workers.client`: see docs/workers.md."""
