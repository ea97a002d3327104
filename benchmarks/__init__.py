"""Measured comparisons; each writes JSON and a readable markdown summary."""
