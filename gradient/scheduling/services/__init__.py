"""Writes of the scheduling app: claims, assignment, reports, the build graph, evaluations."""
