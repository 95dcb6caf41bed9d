-- Messages are deleted about as fast as they are inserted, so the table and
-- its TOAST table only stay small if vacuum keeps up: with the defaults (20 %
-- dead rows, cost-limited) a flood of 1 MiB bodies spent ~40 % of the
-- backend's CPU extending the TOAST relation instead of reusing freed space
-- (89 vs 120 MiB/s with frequent vacuums, one connection). Autovacuum's wake-up
-- interval is server-wide: set autovacuum_naptime (docs/ARCHITECTURE.md).
ALTER TABLE messages SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0,
    toast.autovacuum_vacuum_scale_factor = 0,
    toast.autovacuum_vacuum_threshold = 1000,
    toast.autovacuum_vacuum_insert_scale_factor = 0,
    toast.autovacuum_vacuum_insert_threshold = 1000,
    toast.autovacuum_vacuum_cost_delay = 0
);
