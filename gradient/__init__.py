"""Gradient: a distributed job scheduler for Nix CI."""

from gradient.celery import app as celery_app

__all__ = ["celery_app"]
