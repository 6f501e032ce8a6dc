//! Building the service from its settings, and the order it stops in.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::{
    config::Settings,
    db::{Database, DbOptions, Handle, WriterTask},
    http::{self, AppState, observe::MetricsState},
    observe, replica,
};

/// A built service: database open, writer running, listener bound.
pub struct Application {
    listener: TcpListener,
    router: axum::Router,
    /// `/metrics` on a listener of its own, when configured.
    metrics: Option<(TcpListener, axum::Router)>,
    /// The exporter's periodic upkeep; stopped with the service.
    upkeep: tokio::task::JoinHandle<()>,
    db: Handle,
    writer: WriterTask,
    settings: Settings,
}

impl Application {
    /// Opens the database (running migrations), starts the writer and binds
    /// the listener. Nothing is served until [`Self::run_until_stopped`].
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let prometheus = observe::install();
        observe::record_start(settings.queue_capacity as usize);
        let under_litestream = settings.litestream_socket.is_some();
        let opts = DbOptions {
            queue_capacity: settings.queue_capacity as usize,
            max_batch: settings.max_batch as usize,
            synchronous: settings.synchronous,
            readers: settings.readers,
            // Litestream must see every WAL frame before it is checkpointed
            // away, so under it Litestream alone checkpoints.
            checkpoints: !under_litestream,
            writer_delay: settings
                .test_writer_delay_ms
                .map(std::time::Duration::from_millis),
            writer_panic_after: settings.test_writer_panic_after,
        };
        let (db, writer) = Database::open(&settings.database, &opts).await?;
        let writer = writer.spawn().context("cannot start the writer thread")?;

        if let Some(socket) = &settings.litestream_socket {
            let db_path = std::path::absolute(&settings.database)
                .context("cannot resolve the database path")?;
            tracing::info!(socket = %socket.display(), "waiting for the first replica sync before serving");
            let started = std::time::Instant::now();
            let gate = replica::wait_for_replica(
                socket,
                &db_path,
                settings.replica_wait_timeout,
                Duration::from_secs(10),
            )
            .await;
            metrics::gauge!("tally_replica_wait_seconds").set(started.elapsed().as_secs_f64());
            if let Ok(status) = &gate {
                metrics::gauge!("tally_replica_txid").set(status.replicated_txid as f64);
            }
            if let Err(e) = gate {
                db.close();
                let _ = writer.join().await;
                db.close_readers().await;
                return Err(e.into());
            }
        }

        let state = AppState {
            db: db.clone(),
            admin_token: settings.admin_token.as_deref().map(Arc::from),
        };
        let metrics_state = MetricsState {
            handle: prometheus.clone(),
            db: db.clone(),
            db_path: settings.database.clone(),
        };
        let upkeep = tokio::spawn(observe::upkeep(prometheus, Duration::from_secs(5)));
        let (router, metrics) = match settings.metrics_listen {
            None => (
                http::router(state, settings.request_timeout, Some(metrics_state)),
                None,
            ),
            Some(addr) => {
                let listener = TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen on {addr} for metrics"))?;
                (
                    http::router(state, settings.request_timeout, None),
                    Some((listener, http::observe::metrics_router(metrics_state))),
                )
            }
        };
        let listener = TcpListener::bind(settings.listen)
            .await
            .with_context(|| format!("cannot listen on {}", settings.listen))?;
        Ok(Self {
            listener,
            router,
            metrics,
            upkeep,
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
    /// 1. stop accepting connections; let in-flight requests finish, for at
    ///    most the drain timeout;
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
        // Cancelled by the shutdown signal, or by the writer dying.
        let stop = CancellationToken::new();
        let stopping = CancellationToken::new();
        let (stop_on_signal, signal) = (stop.clone(), stopping.clone());
        let serve = axum::serve(self.listener, self.router)
            .with_graceful_shutdown(async move {
                tokio::select! {
                    () = shutdown => {}
                    () = stop_on_signal.cancelled() => {}
                }
                signal.cancel();
            })
            .into_future();
        let mut serve = tokio::spawn(serve);
        // Metrics stay up through the drain; they stop with the process.
        let metrics = self.metrics.map(|(listener, router)| {
            if let Ok(a) = listener.local_addr() {
                tracing::info!(addr = %a, "serving metrics");
            }
            tokio::spawn(async move { axum::serve(listener, router).await })
        });
        tracing::info!(%addr, "serving");

        // Without its writer tally can accept no write: stop serving, so
        // that the pod is restarted, rather than answer errors forever.
        let mut writer = self.writer;
        let mut writer_died = None;
        let drain_timeout = self.settings.drain_timeout;
        let served = loop {
            tokio::select! {
                r = &mut serve => break r,
                () = async { stopping.cancelled().await; tokio::time::sleep(drain_timeout).await } => {
                    tracing::warn!(?drain_timeout, "in-flight requests did not finish in time; dropping them");
                    serve.abort();
                    break Ok(Ok(()));
                }
                e = writer.died(), if writer_died.is_none() => {
                    tracing::error!(error = %e, "the writer stopped; shutting down");
                    writer_died = Some(e);
                    stop.cancel();
                }
            }
        };
        tracing::info!("HTTP stopped; draining the write queue");

        self.db.close();
        let written = match writer_died {
            Some(e) => Err(e),
            None => writer.join().await,
        };
        self.db.close_readers().await;
        if let Some(m) = metrics {
            m.abort();
        }
        self.upkeep.abort();

        served
            .context("HTTP server task failed")?
            .context("HTTP server failed")?;
        written?;
        tracing::info!("stopped cleanly");
        Ok(())
    }
}

/// Resolves on SIGTERM or ctrl-c.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("ctrl-c received, shutting down"),
        () = term => tracing::info!("SIGTERM received, shutting down"),
    }
}
