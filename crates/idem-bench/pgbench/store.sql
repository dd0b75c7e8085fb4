-- idem's own statements as the store sends them under the default claim (insert-on-conflict):
-- BEGIN with the first insert (under the claim's lock-wait bound) and the look (the bound
-- restored, the key's row read), the business insert, the record (failing unless it updated
-- exactly one row) with COMMIT. On pgb_keys.
\set a random(1, 9000000000000000)
\set b random(1, 9000000000000000)
\startpipeline
BEGIN;
INSERT INTO pgb_keys AS k (tenant, operation, idem_key, fingerprint, status, token, created_at_ms, expires_at_ms, lease_expires_at_ms) SELECT 't', 'POST /bench', :client_id || '-' || :a || '-' || :b, '\xabababababababababababababababababababababababababababababababab'::bytea, 0, 1::bigint, 1::bigint, 9000000000000000::bigint, NULL::bigint FROM (SELECT set_config('lock_timeout', '5000', true) AS bounded FROM (SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true) AS saved OFFSET 0) AS saved OFFSET 0) AS bounded ON CONFLICT (tenant, operation, idem_key) DO NOTHING RETURNING k.token;
SELECT NULL::bigint, COALESCE(e.expires_at_ms > 1::bigint AND (e.status <> 0 OR e.lease_expires_at_ms > 1::bigint), false), e.fingerprint, e.status, e.token, e.payload, e.lease_expires_at_ms, e.expires_at_ms, r.restored FROM (SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true) AS restored) AS r LEFT JOIN (SELECT fingerprint, status, token, payload, lease_expires_at_ms, expires_at_ms FROM pgb_keys WHERE tenant = 't' AND operation = 'POST /bench' AND idem_key = :client_id || '-' || :a || '-' || :b AND txid_current_if_assigned() IS NULL) AS e ON true;
\endpipeline
INSERT INTO pgb_effects (id, payload) VALUES (:client_id || '-' || :a || '-' || :b, 'payload');
\startpipeline
WITH done AS (UPDATE pgb_keys SET status = 1::smallint, payload = '\x7b226f6b223a747275657d'::bytea, lease_expires_at_ms = NULL WHERE tenant = 't' AND operation = 'POST /bench' AND idem_key = :client_id || '-' || :a || '-' || :b AND status = 0 RETURNING 1) SELECT 1 / count(*)::int FROM done;
COMMIT;
\endpipeline
