//! The SQL dialects and the statements of one, prepared once per engine.

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use super::{accounts, payouts, schema, statements, withdrawals};

/// SQL dialects, for the few places where they differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// PostgreSQL: `$n` placeholders.
    Postgres,
    /// MySQL/MariaDB.
    MySql,
    /// SQLite.
    Sqlite,
}

impl Dialect {
    /// Rewrites `?` placeholders for this dialect.
    pub(super) fn prepare(self, sql: &str) -> SqlStr {
        let sql = match self {
            Dialect::Postgres => {
                let mut out = String::with_capacity(sql.len() + 8);
                let mut n = 0;
                for c in sql.chars() {
                    if c == '?' {
                        n += 1;
                        out.push('$');
                        out.push_str(&n.to_string());
                    } else {
                        out.push(c);
                    }
                }
                out
            }
            Dialect::MySql | Dialect::Sqlite => sql.to_owned(),
        };
        // Every statement is a constant of this module's siblings with bind
        // parameters; nothing user-supplied is spliced in.
        AssertSqlSafe(sql).into_sql_str()
    }

    /// `SUM(expr)` as a 64-bit integer, 0 over no rows.
    pub(super) fn sum(self, expr: &str) -> String {
        match self {
            Dialect::Postgres => format!("CAST(COALESCE(SUM({expr}), 0) AS BIGINT)"),
            Dialect::MySql => format!("CAST(COALESCE(SUM({expr}), 0) AS SIGNED)"),
            Dialect::Sqlite => format!("COALESCE(SUM({expr}), 0)"),
        }
    }

    /// Begins a read-only transaction on one consistent snapshot.
    pub(super) fn snapshot(self) -> &'static str {
        match self {
            Dialect::Postgres => "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
            Dialect::MySql => "START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY",
            Dialect::Sqlite => "BEGIN DEFERRED",
        }
    }
}

/// Declares a module's statements, each named once: `struct Sql` with one
/// [`SqlStr`] a statement, and `Sql::new(dialect)` preparing each for
/// `dialect`, where `p` rewrites a text's `?` placeholders
/// ([`Dialect::prepare`]).
macro_rules! sql_statements {
    ($(#[$doc:meta])* |$dialect:ident, $p:ident| {
        $($(#[$field_doc:meta])* $name:ident: $sql:expr),* $(,)?
    }) => {
        $(#[$doc])*
        pub(super) struct Sql {
            $($(#[$field_doc])* pub(super) $name: sqlx::SqlStr,)*
        }

        impl Sql {
            pub(super) fn new($dialect: Dialect) -> Self {
                let $p = |s: &str| $dialect.prepare(s);
                Self { $($name: $sql,)* }
            }
        }
    };
}
pub(super) use sql_statements;

/// The prepared statements of one dialect.
pub struct Queries {
    pub(super) dialect: Dialect,
    pub(super) accounts: accounts::Sql,
    pub(super) statements: statements::Sql,
    pub(super) payouts: payouts::Sql,
    pub(super) withdrawals: withdrawals::Sql,
    pub(super) schema: schema::Sql,
}

impl Queries {
    /// Prepares every statement for `dialect`.
    pub fn new(dialect: Dialect) -> Self {
        Self {
            dialect,
            accounts: accounts::Sql::new(dialect),
            statements: statements::Sql::new(dialect),
            payouts: payouts::Sql::new(dialect),
            withdrawals: withdrawals::Sql::new(dialect),
            schema: schema::Sql::new(dialect),
        }
    }
}
