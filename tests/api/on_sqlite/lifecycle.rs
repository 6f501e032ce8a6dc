//! The real binary failing to start, given a SQLite file path: a database
//! it cannot create, a bad setting, a port already in use; and `--help`.

#[tokio::test]
async fn startup_failures_exit_non_zero_with_a_message() {
    let mut bin = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .env_clear()
        .env("TALLY_DATABASE", "/dev/null/tally.db")
        .env("TALLY_LISTEN", "127.0.0.1:0")
        .output()
        .unwrap();
    assert_eq!(bin.status.code(), Some(1));
    let err = String::from_utf8_lossy(&bin.stderr);
    assert!(err.contains("cannot create directory /dev/null"), "{err}");

    bin = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .env_clear()
        .env("TALLY_QUEUE_CAPACITY", "0")
        .output()
        .unwrap();
    assert_eq!(bin.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bin.stderr).contains("queue-capacity"));

    let help = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for env in [
        "TALLY_LISTEN",
        "TALLY_DATABASE",
        "TALLY_QUEUE_CAPACITY",
        "TALLY_SYNCHRONOUS",
        "TALLY_READERS",
        "TALLY_ADMIN_TOKEN",
        "TALLY_MAX_BATCH",
        "TALLY_DRAIN_TIMEOUT",
    ] {
        assert!(help.contains(env), "--help does not mention {env}");
    }
}

#[tokio::test]
async fn a_port_in_use_is_a_clear_startup_failure() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .env_clear()
        .env("TALLY_DATABASE", dir.path().join("t.db"))
        .env("TALLY_LISTEN", &addr)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("cannot listen on {addr}")), "{err}");
}
