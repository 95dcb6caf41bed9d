"""MQTT 3.1.1 and 5.0 on the engine: a sans-IO connection state machine and a thin asyncio layer.

See docs/MQTT.md for what is served and how topics map onto ``amq.topic``.
"""
