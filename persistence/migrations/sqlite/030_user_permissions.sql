-- The permission regexes of each user (mirrors migrations/postgres/030_user_permissions.sql):
-- JSON {"vhosts": {vhost: [configure, write, read]}, "topics": {vhost: {exchange: [write, read]}}}.
-- Users stored before have '{}': every vhost in their vhosts list with ".*" for all three.
ALTER TABLE users ADD COLUMN permissions TEXT NOT NULL DEFAULT '{}';
