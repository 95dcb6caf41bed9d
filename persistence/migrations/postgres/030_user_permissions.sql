-- The permission regexes of each user, enforced by core/engine/access.py:
-- JSON {"vhosts": {vhost: [configure, write, read]}, "topics": {vhost: {exchange: [write, read]}}}.
-- Users stored before have '{}': every vhost in their vhosts list with ".*" for all three.
ALTER TABLE users ADD COLUMN permissions text NOT NULL DEFAULT '{}';
