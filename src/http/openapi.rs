//! The API description: OpenAPI generated from the handlers themselves
//! (utoipa), served at `/openapi.json`. Routes are registered through
//! `utoipa_axum`, so a route cannot exist without its description.

use serde::Serialize;
use utoipa::{
    Modify, OpenApi, ToSchema,
    openapi::{
        RefOr,
        schema::{ObjectBuilder, Schema, Type},
        security::{HttpAuthScheme, HttpBuilder, SecurityScheme},
    },
};

use crate::meter::{Name, VisitorId};

/// An RFC 9457 problem document. Budget checks add `allowed: false` (and
/// `reason` when the database failed).
#[derive(Serialize, ToSchema)]
#[schema(as = Problem)]
pub struct ProblemDoc {
    /// A URI reference naming the kind of problem, e.g. `/problems/queue-full`.
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    /// The `x-request-id` of the request, to quote when reporting it.
    pub request_id: Option<String>,
    /// On budget checks: always `false`.
    pub allowed: Option<bool>,
    /// On budget checks that failed: `meter_error`.
    pub reason: Option<String>,
    /// On unknown budgets: the name asked for.
    pub budget: Option<String>,
    /// On a delete of an unknown counter: the name asked for.
    pub counter: Option<String>,
    /// On `/problems/day-outside-window`: the oldest day the budget keeps.
    #[schema(format = Date)]
    pub oldest_day: Option<String>,
    /// On `/problems/day-outside-window`: today in the budget's time zone,
    /// the newest day it keeps.
    #[schema(format = Date)]
    pub today: Option<String>,
}

/// [`Name::parse`]'s rule, for clients.
const NAME_PATTERN: &str = r"^[A-Za-z0-9._:-]{1,128}$";
/// [`VisitorId::parse`]'s rule, for clients.
const VISITOR_PATTERN: &str = r"^[^\u0000-\u001F\u007F-\u009F]{1,256}$";

/// The schemas of the domain's types, each stating its rule once: path
/// parameters and body fields of these types share them.
impl utoipa::PartialSchema for Name {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
            .max_length(Some(Name::MAX_LEN))
            .pattern(Some(NAME_PATTERN))
            .into()
    }
}
impl ToSchema for Name {}

impl utoipa::PartialSchema for VisitorId {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(
                "Who is calling: 1 to 256 characters, no control characters.",
            ))
            .min_length(Some(1))
            .max_length(Some(VisitorId::MAX_LEN))
            .pattern(Some(VISITOR_PATTERN))
            .into()
    }
}
impl ToSchema for VisitorId {}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "tally",
        description = "Atomic counters and daily budgets over HTTP, backed by one SQLite file \
                       or by PostgreSQL shared by many tally processes. \
                       A 200 on a write means it committed."
    ),
    components(schemas(ProblemDoc)),
    modifiers(&AdminAuth)
)]
pub struct ApiDoc;

struct AdminAuth;

impl Modify for AdminAuth {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        if let Some(c) = api.components.as_mut() {
            c.add_security_scheme(
                "admin",
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
        }
    }
}

/// Problem answers, by what can go wrong on an endpoint.
#[allow(dead_code)] // only described, never built: Problem builds the bodies
#[derive(utoipa::IntoResponses)]
pub enum Problems {
    #[response(
        status = 400,
        description = "Bad name, query or malformed JSON",
        content_type = "application/problem+json"
    )]
    BadRequest(ProblemDoc),
    #[response(
        status = 404,
        description = "No such budget (or, on a delete, counter) or route",
        content_type = "application/problem+json"
    )]
    NotFound(ProblemDoc),
    #[response(
        status = 405,
        description = "Method not allowed",
        content_type = "application/problem+json"
    )]
    MethodNotAllowed(ProblemDoc),
    #[response(
        status = 408,
        description = "Body not received in full within the header timeout of the head (or half the request timeout, if shorter); nothing was done",
        content_type = "application/problem+json"
    )]
    BodyTimeout(ProblemDoc),
    #[response(
        status = 413,
        description = "Body over 64 KiB",
        content_type = "application/problem+json"
    )]
    TooLarge(ProblemDoc),
    #[response(
        status = 415,
        description = "Body is not JSON, or sent in a content coding (`Content-Encoding` other than `identity`)",
        content_type = "application/problem+json"
    )]
    UnsupportedMediaType(ProblemDoc),
    #[response(
        status = 414,
        description = "Request target over 8 KiB",
        content_type = "application/problem+json"
    )]
    UriTooLong(ProblemDoc),
    #[response(
        status = 422,
        description = "Body does not fit the endpoint, or a `day` is not one the budget keeps \
                       (`/problems/day-outside-window`: today in its time zone and the \
                       `retention_days` days before it)",
        content_type = "application/problem+json"
    )]
    Unprocessable(ProblemDoc),
    #[response(
        status = 431,
        description = "Header fields too large or too many",
        content_type = "application/problem+json"
    )]
    HeadersTooLarge(ProblemDoc),
    #[response(
        status = 500,
        description = "Database failed, or a write's outcome is unknown",
        content_type = "application/problem+json"
    )]
    Internal(ProblemDoc),
    #[response(
        status = 503,
        description = "Shutting down, timed out, the database file was lost \
                       (`/problems/storage-lost`), the database unreachable or a row busy, \
                       a budget's deleted namesake's usage still being deleted (a `PUT` \
                       creating it again: `/problems/budget-purge-under-way`), or (checks) \
                       the meter failed",
        content_type = "application/problem+json"
    )]
    Unavailable(ProblemDoc),
}

/// What the request frame answers on any route before its handler runs:
/// all the probes and the meta routes (which take no input) answer but
/// for their own statuses.
#[allow(dead_code)]
#[derive(utoipa::IntoResponses)]
pub enum FrameProblems {
    #[response(
        status = 400,
        description = "A `Host` field that breaks HTTP/1.1's rule (`/problems/invalid-host`: \
                       more than one, or none in an HTTP/1.1 request)",
        content_type = "application/problem+json"
    )]
    BadRequest(ProblemDoc),
    #[response(
        status = 405,
        description = "Method not allowed",
        content_type = "application/problem+json"
    )]
    MethodNotAllowed(ProblemDoc),
    #[response(
        status = 414,
        description = "Request target over 8 KiB",
        content_type = "application/problem+json"
    )]
    UriTooLong(ProblemDoc),
    #[response(
        status = 431,
        description = "Header fields too large or too many",
        content_type = "application/problem+json"
    )]
    HeadersTooLarge(ProblemDoc),
}

/// What only writes can answer.
#[allow(dead_code)]
#[derive(utoipa::IntoResponses)]
pub enum WriteProblems {
    #[response(
        status = 429,
        description = "Write queue full; nothing was done. Retry after `Retry-After` seconds.",
        content_type = "application/problem+json",
        headers(("Retry-After" = u64, description = "Seconds to wait"))
    )]
    QueueFull(ProblemDoc),
    #[response(
        status = 507,
        description = "Disk full; nothing was written. Retry after `Retry-After` seconds.",
        content_type = "application/problem+json",
        headers(("Retry-After" = u64, description = "Seconds to wait"))
    )]
    StorageFull(ProblemDoc),
}

/// What only a budget check's writes can answer: a full disk, as any
/// failure of the meter, denies with 503 `meter-error` (see [`Problems`]).
#[allow(dead_code)]
#[derive(utoipa::IntoResponses)]
pub enum CheckWriteProblems {
    #[response(
        status = 429,
        description = "Write queue full; nothing was done (denied). Retry after `Retry-After` seconds.",
        content_type = "application/problem+json",
        headers(("Retry-After" = u64, description = "Seconds to wait"))
    )]
    QueueFull(ProblemDoc),
}

/// What only admin endpoints can answer.
#[allow(dead_code)]
#[derive(utoipa::IntoResponses)]
pub enum AdminProblems {
    #[response(
        status = 401,
        description = "Missing or wrong admin token",
        content_type = "application/problem+json"
    )]
    Unauthorized(ProblemDoc),
    #[response(
        status = 403,
        description = "Admin disabled: no usable token configured",
        content_type = "application/problem+json"
    )]
    Forbidden(ProblemDoc),
}

/// What only counters can answer.
#[allow(dead_code)]
#[derive(utoipa::IntoResponses)]
pub enum CounterProblems {
    #[response(
        status = 409,
        description = "The counter would overflow; unchanged",
        content_type = "application/problem+json"
    )]
    Overflow(ProblemDoc),
}

#[cfg(test)]
mod tests {
    use utoipa::{IntoParams, openapi::schema::Schema};

    use super::*;
    use crate::meter::IdempotencyKey;

    /// Random strings near the rules' edges: lengths around the limits,
    /// letters, punctuation, quotes, controls and non-ASCII.
    fn samples() -> Vec<String> {
        let alphabet: Vec<char> = "aZ09._:-!#[]~ \"\\/é🎉\u{0}\u{1f}\u{7f}\u{85}\u{a0}*"
            .chars()
            .collect();
        let mut rng = fastrand::Rng::with_seed(3);
        let mut out = vec![String::new()];
        for _ in 0..5000 {
            let len = [1, 2, 127, 128, 129, 255, 256, 257][rng.usize(..8)];
            let plain = rng.bool();
            out.push(
                (0..len)
                    .map(|_| {
                        if plain {
                            'a'
                        } else {
                            alphabet[rng.usize(..alphabet.len())]
                        }
                    })
                    .collect(),
            );
            let mut s: String = (0..rng.usize(1..4))
                .map(|_| alphabet[rng.usize(..alphabet.len())])
                .collect();
            s.push_str(&"b".repeat(len - 1));
            // Quoted, as a structured-field string.
            out.push(format!("\"{s}\""));
            out.push(s);
        }
        out
    }

    fn agree(pattern: &str, parses: impl Fn(&str) -> bool) {
        let re = regex::Regex::new(pattern).unwrap();
        for s in samples() {
            assert_eq!(re.is_match(&s), parses(&s), "{pattern} vs {s:?}");
        }
    }

    /// What OpenAPI tells clients is exactly what tally accepts.
    #[test]
    fn stated_patterns_are_the_parsers_rules() {
        agree(NAME_PATTERN, |s| Name::parse(s).is_ok());
        agree(VISITOR_PATTERN, |s| VisitorId::parse(s).is_ok());
        use crate::http::extract::{CheckedKeyHeader, IdempotencyKeyHeader};
        for param in [
            IdempotencyKeyHeader::into_params(|| None).remove(0),
            CheckedKeyHeader::into_params(|| None).remove(0),
        ] {
            let Some(utoipa::openapi::RefOr::T(Schema::Object(o))) = param.schema else {
                panic!("no schema")
            };
            let pattern = o.pattern.unwrap();
            // White space around a key is the header's syntax, not the key's.
            agree(&pattern, |s| {
                s.trim() == s && IdempotencyKey::parse(s).is_ok()
            });
        }
    }
}
