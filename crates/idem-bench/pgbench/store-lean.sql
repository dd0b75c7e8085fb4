-- store.sql's claim as one plain statement for READ COMMITTED: the read first and the upsert, without the
-- isolation gates, the lock-wait bound and the arm used under SERIALIZABLE.
\set a random(1, 9000000000000000)
\set b random(1, 9000000000000000)
\startpipeline
BEGIN;
WITH existing AS MATERIALIZED (SELECT fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms FROM pgb_keys WHERE tenant = 't' AND operation = 'POST /bench' AND idem_key = :client_id || '-' || :a || '-' || :b), claimed AS (INSERT INTO pgb_keys AS k (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms, lease_expires_at_ms) SELECT 't', 'POST /bench', :client_id || '-' || :a || '-' || :b, '\xabababababababababababababababababababababababababababababababab'::bytea, 0, 1::bigint, 1::bigint, 9000000000000000::bigint, NULL::bigint WHERE NOT EXISTS (SELECT 1 FROM existing e WHERE e.expires_at_ms > 1 AND (e.status <> 0 OR e.lease_expires_at_ms > 1)) ON CONFLICT (tenant, operation, idem_key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, status = 0, token = GREATEST(k.token + 1, EXCLUDED.token), payload = NULL, created_at_ms = EXCLUDED.created_at_ms, expires_at_ms = EXCLUDED.expires_at_ms, lease_expires_at_ms = EXCLUDED.lease_expires_at_ms, sent_at_ms = NULL WHERE k.expires_at_ms <= 1 OR (k.status = 0 AND k.lease_expires_at_ms <= 1) RETURNING k.token) SELECT c.token, COALESCE(e.expires_at_ms > 1 AND (e.status <> 0 OR e.lease_expires_at_ms > 1), false), e.fingerprint, e.status, e.token, e.payload, e.lease_expires_at_ms, e.expires_at_ms FROM (SELECT 1) AS one LEFT JOIN claimed c ON true LEFT JOIN existing e ON true;
\endpipeline
INSERT INTO pgb_effects (id, payload) VALUES (:client_id || '-' || :a || '-' || :b, 'payload');
\startpipeline
WITH done AS (UPDATE pgb_keys SET status = 1::smallint, payload = '\x7b226f6b223a747275657d'::bytea, lease_expires_at_ms = NULL WHERE tenant = 't' AND operation = 'POST /bench' AND idem_key = :client_id || '-' || :a || '-' || :b AND status = 0 RETURNING 1) SELECT 1 / count(*)::int FROM done;
COMMIT;
\endpipeline
