//! Structured logs: JSON lines when stderr is not a terminal (a log
//! pipeline), readable text when it is. Colours only on a terminal.

use std::io::IsTerminal;

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// Installs the global subscriber. The filter comes from `TALLY_LOG`
/// (`RUST_LOG` syntax, default `info`); the format from `TALLY_LOG_FORMAT`
/// (`json` or `text`, default by whether stderr is a terminal).
pub fn init() {
    let mut filter =
        EnvFilter::try_from_env("TALLY_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    // sqlx warns of a URL parameter it does not know with the parameter's
    // value, which can be a password (`sslpassword=...`).
    if let Ok(quiet) = "sqlx_postgres::options=error".parse() {
        filter = filter.add_directive(quiet);
    }
    let json = match std::env::var("TALLY_LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => !std::io::stderr().is_terminal(),
    };
    // Escape sequences are for a terminal to draw; in a file or a log
    // pipeline they are noise in every line. NO_COLOR (no-color.org) turns
    // them off on a terminal too.
    let colours = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let registry = tracing_subscriber::registry().with(filter);
    if json {
        registry
            .with(
                fmt::layer()
                    .json()
                    .with_ansi(false)
                    .with_writer(std::io::stderr),
            )
            .init();
    } else {
        registry
            .with(fmt::layer().with_ansi(colours).with_writer(std::io::stderr))
            .init();
    }
}
