//! The one error type of the API: every 4xx and 5xx answer is an RFC 9457
//! `application/problem+json` document built here.

use std::time::Duration;

use axum::{
    extract::rejection::{JsonRejection, PathRejection, QueryRejection},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde_json::{Map, Value, json};

use crate::{
    db,
    meter::{InvalidInput, Refusal},
    telemetry::Throttle,
};

/// `Retry-After` for writes refused because the disk is full or the
/// database file is gone: freeing space, or a restart, takes an operator or
/// an orchestrator a few seconds at least.
pub const STORAGE_RETRY_AFTER: Duration = Duration::from_secs(5);

/// `Retry-After` while the database server cannot be reached: the writer
/// tries to connect again for the next write, so a short wait is enough.
pub const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The log lines of requests the database failed, throttled: a failure
/// that lasts fails every request.
static DATABASE_ERRORS: Throttle = Throttle::new(Duration::from_secs(10));

/// A problem document, with optional extension members and `Retry-After`.
/// Boxed: it travels in the `Err` side of every handler's result.
#[derive(Debug)]
pub struct Problem(Box<Inner>);

#[derive(Debug)]
struct Inner {
    status: StatusCode,
    /// Short slug; the `type` member is `/problems/{slug}`.
    slug: &'static str,
    title: &'static str,
    detail: String,
    extensions: Map<String, Value>,
    retry_after: Option<Duration>,
    /// One more header the status calls for: `WWW-Authenticate` on a
    /// `401`, `Accept-Encoding` on a `415` for a content coding.
    header: Option<(header::HeaderName, HeaderValue)>,
}

/// Longest `detail` a problem answers with, in bytes (before the `...`
/// that says it was cut).
pub const MAX_DETAIL_BYTES: usize = 1024;

impl Problem {
    pub fn new(status: StatusCode, slug: &'static str, title: &'static str) -> Self {
        Self(Box::new(Inner {
            status,
            slug,
            title,
            detail: title.to_owned(),
            extensions: Map::new(),
            retry_after: None,
            header: None,
        }))
    }

    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        let mut detail = detail.into();
        // A detail may quote what the client sent (an unknown field's
        // name, twice in serde's words): an answer is no larger than the
        // problem needs, whatever the request's size.
        if detail.len() > MAX_DETAIL_BYTES {
            let mut end = MAX_DETAIL_BYTES;
            while !detail.is_char_boundary(end) {
                end -= 1;
            }
            detail.truncate(end);
            detail.push_str("...");
        }
        self.0.detail = detail;
        self
    }

    /// Adds an extension member (RFC 9457 section 3.2).
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.0.extensions.insert(key.to_owned(), value.into());
        self
    }

    /// Asks the client to wait this long before retrying (`Retry-After`,
    /// in whole seconds, at least 1).
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.0.retry_after = Some(after);
        self
    }

    pub fn invalid(err: InvalidInput) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid-input", "Invalid input").detail(err.0)
    }

    pub fn invalid_body(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-body",
            "The request body is not valid for this endpoint",
        )
        .detail(detail)
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", "Not found").detail(detail)
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "Method not allowed",
        )
        .detail("this path does not accept that method")
    }

    pub fn unauthorized() -> Self {
        let mut p = Self::new(StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized")
            .detail("this endpoint needs `Authorization: Bearer <admin token>`");
        p.0.header = Some((
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"tally\""),
        ));
        p
    }

    /// A body in a content coding (`gzip`, ...): tally reads bodies as
    /// sent, so it says so rather than parse compressed bytes as JSON, or
    /// take a body that only claims to be compressed as plain (RFC 9110,
    /// section 15.5.16: `Accept-Encoding` names what is taken).
    pub fn content_coding() -> Self {
        let mut p = Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-content-encoding",
            "Unsupported content coding",
        )
        .detail("request bodies are read as sent: send them without a `Content-Encoding` (or `identity`)");
        p.0.header = Some((
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        ));
        p
    }

    /// A body in a transfer coding other than `chunked` (`gzip, chunked`):
    /// hyper takes the chunks apart and leaves the rest. RFC 9112 (section
    /// 6.1) suggests 501; it is 400 here, the answer hyper gives a
    /// transfer coding whose last is not `chunked`, so that a client's
    /// choice of framing cannot count as the server's error.
    pub fn transfer_coding() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "unsupported-transfer-encoding",
            "Unsupported transfer coding",
        )
        .detail(
            "a request body may be sent with `Transfer-Encoding: chunked` alone: no other \
             coding, and chunked once",
        )
    }

    pub fn admin_disabled() -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "admin-disabled",
            "Admin API disabled",
        )
        .detail("no usable admin token is configured (TALLY_ADMIN_TOKEN unset, empty, or holding characters no request can send), so admin endpoints are off")
    }

    pub fn timeout() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "timeout",
            "Request timed out",
        )
        .detail(
            "the request took too long; if it was a write, it may still have committed: \
             read the value back before retrying",
        )
    }

    pub fn internal(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal server error",
        )
        .detail(detail)
    }
}

impl From<InvalidInput> for Problem {
    fn from(e: InvalidInput) -> Self {
        Self::invalid(e)
    }
}

impl From<Refusal> for Problem {
    fn from(r: Refusal) -> Self {
        use StatusCode as S;
        let detail = r.to_string();
        match r {
            Refusal::UnknownBudget(name) => Self::not_found(detail).with("budget", name.as_str()),
            Refusal::UnknownCounter(name) => Self::not_found(detail).with("counter", name.as_str()),
            Refusal::Overflow(_) => {
                Self::new(S::CONFLICT, "counter-overflow", "Counter would overflow").detail(detail)
            }
            Refusal::KeyReused => Self::new(
                S::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "Idempotency-Key reused",
            )
            .detail(detail),
            Refusal::DayOutsideWindow { kept, .. } => Self::new(
                S::UNPROCESSABLE_ENTITY,
                "day-outside-window",
                "Day outside the budget's window",
            )
            .detail(detail)
            .with("oldest_day", kept.oldest.to_string())
            .with("today", kept.today.to_string()),
        }
    }
}

impl From<db::Error> for Problem {
    fn from(e: db::Error) -> Self {
        match e {
            db::Error::Refused(r) => r.into(),
            db::Error::QueueFull { retry_after } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "queue-full",
                "Write queue full",
            )
            .detail("too many writes are waiting; nothing was done, so retrying later is safe")
            .retry_after(retry_after),
            db::Error::Closed => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting-down",
                "Shutting down",
            )
            .detail("tally is shutting down and takes no more requests; nothing was done")
            .retry_after(Duration::from_secs(1)),
            db::Error::OutcomeUnknown => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "outcome-unknown",
                "Outcome unknown",
            )
            .detail(
                "the write was accepted but its reply was lost; it may or may not have committed. \
                 Do not retry blindly: retry with the same Idempotency-Key, or read the current \
                 value first",
            ),
            // The writer has logged the failed batch; one line per refused
            // request would only add to a full disk's troubles.
            db::Error::StorageFull(_) => Self::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "storage-full",
                "Storage full",
            )
            .detail(
                "the database's disk is full, or the database reached tally's storage limit \
                 (TALLY_STORAGE_LIMIT); nothing was written. Retrying is safe and succeeds once \
                 space is freed",
            )
            .with("reason", "storage_full")
            .retry_after(STORAGE_RETRY_AFTER),
            db::Error::StorageLost(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "storage-lost",
                "Database file lost",
            )
            .detail(
                "the database file was deleted, replaced or cut short underneath tally; this \
                 write was not kept. tally stops so that it is restarted; retry then",
            )
            .with("reason", "storage_lost")
            .retry_after(STORAGE_RETRY_AFTER),
            // The writer logs when the server goes and comes back.
            db::Error::Unavailable(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "database-unavailable",
                "Database unavailable",
            )
            .detail(
                "the database server cannot be reached, cannot take writes now, or did not \
                 answer in time (on SQLite: every read connection stayed busy for 5 s, more \
                 reads at once than they keep up with); nothing was done. Retrying is safe and \
                 succeeds once it answers again",
            )
            .with("reason", "database_unavailable")
            .retry_after(UNAVAILABLE_RETRY_AFTER),
            // The writer logs the rows it found busy, once per batch.
            db::Error::Busy(..) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "row-busy",
                "Row busy",
            )
            .detail(
                "another transaction held a row this request needs for longer than the lock \
                 timeout; nothing was done. Retrying is safe and succeeds once it is released",
            )
            .with("reason", "row_busy")
            .retry_after(UNAVAILABLE_RETRY_AFTER),
            db::Error::Purging(ref name) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "budget-purge-under-way",
                "Deleted budget's usage still being deleted",
            )
            .detail(e.to_string())
            .with("budget", name.as_str())
            .retry_after(UNAVAILABLE_RETRY_AFTER),
            e @ (db::Error::Raced(_) | db::Error::Database(_) | db::Error::Internal(_)) => {
                if let Some(held_back) = DATABASE_ERRORS.admit() {
                    tracing::error!(error = %e, request_id = %super::instrument::request_id().as_deref().unwrap_or(""), held_back, "database error (one line every 10 s at most; held_back: like lines not written since the last)");
                }
                // tally's own words (a stored row it cannot read back names
                // the row), unlike a driver's error, which may quote SQL.
                let detail = match &e {
                    db::Error::Internal(what) => {
                        format!(
                            "tally cannot use what the database holds: {what}; nothing was written"
                        )
                    }
                    _ => "the database failed; nothing was written".to_owned(),
                };
                Self::internal(detail).with("reason", "database_error")
            }
        }
    }
}

impl From<PathRejection> for Problem {
    fn from(r: PathRejection) -> Self {
        use axum::extract::path::ErrorKind;
        // A name that arrived whole but breaks the rule of its type: the
        // rule's own words.
        if let PathRejection::FailedToDeserializePathParams(e) = &r
            && let ErrorKind::Message(rule) | ErrorKind::DeserializeError { message: rule, .. } =
                e.kind()
        {
            return Self::invalid(InvalidInput(rule.clone()));
        }
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid-path",
            "Invalid path parameter",
        )
        .detail(r.body_text())
    }
}

impl From<JsonRejection> for Problem {
    fn from(r: JsonRejection) -> Self {
        match r {
            // serde's own words (with the field's path), without axum's
            // preamble.
            JsonRejection::JsonDataError(e) => Self::invalid_body(serde_message(&e, e.body_text())),
            JsonRejection::JsonSyntaxError(e) => {
                let message = serde_message(&e, e.body_text());
                // Valid JSON (which sets no range) that serde_json cannot
                // hold (`1e400`, a thousand digits): a value out of range,
                // as `18446744073709551616` is, not JSON that does not parse.
                if message.contains("number out of range") {
                    return Self::invalid_body(message);
                }
                Self::new(StatusCode::BAD_REQUEST, "malformed-json", "Malformed JSON")
                    .detail(message)
            }
            r => Self::new(
                StatusCode::BAD_REQUEST,
                "bad-body",
                "Cannot read request body",
            )
            .detail(r.body_text()),
        }
    }
}

/// The message of the error `e` wraps, else `fallback`.
fn serde_message(e: &dyn std::error::Error, fallback: String) -> String {
    e.source().map_or(fallback, ToString::to_string)
}

impl From<QueryRejection> for Problem {
    fn from(r: QueryRejection) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid-query",
            "Invalid query string",
        )
        .detail(r.body_text())
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let this = *self.0;
        let mut body = Map::new();
        body.insert("type".into(), json!(format!("/problems/{}", this.slug)));
        body.insert("title".into(), json!(this.title));
        body.insert("status".into(), json!(this.status.as_u16()));
        body.insert("detail".into(), json!(this.detail));
        body.extend(this.extensions);
        // The request being answered, set for the whole request by the
        // `frame` around every route, so a client can quote it.
        if let Some(id) = super::instrument::request_id() {
            body.insert("request_id".into(), json!(&*id));
        }
        let mut res = (this.status, axum::Json(Value::Object(body))).into_response();
        let headers = res.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = this.retry_after {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from(after.as_secs().max(1)),
            );
        }
        if let Some((name, value)) = this.header {
            headers.insert(name, value);
        }
        res
    }
}
