"""Links between brokers that run on a node: dynamic shovels and exchange federation."""
