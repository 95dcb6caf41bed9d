-- Message bodies are stored out of line without compression: pglz on every
-- 1 MiB body cost the server more CPU than everything else in the persistent
-- 1 MiB benchmark, and most payloads (JSON aside) compress poorly anyway.
ALTER TABLE messages ALTER COLUMN body SET STORAGE EXTERNAL;
