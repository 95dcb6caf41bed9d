"""The news web application: a pusher page and a consumer page over Leveret's gRPC client (README.md)."""
