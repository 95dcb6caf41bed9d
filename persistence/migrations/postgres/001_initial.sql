-- Leveret message store, PostgreSQL schema 1.
-- The SQLite schema mirrors these names and the Spark retention jobs read them:
-- rename nothing here, add a new numbered file instead.

CREATE TABLE vhosts (
    name text PRIMARY KEY
);

-- arguments columns hold AMQP field tables in their wire encoding (core.fieldtable.encode_table).
CREATE TABLE exchanges (
    vhost text NOT NULL,
    name text NOT NULL,
    type text NOT NULL,
    auto_delete boolean NOT NULL DEFAULT false,
    internal boolean NOT NULL DEFAULT false,
    arguments bytea NOT NULL,
    PRIMARY KEY (vhost, name)
);

CREATE TABLE queues (
    vhost text NOT NULL,
    name text NOT NULL,
    auto_delete boolean NOT NULL DEFAULT false,
    arguments bytea NOT NULL,
    PRIMARY KEY (vhost, name)
);

-- arguments_key: hex SHA-1 of the encoded arguments, so that two bindings differing
-- only in their arguments (headers exchanges) are distinct.
CREATE TABLE bindings (
    vhost text NOT NULL,
    source text NOT NULL,
    destination_kind text NOT NULL CHECK (destination_kind IN ('queue', 'exchange')),
    destination text NOT NULL,
    routing_key text NOT NULL,
    arguments bytea NOT NULL,
    arguments_key text NOT NULL,
    PRIMARY KEY (vhost, source, destination_kind, destination, routing_key, arguments_key)
);
CREATE INDEX bindings_destination ON bindings (vhost, destination_kind, destination);

-- The fencing token of each queue (DESIGN.md, "Ownership and failover").
CREATE TABLE queue_epochs (
    vhost text NOT NULL,
    queue text NOT NULL,
    epoch bigint NOT NULL,
    PRIMARY KEY (vhost, queue)
);

-- enqueued_at and expires_at are Unix times in seconds; size is the body size in bytes.
CREATE TABLE messages (
    vhost text NOT NULL,
    queue text NOT NULL,
    "offset" bigint NOT NULL,
    message_id text NOT NULL,
    exchange text NOT NULL,
    routing_key text NOT NULL,
    properties bytea NOT NULL,
    body bytea NOT NULL,
    enqueued_at double precision NOT NULL,
    expires_at double precision NULL,
    size integer NOT NULL,
    delivery_count integer NOT NULL DEFAULT 0,
    state text NOT NULL DEFAULT 'ready',
    PRIMARY KEY (vhost, queue, "offset")
);
CREATE INDEX messages_enqueued_at ON messages (enqueued_at);
