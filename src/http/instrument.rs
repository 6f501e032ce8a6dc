//! Per-request observability: request ids, metrics by route template, and
//! `/metrics`. [`super::frame`] applies them to every request.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{LazyLock, OnceLock, RwLock},
    time::Duration,
};

use axum::{
    Router,
    extract::State,
    http::{HeaderName, HeaderValue, Method, StatusCode, header},
    response::IntoResponse,
};
use metrics::{Counter, Histogram};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::db::Handle;

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// A new request id: a random version-4 UUID from a per-thread generator.
/// Ids need to be unique, not unguessable, and asking the kernel for
/// randomness on every request (as tower-http's `MakeRequestUuid` does)
/// showed up at ~3% of a no-op request's cost.
pub fn new_request_id() -> HeaderValue {
    let id = uuid::Builder::from_random_bytes(fastrand::u128(..).to_le_bytes()).into_uuid();
    let mut buf = uuid::Uuid::encode_buffer();
    let text = id.hyphenated().encode_lower(&mut buf);
    HeaderValue::from_maybe_shared(bytes::Bytes::copy_from_slice(text.as_bytes()))
        .unwrap_or_else(|_| HeaderValue::from_static("00000000-0000-4000-8000-000000000000"))
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

/// The request counter and duration histogram of one method, route and
/// status, registered once: building a metric's key with its labels and
/// looking it up in the registry, on every request, cost more than
/// everything else tally does for a no-op answer.
pub(super) fn series(
    method: &'static str,
    route: &str,
    status: StatusCode,
) -> (Counter, Histogram) {
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

/// One endpoint's request counters and duration histograms, by status:
/// each found through [`series`] once, then used with no lock and no hash.
/// Looking them up on every request cost more than anything else tally's
/// frame does for a no-op answer. A `HEAD`, a status not given a place
/// here, or a method or route other than the one kept (the fallbacks
/// answer every method) goes through [`series`].
#[derive(Default)]
pub(super) struct EndpointSeries {
    by_status: [OnceLock<Kept>; STATUSES.len()],
}

/// What tally answers; each has a place in [`EndpointSeries`].
const STATUSES: [u16; 20] = [
    200, 201, 204, 400, 401, 403, 404, 405, 408, 409, 413, 414, 415, 422, 429, 431, 500, 503, 504,
    507,
];

struct Kept {
    method: &'static str,
    route: Box<str>,
    requests: Counter,
    duration: Histogram,
}

impl EndpointSeries {
    /// Counts one answer and records how long it took.
    pub(super) fn record(
        &self,
        method: &'static str,
        route: &str,
        status: StatusCode,
        took: Duration,
    ) {
        let looked_up;
        let (requests, duration) = match self.kept(method, route, status) {
            Some(k) => (&k.requests, &k.duration),
            None => {
                looked_up = series(method, route, status);
                (&looked_up.0, &looked_up.1)
            }
        };
        requests.increment(1);
        duration.record(took.as_secs_f64());
    }

    /// The handles kept for `status`, found the first time; `None` for a
    /// status with no place, or if they were kept for another method or
    /// route.
    fn kept(&self, method: &'static str, route: &str, status: StatusCode) -> Option<&Kept> {
        // A GET route answers HEAD too: a HEAD (a probe) arriving first
        // must not take the place of the route's own GETs.
        if method == "HEAD" {
            return None;
        }
        let i = STATUSES.iter().position(|&s| s == status.as_u16())?;
        let kept = self.by_status[i].get_or_init(|| {
            let (requests, duration) = series(method, route, status);
            Kept {
                method,
                route: route.into(),
                requests,
                duration,
            }
        });
        (kept.method == method && &*kept.route == route).then_some(kept)
    }
}

pub(super) fn method_label(m: &Method) -> &'static str {
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

pub use super::frame::request_id;

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
    // Its other answers are problems too, as the API's are.
    metrics_api(state)
        .split_for_parts()
        .0
        .fallback(|| async {
            super::problem::Problem::not_found("no such route; this listener serves GET /metrics")
        })
        .method_not_allowed_fallback(|| async { super::problem::Problem::method_not_allowed() })
}

/// `GET /metrics`, with its description.
pub fn metrics_api(state: MetricsState) -> utoipa_axum::router::OpenApiRouter {
    utoipa_axum::router::OpenApiRouter::new()
        .routes(utoipa_axum::routes!(render))
        .with_state(state)
}

/// Prometheus metrics, in the text exposition format.
#[utoipa::path(get, path = "/metrics", operation_id = "metrics", tag = "meta",
    responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"),
        super::openapi::FrameProblems))]
async fn render(State(m): State<MetricsState>) -> impl IntoResponse {
    crate::prometheus::sample(&m.db, m.db_path.as_deref());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        crate::prometheus::render(&m.handle),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_keeps_its_series_by_status_and_no_one_elses() {
        let e = EndpointSeries::default();
        let ok = e
            .kept("GET", "/a", StatusCode::OK)
            .expect("200 has a place");
        // Found again, not looked up again.
        let again = e.kept("GET", "/a", StatusCode::OK).expect("kept");
        assert!(std::ptr::eq(ok, again));
        // A GET route also answers HEAD, and a fallback every method: a
        // method or route other than the one kept is not given its handles.
        assert!(e.kept("HEAD", "/a", StatusCode::OK).is_none());
        assert!(e.kept("POST", "/a", StatusCode::OK).is_none());
        assert!(e.kept("GET", "/b", StatusCode::OK).is_none());
        // A HEAD that comes first takes no place.
        let head_first = EndpointSeries::default();
        assert!(head_first.kept("HEAD", "/a", StatusCode::OK).is_none());
        assert!(head_first.kept("GET", "/a", StatusCode::OK).is_some());
        // Each status its own.
        let missing = e
            .kept("GET", "/a", StatusCode::NOT_FOUND)
            .expect("404 has a place");
        assert!(!std::ptr::eq(ok, missing));
        // A status with no place goes through `series` every time.
        assert!(e.kept("GET", "/a", StatusCode::IM_A_TEAPOT).is_none());
        // Recording works either way.
        e.record("HEAD", "/a", StatusCode::OK, Duration::from_micros(5));
        e.record(
            "GET",
            "/a",
            StatusCode::IM_A_TEAPOT,
            Duration::from_micros(5),
        );
    }

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
