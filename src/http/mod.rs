//! The HTTP API: the router, one module per resource, and the problem type
//! every error answers with. Handlers parse input into domain types and talk
//! to the database only through [`crate::db::Handle`]; they never see SQL.

mod budgets;
mod counters;
mod extract;
mod frame;
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

use axum::{Router, extract::DefaultBodyLimit};
use axum::{extract::State, http::header, response::IntoResponse};
use bytes::Bytes;
use tower::ServiceBuilder;
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
    responses((status = 200, description = "OpenAPI document", body = Object),
        openapi::FrameProblems))]
async fn openapi_json(State(state): State<AppState>) -> impl IntoResponse {
    let doc = state.openapi.get().cloned().unwrap_or_default();
    ([(header::CONTENT_TYPE, "application/json")], doc)
}

/// What every handler can reach: one pointer, since axum clones a route's
/// state for every request (three reference counts to bump and drop were
/// measurable on a no-op answer).
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

pub struct Shared {
    pub db: Handle,
    /// The bearer token for admin endpoints; `None` turns them off.
    pub admin_token: Option<Arc<str>>,
    /// The OpenAPI document as served, written once the routes are known.
    pub openapi: OnceLock<Bytes>,
}

impl AppState {
    pub fn new(db: Handle, admin_token: Option<Arc<str>>) -> Self {
        Self(Arc::new(Shared {
            db,
            admin_token,
            openapi: OnceLock::new(),
        }))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The whole API, ready to serve. `/metrics` is served here too unless
/// `metrics` is `None` (it then has a listener of its own).
pub fn router(
    state: AppState,
    request_timeout: Duration,
    metrics: Option<instrument::MetricsState>,
) -> Router {
    let shared = state.clone();
    let (api, doc) = api_parts(state, metrics);
    let _ = shared
        .openapi
        .set(serde_json::to_vec(&doc).unwrap_or_default().into());
    // One layer (see `frame`), and the body limit the extractors read.
    // Every `Router::layer` call wraps each route in a boxed service of its
    // own, which a request then clones: as few as possible.
    let stack = ServiceBuilder::new()
        .layer(frame::FrameLayer {
            timeout: request_timeout,
            check_route: budgets::CHECK_ROUTE,
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    // `with_state` last: it makes every handler, the two fallbacks
    // included, a service once. Without it the fallbacks stayed handlers,
    // built again (with their layer) for every request they answered.
    api.fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(stack)
        .with_state(())
}

/// A path a client meant as a check (`/budgets/b/check/`, `/budgets/b//check`)
/// is no route, and its 404 says `"allowed": false` as the check's own
/// answers do: a client reading only that field denies.
async fn not_found(uri: axum::http::Uri) -> Problem {
    match meant_as_check(uri.path()) {
        true => Problem::not_found(
            "no such route; a check is POST /budgets/{name}/check, with no slash at its end",
        )
        .with("allowed", false),
        false => Problem::not_found("no such route"),
    }
}

/// Under `/budgets/`, with `check` for its last segment once empty
/// segments are left out.
fn meant_as_check(path: &str) -> bool {
    let mut segments = path.split('/').filter(|s| !s.is_empty());
    segments.next() == Some("budgets") && segments.next_back() == Some("check")
}

/// A check route's answers other than a `200` all say `"allowed": false`,
/// a wrong method's too.
async fn method_not_allowed(route: Option<axum::extract::MatchedPath>) -> Problem {
    match route {
        Some(r) if r.as_str() == budgets::CHECK_ROUTE => {
            Problem::method_not_allowed().with("allowed", false)
        }
        _ => Problem::method_not_allowed(),
    }
}
