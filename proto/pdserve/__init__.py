"""Versioned pdserve APIs."""
