//! The idempotency keys' test that reads the stored keys behind the API,
//! in SQLite: a key older than a day is forgotten.

use serde_json::{Value, json};

use crate::{helpers::spawn_app, idempotency::post_keyed};

#[tokio::test]
async fn keys_are_forgotten_after_a_day() {
    let app = spawn_app().await;
    // A key stored two days ago, behind the API (as an earlier run of
    // tally would have left it), for an increment of `old`, before any
    // write: the writer cleans up after its first batch, with a key or not.
    app.sql_behind(
        "INSERT INTO counters (name, value) VALUES ('old', 1);
         INSERT INTO idempotency_keys (key, fingerprint, result, created_at)
             VALUES ('stale', 'increment old 1', '1', unixepoch() - 2 * 86400)",
    )
    .await;
    // The writer's first batch forgets expired keys after it has answered.
    post_keyed(&app, "/counters/other", "fresh", json!({})).await;
    let mut left: Vec<String> = Vec::new();
    for _ in 0..100 {
        left = sqlx::query_scalar("SELECT key FROM idempotency_keys ORDER BY key")
            .fetch_all(&app.peek().await)
            .await
            .unwrap();
        if left == ["fresh"] {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(left, ["fresh"]);
    // The stale key is new again.
    let r = post_keyed(&app, "/counters/old", "stale", json!({})).await;
    assert!(!r.headers().contains_key("idempotent-replayed"));
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 2);
    app.stop().await.unwrap();
}
