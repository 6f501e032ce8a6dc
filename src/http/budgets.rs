use axum::{
    Json,
    extract::State,
    http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header},
};
use jiff::Timestamp;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    AppState, Problem,
    extract::{
        Admin, CheckedKeyHeader, IdempotencyKeyHeader, Json as JsonBody, OptionalJson, Path, Query,
        replayed_header,
    },
    instrument::request_id,
    openapi::{AdminProblems, CheckWriteProblems, Problems, WriteProblems},
    pages::{ListQuery, NoBody, NoQuery, UnreadableView},
};
use crate::{
    db,
    meter::{Budget, BudgetSpec, Day, Decision, Name, Reason, VisitorId},
    telemetry::Throttle,
};

/// A budget's configuration.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetBody {
    /// Calls one visitor may make per day; 0 denies everything.
    #[schema(value_type = i64, minimum = 0, maximum = 4294967295_i64)]
    visitor_limit: u32,
    /// Calls all visitors together may make per day.
    #[schema(value_type = i64, minimum = 0, maximum = 4294967295_i64)]
    global_limit: u32,
    /// Days of usage kept; 7 when left out.
    #[schema(minimum = 1, maximum = 3650)]
    retention_days: Option<u32>,
    /// IANA time zone whose days the budget counts; `UTC` when left out.
    #[schema(example = "Europe/Berlin", min_length = 1)]
    timezone: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct BudgetView {
    #[schema(inline)]
    name: Name,
    #[schema(value_type = i64, minimum = 0, maximum = 4294967295_i64)]
    visitor_limit: u32,
    #[schema(value_type = i64, minimum = 0, maximum = 4294967295_i64)]
    global_limit: u32,
    #[schema(minimum = 1, maximum = 3650)]
    retention_days: u32,
    timezone: String,
}

impl From<Budget> for BudgetView {
    fn from(b: Budget) -> Self {
        Self {
            name: b.name,
            visitor_limit: b.spec.visitor_limit,
            global_limit: b.spec.global_limit,
            retention_days: b.spec.retention_days,
            timezone: b.spec.timezone_name,
        }
    }
}

/// Creates or replaces a budget (admin).
#[utoipa::path(put, path = "/budgets/{name}", operation_id = "putBudget", tag = "budgets",
    params(("name" = inline(Name), Path), CheckedKeyHeader),
    request_body(content = BudgetBody, content_type = "application/json"),
    security(("admin" = [])),
    responses((status = 200, description = "Stored", body = BudgetView),
        AdminProblems, WriteProblems, Problems))]
/// A `PUT` is idempotent by itself (the same request sets the same
/// budget), so an `Idempotency-Key` is checked as on every write (one
/// field, a valid key) and not stored.
pub async fn put(
    _: Admin,
    State(state): State<AppState>,
    Path(name): Path<Name>,
    _: Query<NoQuery>,
    _: CheckedKeyHeader,
    JsonBody(body): JsonBody<BudgetBody>,
) -> Result<Json<BudgetView>, Problem> {
    let spec = BudgetSpec::new(
        body.visitor_limit,
        body.global_limit,
        body.retention_days,
        body.timezone.as_deref(),
    )
    .map_err(|e| Problem::invalid_body(e.0))?;
    Ok(Json(
        state.db.put_budget(name, spec, request_id()).await?.into(),
    ))
}

/// A budget's configuration.
#[utoipa::path(get, path = "/budgets/{name}", operation_id = "getBudget", tag = "budgets",
    params(("name" = inline(Name), Path)),
    responses((status = 200, description = "The budget", body = BudgetView), Problems))]
pub async fn get(
    State(state): State<AppState>,
    Path(name): Path<Name>,
    _: Query<NoQuery>,
) -> Result<Json<BudgetView>, Problem> {
    Ok(Json(state.db.budget(&name).await?.into()))
}

/// A page of budgets.
#[derive(Debug, Serialize, ToSchema)]
pub struct BudgetList {
    /// Each as `GET /budgets/{name}` answers it, by name in byte order.
    budgets: Vec<BudgetView>,
    /// Rows of this page tally cannot read back, by name; only on a page
    /// that has some.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    unreadable: Vec<UnreadableView>,
    /// The last name of this page, to pass as `after` for the next one;
    /// `null` on the last page.
    next: Option<String>,
}

/// Budgets by name in byte order, a page at a time. Pages are keyed by
/// name: a budget that exists from the first page to the last is listed
/// exactly once, whatever is written or deleted meanwhile.
#[utoipa::path(get, path = "/budgets", operation_id = "listBudgets", tag = "budgets",
    params(ListQuery),
    responses((status = 200, description = "A page of budgets", body = BudgetList), Problems))]
pub async fn list(
    State(state): State<AppState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<BudgetList>, Problem> {
    let page = state.db.list_budgets(&q.page()?).await?;
    Ok(Json(BudgetList {
        budgets: page.items.into_iter().map(BudgetView::from).collect(),
        unreadable: UnreadableView::all(page.unreadable),
        next: page.next,
    }))
}

/// Deletes a budget and all its usage (admin).
#[utoipa::path(delete, path = "/budgets/{name}", operation_id = "deleteBudget", tag = "budgets",
    params(("name" = inline(Name), Path), IdempotencyKeyHeader),
    security(("admin" = [])),
    responses((status = 204, description = "Deleted, with all its usage",
        headers(("Idempotent-Replayed" = bool, description = "On a delete replayed for its Idempotency-Key"))),
        AdminProblems, WriteProblems, Problems))]
/// Deletes a budget: its configuration and every day of its usage, in one
/// transaction. A check queued before the delete was counted, and goes
/// with it; one queued after it is `404`. A budget created again under the
/// same name starts with no usage.
pub async fn delete(
    _: Admin,
    State(state): State<AppState>,
    Path(name): Path<Name>,
    _: Query<NoQuery>,
    key: IdempotencyKeyHeader,
    _: OptionalJson<NoBody>,
) -> Result<(StatusCode, HeaderMap), Problem> {
    let replayed = state.db.delete_budget(name, key.0, request_id()).await?;
    Ok((StatusCode::NO_CONTENT, replayed_header(replayed)))
}

/// One call against a budget.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckBody {
    #[schema(inline)]
    visitor: VisitorId,
    /// The day to count the call on; today in the budget's time zone when
    /// left out. Only a day the budget keeps: today or one of the
    /// `retention_days` days before it; any other day (a future one
    /// included) is refused with 422 `/problems/day-outside-window`.
    #[schema(value_type = Option<String>, format = Date)]
    day: Option<Day>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DecisionView {
    allowed: bool,
    #[schema(value_type = String, example = "ok")]
    reason: Reason,
    #[schema(value_type = String, format = Date)]
    day: Day,
    visitor_calls: i64,
    global_calls: i64,
    #[schema(value_type = i64, minimum = 0, maximum = 4294967295_i64)]
    visitor_limit: u32,
    #[schema(value_type = i64, minimum = 0, maximum = 4294967295_i64)]
    global_limit: u32,
}

impl From<Decision> for DecisionView {
    fn from(d: Decision) -> Self {
        Self {
            allowed: d.allowed(),
            reason: d.reason,
            day: d.day,
            visitor_calls: d.visitor_calls,
            global_calls: d.global_calls,
            visitor_limit: d.visitor_limit,
            global_limit: d.global_limit,
        }
    }
}

/// The route of [`check`], as its requests' `MatchedPath` names it.
pub const CHECK_ROUTE: &str = "/budgets/{name}/check";

/// One call against a budget: the visitor's limit first, then the global
/// one. Denied calls are counted too. Every answer but a 200 is a denial
/// (`"allowed": false`). A `day` outside the days the budget keeps (today in
/// its time zone and the `retention_days` days before it) is 422
/// `/problems/day-outside-window`, and nothing is counted.
#[utoipa::path(post, path = "/budgets/{name}/check", operation_id = "checkBudget", tag = "budgets",
    params(("name" = inline(Name), Path), IdempotencyKeyHeader),
    request_body(content = CheckBody, content_type = "application/json"),
    responses((status = 200, description = "Decided and committed", body = DecisionView,
        headers(("RateLimit-Policy" = String, description = "draft-ietf-httpapi-ratelimit-headers-10"),
                ("RateLimit" = String, description = "draft-ietf-httpapi-ratelimit-headers-10"),
                ("Retry-After" = u64, description = "On denials whose day is not over: seconds until it resets"))),
        CheckWriteProblems, Problems))]
/// A budget check. It fails closed: every answer other than a 200 carries
/// `"allowed": false`, and a database failure denies with `meter_error`.
pub async fn check(
    State(state): State<AppState>,
    name: Result<Path<Name>, Problem>,
    query: Result<Query<NoQuery>, Problem>,
    key: Result<IdempotencyKeyHeader, Problem>,
    body: Result<JsonBody<CheckBody>, Problem>,
) -> Result<(HeaderMap, Json<DecisionView>), Problem> {
    let deny = |p: Problem| p.with("allowed", false);
    let Path(name) = name.map_err(deny)?;
    query.map_err(deny)?;
    let key = key.map_err(deny)?;
    let JsonBody(body) = body.map_err(deny)?;
    let checked = state
        .db
        .check(name, body.visitor, body.day, key.0, request_id())
        .await;
    match checked {
        // Counted by the writer, which decided it (whether or not this
        // caller is still here to hear it).
        Ok((decision, replayed)) => {
            let at = decision.decided_at.unwrap_or_else(Timestamp::now);
            let mut headers = rate_limit_headers(&decision, at);
            headers.extend(replayed_header(replayed));
            Ok((headers, Json(decision.into())))
        }
        Err(e) if e.is_storage_failure() => Err(meter_failed(&e)),
        Err(e) => Err(deny(e.into())),
    }
}

/// The answer to a check the database failed (an error, a full disk, a
/// lost file): denied, since a check fails closed.
fn meter_failed(err: &db::Error) -> Problem {
    // Whether the budget exists is unknown here: keep its name out of the
    // labels, so bad input cannot grow them.
    crate::prometheus::budget_meter_error();
    // An unreachable server, a full disk (or the storage limit) and a lost
    // file are logged by the writer when they start and when they end, a
    // held row once per batch: not once per denied check.
    if !matches!(
        err,
        db::Error::Unavailable(_)
            | db::Error::Busy(..)
            | db::Error::StorageFull(_)
            | db::Error::StorageLost(_)
    ) {
        static FAILED: Throttle = Throttle::new(std::time::Duration::from_secs(10));
        if let Some(held_back) = FAILED.admit() {
            tracing::error!(error = %err, request_id = %request_id().as_deref().unwrap_or(""), held_back, "budget check failed; denying (one line every 10 s at most; held_back: like lines not written since the last)");
        }
    }
    let denied = Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "meter-error",
        "Budget check failed",
    )
    .detail("the budget could not be checked, so the call is denied")
    .with("allowed", false)
    .with("reason", "meter_error");
    // A full or lost disk is not over at once, an unreachable server or a
    // held row may be: say when to try again, as the same failures of any
    // other request do. Any other failure (a row tally cannot read back, a
    // database error) gets none, as a write's `500` does not: a client
    // following `Retry-After` would loop on it.
    match err {
        db::Error::Unavailable(_) | db::Error::Busy(..) => {
            denied.retry_after(super::problem::UNAVAILABLE_RETRY_AFTER)
        }
        db::Error::StorageFull(_) | db::Error::StorageLost(_) => {
            denied.retry_after(super::problem::STORAGE_RETRY_AFTER)
        }
        _ => denied,
    }
}

/// The quota fields of draft-ietf-httpapi-ratelimit-headers-10: one policy
/// per limit, `visitor` and `global`, each a quota `q` per window of `w`
/// seconds (the budget's day in its time zone, as long as it really is:
/// 23 or 25 hours when clocks change by an hour), and what is left of
/// each, `r`, with the seconds until the day resets, `t`. A denied check
/// also says `Retry-After: t`, unless its day is over (`t` 0).
pub fn rate_limit_headers(d: &Decision, now: Timestamp) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(4);
    let Some(w) = d.day.window(&d.timezone, now) else {
        return h;
    };
    // A count below 0 is none a check leaves (a row edited by hand), and
    // subtracted as it is it could overflow.
    let left = |limit: u32, used: i64| (i64::from(limit) - used.max(0)).max(0);
    let policy = quota_list([
        (
            "visitor",
            [("q", d.visitor_limit.into()), ("w", w.length_secs)],
        ),
        (
            "global",
            [("q", d.global_limit.into()), ("w", w.length_secs)],
        ),
    ]);
    let state = quota_list([
        (
            "visitor",
            [
                ("r", left(d.visitor_limit, d.visitor_calls)),
                ("t", w.resets_in_secs),
            ],
        ),
        (
            "global",
            [
                ("r", left(d.global_limit, d.global_calls)),
                ("t", w.resets_in_secs),
            ],
        ),
    ]);
    for (name, value) in [("ratelimit-policy", policy), ("ratelimit", state)] {
        if let Ok(v) = HeaderValue::try_from(value) {
            h.insert(HeaderName::from_static(name), v);
        }
    }
    // A denial on a day that is over (a check that named an earlier day)
    // stays one: no wait helps, and `Retry-After: 0` would ask for the
    // retry at once.
    if !d.allowed() && w.resets_in_secs > 0 {
        h.insert(header::RETRY_AFTER, HeaderValue::from(w.resets_in_secs));
    }
    h
}

/// A structured-field list of the two quotas, `"visitor";q=3;w=86400,
/// "global";...`, written piece by piece: every check answers two of
/// these, and `format!` cost more than the rest of the answer's headers.
/// Names and keys are fixed literals here, so nothing needs escaping.
fn quota_list(items: [(&str, [(&str, i64); 2]); 2]) -> String {
    let mut out = String::with_capacity(80);
    let mut number = itoa::Buffer::new();
    for (i, (name, params)) in items.into_iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push('"');
        out.push_str(name);
        out.push('"');
        for (key, value) in params {
            out.push(';');
            out.push_str(key);
            out.push('=');
            out.push_str(number.format(value));
        }
    }
    out
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct UsageQuery {
    /// The day; today in the budget's time zone when left out. Only a day
    /// the budget keeps (today or one of the `retention_days` days before
    /// it): any other is 422 `/problems/day-outside-window`.
    #[param(format = Date)]
    day: Option<String>,
    /// Also report this visitor's calls.
    #[param(value_type = Option<VisitorId>, inline)]
    visitor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct UsageView {
    #[schema(value_type = String, format = Date)]
    day: Day,
    global_calls: i64,
    /// `null` when no visitor was asked about.
    visitor_calls: Option<i64>,
}

/// A budget's usage on one day, read without consuming anything.
///
/// Outside its window a budget has no usage to tell: future days have none
/// yet, and past ones read one thing or 0 depending on whether a prune has
/// run; they are refused as a check would refuse them.
#[utoipa::path(get, path = "/budgets/{name}/usage", operation_id = "getUsage", tag = "budgets",
    params(("name" = inline(Name), Path), UsageQuery),
    responses((status = 200, description = "Usage", body = UsageView), Problems))]
pub async fn usage(
    State(state): State<AppState>,
    Path(name): Path<Name>,
    Query(q): Query<UsageQuery>,
) -> Result<Json<UsageView>, Problem> {
    // Parsed here rather than by the query's deserializer, so that a bad
    // value is `invalid-input`, as everywhere else, not `invalid-query`.
    let day = q.day.as_deref().map(Day::parse).transpose()?;
    let visitor = q.visitor.as_deref().map(VisitorId::parse).transpose()?;
    let u = state.db.usage(&name, day, visitor.as_ref()).await?;
    Ok(Json(UsageView {
        day: u.day,
        global_calls: u.global_calls,
        visitor_calls: u.visitor_calls,
    }))
}

/// What to clear: one day (today by default), one visitor or all.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResetBody {
    /// Today in the budget's time zone when left out. Only a day the budget
    /// keeps (today or one of the `retention_days` days before it): any
    /// other is 422 `/problems/day-outside-window`.
    #[schema(value_type = Option<String>, format = Date)]
    day: Option<Day>,
    #[schema(inline)]
    visitor: Option<VisitorId>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ResetView {
    #[schema(inline)]
    budget: Name,
    #[schema(value_type = String, format = Date)]
    day: Day,
    #[schema(value_type = Option<String>)]
    visitor: Option<VisitorId>,
    deleted_rows: u64,
}

/// Clears a day's usage of a budget (admin).
#[utoipa::path(post, path = "/budgets/{name}/reset", operation_id = "resetUsage", tag = "budgets",
    params(("name" = inline(Name), Path), IdempotencyKeyHeader),
    request_body(content = Option<ResetBody>, content_type = "application/json"),
    security(("admin" = [])),
    responses((status = 200, description = "Cleared", body = ResetView,
        headers(("Idempotent-Replayed" = bool, description = "On a reset replayed for its Idempotency-Key"))),
        AdminProblems, WriteProblems, Problems))]
/// Clears a day's usage of a budget (today in its time zone by default):
/// every row of that day, or one visitor's only. A retry under the same
/// `Idempotency-Key` answers the first reset's result and clears nothing
/// counted since.
pub async fn reset(
    _: Admin,
    State(state): State<AppState>,
    Path(name): Path<Name>,
    _: Query<NoQuery>,
    key: IdempotencyKeyHeader,
    OptionalJson(body): OptionalJson<ResetBody>,
) -> Result<(HeaderMap, Json<ResetView>), Problem> {
    let (cleared, replayed) = state
        .db
        .reset(
            name.clone(),
            body.day,
            body.visitor.clone(),
            key.0,
            request_id(),
        )
        .await?;
    Ok((
        replayed_header(replayed),
        Json(ResetView {
            budget: name,
            day: cleared.day,
            visitor: body.visitor,
            deleted_rows: cleared.deleted_rows,
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(reason: Reason, visitor_calls: i64, global_calls: i64) -> Decision {
        Decision {
            reason,
            day: Day::parse("2026-03-01").unwrap(),
            visitor_calls,
            global_calls,
            visitor_limit: 3,
            global_limit: 4_000_000_000,
            pruned_rows: 0,
            timezone: jiff::tz::TimeZone::UTC,
            decided_at: None,
        }
    }

    #[test]
    fn rate_limit_headers_spell_the_draft_fields() {
        let now: Timestamp = "2026-03-01T23:00:00.5Z".parse().unwrap();
        let h = rate_limit_headers(&decision(Reason::Ok, 2, 17), now);
        assert_eq!(
            h["ratelimit-policy"],
            "\"visitor\";q=3;w=86400, \"global\";q=4000000000;w=86400"
        );
        assert_eq!(
            h["ratelimit"],
            "\"visitor\";r=1;t=3600, \"global\";r=3999999983;t=3600"
        );
        assert!(!h.contains_key("retry-after"));

        // Denied: nothing left, and Retry-After says when the day resets.
        let h = rate_limit_headers(&decision(Reason::VisitorLimit, 5, 17), now);
        assert_eq!(
            h["ratelimit"],
            "\"visitor\";r=0;t=3600, \"global\";r=3999999983;t=3600"
        );
        assert_eq!(h["retry-after"], "3600");

        // Counts no check leaves (rows edited by hand): nothing wraps.
        let h = rate_limit_headers(&decision(Reason::Ok, i64::MIN + 1, i64::MAX), now);
        assert_eq!(
            h["ratelimit"],
            "\"visitor\";r=3;t=3600, \"global\";r=0;t=3600"
        );

        // Denied on a day that is over: no Retry-After, t=0.
        let later: Timestamp = "2026-03-02T10:00:00Z".parse().unwrap();
        let h = rate_limit_headers(&decision(Reason::VisitorLimit, 5, 17), later);
        assert_eq!(
            h["ratelimit"],
            "\"visitor\";r=0;t=0, \"global\";r=3999999983;t=0"
        );
        assert!(!h.contains_key("retry-after"));
    }
}
