//! The query of a list endpoint (`GET /budgets`, `GET /counters`): a
//! prefix, where the page starts, and how long it is; and the empty query
//! and body of a delete.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::Problem;
use crate::{
    db::list::{PageRequest, Unreadable},
    meter::{InvalidInput, Name},
    telemetry::Throttle,
};

/// Which page of a list: names in byte order, after `after`, starting
/// with `prefix`, `limit` of them at most.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only names starting with these characters (compared byte by byte:
    /// `a_` lists `a_b`, never `a-b`). A name itself.
    #[param(value_type = Option<Name>, inline)]
    prefix: Option<String>,
    /// Only names after this text, in byte order: the `next` of the
    /// previous page (a name, or the stored name of a row listed as
    /// unreadable, which may be empty).
    #[param(value_type = Option<String>)]
    after: Option<String>,
    /// The most entries on the page: 1 to 1000, 100 when left out.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    limit: Option<String>,
}

impl ListQuery {
    /// The page asked for. Parsed here rather than by the query's
    /// deserializer, so that a bad value is `invalid-input`, saying which
    /// parameter is wrong, as everywhere else.
    pub fn page(&self) -> Result<PageRequest, Problem> {
        let name = |field: &str, v: &Option<String>| {
            v.as_deref()
                .map(|s| Name::parse(s).map_err(|e| InvalidInput(format!("{field}: {}", e.0))))
                .transpose()
        };
        let limit = self
            .limit
            .as_deref()
            .map(|s| {
                s.parse::<u32>().map_err(|_| {
                    InvalidInput(format!(
                        "limit: must be a whole number from 1 to {}, got `{s}`",
                        PageRequest::MAX_LIMIT
                    ))
                })
            })
            .transpose()?;
        Ok(PageRequest::new(
            name("prefix", &self.prefix)?,
            self.after.clone(),
            limit,
        )?)
    }
}

/// A stored row of the page tally cannot read back (edited by hand, say):
/// it is not among the page's entries, and is named here with why. A `PUT`
/// of a budget replaces its row, a `DELETE` removes it; a name the API
/// does not take is for SQL to mend.
#[derive(Debug, Serialize, ToSchema)]
pub struct UnreadableView {
    /// The name as stored.
    name: String,
    /// What in the row cannot be read.
    problem: String,
}

impl UnreadableView {
    /// The page's unreadable rows, logged with the request's id (one line
    /// every 10 s at most: a client walking the list should not write a
    /// line per page).
    pub fn all(rows: Vec<Unreadable>) -> Vec<Self> {
        static UNREADABLE: Throttle = Throttle::new(std::time::Duration::from_secs(10));
        if let Some(first) = rows.first()
            && let Some(held_back) = UNREADABLE.admit()
        {
            tracing::warn!(
                name = ?first.name,
                problem = %first.problem,
                on_page = rows.len(),
                held_back,
                request_id = %super::instrument::request_id().as_deref().unwrap_or(""),
                "a stored row tally cannot read back was listed as unreadable; repair it with a PUT or remove it with a DELETE (or by SQL, if its name is none the API takes) (one line every 10 s at most; held_back: like lines not written since the last)"
            );
        }
        rows.into_iter()
            .map(|Unreadable { name, problem }| Self { name, problem })
            .collect()
    }
}

/// No parameters: a delete takes none, and refuses any (`400
/// invalid-query`) rather than deleting for a request it misread, such as
/// one with `?dry_run=true` or `?prefix=`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoQuery {}

/// No fields: a delete's body, if it has one, must be empty (or `{}`). A
/// body that asks for something (`{"day": ...}`, `{"visitor": ...}`) is
/// refused (`422`) rather than deleting the whole budget or counter.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoBody {}
