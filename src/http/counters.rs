use axum::{Json, extract::State};
use serde::{Deserialize, Serialize};

use super::{
    AppState, Problem,
    extract::{OptionalJson, Path},
};
use crate::meter::Name;

/// The counter behind `/counter`.
const DEFAULT_COUNTER: &str = "default";
/// Largest single increment.
pub const MAX_BY: u32 = 1_000_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IncrementBody {
    #[serde(default = "one")]
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

#[derive(Debug, Serialize)]
pub struct Value {
    value: i64,
}

#[derive(Debug, Serialize)]
pub struct NamedValue {
    name: Name,
    value: i64,
}

fn default_name() -> Name {
    Name::parse(DEFAULT_COUNTER).unwrap_or_else(|_| unreachable!("the default name is valid"))
}

async fn add(state: &AppState, name: Name, body: IncrementBody) -> Result<i64, Problem> {
    if !(1..=MAX_BY).contains(&body.by) {
        return Err(Problem::invalid_body(format!(
            "by: must be between 1 and {MAX_BY}, got {}",
            body.by
        )));
    }
    Ok(state.db.increment(name, i64::from(body.by)).await?)
}

pub async fn increment_default(
    State(state): State<AppState>,
    OptionalJson(body): OptionalJson<IncrementBody>,
) -> Result<Json<Value>, Problem> {
    let value = add(&state, default_name(), body).await?;
    Ok(Json(Value { value }))
}

pub async fn get_default(State(state): State<AppState>) -> Result<Json<Value>, Problem> {
    let value = state.db.read_counter(default_name()).await?;
    Ok(Json(Value { value }))
}

pub async fn increment(
    State(state): State<AppState>,
    Path(name): Path<String>,
    OptionalJson(body): OptionalJson<IncrementBody>,
) -> Result<Json<NamedValue>, Problem> {
    let name = Name::parse(&name)?;
    let value = add(&state, name.clone(), body).await?;
    Ok(Json(NamedValue { name, value }))
}

pub async fn get(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<NamedValue>, Problem> {
    let name = Name::parse(&name)?;
    let value = state.db.read_counter(name.clone()).await?;
    Ok(Json(NamedValue { name, value }))
}
