"""Leveret: an AMQP 0-9-1 message broker in Python."""

# The release (pyproject.toml reads it; leveret-client carries the same number; CHANGELOG.md names it).
__version__ = "0.2.0"
