"""A node's HTTP listeners: the management API and console (server.py) and the Prometheus endpoint (metrics.py)."""
