//! idem: exactly-once effects for Rust services.

pub use idem_core::*;
