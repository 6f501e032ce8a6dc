//! The HTTP API: the router, one module per resource, and the problem type
//! every error answers with. Handlers parse input into domain types and talk
//! to the database only through [`crate::db::Handle`]; they never see SQL.

mod budgets;
mod counters;
mod extract;
mod health;
pub mod instrument;
pub mod limits;
pub mod openapi;
mod pages;
mod problem;

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use axum::{
    Router,
    error_handling::HandleErrorLayer,
    extract::{DefaultBodyLimit, MatchedPath},
};
use axum::{extract::State, http::header, middleware, response::IntoResponse};
use bytes::Bytes;
use tower::ServiceBuilder;
use tower_http::{
    request_id::{PropagateRequestIdLayer, SetRequestIdLayer},
    trace::TraceLayer,
};
use utoipa::OpenApi;
use utoipa_axum::{router::OpenApiRouter, routes};

pub use problem::Problem;

use crate::db::Handle;

/// Largest request body accepted; larger ones answer 413.
pub const BODY_LIMIT: usize = 64 * 1024;

/// The routes and the OpenAPI document describing exactly them.
pub fn api_parts(
    state: AppState,
    metrics: Option<instrument::MetricsState>,
) -> (Router, utoipa::openapi::OpenApi) {
    let api = OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(counters::increment_default, counters::get_default))
        .routes(routes!(
            counters::increment,
            counters::get,
            counters::delete
        ))
        .routes(routes!(counters::list))
        .routes(routes!(budgets::get, budgets::put, budgets::delete))
        .routes(routes!(budgets::list))
        .routes(routes!(budgets::check))
        .routes(routes!(budgets::usage))
        .routes(routes!(budgets::reset))
        .routes(routes!(health::ready))
        .routes(routes!(health::livez))
        .routes(routes!(openapi_json))
        .with_state(state);
    let api = match metrics {
        Some(m) => api.merge(instrument::metrics_api(m)),
        None => api,
    };
    api.split_for_parts()
}

/// This API's OpenAPI document.
#[utoipa::path(get, path = "/openapi.json", operation_id = "openapi", tag = "meta",
    responses((status = 200, description = "OpenAPI document", body = Object)))]
async fn openapi_json(State(state): State<AppState>) -> impl IntoResponse {
    let doc = state.openapi.get().cloned().unwrap_or_default();
    ([(header::CONTENT_TYPE, "application/json")], doc)
}

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub db: Handle,
    /// The bearer token for admin endpoints; `None` turns them off.
    pub admin_token: Option<Arc<str>>,
    /// The OpenAPI document as served, written once the routes are known.
    pub openapi: Arc<OnceLock<Bytes>>,
}

impl AppState {
    pub fn new(db: Handle, admin_token: Option<Arc<str>>) -> Self {
        Self {
            db,
            admin_token,
            openapi: Arc::default(),
        }
    }
}

/// The whole API, ready to serve. `/metrics` is served here too unless
/// `metrics` is `None` (it then has a listener of its own).
pub fn router(
    state: AppState,
    request_timeout: Duration,
    metrics: Option<instrument::MetricsState>,
) -> Router {
    let openapi = Arc::clone(&state.openapi);
    let (api, doc) = api_parts(state, metrics);
    let _ = openapi.set(serde_json::to_vec(&doc).unwrap_or_default().into());
    // One layer, applied once: every `Router::layer` call wraps each route
    // in a boxed service of its own, and a request then clones the whole
    // chain of boxes (about a dozen allocations, and as many frees, for a
    // no-op). A single stack is cloned in one piece. Outermost first.
    let stack = ServiceBuilder::new()
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                axum::response::IntoResponse::into_response(Problem::internal(
                    "the request failed unexpectedly",
                ))
            },
        ))
        // Before an id is set: a client's id that could forge log text is
        // dropped, so that a fresh one is made in its place.
        .layer(tower::util::MapRequestLayer::new(
            instrument::drop_unsafe_request_id,
        ))
        .layer(SetRequestIdLayer::new(
            instrument::REQUEST_ID,
            instrument::MakeRequestId,
        ))
        .layer(PropagateRequestIdLayer::new(instrument::REQUEST_ID))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|req: &axum::extract::Request| {
                    let id = req
                        .headers()
                        .get(&instrument::REQUEST_ID)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("");
                    tracing::info_span!("request", method = %req.method(), request_id = %id)
                })
                // Not one ERROR line per failed request: during an outage that
                // is thousands a second. What failed is counted by route and
                // status in the metrics; what broke is logged where it broke
                // (the writer and the readers log an outage's start and end).
                .on_failure(
                    tower_http::trace::DefaultOnFailure::new().level(tracing::Level::DEBUG),
                ),
        )
        .layer(middleware::from_fn(instrument::observe))
        .layer(HandleErrorLayer::new(timed_out))
        .timeout(request_timeout)
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    api.fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(stack)
}

/// The answer to a request that ran out of time (the only error the
/// timeout layer produces). A budget check's answer still says the call is
/// denied: every check answer other than a 200 carries `"allowed": false`.
async fn timed_out(route: Option<MatchedPath>, _: tower::BoxError) -> Problem {
    match route {
        Some(r) if r.as_str() == budgets::CHECK_ROUTE => Problem::timeout().with("allowed", false),
        _ => Problem::timeout(),
    }
}

async fn not_found() -> Problem {
    Problem::not_found("no such route")
}

async fn method_not_allowed() -> Problem {
    Problem::method_not_allowed()
}
