//! The build script of the crates whose binaries ship (`idem`, `ledger`):
//! in release builds on Linux their debug sections (line tables only, see
//! the workspace's `[profile.release]`) are written compressed, so a
//! backtrace still names each frame's file and line at a fraction of the
//! size.

fn main() {
    println!("cargo:rerun-if-changed=../../build/release_link.rs");
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    let linux = std::env::var("CARGO_CFG_TARGET_OS").is_ok_and(|os| os == "linux");
    if release && linux {
        println!("cargo:rustc-link-arg-bins=-Wl,--compress-debug-sections=zlib");
    }
}
