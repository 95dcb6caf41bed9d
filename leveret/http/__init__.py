"""The node's HTTP side: the management API and console (server.py) and the Prometheus endpoint."""
