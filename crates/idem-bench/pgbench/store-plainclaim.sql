-- store.sql with paired.sql's plain upsert as the claim (no read first, no wait bound, no gates).
\set a random(1, 9000000000000000)
\set b random(1, 9000000000000000)
\startpipeline
BEGIN;
INSERT INTO pgb_keys AS k (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms, lease_expires_at_ms) VALUES ('t', 'POST /bench', :client_id || '-' || :a || '-' || :b, '\xabababababababababababababababababababababababababababababababab', 0, 1, 1, 9000000000000000, NULL) ON CONFLICT (tenant, operation, idem_key) DO UPDATE SET status = 0 WHERE k.expires_at_ms <= 1 RETURNING k.token;
\endpipeline
INSERT INTO pgb_effects (id, payload) VALUES (:client_id || '-' || :a || '-' || :b, 'payload');
\startpipeline
WITH done AS (UPDATE pgb_keys SET status = 1::smallint, payload = '\x7b226f6b223a747275657d'::bytea, lease_expires_at_ms = NULL WHERE tenant = 't' AND operation = 'POST /bench' AND idem_key = :client_id || '-' || :a || '-' || :b AND status = 0 RETURNING 1) SELECT 1 / count(*)::int FROM done;
COMMIT;
\endpipeline
