//! SQLite (embedded; WAL and BEGIN IMMEDIATE) store for idem.
