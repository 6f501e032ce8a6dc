//! Helpers shared by tally's own tests: its unit tests, and its
//! integration tests (which build the library with the `test-hooks`
//! feature).

use std::{path::Path, time::Duration};

/// Writes an executable shell script at `path` and returns once it can be
/// run: a process forked by another test while the script was open for
/// writing holds it open until it execs, and running it meanwhile fails
/// with "Text file busy". `text` follows the `#!` line; the script answers
/// `--probe` by exiting at once.
pub fn script(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(
        path,
        format!("#!/bin/sh\n[ \"$1\" = --probe ] && exit 0\n{text}\n"),
    )
    .unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while let Err(e) = std::process::Command::new(path).arg("--probe").status() {
        assert!(
            e.kind() == std::io::ErrorKind::ExecutableFileBusy
                && std::time::Instant::now() < deadline,
            "{}: {e}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `path` made `len` bytes long in place, as `truncate -s` does.
pub fn cut(path: &Path, len: u64) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}
