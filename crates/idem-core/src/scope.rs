//! Scopes: the (tenant, operation) namespace a key lives in.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

/// The longest tenant or operation name accepted, in bytes.
pub const MAX_NAME_LEN: usize = 255;

fn validate(what: &str, s: &str) -> Result<()> {
    if s.is_empty() {
        return Err(Error::InvalidScope(format!("{what} is empty")));
    }
    if s.len() > MAX_NAME_LEN {
        return Err(Error::InvalidScope(format!(
            "{what} is {} bytes long; at most {MAX_NAME_LEN} are allowed",
            s.len()
        )));
    }
    if s.chars().any(char::is_control) {
        return Err(Error::InvalidScope(format!("{what} contains a control character")));
    }
    Ok(())
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            /// Validates (1 to 255 bytes, no control characters) and wraps the name.
            pub fn new(name: impl AsRef<str>) -> Result<Self> {
                let name = name.as_ref();
                validate($what, name)?;
                Ok(Self(Arc::from(name)))
            }

            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_tuple(stringify!($name)).field(&&*self.0).finish()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

name_type!(
    /// Who the key belongs to: a tenant, account or authenticated principal.
    Tenant,
    "tenant"
);
name_type!(
    /// What the key is for: an operation name such as `POST /v1/transfers`
    /// or `event:order.placed.v1`.
    Operation,
    "operation"
);

impl Operation {
    /// The operation's name as a metric label value, sharing the name
    /// rather than copying it.
    pub fn metric_label(&self) -> metrics::SharedString {
        metrics::SharedString::from(self.0.clone())
    }
}

/// The namespace of a key: the same key under two scopes is two independent
/// keys. Every store looks keys up by (tenant, operation, key) together, so a
/// record of one tenant can never be found by another.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Scope {
    tenant: Tenant,
    operation: Operation,
}

impl Scope {
    /// Builds a scope from validated parts.
    pub fn new(tenant: Tenant, operation: Operation) -> Self {
        Self { tenant, operation }
    }

    /// Validates both names and builds a scope.
    ///
    /// ```
    /// let scope = idem_core::Scope::parse("tenant-1", "POST /v1/transfers")?;
    /// assert_eq!(scope.operation().as_str(), "POST /v1/transfers");
    /// # Ok::<(), idem_core::Error>(())
    /// ```
    pub fn parse(tenant: &str, operation: &str) -> Result<Self> {
        Ok(Self::new(Tenant::new(tenant)?, Operation::new(operation)?))
    }

    /// The tenant.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// The operation.
    pub fn operation(&self) -> &Operation {
        &self.operation
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.tenant, self.operation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(Tenant::new("").is_err());
        assert!(Tenant::new("x".repeat(256)).is_err());
        assert!(Operation::new("POST /v1/x\n").is_err());
        assert!(Scope::parse("t", "op").is_ok());
    }
}
