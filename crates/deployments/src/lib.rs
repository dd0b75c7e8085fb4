//! `deployments`: idem on replicated and clustered engines.
//!
//! Each module starts one kind of deployment on free loopback ports, in a
//! directory of its own that is removed when the deployment is dropped (also
//! when a test panics), and stops its processes by pid:
//!
//! - [`galera`]: a three-node MariaDB Galera cluster;
//! - [`pg_replica`]: a PostgreSQL primary with a streaming replica,
//!   asynchronous or synchronous, and its failover by promotion;
//! - [`jetstream`]: a three-node NATS JetStream cluster;
//! - [`redis_replica`]: a Redis master with a replica, and its failover by
//!   promotion;
//! - [`redis_sentinel`]: a Redis master with a replica watched by three
//!   sentinels, failing over by itself;
//! - [`redis_cluster`]: a Redis Cluster of three masters with a replica
//!   each, failing over by itself.
//!
//! The tests in `tests/` run the conformance suites and the attacks against
//! them; the long measured runs are the `deployments` binary's (see
//! `docs/deployments.md`). The guide to what each deployment guarantees is
//! `docs/deployments.md`.

pub mod galera;
pub mod jetstream;
pub mod pg_replica;
pub mod process;
pub mod redis_cluster;
pub mod redis_replica;
pub mod redis_sentinel;
