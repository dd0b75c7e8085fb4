-- onewrite.sql on a keys table without an expiry index (setup.sql's pgb_keys_noexp).
\set a random(1, 9000000000000000)
\set b random(1, 9000000000000000)
\startpipeline
BEGIN;
SELECT pg_advisory_xact_lock(hashtextextended(:client_id || '-' || :a || '-' || :b, 0)), (SELECT status FROM pgb_keys_noexp WHERE tenant = 't' AND operation = 'POST /bench' AND idem_key = :client_id || '-' || :a || '-' || :b);
\endpipeline
INSERT INTO pgb_effects (id, payload) VALUES (:client_id || '-' || :a || '-' || :b, 'payload');
\startpipeline
INSERT INTO pgb_keys_noexp (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms, lease_expires_at_ms, payload) VALUES ('t', 'POST /bench', :client_id || '-' || :a || '-' || :b, '\xabababababababababababababababababababababababababababababababab', 1, 1, 1, 9000000000000000, NULL, '\x7b226f6b223a747275657d');
COMMIT;
\endpipeline
