//! Property tests of exact canonical JSON: generated values rendered with
//! random whitespace, member order, number spellings and string escapes.

use std::collections::BTreeMap;

use idem_core::{Fingerprint, Operation, canonical_json};
use proptest::prelude::*;

/// A JSON value as the canonical form should see it: numbers normalised to
/// (negative, significant digits, exponent), objects unordered.
#[derive(Debug, Clone, PartialEq, Eq)]
enum V {
    Null,
    Bool(bool),
    Num { negative: bool, digits: String, exp: i32 },
    Str(String),
    Arr(Vec<V>),
    Obj(BTreeMap<String, V>),
}

fn number(negative: bool, raw: String, exp: i32) -> V {
    let raw = raw.trim_start_matches('0');
    let trimmed = raw.trim_end_matches('0');
    if trimmed.is_empty() {
        return V::Num {
            negative: false,
            digits: "0".into(),
            exp: 0,
        };
    }
    V::Num {
        negative,
        digits: trimmed.to_owned(),
        exp: exp + (raw.len() - trimmed.len()) as i32,
    }
}

fn text() -> impl Strategy<Value = String> {
    let chars = prop::sample::select(vec!['a', 'b', '"', '\\', '/', '\n', '\u{1}', 'é', '😀', '\u{e000}']);
    prop::collection::vec(chars, 0..4).prop_map(|c| c.into_iter().collect())
}

fn value() -> impl Strategy<Value = V> {
    let leaf = prop_oneof![
        Just(V::Null),
        any::<bool>().prop_map(V::Bool),
        (any::<bool>(), "[0-9]{1,3}", -3i32..4).prop_map(|(n, d, e)| number(n, d, e)),
        (any::<bool>(), "[1-9][0-9]{15,25}", -400i32..400).prop_map(|(n, d, e)| number(n, d, e)),
        text().prop_map(V::Str),
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(V::Arr),
            prop::collection::btree_map(text(), inner, 0..4).prop_map(V::Obj),
        ]
    })
}

/// A small deterministic generator for rendering choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn ws(&mut self, out: &mut String) {
        for _ in 0..self.below(3) {
            out.push([' ', '\n', '\t', '\r'][self.below(4) as usize]);
        }
    }
}

fn render_str(s: &str, rng: &mut Rng, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        let must = c == '"' || c == '\\' || (c as u32) < 0x20;
        if !must && rng.below(3) > 0 {
            out.push(c);
            continue;
        }
        match (c, rng.below(2)) {
            ('"', 0) => out.push_str("\\\""),
            ('\\', 0) => out.push_str("\\\\"),
            ('/', 0) => out.push_str("\\/"),
            ('\n', 0) => out.push_str("\\n"),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    if rng.below(2) == 0 {
                        out.push_str(&format!("\\u{:04x}", u));
                    } else {
                        out.push_str(&format!("\\u{:04X}", u));
                    }
                }
            }
        }
    }
    out.push('"');
}

fn render_num(negative: bool, digits: &str, exp: i32, rng: &mut Rng, out: &mut String) {
    if digits == "0" {
        out.push_str(["0", "-0", "0.0", "0e5", "-0.000E-3", "0E+0"][rng.below(6) as usize]);
        return;
    }
    if negative {
        out.push('-');
    }
    // Pad with trailing zeros, then place the decimal point anywhere.
    let pad = rng.below(3) as usize;
    let d = format!("{digits}{}", "0".repeat(pad));
    let mut e = i64::from(exp) - pad as i64;
    let point = rng.below(d.len() as u64 + 1) as usize;
    let (int, frac) = d.split_at(point);
    if int.is_empty() {
        let zeros = "0".repeat(rng.below(3) as usize);
        out.push_str("0.");
        out.push_str(&zeros);
        out.push_str(frac);
        e += (zeros.len() + frac.len()) as i64;
    } else {
        out.push_str(int);
        if !frac.is_empty() {
            out.push('.');
            out.push_str(frac);
            e += frac.len() as i64;
        }
    }
    if e != 0 || rng.below(3) == 0 {
        out.push(if rng.below(2) == 0 { 'e' } else { 'E' });
        if e >= 0 && rng.below(2) == 0 {
            out.push('+');
        }
        out.push_str(&e.to_string());
    }
}

fn render(v: &V, rng: &mut Rng, out: &mut String) {
    rng.ws(out);
    match v {
        V::Null => out.push_str("null"),
        V::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        V::Num { negative, digits, exp } => render_num(*negative, digits, *exp, rng, out),
        V::Str(s) => render_str(s, rng, out),
        V::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                render(item, rng, out);
            }
            rng.ws(out);
            out.push(']');
        }
        V::Obj(members) => {
            let mut members: Vec<_> = members.iter().collect();
            for i in (1..members.len()).rev() {
                members.swap(i, rng.below(i as u64 + 1) as usize);
            }
            out.push('{');
            for (i, (name, value)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                rng.ws(out);
                render_str(name, rng, out);
                rng.ws(out);
                out.push(':');
                render(value, rng, out);
            }
            rng.ws(out);
            out.push('}');
        }
    }
    rng.ws(out);
}

fn rendered(v: &V, seed: u64) -> String {
    let mut out = String::new();
    render(v, &mut Rng(seed | 1), &mut out);
    out
}

/// A pair of values: the same value twice, or two independent ones.
fn pair() -> impl Strategy<Value = (V, V)> {
    prop_oneof![value().prop_map(|v| (v.clone(), v)), (value(), value()),]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    // Two renderings have equal canonical forms iff they denote equal values,
    // and equal fingerprints iff equal canonical forms.
    #[test]
    fn equal_fingerprints_iff_equal_canonical_forms((a, b) in pair(), sa in any::<u64>(), sb in any::<u64>()) {
        let (ra, rb) = (rendered(&a, sa), rendered(&b, sb));
        let ca = canonical_json(ra.as_bytes()).map_err(|e| TestCaseError::fail(format!("{ra:?}: {e}")))?;
        let cb = canonical_json(rb.as_bytes()).map_err(|e| TestCaseError::fail(format!("{rb:?}: {e}")))?;
        prop_assert_eq!(ca == cb, a == b, "{} vs {}", ra, rb);
        // The canonical form is JSON text, and its own canonical form.
        prop_assert_eq!(&canonical_json(&ca).unwrap(), &ca);
        let op = Operation::new("POST /p").unwrap();
        let fa = Fingerprint::of_json(&op, ra.as_bytes()).unwrap();
        let fb = Fingerprint::of_json(&op, rb.as_bytes()).unwrap();
        prop_assert_eq!(fa == fb, ca == cb);
    }
}
