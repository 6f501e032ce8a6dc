//! Extractors whose rejections are [`Problem`]s, so that bad input of every
//! kind answers in the same format.

use axum::{
    extract::{FromRequest, FromRequestParts, Request},
    http::{StatusCode, header, request::Parts},
};
use bytes::Bytes;
use serde::de::DeserializeOwned;
use subtle::ConstantTimeEq;

use super::{AppState, Problem};

/// `axum::extract::Path` answering bad input with a problem. Path
/// parameters are domain types ([`crate::meter::Name`]), parsed here once.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(Problem))]
pub struct Path<T>(pub T);

/// `axum::extract::Query` answering bad input with a problem. A query whose
/// percent-decoded bytes are not UTF-8 is refused, as the same bytes in a
/// path are: axum's own decoding would replace them with U+FFFD, and two
/// different visitor ids would read as one.
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        if let Some(q) = parts.uri.query()
            && percent_encoding::percent_decode_str(q)
                .decode_utf8()
                .is_err()
        {
            return Err(Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid-query",
                "Invalid query string",
            )
            .detail("the query string is not valid UTF-8 once percent-decoded"));
        }
        let axum::extract::Query(v) =
            axum::extract::Query::from_request_parts(parts, state).await?;
        Ok(Query(v))
    }
}

/// A JSON request body that must be present.
pub struct Json<T>(pub T);

/// A JSON request body that may be left out entirely, as in a plain
/// `curl -X POST`, `hey -m POST` or an HTML form posted empty: no body at
/// all counts as left out whatever its `Content-Type` says; then
/// `T::default()`.
pub struct OptionalJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Json<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        match read_json(req, state).await? {
            Some(v) => Ok(Json(v)),
            None => Err(Problem::invalid_body("this endpoint needs a JSON body")),
        }
    }
}

impl<S: Send + Sync, T: DeserializeOwned + Default> FromRequest<S> for OptionalJson<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        Ok(OptionalJson(
            read_json(req, state).await?.unwrap_or_default(),
        ))
    }
}

/// Whether reading the body failed because it did not arrive in time.
fn timed_out(r: &axum::extract::rejection::BytesRejection) -> bool {
    anyhow::Chain::new(r).any(|e| e.is::<crate::server::BodyTimedOut>())
}

/// Reads the body (within the router's size limit) and parses it with
/// axum's `Json`. tally's one extra rule: no body at all is `None` whatever
/// the `Content-Type` (there is nothing to be of the wrong type); so is
/// blank space sent as JSON or without a type, and JSON `null`. Any other
/// body must say it is JSON, and be an object (serde would take `[1]` for
/// a struct).
async fn read_json<S: Send + Sync, T: DeserializeOwned>(
    req: Request,
    state: &S,
) -> Result<Option<T>, Problem> {
    // Two fields are two types, the body one of them or neither.
    if req
        .headers()
        .get_all(header::CONTENT_TYPE)
        .iter()
        .nth(1)
        .is_some()
    {
        return Err(Problem::invalid(crate::meter::InvalidInput(
            "a request takes one Content-Type, not several".into(),
        )));
    }
    // The type alone, without its parameters (`; charset=utf-8`): RFC 9110
    // lets white space stand before each `;` and parameters be empty,
    // which the `mime` parser refuses, and tally reads no parameter.
    let is_json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .and_then(|v| v.trim().parse::<mime::Mime>().ok())
        .is_some_and(|m| {
            m.type_() == mime::APPLICATION
                && (m.subtype() == mime::JSON || m.suffix() == Some(mime::JSON))
        });
    let has_content_type = req.headers().contains_key(header::CONTENT_TYPE);
    // A body refused whatever it holds is refused before it is read: a
    // client waiting on `Expect: 100-continue` is not asked to send it,
    // and one that sends it anyway is not waited for.
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > super::BODY_LIMIT as u64) {
        return Err(too_large());
    }
    if has_content_type && !is_json && declared.is_some_and(|n| n > 0) {
        return Err(not_json());
    }
    // Codings tally does not take apart: refused from the head too. hyper
    // has taken a `chunked` body apart, once, and refused one whose last
    // coding is anything else; `chunked` may not be applied twice (RFC
    // 9112, section 6.1).
    let chunked = req.headers().contains_key(header::TRANSFER_ENCODING);
    let chunked_once = {
        let mut transfer = codings(req.headers(), header::TRANSFER_ENCODING);
        transfer
            .next()
            .is_none_or(|c| c.eq_ignore_ascii_case(b"chunked"))
            && transfer.next().is_none()
    };
    if !chunked_once {
        return Err(Problem::transfer_coding());
    }
    if (chunked || declared.is_some_and(|n| n > 0))
        && codings(req.headers(), header::CONTENT_ENCODING)
            .any(|c| !c.eq_ignore_ascii_case(b"identity"))
    {
        return Err(Problem::content_coding());
    }
    let body = Bytes::from_request(req, state).await.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            too_large()
        } else if timed_out(&r) {
            Problem::new(
                StatusCode::REQUEST_TIMEOUT,
                "body-timeout",
                "Request body not received in time",
            )
            .detail(
                "the body must arrive in full within TALLY_HEADER_TIMEOUT of the request head \
                 (half TALLY_REQUEST_TIMEOUT, if that is shorter); nothing was done",
            )
        } else {
            Problem::new(
                StatusCode::BAD_REQUEST,
                "bad-body",
                "Cannot read request body",
            )
            .detail(r.body_text())
        }
    })?;
    let text = body.trim_ascii();
    if body.is_empty() || (text.is_empty() && (is_json || !has_content_type)) {
        return Ok(None);
    }
    if is_json && text == b"null" {
        return Ok(None);
    }
    if !is_json {
        return Err(not_json());
    }
    if !text.starts_with(b"{") {
        return Err(match axum::Json::<serde_json::Value>::from_bytes(&body) {
            Ok(_) => Problem::invalid_body("the body must be a JSON object"),
            Err(r) => r.into(),
        });
    }
    Ok(Some(axum::Json::<T>::from_bytes(&body)?.0))
}

/// The codings a list-valued field names, over all its fields (`gzip,
/// chunked` is two), with white space and empty elements left out.
fn codings(
    headers: &axum::http::HeaderMap,
    name: header::HeaderName,
) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(name)
        .into_iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|c| !c.is_empty())
}

fn too_large() -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body-too-large",
        "Request body too large",
    )
    .detail(format!(
        "request bodies are limited to {} bytes",
        super::BODY_LIMIT
    ))
}

fn not_json() -> Problem {
    Problem::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported-media-type",
        "Unsupported media type",
    )
    .detail("request bodies must be JSON, sent with `Content-Type: application/json`")
}

/// Proof that the request carried the admin token.
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Problem> {
        let Some(expected) = state.admin_token.as_deref() else {
            return Err(Problem::admin_disabled());
        };
        // Two fields are two credentials: which one would count?
        let mut fields = parts.headers.get_all(header::AUTHORIZATION).iter();
        let presented = fields
            .next()
            .filter(|_| fields.next().is_none())
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            })
            .ok_or_else(Problem::unauthorized)?;
        if bool::from(presented.as_bytes().ct_eq(expected.as_bytes())) {
            Ok(Admin)
        } else {
            Err(Problem::unauthorized())
        }
    }
}

/// The optional `Idempotency-Key` field (draft-ietf-httpapi-idempotency-key-header).
#[derive(utoipa::IntoParams)]
#[into_params(names("Idempotency-Key"), parameter_in = Header)]
pub struct IdempotencyKeyHeader(
    /// Makes a retry safe: a repeat with the same key answers the first result (with Idempotent-Replayed: true) instead of writing again; reusing it for a different request is 422; kept for TALLY_IDEMPOTENCY_KEY_TTL (24 h by default)
    #[param(value_type = Option<String>, pattern = r#"^("[!#-\[\]-~]{1,255}"|[!#-\[\]-~]{1,255})$"#)]
    pub Option<crate::meter::IdempotencyKey>,
);

/// The `Idempotency-Key` field of a write that is idempotent by itself (a
/// budget's `PUT`): checked as [`IdempotencyKeyHeader`] checks it, and
/// not stored. Its own type, so that the API description does not promise
/// a replay.
#[derive(utoipa::IntoParams)]
#[into_params(names("Idempotency-Key"), parameter_in = Header)]
pub struct CheckedKeyHeader(
    /// Accepted and checked as on every write (one field, a valid key), but not stored: the same PUT sets the same budget however often it is sent, so a repeat is applied again and answered without Idempotent-Replayed, whatever key it carries
    #[param(value_type = Option<String>, pattern = r#"^("[!#-\[\]-~]{1,255}"|[!#-\[\]-~]{1,255})$"#)]
    #[expect(dead_code, reason = "checked, and not stored: nothing reads it")]
    pub Option<crate::meter::IdempotencyKey>,
);

impl<S: Send + Sync> FromRequestParts<S> for CheckedKeyHeader {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        let IdempotencyKeyHeader(key) =
            IdempotencyKeyHeader::from_request_parts(parts, state).await?;
        Ok(CheckedKeyHeader(key))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKeyHeader {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        let mut fields = parts.headers.get_all("idempotency-key").iter();
        let Some(v) = fields.next() else {
            return Ok(IdempotencyKeyHeader(None));
        };
        // Two fields are two keys: taking either would let a retry that
        // sends the other one write again.
        if fields.next().is_some() {
            return Err(Problem::invalid(crate::meter::InvalidInput(
                "a request takes one Idempotency-Key, not several".into(),
            )));
        }
        let text = v.to_str().map_err(|_| {
            Problem::invalid(crate::meter::InvalidInput(
                "an Idempotency-Key must be visible ASCII".into(),
            ))
        })?;
        Ok(IdempotencyKeyHeader(Some(
            crate::meter::IdempotencyKey::parse(text)?,
        )))
    }
}

/// `Idempotent-Replayed: true` on an answer replayed for a key.
pub fn replayed_header(replayed: bool) -> axum::http::HeaderMap {
    let mut h = axum::http::HeaderMap::new();
    if replayed {
        h.insert(
            axum::http::HeaderName::from_static("idempotent-replayed"),
            axum::http::HeaderValue::from_static("true"),
        );
    }
    h
}
