"""Bundled example models and data factories."""
