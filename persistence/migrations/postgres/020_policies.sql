-- Policies as RabbitMQ defines them: per vhost, user or operator, a pattern over
-- queue/exchange names, what they apply to, a priority and a JSON definition.
-- One notion of policy: the node applies them to live queues (core/engine/policy.py)
-- and the retention job reads the same rows (spark/policies.py). The retention
-- policies of migration 002 become policies of vhost '/' that apply to queues.
-- Numbered 020 so it never collides with migrations other branches add meanwhile.
CREATE TABLE policies (
    vhost text NOT NULL,
    name text NOT NULL,
    operator boolean NOT NULL DEFAULT false,
    pattern text NOT NULL,
    apply_to text NOT NULL DEFAULT 'all',
    priority integer NOT NULL DEFAULT 0,
    definition text NOT NULL,
    updated_at double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (vhost, operator, name)
);
INSERT INTO policies (vhost, name, operator, pattern, apply_to, priority, definition, updated_at)
SELECT '/', name, false, pattern, 'queues', 0,
       jsonb_strip_nulls(jsonb_build_object(
           'max-age', CASE WHEN max_age_seconds IS NULL THEN NULL
                           ELSE greatest(1, round(max_age_seconds))::bigint::text || 's' END,
           'max-length-bytes', max_bytes,
           'max-length', max_length,
           'archive', archive))::text,
       created_at
FROM retention_policies;
DROP TABLE retention_policies;
