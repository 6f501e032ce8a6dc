use axum::{
    Json,
    extract::State,
    http::{HeaderMap, StatusCode},
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    AppState, Problem,
    extract::{Admin, IdempotencyKeyHeader, OptionalJson, Path, Query, replayed_header},
    instrument::request_id,
    openapi::{AdminProblems, CounterProblems, Problems, WriteProblems},
    pages::{ListQuery, NoBody, NoQuery, UnreadableView},
};
use crate::meter::Name;

/// The counter behind `/counter`.
const DEFAULT_COUNTER: &str = "default";
/// Largest single increment.
pub const MAX_BY: u32 = 1_000_000;

/// How much to add; the body may be left out entirely.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IncrementBody {
    /// 1 to 1 000 000; 1 when left out.
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 1_000_000, default = 1)]
    by: u32,
}

impl Default for IncrementBody {
    fn default() -> Self {
        Self { by: 1 }
    }
}

fn one() -> u32 {
    1
}

// Not named `Value`: utoipa takes a type of that name for any JSON value,
// and describes it as `{}`.
/// The single counter's value.
#[derive(Debug, Serialize, ToSchema)]
pub struct CounterValue {
    value: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct NamedValue {
    #[schema(inline)]
    name: Name,
    value: i64,
}

fn default_name() -> Name {
    Name::parse(DEFAULT_COUNTER).unwrap_or_else(|_| unreachable!("the default name is valid"))
}

async fn add(
    state: &AppState,
    name: Name,
    body: IncrementBody,
    key: IdempotencyKeyHeader,
) -> Result<(HeaderMap, i64), Problem> {
    if !(1..=MAX_BY).contains(&body.by) {
        return Err(Problem::invalid_body(format!(
            "by: must be between 1 and {MAX_BY}, got {}",
            body.by
        )));
    }
    let (value, replayed) = state
        .db
        .increment(name, i64::from(body.by), key.0, request_id())
        .await?;
    Ok((replayed_header(replayed), value))
}

/// Adds to the counter `default`. A 200 means the write committed.
#[utoipa::path(post, path = "/counter", operation_id = "incrementDefault", tag = "counters",
    params(IdempotencyKeyHeader),
    request_body(content = Option<IncrementBody>, content_type = "application/json"),
    responses((status = 200, description = "Committed", body = CounterValue),
        CounterProblems, WriteProblems, Problems))]
pub async fn increment_default(
    State(state): State<AppState>,
    _: Query<NoQuery>,
    key: IdempotencyKeyHeader,
    OptionalJson(body): OptionalJson<IncrementBody>,
) -> Result<(HeaderMap, Json<CounterValue>), Problem> {
    let (headers, value) = add(&state, default_name(), body, key).await?;
    Ok((headers, Json(CounterValue { value })))
}

/// Reads the counter `default`.
#[utoipa::path(get, path = "/counter", operation_id = "getDefault", tag = "counters",
    responses((status = 200, description = "Current value", body = CounterValue), Problems))]
pub async fn get_default(
    State(state): State<AppState>,
    _: Query<NoQuery>,
) -> Result<Json<CounterValue>, Problem> {
    let value = state.db.counter(&default_name()).await?;
    Ok(Json(CounterValue { value }))
}

/// Adds to a named counter (created at 0). A 200 means the write committed.
#[utoipa::path(post, path = "/counters/{name}", operation_id = "incrementCounter", tag = "counters",
    params(("name" = inline(Name), Path), IdempotencyKeyHeader),
    request_body(content = Option<IncrementBody>, content_type = "application/json"),
    responses((status = 200, description = "Committed", body = NamedValue),
        CounterProblems, WriteProblems, Problems))]
pub async fn increment(
    State(state): State<AppState>,
    Path(name): Path<Name>,
    _: Query<NoQuery>,
    key: IdempotencyKeyHeader,
    OptionalJson(body): OptionalJson<IncrementBody>,
) -> Result<(HeaderMap, Json<NamedValue>), Problem> {
    let (headers, value) = add(&state, name.clone(), body, key).await?;
    Ok((headers, Json(NamedValue { name, value })))
}

/// Reads a named counter; 0 if it was never written.
#[utoipa::path(get, path = "/counters/{name}", operation_id = "getCounter", tag = "counters",
    params(("name" = inline(Name), Path)),
    responses((status = 200, description = "Current value", body = NamedValue), Problems))]
pub async fn get(
    State(state): State<AppState>,
    Path(name): Path<Name>,
    _: Query<NoQuery>,
) -> Result<Json<NamedValue>, Problem> {
    let value = state.db.counter(&name).await?;
    Ok(Json(NamedValue { name, value }))
}

/// A page of counters.
#[derive(Debug, Serialize, ToSchema)]
pub struct CounterList {
    /// By name in byte order.
    counters: Vec<NamedValue>,
    /// Rows of this page tally cannot read back, by name; only on a page
    /// that has some.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    unreadable: Vec<UnreadableView>,
    /// The last name of this page, to pass as `after` for the next one;
    /// `null` on the last page.
    next: Option<String>,
}

/// Counters and their values by name in byte order, a page at a time
/// (counters never written, or deleted, are not listed). Pages are keyed
/// by name: a counter that exists from the first page to the last is
/// listed exactly once, whatever is written or deleted meanwhile.
#[utoipa::path(get, path = "/counters", operation_id = "listCounters", tag = "counters",
    params(ListQuery),
    responses((status = 200, description = "A page of counters", body = CounterList), Problems))]
pub async fn list(
    State(state): State<AppState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<CounterList>, Problem> {
    let page = state.db.list_counters(&q.page()?).await?;
    Ok(Json(CounterList {
        counters: page
            .items
            .into_iter()
            .map(|(name, value)| NamedValue { name, value })
            .collect(),
        unreadable: UnreadableView::all(page.unreadable),
        next: page.next,
    }))
}

/// Deletes a counter (admin): `404` if it does not exist; a later
/// increment starts again from 0.
#[utoipa::path(delete, path = "/counters/{name}", operation_id = "deleteCounter", tag = "counters",
    params(("name" = inline(Name), Path), IdempotencyKeyHeader),
    security(("admin" = [])),
    responses((status = 204, description = "Deleted",
        headers(("Idempotent-Replayed" = bool, description = "On a delete replayed for its Idempotency-Key"))),
        AdminProblems, WriteProblems, Problems))]
pub async fn delete(
    _: Admin,
    State(state): State<AppState>,
    Path(name): Path<Name>,
    _: Query<NoQuery>,
    key: IdempotencyKeyHeader,
    _: OptionalJson<NoBody>,
) -> Result<(StatusCode, HeaderMap), Problem> {
    let replayed = state.db.delete_counter(name, key.0, request_id()).await?;
    Ok((StatusCode::NO_CONTENT, replayed_header(replayed)))
}
