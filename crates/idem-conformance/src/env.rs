//! Where the tests find their servers: `IDEM_TEST_POSTGRES_URL`,
//! `IDEM_TEST_MYSQL_URL`, `IDEM_TEST_REDIS_URL` and `IDEM_TEST_NATS_URL`,
//! each with the local default of the machine the suite is written for. A
//! test that cannot reach the server it was pointed at fails and says so;
//! none is skipped.

/// The variable's value, or `default`.
fn var_or(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// PostgreSQL: `IDEM_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`.
pub fn postgres_url() -> String {
    var_or("IDEM_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
}

/// MySQL or MariaDB: `IDEM_TEST_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`.
pub fn mysql_url() -> String {
    var_or("IDEM_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
}

/// Redis: `IDEM_TEST_REDIS_URL`, default `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    var_or("IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379")
}

/// NATS with JetStream: `IDEM_TEST_NATS_URL`, default `nats://127.0.0.1:4222`.
pub fn nats_url() -> String {
    var_or("IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222")
}
