"""Data paths: tcp between hosts, cross-memory attach on one host."""
