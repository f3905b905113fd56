"""Stale weights: weight versions and the staleness corrections (predictions) of delayed stages."""
