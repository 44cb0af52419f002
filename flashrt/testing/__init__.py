"""Helpers for flashrt's own test suite and for users' tests of their frontends."""
