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
        Admin, IdempotencyKeyHeader, Json as JsonBody, OptionalJson, Path, Query, replayed_header,
    },
    openapi::{AdminProblems, Problems, WriteProblems},
};
use crate::{
    db::WriteError,
    meter::{
        self, Budget, BudgetSpec, Day, Decision, MeterError, Name, Reason, ResetScope, VisitorId,
    },
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
    #[schema(value_type = String)]
    name: Name,
    visitor_limit: u32,
    global_limit: u32,
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

fn parse_day(day: Option<&str>) -> Result<Option<Day>, Problem> {
    Ok(day.map(Day::parse).transpose()?)
}

/// `day`, if the budget keeps it now: today in its time zone or one of the
/// `retention_days` days before it, exactly what pruning keeps. A later day
/// does not exist yet and an earlier one is pruned (or about to be), so
/// naming one is refused with a 422 that changed nothing.
fn kept_day(budget: &Budget, day: Day) -> Result<Day, Problem> {
    let kept = budget.spec.kept_days(Timestamp::now());
    if kept.contains(day) {
        return Ok(day);
    }
    Err(Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "day-outside-window",
        "Day outside the budget's window",
    )
    .detail(format!(
        "budget `{}` keeps the days {} to {} (today in {} and the {} days before it); {day} is not one of them",
        budget.name,
        kept.oldest,
        kept.today,
        budget.spec.timezone_name,
        budget.spec.retention_days,
    ))
    .with("oldest_day", kept.oldest.to_string())
    .with("today", kept.today.to_string()))
}

/// Creates or replaces a budget (admin).
#[utoipa::path(put, path = "/budgets/{name}", operation_id = "putBudget", tag = "budgets", params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,128}$")),
    request_body(content = BudgetBody, content_type = "application/json"),
    security(("admin" = [])),
    responses((status = 200, description = "Stored", body = BudgetView),
        AdminProblems, WriteProblems, Problems))]
pub async fn put(
    _: Admin,
    State(state): State<AppState>,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<BudgetBody>,
) -> Result<Json<BudgetView>, Problem> {
    let name = Name::parse(&name)?;
    let spec = BudgetSpec::new(
        body.visitor_limit,
        body.global_limit,
        body.retention_days,
        body.timezone.as_deref(),
    )
    .map_err(|e| Problem::invalid_body(e.0))?;
    Ok(Json(state.db.put_budget(name, spec).await?.into()))
}

/// A budget's configuration.
#[utoipa::path(get, path = "/budgets/{name}", operation_id = "getBudget", tag = "budgets", params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,128}$")),
    responses((status = 200, description = "The budget", body = BudgetView), Problems))]
pub async fn get(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<BudgetView>, Problem> {
    let name = Name::parse(&name)?;
    Ok(Json(
        meter::get_budget(state.db.readers(), &name).await?.into(),
    ))
}

/// One call against a budget.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckBody {
    /// Who is calling: 1 to 256 characters, no control characters.
    #[schema(
        min_length = 1,
        max_length = 256,
        pattern = r"^[^\u0000-\u001F\u007F-\u009F]{1,256}$"
    )]
    visitor: String,
    /// The day to count the call on; today in the budget's time zone when
    /// left out. Only a day the budget keeps: today or one of the
    /// `retention_days` days before it; any other day (a future one
    /// included) is refused with 422 `/problems/day-outside-window`.
    #[schema(format = Date)]
    day: Option<String>,
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
    visitor_limit: u32,
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
    params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,128}$"), ("Idempotency-Key" = Option<String>, Header, pattern = r"^[!#-\[\]-~]{1,255}$", description = "Makes a retry safe: a repeat with the same key answers the first result (with Idempotent-Replayed: true) instead of writing again; reusing it for a different request is 422; kept for 24 h")),
    request_body(content = CheckBody, content_type = "application/json"),
    responses((status = 200, description = "Decided and committed", body = DecisionView,
        headers(("RateLimit-Policy" = String, description = "draft-ietf-httpapi-ratelimit-headers-10"),
                ("RateLimit" = String, description = "draft-ietf-httpapi-ratelimit-headers-10"),
                ("Retry-After" = u64, description = "On denials: seconds until the day resets"))),
        WriteProblems, Problems))]
/// A budget check. It fails closed: every answer other than a 200 carries
/// `"allowed": false`, and a database failure denies with `meter_error`.
pub async fn check(
    State(state): State<AppState>,
    Path(name): Path<String>,
    key: Result<IdempotencyKeyHeader, Problem>,
    body: Result<JsonBody<CheckBody>, Problem>,
) -> Result<(HeaderMap, Json<DecisionView>), Problem> {
    let deny = |p: Problem| p.with("allowed", false);
    let key = key.map_err(deny)?;
    let JsonBody(body) = body.map_err(deny)?;
    let name = Name::parse(&name).map_err(|e| deny(e.into()))?;
    let visitor = VisitorId::parse(&body.visitor)
        .map_err(|e| deny(Problem::invalid_body(format!("visitor: {}", e.0))))?;
    let day = body
        .day
        .as_deref()
        .map(Day::parse)
        .transpose()
        .map_err(|e| deny(Problem::invalid_body(format!("day: {}", e.0))))?;
    // A day the client names must be one the budget keeps, which only the
    // budget's configuration tells. The writer prunes from the real today
    // whatever day it is given, so even a budget changed between this read
    // and the check cannot make it delete a day it keeps.
    let day = match day {
        None => None,
        Some(day) => match meter::get_budget(state.db.readers(), &name).await {
            Ok(budget) => Some(kept_day(&budget, day).map_err(deny)?),
            Err(e) if e.is_storage_failure() => return Err(meter_failed(&e)),
            Err(e) => return Err(deny(e.into())),
        },
    };
    match state.db.check(name.clone(), visitor, day, key.0).await {
        Ok((decision, replayed)) => {
            // Budget names are configured by the operator: a bounded set.
            metrics::counter!("tally_budget_decisions_total",
                "budget" => name.as_str().to_owned(), "reason" => reason_label(decision.reason))
            .increment(1);
            let mut headers = rate_limit_headers(&decision, Timestamp::now());
            headers.extend(replayed_header(replayed));
            Ok((headers, Json(decision.into())))
        }
        Err(WriteError::Meter(e)) if e.is_storage_failure() => Err(meter_failed(&e)),
        Err(e) => Err(deny(e.into())),
    }
}

/// The answer to a check the database failed (an error, a full disk, a
/// lost file): denied, since a check fails closed.
fn meter_failed(err: &MeterError) -> Problem {
    // Whether the budget exists is unknown here: keep its name out of the
    // labels, so bad input cannot grow them.
    metrics::counter!("tally_budget_decisions_total",
        "budget" => "", "reason" => "meter_error")
    .increment(1);
    tracing::error!(error = %err, "budget check failed; denying");
    let denied = Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "meter-error",
        "Budget check failed",
    )
    .detail("the budget could not be checked, so the call is denied")
    .with("allowed", false)
    .with("reason", "meter_error");
    // A full or lost disk is not over at once: say when to try again.
    match err.is_storage_failure() {
        true => denied.retry_after(super::problem::STORAGE_RETRY_AFTER),
        false => denied,
    }
}

/// The quota fields of draft-ietf-httpapi-ratelimit-headers-10: one policy
/// per limit, `visitor` and `global`, each a quota `q` per window of `w`
/// seconds (the budget's day in its time zone: 23 or 25 hours when clocks
/// change), and what is left of each, `r`, with the seconds until the day
/// resets, `t`. A denied check also says `Retry-After: t`.
pub fn rate_limit_headers(d: &Decision, now: Timestamp) -> HeaderMap {
    let mut h = HeaderMap::new();
    let Some(w) = d.day.window(&d.timezone, now) else {
        return h;
    };
    let left = |limit: u32, used: i64| (i64::from(limit) - used).max(0);
    let policy = format!(
        "\"visitor\";q={};w={len}, \"global\";q={};w={len}",
        d.visitor_limit,
        d.global_limit,
        len = w.length_secs
    );
    let state = format!(
        "\"visitor\";r={};t={t}, \"global\";r={};t={t}",
        left(d.visitor_limit, d.visitor_calls),
        left(d.global_limit, d.global_calls),
        t = w.resets_in_secs
    );
    for (name, value) in [("ratelimit-policy", policy), ("ratelimit", state)] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(HeaderName::from_static(name), v);
        }
    }
    if !d.allowed() {
        h.insert(header::RETRY_AFTER, HeaderValue::from(w.resets_in_secs));
    }
    h
}

fn reason_label(r: Reason) -> &'static str {
    match r {
        Reason::Ok => "ok",
        Reason::VisitorLimit => "visitor_limit",
        Reason::GlobalLimit => "global_limit",
    }
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
    #[param(
        min_length = 1,
        max_length = 256,
        pattern = r"^[^\u0000-\u001F\u007F-\u009F]{1,256}$"
    )]
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
#[utoipa::path(get, path = "/budgets/{name}/usage", operation_id = "getUsage", tag = "budgets", params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,128}$"), UsageQuery),
    responses((status = 200, description = "Usage", body = UsageView), Problems))]
pub async fn usage(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Query(q): Query<UsageQuery>,
) -> Result<Json<UsageView>, Problem> {
    let name = Name::parse(&name)?;
    let day = parse_day(q.day.as_deref())?;
    let visitor = q.visitor.as_deref().map(VisitorId::parse).transpose()?;
    // Outside its window a budget has no usage to tell: future days have
    // none yet, and past ones read one thing or 0 depending on whether a
    // prune has run. Refuse them as a check would.
    let day = match day {
        None => None,
        Some(day) => Some(kept_day(
            &meter::get_budget(state.db.readers(), &name).await?,
            day,
        )?),
    };
    let u = meter::read_usage(state.db.readers(), &name, day, visitor.as_ref()).await?;
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
    #[schema(format = Date)]
    day: Option<String>,
    #[schema(
        min_length = 1,
        max_length = 256,
        pattern = r"^[^\u0000-\u001F\u007F-\u009F]{1,256}$"
    )]
    visitor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ResetView {
    #[schema(value_type = String)]
    budget: Name,
    #[schema(value_type = String, format = Date)]
    day: Day,
    #[schema(value_type = Option<String>)]
    visitor: Option<VisitorId>,
    deleted_rows: u64,
}

/// Clears a day's usage of a budget (admin).
#[utoipa::path(post, path = "/budgets/{name}/reset", operation_id = "resetUsage", tag = "budgets", params(("name" = String, Path, pattern = r"^[A-Za-z0-9._:-]{1,128}$")),
    request_body(content = Option<ResetBody>, content_type = "application/json"),
    security(("admin" = [])),
    responses((status = 200, description = "Cleared", body = ResetView),
        AdminProblems, WriteProblems, Problems))]
/// Clears a day's usage of a budget (today in its time zone by default):
/// every row of that day, or one visitor's only.
pub async fn reset(
    _: Admin,
    State(state): State<AppState>,
    Path(name): Path<String>,
    OptionalJson(body): OptionalJson<ResetBody>,
) -> Result<Json<ResetView>, Problem> {
    let name = Name::parse(&name)?;
    let day = body
        .day
        .as_deref()
        .map(Day::parse)
        .transpose()
        .map_err(|e| Problem::invalid_body(format!("day: {}", e.0)))?;
    let visitor = body
        .visitor
        .as_deref()
        .map(VisitorId::parse)
        .transpose()
        .map_err(|e| Problem::invalid_body(format!("visitor: {}", e.0)))?;
    // The default day is the budget's own today, and a day given must be
    // one it keeps, so the budget is read first.
    let budget = meter::get_budget(state.db.readers(), &name).await?;
    let day = match day {
        Some(d) => kept_day(&budget, d)?,
        None => Day::today(&budget.spec.timezone),
    };
    let scope = ResetScope { day, visitor };
    let deleted_rows = state.db.reset(name.clone(), scope.clone()).await?;
    Ok(Json(ResetView {
        budget: name,
        day: scope.day,
        visitor: scope.visitor,
        deleted_rows,
    }))
}
