-- Tables for the statement-level comparison of PostgreSQL options (run.sh).
SET client_min_messages = warning;
DROP TABLE IF EXISTS pgb_keys, pgb_keys_noexp, pgb_keys_brin, pgb_effects;
CREATE TABLE pgb_keys (
    tenant TEXT COLLATE "C" NOT NULL,
    operation TEXT COLLATE "C" NOT NULL,
    idem_key TEXT COLLATE "C" NOT NULL,
    fingerprint BYTEA NOT NULL,
    status SMALLINT NOT NULL,
    token BIGINT NOT NULL,
    payload BYTEA NULL,
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL,
    lease_expires_at_ms BIGINT NULL,
    sent_at_ms BIGINT NULL,
    PRIMARY KEY (tenant, operation, idem_key)
) WITH (fillfactor = 80);
CREATE INDEX pgb_keys_expires ON pgb_keys (expires_at_ms);
CREATE TABLE pgb_keys_noexp (LIKE pgb_keys INCLUDING ALL) WITH (fillfactor = 80);
DROP INDEX IF EXISTS pgb_keys_noexp_expires_at_ms_idx;
CREATE TABLE pgb_keys_brin (LIKE pgb_keys INCLUDING ALL) WITH (fillfactor = 80);
DROP INDEX IF EXISTS pgb_keys_brin_expires_at_ms_idx;
CREATE INDEX pgb_keys_brin_expires ON pgb_keys_brin USING brin (expires_at_ms);
CREATE TABLE pgb_effects (id TEXT PRIMARY KEY, payload TEXT NOT NULL);
