//! Reads the shell blocks of `README.md` and `docs/*.md` so the test suite
//! can run them: the documentation cannot drift from the product.
//!
//! Every fenced block in those files carries a language, and every shell
//! block a marker in its info string:
//!
//! - ` ```sh run `: executed by `tests/docs.rs` with `bash -euo pipefail`
//!   in a temporary directory, against services the block starts itself
//!   (`cargo run -p …` runs the binary the test build already made; the
//!   ports the docs show are mapped to free ones). A line `#   pattern`
//!   (a hash and exactly three spaces) after a command is an output line that
//!   command must print, `…` matching any text; patterns of one command
//!   match in order (runs of spaces and tabs compare equal).
//! - ` ```sh norun: <reason> `: not executed (a long chaos run, a
//!   benchmark, an engine the suite does not own); every `cargo run` in it
//!   is run with `--help` appended, so its binary must still accept the
//!   flags shown, and every other command is checked for what can be
//!   checked cheaply (a path that must exist, the CI running the README's
//!   test command).
//! - ` ```console `: `$ idem …` sessions with their exact output, run by
//!   `trycmd` from `crates/idem-cli/tests/docs_cli.rs`.
//!
//! An unmarked shell block, or a fence without a language, fails the test.
//! See `docs/testing.md`.

/// The ports the docs show, mapped to free ones when a block runs.
pub const DOC_PORTS: [u16; 5] = [8080, 8000, 9000, 9100, 4222];

/// How a fenced block is treated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Marker {
    /// ` ```sh run `: executed.
    Run,
    /// ` ```sh norun: reason `: checked for drift, not executed.
    NoRun(String),
    /// ` ```console `: run by trycmd.
    Console,
    /// Not a shell block (rust, toml, json, text…).
    NotShell,
    /// A mistake: what is wrong with the fence.
    Invalid(String),
}

/// One fenced block of a document.
#[derive(Debug, Clone)]
pub struct Block {
    /// 1-based line of the opening fence.
    pub line: usize,
    /// The fence's info string.
    pub info: String,
    /// How it is treated.
    pub marker: Marker,
    /// The lines between the fences.
    pub body: Vec<String>,
}

const SHELLS: [&str; 4] = ["sh", "bash", "shell", "zsh"];

/// The marker an info string gives.
pub fn marker(info: &str) -> Marker {
    let info = info.trim();
    if info.is_empty() {
        return Marker::Invalid("a fence without a language (say `sh run`, `sh norun: why`, `text`…)".into());
    }
    let (lang, rest) = match info.find(|c: char| c.is_whitespace() || c == ',') {
        Some(i) => (&info[..i], info[i + 1..].trim()),
        None => (info, ""),
    };
    if lang == "console" || lang == "trycmd" {
        return if rest.is_empty() {
            Marker::Console
        } else {
            Marker::Invalid(format!(
                "`{info}`: console blocks take no options (trycmd runs them all)"
            ))
        };
    }
    if !SHELLS.contains(&lang) {
        return Marker::NotShell;
    }
    if rest == "run" {
        return Marker::Run;
    }
    if let Some(reason) = rest.strip_prefix("norun:") {
        let reason = reason.trim();
        if reason.is_empty() {
            return Marker::Invalid(format!("`{info}`: say why the block is not run"));
        }
        return Marker::NoRun(reason.to_string());
    }
    Marker::Invalid(format!(
        "`{info}`: a shell block is `{lang} run` (executed by the test suite) or `{lang} norun: <why>`"
    ))
}

/// The fenced blocks of a Markdown text (indented code is not a block).
pub fn blocks(text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(usize, String, String, Vec<String>)> = None;
    for (i, line) in text.lines().enumerate() {
        let ticks = line.chars().take_while(|&c| c == '`').count();
        match &mut open {
            None if ticks >= 3 => {
                let info = line[ticks..].trim().to_string();
                open = Some((i + 1, "`".repeat(ticks), info, Vec::new()));
            }
            Some((start, fence, info, body)) => {
                if line.starts_with(fence.as_str()) && line[fence.len()..].trim().is_empty() {
                    out.push(Block {
                        line: *start,
                        marker: marker(info),
                        info: info.clone(),
                        body: std::mem::take(body),
                    });
                    open = None;
                } else {
                    body.push(line.to_string());
                }
            }
            None => {}
        }
    }
    if let Some((start, _, info, body)) = open {
        out.push(Block {
            line: start,
            marker: Marker::Invalid("a fence that is never closed".into()),
            info,
            body,
        });
    }
    out
}

/// One command of a shell block and the output lines it must print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// Index of the block's first line this command starts on (0-based).
    pub first: usize,
    /// Index one past its last line.
    pub end: usize,
    /// The command as one line (continuations joined, comments kept out).
    pub text: String,
    /// `#   pattern` lines that follow it.
    pub expected: Vec<String>,
}

/// The prefix of an expected-output line.
pub const EXPECT: &str = "#   ";

/// Splits a shell block into commands with their expected output. A command
/// starts on a line that is not blank, not a comment, does not follow a line
/// ending in `\` and is not inside a loop or conditional (a `for` … `done`
/// is one command).
pub fn commands(body: &[String]) -> Vec<Command> {
    let mut out: Vec<Command> = Vec::new();
    let mut continued = false;
    // Inside `for`/`while`/`until`/`if`/`case` … `done`/`fi`/`esac`: one command.
    let mut depth = 0usize;
    for (i, line) in body.iter().enumerate() {
        let t = line.trim();
        let first = t.split_whitespace().next().unwrap_or("");
        let opens = usize::from(matches!(first, "for" | "while" | "until" | "if" | "case"));
        let closes = usize::from(
            matches!(first.trim_end_matches(';'), "done" | "fi" | "esac")
                || ["; done", "; fi", "esac"].iter().any(|e| t.ends_with(e)),
        );
        if continued || (depth > 0 && !t.is_empty() && !line.starts_with('#')) {
            let cmd = out.last_mut().expect("a continuation follows a command");
            cmd.text.push(' ');
            cmd.text.push_str(t.trim_end_matches('\\').trim());
            cmd.end = i + 1;
            continued = t.ends_with('\\');
            depth = (depth + opens).saturating_sub(closes);
            continue;
        }
        if !t.is_empty() && !line.starts_with('#') {
            depth = (depth + opens).saturating_sub(closes);
        }
        if t.is_empty() {
            continue;
        }
        if line.starts_with('#') {
            if let Some(p) = line.strip_prefix(EXPECT)
                && !p.starts_with(char::is_whitespace)
                && let Some(cmd) = out.last_mut()
            {
                cmd.expected.push(p.trim_end().to_string());
            }
            continue;
        }
        continued = t.ends_with('\\');
        out.push(Command {
            first: i,
            end: i + 1,
            text: t.trim_end_matches('\\').trim().to_string(),
            expected: Vec::new(),
        });
    }
    out
}

/// Whether `line` matches `pattern` as a whole, `…` matching any text; runs
/// of spaces and tabs compare equal to one space.
pub fn matches(pattern: &str, line: &str) -> bool {
    let squeeze = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let (pattern, line) = (squeeze(pattern), squeeze(line));
    let (pattern, line) = (pattern.as_str(), line.as_str());
    let parts: Vec<&str> = pattern.split('…').collect();
    if parts.len() == 1 {
        return pattern == line;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !line.starts_with(first) || !line[first.len()..].ends_with(last) {
        return false;
    }
    let mut rest = &line[first.len()..line.len() - last.len()];
    if first.len() + last.len() > line.len() {
        return false;
    }
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

/// Checks that `lines` hold every pattern, in order; the pattern missing.
pub fn missing<'a>(patterns: &'a [String], lines: &[&str]) -> Option<&'a str> {
    let mut at = 0;
    for p in patterns {
        match lines[at..].iter().position(|l| matches(p, l.trim_end())) {
            Some(i) => at += i + 1,
            None => return Some(p),
        }
    }
    None
}

/// The marker printed before each command of a run block.
pub fn step_marker(n: usize) -> String {
    format!("@@idem-docs-step {n}@@")
}

/// Replaces each port the docs show (`:8080` not followed by a digit) with
/// the one given.
pub fn map_ports(text: &str, ports: &[(u16, u16)]) -> String {
    let mut out = text.to_string();
    for (from, to) in ports {
        let needle = format!(":{from}");
        let mut result = String::with_capacity(out.len());
        let mut rest = out.as_str();
        while let Some(i) = rest.find(&needle) {
            let after = &rest[i + needle.len()..];
            result.push_str(&rest[..i]);
            if after.starts_with(|c: char| c.is_ascii_digit()) {
                result.push_str(&needle);
            } else {
                result.push_str(&format!(":{to}"));
            }
            rest = after;
        }
        result.push_str(rest);
        out = result;
    }
    out
}

/// The script of a document's run blocks, with a step marker printed before
/// each command, and the commands in order.
pub fn script(blocks: &[Block]) -> (String, Vec<Command>) {
    let mut script = String::new();
    let mut all = Vec::new();
    for b in blocks.iter().filter(|b| b.marker == Marker::Run) {
        let cmds = commands(&b.body);
        let mut next = cmds.iter().peekable();
        for (i, line) in b.body.iter().enumerate() {
            if let Some(c) = next.peek()
                && c.first == i
            {
                script.push_str(&format!("printf '\\n%s\\n' '{}'\n", step_marker(all.len())));
                all.push((*c).clone());
                next.next();
            }
            script.push_str(line);
            script.push('\n');
        }
    }
    (script, all)
}

/// Checks a run's output against the commands' expected lines.
pub fn check(output: &str, commands: &[Command]) -> Result<(), String> {
    let mut segments: Vec<Vec<&str>> = vec![Vec::new(); commands.len()];
    let mut current: Option<usize> = None;
    for line in output.lines() {
        if let Some(n) = line
            .strip_prefix("@@idem-docs-step ")
            .and_then(|r| r.strip_suffix("@@"))
        {
            current = n.parse().ok();
            continue;
        }
        if let Some(c) = current
            && c < segments.len()
        {
            segments[c].push(line);
        }
    }
    for (cmd, seg) in commands.iter().zip(&segments) {
        if let Some(p) = missing(&cmd.expected, seg) {
            return Err(format!(
                "`{}` should print a line matching\n    {p}\nbut printed:\n{}",
                cmd.text,
                seg.iter().map(|l| format!("    {l}")).collect::<Vec<_>>().join("\n")
            ));
        }
    }
    Ok(())
}

/// The relative links of a Markdown text outside code blocks: (line, target).
pub fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fence: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let ticks = line.chars().take_while(|&c| c == '`').count();
        match &fence {
            Some(f) if line.starts_with(f.as_str()) && line[f.len()..].trim().is_empty() => fence = None,
            Some(_) => {}
            None if ticks >= 3 => fence = Some("`".repeat(ticks)),
            None => {
                let mut rest = line;
                while let Some(at) = rest.find("](") {
                    let after = &rest[at + 2..];
                    let Some(end) = after.find(')') else { break };
                    let target = &after[..end];
                    if !target.contains("://") && !target.starts_with("mailto:") {
                        out.push((i + 1, target.to_string()));
                    }
                    rest = &after[end..];
                }
            }
        }
    }
    out
}

/// The anchors GitHub gives a Markdown text's headings.
pub fn anchors(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fence = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fence = !fence;
            continue;
        }
        if fence || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        out.push(slug);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers() {
        assert_eq!(marker("sh run"), Marker::Run);
        assert_eq!(
            marker("sh norun: a 20-minute run"),
            Marker::NoRun("a 20-minute run".into())
        );
        assert_eq!(marker("console"), Marker::Console);
        assert_eq!(marker("rust"), Marker::NotShell);
        assert!(matches!(marker("sh"), Marker::Invalid(_)));
        assert!(matches!(marker("bash"), Marker::Invalid(_)));
        assert!(matches!(marker("sh norun:"), Marker::Invalid(_)));
        assert!(matches!(marker(""), Marker::Invalid(_)));
        assert!(matches!(marker("console,ignore"), Marker::Invalid(_)));
    }

    #[test]
    fn unmarked_and_unclosed_blocks_are_found() {
        let doc = "text\n```sh\nls\n```\n```rust\nfn x() {}\n```\n````sh run\nls\n````\n```sh run\nls\n";
        let b = blocks(doc);
        assert_eq!(b.len(), 4);
        assert!(matches!(b[0].marker, Marker::Invalid(_)));
        assert_eq!(b[0].line, 2);
        assert_eq!(b[1].marker, Marker::NotShell);
        assert_eq!(b[2].marker, Marker::Run);
        assert!(matches!(b[3].marker, Marker::Invalid(_)));
    }

    /// The commands of the block whose text is `text`.
    fn commands_of(text: &str) -> Vec<Command> {
        let body: Vec<String> = text.lines().map(String::from).collect();
        commands(&body)
    }

    /// The command on lines `first..end` whose text is `text`, expecting
    /// `expected`.
    fn command(first: usize, end: usize, text: &str, expected: &[&str]) -> Command {
        Command {
            first,
            end,
            text: text.into(),
            expected: expected.iter().map(|e| (*e).to_owned()).collect(),
        }
    }

    #[test]
    fn commands_and_patterns() {
        let c = commands_of(
            "# a comment\nA=1\ncurl -s x \\\n   -d y\n#   {\"a\":…}\n#   b\n# not a pattern\n#    nor this\n\necho z",
        );
        assert_eq!(c.len(), 3);
        assert_eq!(c[1], command(2, 4, "curl -s x -d y", &["{\"a\":…}", "b"]));
        assert!(c[2].expected.is_empty());
    }

    #[test]
    fn a_loop_is_one_command() {
        let c = commands_of("for i in 1 2; do\n  echo $i\ndone\n#   1\n#   2\necho end");
        assert_eq!(c.len(), 2);
        assert_eq!(c[0], command(0, 3, "for i in 1 2; do echo $i done", &["1", "2"]));
        let one: Vec<String> = vec!["for i in 1 2; do echo $i; done".into(), "echo end".into()];
        assert_eq!(commands(&one).len(), 2);
    }

    #[test]
    fn patterns_match_whole_lines() {
        assert!(matches(
            "{\"id\":\"…\",\"amount\":100}",
            "{\"id\":\"x-1\",\"amount\":100}"
        ));
        assert!(!matches(
            "{\"id\":\"…\",\"amount\":100}",
            "{\"id\":\"x-1\",\"amount\":1000}"
        ));
        assert!(matches("a…b…c", "abc"));
        assert!(!matches("a…a", "a"));
        assert!(!matches("HTTP/1.1 201 Created", "HTTP/1.1 201 Created extra"));
        assert!(matches("1  a  dead", "1\ta\tdead"));
        let lines = ["one", "two", "three"];
        assert_eq!(missing(&["one".into(), "three".into()], &lines), None);
        assert_eq!(missing(&["three".into(), "one".into()], &lines), Some("one"));
    }

    #[test]
    fn a_wrong_output_fails_the_check() {
        let body: Vec<String> = "echo 1\n#   1\necho 2\n#   2".lines().map(String::from).collect();
        let b = [Block {
            line: 1,
            info: "sh run".into(),
            marker: Marker::Run,
            body,
        }];
        let (script, cmds) = script(&b);
        assert!(script.contains(&step_marker(1)));
        let good = format!("\n{}\n1\n\n{}\n2\n", step_marker(0), step_marker(1));
        assert_eq!(check(&good, &cmds), Ok(()));
        // The second command's line printed by the first does not count.
        let bad = format!("\n{}\n1\n2\n\n{}\n3\n", step_marker(0), step_marker(1));
        assert!(check(&bad, &cmds).is_err());
    }

    #[test]
    fn links_and_anchors() {
        let doc = "# One dependency: the `idem` crate\nSee [a](docs/http.md#metric-labels) and [b](https://x.y/z).\n```sh run\necho [c](nope.md)\n```\n## What each mode guarantees";
        assert_eq!(links(doc), vec![(2, "docs/http.md#metric-labels".to_string())]);
        assert_eq!(
            anchors(doc),
            vec![
                "one-dependency-the-idem-crate".to_string(),
                "what-each-mode-guarantees".into()
            ]
        );
    }

    #[test]
    fn ports_are_mapped() {
        let t = "curl localhost:8080/v1 --listen 127.0.0.1:80801 nats://h:4222";
        assert_eq!(
            map_ports(t, &[(8080, 41000), (4222, 42000)]),
            "curl localhost:41000/v1 --listen 127.0.0.1:80801 nats://h:42000"
        );
    }
}
