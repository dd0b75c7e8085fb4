//! An exact canonical form of JSON text, the input of version 2 fingerprints.
//!
//! Two JSON documents have the same canonical form if and only if they
//! denote the same value under these rules:
//!
//! - Insignificant whitespace is dropped.
//! - Object members are sorted by name, comparing names as sequences of
//!   UTF-16 code units after unescaping (the order of RFC 8785). Two members
//!   with the same unescaped name make the document not canonicalisable.
//! - Strings are unescaped and re-emitted with one escaping: `\"`, `\\`,
//!   `\b`, `\f`, `\n`, `\r`, `\t`, other control characters as `\u00xx`,
//!   everything else as UTF-8. Lone surrogates are refused.
//! - Numbers are exact decimals, never rounded through a binary float: the
//!   sign, the significant digits without leading or trailing zeros and a
//!   decimal exponent. So `1`, `1.0`, `1e0` and `10e-1` are one number, `-0`
//!   is `0`, but `9007199254740993` differs from `9007199254740992` and
//!   `0.30000000000000001` from `0.3`.
//! - Array order is significant; `true`, `false` and `null` are themselves.
//!
//! The parser is iterative, nests at most [`MAX_DEPTH`] arrays and objects,
//! keeps memory proportional to the input, and bounds an exponent to
//! [`MAX_EXPONENT_DIGITS`] significant digits.

use std::borrow::Cow;
use std::fmt;
use std::io::Write as _;
use std::ops::Range;

/// How deeply arrays and objects may nest.
pub const MAX_DEPTH: usize = 128;

/// How many significant digits a number's exponent may have.
pub const MAX_EXPONENT_DIGITS: usize = 18;

/// Why a document has no canonical form.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CanonicalError {
    /// The input is not JSON text; `offset` is the byte where it went wrong.
    Syntax {
        /// Byte offset of the error.
        offset: usize,
    },
    /// An object has two members with the same (unescaped) name.
    DuplicateName,
    /// Arrays and objects nest deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A number's exponent has more than [`MAX_EXPONENT_DIGITS`] significant digits.
    ExponentTooLarge,
    /// A string contains an unpaired UTF-16 surrogate escape.
    LoneSurrogate,
}

impl fmt::Display for CanonicalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Syntax { offset } => write!(f, "not valid JSON at byte {offset}"),
            Self::DuplicateName => f.write_str("an object has two members with the same name"),
            Self::TooDeep => write!(f, "arrays and objects nest deeper than {MAX_DEPTH}"),
            Self::ExponentTooLarge => write!(f, "a number's exponent has more than {MAX_EXPONENT_DIGITS} digits"),
            Self::LoneSurrogate => f.write_str("a string contains an unpaired surrogate"),
        }
    }
}

impl std::error::Error for CanonicalError {}

/// The canonical form of the JSON text `json` (see the module docs).
///
/// ```
/// use idem_core::canonical_json;
/// assert_eq!(canonical_json(br#"{ "b": 10e-1, "a": "\u0041" }"#)?, br#"{"a":"A","b":1}"#);
/// # Ok::<(), idem_core::CanonicalError>(())
/// ```
pub fn canonical_json(json: &[u8]) -> Result<Vec<u8>, CanonicalError> {
    Parser {
        input: json,
        pos: 0,
        digits: Vec::new(),
    }
    .document()
}

/// An object's members: each name, and the range of its value's canonical
/// form in the object's buffer.
type Members<'a> = Vec<(Cow<'a, str>, Range<usize>)>;

/// An open object: its members' canonical values side by side in `buf`,
/// each named with its range there, sorted when the object closes.
struct Object<'a> {
    buf: Vec<u8>,
    members: Members<'a>,
    /// The name of the member being parsed, and where its value starts.
    name: Cow<'a, str>,
    start: usize,
}

/// What is open, innermost last. An array keeps no buffer of its own: its
/// elements keep their order, so they are written straight into the
/// innermost open object's buffer (or the output).
#[derive(Clone, Copy)]
enum Open {
    Array,
    Object,
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    /// Scratch space for a number's digits, reused.
    digits: Vec<u8>,
}

impl<'a> Parser<'a> {
    fn err(&self) -> CanonicalError {
        CanonicalError::Syntax { offset: self.pos }
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.input.get(self.pos) {
            self.pos += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn expect(&mut self, byte: u8) -> Result<(), CanonicalError> {
        self.skip_ws();
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.err())
        }
    }

    /// Steps over the opening bracket of an array or object nested in
    /// `depth` others, and answers whether it is empty: `close` follows at
    /// once (and is stepped over too).
    fn enter(&mut self, depth: usize, close: u8) -> Result<bool, CanonicalError> {
        self.pos += 1;
        if depth >= MAX_DEPTH {
            return Err(CanonicalError::TooDeep);
        }
        self.skip_ws();
        let empty = self.peek() == Some(close);
        if empty {
            self.pos += 1;
        }
        Ok(empty)
    }

    fn document(mut self) -> Result<Vec<u8>, CanonicalError> {
        // Each value is written once where it ends up, except an object's
        // members, which are copied once more when the object is sorted.
        // Buffers of closed objects are kept for the next ones.
        let mut out = Vec::with_capacity(self.input.len());
        let mut open: Vec<Open> = Vec::new();
        let mut objects: Vec<Object<'a>> = Vec::new();
        let mut spare: Vec<(Vec<u8>, Members<'a>)> = Vec::new();
        'value: loop {
            // Parse one value into the innermost object's buffer (or the
            // output); containers open and parse their first element on the
            // next turn of the loop.
            self.skip_ws();
            let sink = match objects.last_mut() {
                Some(object) => &mut object.buf,
                None => &mut out,
            };
            match self.peek() {
                Some(b'[') => {
                    if self.enter(open.len(), b']')? {
                        sink.extend_from_slice(b"[]");
                    } else {
                        sink.push(b'[');
                        open.push(Open::Array);
                        continue 'value;
                    }
                }
                Some(b'{') => {
                    if self.enter(open.len(), b'}')? {
                        sink.extend_from_slice(b"{}");
                    } else {
                        let name = self.name()?;
                        let (mut buf, members) = spare.pop().unwrap_or_default();
                        buf.clear();
                        objects.push(Object {
                            buf,
                            members,
                            name,
                            start: 0,
                        });
                        open.push(Open::Object);
                        continue 'value;
                    }
                }
                Some(b'"') => {
                    let s = self.string()?;
                    write_parsed(sink, &s);
                }
                Some(b'-' | b'0'..=b'9') => self.number(sink)?,
                Some(b't') => self.literal(b"true", sink)?,
                Some(b'f') => self.literal(b"false", sink)?,
                Some(b'n') => self.literal(b"null", sink)?,
                _ => return Err(self.err()),
            }
            // The value is written: hand it to its container, closing
            // containers as long as their closing bracket follows.
            loop {
                let Some(&top) = open.last() else {
                    self.skip_ws();
                    if self.pos != self.input.len() {
                        return Err(self.err());
                    }
                    return Ok(out);
                };
                self.skip_ws();
                let next = self.peek();
                if next.is_some() {
                    self.pos += 1;
                }
                match top {
                    Open::Array => {
                        let sink = match objects.last_mut() {
                            Some(object) => &mut object.buf,
                            None => &mut out,
                        };
                        match next {
                            Some(b',') => {
                                sink.push(b',');
                                continue 'value;
                            }
                            Some(b']') => {
                                sink.push(b']');
                                open.pop();
                            }
                            _ => {
                                return Err(CanonicalError::Syntax {
                                    offset: self.pos.saturating_sub(1),
                                });
                            }
                        }
                    }
                    Open::Object => {
                        let object = objects.last_mut().expect("an open object has its buffer");
                        let name = std::mem::take(&mut object.name);
                        object.members.push((name, object.start..object.buf.len()));
                        match next {
                            Some(b',') => {
                                self.skip_ws();
                                object.name = self.name()?;
                                object.start = object.buf.len();
                                continue 'value;
                            }
                            Some(b'}') => {
                                open.pop();
                                let mut closed = objects.pop().expect("an open object has its buffer");
                                let sink = match objects.last_mut() {
                                    Some(object) => &mut object.buf,
                                    None => &mut out,
                                };
                                close_object(&mut closed.members, &closed.buf, sink)?;
                                closed.members.clear();
                                spare.push((closed.buf, closed.members));
                            }
                            _ => {
                                return Err(CanonicalError::Syntax {
                                    offset: self.pos.saturating_sub(1),
                                });
                            }
                        }
                    }
                }
            }
        }
    }

    /// A member name and its colon.
    fn name(&mut self) -> Result<Cow<'a, str>, CanonicalError> {
        self.skip_ws();
        if self.peek() != Some(b'"') {
            return Err(self.err());
        }
        let name = self.string()?;
        self.expect(b':')?;
        Ok(name)
    }

    fn literal(&mut self, word: &'static [u8], out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        if self.input[self.pos..].starts_with(word) {
            self.pos += word.len();
            out.extend_from_slice(word);
            Ok(())
        } else {
            Err(self.err())
        }
    }

    fn hex4(&mut self) -> Result<u16, CanonicalError> {
        let digits = self.input.get(self.pos..self.pos + 4).ok_or_else(|| self.err())?;
        let mut v: u16 = 0;
        for &d in digits {
            let n = (d as char).to_digit(16).ok_or_else(|| self.err())?;
            v = v * 16 + n as u16;
        }
        self.pos += 4;
        Ok(v)
    }

    /// An unescaped string; `self.pos` is at its opening quote. Borrowed
    /// from the input when it has no escapes, and then it holds nothing the
    /// canonical form escapes either (see [`write_parsed`]).
    fn string(&mut self) -> Result<Cow<'a, str>, CanonicalError> {
        let input = self.input;
        self.pos += 1;
        let mut out: Option<String> = None;
        loop {
            let start = self.pos;
            self.pos += input[start..]
                .iter()
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
                .unwrap_or(input.len() - start);
            let run = std::str::from_utf8(&input[start..self.pos]).map_err(|e| CanonicalError::Syntax {
                offset: start + e.valid_up_to(),
            })?;
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(match out {
                        None => Cow::Borrowed(run),
                        Some(mut out) => {
                            out.push_str(run);
                            Cow::Owned(out)
                        }
                    });
                }
                Some(b'\\') => {
                    let out = out.get_or_insert_with(String::new);
                    out.push_str(run);
                    self.pos += 1;
                    let escape = self.peek().ok_or_else(|| self.err())?;
                    self.pos += 1;
                    let c = match escape {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode_escape()?,
                        _ => return Err(CanonicalError::Syntax { offset: self.pos - 1 }),
                    };
                    out.push(c);
                }
                _ => return Err(self.err()),
            }
        }
    }

    /// The character of a `\u` escape (and its low surrogate, if any).
    fn unicode_escape(&mut self) -> Result<char, CanonicalError> {
        let high = self.hex4()?;
        if (0xDC00..0xE000).contains(&high) {
            return Err(CanonicalError::LoneSurrogate);
        }
        if !(0xD800..0xDC00).contains(&high) {
            return char::from_u32(u32::from(high)).ok_or(CanonicalError::LoneSurrogate);
        }
        if !self.input[self.pos..].starts_with(b"\\u") {
            return Err(CanonicalError::LoneSurrogate);
        }
        self.pos += 2;
        let low = self.hex4()?;
        if !(0xDC00..0xE000).contains(&low) {
            return Err(CanonicalError::LoneSurrogate);
        }
        let c = 0x10000 + ((u32::from(high) - 0xD800) << 10) + (u32::from(low) - 0xDC00);
        char::from_u32(c).ok_or(CanonicalError::LoneSurrogate)
    }

    fn digits(&mut self) -> &'a [u8] {
        let input = self.input;
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        &input[start..self.pos]
    }

    /// Writes a number as `[-]digits[eN]`: `digits` has no leading or
    /// trailing zeros, and the value is `digits × 10^N`. Zero is `0`.
    fn number(&mut self, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let int_at = self.pos;
        let int = self.digits();
        if int.is_empty() || (int.len() > 1 && int[0] == b'0') {
            return Err(CanonicalError::Syntax { offset: int_at });
        }
        let mut digits = std::mem::take(&mut self.digits);
        digits.clear();
        digits.extend_from_slice(int);
        let result = self.number_rest(negative, &mut digits, out);
        self.digits = digits;
        result
    }

    /// The fraction and exponent of a number whose integer digits are in
    /// `digits`, then the number written.
    fn number_rest(&mut self, negative: bool, digits: &mut Vec<u8>, out: &mut Vec<u8>) -> Result<(), CanonicalError> {
        let mut exponent: i128 = 0;
        if self.peek() == Some(b'.') {
            self.pos += 1;
            let frac = self.digits();
            if frac.is_empty() {
                return Err(self.err());
            }
            exponent -= frac.len() as i128;
            digits.extend_from_slice(frac);
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            let negative_exp = match self.peek() {
                Some(b'-') => {
                    self.pos += 1;
                    true
                }
                Some(b'+') => {
                    self.pos += 1;
                    false
                }
                _ => false,
            };
            let exp = self.digits();
            if exp.is_empty() {
                return Err(self.err());
            }
            let significant = &exp[exp.iter().take_while(|&&d| d == b'0').count()..];
            if significant.len() > MAX_EXPONENT_DIGITS {
                return Err(CanonicalError::ExponentTooLarge);
            }
            let value = significant.iter().fold(0i128, |v, &d| v * 10 + i128::from(d - b'0'));
            exponent += if negative_exp { -value } else { value };
        }
        let leading = digits.iter().take_while(|&&d| d == b'0').count();
        let trailing = digits[leading..].iter().rev().take_while(|&&d| d == b'0').count();
        let significant = &digits[leading..digits.len() - trailing];
        if significant.is_empty() {
            out.push(b'0');
            return Ok(());
        }
        exponent += trailing as i128;
        if negative {
            out.push(b'-');
        }
        out.extend_from_slice(significant);
        if exponent != 0 {
            out.push(b'e');
            // Writing to a Vec cannot fail.
            let _ = write!(out, "{exponent}");
        }
        Ok(())
    }
}

/// Writes an object: its members sorted by name (as UTF-16 code units), each
/// value taken from its range of `values`; refuses duplicate names.
fn close_object(
    members: &mut [(Cow<'_, str>, Range<usize>)],
    values: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), CanonicalError> {
    members.sort_by(|a, b| utf16_cmp(&a.0, &b.0));
    if members.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(CanonicalError::DuplicateName);
    }
    out.reserve(values.len() + members.iter().map(|(n, _)| n.len() + 4).sum::<usize>() + 2);
    out.push(b'{');
    for (i, (name, value)) in members.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_parsed(out, name);
        out.push(b':');
        out.extend_from_slice(&values[value.clone()]);
    }
    out.push(b'}');
    Ok(())
}

/// Compares strings as sequences of UTF-16 code units (RFC 8785's order).
/// UTF-8 byte order is the same except where a character from U+E000 to
/// U+FFFF meets one past U+FFFF, so the bytes decide unless the first
/// difference involves such characters.
fn utf16_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    let (x, y) = (a.as_bytes(), b.as_bytes());
    let Some(i) = x.iter().zip(y).position(|(p, q)| p != q) else {
        // One is a prefix of the other, in code units too.
        return x.len().cmp(&y.len());
    };
    // The first differing characters start at `lead` on both sides (the
    // bytes before `i` are shared). Leading bytes below 0xEE begin
    // characters below U+E000, where both orders agree.
    let mut lead = i;
    while lead > 0 && x[lead] & 0xC0 == 0x80 {
        lead -= 1;
    }
    if x[lead] < 0xEE && y[lead] < 0xEE {
        x[i].cmp(&y[i])
    } else {
        a.encode_utf16().cmp(b.encode_utf16())
    }
}

/// Writes a string [`Parser::string`] returned. A borrowed one had no escape
/// in the input, so it holds no quote, backslash or control character: its
/// canonical form is itself between quotes.
#[expect(
    clippy::ptr_arg,
    reason = "whether the string is borrowed says whether it needs escaping"
)]
fn write_parsed(out: &mut Vec<u8>, s: &Cow<'_, str>) {
    match s {
        Cow::Borrowed(s) => {
            out.reserve(s.len() + 2);
            out.push(b'"');
            out.extend_from_slice(s.as_bytes());
            out.push(b'"');
        }
        Cow::Owned(s) => write_string(out, s),
    }
}

/// Writes `s` as a JSON string with the canonical escaping: runs that need
/// none are copied whole.
fn write_string(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if escape.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xf)],
            ]);
        } else {
            out.extend_from_slice(escape);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        String::from_utf8(canonical_json(s.as_bytes()).unwrap()).unwrap()
    }

    // Numbers keep every digit and ignore only their spelling.
    #[test]
    fn numbers_are_exact() {
        assert_eq!(canon("1"), canon("1.0"));
        assert_eq!(canon("1"), canon("1e0"));
        assert_eq!(canon("1"), canon("10e-1"));
        assert_eq!(canon("1"), canon("0.1E+1"));
        assert_eq!(canon("-0"), canon("0"));
        assert_eq!(canon("-0.0e5"), "0");
        assert_eq!(canon("1200"), "12e2");
        assert_eq!(canon("-0.025"), "-25e-3");
        assert_ne!(canon("9007199254740993"), canon("9007199254740992"));
        assert_ne!(canon("0.30000000000000001"), canon("0.3"));
        assert_ne!(canon("1"), canon("-1"));
    }

    // Exponents are normalised arithmetically, so a huge one costs nothing.
    #[test]
    fn huge_exponents_are_bounded() {
        assert_eq!(canon("1e999999999999999999"), "1e999999999999999999");
        assert_eq!(canon("10e999999999999999998"), "1e999999999999999999");
        assert_eq!(canon("1e-000000000000000000000000005"), "1e-5");
        assert_eq!(
            canonical_json(b"1e1000000000000000000"),
            Err(CanonicalError::ExponentTooLarge)
        );
    }

    // Escapes are undone and strings re-emitted with one escaping.
    #[test]
    fn strings_are_unescaped() {
        assert_eq!(canon(r#""\u0041""#), canon(r#""A""#));
        assert_eq!(canon(r#""\/\u00e9\ud83d\ude00""#), "\"/\u{e9}\u{1f600}\"");
        assert_eq!(canon(r#""\u001f\n\"""#), r#""\u001f\n\"""#);
        assert_eq!(canonical_json(br#""\ud83d""#), Err(CanonicalError::LoneSurrogate));
        assert_eq!(canonical_json(br#""\ude00x""#), Err(CanonicalError::LoneSurrogate));
    }

    // Members sort by UTF-16 code units; whitespace goes.
    #[test]
    fn objects_sort_by_utf16_names() {
        assert_eq!(
            canon(" { \"b\" : [ 1 , {} ] , \"a\" : null } "),
            r#"{"a":null,"b":[1,{}]}"#
        );
        // U+1F600 (a surrogate pair, D83D DE00) sorts before U+E000 in UTF-16,
        // though after it in UTF-8.
        assert_eq!(
            canon("{\"\u{e000}\":2,\"\u{1f600}\":1}"),
            "{\"\u{1f600}\":1,\"\u{e000}\":2}"
        );
    }

    proptest::proptest! {
        // The byte-wise shortcut orders names exactly as their UTF-16 code units do.
        #[test]
        fn names_compare_as_utf16(
            a in "[a\u{7f}\u{e9}\u{d7ff}\u{e000}\u{ffff}\u{10000}\u{1f600}]{0,4}",
            b in "[a\u{7f}\u{e9}\u{d7ff}\u{e000}\u{ffff}\u{10000}\u{1f600}]{0,4}",
        ) {
            proptest::prop_assert_eq!(utf16_cmp(&a, &b), a.encode_utf16().cmp(b.encode_utf16()));
        }
    }

    // Two members named alike, even through escapes, have no canonical form.
    #[test]
    fn duplicate_names_are_refused() {
        assert_eq!(canonical_json(br#"{"a":1,"a":1}"#), Err(CanonicalError::DuplicateName));
        assert_eq!(
            canonical_json(br#"{"a":1,"\u0061":2}"#),
            Err(CanonicalError::DuplicateName)
        );
        assert!(canonical_json(br#"[{"a":1},{"a":1}]"#).is_ok());
    }

    // Nesting is bounded, without recursion.
    #[test]
    fn depth_is_limited() {
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(canonical_json(ok.as_bytes()).is_ok());
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert_eq!(canonical_json(deep.as_bytes()), Err(CanonicalError::TooDeep));
        let huge = "[{\"a\":".repeat(100_000);
        assert_eq!(canonical_json(huge.as_bytes()), Err(CanonicalError::TooDeep));
    }

    // Whatever is not JSON text is refused.
    #[test]
    fn invalid_json_is_refused() {
        for bad in [
            "",
            " ",
            "{",
            "[1,]",
            "{\"a\"}",
            "{\"a\":1,}",
            "01",
            "1.",
            ".5",
            "1e",
            "-",
            "+1",
            "tru",
            "nul",
            "\"abc",
            "\"\\x\"",
            "\"\u{1}\"",
            "[1 2]",
            "{1:2}",
            "1 1",
            "[}",
            "{]",
            "NaN",
        ] {
            assert!(canonical_json(bad.as_bytes()).is_err(), "{bad:?} was accepted");
        }
        assert!(canonical_json(b"\"\xff\"").is_err());
    }
}
