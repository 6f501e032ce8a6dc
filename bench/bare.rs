//! The benchmark's external ceiling: a bare axum server with one no-op
//! route and nothing else, on the same runtime settings as tally (tokio's
//! multi-threaded runtime with a worker per core, mimalloc, HTTP/1.1 with
//! keep-alive). `bench/run` measures it in the same run as tally, so every
//! tally scenario can be told as a fraction of what the stack itself can
//! do on this machine, now. Loopback only.

use std::net::SocketAddr;

use axum::{Router, routing::get};
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Args {
    /// Where to listen; must be on loopback.
    #[arg(long)]
    addr: SocketAddr,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    if !args.addr.ip().is_loopback() {
        eprintln!("bare: {} is not a loopback address", args.addr);
        std::process::exit(2);
    }
    let app = Router::new().route("/livez", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(args.addr).await?;
    let mut term = signal(SignalKind::terminate())?;
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            term.recv().await;
        })
        .await
}
