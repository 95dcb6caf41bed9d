"""Dynamic shovels (runtime parameters of component ``shovel``), as RabbitMQ's (docs/SHOVELS.md)."""
