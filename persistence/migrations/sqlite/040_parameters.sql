-- Runtime parameters (/api/parameters/{component}/{vhost}/{name}): shovels and
-- whatever other component stores one. Every node reads them (leveret/shovel/),
-- so a shovel survives a restart and moves with the cluster.
-- Numbered 040 so it never collides with migrations other branches add meanwhile.
CREATE TABLE runtime_parameters (
    vhost TEXT NOT NULL,
    component TEXT NOT NULL,
    name TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (vhost, component, name)
);
