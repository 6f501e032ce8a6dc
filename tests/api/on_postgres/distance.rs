//! PostgreSQL a network away: every byte between tally and the server
//! takes a fixed time each way (a loopback forwarder that holds it back),
//! so that the round trips a batch makes, not the work in it, decide how
//! fast writes go.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use futures_util::future::join_all;
use reqwest::{Client, Response, StatusCode};
use serde_json::json;
use sqlx::{Connection, PgConnection};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
    sync::mpsc,
    task::JoinHandle,
};

use crate::{
    forwarding::accept_each,
    helpers::{ADMIN, Binary, json, problem, put_budget},
    on_postgres::scale_out::{global_calls, metric, processes, stop_all},
    postgres,
};

/// A loopback forwarder to `target` that delivers every chunk `delay`
/// after it was read, in order, each way: a round trip takes twice
/// `delay` more than on loopback. Armed with a trap ([`Distant::trap`]),
/// it turns the connection on which tally next sends those bytes into a
/// black hole: nothing more is delivered either way, and neither side is
/// told, as when a network partition falls between two packets (with
/// [`Distant::trap_after`], once those bytes have reached the server).
struct Distant {
    addr: SocketAddr,
    trap: Trap,
    /// Owns the accept loop, which owns every connection's task.
    task: JoinHandle<()>,
}

/// The bytes that, sent by tally, cut their connection off, and whether
/// they reach the server first; taken when they do.
type Trap = Arc<Mutex<Option<(&'static [u8], bool)>>>;

impl Distant {
    async fn start(target: SocketAddr, delay: Duration) -> Self {
        let trap = Trap::default();
        let armed = Arc::clone(&trap);
        let (addr, task) = accept_each(move |inbound| {
            let trap = Arc::clone(&armed);
            async move {
                let Ok(outbound) = TcpStream::connect(target).await else {
                    return;
                };
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                let (in_read, in_write) = inbound.into_split();
                let (out_read, out_write) = outbound.into_split();
                let cut = Arc::new(AtomicBool::new(false));
                tokio::join!(
                    held_back(in_read, out_write, delay, Some(trap), Arc::clone(&cut)),
                    held_back(out_read, in_write, delay, None, cut)
                );
            }
        })
        .await;
        Distant { addr, trap, task }
    }

    /// Cuts off the next connection on which tally sends `bytes`, before
    /// they reach the server.
    fn trap(&self, bytes: &'static [u8]) {
        *self.trap.lock().unwrap() = Some((bytes, false));
    }

    /// Cuts off the next connection on which tally sends `bytes`, once
    /// they have reached the server: its answer is lost.
    fn trap_after(&self, bytes: &'static [u8]) {
        *self.trap.lock().unwrap() = Some((bytes, true));
    }
}

impl Drop for Distant {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read, until the
/// connection is `cut`: from then on it reads and drops, and never closes
/// `to`. A chunk holding the `trap`'s bytes cuts it, delivered or not.
async fn held_back(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    delay: Duration,
    trap: Option<Trap>,
    cut: Arc<AtomicBool>,
) {
    // Each chunk with when to deliver it, and whether it is delivered
    // though the connection is cut (the trap's, sprung after).
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>, bool)>();
    let dropping = Arc::clone(&cut);
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            let chunk = &buf[..n];
            if let Some(trap) = &trap {
                let mut armed = trap.lock().unwrap();
                if let Some((bytes, after)) = *armed
                    && chunk.windows(bytes.len()).any(|w| w == bytes)
                {
                    *armed = None;
                    dropping.store(true, Ordering::SeqCst);
                    if after {
                        let _ = tx.send((Instant::now() + delay, chunk.to_vec(), true));
                    }
                }
            }
            if dropping.load(Ordering::SeqCst) {
                continue;
            }
            if tx
                .send((Instant::now() + delay, chunk.to_vec(), false))
                .is_err()
            {
                break;
            }
        }
        // Cut off, the peer hears nothing, not even an end.
        if dropping.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
    };
    let write = async move {
        while let Some((at, bytes, delivered_anyway)) = rx.recv().await {
            tokio::time::sleep_until(at.into()).await;
            if cut.load(Ordering::SeqCst) && !delivered_anyway {
                continue;
            }
            if to.write_all(&bytes).await.is_err() {
                break;
            }
        }
        match cut.load(Ordering::SeqCst) {
            true => std::future::pending::<()>().await,
            false => {
                let _ = to.shutdown().await;
            }
        }
    };
    tokio::join!(read, write);
}

/// What `bin` counted under `name`: the sum of counters `{name}-0` to
/// `{name}-9`, and budget `name`'s calls today.
async fn counted(client: &Client, bin: &Binary, name: &str) -> (i64, i64) {
    let mut total = 0;
    for n in 0..10 {
        let r = client
            .get(bin.url(&format!("/counters/{name}-{n}")))
            .send()
            .await
            .unwrap();
        total += json(r).await["value"].as_i64().unwrap();
    }
    (total, global_calls(client, bin, name).await)
}

/// One tally process on a fresh database `delay` away each way, whose
/// writer waits `hold_ms` before every batch (`TALLY_TEST_WRITER_DELAY_MS`),
/// and a budget `name` allowing `limit` calls a day (a visitor's and all);
/// and the database's own URL, on loopback. Its request timeout is 60 s: a
/// write sent as the writer begins its hold waits that hold, the next
/// batch's and a batch's whole time limit (15 s) that a test runs out,
/// 23 s, too near the default 30 s on a loaded machine.
async fn far_with_a_slow_writer(
    delay: Duration,
    hold_ms: &str,
    name: &str,
    limit: u32,
) -> (Distant, Vec<Binary>, String) {
    let url = postgres::fresh_database().await;
    let distant = Distant::start(target_of(&url), delay).await;
    let bins = processes(
        1,
        &through(&url, distant.addr),
        &[
            ("TALLY_TEST_WRITER_DELAY_MS", hold_ms),
            ("TALLY_REQUEST_TIMEOUT", "60"),
        ],
    );
    let limits = json!({"visitor_limit": limit, "global_limit": limit});
    put_budget(&Client::new(), &bins[0], name, limits).await;
    (distant, bins, url)
}

/// Sends a write that holds the slow writer, and gives it the time to
/// take it: what is sent next queues up behind it, to become one batch.
async fn hold_the_writer(client: &Client, bin: &Binary) -> JoinHandle<reqwest::Result<Response>> {
    let held = bin.batches_held();
    let busy = tokio::spawn(client.post(bin.url("/counters/first")).send());
    bin.writer_holds(held + 1).await;
    busy
}

/// Waits until `bin`'s write queue holds at least `n` commands: those sent
/// so far are queued, in the order sent, behind a writer held by its test
/// delay.
async fn queued(client: &Client, bin: &Binary, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let depth = metric(client, bin, "tally_write_queue_depth").await;
        if depth.is_some_and(|d| d >= n as f64) {
            return;
        }
        assert!(Instant::now() < deadline, "queue depth {depth:?}, not {n}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Counter `name`, written once, with its row then held by an outside
/// session (an operator's `SELECT ... FOR UPDATE` left open) on the
/// database at `url`, until the session given back commits or is dropped.
async fn held_counter(client: &Client, bin: &Binary, url: &str, name: &str) -> PgConnection {
    let r = client
        .post(bin.url(&format!("/counters/{name}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let mut holder = PgConnection::connect(url).await.unwrap();
    let hold = format!("BEGIN; SELECT * FROM counters WHERE name = '{name}' FOR UPDATE");
    sqlx::raw_sql(sqlx::AssertSqlSafe(hold))
        .execute(&mut holder)
        .await
        .unwrap();
    holder
}

/// Sends an increment of counter `name`; its answer, with the name.
fn post_counter(
    client: &Client,
    bin: &Binary,
    name: String,
) -> JoinHandle<(String, StatusCode, String)> {
    let request = client.post(bin.url(&format!("/counters/{name}")));
    tokio::spawn(async move {
        let r = request.send().await.unwrap();
        (name, r.status(), r.text().await.unwrap())
    })
}

/// The database URL `url` names, reached through a forwarder.
fn through(url: &str, forwarder: SocketAddr) -> String {
    let mut u = url::Url::parse(url).unwrap();
    u.set_port(Some(forwarder.port())).unwrap();
    u.set_host(Some("127.0.0.1")).unwrap();
    u.to_string()
}

fn target_of(url: &str) -> SocketAddr {
    let u = url::Url::parse(url).unwrap();
    let host = u.host_str().unwrap();
    let host = if host == "localhost" {
        "127.0.0.1"
    } else {
        host
    };
    format!("{host}:{}", u.port().unwrap_or(5432))
        .parse()
        .unwrap()
}

/// 200 keyed writes at once, increments and checks, on a database 50 ms
/// away, ten of them sent twice at once: a batch of keyed writes claims
/// its keys in one statement and stores their answers in another, so each
/// batch costs the same handful of round trips however many keyed writes
/// it holds, and a key twice in one batch takes one more round of them.
/// Command by command (five round trips each, a quarter of a second here)
/// the batches would run past their deadline and fail every caller in
/// them. Every write is `200`; each retry, sent again all at once, is its
/// first answer replayed, and nothing is counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keyed_writes_to_a_distant_database_go_a_batch_at_a_time() {
    let url = postgres::fresh_database().await;
    let distant = Distant::start(target_of(&url), Duration::from_millis(25)).await;
    let bins = processes(1, &through(&url, distant.addr), &[]);
    let client = Client::new();
    put_budget(
        &client,
        &bins[0],
        "far",
        json!({"visitor_limit": 1000, "global_limit": 1000}),
    )
    .await;
    let bin = &bins[0];
    // The last ten send the ten before them again, at once: a retry queued
    // beside its first try, often in the same batch.
    let send = |i: usize| {
        let i = if i >= 190 { i - 10 } else { i };
        let request = match i % 2 {
            0 => client.post(bin.url(&format!("/counters/far-{}", i % 10))),
            _ => client
                .post(bin.url("/budgets/far/check"))
                .json(&json!({"visitor": format!("v{}", i % 7)})),
        };
        async move {
            let r = request
                .header("idempotency-key", format!("far-{i}"))
                .send()
                .await
                .unwrap();
            let status = r.status();
            let replayed = r.headers().contains_key("idempotent-replayed");
            let text = r.text().await.unwrap();
            (status, replayed, text)
        }
    };
    let started = Instant::now();
    let first = join_all((0..200).map(send)).await;
    let took = started.elapsed();
    for (i, (status, replayed, text)) in first.iter().enumerate() {
        assert_eq!(*status, StatusCode::OK, "write {i}: {text}");
        assert!(!replayed || i >= 180, "write {i}");
    }
    // Of the two tries of one key, one ran and the other was answered
    // with what it committed.
    for i in 180..190 {
        let (a, b) = (&first[i], &first[i + 10]);
        assert!(a.1 != b.1, "write {i}: replayed {} and {}", a.1, b.1);
        let (a, b): (serde_json::Value, serde_json::Value) = (
            serde_json::from_str(&a.2).unwrap(),
            serde_json::from_str(&b.2).unwrap(),
        );
        assert_eq!(a, b, "write {i}");
    }
    // A batch at a time: a few seconds at most (command by command, past
    // 50 s).
    assert!(took < Duration::from_secs(20), "{took:?}");
    let again = join_all((0..200).map(send)).await;
    for (i, ((status, replayed, text), (_, _, first))) in again.iter().zip(&first).enumerate() {
        assert_eq!(*status, StatusCode::OK, "retry {i}: {text}");
        assert!(replayed, "retry {i}");
        let (a, b): (serde_json::Value, serde_json::Value) = (
            serde_json::from_str(text).unwrap(),
            serde_json::from_str(first).unwrap(),
        );
        assert_eq!(a, b, "retry {i}");
    }
    assert_eq!(counted(&client, bin, "far").await, (95, 95));
    stop_all(bins).await;
    drop(distant);
}

/// A batch cut off by the network: before its `COMMIT` went out, it
/// committed nothing, and its caller hears `503 database-unavailable`,
/// which a retry without a key may follow; once `COMMIT` went out, tally
/// cannot know whether the server got it, and its caller hears
/// `500 outcome-unknown`. Here the `COMMIT` never arrives either way, so
/// the next write finds the counter at 2. Both answers come at the
/// batch's time limit (15 s and a little), not TCP's minutes, and the
/// counter is written again once the server has ended the session cut
/// off, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_cut_off_says_whether_its_commit_went_out() {
    let url = postgres::fresh_database().await;
    let cases: [(&'static [u8], StatusCode, &str); 2] = [
        (
            b"BEGIN",
            StatusCode::SERVICE_UNAVAILABLE,
            "/problems/database-unavailable",
        ),
        (
            b"COMMIT",
            StatusCode::INTERNAL_SERVER_ERROR,
            "/problems/outcome-unknown",
        ),
    ];
    let runs = cases.map(|(trap, status, kind)| {
        let url = url.clone();
        async move {
            let distant = Distant::start(target_of(&url), Duration::ZERO).await;
            let bins = processes(1, &through(&url, distant.addr), &[]);
            let client = Client::new();
            let counter = bins[0].url(&format!("/counters/cut-{}", status.as_u16()));
            let r = client.post(&counter).send().await.unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            distant.trap(trap);
            let started = Instant::now();
            let r = client.post(&counter).send().await.unwrap();
            let took = started.elapsed();
            let p = problem(r, status).await;
            assert_eq!(p["type"], kind, "{p}");
            assert!(took < Duration::from_secs(25), "{took:?}");
            // The writer connects anew. Cut off after its upsert, the
            // batch's session holds the counter's row until the server
            // ends it (`idle_in_transaction_session_timeout`, 30 s): until
            // then writes to it are answered row-busy. The cut-off write
            // never committed.
            let deadline = Instant::now() + Duration::from_secs(60);
            let value = loop {
                let r = client.post(&counter).send().await.unwrap();
                if r.status() == StatusCode::OK {
                    break json(r).await["value"].clone();
                }
                let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
                assert!(
                    ["/problems/row-busy", "/problems/database-unavailable"]
                        .contains(&p["type"].as_str().unwrap()),
                    "{p}"
                );
                assert!(Instant::now() < deadline, "never writable again: {p}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            assert_eq!(value, 2);
            stop_all(bins).await;
        }
    });
    join_all(runs).await;
}

/// One client sending 200 different checks under one `Idempotency-Key` at
/// once, on budgets that do not exist, a database 50 ms away: the first
/// is refused (`404`), the others, different requests beside it, as
/// reusing its key (`422`), all without a statement of their own; the
/// other callers in the same batch are answered `200` as usual. (Had each
/// different request after a refusal run in a round of statements of its
/// own, the batch would have run past its time limit, failing them all.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_requests_under_one_key_cost_their_batch_nothing() {
    // A slow writer, so that everything below shares one batch.
    let (distant, bins, _) =
        far_with_a_slow_writer(Duration::from_millis(25), "4000", "real", 1000).await;
    let bin = &bins[0];
    let client = Client::new();
    let busy = hold_the_writer(&client, bin).await;
    let hostile: Vec<_> = (0..200)
        .map(|i| {
            tokio::spawn(
                client
                    .post(bin.url(&format!("/budgets/nope{i:03}/check")))
                    .header("idempotency-key", "one-key")
                    .json(&json!({"visitor": "v"}))
                    .send(),
            )
        })
        .collect();
    let increment = tokio::spawn(client.post(bin.url("/counters/innocent")).send());
    let check = tokio::spawn(
        client
            .post(bin.url("/budgets/real/check"))
            .header("idempotency-key", "alice-1")
            .json(&json!({"visitor": "alice"}))
            .send(),
    );
    // All of them behind the held batch, so in the next one together.
    queued(&client, bin, 202).await;
    assert_eq!(busy.await.unwrap().unwrap().status(), StatusCode::OK);
    // Their batch: held 4 s like every batch here, then run.
    let started = Instant::now();
    let (hostile, increment, check) = (join_all(hostile).await, increment.await, check.await);
    let took = started.elapsed();
    assert_eq!(increment.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(check.unwrap().unwrap().status(), StatusCode::OK);
    let mut statuses = std::collections::BTreeMap::new();
    for r in hostile {
        *statuses
            .entry(r.unwrap().unwrap().status().as_u16())
            .or_insert(0) += 1;
    }
    assert_eq!(statuses, [(404, 1), (422, 199)].into(), "{took:?}");
    assert!(took < Duration::from_secs(12), "{took:?}");
    stop_all(bins).await;
    drop(distant);
}

/// An operator's commands in a busy batch, on a database 50 ms away: a
/// put of the budget the checks are counted on, and the delete of a
/// counter, queued among 200 increments and checks (a quarter of them
/// keyed), all in one batch. The operator's commands run command by
/// command (about five round trips each); the increments and checks run
/// set-based around them: those on other names in a transaction of their
/// own, the checks of the budget put before and after it, each side in
/// one. Every write is `200` within a few seconds, the checks before the
/// put count against its old limits and those after it against the new
/// ones, and nothing is counted twice or lost. (Run all together command
/// by command, the batch would take about a minute, past its time limit,
/// and fail every caller in it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operators_command_leaves_the_writes_beside_it_set_based() {
    // A slow writer, so that everything below shares one batch.
    let (distant, bins, _) =
        far_with_a_slow_writer(Duration::from_millis(25), "4000", "hot", 1000).await;
    let bin = &bins[0];
    let client = Client::new();
    let r = client.post(bin.url("/counters/gone")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let write = |wave: usize, i: usize| {
        let request = match i % 2 {
            0 => client.post(bin.url(&format!("/counters/hot-{}", i % 10))),
            _ => client
                .post(bin.url("/budgets/hot/check"))
                .json(&json!({"visitor": format!("v{}", i % 7)})),
        };
        let request = match i % 4 {
            3 => request.header("idempotency-key", format!("op-{wave}-{i}")),
            _ => request,
        };
        tokio::spawn(async move {
            let r = request.send().await.unwrap();
            (r.status(), r.text().await.unwrap())
        })
    };
    let busy = hold_the_writer(&client, bin).await;
    let started = Instant::now();
    let before: Vec<_> = (0..100).map(|i| write(0, i)).collect();
    queued(&client, bin, 100).await;
    let put = tokio::spawn(
        client
            .put(bin.url("/budgets/hot"))
            .bearer_auth(ADMIN)
            .json(&json!({"visitor_limit": 2000, "global_limit": 2000}))
            .send(),
    );
    let delete = tokio::spawn(
        client
            .delete(bin.url("/counters/gone"))
            .bearer_auth(ADMIN)
            .send(),
    );
    queued(&client, bin, 102).await;
    let after: Vec<_> = (0..100).map(|i| write(1, i)).collect();
    queued(&client, bin, 202).await;
    assert_eq!(busy.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(put.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(
        delete.await.unwrap().unwrap().status(),
        StatusCode::NO_CONTENT
    );
    for (wave, writes, limit) in [(0, before, 1000), (1, after, 2000)] {
        for (i, w) in writes.into_iter().enumerate() {
            let (status, text) = w.await.unwrap();
            assert_eq!(status, StatusCode::OK, "wave {wave}, write {i}: {text}");
            if i % 2 == 1 {
                let d: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert_eq!(d["global_limit"], limit, "wave {wave}, write {i}: {d}");
            }
        }
    }
    let took = started.elapsed();
    // The writer's delay and a few rounds of round trips (command by
    // command: about a minute).
    assert!(took < Duration::from_secs(20), "{took:?}");
    assert_eq!(counted(&client, bin, "hot").await, (100, 100));
    // Deleted: deleting it again is refused.
    let r = client
        .delete(bin.url("/counters/gone"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    problem(r, StatusCode::NOT_FOUND).await;
    stop_all(bins).await;
    drop(distant);
}

/// Two puts of a budget amid 160 checks of it, one batch, a database
/// 50 ms away: five transactions (the checks before the first put, the
/// put, the checks between, the put, the checks after), each run of
/// checks set-based. Every check is `200` and counts against the limits
/// put before it. (With the runs after the second operator's command
/// applied together, command by command, that transaction ran past its
/// time limit and its 110 callers heard `503`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn operators_commands_amid_the_writes_on_their_name_cost_the_writes_nothing() {
    // A slow writer, so that everything below shares one batch.
    let (distant, bins, _) =
        far_with_a_slow_writer(Duration::from_millis(25), "4000", "hot", 1000).await;
    let bin = &bins[0];
    let client = Client::new();
    let limits = |limit: u32| json!({"visitor_limit": limit, "global_limit": limit});
    let check = |i: usize| {
        let request = client
            .post(bin.url("/budgets/hot/check"))
            .json(&json!({"visitor": format!("v{}", i % 7)}));
        tokio::spawn(async move {
            let r = request.send().await.unwrap();
            (r.status(), r.text().await.unwrap())
        })
    };
    let put = |limit: u32| {
        let request = client
            .put(bin.url("/budgets/hot"))
            .bearer_auth(ADMIN)
            .json(&limits(limit));
        tokio::spawn(async move { request.send().await.unwrap().status() })
    };
    let busy = hold_the_writer(&client, bin).await;
    let started = Instant::now();
    let mut waves = vec![(1000, (0..50).map(check).collect::<Vec<_>>())];
    let mut puts = Vec::new();
    let mut sent = 50;
    for (limit, checks) in [(2000, 60), (3000, 50)] {
        queued(&client, bin, sent).await;
        puts.push(put(limit));
        queued(&client, bin, sent + 1).await;
        waves.push((limit, (0..checks).map(check).collect()));
        sent += 1 + checks;
    }
    queued(&client, bin, sent).await;
    assert_eq!(busy.await.unwrap().unwrap().status(), StatusCode::OK);
    for put in puts {
        assert_eq!(put.await.unwrap(), StatusCode::OK);
    }
    for (limit, checks) in waves {
        for (i, c) in checks.into_iter().enumerate() {
            let (status, text) = c.await.unwrap();
            assert_eq!(status, StatusCode::OK, "limit {limit}, check {i}: {text}");
            let d: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(d["global_limit"], limit, "check {i}: {d}");
        }
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(20), "{took:?}");
    assert_eq!(global_calls(&client, bin, "hot").await, 160);
    stop_all(bins).await;
    drop(distant);
}

/// A keyed check, a put of its budget and the same check again (a
/// client's retry) in one batch: three transactions. The first one's
/// `COMMIT` reaches the server and its answer is lost, so the first try
/// hears `outcome-unknown`. The put, which did not run, hears
/// `database-unavailable`; the retry would have been answered from what
/// the first try stored, or run, so its outcome is unknown too (not a
/// denial that says nothing was counted). Sent again later, it is the
/// first try's answer replayed: the call was allowed and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_beside_a_commit_cut_off_hears_its_outcome_unknown() {
    // A slow writer, so that everything below shares one batch.
    let (distant, bins, _) = far_with_a_slow_writer(Duration::ZERO, "4000", "hot", 10).await;
    let bin = &bins[0];
    let client = Client::new();
    let limits = |limit: u32| json!({"visitor_limit": limit, "global_limit": limit});
    let check = || {
        client
            .post(bin.url("/budgets/hot/check"))
            .header("idempotency-key", "the-one")
            .json(&json!({"visitor": "v"}))
            .send()
    };
    let busy = hold_the_writer(&client, bin).await;
    let first = tokio::spawn(check());
    queued(&client, bin, 1).await;
    let put = tokio::spawn(
        client
            .put(bin.url("/budgets/hot"))
            .bearer_auth(ADMIN)
            .json(&limits(20))
            .send(),
    );
    queued(&client, bin, 2).await;
    let retry = tokio::spawn(check());
    queued(&client, bin, 3).await;
    assert_eq!(busy.await.unwrap().unwrap().status(), StatusCode::OK);
    distant.trap_after(b"COMMIT");
    for (what, r, status, kind) in [
        ("first", first, 500, "/problems/outcome-unknown"),
        ("put", put, 503, "/problems/database-unavailable"),
        ("retry", retry, 500, "/problems/outcome-unknown"),
    ] {
        let p = problem(
            r.await.unwrap().unwrap(),
            StatusCode::from_u16(status).unwrap(),
        )
        .await;
        assert_eq!(p["type"], kind, "{what}: {p}");
    }
    // Once the writer has a connection again: the first try committed.
    let deadline = Instant::now() + Duration::from_secs(60);
    let r = loop {
        let r = check().await.unwrap();
        if r.status() == StatusCode::OK {
            break r;
        }
        assert!(Instant::now() < deadline, "{}", r.text().await.unwrap());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(r.headers().contains_key("idempotent-replayed"));
    let d = json(r).await;
    assert_eq!(
        (&d["allowed"], &d["visitor_calls"]),
        (&json!(true), &json!(1)),
        "{d}"
    );
    stop_all(bins).await;
    drop(distant);
}

/// A counter's row held by an operator's open transaction, a database
/// 50 ms away, and one batch of 150 increments of other names with five
/// of the held one among them. The batch's set-based try finds a row held
/// without learning which, and the batch is cut in halves that share no
/// name until the held name is alone: a few set-based transactions in
/// all. Every write to another name is `200`, the five to the held row
/// `503` row-busy, and once the row is released it takes writes. (Command
/// by command, five round trips each, the batch ran past its time limit
/// and all 155 callers heard `503`, as would every batch like it for as
/// long as the row was held.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_row_in_a_distant_batch_costs_only_its_own_writes() {
    // A slow writer, so that everything below shares one batch.
    let (distant, bins, url) =
        far_with_a_slow_writer(Duration::from_millis(25), "4000", "hot", 10).await;
    let bin = &bins[0];
    let client = Client::new();
    let mut holder = held_counter(&client, bin, &url, "held").await;
    let busy = hold_the_writer(&client, bin).await;
    let started = Instant::now();
    let writes: Vec<_> = (0..155)
        .map(|i| match i % 31 {
            0 => "held".to_owned(),
            _ => format!("free-{i}"),
        })
        .map(|name| post_counter(&client, bin, name))
        .collect();
    queued(&client, bin, 155).await;
    assert_eq!(busy.await.unwrap().unwrap().status(), StatusCode::OK);
    let mut held = 0;
    for w in writes {
        let (name, status, text) = w.await.unwrap();
        match name.as_str() {
            "held" => {
                held += 1;
                assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
                let p: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert_eq!(p["type"], "/problems/row-busy", "{p}");
            }
            _ => assert_eq!(status, StatusCode::OK, "{name}: {text}"),
        }
    }
    assert_eq!(held, 5);
    let took = started.elapsed();
    eprintln!("the batch with a held row took {took:?}");
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
    let r = client.post(bin.url("/counters/held")).send().await.unwrap();
    assert_eq!(json(r).await["value"], 2, "the busy writes wrote nothing");
    let reads = (1..155).filter(|i| i % 31 != 0).map(|i| {
        let read = client.get(bin.url(&format!("/counters/free-{i}"))).send();
        async move { (i, json(read.await.unwrap()).await) }
    });
    for (i, v) in join_all(reads).await {
        assert_eq!(v["value"], 1, "free-{i}");
    }
    stop_all(bins).await;
    drop(distant);
}

/// A batch cut in halves around a held row, stopped part-way. Of its ten
/// names the first half holds the held one and four others: cut again, the
/// held name's own transaction commits (its write answered row-busy), and
/// so do the other four. Then the second half's connection goes silent, so
/// that the batch runs out of time before its `COMMIT`: its five writes
/// hear `503 database-unavailable` (nothing was done), and the row found
/// held is remembered all the same (`tally_rows_held`), so the next batch
/// is wary of it rather than finding it again at the cost of a lock
/// timeout and the cuts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_stopped_part_way_remembers_the_held_row_it_found() {
    // A slow writer, so that the writes below share one batch.
    let (distant, bins, url) = far_with_a_slow_writer(Duration::ZERO, "4000", "hot", 10).await;
    let bin = &bins[0];
    let client = Client::new();
    let mut holder = held_counter(&client, bin, &url, "a-held").await;
    // The second half's upsert: its names go as an array whose first
    // element (after the lower bound, 1) is "free-4", 6 bytes long; in the
    // whole batch's and the first half's, "a-held" comes first.
    distant.trap(b"\x00\x00\x00\x01\x00\x00\x00\x06free-4");
    let busy = hold_the_writer(&client, bin).await;
    // In this queue order (the held name first: its half, and its leaf,
    // run first).
    let mut writes = vec![post_counter(&client, bin, "a-held".into())];
    queued(&client, bin, 1).await;
    for i in 0..9 {
        writes.push(post_counter(&client, bin, format!("free-{i}")));
        queued(&client, bin, i + 2).await;
    }
    assert_eq!(busy.await.unwrap().unwrap().status(), StatusCode::OK);
    for w in writes {
        let (name, status, text) = w.await.unwrap();
        let want = match name.as_str() {
            "a-held" => Some("/problems/row-busy"),
            "free-0" | "free-1" | "free-2" | "free-3" => None,
            _ => Some("/problems/database-unavailable"),
        };
        let Some(want) = want else {
            assert_eq!(status, StatusCode::OK, "{name}: {text}");
            continue;
        };
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{name}: {text}");
        let p: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(p["type"], want, "{name}: {p}");
    }
    assert_eq!(
        metric(&client, bin, "tally_rows_held").await,
        Some(1.0),
        "the row found held is remembered"
    );
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
    stop_all(bins).await;
    drop(distant);
}
