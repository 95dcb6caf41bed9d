"""Every test run: nodes a test starts without naming MQTT ports serve no MQTT listener.

The defaults (1883, 8883, 15675) would collide between nodes of tests run in
parallel, and a RabbitMQ with its MQTT plugin may hold 1883. A flag
(--mqtt-port) still overrides this, as compat_tests/node_process.py passes
for nodes that serve MQTT.
"""

import os

for _name in ("LEVERET_MQTT_PORT", "LEVERET_MQTT_TLS_PORT", "LEVERET_MQTT_WS_PORT"):
    os.environ[_name] = "0"
