"""AMQP 0-9-1 compatibility test suite for Leveret (validated against RabbitMQ).

This is a package so that the helper modules can be imported as
``compat_tests.<module>`` and so that test module basenames never clash with
other test directories of the project.
"""
