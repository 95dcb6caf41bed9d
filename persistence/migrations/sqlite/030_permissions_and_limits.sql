-- The permission regexes of each user (mirrors migrations/postgres/030_permissions_and_limits.sql):
-- JSON {"vhosts": {vhost: [configure, write, read]}, "topics": {vhost: {exchange: [write, read]}}}.
-- Users stored before have '{}': every vhost in their vhosts list with ".*" for all three.
ALTER TABLE users ADD COLUMN permissions TEXT NOT NULL DEFAULT '{}';
-- RabbitMQ's vhost limits, JSON {"max-connections": N, "max-queues": N} (core/engine/limits.py),
-- in their own table so the vhosts table the retention jobs read stays as it is; user limits
-- travel in users.permissions under "limits".
CREATE TABLE vhost_limits (
    vhost TEXT PRIMARY KEY,
    limits TEXT NOT NULL
);
