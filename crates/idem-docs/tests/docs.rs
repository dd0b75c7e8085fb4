//! Every command README.md and docs/ show is run here (`sh run` blocks) or
//! checked for drift (`sh norun: …` blocks); `console` blocks are run by
//! trycmd in `crates/idem-cli/tests/docs_cli.rs`. The binaries are the ones
//! the test build made (`cargo test --workspace` builds them all; alone,
//! build them first: `cargo build -p ledger -p idem-cli -p fake-vendor
//! -p idem-client -p idem-gateway --examples`).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idem_docs::{Block, DOC_PORTS, Marker, anchors, blocks, check, commands, links, map_ports, script};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

/// `target/debug` (or the profile the tests run in): where the workspace's
/// binaries are.
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/..")
        .to_path_buf()
}

fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut docs = vec![root.join("README.md")];
    let mut more: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    more.sort();
    docs.extend(more);
    docs
}

fn read(doc: &Path) -> Vec<Block> {
    blocks(&std::fs::read_to_string(doc).unwrap_or_else(|e| panic!("{}: {e}", doc.display())))
}

fn name(doc: &Path) -> String {
    doc.strip_prefix(root()).unwrap_or(doc).display().to_string()
}

#[test]
fn every_shell_block_is_marked() {
    let mut problems = Vec::new();
    let mut counts = [0usize; 3];
    for doc in documents() {
        for b in read(&doc) {
            match &b.marker {
                Marker::Invalid(why) => problems.push(format!("{}:{}: {why}", name(&doc), b.line)),
                Marker::Run => counts[0] += 1,
                Marker::NoRun(_) => counts[1] += 1,
                Marker::Console => counts[2] += 1,
                Marker::NotShell => {}
            }
        }
    }
    assert!(
        problems.is_empty(),
        "unmarked or malformed blocks:\n{}",
        problems.join("\n")
    );
    eprintln!(
        "shell blocks: {} run, {} norun, {} console",
        counts[0], counts[1], counts[2]
    );
    assert!(counts[0] > 0 && counts[2] > 0, "the docs lost their runnable blocks");
}

#[test]
fn every_relative_link_and_anchor_exists() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).expect("doc");
        for (line, target) in links(&text) {
            checked += 1;
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let file = if path.is_empty() {
                doc.clone()
            } else {
                doc.parent().expect("dir").join(path)
            };
            if !file.exists() {
                problems.push(format!("{}:{line}: `{target}`: no such file", name(&doc)));
                continue;
            }
            if !anchor.is_empty() {
                let headings = anchors(&std::fs::read_to_string(&file).unwrap_or_default());
                if !headings.iter().any(|h| h == anchor) {
                    problems.push(format!(
                        "{}:{line}: `{target}`: no heading with that anchor",
                        name(&doc)
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "broken links:\n{}", problems.join("\n"));
    eprintln!("{checked} relative links checked");
}

#[test]
fn the_ci_runs_the_readme_test_command() {
    let readme = read(&root().join("README.md"));
    let first = readme
        .iter()
        .find(|b| b.marker != Marker::NotShell)
        .expect("a first shell block");
    let test = commands(&first.body)
        .into_iter()
        .find(|c| c.text.starts_with("cargo test"))
        .expect("the README's first block gives the test command");
    let test = test.text.split(" #").next().unwrap().trim().to_string();
    let ci = std::fs::read_to_string(root().join(".ci/run")).expect(".ci/run");
    assert!(
        ci.lines().any(|l| l.trim() == test),
        "`.ci/run` must run `{test}` verbatim"
    );
}

/// Splits a command line into words (quotes and backslashes as a shell
/// does; no expansion).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut has = false;
    let mut chars = line.chars().peekable();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"'), '\\') => cur.extend(chars.next()),
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                has = true;
            }
            (None, '\\') => cur.extend(chars.next()),
            (None, '#') if !has => break,
            (None, c) if c.is_whitespace() => {
                if has {
                    out.push(std::mem::take(&mut cur));
                    has = false;
                }
            }
            (None, c) => {
                cur.push(c);
                has = true;
            }
        }
    }
    if has {
        out.push(cur);
    }
    out
}

/// What a `cargo run …` line runs: a binary with its arguments, or an
/// example (its source and features exist).
enum Target {
    Bin(String, Vec<String>),
    Example,
}

fn cargo_run(w: &[String]) -> Result<Target, String> {
    let mut i = 2;
    let (mut pkg, mut bin, mut example, mut features) = (None, None, None, Vec::new());
    while i < w.len() {
        match w[i].as_str() {
            "--release" => i += 1,
            "-p" | "--package" => {
                pkg = w.get(i + 1).cloned();
                i += 2
            }
            "--bin" => {
                bin = w.get(i + 1).cloned();
                i += 2
            }
            "--example" => {
                example = w.get(i + 1).cloned();
                i += 2
            }
            "--features" => {
                features.extend(w.get(i + 1).into_iter().flat_map(|f| f.split(',').map(String::from)));
                i += 2
            }
            "--" => {
                i += 1;
                break;
            }
            other => return Err(format!("unknown cargo flag `{other}`")),
        }
    }
    let args: Vec<String> = w[i.min(w.len())..].iter().filter(|a| *a != "&").cloned().collect();
    let pkg = pkg.ok_or("`cargo run` without `-p`")?;
    let dir = root().join("crates").join(&pkg);
    let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).map_err(|_| format!("no package `{pkg}`"))?;
    for f in &features {
        if !manifest.contains(&format!("\n{f} =")) {
            return Err(format!("package `{pkg}` has no feature `{f}`"));
        }
    }
    if let Some(e) = example {
        let src = dir.join("examples").join(format!("{e}.rs"));
        return if src.exists() {
            Ok(Target::Example)
        } else {
            Err(format!("no example {}", src.display()))
        };
    }
    let default_run = manifest
        .lines()
        .find_map(|l| l.strip_prefix("default-run = \"").and_then(|r| r.strip_suffix('"')))
        .map(String::from);
    let exe = bin
        .or(default_run)
        .unwrap_or_else(|| if pkg == "idem-cli" { "idem".into() } else { pkg.clone() });
    Ok(Target::Bin(exe, args))
}

fn run_help(exe: &str, args: &[String]) -> Result<(), String> {
    let path = bin_dir().join(exe);
    if !path.exists() {
        return Err(format!(
            "{} is not built (run the workspace's tests, or build it first)",
            path.display()
        ));
    }
    let out = Command::new(&path)
        .args(args)
        .arg("--help")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{exe}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{exe} {} --help` refused the flags shown:\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Checks that the package of `-p` in the cargo command `w` exists
/// (`without_p` is the complaint when there is none), and so does its
/// target of `--{kind}`, if named, in its folder `folder`.
fn package_target(w: &[String], without_p: &str, kind: &str, folder: &str) -> Result<(), String> {
    let pkg = w.iter().skip_while(|a| *a != "-p").nth(1).ok_or(without_p)?;
    let dir = root().join("crates").join(pkg);
    if !dir.join("Cargo.toml").exists() {
        return Err(format!("no package `{pkg}`"));
    }
    let flag = format!("--{kind}");
    if let Some(t) = w.iter().skip_while(|a| **a != flag).nth(1)
        && !dir.join(folder).join(format!("{t}.rs")).exists()
    {
        return Err(format!("package `{pkg}` has no {kind} `{t}`"));
    }
    Ok(())
}

/// The drift check of one command of a `norun` block.
fn check_norun(text: &str) -> Result<&'static str, String> {
    let w = words(text);
    let w: Vec<String> = w
        .into_iter()
        .skip_while(|x| x.contains('=') && !x.starts_with('-'))
        .collect();
    match w.first().map(String::as_str) {
        None => Ok("empty"),
        Some("cargo") => match w.get(1).map(String::as_str) {
            Some("run") => match cargo_run(&w)? {
                Target::Bin(exe, args) => run_help(&exe, &args).map(|()| "flags accepted"),
                Target::Example => Ok("example exists, features exist"),
            },
            Some("test") if w.iter().any(|a| a == "-p") => {
                package_target(&w, "`-p` without a package", "test", "tests")?;
                Ok("the package and its test exist")
            }
            Some("bench") => {
                package_target(&w, "`cargo bench` without `-p`", "bench", "benches")?;
                Ok("the package and its bench exist")
            }
            Some("test") => {
                let ci = std::fs::read_to_string(root().join(".ci/run")).map_err(|e| e.to_string())?;
                let line = w.join(" ");
                if ci.lines().any(|l| l.trim() == line) {
                    Ok("the CI runs it")
                } else {
                    Err(format!("`{line}` is not what .ci/run runs"))
                }
            }
            Some("build") => {
                for (i, a) in w.iter().enumerate() {
                    if a == "-p" {
                        let pkg = w.get(i + 1).ok_or("`-p` without a package")?;
                        if !root().join("crates").join(pkg).join("Cargo.toml").exists() {
                            return Err(format!("no package `{pkg}`"));
                        }
                    }
                }
                Ok("packages exist")
            }
            Some("install") => Ok("a third-party crate"),
            other => Err(format!("cannot check `cargo {}`", other.unwrap_or(""))),
        },
        Some(p) if p.starts_with("target/") => {
            let exe = Path::new(p)
                .file_name()
                .and_then(|f| f.to_str())
                .ok_or("a path")?
                .to_string();
            run_help(&exe, &w[1..]).map(|()| "flags accepted")
        }
        Some("bash") => {
            let script = w.get(1).ok_or("bash without a script")?;
            if root().join(script).exists() {
                Ok("the script exists")
            } else {
                Err(format!("no {script}"))
            }
        }
        Some("cd") => {
            let dir = w.get(1).ok_or("cd without a directory")?;
            if root().join(dir).is_dir() {
                Ok("the directory exists")
            } else {
                Err(format!("no directory {dir}"))
            }
        }
        Some("python3" | "schemathesis" | "curl") => Ok("a third-party tool"),
        Some(other) => Err(format!(
            "no drift check for `{other}`: add one, or show it as a run block"
        )),
    }
}

#[test]
fn norun_commands_still_match_the_binaries() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        for b in read(&doc) {
            if !matches!(b.marker, Marker::NoRun(_)) {
                continue;
            }
            for c in commands(&b.body) {
                // `a && b`: each part is a command of its own.
                for part in c.text.split("&&") {
                    checked += 1;
                    if let Err(e) = check_norun(part.trim()) {
                        problems.push(format!(
                            "{}:{}: `{}`: {e}",
                            name(&doc),
                            b.line + 1 + c.first,
                            part.trim()
                        ));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    eprintln!("{checked} norun commands checked");
}

const PRELUDE: &str = r#"
exec 2>&1
docs_wait_port() {
  local i
  for i in $(seq 1 600); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.05
  done
  echo "docs: nothing listens on port $1" >&2
  return 1
}
docs_wait_started() {   # the server started last (`$!`) has replaced the one before it
  local last=$1 i
  [[ -z $last ]] && return 0
  for i in $(seq 1 600); do
    if grep -qx "$last" ./*.pid 2>/dev/null || ! kill -0 "$last" 2>/dev/null; then return 0; fi
    sleep 0.05
  done
}
curl() {
  local a
  docs_wait_started "${!:-}"
  for a in "$@"; do
    if [[ $a =~ (localhost|127\.0\.0\.1):([0-9]+) ]]; then docs_wait_port "${BASH_REMATCH[2]}"; break; fi
  done
  command curl --no-progress-meter --max-time 30 "$@"
}
docs_exec() {
  local exe=$1; shift
  local name server=
  name=$(basename "$exe")
  case $name in
    ledger) if [[ $# -eq 0 || $1 == -* ]]; then server=ledger; fi ;;
    idem) if [[ ${1:-} == gateway ]]; then server=gateway; fi ;;
    fake-vendor|counter) server=$name ;;
  esac
  if [[ -z $server ]]; then "$exe" "$@"; return; fi
  if [[ $BASHPID == "$$" ]]; then
    echo "docs: start $name in the background (with &): the block would wait for it forever" >&2
    return 98
  fi
  if [[ -f $server.pid ]]; then   # a new start replaces the one before, as after a Ctrl-C
    local old; old=$(cat "$server.pid")
    kill "$old" 2>/dev/null || true
    while kill -0 "$old" 2>/dev/null; do sleep 0.05; done
  fi
  local extra=()
  case $server in
    ledger) [[ " $* " == *" --listen "* ]] || extra=(--listen "127.0.0.1:$DOCS_PORT_8080") ;;
    gateway) [[ " $* " == *" --listen "* ]] || extra=(--listen "127.0.0.1:$DOCS_PORT_8000") ;;
    counter) export COUNTER_LISTEN="127.0.0.1:$DOCS_PORT_9000" ;;
  esac
  echo "$BASHPID" > "$server.pid"
  exec "$exe" "$@" "${extra[@]}" >>"$server.log" 2>&1
}
cargo() {
  if [[ ${1:-} != run ]]; then echo "docs: only 'cargo run' runs here" >&2; return 97; fi
  shift
  local pkg= bin= example=
  while (($#)); do
    case $1 in
      --release) shift ;;
      -p|--package) pkg=$2; shift 2 ;;
      --bin) bin=$2; shift 2 ;;
      --example) example=$2; shift 2 ;;
      --features) shift 2 ;;
      --) shift; break ;;
      *) echo "docs: unknown cargo flag $1" >&2; return 97 ;;
    esac
  done
  local exe
  if [[ -n $example ]]; then exe=$DOCS_BIN/examples/$example
  elif [[ -n $bin ]]; then exe=$DOCS_BIN/$bin
  elif [[ $pkg == idem-cli ]]; then exe=$DOCS_BIN/idem
  else exe=$DOCS_BIN/$pkg
  fi
  if [[ ! -x $exe ]]; then echo "docs: $exe is not built" >&2; return 96; fi
  docs_exec "$exe" "$@"
}
"#;

fn free_port() -> u16 {
    idem_conformance::free_port()
}

/// A NATS server with JetStream of the test's own, killed on drop.
struct Nats(std::process::Child, PathBuf);

impl Nats {
    fn start(port: u16, dir: &Path) -> Nats {
        let bin = std::env::var("CHAOS_NATS_SERVER").unwrap_or_else(|_| {
            if Path::new("/usr/sbin/nats-server").exists() {
                "/usr/sbin/nats-server".into()
            } else {
                "nats-server".into()
            }
        });
        let store = dir.join("nats");
        let child = Command::new(&bin)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(&store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {bin}: {e}"));
        let nats = Nats(child, store);
        // The page's commands connect at once: wait until the server listens.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "{bin} did not listen on 127.0.0.1:{port} within 20 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        nats
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

/// Runs the `sh run` blocks of one document as one script.
fn run_document(rel: &str) {
    let doc = root().join(rel);
    let all = read(&doc);
    let (body, cmds) = script(&all);
    assert!(!cmds.is_empty(), "{rel} has no run blocks");
    let ports: Vec<(u16, u16)> = DOC_PORTS.iter().map(|&p| (p, free_port())).collect();
    let body = map_ports(&body, &ports);
    let cmds: Vec<_> = cmds
        .into_iter()
        .map(|mut c| {
            c.expected = c.expected.iter().map(|p| map_ports(p, &ports)).collect();
            c
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("idem-docs-{}-{}", rel.replace('/', "-"), std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let _nats = body
        .contains(&format!(":{}", ports[4].1))
        .then(|| Nats::start(ports[4].1, &dir));
    let mut env = String::new();
    for (from, to) in &ports {
        env.push_str(&format!("DOCS_PORT_{from}={to}\n"));
    }
    let script = format!("{env}DOCS_BIN='{}'\n{PRELUDE}\n{body}", bin_dir().display());
    std::fs::write(dir.join("doc.sh"), &script).expect("script");

    use std::os::unix::process::CommandExt;
    let mut child = Command::new("bash")
        .args(["-euo", "pipefail", "doc.sh"])
        .current_dir(&dir)
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("bash");
    let pgid = child.id();
    let mut stdout = child.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // The servers the script started are in its process group.
    let quiet = |sig: &str| {
        Command::new("kill")
            .args([sig, "--", &format!("-{pgid}")])
            .stderr(Stdio::null())
            .status()
    };
    let _ = quiet("-TERM");
    std::thread::sleep(Duration::from_millis(200));
    let _ = quiet("-KILL");
    let _ = child.wait();
    let output = reader.join().expect("reader");
    let logs = || {
        let mut l = String::new();
        for s in ["ledger", "gateway", "fake-vendor", "counter"] {
            if let Ok(t) = std::fs::read_to_string(dir.join(format!("{s}.log"))) {
                l.push_str(&format!("--- {s}.log (last lines)\n"));
                let lines: Vec<&str> = t.lines().collect();
                l.push_str(&lines[lines.len().saturating_sub(15)..].join("\n"));
                l.push('\n');
            }
        }
        l
    };
    let Some(status) = status else {
        panic!(
            "{rel}: the run blocks did not finish within 180 s; output:\n{output}\n{}",
            logs()
        );
    };
    assert!(
        status.success(),
        "{rel}: the run blocks failed ({status}); output:\n{output}\n{}",
        logs()
    );
    if let Err(e) = check(&output, &cmds) {
        panic!("{rel}: {e}\n{}", logs());
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "{rel}: {} commands run, {} output lines checked",
        cmds.len(),
        cmds.iter().map(|c| c.expected.len()).sum::<usize>()
    );
}

#[test]
fn readme() {
    run_document("README.md");
}

#[test]
fn ledger() {
    run_document("docs/ledger.md");
}

#[test]
fn gateway() {
    run_document("docs/gateway.md");
}

#[test]
fn client() {
    run_document("docs/client.md");
}

#[test]
fn operations() {
    run_document("docs/operations.md");
}

#[test]
fn http() {
    run_document("docs/http.md");
}

#[test]
fn events() {
    run_document("docs/events.md");
}

#[test]
fn outbound() {
    run_document("docs/outbound.md");
}

#[test]
fn steps() {
    run_document("docs/steps.md");
}

#[test]
fn tls() {
    run_document("docs/tls.md");
}
