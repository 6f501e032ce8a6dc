use std::{process::ExitCode, time::Duration};

use anyhow::{Context, bail};
use clap::Parser;
use tally::{
    Application,
    app::{StopReason, stop_requested},
    config::{Cli, Command},
};

// Every request allocates a little on one thread and frees it on another;
// mimalloc handles that pattern with far less contention than glibc's malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tally: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = rt.block_on(run());
    // Not a wait on whatever blocking work is still under way (a walk of
    // the database's directory, a host name looked up while DNS does not
    // answer): dropped, the runtime would wait for it without limit, past
    // every timeout of the stop.
    rt.shutdown_timeout(Duration::from_secs(1));
    code
}

async fn run() -> ExitCode {
    // Read before anything else: the later the read, the longer a parent
    // could die unnoticed (see `stop_requested`).
    let parent = std::os::unix::process::parent_id();
    if let Some(name) = tally::config::variable_not_utf8(std::env::vars_os()) {
        eprintln!(
            "tally: the value of {name} is not valid UTF-8: every TALLY_* setting, a path \
             included, is read as UTF-8 text"
        );
        return ExitCode::from(2);
    }
    let cli = Cli::parse();
    if let Err(e) = tally::telemetry::init() {
        eprintln!("tally: {e}");
        return ExitCode::FAILURE;
    }
    if let Err(e) = cli.settings.database.check() {
        tracing::error!(error = e, "tally failed");
        eprintln!("tally: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => serve(cli.settings, parent).await,
        Command::Contention { writers, hold_ms } => {
            contention(writers as usize, Duration::from_millis(hold_ms)).await
        }
        Command::RestoreTo {
            timestamp,
            timeout,
            at_every_start,
        } => restore_to(&cli.settings, timestamp, timeout, at_every_start).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let text = tally::telemetry::error_text(&e);
            tracing::error!(error = text, "tally failed");
            eprintln!("tally: {text}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(settings: tally::Settings, parent: u32) -> anyhow::Result<()> {
    tracing::info!(?settings, "starting");
    // One process at a time on a SQLite database, held until tally exits:
    // not while a restore fills its directory, nor beside another tally.
    let lock = match &settings.database {
        tally::Storage::Sqlite(db) => Some(lock_database(db)?),
        tally::Storage::Postgres(_) => None,
    };
    let served = serve_locked(settings, parent).await;
    // Held until the process exits, which releases it: a writer left
    // behind by the stop (see `TALLY_WRITER_DRAIN_TIMEOUT`) may still be
    // at the file until then.
    std::mem::forget(lock);
    served
}

async fn serve_locked(settings: tally::Settings, parent: u32) -> anyhow::Result<()> {
    if let Some(db) = settings.database.sqlite_path()
        && let Some(m) = tally::restore::unfinished(db)
    {
        bail!(
            "a restore to {} was stopped before it put the restored database in place (it \
             is at {}-restoring, recorded): run `tally restore-to --timestamp {}` again to \
             finish it (the chart's init container does), or, to start without it, remove \
             that file and {}",
            m.target,
            db.display(),
            m.target,
            tally::restore::marker_path(db).display()
        );
    }
    // Under Litestream, tally stops with its parent.
    let parent = settings.litestream_socket.is_some().then_some(parent);
    // Before anything is served: a SIGTERM from then on drains, and one
    // that comes while tally starts (restoring, waiting for the first
    // replica sync, which may take minutes) ends the start: nothing has
    // been accepted yet. The parent's death ends it too.
    let signal = tally::app::shutdown_signal(parent.is_some());
    let mut stop = Box::pin(stop_requested(parent, signal));
    let app = tokio::select! {
        app = Application::build(settings) => app?,
        why = &mut stop => {
            if let StopReason::ParentExited { pid } = why {
                bail!("the parent process (Litestream, pid {pid}) exited while tally was starting");
            }
            tracing::info!("stopped while starting, before serving anything");
            return Ok(());
        }
    };
    let (why_tx, why) = tokio::sync::oneshot::channel();
    app.run_until_stopped(async move {
        let _ = why_tx.send(stop.await);
    })
    .await?;
    // Drained cleanly, but without Litestream nothing replicates: exit
    // non-zero so that the whole unit is restarted.
    if let Ok(StopReason::ParentExited { pid }) = why.await {
        bail!("the parent process (Litestream, pid {pid}) exited; stopped");
    }
    Ok(())
}

/// The lock on `db`'s directory ([`tally::restore::lock_database`]).
fn lock_database(db: &std::path::Path) -> anyhow::Result<std::fs::File> {
    if let Some(dir) = db.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create directory {}", dir.display()))?;
    }
    match tally::restore::lock_database(db)? {
        Some(lock) => Ok(lock),
        None => bail!(
            "another process is using the database {} (it holds {}): a tally serving it, or a \
             restore into its directory (`tally restore-to`, or a `litestream restore` one \
             started). One process at a time: a second tally would answer reads from values \
             the other changed, and one started during a restore would have its database \
             replaced. Stop the other, or wait for the restore to end, and start again",
            db.display(),
            tally::restore::lock_path(db).display()
        ),
    }
}

async fn contention(writers: usize, hold: Duration) -> anyhow::Result<()> {
    println!(
        "{writers} concurrent writes, each holding its transaction {hold:?}, busy_timeout=0\n"
    );
    let outcomes = tally::db::contention::run(writers, hold).await?;
    print!("{}", tally::db::contention::render(&outcomes));
    Ok(())
}

async fn restore_to(
    settings: &tally::Settings,
    timestamp: jiff::Timestamp,
    timeout: std::time::Duration,
    at_every_start: bool,
) -> anyhow::Result<()> {
    let tally::Storage::Sqlite(db) = &settings.database else {
        bail!(
            "restore-to restores a SQLite database from Litestream's replica; TALLY_DATABASE is a PostgreSQL URL"
        );
    };
    let ls = tally::restore::Litestream {
        binary: settings.litestream.clone(),
        config: tally::restore::config_path(settings.litestream_config.as_deref()),
        no_expand_env: false,
        timeout,
    };
    // A stop (the pod deleted while it restores) ends the restore at once:
    // the Litestream it runs is killed with it, and nothing half-restored
    // is in place, so the next start restores again.
    // The signal first: Ctrl-C reaches Litestream too, and its death
    // would otherwise often be told as a kill from outside.
    let signal = tokio::select! {
        biased;
        signal = restore_stopped() => signal,
        restored = tally::restore::restore_to(db, timestamp, &ls, at_every_start) => {
            return restored.map(drop);
        }
    };
    // Killed as the restore was dropped, Litestream holds the lock until it
    // is gone, a few milliseconds: a restore run again at once was refused
    // as if one still ran.
    let waited = std::time::Instant::now();
    while waited.elapsed() < Duration::from_secs(5) {
        if tally::restore::lock_database(db).is_ok_and(|lock| lock.is_some()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bail!("stopped by {signal} while restoring: nothing restored (the next start restores again)")
}

/// SIGTERM, SIGINT, SIGQUIT or SIGHUP, whichever comes first: any of them
/// left to its default would end this process at once and leave its
/// Litestream running, holding the restore's lock. Not SIGHUP where it is
/// ignored: a restore run by hand under `nohup` goes on when its terminal
/// closes.
fn restore_stopped() -> impl Future<Output = &'static str> {
    use tokio::signal::unix::SignalKind;
    let mut signals = vec![
        (SignalKind::terminate(), "SIGTERM"),
        (SignalKind::interrupt(), "SIGINT"),
        (SignalKind::quit(), "SIGQUIT"),
    ];
    if !tally::app::ignored_from_start(SignalKind::hangup()) {
        signals.push((SignalKind::hangup(), "SIGHUP"));
    }
    tally::app::first_signal(&signals)
}
