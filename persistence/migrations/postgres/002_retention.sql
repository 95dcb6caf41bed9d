-- Named retention policies (leveret retention policy set|list|delete), matched against
-- queue names by a regular expression (searched, as RabbitMQ's policy patterns are).
-- NULL limits do not apply; created_at is a Unix time in seconds, as in messages.
CREATE TABLE retention_policies (
    name text PRIMARY KEY,
    pattern text NOT NULL,
    max_age_seconds double precision NULL,
    max_bytes bigint NULL,
    max_length bigint NULL,
    archive boolean NOT NULL DEFAULT false,
    created_at double precision NOT NULL
);
