-- Leveret's durable store, SQLite flavour (mirrors migrations/postgres/001_initial.sql).
CREATE TABLE vhosts (name TEXT PRIMARY KEY);

CREATE TABLE exchanges (
    vhost TEXT NOT NULL,
    name TEXT NOT NULL,
    type TEXT NOT NULL,
    auto_delete INTEGER NOT NULL,
    internal INTEGER NOT NULL,
    arguments BLOB NOT NULL,
    PRIMARY KEY (vhost, name)
);

CREATE TABLE queues (
    vhost TEXT NOT NULL,
    name TEXT NOT NULL,
    auto_delete INTEGER NOT NULL,
    arguments BLOB NOT NULL,
    PRIMARY KEY (vhost, name)
);

CREATE TABLE bindings (
    vhost TEXT NOT NULL,
    source TEXT NOT NULL,
    destination_kind TEXT NOT NULL,
    destination TEXT NOT NULL,
    routing_key TEXT NOT NULL,
    arguments BLOB NOT NULL,
    arguments_key TEXT NOT NULL,
    PRIMARY KEY (vhost, source, destination_kind, destination, routing_key, arguments_key)
);

CREATE TABLE queue_epochs (
    vhost TEXT NOT NULL,
    queue TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    PRIMARY KEY (vhost, queue)
);

CREATE TABLE messages (
    vhost TEXT NOT NULL,
    queue TEXT NOT NULL,
    "offset" INTEGER NOT NULL,
    message_id TEXT NOT NULL,
    exchange TEXT NOT NULL,
    routing_key TEXT NOT NULL,
    properties BLOB NOT NULL,
    body BLOB NOT NULL,
    enqueued_at REAL NOT NULL,
    expires_at REAL,
    size INTEGER NOT NULL,
    delivery_count INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'ready',
    PRIMARY KEY (vhost, queue, "offset")
);

CREATE INDEX messages_enqueued_at ON messages (enqueued_at);
