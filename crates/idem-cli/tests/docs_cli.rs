//! The `console` sessions of README.md and docs/ run as written, with their
//! exact output (trycmd: `...` stands for lines left out, `[..]` for part of
//! a line). The `sh` blocks are run by `crates/idem-docs`.

#[test]
fn console_sessions_in_the_docs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cases = trycmd::TestCases::new();
    cases
        .default_bin_name("idem")
        .register_bin("idem", trycmd::cargo::cargo_bin!("idem"));
    cases.case(root.join("README.md"));
    for entry in std::fs::read_dir(root.join("docs")).expect("docs/") {
        let path = entry.expect("docs entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            cases.case(path);
        }
    }
}
