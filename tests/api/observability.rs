use reqwest::StatusCode;

use crate::helpers::{problem, spawn_app};

#[tokio::test]
async fn request_ids_round_trip_into_problems() {
    let app = spawn_app().await;
    // A client's own id is kept.
    let r = app
        .client
        .post(app.url("/counters/bad%20name"))
        .header("x-request-id", "client-chosen-42")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "client-chosen-42");
    let body = problem(r, StatusCode::BAD_REQUEST).await;
    assert_eq!(body["request_id"], "client-chosen-42");

    // Otherwise tally makes one, and the problem quotes the same.
    let r = app.get("/nope").await;
    let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    let body = problem(r, StatusCode::NOT_FOUND).await;
    assert_eq!(body["request_id"], id.as_str());

    // Successful answers carry it too.
    let r = app.get("/counter").await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.headers().contains_key("x-request-id"));
    app.stop().await.unwrap();
}
