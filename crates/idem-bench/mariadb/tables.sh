# Sourced by the MariaDB scripts beside it: `mysql_` runs statements in the
# benchmark database, and `fresh_tables KEYS EFFECTS` (re)creates a keys
# table shaped like the store's and a business table under those names.
db=${IDEM_BENCH_MYSQL_DB:-test}
mysql_() { mysql -uroot -h127.0.0.1 -P3306 "$db" "$@"; }
fresh_tables() { # keys table, effects table
    mysql_ -e "
DROP TABLE IF EXISTS $1, $2;
CREATE TABLE $1 (
    tenant VARBINARY(255) NOT NULL, operation VARBINARY(255) NOT NULL, idem_key VARBINARY(255) NOT NULL,
    fingerprint BINARY(32) NOT NULL, status SMALLINT NOT NULL, token BIGINT NOT NULL, payload LONGBLOB NULL,
    created_at_ms BIGINT NOT NULL, expires_at_ms BIGINT NOT NULL, lease_expires_at_ms BIGINT NULL,
    PRIMARY KEY (tenant, operation, idem_key), KEY expires_at_ms_idx (expires_at_ms)) ENGINE=InnoDB;
CREATE TABLE $2 (id VARBINARY(64) PRIMARY KEY, payload VARBINARY(64)) ENGINE=InnoDB;"
}
