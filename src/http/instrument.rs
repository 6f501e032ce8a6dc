//! Per-request observability: request ids, metrics by route template, and
//! the request id in every problem body.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, LazyLock, RwLock},
    time::Instant,
};

use axum::{
    Router,
    extract::{MatchedPath, Request, State},
    http::{HeaderName, HeaderValue, Method, StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};
use metrics::{Counter, Histogram};
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

/// The longest client `x-request-id` kept.
pub const MAX_REQUEST_ID_LEN: usize = 64;

/// Whether a client's `x-request-id` is kept as it is: 1 to
/// [`MAX_REQUEST_ID_LEN`] characters, each an ASCII letter or digit or one
/// of `-._:+/=`. That covers UUIDs, ULIDs, W3C trace ids and `traceparent`
/// values, and base64; it leaves out spaces, quotes, braces, backslashes,
/// control and non-ASCII bytes, so an id cannot forge or break a log line
/// in any log format.
pub fn is_safe_request_id(id: &[u8]) -> bool {
    (1..=MAX_REQUEST_ID_LEN).contains(&id.len())
        && id
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-._:+/=".contains(b))
}

/// Removes a client's `x-request-id` unless it is a single safe one (see
/// [`is_safe_request_id`]), so that the id layer makes a fresh one, which
/// is what the logs, the problem bodies and the echoed header then carry.
pub fn drop_unsafe_request_id(mut req: Request) -> Request {
    let mut ids = req.headers().get_all(&REQUEST_ID).iter();
    let keep = match (ids.next(), ids.next()) {
        (None, _) => return req,
        (Some(id), None) => is_safe_request_id(id.as_bytes()),
        (Some(_), Some(_)) => false,
    };
    if !keep {
        req.headers_mut().remove(&REQUEST_ID);
    }
    req
}

/// Runs the request with its id in scope (see [`request_id`]), and counts
/// and times it by method, route template and status. Requests that
/// matched no route share the label `unmatched`, so no raw path ever
/// becomes a label.
pub async fn observe(req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().cloned();
    let method = method_label(req.method());
    let id = req
        .headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .map(Arc::<str>::from);
    let started = Instant::now();
    let res = match id {
        Some(id) => REQUEST.scope(id, next.run(req)).await,
        None => next.run(req).await,
    };
    let route = route.as_ref().map_or("unmatched", MatchedPath::as_str);
    let (requests, duration) = series(method, route, res.status());
    requests.increment(1);
    duration.record(started.elapsed().as_secs_f64());
    res
}

/// The request counter and duration histogram of one method, route and
/// status, registered once: building a metric's key with its labels and
/// looking it up in the registry, on every request, cost more than
/// everything else tally does for a no-op answer.
fn series(method: &'static str, route: &str, status: StatusCode) -> (Counter, Histogram) {
    type Series = (&'static str, StatusCode, Counter, Histogram);
    static SERIES: LazyLock<RwLock<HashMap<Box<str>, Vec<Series>>>> =
        LazyLock::new(Default::default);
    let find = |all: &HashMap<Box<str>, Vec<Series>>| {
        all.get(route)?
            .iter()
            .find(|s| s.0 == method && s.1 == status)
            .map(|s| (s.2.clone(), s.3.clone()))
    };
    if let Some(found) = SERIES.read().ok().as_deref().and_then(find) {
        return found;
    }
    let requests = metrics::counter!("tally_http_requests_total",
        "method" => method, "route" => route.to_owned(), "status" => status.as_str().to_owned());
    let duration = metrics::histogram!("tally_http_request_duration_seconds",
        "method" => method, "route" => route.to_owned());
    if let Ok(mut all) = SERIES.write() {
        let at = all.entry(route.into()).or_default();
        if !at.iter().any(|s| s.0 == method && s.1 == status) {
            at.push((method, status, requests.clone(), duration.clone()));
        }
    }
    (requests, duration)
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

tokio::task_local! {
    /// The id of the request this task serves.
    static REQUEST: Arc<str>;
}

/// The id of the request being served: problem bodies quote it as
/// `request_id`, and handlers hand it to the writer with their commands, so
/// its log lines about them name it.
pub fn request_id() -> Option<Arc<str>> {
    REQUEST.try_with(Arc::clone).ok()
}

/// What `/metrics` needs.
#[derive(Clone)]
pub struct MetricsState {
    pub handle: PrometheusHandle,
    pub db: Handle,
    /// The SQLite file, whose size is exported; none for PostgreSQL.
    pub db_path: Option<PathBuf>,
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
    crate::prometheus::sample(&m.db, m.db_path.as_deref());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        m.handle.render(),
    )
}

#[cfg(test)]
mod tests {
    use super::is_safe_request_id;

    #[test]
    fn request_ids() {
        for ok in [
            "a",
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
            "01ARZ3NDEKTSV4RRFFQ69G5FAV",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "dGFsbHk+/w==",
            "req:1.2_3",
            &"x".repeat(64),
        ] {
            assert!(is_safe_request_id(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "",
            "a b",
            "a\tb",
            "a\nb",
            "a\u{1b}[31mred",
            "\"quoted\"",
            "a\\b",
            "a}b",
            "a;b",
            "é",
            &"x".repeat(65),
        ] {
            assert!(!is_safe_request_id(bad.as_bytes()), "{bad:?}");
        }
        assert!(!is_safe_request_id(b"a\xffb"));
    }
}
