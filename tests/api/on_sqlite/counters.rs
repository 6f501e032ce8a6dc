//! Counter reads on SQLite, where the writer publishes committed values in
//! memory for reads, against the file read behind the API.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::spawn_with;

/// Between a batch's COMMIT and the publication of its values, a read of
/// a counter it changed answers what the file holds, never the value kept
/// in memory from before: a read from the file (of a name let go from
/// memory) could already have answered the new value, and a later read
/// the old one. The writer is held in that window (a test hook) and the
/// file is read behind the API to know the COMMIT has landed.
#[tokio::test]
async fn a_read_while_a_batch_publishes_answers_what_the_file_holds() {
    let app = spawn_with(|s| s.test_publish_delay_ms = Some(3_000)).await;
    let r = app.post_json("/counters/x", json!({"by": 1})).await;
    assert_eq!(r.status(), StatusCode::OK);
    let read = || async {
        let v: Value = app.get("/counters/x").await.json().await.unwrap();
        v["value"].as_i64().unwrap()
    };
    assert_eq!(read().await, 1, "kept in memory after the write");

    let write = tokio::spawn({
        let (client, url) = (app.client.clone(), app.url("/counters/x"));
        async move {
            client
                .post(url)
                .json(&json!({"by": 1}))
                .send()
                .await
                .unwrap()
        }
    });
    // The COMMIT is in the file: the writer is now held before publishing.
    let pool = app.peek().await;
    let started = std::time::Instant::now();
    loop {
        let in_file: i64 = sqlx::query_scalar("SELECT value FROM counters WHERE name = 'x'")
            .fetch_one(&pool)
            .await
            .unwrap();
        if in_file == 2 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no commit");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(read().await, 2, "an older value than the file's");
    let r = write.await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(read().await, 2);
    app.stop().await.unwrap();
}
