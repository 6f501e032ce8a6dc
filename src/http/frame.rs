//! What every request passes through, in one service: its id, the rules
//! on its head ([`limits`]), the time limit, panic catching, and its count
//! and duration by route.
//!
//! One layer instead of a stack of them (tower-http's request-id, trace and
//! catch-panic layers, a `from_fn` middleware, the timeout and its error
//! handler): axum clones a route's whole service chain for every request,
//! and each layer of that chain cost an allocation, a boxed future or
//! span bookkeeping, which together made tally's own code cost about three
//! times the bare server's per answer. Here a request costs one boxed future
//! and, when the client sent no usable id, one id.
//!
//! No tracing span is opened per request: the few log lines written while
//! a request runs name its id themselves ([`request_id`]), so no field is
//! formatted unless a line is written. One line per answered request is
//! written at debug level under the target `tally::request`.

use std::{
    any::Any,
    convert::Infallible,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    extract::{MatchedPath, Request},
    http::{HeaderValue, StatusCode},
    response::{IntoResponse, Response},
};
use futures_util::FutureExt;
use tower::{Layer, Service};

use super::{
    Problem,
    instrument::{self, REQUEST_ID},
    limits,
};

tokio::task_local! {
    /// The id of the request this task serves.
    static REQUEST: HeaderValue;
}

/// The id of the request being served: problem bodies quote it as
/// `request_id`, log lines written while it runs name it, and handlers
/// hand it to the writer with their commands, so its log lines about them
/// name it.
pub fn request_id() -> Option<Arc<str>> {
    REQUEST
        .try_with(|id| id.to_str().ok().map(Arc::from))
        .ok()
        .flatten()
}

/// Wraps each route (see [`super::router`]).
#[derive(Clone, Copy)]
pub struct FrameLayer {
    pub timeout: Duration,
    /// Where the route answering timeouts with `"allowed": false` is.
    pub check_route: &'static str,
}

impl<S> Layer<S> for FrameLayer {
    type Service = Frame<S>;

    fn layer(&self, inner: S) -> Frame<S> {
        Frame {
            inner,
            layer: *self,
            series: Arc::default(),
        }
    }
}

#[derive(Clone)]
pub struct Frame<S> {
    inner: S,
    layer: FrameLayer,
    /// The request count and duration of this endpoint, by status.
    series: Arc<instrument::EndpointSeries>,
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

impl<S> Service<Request> for Frame<S>
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> BoxFuture {
        let started = Instant::now();
        let route = req.extensions().get::<MatchedPath>().cloned();
        // A head tally does not accept is answered before any extractor
        // reads it, measured as the client sent it (before an unsafe
        // request id is taken out); a budget check's refusal denies.
        let refused = limits::refused_head(&req).map(|p| match &route {
            Some(r) if r.as_str() == self.layer.check_route => p.with("allowed", false),
            _ => p,
        });
        let id = id_of(&mut req);
        let method = instrument::method_label(req.method());
        // The service that was made ready is the one called (tower's
        // contract); a clone takes its place for the next request.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let FrameLayer {
            timeout,
            check_route,
        } = self.layer;
        // Counted as 499 if the request is dropped unanswered.
        let mut unanswered = Unanswered {
            series: Some(Arc::clone(&self.series)),
            method,
            route,
            started,
        };
        Box::pin(async move {
            // Borrowed from the guard, which records the request when done.
            let route = &unanswered.route;
            let answer = REQUEST.scope(id, async {
                if let Some(refused) = refused {
                    return refused.into_response();
                }
                let mut run = std::pin::pin!(AssertUnwindSafe(inner.call(req)).catch_unwind());
                // An answer ready at the first poll (a probe, a read of a
                // value kept in memory) needs no timer: the time limit is
                // armed only for one that has to wait, from the request's
                // start.
                let first = std::future::poll_fn(|cx| Poll::Ready(run.as_mut().poll(cx))).await;
                let ran = match first {
                    Poll::Ready(done) => Ok(done),
                    Poll::Pending => {
                        let deadline = tokio::time::Instant::from_std(started + timeout);
                        tokio::time::timeout_at(deadline, run).await
                    }
                };
                match ran {
                    Ok(Ok(Ok(res))) => res,
                    Ok(Ok(Err(never))) => match never {},
                    Ok(Err(panic)) => panicked(panic),
                    Err(_) => timed_out(route.as_ref(), check_route),
                }
            });
            let mut answer = std::pin::pin!(answer);
            let mut res = answer.as_mut().await;
            // The id the task held, moved into the answer: no copy of it
            // is made per request.
            if let Some(id) = answer.as_mut().take_value() {
                res.headers_mut().insert(REQUEST_ID, id);
            }
            let label = route.as_ref().map_or("unmatched", MatchedPath::as_str);
            let took = started.elapsed();
            if let Some(series) = unanswered.series.take() {
                series.record(method, label, res.status(), took);
            }
            // One line per request, for whoever turns it on
            // (`TALLY_LOG=info,tally::request=debug`); when off, nothing
            // below is evaluated.
            tracing::debug!(target: "tally::request", method, route = label,
                status = res.status().as_u16(), micros = took.as_micros() as u64,
                request_id = %res.headers().get(REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or(""),
                "answered");
            Ok(res)
        })
    }
}

/// A request on its way to an answer. Dropped before it has one (its
/// client closed the connection, or the server stopped waiting for it),
/// it is counted in `tally_http_requests_total` and
/// `tally_http_request_duration_seconds` with status `499` (nginx's
/// "client closed request"), so that what the writer did for clients who
/// left (see `tally_write_committed_caller_gone_total`) is matched by
/// requests in the HTTP series.
struct Unanswered {
    series: Option<Arc<instrument::EndpointSeries>>,
    method: &'static str,
    route: Option<MatchedPath>,
    started: Instant,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        let (Some(series), Ok(status)) = (self.series.take(), StatusCode::from_u16(499)) else {
            return;
        };
        let route = self.route.as_ref().map_or("unmatched", MatchedPath::as_str);
        let took = self.started.elapsed();
        series.record(self.method, route, status, took);
        tracing::debug!(target: "tally::request", method = self.method, route,
            status = 499, micros = took.as_micros() as u64, "dropped unanswered");
    }
}

/// The request's id: the client's `x-request-id` when it sent exactly one
/// that is safe to log (see [`instrument::is_safe_request_id`]), else a new
/// one, which replaces whatever the client sent, so the handler, the logs,
/// the problem body and the echoed header all carry the same id.
fn id_of(req: &mut Request) -> HeaderValue {
    let mut ids = req.headers().get_all(&REQUEST_ID).iter();
    if let (Some(id), None) = (ids.next(), ids.next())
        && instrument::is_safe_request_id(id.as_bytes())
    {
        return id.clone();
    }
    // Nothing after this reads the request's own header (handlers, logs and
    // problems take the id from the task), so a fresh id is not written
    // into it; an unsafe one the client sent is taken out.
    if req.headers().contains_key(&REQUEST_ID) {
        req.headers_mut().remove(&REQUEST_ID);
    }
    instrument::new_request_id()
}

/// The answer to a request whose handler panicked; the panic itself was
/// logged by the panic hook (see `main`).
fn panicked(_: Box<dyn Any + Send>) -> Response {
    Problem::internal("the request failed unexpectedly").into_response()
}

/// The answer to a request that ran out of time. A budget check's answer
/// still says the call is denied: every check answer other than a 200
/// carries `"allowed": false`.
fn timed_out(route: Option<&MatchedPath>, check_route: &str) -> Response {
    match route {
        Some(r) if r.as_str() == check_route => Problem::timeout().with("allowed", false),
        _ => Problem::timeout(),
    }
    .into_response()
}

#[cfg(test)]
mod tests {
    use axum::{Router, body::Body, routing::get};
    use http_body_util::BodyExt;
    use serde_json::Value;
    use tower::ServiceExt;

    use super::*;

    fn app() -> Router {
        Router::new()
            .route(
                "/ok",
                get(|| async { request_id().map(|id| id.to_string()).unwrap_or_default() }),
            )
            .route(
                "/panics",
                get(|| async {
                    if request_id().is_some() {
                        panic!("a handler bug");
                    }
                }),
            )
            .route(
                "/slow",
                get(|| async { tokio::time::sleep(Duration::from_secs(5)).await }),
            )
            .route(
                "/budgets/{name}/check",
                get(|| async { tokio::time::sleep(Duration::from_secs(5)).await }),
            )
            .layer(FrameLayer {
                timeout: Duration::from_millis(50),
                check_route: "/budgets/{name}/check",
            })
    }

    async fn call(path: &str, id: Option<&str>) -> (Response, Value) {
        let mut req = Request::get(path).header("host", "tally");
        if let Some(id) = id {
            req = req.header(REQUEST_ID, id);
        }
        let res = app()
            .oneshot(req.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let (parts, body) = res.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        // A problem's JSON, or the handler's text as a JSON string.
        let json = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        (Response::from_parts(parts, Body::empty()), json)
    }

    fn id(res: &Response) -> &str {
        res.headers()[REQUEST_ID].to_str().unwrap()
    }

    #[tokio::test]
    async fn a_safe_client_id_is_kept_and_an_unsafe_one_replaced() {
        let (res, body) = call("/ok", Some("client-id-1")).await;
        assert_eq!(id(&res), "client-id-1");
        assert_eq!(body, "client-id-1", "the handler sees the same id");
        let (res, body) = call("/ok", Some("bad id")).await;
        assert_ne!(id(&res), "bad id");
        assert_eq!(id(&res).len(), 36, "a fresh UUID");
        assert_eq!(body, id(&res));
    }

    #[tokio::test]
    async fn a_panic_is_a_500_problem_with_the_request_id() {
        let (res, body) = call("/panics", Some("p-1")).await;
        assert_eq!(res.status(), 500);
        assert_eq!(id(&res), "p-1");
        assert_eq!(body["type"], "/problems/internal");
        assert_eq!(body["request_id"], "p-1");
    }

    #[tokio::test]
    async fn a_request_out_of_time_is_answered_and_a_check_still_denied() {
        let (res, body) = call("/slow", Some("t-1")).await;
        assert_eq!(res.status(), 503);
        assert_eq!(body["type"], "/problems/timeout");
        assert_eq!(body["request_id"], "t-1");
        assert_eq!(id(&res), "t-1");
        assert!(body.get("allowed").is_none());
        let (res, body) = call("/budgets/b/check", None).await;
        assert_eq!(res.status(), 503);
        assert_eq!(body["allowed"], false);
    }
}
