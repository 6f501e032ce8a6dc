use std::{process::ExitCode, time::Duration};

use clap::Parser;
use tally::{
    Application,
    app::shutdown_signal,
    config::{Cli, Command},
};

// Every request allocates a little on one thread and frees it on another;
// mimalloc handles that pattern with far less contention than glibc's malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tally::telemetry::init();
    let result = match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => serve(cli.settings).await,
        Command::Contention { writers, hold_ms } => {
            contention(writers as usize, Duration::from_millis(hold_ms)).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "tally failed");
            eprintln!("tally: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(settings: tally::Settings) -> anyhow::Result<()> {
    tracing::info!(?settings, "starting");
    let app = Application::build(settings).await?;
    app.run_until_stopped(shutdown_signal()).await
}

async fn contention(writers: usize, hold: Duration) -> anyhow::Result<()> {
    println!(
        "{writers} concurrent writes, each holding its transaction {hold:?}, busy_timeout=0\n"
    );
    let outcomes = tally::contention::run(writers, hold).await?;
    print!("{}", tally::contention::render(&outcomes));
    Ok(())
}
