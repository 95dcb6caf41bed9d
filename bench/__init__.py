"""Leveret benchmark harness: run the same AMQP 0-9-1 scenarios against several brokers.

Run it with ``python -m bench --url NAME=amqp://... [--url NAME=amqp://...]``;
see ``bench/README.md``.
"""
