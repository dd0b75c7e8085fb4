//! Every benchmark program parses its flags: the flags docs/benchmarks.md
//! shows are checked against these binaries by `crates/idem-docs`.

use std::process::Command;

const PROGRAMS: [(&str, &str); 6] = [
    ("suite", env!("CARGO_BIN_EXE_suite")),
    ("idem-bench", env!("CARGO_BIN_EXE_idem-bench")),
    ("events", env!("CARGO_BIN_EXE_events")),
    ("gateway", env!("CARGO_BIN_EXE_gateway")),
    ("scale", env!("CARGO_BIN_EXE_scale")),
    ("claims", env!("CARGO_BIN_EXE_claims")),
];

#[test]
fn every_program_answers_help_and_refuses_an_unknown_flag() {
    for (name, exe) in PROGRAMS {
        let help = Command::new(exe).arg("--help").output().expect(name);
        assert!(help.status.success(), "{name} --help: {help:?}");
        assert!(
            String::from_utf8_lossy(&help.stdout).contains("Usage"),
            "{name} --help prints no usage"
        );
        let bad = Command::new(exe).arg("--no-such-flag").output().expect(name);
        assert_eq!(bad.status.code(), Some(2), "{name} --no-such-flag: {bad:?}");
    }
}
