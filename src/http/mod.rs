//! The HTTP API: the router, one module per resource, and the problem type
//! every error answers with. Handlers parse input into domain types and talk
//! to the database only through [`crate::db::Handle`]; they never see SQL.

mod budgets;
mod counters;
mod extract;
mod health;
mod problem;

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    error_handling::HandleErrorLayer,
    extract::DefaultBodyLimit,
    routing::{get, post},
};
use tower::ServiceBuilder;

pub use problem::Problem;

use crate::db::Handle;

/// Largest request body accepted; larger ones answer 413.
pub const BODY_LIMIT: usize = 64 * 1024;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub db: Handle,
    /// The bearer token for admin endpoints; `None` turns them off.
    pub admin_token: Option<Arc<str>>,
}

/// The whole API, ready to serve.
pub fn router(state: AppState, request_timeout: Duration) -> Router {
    Router::new()
        .route(
            "/counter",
            post(counters::increment_default).get(counters::get_default),
        )
        .route(
            "/counters/{name}",
            post(counters::increment).get(counters::get),
        )
        .route("/budgets/{name}", get(budgets::get).put(budgets::put))
        .route("/budgets/{name}/check", post(budgets::check))
        .route("/budgets/{name}/usage", get(budgets::usage))
        .route("/budgets/{name}/reset", post(budgets::reset))
        .route("/ready", get(health::ready))
        .route("/livez", get(health::livez))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(|_: tower::BoxError| async {
                    Problem::timeout()
                }))
                .timeout(request_timeout),
        )
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                axum::response::IntoResponse::into_response(Problem::internal(
                    "the request failed unexpectedly",
                ))
            },
        ))
}

async fn not_found() -> Problem {
    Problem::not_found("no such route")
}

async fn method_not_allowed() -> Problem {
    Problem::method_not_allowed()
}
