"""Exchange federation (runtime parameters ``federation-upstream``, ``federation-upstream-set``), as RabbitMQ's.

See docs/FEDERATION.md.
"""
