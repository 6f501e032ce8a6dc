//! Per-request observability: request ids, metrics by route template, and
//! the request id in every problem body.

use std::{path::PathBuf, sync::Arc, time::Instant};

use axum::{
    Router,
    extract::{MatchedPath, Request, State},
    http::{HeaderName, HeaderValue, Method, header},
    middleware::Next,
    response::{IntoResponse, Response},
};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::db::Handle;

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Makes request ids: random version-4 UUIDs from a per-thread generator.
/// They need to be unique, not unguessable, and tower-http's `MakeRequestUuid`
/// asks the kernel for randomness on every request (a system call that
/// showed up at ~3% of a no-op request's cost).
#[derive(Clone, Copy, Default)]
pub struct MakeRequestId;

impl tower_http::request_id::MakeRequestId for MakeRequestId {
    fn make_request_id<B>(
        &mut self,
        _: &axum::http::Request<B>,
    ) -> Option<tower_http::request_id::RequestId> {
        let id = uuid::Builder::from_random_bytes(fastrand::u128(..).to_le_bytes()).into_uuid();
        let mut buf = uuid::Uuid::encode_buffer();
        HeaderValue::from_str(id.hyphenated().encode_lower(&mut buf))
            .ok()
            .map(tower_http::request_id::RequestId::new)
    }
}

/// Counts and times every request by method, route template and status.
/// Requests that matched no route share the label `unmatched`, so no raw
/// path ever becomes a label.
pub async fn track(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = method_label(req.method());
    let started = Instant::now();
    let res = next.run(req).await;
    let status = res.status().as_u16().to_string();
    metrics::counter!("tally_http_requests_total",
        "method" => method, "route" => route.clone(), "status" => status)
    .increment(1);
    metrics::histogram!("tally_http_request_duration_seconds", "method" => method, "route" => route)
        .record(started.elapsed().as_secs_f64());
    res
}

fn method_label(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// Runs the request with its id in scope: problem bodies quote it as
/// `request_id`, and the writer's log lines about its commands name it.
pub async fn with_request_id(req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .map(Arc::<str>::from);
    match id {
        Some(id) => crate::db::CALLER.scope(id, next.run(req)).await,
        None => next.run(req).await,
    }
}

/// What `/metrics` needs.
#[derive(Clone)]
pub struct MetricsState {
    pub handle: PrometheusHandle,
    pub db: Handle,
    pub db_path: PathBuf,
}

/// `GET /metrics` on a listener of its own.
pub fn metrics_router(state: MetricsState) -> Router {
    metrics_api(state).split_for_parts().0
}

/// `GET /metrics`, with its description.
pub fn metrics_api(state: MetricsState) -> utoipa_axum::router::OpenApiRouter {
    utoipa_axum::router::OpenApiRouter::new()
        .routes(utoipa_axum::routes!(render))
        .with_state(state)
}

/// Prometheus metrics, in the text exposition format.
#[utoipa::path(get, path = "/metrics", operation_id = "metrics", tag = "meta",
    responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain")))]
async fn render(State(m): State<MetricsState>) -> impl IntoResponse {
    crate::observe::sample(&m.db, &m.db_path);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        m.handle.render(),
    )
}
