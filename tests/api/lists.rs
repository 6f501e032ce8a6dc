//! `GET /budgets` and `GET /counters`: pages by name in byte order, keyed
//! by the last name of the previous page.

use std::{
    collections::BTreeSet,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{ADMIN, TestApp, problem, spawn_app};

/// The two lists, told apart by their path and the field holding the page.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Budgets,
    Counters,
}

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Kind::Budgets => "/budgets",
            Kind::Counters => "/counters",
        }
    }

    /// Creates `name`, asserting success.
    async fn create(self, app: &TestApp, name: &str) {
        let r = match self {
            Kind::Budgets => {
                let body =
                    json!({"visitor_limit": 3, "global_limit": 9, "timezone": "Europe/Berlin"});
                app.admin_put_budget(name, body).await
            }
            Kind::Counters => app.post_json(&format!("/counters/{name}"), json!({})).await,
        };
        assert_eq!(r.status(), StatusCode::OK, "create {name}");
    }

    async fn delete(self, app: &TestApp, name: &str) -> StatusCode {
        let r = app
            .client
            .delete(app.url(&format!("{}/{name}", self.path())))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
        r.status()
    }

    /// One page: its entries and `next`.
    async fn page(self, app: &TestApp, query: &str) -> (Vec<Value>, Option<String>) {
        let r = app.get(&format!("{}?{query}", self.path())).await;
        assert_eq!(r.status(), StatusCode::OK, "{query}");
        let body: Value = r.json().await.unwrap();
        let field = &self.path()[1..];
        assert_eq!(body.as_object().unwrap().len(), 2, "{body}");
        assert!(body.get("next").is_some(), "next is always there: {body}");
        let items = body[field].as_array().unwrap().clone();
        let next = body["next"].as_str().map(ToOwned::to_owned);
        (items, next)
    }

    /// The names of one page, and `next`.
    async fn names(self, app: &TestApp, query: &str) -> (Vec<String>, Option<String>) {
        let (items, next) = self.page(app, query).await;
        let names = items
            .iter()
            .map(|i| i["name"].as_str().unwrap().to_owned())
            .collect();
        (names, next)
    }

    /// Every page from the start, `limit` at a time: the names in page
    /// order, and how many pages.
    async fn walk(self, app: &TestApp, query: &str, limit: u32) -> (Vec<String>, usize) {
        let (mut all, mut pages, mut after) = (Vec::new(), 0, None::<String>);
        loop {
            let q = match &after {
                Some(a) => format!("{query}&limit={limit}&after={a}"),
                None => format!("{query}&limit={limit}"),
            };
            let (names, next) = self.names(app, &q).await;
            pages += 1;
            assert!(names.len() <= limit as usize);
            // `next` is the page's last name, and only on a full page.
            if let Some(n) = &next {
                assert_eq!(names.len(), limit as usize, "{q}");
                assert_eq!(names.last(), Some(n), "{q}");
            }
            all.extend(names);
            match next {
                Some(n) => after = Some(n),
                None => return (all, pages),
            }
        }
    }
}

/// Names whose byte order differs from a dictionary's: upper case before
/// lower, `-` `.` digits `:` before letters, `_` between upper and lower.
const NAMES: &[&str] = &[
    "a_b", "B", "a", "a-b", "a.b", "a:b", "A", "0", "ab", "a0", "Z", "_x", "zz",
];

fn byte_order(names: &[&str]) -> Vec<String> {
    let mut sorted: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    sorted.sort_unstable();
    sorted
}

async fn lists_in_byte_order_with_true_prefixes(kind: Kind) {
    let app = spawn_app().await;
    assert_eq!(kind.names(&app, "").await, (vec![], None), "empty at first");
    for n in NAMES {
        kind.create(&app, n).await;
    }
    let all = byte_order(NAMES);
    // The byte order, spelled out once.
    assert_eq!(
        all,
        [
            "0", "A", "B", "Z", "_x", "a", "a-b", "a.b", "a0", "a:b", "a_b", "ab", "zz"
        ]
    );
    assert_eq!(kind.names(&app, "").await, (all.clone(), None));
    // Every page size, through the end: each name once, in order, and
    // `next` null exactly on the last page (also when the last page is
    // full: 13 = 13 * 1).
    for limit in [1, 2, 3, 5, 12, 13, 14, 1000] {
        let (walked, pages) = kind.walk(&app, "", limit).await;
        assert_eq!(walked, all, "limit {limit}");
        assert_eq!(
            pages,
            all.len().div_ceil(limit as usize).max(1),
            "limit {limit}"
        );
    }
    // Prefixes are byte prefixes: `_` and `-` are themselves, no wildcard.
    let cases: &[(&str, &[&str])] = &[
        ("a", &["a", "a-b", "a.b", "a0", "a:b", "a_b", "ab"]),
        ("a_", &["a_b"]),
        ("a-", &["a-b"]),
        ("a.", &["a.b"]),
        ("_", &["_x"]),
        ("A", &["A"]),
        ("a_b", &["a_b"]),
        ("a_bc", &[]),
        ("y", &[]),
        ("zz", &["zz"]),
    ];
    for (prefix, want) in cases {
        let (names, next) = kind.names(&app, &format!("prefix={prefix}")).await;
        assert_eq!(names, *want, "prefix {prefix}");
        assert_eq!(next, None);
        let (walked, _) = kind.walk(&app, &format!("prefix={prefix}"), 2).await;
        assert_eq!(walked, *want, "prefix {prefix}, by 2");
    }
    // `after` with a prefix: before the prefix's names, among them, past them.
    let after: &[(&str, &str, &[&str])] = &[
        ("a", "B", &["a", "a-b", "a.b", "a0", "a:b", "a_b", "ab"]),
        ("a", "a", &["a-b", "a.b", "a0", "a:b", "a_b", "ab"]),
        ("a", "a0", &["a:b", "a_b", "ab"]),
        ("a", "ab", &[]),
        ("a", "b", &[]),
        ("", "a_b", &["ab", "zz"]),
        ("", "zz", &[]),
        ("", "a-a", &["a-b", "a.b", "a0", "a:b", "a_b", "ab", "zz"]),
    ];
    for (prefix, after, want) in after {
        let q = match *prefix {
            "" => format!("after={after}"),
            p => format!("prefix={p}&after={after}"),
        };
        let (names, next) = kind.names(&app, &q).await;
        assert_eq!(names, *want, "{q}");
        assert_eq!(next, None, "{q}");
    }
    // A page that ends exactly at the end has no next; one short of it has.
    let (names, next) = kind.names(&app, "prefix=a&limit=7").await;
    assert_eq!((names.len(), next), (7, None));
    let (names, next) = kind.names(&app, "prefix=a&limit=6").await;
    assert_eq!((names.len(), next.as_deref()), (6, Some("a_b")));
    app.stop().await.unwrap();
}

#[tokio::test]
async fn budgets_list_in_byte_order_with_true_prefixes() {
    lists_in_byte_order_with_true_prefixes(Kind::Budgets).await;
}

#[tokio::test]
async fn counters_list_in_byte_order_with_true_prefixes() {
    lists_in_byte_order_with_true_prefixes(Kind::Counters).await;
}

/// Each budget is listed exactly as `GET /budgets/{name}` answers it; each
/// counter with its value, as `GET /counters/{name}` does.
#[tokio::test]
async fn entries_are_what_a_get_answers() {
    let app = spawn_app().await;
    app.admin_put_budget(
        "b1",
        json!({"visitor_limit": 0, "global_limit": 4294967295_u32}),
    )
    .await;
    app.admin_put_budget(
        "b2",
        json!({"visitor_limit": 5, "global_limit": 7, "retention_days": 30, "timezone": "america/new_york"}),
    )
    .await;
    let (items, next) = Kind::Budgets.page(&app, "").await;
    assert_eq!(next, None);
    assert_eq!(items.len(), 2);
    for item in &items {
        let name = item["name"].as_str().unwrap();
        let one: Value = app
            .get(&format!("/budgets/{name}"))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(*item, one);
    }
    assert_eq!(items[1]["timezone"], "America/New_York");
    app.post_json("/counters/c1", json!({"by": 41})).await;
    app.post_json("/counters/c1", json!({})).await;
    app.post_json("/counter", json!({"by": 3})).await;
    let (items, _) = Kind::Counters.page(&app, "").await;
    assert_eq!(
        items,
        [
            json!({"name": "c1", "value": 42}),
            json!({"name": "default", "value": 3})
        ]
    );
    app.stop().await.unwrap();
}

/// Bad query input is a 400 problem naming what is wrong, on both lists;
/// unknown parameters are refused as on `GET /budgets/{name}/usage`.
#[tokio::test]
async fn bad_list_queries_are_400() {
    let app = spawn_app().await;
    let long = "a".repeat(129);
    let invalid_input: &[(&str, &str)] = &[
        ("prefix=", "prefix"),
        ("prefix=a%20b", "prefix"),
        ("prefix=a*", "prefix"),
        ("prefix=%C3%A9", "prefix"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=4294967296", "limit"),
        ("limit=-1", "limit"),
        ("limit=1.5", "limit"),
        ("limit=ten", "limit"),
        ("limit=", "limit"),
        ("prefix=a&limit=0", "limit"),
    ];
    for kind in [Kind::Budgets, Kind::Counters] {
        for (q, field) in invalid_input {
            let r = app.get(&format!("{}?{q}", kind.path())).await;
            let body = problem(r, StatusCode::BAD_REQUEST).await;
            assert_eq!(body["type"], "/problems/invalid-input", "{q}: {body}");
            let detail = body["detail"].as_str().unwrap();
            assert!(detail.starts_with(&format!("{field}: ")), "{q}: {detail}");
        }
        let r = app.get(&format!("{}?prefix={long}", kind.path())).await;
        problem(r, StatusCode::BAD_REQUEST).await;
        for q in ["page=2", "limit=1&limit=2", "prefix=a&prefix=b", "%FF=1"] {
            let r = app.get(&format!("{}?{q}", kind.path())).await;
            let body = problem(r, StatusCode::BAD_REQUEST).await;
            assert_eq!(body["type"], "/problems/invalid-query", "{q}: {body}");
        }
        // The edges of what is accepted.
        for q in [
            "limit=1",
            "limit=1000",
            "limit=%2B5",
            "prefix=a&after=a",
            "after=x/y",
            "after=a%20b",
            "after=%C3%A9",
            "after=",
            "after=a%00b",
            "after=%F4%8F%BF%BF",
            "",
        ] {
            let r = app.get(&format!("{}?{q}", kind.path())).await;
            assert_eq!(r.status(), StatusCode::OK, "{q}");
        }
    }
    app.stop().await.unwrap();
}

/// A walk through every page while names are created and deleted all
/// along: every name that existed before the walk and still exists after
/// it is seen exactly once, no name is seen twice, and names come in byte
/// order across pages.
async fn a_walk_under_writes_sees_each_lasting_name_once(kind: Kind) {
    let app = Arc::new(spawn_app().await);
    let before: Vec<String> = (0..240).map(|i| format!("w{i:03}")).collect();
    for n in &before {
        kind.create(&app, n).await;
    }
    // Every third name is deleted during the walk, in a random order; new
    // names land between the old ones, before and after where the walk is.
    let mut doomed: Vec<String> = before.iter().step_by(3).cloned().collect();
    fastrand::Rng::with_seed(5).shuffle(&mut doomed);
    let walking = Arc::new(AtomicBool::new(true));
    let writes = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (app, walking, writes) = (Arc::clone(&app), Arc::clone(&walking), Arc::clone(&writes));
        tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(6);
            let mut created = Vec::new();
            let mut deleted = Vec::new();
            let mut doomed = doomed.into_iter();
            while walking.load(Ordering::Relaxed) {
                let new = format!("w{:03}{}", rng.u32(0..240), rng.alphanumeric());
                kind.create(&app, &new).await;
                created.push(new);
                if let Some(d) = doomed.next() {
                    assert_eq!(kind.delete(&app, &d).await, StatusCode::NO_CONTENT, "{d}");
                    deleted.push(d);
                }
                writes.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
            (created, deleted)
        })
    };
    // Paced by the writes: at least one create and one delete between any
    // two pages, however fast or slow the disk.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    let mut pages = 0;
    loop {
        let q = match &after {
            Some(a) => format!("limit=7&after={a}"),
            None => "limit=7".to_owned(),
        };
        let (names, next) = kind.names(&app, &q).await;
        seen.extend(names);
        pages += 1;
        let written = writes.load(Ordering::Relaxed);
        for _ in 0..5000 {
            if writes.load(Ordering::Relaxed) > written {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        match next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    let during = writes.load(Ordering::Relaxed);
    walking.store(false, Ordering::Relaxed);
    let (_created, deleted) = writer.await.unwrap();
    assert!(during >= pages, "only {during} writes during {pages} pages");

    let unique: BTreeSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "a name was seen twice");
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "out of byte order");
    let deleted: BTreeSet<&String> = deleted.iter().collect();
    for n in before.iter().filter(|n| !deleted.contains(n)) {
        assert!(unique.contains(n), "{n} lasted the walk but was not seen");
    }
    Arc::into_inner(app).unwrap().stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_walk_under_writes_sees_each_lasting_budget_once() {
    a_walk_under_writes_sees_each_lasting_name_once(Kind::Budgets).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_walk_under_writes_sees_each_lasting_counter_once() {
    a_walk_under_writes_sees_each_lasting_name_once(Kind::Counters).await;
}

/// A stored row tally cannot read back (a budget whose time zone is none
/// tally knows, a counter whose name the API would refuse: edited by hand)
/// fails neither the page it is on nor the walk: it is named among the
/// page's `unreadable` rows with why, counts towards the page's limit,
/// may end the page (its stored name is then `next`, taken as `after`),
/// and a budget's is mended by a `PUT` or removed by a `DELETE`. Once one such row made every page
/// it fell on `500`, and every name after it unreachable.
#[tokio::test]
async fn an_unreadable_row_is_named_and_paged_past() {
    let app = spawn_app().await;
    for name in ["a", "c"] {
        Kind::Counters.create(&app, name).await;
        Kind::Budgets.create(&app, name).await;
    }
    Kind::Budgets.create(&app, "b").await;
    app.sql_behind("UPDATE budgets SET timezone = 'Mars/Olympus' WHERE name = 'b'")
        .await;
    app.sql_behind("INSERT INTO counters (name, value) VALUES ('b c', 7)")
        .await;
    let cases = [
        (Kind::Budgets, "b", "bad time zone"),
        (Kind::Counters, "b c", "not ' '"),
    ];
    for (kind, bad, why) in cases {
        let field = &kind.path()[1..];
        let page = |query: String| {
            let app = &app;
            async move {
                let r = app.get(&format!("{}?{query}", kind.path())).await;
                assert_eq!(r.status(), StatusCode::OK, "{query}");
                r.json::<Value>().await.unwrap()
            }
        };
        let names = |v: &Value| -> Vec<String> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|i| i["name"].as_str().unwrap().to_owned())
                .collect()
        };
        let whole = page(String::new()).await;
        assert_eq!(names(&whole[field]), ["a", "c"], "{whole}");
        let unreadable = whole["unreadable"].as_array().unwrap();
        assert_eq!(unreadable.len(), 1, "{whole}");
        assert_eq!(unreadable[0]["name"], bad, "{whole}");
        let problem_text = unreadable[0]["problem"].as_str().unwrap();
        assert!(problem_text.contains(why), "{problem_text}");
        assert_eq!(whole["next"], Value::Null);
        // A page ending on it goes on past it.
        let first = page("limit=2".into()).await;
        assert_eq!(names(&first[field]), ["a"], "{first}");
        assert_eq!(first["next"], bad, "{first}");
        let after: String = url_escape(bad);
        let second = page(format!("limit=2&after={after}")).await;
        assert_eq!(names(&second[field]), ["c"], "{second}");
        assert!(second.get("unreadable").is_none(), "{second}");
        assert_eq!(second["next"], Value::Null, "{second}");
    }
    // Read alone, it is a 500 that names it.
    let p = problem(
        app.get("/budgets/b").await,
        StatusCode::INTERNAL_SERVER_ERROR,
    )
    .await;
    let detail = p["detail"].as_str().unwrap();
    assert!(
        detail.contains("stored budget `b`: bad time zone"),
        "{detail}"
    );
    // A DELETE removes the row; a PUT replaces one: it is listed again.
    Kind::Budgets.create(&app, "d").await;
    app.sql_behind("UPDATE budgets SET timezone = 'Mars/Olympus' WHERE name = 'd'")
        .await;
    assert_eq!(
        Kind::Budgets.delete(&app, "d").await,
        StatusCode::NO_CONTENT
    );
    Kind::Budgets.create(&app, "b").await;
    let (names, next) = Kind::Budgets.names(&app, "").await;
    assert_eq!(
        (names, next),
        (vec!["a".into(), "b".into(), "c".into()], None)
    );
    app.stop().await.unwrap();
}

/// A walk a row at a time passes every stored row however it is named,
/// each once, in byte order: an empty name, one at U+10FFFF (above what
/// the last page once looked at) and, on SQLite, one holding a NUL. Ended
/// on such a row, a page's `next` is its name, which `after` takes (an
/// empty `after` and one holding a NUL were refused, and the walk stopped
/// there).
#[tokio::test]
async fn a_walk_passes_every_stored_row_however_it_is_named() {
    let app = spawn_app().await;
    for name in ["a", "c"] {
        Kind::Counters.create(&app, name).await;
    }
    app.sql_behind("INSERT INTO counters (name, value) VALUES ('', 1), ('b c', 1)")
        .await;
    app.sql_behind("INSERT INTO counters (name, value) VALUES ('\u{10FFFF}z', 1)")
        .await;
    let mut want = vec!["", "a", "b c", "c", "\u{10FFFF}z"];
    if !crate::helpers::on_postgres() {
        app.sql_behind("INSERT INTO counters (name, value) VALUES (CAST(X'62006321' AS TEXT), 1)")
            .await;
        want.insert(2, "b\0c!");
    }
    let (mut seen, mut after) = (Vec::<String>::new(), None::<String>);
    for _ in 0..20 {
        let query = match &after {
            Some(a) => format!("limit=1&after={}", url_escape(a)),
            None => "limit=1".into(),
        };
        let r = app.get(&format!("/counters?{query}")).await;
        assert_eq!(r.status(), StatusCode::OK, "{query}");
        let page: Value = r.json().await.unwrap();
        let rows = page["counters"]
            .as_array()
            .unwrap()
            .iter()
            .chain(page["unreadable"].as_array().into_iter().flatten());
        seen.extend(rows.map(|r| r["name"].as_str().unwrap().to_owned()));
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, want);
    // After a text holding a NUL, which PostgreSQL cannot take: the names
    // after it all the same.
    let r = app.get("/counters?limit=1&after=b%00").await;
    assert_eq!(r.status(), StatusCode::OK);
    let page: Value = r.json().await.unwrap();
    assert_eq!(page["next"].as_str(), Some(want[2]), "{page}");
    app.stop().await.unwrap();
}

/// `s` as a query value: every byte outside `[A-Za-z0-9]` escaped.
fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b.is_ascii_alphanumeric() {
            true => (b as char).to_string(),
            false => format!("%{b:02X}"),
        })
        .collect()
}

/// The warning of a page's unreadable row names the request that listed
/// it, as every line written while a request runs does.
#[tokio::test]
async fn the_warning_of_an_unreadable_row_names_its_request() {
    use crate::helpers::{Binary, behind, database_in};
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let bin = Binary::start(&[("TALLY_DATABASE", &db)]);
    behind(&db, "INSERT INTO counters (name, value) VALUES ('b c', 7)").await;
    let r = reqwest::Client::new()
        .get(bin.url("/counters"))
        .header("x-request-id", "list-req-4711")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    bin.logs_within("listed as unreadable", Duration::from_secs(10))
        .await;
    let line = bin
        .log_text()
        .lines()
        .find(|l| l.contains("listed as unreadable"))
        .unwrap()
        .to_owned();
    assert!(line.contains("list-req-4711"), "{line}");
}
