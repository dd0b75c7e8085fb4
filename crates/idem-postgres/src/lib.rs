//! PostgreSQL (and Postgres-compatible engines such as CockroachDB and YugabyteDB) store for idem.
