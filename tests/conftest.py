"""Shared pytest setup. Subdirectories keep their own fixtures in their own conftest.py."""
