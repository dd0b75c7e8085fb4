//! Validated SQL table names, so a configurable name can never inject SQL.

use std::fmt;

use crate::error::{Error, Result};

/// A table name safe to splice into SQL: an ASCII letter or `_`, then up to
/// 62 ASCII letters, digits or `_` (the common limit of PostgreSQL, MySQL and
/// SQLite identifiers).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TableName(String);

impl TableName {
    /// The default name of the keys table.
    pub const DEFAULT: &'static str = "idem_keys";

    /// Validates and wraps a table name.
    ///
    /// ```
    /// use idem_core::TableName;
    /// assert!(TableName::new("payments_keys").is_ok());
    /// assert!(TableName::new("keys; DROP TABLE users").is_err());
    /// ```
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let mut chars = name.chars();
        let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !first_ok || !rest_ok || name.len() > 63 {
            return Err(Error::Config(format!(
                "table name {name:?} must match [A-Za-z_][A-Za-z0-9_]{{0,62}}"
            )));
        }
        Ok(Self(name))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self(Self::DEFAULT.to_owned())
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TableName").field(&self.0).finish()
    }
}
