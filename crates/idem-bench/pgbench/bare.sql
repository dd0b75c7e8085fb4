-- The caller's own transaction: BEGIN; one insert; COMMIT.
\set a random(1, 9000000000000000)
\set b random(1, 9000000000000000)
BEGIN;
INSERT INTO pgb_effects (id, payload) VALUES (:client_id || '-' || :a || '-' || :b, 'payload');
COMMIT;
