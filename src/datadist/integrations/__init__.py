"""Adapters that plug datadist into serving frameworks.

Each adapter lives in its own subpackage and imports its framework only when loaded;
``import datadist`` never imports any of them.
"""
