//! MySQL and MariaDB store for idem.
