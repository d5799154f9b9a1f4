"""Conformance checks that every plugin of a kind must pass (used by minisgl's own tests and
available to third-party plugin packages)."""
