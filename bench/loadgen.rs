//! A closed-loop HTTP/1.1 load generator for tally's benchmark.
//!
//! Each of `--connections` keeps one connection busy: send, read the whole
//! answer, send again at once (clients that ignore `Retry-After`). It counts
//! answers by status and keeps a latency histogram per status class, then
//! prints one JSON object. Loopback targets only.
//!
//! Request templates: `{name}` becomes one of `--names` counter names
//! (`n0`..), `{visitor}` a random visitor id out of a million.
//!
//! `--addr` may be given more than once (several servers behind one load):
//! connection `i` then targets address `i mod n`, so the connections are
//! spread round-robin, and the output gains `by_addr`, the answers each
//! address gave, in the order given. With one address the output is
//! unchanged.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    time::{Duration, Instant},
};

use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, client::conn::http1};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Target address; must be on loopback. Repeat it to spread the
    /// connections over several servers, round-robin.
    #[arg(long, required = true)]
    addr: Vec<SocketAddr>,
    #[arg(long, default_value = "GET")]
    method: Method,
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
    /// Load-generator threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
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

fn render(template: &str, names: u32, rng: &mut fastrand::Rng) -> String {
    let mut out = template.to_owned();
    if out.contains("{name}") {
        out = out.replace("{name}", &format!("n{}", rng.u32(0..names.max(1))));
    }
    if out.contains("{visitor}") {
        out = out.replace("{visitor}", &format!("v{}", rng.u32(0..1_000_000)));
    }
    out
}

async fn connection(args: Args, addr: SocketAddr, deadline: Instant, seed: u64) -> Tally {
    let mut tally = Tally::new();
    let mut rng = fastrand::Rng::with_seed(seed);
    'reconnect: while Instant::now() < deadline {
        let Ok(stream) = TcpStream::connect(addr).await else {
            tally.errors += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let Ok((mut sender, conn)) = http1::handshake(TokioIo::new(stream)).await else {
            tally.errors += 1;
            continue;
        };
        tokio::spawn(conn);
        while Instant::now() < deadline {
            let path = render(&args.path, args.names, &mut rng);
            let mut req = Request::builder()
                .method(args.method.clone())
                .uri(path)
                .header("host", "bench");
            let body = match &args.body {
                Some(t) => {
                    req = req.header("content-type", "application/json");
                    Full::new(Bytes::from(render(t, args.names, &mut rng)))
                }
                None => Full::new(Bytes::new()),
            };
            let req = req.body(body).expect("valid request");
            if sender.ready().await.is_err() {
                tally.errors += 1;
                continue 'reconnect;
            }
            let started = Instant::now();
            match sender.send_request(req).await {
                Ok(res) => {
                    let status = res.status().as_u16();
                    if res.into_body().collect().await.is_err() {
                        tally.errors += 1;
                        continue 'reconnect;
                    }
                    tally.record(status, started.elapsed());
                }
                Err(_) => {
                    tally.errors += 1;
                    continue 'reconnect;
                }
            }
        }
    }
    tally
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
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .expect("runtime");
    let started = Instant::now();
    let (total, by_addr) = rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs_f64(args.duration);
        let tasks: Vec<_> = (0..args.connections)
            .map(|i| {
                let addr = args.addr[i % args.addr.len()];
                (
                    i % args.addr.len(),
                    tokio::spawn(connection(args.clone(), addr, deadline, i as u64 + 1)),
                )
            })
            .collect();
        let mut total = Tally::new();
        let mut by_addr = vec![0u64; args.addr.len()];
        for (slot, t) in tasks {
            let tally = t.await.expect("connection task");
            by_addr[slot] += tally.by_status.values().sum::<u64>();
            total.merge(tally);
        }
        (total, by_addr)
    });
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
