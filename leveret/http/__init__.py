"""A node's HTTP listeners: the management API and console, and the Prometheus endpoint (metrics.py)."""
