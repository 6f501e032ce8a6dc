//! The recipes of "Calling tally" (`docs/calling-tally.md`), run against an
//! overloaded tally (a one-slot queue in front of a slow writer, and
//! clients whose read timeout is shorter than a write queued behind a batch
//! waits): every intended
//! write lands exactly once, whatever mix of 429s, timeouts and retries it
//! took.
//!
//! The Python recipe is taken from that page as it stands and run with the
//! test venv's Python (urllib3 comes with moto). The Rust recipe is the
//! function between the markers below, which the page must quote verbatim.

use std::{path::Path, time::Duration};

use serde_json::Value;

use crate::{
    helpers::{sample, spawn_with},
    loopback::tool,
};

/// How long the writer holds each batch, and the clients' timeout: a write
/// that finds the writer idle is answered in one hold and well within the
/// timeout (100 ms to spare for a loaded host: with 40, every try of a
/// write could miss it, keyed retries going through the writer too);
/// one queued behind a batch waits two holds, past it.
const HOLD_MS: u64 = 150;
const TIMEOUT_MS: u64 = 250;

/// An app that answers many writes `429` and some too slowly for a
/// client's read timeout.
async fn overloaded() -> crate::helpers::TestApp {
    spawn_with(|s| {
        s.queue_capacity = 1;
        s.test_writer_delay_ms = Some(HOLD_MS);
    })
    .await
}

/// The page that documents the recipes, relative to the repository.
const PAGE: &str = "docs/calling-tally.md";

fn page() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(PAGE)).unwrap()
}

/// The first fenced block of `lang` after `heading` in [`PAGE`].
fn page_block(heading: &str, lang: &str) -> String {
    let text = page();
    let from = text
        .find(heading)
        .unwrap_or_else(|| panic!("{PAGE} has no {heading:?}"));
    let fence = format!("```{lang}\n");
    let start = text[from..]
        .find(&fence)
        .map(|i| from + i + fence.len())
        .unwrap_or_else(|| panic!("no {lang} block after {heading:?}"));
    let len = text[start..].find("```").unwrap();
    text[start..start + len].to_owned()
}

async fn counter(app: &crate::helpers::TestApp, name: &str) -> i64 {
    let v: Value = app
        .get(&format!("/counters/{name}"))
        .await
        .json()
        .await
        .unwrap();
    v["value"].as_i64().unwrap()
}

/// Four threads, ten writes each, of known sizes; a read timeout shorter
/// than two of the writer's holds makes some first tries end before their
/// (committed) answer arrives.
const DRIVER: &str = r#"
import sys, threading
base = sys.argv[1]
http = urllib3.PoolManager(retries=RETRY, timeout=urllib3.Timeout(connect=2.0, read=float(sys.argv[2])))
errors = []
def work(t):
    for i in range(10):
        try:
            increment(base, "py", t * 10 + i + 1)
        except Exception as e:
            errors.append(repr(e))
threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print("errors", len(errors), errors[:3])
sys.exit(1 if errors else 0)
"#;

#[tokio::test(flavor = "multi_thread")]
async fn the_python_recipe_lands_every_write_exactly_once_under_overload() {
    let app = overloaded().await;
    let recipe = page_block("# Calling tally", "python");
    let driver = format!("{recipe}\n{DRIVER}");
    let out = tokio::time::timeout(
        Duration::from_secs(180),
        tokio::process::Command::new(tool("python"))
            .arg("-c")
            .arg(&driver)
            .arg(format!("http://{}", app.addr))
            .arg((TIMEOUT_MS as f64 / 1000.0).to_string())
            .output(),
    )
    .await
    .expect("the recipe finished within its bound")
    .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    // 1 + 2 + ... + 40: each intended write once, never twice.
    assert_eq!(counter(&app, "py").await, 820, "{said}");
    met_a_full_queue_and_timeouts(&app).await;
}

/// Asserts that the run met what the recipes are for: a full queue
/// (`429`), and tries whose client gave up before their committed answer.
async fn met_a_full_queue_and_timeouts(app: &crate::helpers::TestApp) {
    let metrics = app.get("/metrics").await.text().await.unwrap();
    let rejected = sample(&metrics, "tally_write_rejected_total").unwrap_or(0.0);
    assert!(rejected > 0.0, "the run must have met a full queue");
    let gone = r#"tally_write_committed_caller_gone_total{command="increment"}"#;
    let gone = sample(&metrics, gone).unwrap_or(0.0);
    assert!(gone > 0.0, "the run must have met a timeout after a commit");
}

// recipe: rust
/// Adds `by` to counter `name` exactly once: one Idempotency-Key for the
/// intended write, reused by every retry; 429 and 503 are retried after
/// their Retry-After, a lost answer (timeout, 500 outcome-unknown, a 200
/// cut off) at once with a short back-off. Any other answer is final.
async fn increment(
    client: &reqwest::Client,
    base: &str,
    name: &str,
    by: i64,
) -> Result<i64, String> {
    let key = format!("{:032x}", fastrand::u128(..));
    let mut backoff = Duration::from_millis(50);
    for _ in 0..30 {
        let sent = client
            .post(format!("{base}/counters/{name}"))
            .header("Idempotency-Key", &key)
            .json(&serde_json::json!({ "by": by }))
            .send()
            .await;
        let wait = match sent {
            // An answer cut off (the timeout struck mid-body) is lost too.
            Ok(r) if r.status().is_success() => match r.json::<serde_json::Value>().await {
                Ok(v) => return v["value"].as_i64().ok_or("no value".to_owned()),
                Err(_) => backoff,
            },
            Ok(r) if matches!(r.status().as_u16(), 429 | 503) => r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .map_or(backoff, Duration::from_secs),
            Ok(r) if r.status().as_u16() == 500 => backoff,
            Ok(r) => {
                return Err(format!(
                    "{}: {}",
                    r.status(),
                    r.text().await.unwrap_or_default()
                ));
            }
            Err(e) if e.is_timeout() || e.is_connect() || e.is_request() => backoff,
            Err(e) => return Err(e.to_string()),
        };
        tokio::time::sleep(wait).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
    Err("gave up after 30 tries".to_owned())
}
// end of recipe

#[tokio::test(flavor = "multi_thread")]
async fn the_rust_recipe_lands_every_write_exactly_once_under_overload() {
    let source = std::fs::read_to_string(file!()).unwrap();
    let start = source.find("// recipe: rust\n").unwrap() + "// recipe: rust\n".len();
    let len = source[start..].find("// end of recipe").unwrap();
    assert!(
        page().contains(&source[start..start + len]),
        "{PAGE}'s Rust recipe must be the one tested here, verbatim"
    );

    let app = overloaded().await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(TIMEOUT_MS))
        .build()
        .unwrap();
    let base = format!("http://{}", app.addr);
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..4i64 {
        let (client, base) = (client.clone(), base.clone());
        tasks.spawn(async move {
            for i in 0..10 {
                increment(&client, &base, "rs", t * 10 + i + 1).await?;
            }
            Ok::<_, String>(())
        });
    }
    let all = tokio::time::timeout(Duration::from_secs(180), tasks.join_all())
        .await
        .expect("the recipe finished within its bound");
    assert!(all.iter().all(Result::is_ok), "{all:?}");
    assert_eq!(counter(&app, "rs").await, 820);
    met_a_full_queue_and_timeouts(&app).await;
}
