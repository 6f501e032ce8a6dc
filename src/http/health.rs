use axum::{Json, extract::State, http::StatusCode};
use serde_json::{Value, json};

use super::{AppState, Problem};

/// Ready while the write queue accepts commands. A full queue is still ready:
/// it answers 429 and drains; only a closed queue (shutdown) is not.
#[utoipa::path(get, path = "/ready", operation_id = "ready", tag = "health",
    responses((status = 200, description = "Accepting writes", body = Object),
        (status = 503, description = "Write queue closed: shutting down",
         body = super::openapi::ProblemDoc, content_type = "application/problem+json"),
        super::openapi::FrameProblems))]
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

#[utoipa::path(get, path = "/livez", operation_id = "livez", tag = "health",
    responses((status = 200, description = "Serving", body = String, content_type = "text/plain"),
        super::openapi::FrameProblems))]
/// Alive while the process serves HTTP. Does no work: also the benchmark's
/// no-op ceiling.
pub async fn livez() -> &'static str {
    "ok"
}
