//! Credentials out of text before it is printed or logged.
//!
//! Store URLs carry passwords (`postgres://app:secret@db/app`,
//! `redis://:secret@cache`, `…?password=secret`), and so do the errors and
//! log lines that name them. Every place that prints or logs a URL, or an
//! error that may contain one, passes it through [`redact_credentials`]
//! first. The function works on text, not on parsed URLs, so a URL that does
//! not parse (the usual reason it is being printed) is redacted too.

/// Replaces what stands in for it.
const MASK: &str = "***";

/// Parameter names (lowercased) whose values are secrets: any name that
/// contains one of these (`password`, `sslpassword`, `auth_token`,
/// `api_key`, `client_secret`…).
const SECRET_NAMES: &[&str] = &["pass", "pwd", "secret", "token", "key", "auth", "credential", "sig"];

/// `text` with every credential it holds replaced by `***`:
///
/// - the password of each `scheme://user:password@host…` (the user name
///   stays, so the message still says who connected);
/// - the value of each `name=value` pair (in a query string or free text)
///   whose name says it is a secret (see the list above).
///
/// The end of a URL's credentials is its last `@` before the next space,
/// quote or URL, so a password holding `@`, `/` or `:` unescaped is
/// masked whole. When in doubt it masks more than less.
///
/// ```
/// use idem_core::redact_credentials;
/// assert_eq!(
///     redact_credentials("store postgres://app:s3cret@db:5432/app: connection refused"),
///     "store postgres://app:***@db:5432/app: connection refused"
/// );
/// assert_eq!(redact_credentials("redis://:s3cret@cache:6379/0"), "redis://:***@cache:6379/0");
/// assert_eq!(
///     redact_credentials("postgres://db/app?user=app&password=s3cret"),
///     "postgres://db/app?user=app&password=***"
/// );
/// ```
pub fn redact_credentials(text: &str) -> String {
    redact_pairs(&redact_userinfo(text))
}

/// The password of one URL given whole (a command-line argument, an
/// environment variable): what follows the first `:` of its user part.
/// Unlike free text, a URL given whole has known ends, so a password
/// holding spaces, quotes, `<`, `>` or backticks is found whole. The user
/// part ends at the last `@` of the URL, or at the last `@` before its path
/// or query (a password holding `@`, or a query holding one): both
/// readings are answered, longest first. Empty without one.
///
/// ```
/// use idem_core::url_passwords;
/// assert_eq!(url_passwords("postgres://app:pa ss\"w@db/app"), vec!["pa ss\"w"]);
/// assert_eq!(url_passwords("redis://:s3cret@cache:6379"), vec!["s3cret"]);
/// assert_eq!(
///     url_passwords("postgres://app:pw@db/app?application_name=a@b"),
///     vec!["pw@db/app?application_name=a", "pw"]
/// );
/// assert!(url_passwords("postgres://app@db/app").is_empty());
/// assert!(url_passwords("./idem.db").is_empty());
/// ```
pub fn url_passwords(url: &str) -> Vec<&str> {
    let Some((_, rest)) = url.split_once("://") else {
        return Vec::new();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let mut found = Vec::new();
    for userinfo in [
        rest.rsplit_once('@').map(|(u, _)| u),
        rest[..authority_end].rsplit_once('@').map(|(u, _)| u),
    ]
    .into_iter()
    .flatten()
    {
        if let Some((_, password)) = userinfo.split_once(':')
            && !password.is_empty()
            && !found.contains(&password)
        {
            found.push(password);
        }
    }
    found.sort_by_key(|p| std::cmp::Reverse(p.len()));
    found
}

/// [`redact_credentials`], and besides every occurrence of each of
/// `secrets` (passwords known from where they were given, as
/// [`url_passwords`] finds them) masked: as written, percent-decoded, and
/// escaped as `{:?}` and JSON print it (`\"`, `\\`), longest first so a
/// password that begins another is never left half-masked.
///
/// ```
/// use idem_core::redact_known;
/// let url = "postgres://app:pa ss@db/app";
/// let secrets = idem_core::url_passwords(url);
/// let out = redact_known(&format!("store {url}: refused"), &secrets);
/// assert!(!out.contains("pa ss"));
/// ```
pub fn redact_known(text: &str, secrets: &[&str]) -> String {
    let mut forms: Vec<String> = Vec::new();
    for secret in secrets.iter().filter(|s| !s.is_empty()) {
        // As `{:?}` prints it, without its quotes (JSON escapes printable
        // text the same way).
        let debug = format!("{secret:?}");
        let escaped = debug[1..debug.len() - 1].to_owned();
        for form in [Some(secret.to_string()), percent_decoded(secret), Some(escaped)]
            .into_iter()
            .flatten()
        {
            if !form.is_empty() && form != MASK && !forms.contains(&form) {
                forms.push(form);
            }
        }
    }
    forms.sort_by_key(|f| std::cmp::Reverse(f.len()));
    let mut out = text.to_owned();
    for form in &forms {
        out = out.replace(form.as_str(), MASK);
    }
    redact_credentials(&out)
}

/// `%XX` escapes decoded, if there are any and the result is text.
fn percent_decoded(s: &str) -> Option<String> {
    if !s.contains('%') {
        return None;
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn is_scheme_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'+' | b'.' | b'-')
}

fn ends_token(b: u8) -> bool {
    b.is_ascii_whitespace() || matches!(b, b'"' | b'\'' | b'`' | b'<' | b'>')
}

/// Masks the password of every `scheme://user:password@` in `text`.
fn redact_userinfo(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut search = 0;
    while let Some(found) = text[search..].find("://") {
        let start = search + found + 3;
        // The URL's text runs to the next space or quote, or to the start
        // of the next URL (a comma-separated list of cluster nodes).
        let mut end = start;
        while end < bytes.len() && !ends_token(bytes[end]) {
            if bytes[end..].starts_with(b"://") {
                let mut scheme = end;
                while scheme > start && is_scheme_char(bytes[scheme - 1]) {
                    scheme -= 1;
                }
                end = scheme;
                break;
            }
            end += 1;
        }
        if let Some(at) = text[start..end].rfind('@') {
            let userinfo = &text[start..start + at];
            if let Some(colon) = userinfo.find(':') {
                out.push_str(&text[copied..start + colon + 1]);
                out.push_str(MASK);
                copied = start + at;
            }
        }
        search = end.max(start);
    }
    out.push_str(&text[copied..]);
    out
}

/// Masks the value of every `name=value` whose name says secret.
fn redact_pairs(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'=' {
            i += 1;
            continue;
        }
        let mut name_start = i;
        while name_start > 0
            && (bytes[name_start - 1].is_ascii_alphanumeric() || matches!(bytes[name_start - 1], b'_' | b'-' | b'.'))
        {
            name_start -= 1;
        }
        let name = text[name_start..i].to_ascii_lowercase();
        let value_start = i + 1;
        let mut value_end = value_start;
        while value_end < bytes.len()
            && !ends_token(bytes[value_end])
            && !matches!(bytes[value_end], b'&' | b';' | b',')
        {
            value_end += 1;
        }
        // A value masked already stays as it is (redacting twice changes nothing).
        let masked = text[value_start..value_end].starts_with(MASK);
        if !name.is_empty() && value_end > value_start && !masked && SECRET_NAMES.iter().any(|s| name.contains(s)) {
            out.push_str(&text[copied..value_start]);
            out.push_str(MASK);
            copied = value_end;
        }
        i = value_end.max(i + 1);
    }
    out.push_str(&text[copied..]);
    out
}

/// `text` cut to at most `max` bytes, at a character boundary (the longest
/// prefix that fits).
pub fn cut_at_char_boundary(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::redact_credentials as r;
    use proptest::prelude::*;

    proptest! {
        /// Whatever printable characters a password holds (spaces, quotes,
        /// `<`, `>`, backticks, `@`, `/`, `%`…), a message naming its URL,
        /// as written or quoted, never shows it once redacted with the
        /// password its URL was given with.
        #[test]
        fn a_known_password_never_survives(password in "[ -~]{1,24}", user in "[a-z]{0,8}") {
            let url = format!("postgres://{user}:{password}@127.0.0.1:1/db");
            let secrets = super::url_passwords(&url);
            prop_assert!(secrets.contains(&password.as_str()), "{:?}", secrets);
            let debug = format!("{password:?}");
            let escaped = debug[1..debug.len() - 1].to_owned();
            let json = serde_json::to_string(&password).unwrap();
            let json = &json[1..json.len() - 1];
            for message in [
                format!("store {url}: connection refused"),
                format!("store {url:?}: invalid"),
                serde_json::json!({ "error": format!("store {url}: refused") }).to_string(),
            ] {
                let out = super::redact_known(&message, &secrets).replace(super::MASK, "\u{0}");
                for form in [password.as_str(), escaped.as_str(), json] {
                    prop_assert!(!out.contains(form), "{:?} in {} -> {}", form, message, out);
                }
            }
        }
    }

    /// Every form of URL credentials is masked, and the rest of the text
    /// (user names, hosts, paths, other parameters) survives.
    #[test]
    fn url_credentials_are_masked() {
        let cases = [
            ("postgres://app:pw@db:5432/app", "postgres://app:***@db:5432/app"),
            (
                "postgresql://app:pw@db/app?sslmode=require",
                "postgresql://app:***@db/app?sslmode=require",
            ),
            (
                "mysql://root:pw@127.0.0.1:3306/test",
                "mysql://root:***@127.0.0.1:3306/test",
            ),
            ("mariadb://root:pw@db/test", "mariadb://root:***@db/test"),
            ("redis://:pw@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
            ("rediss://default:pw@cache:6380", "rediss://default:***@cache:6380"),
            (
                "postgres://db/app?user=app&password=pw",
                "postgres://db/app?user=app&password=***",
            ),
            (
                "mysql://db/app?ssl-mode=REQUIRED&sslpassword=pw",
                "mysql://db/app?ssl-mode=REQUIRED&sslpassword=***",
            ),
            (
                "postgres://postgres@127.0.0.1:5432/test",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("./idem-gateway.db", "./idem-gateway.db"),
        ];
        for (url, want) in cases {
            assert_eq!(r(url), want, "{url}");
        }
    }

    /// Two known passwords, one the start of the other: the longer is
    /// masked whole, never left half-shown.
    #[test]
    fn the_longest_known_password_is_masked_first() {
        let out = super::redact_known("password secret123 rejected", &["secret", "secret123"]);
        assert_eq!(out, "password *** rejected");
    }

    /// URLs that do not parse are masked too: passwords holding `@`, `/`,
    /// `:` or `?`, broken hosts, a password-only user part.
    #[test]
    fn broken_urls_are_masked() {
        for url in [
            "postgres://app:p@ss@db/app",
            "postgres://app:pa/ss@db/app",
            "postgres://app:pa:ss@db/app",
            "postgres://app:pa?ss@@bad host:port/db",
            "redis://:pw@[::1",
            "rediss://:pw@héllo:6379",
        ] {
            let out = r(url);
            assert!(
                !out.contains("pw")
                    && !out.contains("p@ss")
                    && !out.contains("pa/ss")
                    && !out.contains("pa:ss")
                    && !out.contains("pa?ss"),
                "{url} -> {out}"
            );
            assert!(out.contains("***"), "{url} -> {out}");
        }
    }

    /// URLs inside messages, quoted (`{:?}`), and several in a row (the
    /// seed nodes of a cluster) are each masked.
    #[test]
    fn urls_inside_text_are_masked() {
        assert_eq!(
            r(r#"Redis URL "redis://:pw@h:1": invalid"#),
            r#"Redis URL "redis://:***@h:1": invalid"#
        );
        assert_eq!(
            r("redis://:a@h1:7000,redis://:b@h2:7001,redis://u:c@h3:7002"),
            "redis://:***@h1:7000,redis://:***@h2:7001,redis://u:***@h3:7002"
        );
        assert_eq!(
            r("store error: password=pw host=db"),
            "store error: password=*** host=db"
        );
        assert_eq!(r("a=b c=d"), "a=b c=d");
        assert_eq!(r("token=abc&x=1 API_KEY=k"), "token=***&x=1 API_KEY=***");
        assert_eq!(r(""), "");
        // A value runs to the next space: what follows it unspaced is
        // masked with it (a password may end in any character).
        let once = r("store postgres://h/db?password=pw: refused");
        assert_eq!(once, "store postgres://h/db?password=*** refused");
        let once = r("store postgres://h/db?password=***: refused");
        assert_eq!(once, "store postgres://h/db?password=***: refused");
        assert_eq!(r(&once), once, "redacting twice changes nothing");
        assert_eq!(r("://@:"), "://@:");
    }
}
