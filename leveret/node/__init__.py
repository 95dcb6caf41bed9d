"""The node: configuration, the wiring of core, front ends, stores and coordinator, its listeners and watches."""
