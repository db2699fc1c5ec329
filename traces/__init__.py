"""Readers for real production trace formats, returning the canonical request table."""
