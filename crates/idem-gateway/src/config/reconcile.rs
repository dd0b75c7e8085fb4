//! The reconcile requests that ask the upstream about a key held as an
//! unknown outcome (`[routes.reconcile]`, `[defaults.reconcile]`), checked
//! on their own, against their route, and against the upstream timeout.

use serde::Deserialize;

use super::routes::UnknownOutcome;
use super::{Config, ConfigError, Defaults, RouteConfig};

/// The request that asks the upstream whether a request held as an
/// unknown outcome was applied (`[routes.reconcile]`, or `[defaults.reconcile]`
/// for every route holding unknown outcomes without one of its own, and for
/// requests no route matches). Sent when a retry meets the held key, with
/// the retry's own headers (its credentials and `Idempotency-Key`) as a
/// forwarded request would carry them, without a body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileConfig {
    /// `GET` (default) or `HEAD`: asking must change nothing.
    #[serde(default = "default_reconcile_method")]
    pub method: String,
    /// The upstream path (and optional query) asked: `{name}` is the
    /// request's segment under the route's `{name}`, `{key}` the
    /// idempotency key, percent-encoded. In `[defaults]` only `{key}`.
    pub path: String,
    /// The statuses (2xx) that mean the request was applied: the answer
    /// (status, end-to-end headers but private ones, body) is recorded as
    /// the key's outcome and replayed.
    #[serde(default = "default_applied")]
    pub applied: Vec<u16>,
    /// The status recorded in place of the lookup's own for an applied
    /// request (2xx or 3xx: the status the original request would have
    /// had, as 201), with the lookup's headers and body.
    pub applied_status: Option<u16>,
    /// The statuses (4xx) that mean the request was not applied: the key is
    /// released and the retry is sent. Any other answer, an error or a
    /// timeout keeps the key held.
    #[serde(default = "default_not_applied")]
    pub not_applied: Vec<u16>,
    /// How long the upstream may take to answer, milliseconds.
    #[serde(default = "default_reconcile_timeout_ms")]
    pub timeout_ms: u64,
    /// How long after the held request was sent its "not applied" answer is
    /// trusted, milliseconds: the longest the upstream may still be working
    /// on a request whose caller gave up. Before it, a "not applied" keeps
    /// the key held (409 with `Retry-After`). Default: the upstream timeout
    /// plus 5 seconds. The lookup must answer "applied" for any request the
    /// upstream applied once this long has passed since it was sent.
    pub settle_ms: Option<u64>,
}

fn default_reconcile_method() -> String {
    "GET".into()
}

fn default_applied() -> Vec<u16> {
    vec![200]
}

fn default_not_applied() -> Vec<u16> {
    vec![404]
}

fn default_reconcile_timeout_ms() -> u64 {
    5_000
}

impl ReconcileConfig {
    /// Checks the request on its own and against the route's placeholders
    /// (`names`); `what` names the table in messages.
    pub(crate) fn check<'a>(
        &self,
        what: &str,
        names: impl Iterator<Item = &'a str> + Clone,
    ) -> Result<crate::reconcile::LookupTemplate, ConfigError> {
        let method = self.method.to_ascii_uppercase();
        if !matches!(method.as_str(), "GET" | "HEAD") {
            return Err(ConfigError(format!(
                "{what}.method {:?}: asking must change nothing and send no body; use GET or HEAD",
                self.method
            )));
        }
        if self.applied.is_empty() {
            return Err(ConfigError(format!("{what}.applied: name at least one status")));
        }
        for s in &self.applied {
            if !(200..=299).contains(s) {
                return Err(ConfigError(format!(
                    "{what}.applied: {s} is not a 2xx status; only a success says the request was applied"
                )));
            }
        }
        if let Some(s) = self.applied_status
            && !(200..=399).contains(&s)
        {
            return Err(ConfigError(format!(
                "{what}.applied_status: {s} would not be recorded; use a 2xx or 3xx status"
            )));
        }
        for s in &self.not_applied {
            if !(400..=499).contains(s) || matches!(s, 401 | 403 | 407 | 408 | 409 | 425 | 429) {
                return Err(ConfigError(format!(
                    "{what}.not_applied: {s} cannot mean \"not applied\" (only a 4xx that is not 401, 403, \
                     407, 408, 409, 425 or 429: those say the lookup was refused or could not be answered now)"
                )));
            }
        }
        if self.timeout_ms == 0 || self.timeout_ms > 600_000 {
            return Err(ConfigError(format!(
                "{what}.timeout_ms must be between 1 and 600000, not {}",
                self.timeout_ms
            )));
        }
        if self.settle_ms.is_some_and(|ms| ms > 86_400_000) {
            return Err(ConfigError(format!(
                "{what}.settle_ms must be at most 86400000 (a day), not {}",
                self.settle_ms.unwrap_or_default()
            )));
        }
        crate::reconcile::LookupTemplate::parse(&self.path, names)
            .map_err(|why| ConfigError(format!("{what}.path {:?}: {why}", self.path)))
    }
}

impl RouteConfig {
    /// The route's reconcile request over `defaults`, checked against its
    /// path: none when it releases unknown outcomes.
    pub(crate) fn reconcile<'a>(
        &'a self,
        d: &'a Defaults,
    ) -> Result<Option<(&'a ReconcileConfig, crate::reconcile::LookupTemplate)>, ConfigError> {
        let (_, template) = self.parsed()?;
        let holds = self.on_unknown_outcome.unwrap_or(d.on_unknown_outcome) == UnknownOutcome::Hold;
        if let Some(own) = &self.reconcile {
            let what = format!("route {} reconcile", self.name());
            if !holds {
                return Err(ConfigError(format!(
                    "{what}: the route releases unknown outcomes (on_unknown_outcome = \"release\"), so there \
                     is nothing to reconcile; remove one of them"
                )));
            }
            if own.path.contains("{key}") && template.names().any(|n| n == "key") {
                return Err(ConfigError(format!(
                    "{what}.path: {{key}} is the idempotency key, and the route's path has a segment of that name; \
                     rename the segment"
                )));
            }
            return Ok(Some((own, own.check(&what, template.names())?)));
        }
        match &d.reconcile {
            Some(inherited) if holds => Ok(Some((
                inherited,
                inherited.check("[defaults] reconcile", std::iter::empty())?,
            ))),
            _ => Ok(None),
        }
    }
}

impl Config {
    /// Checks the reconcile requests: the defaults' and each route's.
    pub(super) fn check_reconciles(&self) -> Result<(), ConfigError> {
        if let Some(d) = &self.defaults.reconcile {
            if self.defaults.on_unknown_outcome != UnknownOutcome::Hold {
                return Err(ConfigError(
                    "[defaults] reconcile: the defaults release unknown outcomes (on_unknown_outcome = \"release\"), \
                     so there is nothing to reconcile; remove one of them"
                        .into(),
                ));
            }
            d.check("[defaults] reconcile", std::iter::empty())?;
            self.check_settle("[defaults] reconcile", d)?;
        }
        for route in &self.routes {
            if let Some((rc, _)) = route.reconcile(&self.defaults)? {
                self.check_settle(&format!("route {} reconcile", route.name()), rc)?;
            }
        }
        Ok(())
    }

    /// A "not applied" must not be trusted while the upstream may still be
    /// working on the request: a settle time shorter than the upstream
    /// timeout would send a request again that is about to be applied.
    fn check_settle(&self, what: &str, rc: &ReconcileConfig) -> Result<(), ConfigError> {
        match rc.settle_ms {
            Some(ms) if u128::from(ms) < self.upstream_timeout().as_millis() => Err(ConfigError(format!(
                "{what}.settle_ms ({ms}) must be at least upstream_timeout_secs ({}) in milliseconds:                  the upstream may still apply a request that long after it was sent",
                self.upstream_timeout_secs
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{TENANT, valid};

    /// A reconcile request that cannot work is refused at start, naming the setting; a good one is kept.
    #[test]
    fn reconcile_requests_are_checked() {
        let route = |path: &str, reconcile: &str| {
            format!("{TENANT}[[routes]]\nmethod = \"POST\"\npath = \"{path}\"\n[routes.reconcile]\n{reconcile}\n")
        };
        let c = valid(&route(
            "/v1/payouts/{id}",
            "path = \"/v1/payouts/{id}/by-key/{key}?x={id}\"",
        ))
        .unwrap();
        let r = c.routes[0].reconcile.as_ref().unwrap();
        assert_eq!(
            (r.method.as_str(), r.applied.as_slice(), r.not_applied.as_slice()),
            ("GET", &[200][..], &[404][..])
        );
        assert!(
            valid(&format!(
                "{TENANT}[defaults.reconcile]\npath = \"/v1/keys/{{key}}\"\nmethod = \"head\"\n"
            ))
            .is_ok()
        );
        for (config, named) in [
            (
                route("/v1/p/{id}", "path = \"/v1/p/{nope}\""),
                "route POST /v1/p/{id} reconcile.path",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\nmethod = \"POST\""),
                "reconcile.method",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\napplied = [404]"),
                "reconcile.applied",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\napplied = []"),
                "reconcile.applied",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\napplied_status = 500"),
                "reconcile.applied_status",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\nnot_applied = [401]"),
                "reconcile.not_applied",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\nnot_applied = [200]"),
                "reconcile.not_applied",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\ntimeout_ms = 0"),
                "reconcile.timeout_ms",
            ),
            (route("/v1/p/{id}", "path = \"/v1/p/./{id}\""), "reconcile.path"),
            (route("/v1/p/{key}", "path = \"/v1/p/{key}\""), "rename the segment"),
            (
                format!(
                    "{TENANT}[[routes]]\nmethod = \"POST\"\npath = \"/v1/p/{{id}}\"\non_unknown_outcome = \"release\"\n\
                     [routes.reconcile]\npath = \"/v1/p/{{id}}\"\n"
                ),
                "nothing to reconcile",
            ),
            (
                format!("{TENANT}[defaults.reconcile]\npath = \"/v1/p/{{id}}\"\n"),
                "[defaults] reconcile.path",
            ),
            (
                format!(
                    "{TENANT}[defaults]\non_unknown_outcome = \"release\"\n[defaults.reconcile]\npath = \"/k/{{key}}\"\n"
                ),
                "[defaults] reconcile",
            ),
            (
                route("/v1/p/{id}", "path = \"/v1/p/{id}\"\nretries = 3"),
                "unknown field",
            ),
        ] {
            let e = Config::from_toml(&format!("upstream = \"http://127.0.0.1:9000\"\n{config}"))
                .and_then(|c| c.validate())
                .unwrap_err()
                .to_string();
            assert!(e.contains(named), "{config}\n{e}");
        }
    }
}
