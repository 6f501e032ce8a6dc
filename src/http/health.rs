use axum::{Json, extract::State, http::StatusCode};
use serde_json::{Value, json};

use super::{AppState, Problem};

/// Ready while the write queue accepts commands. A full queue is still ready:
/// it answers 429 and drains; only a closed queue (shutdown) is not.
pub async fn ready(State(state): State<AppState>) -> Result<Json<Value>, Problem> {
    if state.db.accepts_writes() {
        Ok(Json(
            json!({"status": "ready", "queue_depth": state.db.queue_depth()}),
        ))
    } else {
        Err(
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, "not-ready", "Not ready")
                .detail("the write queue is closed: tally is shutting down"),
        )
    }
}

/// Alive while the process serves HTTP. Does no work: also the benchmark's
/// no-op ceiling.
pub async fn livez() -> &'static str {
    "ok"
}
