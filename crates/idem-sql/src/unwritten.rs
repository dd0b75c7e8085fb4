//! The keys a transaction claimed without writing their rows: where an
//! engine's claim only reads or locks (SQLite's write lock, MySQL's named
//! lock, PostgreSQL's one-write strategy), the record writes the row, and it
//! finds here what the claim decided.

use idem_core::ClaimRequest;

/// The keys a transaction claimed with no row written yet, each with what
/// its record writes (`T`: the token, and what else the engine needs).
#[derive(Debug)]
pub struct UnwrittenClaims<T> {
    claims: Vec<(ClaimedKey, T)>,
}

impl<T> Default for UnwrittenClaims<T> {
    fn default() -> Self {
        Self { claims: Vec::new() }
    }
}

/// A claimed key, owned.
#[derive(Debug)]
struct ClaimedKey {
    tenant: String,
    operation: String,
    key: String,
}

impl ClaimedKey {
    fn of(req: &ClaimRequest<'_>) -> Self {
        Self {
            tenant: req.scope.tenant().as_str().to_owned(),
            operation: req.scope.operation().as_str().to_owned(),
            key: req.key.as_str().to_owned(),
        }
    }

    fn is(&self, req: &ClaimRequest<'_>) -> bool {
        self.key == req.key.as_str()
            && self.operation == req.scope.operation().as_str()
            && self.tenant == req.scope.tenant().as_str()
    }
}

impl<T> UnwrittenClaims<T> {
    /// Notes a claim of `req`'s key, in place of any earlier one of it.
    pub fn hold(&mut self, req: &ClaimRequest<'_>, claim: T) {
        self.forget(req);
        self.claims.push((ClaimedKey::of(req), claim));
    }

    /// The claim of `req`'s key, if one is held.
    pub fn get(&self, req: &ClaimRequest<'_>) -> Option<&T> {
        self.claims.iter().find(|(key, _)| key.is(req)).map(|(_, claim)| claim)
    }

    /// Takes the claim of `req`'s key out, if one is held.
    pub fn take(&mut self, req: &ClaimRequest<'_>) -> Option<T> {
        let at = self.claims.iter().position(|(key, _)| key.is(req))?;
        Some(self.claims.swap_remove(at).1)
    }

    /// Forgets the claim of `req`'s key (its row is written).
    pub fn forget(&mut self, req: &ClaimRequest<'_>) {
        self.claims.retain(|(key, _)| !key.is(req));
    }

    /// How many claims are held.
    pub fn len(&self) -> usize {
        self.claims.len()
    }

    /// Whether no claim is held.
    pub fn is_empty(&self) -> bool {
        self.claims.is_empty()
    }
}
