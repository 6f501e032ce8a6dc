//! The contention lab behind `tally contention`: writers that each hold a
//! transaction, on SQLite connections of their own (most fail with
//! `SQLITE_BUSY`) and through one queue (all commit).

use std::time::Duration;

#[tokio::test]
async fn queued_writes_all_commit_where_direct_ones_collide() {
    let [direct, queued] = tally::db::contention::run(12, Duration::from_millis(75))
        .await
        .unwrap();
    assert_eq!(
        (queued.committed, queued.busy, queued.final_counter),
        (12, 0, 12)
    );
    assert!(direct.committed < 12, "{direct:?}");
    assert!(direct.busy > 0, "{direct:?}");
    assert_eq!(direct.final_counter, direct.committed as i64);
    assert_eq!(direct.committed + direct.busy + direct.other_errors, 12);
    // Queued writes run one after another: at least 12 holds long.
    assert!(queued.elapsed >= Duration::from_millis(12 * 75));
}

#[test]
fn contention_subcommand_prints_the_table() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["contention", "--writers", "6", "--hold-ms", "20"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let queued = text.lines().find(|l| l.starts_with("queued")).expect(&text);
    let cols: Vec<&str> = queued.split_whitespace().collect();
    assert_eq!(&cols[1..5], ["6", "0", "0", "6"], "{text}");
    assert!(text.lines().any(|l| l.starts_with("direct")), "{text}");
}
