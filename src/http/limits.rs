//! What a request head may be: its target, its header fields and its
//! `Host`. The transport (`crate::server`) bounds what it buffers; this
//! answers the heads it lets through that break these rules, as
//! problem+json. On the API listener the request frame asks
//! ([`super::frame`]), so that these answers carry a request id, are
//! counted by route, and deny a budget check like any other refusal; the
//! metrics listener asks from the transport ([`screen`]).

use axum::response::{IntoResponse, Response};
use http::{Version, header::HOST};
use hyper::StatusCode;

use super::Problem;

/// Longest request target (path and query) tally answers; longer ones get a
/// `414` problem. Ample for every route (names are short).
pub const MAX_URI_BYTES: usize = 8 * 1024;
/// Largest request head (request line and header fields) tally answers;
/// larger ones get a `431` problem. As much as common proxies accept.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Most header fields in one request; more get a `431` problem.
pub const MAX_HEADER_FIELDS: usize = 64;
/// [`refused_head`] as an answer, for a listener without the request frame.
pub fn screen<B>(req: &http::Request<B>) -> Option<Response> {
    refused_head(req).map(IntoResponse::into_response)
}

/// The refusal of a request head tally does not accept, or `None`: a
/// target or head larger than tally accepts ([`oversized_head`]), or a
/// `Host` that breaks HTTP/1.1's rule (RFC 9112, section 3.2: exactly one
/// `Host` field, and an HTTP/1.1 request must send one): `400`.
pub fn refused_head<B>(req: &http::Request<B>) -> Option<Problem> {
    if let Some(p) = oversized_head(req) {
        return Some(p);
    }
    let mut hosts = req.headers().get_all(HOST).iter();
    let (first, second) = (hosts.next(), hosts.next());
    let broken = match (first, second) {
        (_, Some(_)) => Some("the request has more than one Host field"),
        (None, None) if req.version() >= Version::HTTP_11 => {
            Some("an HTTP/1.1 request must have a Host field")
        }
        _ => None,
    };
    broken.map(|why| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-host",
            "Invalid Host field",
        )
        .detail(why)
    })
}

/// The answer to a request whose target or head is larger than tally
/// accepts: a `414` or `431` problem; hyper answers only the much larger
/// ones (see `crate::server::HARD_HEAD_BYTES`), and without a body. `None` for the rest.
fn oversized_head<B>(req: &http::Request<B>) -> Option<Problem> {
    let uri = req.uri();
    let target = uri.path_and_query().map_or(0, |p| p.as_str().len())
        + uri
            .authority()
            .map_or(0, |a| a.as_str().len() + "http://".len());
    if target > MAX_URI_BYTES {
        let p = Problem::new(StatusCode::URI_TOO_LONG, "uri-too-long", "URI too long").detail(
            format!("the request target is {target} bytes; tally accepts at most {MAX_URI_BYTES}"),
        );
        return Some(p);
    }
    // As on the wire: "METHOD target HTTP/1.1\r\n", "name: value\r\n"
    // per field, "\r\n".
    let fields = req.headers().len();
    let head = req.method().as_str().len()
        + target
        + 12
        + req
            .headers()
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum::<usize>()
        + 2;
    if head > MAX_HEAD_BYTES || fields > MAX_HEADER_FIELDS {
        let p = Problem::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "header-too-large",
            "Request header too large",
        )
        .detail(format!(
            "the request head is {head} bytes in {fields} fields; tally accepts at most \
             {MAX_HEAD_BYTES} bytes and {MAX_HEADER_FIELDS} fields"
        ));
        return Some(p);
    }
    None
}
