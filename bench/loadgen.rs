//! A closed-loop HTTP/1.1 load generator for tally's benchmark, made to cost
//! less per request than the server it measures.
//!
//! Each of `--connections` keeps one connection busy: send, read the whole
//! answer, send again at once (clients that ignore `Retry-After`). It counts
//! answers by status and keeps a latency histogram per status class, then
//! prints one JSON object. Loopback targets only.
//!
//! `bench/run` pins the server to one core and this client to the other, so
//! that the rates it reports are the server's, not the client's: requests
//! are rendered once, before the clock starts, into a pool of raw request
//! bytes; answers are read with a minimal parser (status line and
//! `content-length`, nothing else); and by default everything runs on one
//! thread. Against the bare axum server (bench/bare.rs) it reaches the
//! server's one-core rate, as `wrk -t1` does.
//!
//! Request templates: `{name}` becomes one of `--names` counter names
//! (`n0`..), `{visitor}` a random visitor id out of `--visitors` (a million).
//!
//! `--addr` may be given more than once (several servers behind one load):
//! connection `i` then targets address `i mod n`, so the connections are
//! spread round-robin, and the output gains `by_addr`, the answers each
//! address gave, in the order given. With one address the output is
//! unchanged.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    rc::Rc,
    time::{Duration, Instant},
};

use clap::Parser;
use hdrhistogram::Histogram;
use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Target address; must be on loopback. Repeat it to spread the
    /// connections over several servers, round-robin.
    #[arg(long, required = true)]
    addr: Vec<SocketAddr>,
    #[arg(long, default_value = "GET")]
    method: String,
    /// Path template, e.g. `/counters/{name}`.
    #[arg(long)]
    path: String,
    /// Body template (sent as JSON when given).
    #[arg(long)]
    body: Option<String>,
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Seconds to run.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// How many distinct names `{name}` ranges over.
    #[arg(long, default_value_t = 1)]
    names: u32,
    /// How many distinct visitors `{visitor}` ranges over.
    #[arg(long, default_value_t = 1_000_000)]
    visitors: u32,
    /// Load-generator threads (each runs its share of the connections on
    /// a single-threaded runtime).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Never sleep: keep each thread's runtime polling instead of waiting
    /// in the kernel for the next answer. On loopback an answer written to
    /// a sleeping client wakes the client's thread from inside the
    /// server's write, and the server's CPU time pays for that wake-up
    /// (an interprocessor interrupt); a spinning client is never asleep.
    #[arg(long)]
    spin: bool,
}

/// What one connection saw.
struct Tally {
    by_status: BTreeMap<u16, u64>,
    latency: BTreeMap<&'static str, Histogram<u64>>,
    errors: u64,
}

impl Tally {
    fn new() -> Self {
        Self {
            by_status: BTreeMap::new(),
            latency: BTreeMap::new(),
            errors: 0,
        }
    }

    fn record(&mut self, status: u16, took: Duration) {
        *self.by_status.entry(status).or_default() += 1;
        let class = match status {
            200 => "200",
            429 => "429",
            _ => "other",
        };
        let micros = took.as_micros().clamp(1, 60_000_000) as u64;
        for key in [class, "all"] {
            self.latency
                .entry(key)
                .or_insert_with(|| Histogram::new_with_bounds(1, 60_000_000, 3).expect("bounds"))
                .saturating_record(micros);
        }
    }

    fn merge(&mut self, other: Tally) {
        for (s, n) in other.by_status {
            *self.by_status.entry(s).or_default() += n;
        }
        for (k, h) in other.latency {
            match self.latency.get_mut(k) {
                Some(mine) => mine.add(&h).expect("same bounds"),
                None => {
                    self.latency.insert(k, h);
                }
            }
        }
        self.errors += other.errors;
    }
}

/// The raw requests connections pick from at random: every name once when
/// only names vary (up to 65,536 of them), else 65,536 random choices. Each
/// request's name and visitor are chosen once, for its path and its body
/// alike.
fn request_pool(args: &Args) -> Vec<Vec<u8>> {
    let templates = format!("{} {}", args.path, args.body.as_deref().unwrap_or(""));
    let names = args.names.max(1);
    let size = if templates.contains("{visitor}") {
        65_536
    } else if templates.contains("{name}") {
        names.min(65_536)
    } else {
        1
    };
    let mut rng = fastrand::Rng::with_seed(7);
    (0..size)
        .map(|i| {
            let name = match size == names {
                true => i,
                false => rng.u32(0..names),
            };
            let visitor = rng.u32(0..args.visitors.max(1));
            let fill = |template: &str| {
                template
                    .replace("{name}", &format!("n{name}"))
                    .replace("{visitor}", &format!("v{visitor}"))
            };
            let mut req = format!(
                "{} {} HTTP/1.1\r\nhost: bench\r\n",
                args.method,
                fill(&args.path)
            );
            match &args.body {
                Some(t) => {
                    let body = fill(t);
                    req.push_str(&format!(
                        "content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    ));
                }
                None if args.method != "GET" && args.method != "HEAD" => {
                    req.push_str("content-length: 0\r\n\r\n");
                }
                None => req.push_str("\r\n"),
            }
            req.into_bytes()
        })
        .collect()
}

/// What a complete answer at the start of `buf` is: its status, its length
/// in bytes and whether the server closes the connection after it; `None`
/// while more bytes are needed; `Err` when it is not an answer this client
/// can read (no `content-length`, a malformed head).
fn answer(buf: &[u8]) -> Result<Option<(u16, usize, bool)>, ()> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() > 64 * 1024 {
            Err(())
        } else {
            Ok(None)
        };
    };
    let head = &buf[..end];
    if head.len() < 12 || !head.starts_with(b"HTTP/1.1 ") {
        return Err(());
    }
    let status = std::str::from_utf8(&head[9..12])
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(())?;
    let mut length: Option<usize> = None;
    let mut close = false;
    for line in head.split(|&b| b == b'\n').skip(1) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"content-length") {
            length = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
        } else if name.eq_ignore_ascii_case(b"connection") {
            close = value.eq_ignore_ascii_case(b"close");
        }
    }
    let total = end + 4 + length.ok_or(())?;
    Ok((buf.len() >= total).then_some((status, total, close)))
}

async fn connection(
    pool: Rc<Vec<Vec<u8>>>,
    addr: SocketAddr,
    deadline: Instant,
    seed: u64,
) -> Tally {
    let mut tally = Tally::new();
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut buf = Vec::with_capacity(16 * 1024);
    'reconnect: while Instant::now() < deadline {
        let Ok(mut stream) = TcpStream::connect(addr).await else {
            tally.errors += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        while Instant::now() < deadline {
            let req = &pool[rng.usize(0..pool.len())];
            let started = Instant::now();
            if stream.write_all(req).await.is_err() {
                tally.errors += 1;
                continue 'reconnect;
            }
            buf.clear();
            let (status, close) = loop {
                if buf.capacity() - buf.len() < 4096 {
                    buf.reserve(16 * 1024);
                }
                match stream.read_buf(&mut buf).await {
                    Ok(0) | Err(_) => {
                        tally.errors += 1;
                        continue 'reconnect;
                    }
                    Ok(_) => {}
                }
                match answer(&buf) {
                    Ok(None) => {}
                    // A whole answer and nothing after it: nothing was sent
                    // that another answer could follow.
                    Ok(Some((status, len, close))) if len == buf.len() => break (status, close),
                    Ok(Some(_)) | Err(()) => {
                        tally.errors += 1;
                        continue 'reconnect;
                    }
                }
            };
            tally.record(status, started.elapsed());
            if close {
                continue 'reconnect;
            }
        }
    }
    tally
}

/// One thread's share of the connections, on a runtime of its own.
fn run_thread(
    pool: Vec<Vec<u8>>,
    targets: Vec<(usize, SocketAddr, u64)>,
    deadline: Instant,
    spin: bool,
) -> Vec<(usize, Tally)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    let pool = Rc::new(pool);
    local.block_on(&rt, async move {
        if spin {
            tokio::task::spawn_local(async move {
                while Instant::now() < deadline {
                    tokio::task::yield_now().await;
                }
            });
        }
        let tasks: Vec<_> = targets
            .into_iter()
            .map(|(slot, addr, seed)| {
                (
                    slot,
                    tokio::task::spawn_local(connection(Rc::clone(&pool), addr, deadline, seed)),
                )
            })
            .collect();
        let mut out = Vec::new();
        for (slot, t) in tasks {
            out.push((slot, t.await.expect("connection task")));
        }
        out
    })
}

fn summary(h: &Histogram<u64>) -> Value {
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    json!({"count": h.len(), "p50_ms": ms(0.5), "p99_ms": ms(0.99), "max_ms": h.max() as f64 / 1000.0})
}

fn main() {
    let args = Args::parse();
    assert!(
        args.addr.iter().all(|a| a.ip().is_loopback()),
        "loadgen only targets loopback addresses"
    );
    let pool = request_pool(&args);
    let threads = args.threads.clamp(1, args.connections.max(1));
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(args.duration);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let targets: Vec<_> = (0..args.connections)
                .filter(|i| i % threads == t)
                .map(|i| {
                    (
                        i % args.addr.len(),
                        args.addr[i % args.addr.len()],
                        i as u64 + 1,
                    )
                })
                .collect();
            let pool = pool.clone();
            let spin = args.spin;
            std::thread::spawn(move || run_thread(pool, targets, deadline, spin))
        })
        .collect();
    let mut total = Tally::new();
    let mut by_addr = vec![0u64; args.addr.len()];
    for h in handles {
        for (slot, tally) in h.join().expect("load thread") {
            by_addr[slot] += tally.by_status.values().sum::<u64>();
            total.merge(tally);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let requests: u64 = total.by_status.values().sum();
    let ok = total.by_status.get(&200).copied().unwrap_or(0);
    let mut out = json!({
        "requests": requests,
        "elapsed_s": elapsed,
        "rps": requests as f64 / elapsed,
        "ok_rps": ok as f64 / elapsed,
        "status": total.by_status.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "errors": total.errors,
        "latency": total.latency.iter().map(|(k, h)| (k.to_string(), summary(h))).collect::<serde_json::Map<_, _>>(),
    });
    if args.addr.len() > 1 {
        out["by_addr"] = args
            .addr
            .iter()
            .zip(&by_addr)
            .map(|(a, n)| json!({"addr": a.to_string(), "answers": n}))
            .collect::<Vec<_>>()
            .into();
    }
    println!("{out}");
}
