//! Building the service from its settings, and the order it stops in.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{Context, bail};
use secrecy::ExposeSecret;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::{
    config::Settings,
    db::{Database, DbOptions, Handle, WriterTask},
    fds,
    http::{self, AppState, instrument::MetricsState},
    prometheus, replica,
    server::{self, Drained, Limits},
};

/// How often, under Litestream, tally asks how far the replica is behind.
const REPLICA_WATCH_EVERY: Duration = Duration::from_secs(2);

/// A built service: database open, writer running, listener bound.
pub struct Application {
    listener: TcpListener,
    router: axum::Router,
    /// `/metrics` on a listener of its own, when configured.
    metrics: Option<(TcpListener, axum::Router)>,
    /// The cap on open API connections, fitted to the open-files limit.
    max_connections: usize,
    /// Background tasks (the exporter's upkeep, the replica watch), stopped
    /// with the service.
    background: Vec<tokio::task::JoinHandle<()>>,
    db: Handle,
    writer: WriterTask,
    settings: Settings,
}

/// The admin token as requests can present it: set but empty is unset
/// (admin off), and so is one no `Authorization` field could carry, with
/// an error in the log that does not show it (it is a secret). Admin off,
/// not a failed start: counters and checks do not go down for it.
fn admin_token(settings: &Settings) -> Option<Arc<str>> {
    match settings.admin_token.as_ref().map(|t| t.expose_secret()) {
        Some("") => {
            tracing::warn!("TALLY_ADMIN_TOKEN is set but empty: admin endpoints are off (403)");
            None
        }
        Some(t) if !t.bytes().all(|b| b == b' ' || b.is_ascii_graphic()) => {
            tracing::error!(
                "TALLY_ADMIN_TOKEN holds a character other than visible ASCII and spaces, \
                 which no request could present: admin endpoints are off (403) until it is fixed"
            );
            None
        }
        Some(t) => {
            // Admin stays on: a start that refused it would take counters
            // and checks down with it.
            let length = t.trim().chars().count();
            if length < SHORT_ADMIN_TOKEN {
                tracing::warn!(
                    length,
                    "TALLY_ADMIN_TOKEN is shorter than {SHORT_ADMIN_TOKEN} characters: anyone \
                     who can reach the port can guess it (nothing slows down wrong tries). Use \
                     32 random characters or more, such as `openssl rand -hex 32` gives"
                );
            }
            Some(Arc::from(t))
        }
        None => None,
    }
}

/// Below this many characters an admin token is called guessable at start.
const SHORT_ADMIN_TOKEN: usize = 16;

impl Application {
    /// Opens the database (running migrations), starts the writer and binds
    /// the listener. Nothing is served until [`Self::run_until_stopped`].
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        // The listeners are bound once the database is open and the
        // replica gate has passed, which can take minutes; an address that
        // cannot be listened on is found now, before the database is
        // touched, not at the end of that wait.
        try_listen(&settings)?;
        // A clock before 1970 fails every connection (no `Date` header can
        // be written): tally would say it serves, and answer nothing.
        crate::db::clock::wall_clock().map_err(anyhow::Error::msg)?;
        let admin_token = admin_token(&settings);
        let exporter = prometheus::install();
        prometheus::record_start(settings.queue_capacity as usize, settings.database.engine());
        let max_connections = fds::cap_connections(&settings);
        let under_litestream = settings.litestream_socket.is_some();
        // Before a database is created under Litestream, the replica is
        // asked whether it holds one. That question and the gate below
        // share one wait, which the chart's startup probe is sized for
        // (migrations have a margin of their own).
        let asked = std::time::Instant::now();
        let replica_empty = match settings.database.sqlite_path() {
            Some(path) if under_litestream => {
                crate::db::ask_before_creating(path, || litestream_to_ask(&settings)).await?
            }
            _ => false,
        };
        let asked = asked.elapsed();
        let opts = DbOptions {
            queue_capacity: settings.queue_capacity as usize,
            max_batch: settings.max_batch as usize,
            synchronous: settings.synchronous,
            readers: settings.readers,
            counter_cache: usize::try_from(settings.counter_cache).unwrap_or(usize::MAX),
            // Litestream must see every WAL frame before it is checkpointed
            // away, so under it Litestream alone checkpoints.
            checkpoints: !under_litestream,
            // The gate below then needs one upload, whatever the replica
            // held: proof that the object store takes writes. And a start
            // without the database it served, or one the replica holds,
            // refuses to replace it; a missing one is created only where
            // the replica was asked and holds nothing.
            under_litestream,
            replica_empty,
            lock_timeout: settings.postgres_lock_timeout,
            schema: settings.postgres_schema.clone(),
            key_ttl: Some(settings.idempotency_key_ttl),
            storage_limit: settings.storage_limit,
            #[cfg(feature = "test-hooks")]
            writer_delay: settings
                .test_writer_delay_ms
                .map(std::time::Duration::from_millis),
            #[cfg(feature = "test-hooks")]
            writer_panic_after: settings.test_writer_panic_after,
            #[cfg(feature = "test-hooks")]
            publish_delay: settings
                .test_publish_delay_ms
                .map(std::time::Duration::from_millis),
        };
        let (db, writer) = Database::open(&settings.database, &opts).await?;
        let writer = writer.spawn().context("cannot start the writer thread")?;

        let mut background = Vec::new();
        if let Some(socket) = &settings.litestream_socket {
            let left = settings
                .replica_wait_timeout
                .saturating_sub(asked)
                .max(Duration::from_secs(1));
            match replica_gate(socket, &settings, left).await {
                Ok(watch) => background.push(watch),
                Err(e) => {
                    db.close();
                    let _ = writer.join().await;
                    db.close_readers().await;
                    return Err(e);
                }
            }
        }

        let state = AppState::new(db.clone(), admin_token);
        let metrics_state = MetricsState {
            handle: exporter.clone(),
            db: db.clone(),
            db_path: settings.database.sqlite_path().map(ToOwned::to_owned),
        };
        background.push(tokio::spawn(prometheus::upkeep(
            exporter,
            Duration::from_secs(5),
        )));
        let (router, metrics) = match settings.metrics_listen {
            None => (
                http::router(state, settings.request_timeout, Some(metrics_state)),
                None,
            ),
            Some(addr) => {
                let listener = server::bind(addr)
                    .with_context(|| format!("cannot listen on {addr} for metrics"))?;
                let metrics_router = http::instrument::metrics_router(metrics_state);
                (
                    http::router(state, settings.request_timeout, None),
                    Some((listener, metrics_router)),
                )
            }
        };
        let listener = server::bind(settings.listen)
            .with_context(|| format!("cannot listen on {}", settings.listen))?;
        Ok(Self {
            listener,
            router,
            metrics,
            max_connections,
            background,
            db,
            writer,
            settings,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or(self.settings.listen)
    }

    /// Where `/metrics` is served, when it has a listener of its own.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|(l, _)| l.local_addr().ok())
    }

    /// The database handle, for tests that look behind the API.
    pub fn db(&self) -> Handle {
        self.db.clone()
    }

    /// Serves until `shutdown` resolves, then stops in this order:
    ///
    /// 1. stop accepting connections; close those with no request in flight
    ///    at once; let in-flight requests finish, for at most the drain
    ///    timeout;
    /// 2. close the write queue; the writer commits and answers every command
    ///    already accepted, then checkpoints and closes the database;
    /// 3. close the readers.
    ///
    /// A clean stop returns `Ok`: under Litestream a non-zero exit would skip
    /// its final sync.
    pub async fn run_until_stopped(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let addr = self.local_addr();
        let settings = &self.settings;
        // Cancelled by the shutdown signal, or by the writer dying.
        let stop = CancellationToken::new();
        // Cancelled by the shutdown signal when there is a shutdown delay:
        // serving goes on, every answer asking its client to reconnect.
        let closing = CancellationToken::new();
        let limits = Limits {
            name: "api",
            // The API's request frame screens heads itself.
            screen: None,
            header_timeout: settings.header_timeout,
            body_timeout: server::body_timeout(settings.header_timeout, settings.request_timeout),
            max_connections: self.max_connections,
            // Behind a Service or an ingress, many clients share a few
            // addresses.
            per_peer: None,
            drain_timeout: settings.drain_timeout,
            closing: closing.clone(),
        };
        let mut serve = tokio::spawn(server::serve(
            self.listener,
            self.router,
            limits,
            stop.clone(),
        ));
        // Metrics stay up through the drain, so that it can be watched; they
        // stop last.
        let stop_metrics = CancellationToken::new();
        let metrics = self
            .metrics
            .map(|(listener, router)| serve_metrics(listener, router, settings, &stop_metrics));
        tracing::info!(%addr, "serving");

        // Without its writer tally can accept no write: stop serving, so
        // that the pod is restarted, rather than answer errors forever.
        let mut writer = self.writer;
        let mut writer_died = None;
        // Polled until it fires (which cancels `stop`, or `closing` first
        // when there is a delay), never after.
        let mut shutdown = std::pin::pin!(shutdown);
        let delay = settings.shutdown_delay;
        let lame_duck = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(lame_duck);
        let served = loop {
            tokio::select! {
                served = &mut serve => break served,
                () = &mut shutdown, if !stop.is_cancelled() && !closing.is_cancelled() => {
                    if delay.is_zero() {
                        stop.cancel();
                    } else {
                        // Closing first: once the line is out, every answer
                        // asks its client to reconnect (a test, or an
                        // operator, may act on the line at once).
                        closing.cancel();
                        lame_duck.as_mut().reset(tokio::time::Instant::now() + delay);
                        tracing::info!(
                            shutdown_delay = ?delay,
                            "serving on for the shutdown delay, asking every client to \
                             reconnect; then draining"
                        );
                    }
                }
                () = &mut lame_duck, if closing.is_cancelled() && !stop.is_cancelled() => {
                    stop.cancel();
                }
                e = writer.died(), if writer_died.is_none() => {
                    tracing::error!(error = %e, "the writer stopped; shutting down");
                    writer_died = Some(e);
                    stop.cancel();
                }
            }
        };
        if let Ok(Drained::TimedOut { dropped }) = &served {
            tracing::warn!(
                drain_timeout = ?settings.drain_timeout,
                dropped,
                "in-flight requests did not finish in time; dropping them"
            );
        }
        tracing::info!("HTTP stopped; draining the write queue");

        self.db.close();
        let mut abandoned = false;
        let written = match writer_died {
            Some(e) => Err(e),
            None => {
                match tokio::time::timeout(settings.writer_drain_timeout, writer.join()).await {
                    Ok(written) => written,
                    // Every caller of what it still held has gone (the HTTP
                    // drain is over), so stopping without it loses nothing
                    // answered; whatever it had not committed is not, and a
                    // transaction left open is rolled back by the database.
                    Err(_) => {
                        abandoned = true;
                        tracing::error!(
                            writer_drain_timeout = ?settings.writer_drain_timeout,
                            queued = self.db.queue_depth(),
                            on_batch_for = ?self.db.batch_age(),
                            "the writer did not finish within the writer drain timeout (the \
                             database not answering?); stopping without it: the commands it \
                             still held (queued, and the batch it was on, if any) had no caller \
                             left to answer, and may or may not have committed"
                        );
                        Ok(())
                    }
                }
            }
        };
        self.db.close_readers().await;
        if let Some(m) = metrics {
            stop_metrics.cancel();
            let _ = m.await;
        }
        for task in &self.background {
            task.abort();
        }

        served.context("HTTP server task failed")?;
        written?;
        match abandoned {
            true => tracing::warn!("stopped, without the writer"),
            false => tracing::info!("stopped cleanly"),
        }
        Ok(())
    }
}

/// Waits until the replica holds what the database holds (Litestream's
/// first sync has really reached it), then starts the watch that exports
/// how far the replica is behind.
async fn replica_gate(
    socket: &std::path::Path,
    settings: &Settings,
    wait: Duration,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let path = settings.database.sqlite_path().context(
        "TALLY_LITESTREAM_SOCKET is set, but Litestream replicates a SQLite file and the \
         database is PostgreSQL",
    )?;
    let db_path = std::path::absolute(path).context("cannot resolve the database path")?;
    tracing::info!(socket = %socket.display(), "waiting for the first replica sync before serving");
    let started = std::time::Instant::now();
    let gate = replica::wait_for_replica(socket, &db_path, wait, Duration::from_secs(10)).await;
    metrics::gauge!("tally_replica_wait_seconds").set(started.elapsed().as_secs_f64());
    let status = gate?;
    metrics::gauge!("tally_replica_txid").set(status.replicated_txid as f64);
    Ok(tokio::spawn(replica::watch(
        socket.to_owned(),
        db_path,
        REPLICA_WATCH_EVERY,
    )))
}

/// The Litestream tally asks, under Litestream, whether the replica holds a
/// database: with the configuration its parent (`litestream replicate
/// -exec tally`) replicates with, read from the parent's command line, so
/// that the replica asked is the one replicated to. Under another parent
/// (a wrapper that did not `exec`), TALLY_LITESTREAM_CONFIG's, else
/// Litestream's default.
fn litestream_to_ask(settings: &Settings) -> crate::restore::Litestream {
    let parent = std::os::unix::process::parent_id();
    let (config, no_expand_env) = match replica::replicating(parent) {
        Some(given) => {
            let config = crate::restore::config_path(given.config.as_deref());
            if let Some(told) = &settings.litestream_config
                && *told != config
            {
                tracing::warn!(
                    told = %told.display(),
                    replicating_with = %config.display(),
                    "TALLY_LITESTREAM_CONFIG is not the configuration Litestream, tally's \
                     parent, replicates with: tally asks the replica with Litestream's; \
                     restore-to, given TALLY_LITESTREAM_CONFIG, would restore from another"
                );
            }
            (config, given.no_expand_env)
        }
        None => {
            let config = crate::restore::config_path(settings.litestream_config.as_deref());
            tracing::warn!(
                parent_pid = parent,
                config = %config.display(),
                "tally's parent is not `litestream replicate` (a wrapper that did not exec \
                 tally?): where there is no database, the replica is asked with this \
                 configuration (TALLY_LITESTREAM_CONFIG, else LITESTREAM_CONFIG, else \
                 Litestream's default), which must be the one Litestream replicates with"
            );
            (config, false)
        }
    };
    crate::restore::Litestream {
        binary: settings.litestream.clone(),
        config,
        no_expand_env,
        timeout: settings.replica_wait_timeout,
    }
}

/// Binds each fixed address tally will listen on, without listening, and
/// lets it go at once. A port of 0 is left alone: any free port will do.
/// Two trial binds do not see each other, so two addresses that would
/// take one port are refused here too.
fn try_listen(settings: &Settings) -> anyhow::Result<()> {
    if let Some(metrics) = settings.metrics_listen
        && shares_a_port(settings.listen, metrics)
    {
        bail!(
            "TALLY_LISTEN ({}) and TALLY_METRICS_LISTEN ({metrics}) take the same port: \
             give /metrics a port of its own, or leave TALLY_METRICS_LISTEN unset to serve \
             it beside the API",
            settings.listen
        );
    }
    let fixed = [
        (Some(settings.listen), ""),
        (settings.metrics_listen, " for metrics"),
    ];
    for (addr, what) in fixed {
        if let Some(addr) = addr.filter(|a| a.port() != 0) {
            server::try_bind(addr).with_context(|| format!("cannot listen on {addr}{what}"))?;
        }
    }
    Ok(())
}

/// Whether listening at `a` and at `b` would take one port: the same
/// fixed port on the same address, or on a wildcard that covers the other
/// (`0.0.0.0` every IPv4 address, `[::]` every address, as Linux binds it
/// by default). An IPv4 address written the IPv6 way (`[::ffff:127.0.0.1]`)
/// is that IPv4 address.
fn shares_a_port(a: SocketAddr, b: SocketAddr) -> bool {
    let canonical = |s: SocketAddr| SocketAddr::new(s.ip().to_canonical(), s.port());
    let (a, b) = (canonical(a), canonical(b));
    let covers =
        |w: SocketAddr, x: SocketAddr| w.ip().is_unspecified() && (w.is_ipv6() || x.is_ipv4());
    a.port() != 0 && a.port() == b.port() && (a.ip() == b.ip() || covers(a, b) || covers(b, a))
}

/// Serves `/metrics` on its own listener until `stop` is cancelled.
fn serve_metrics(
    listener: TcpListener,
    router: axum::Router,
    settings: &Settings,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<Drained> {
    if let Ok(a) = listener.local_addr() {
        tracing::info!(addr = %a, "serving metrics");
    }
    let limits = Limits {
        name: "metrics",
        screen: Some(http::limits::screen),
        header_timeout: settings.header_timeout,
        // The metrics listener takes no bodies.
        body_timeout: settings.header_timeout,
        max_connections: server::METRICS_MAX_CONNECTIONS,
        // No one address takes every place: a client holding connections
        // open cannot keep Prometheus out.
        per_peer: Some(server::METRICS_PER_PEER),
        drain_timeout: Duration::from_secs(1),
        // Scrapers keep their connection: the metrics stay up to the end.
        closing: CancellationToken::new(),
    };
    tokio::spawn(server::serve(listener, router, limits, stop.clone()))
}

/// Why tally stopped serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// SIGTERM, ctrl-c or SIGHUP: a clean, requested stop.
    Signal,
    /// The parent process (Litestream) is gone.
    ParentExited { pid: u32 },
}

/// Resolves on SIGTERM, ctrl-c or SIGHUP, or, when `parent` is given, once that
/// process is no longer tally's parent.
///
/// Under Litestream (`replicate -exec tally`) tally must not outlive its
/// parent: with Litestream gone nothing replicates, and every write
/// acknowledged from then on is lost with the node. `parent` is the parent
/// pid read first thing in `main`; when it dies the kernel hands tally to a
/// reaper and `getppid()` changes, which is polled twice a second (a
/// syscall; no signal to race with). `PR_SET_PDEATHSIG` is not used: it
/// fires when the parent *thread* that forked tally exits, and the Go
/// runtime under Litestream can retire that thread while Litestream lives
/// on; and its signal would look like an orchestrator's SIGTERM.
///
/// A parent that died before `main` read its pid leaves nothing to see
/// here, but then the startup gate ([`replica::wait_for_replica`]) cannot
/// reach Litestream's socket and tally exits non-zero before serving; and a
/// gate that succeeds proves Litestream outlived that read, so the pid read
/// was Litestream's. This holds only when tally is Litestream's direct child
/// (a wrapper script must `exec` tally), which is logged at start.
pub async fn stop_requested(parent: Option<u32>, signal: impl Future<Output = ()>) -> StopReason {
    let orphaned = async {
        let Some(pid) = parent else {
            return std::future::pending().await;
        };
        let name = replica::process_name(pid).unwrap_or_default();
        if replica::is_litestream(&name) {
            tracing::info!(
                parent_pid = pid,
                parent = name,
                "stopping if the parent process exits"
            );
        } else {
            tracing::warn!(
                parent_pid = pid,
                parent = name,
                "the parent process is not Litestream: tally stops when it exits, but notices \
                 Litestream's death only as its direct child"
            );
        }
        let mut every = tokio::time::interval(Duration::from_millis(500));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            if std::os::unix::process::parent_id() != pid {
                tracing::error!(
                    parent_pid = pid,
                    "the parent process (Litestream) exited: nothing replicates new writes; \
                     stopping so that tally is restarted together with its backup"
                );
                return StopReason::ParentExited { pid };
            }
        }
    };
    tokio::select! {
        () = signal => StopReason::Signal,
        why = orphaned => why,
    }
}

/// Listens for SIGTERM, ctrl-c (SIGINT) and SIGHUP from the moment it is called,
/// and resolves on the first. Call it before serving: until a handler is
/// installed, SIGTERM's default action kills the process, and an
/// orchestrator may send it right after the first answer.
///
/// A hangup (the terminal tally was started from closing, say) would
/// otherwise kill it on the spot, with no drain: it stops tally as SIGTERM
/// does, unless tally runs under Litestream (`under_litestream`). There a
/// hangup reaches Litestream too, which ends at once, without its final
/// sync, and tally, drained cleanly, would exit `0` as if the replica had
/// everything; so under Litestream a SIGHUP is only logged, and tally
/// stops when Litestream does (non-zero, its parent gone: the last writes
/// reach the replica only when Litestream runs on the file again). A
/// tally started with SIGHUP ignored (under `nohup`) leaves it ignored:
/// listening for it would undo that.
pub fn shutdown_signal(under_litestream: bool) -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::SignalKind;
    let hangup = !ignored_from_start(SignalKind::hangup());
    let stopping: &[_] = &[
        (SignalKind::terminate(), "SIGTERM"),
        (SignalKind::interrupt(), "ctrl-c"),
        (SignalKind::hangup(), "SIGHUP"),
    ];
    let stops = first_signal(&stopping[..2 + usize::from(hangup && !under_litestream)]);
    // Listened for from now on all the same: its default action is exit.
    let hangups =
        (hangup && under_litestream).then(|| tokio::signal::unix::signal(SignalKind::hangup()));
    async move {
        let logged = async {
            let Some(Ok(mut hangups)) = hangups else {
                return std::future::pending().await;
            };
            while hangups.recv().await.is_some() {
                tracing::warn!(
                    "SIGHUP received: under Litestream, which a hangup ends without its final \
                     sync, tally stops when Litestream does (SIGTERM or ctrl-c stops both \
                     cleanly)"
                );
            }
            std::future::pending().await
        };
        let name = tokio::select! {
            name = stops => name,
            () = logged => "SIGHUP",
        };
        tracing::info!("{name} received, shutting down");
    }
}

/// Whether this process was started with `kind` ignored (as `nohup` starts
/// its command with SIGHUP ignored): listening for it would undo that.
/// Read from `/proc/self/status`; not ignored where that cannot be read.
pub fn ignored_from_start(kind: tokio::signal::unix::SignalKind) -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    ignored_in(&status, kind.as_raw_value())
}

/// Whether `status` (as `/proc/PID/status` reads) has `signal` in its
/// `SigIgn` mask.
fn ignored_in(status: &str, signal: i32) -> bool {
    let Some(mask) = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
    else {
        return false;
    };
    (1..=64).contains(&signal) && mask & (1 << (signal - 1)) != 0
}

/// Listens for `signals` from the moment it is called, and resolves with
/// the name of the first to arrive. One that cannot be listened for is
/// logged, and never arrives.
pub fn first_signal(
    signals: &[(tokio::signal::unix::SignalKind, &'static str)],
) -> impl Future<Output = &'static str> + Send + use<> {
    let listening = signals.iter().map(|&(kind, name)| {
        let stream = tokio::signal::unix::signal(kind);
        Box::pin(async move {
            match stream {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for {name}");
                    std::future::pending::<()>().await;
                }
            }
            name
        })
    });
    let listening: Vec<_> = listening.collect();
    async move { futures_util::future::select_all(listening).await.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_ignored_from_the_start_is_read_from_its_mask() {
        // SIGHUP (1) and SIGPIPE (13) ignored, as `nohup` under a shell
        // that ignores SIGPIPE starts a command.
        let status = "Name:\ttally\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000001001\n\
                      SigCgt:\t0000000180004000\n";
        assert!(ignored_in(status, 1));
        assert!(ignored_in(status, 13));
        assert!(!ignored_in(status, 15), "SIGTERM is caught, not ignored");
        assert!(!ignored_in(status, 0));
        assert!(!ignored_in(status, 65));
        assert!(!ignored_in("Name:\ttally\n", 1), "no mask: not ignored");
    }

    #[test]
    fn two_addresses_share_a_port_when_one_covers_the_other() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        for (a, b, shared) in [
            ("127.0.0.1:3000", "127.0.0.1:3000", true),
            ("0.0.0.0:3000", "127.0.0.1:3000", true),
            ("[::]:3000", "127.0.0.1:3000", true),
            ("[::]:3000", "[::1]:3000", true),
            ("[::]:3000", "0.0.0.0:3000", true),
            ("0.0.0.0:3000", "[::1]:3000", false),
            ("127.0.0.1:3000", "[::1]:3000", false),
            ("127.0.0.1:3000", "127.0.0.2:3000", false),
            ("127.0.0.1:3000", "[::ffff:127.0.0.1]:3000", true),
            ("0.0.0.0:3000", "[::ffff:127.0.0.1]:3000", true),
            ("[::ffff:0.0.0.0]:3000", "127.0.0.1:3000", true),
            ("[::ffff:127.0.0.1]:3000", "[::1]:3000", false),
            ("0.0.0.0:3000", "127.0.0.1:3001", false),
            ("127.0.0.1:0", "127.0.0.1:0", false),
        ] {
            assert_eq!(shares_a_port(at(a), at(b)), shared, "{a} {b}");
            assert_eq!(shares_a_port(at(b), at(a)), shared, "{b} {a}");
        }
    }
}
