//! The chart's alerting rules (`helm/tally/files/prometheus-rules.yaml`) and
//! Grafana dashboard (`helm/tally/files/grafana-dashboard.json`).
//!
//! promtool checks the rules and runs their unit tests
//! (`fixtures/prometheus-rules-test.yaml`: every alert fires on synthetic
//! series, none on a healthy pod). Every metric a rule or a panel names must
//! be one that tally or Litestream really exports: the test runs tally as
//! Litestream's child, as in the image (Litestream replicating to S3 on
//! loopback, tally behind the replica gate), drives traffic that makes
//! tally's series appear, and reads both `/metrics` endpoints.

use std::{
    collections::{BTreeMap, BTreeSet},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use crate::loopback::{S3, free_port, tool, tool_in};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn rules_file() -> PathBuf {
    repo().join("helm/tally/files/prometheus-rules.yaml")
}

/// The page holding a runbook for every alert, as the rules' `runbook`
/// annotations name it (relative to the repository).
const RUNBOOKS: &str = "docs/runbooks.md";

fn dashboard_file() -> PathBuf {
    repo().join("helm/tally/files/grafana-dashboard.json")
}

/// Runs a short-lived tool, killed if it outlives `limit`; its exit status
/// and stdout plus stderr.
fn run(cmd: &mut Command, limit: Duration) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out");
    let out = std::fs::File::create(&out_path).unwrap();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?} does not start: {e}"));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} ran for more than {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status.success(),
        std::fs::read_to_string(&out_path).unwrap(),
    )
}

fn promtool(args: &[&str]) -> (bool, String) {
    run(
        Command::new(tool_in("prometheus/usr/bin", "promtool")).args(args),
        Duration::from_secs(60),
    )
}

fn rules() -> serde_yaml_ng::Value {
    serde_yaml_ng::from_str(&std::fs::read_to_string(rules_file()).unwrap()).unwrap()
}

/// Every alerting rule of the file, as YAML mappings.
fn alerts(rules: &serde_yaml_ng::Value) -> Vec<&serde_yaml_ng::Value> {
    rules["groups"]
        .as_sequence()
        .expect("a `groups:` list")
        .iter()
        .flat_map(|g| g["rules"].as_sequence().expect("each group has rules"))
        .filter(|r| r.get("alert").is_some())
        .collect()
}

fn alert_name(rule: &serde_yaml_ng::Value) -> &str {
    rule["alert"].as_str().unwrap()
}

fn dashboard() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dashboard_file()).unwrap())
        .expect("the dashboard is JSON")
}

fn panels(dashboard: &Value) -> &Vec<Value> {
    dashboard["panels"].as_array().expect("a panels list")
}

/// Every PromQL expression of the dashboard's panels, named for messages.
fn dashboard_exprs(dashboard: &Value) -> Vec<(String, String)> {
    let mut exprs = Vec::new();
    for p in panels(dashboard) {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.push((
                format!("panel {:?} target {}", p["title"], t["refId"]),
                t["expr"].as_str().unwrap_or_default().to_owned(),
            ));
        }
    }
    exprs
}

/// Grafana's variables replaced by what Prometheus would be sent.
fn as_prometheus_sees_it(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$namespace", ".*")
        .replace("$pod", ".*")
}

#[test]
fn alert_rules_pass_promtool_check() {
    let file = rules_file();
    let (ok, out) = promtool(&[
        "check",
        "rules",
        "--lint=all",
        "--lint-fatal",
        file.to_str().unwrap(),
    ]);
    assert!(
        ok && out.contains("SUCCESS"),
        "promtool check rules:\n{out}"
    );
}

#[test]
fn every_alert_fires_on_synthetic_series_and_none_on_a_healthy_pod() {
    let fixture = repo().join("tests/deploy/fixtures/prometheus-rules-test.yaml");
    let (ok, out) = promtool(&["test", "rules", fixture.to_str().unwrap()]);
    assert!(ok && out.contains("SUCCESS"), "promtool test rules:\n{out}");

    // promtool only checks the cases written down: make sure each alert has
    // one where it fires and one where it must not.
    let rules = rules();
    let names: BTreeSet<&str> = alerts(&rules).into_iter().map(alert_name).collect();
    let tests: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&fixture).unwrap()).unwrap();
    let (mut fires, mut silent) = (BTreeSet::new(), BTreeSet::new());
    for test in tests["tests"].as_sequence().unwrap() {
        for case in test["alert_rule_test"].as_sequence().into_iter().flatten() {
            let name = case["alertname"].as_str().unwrap().to_owned();
            assert!(
                names.contains(name.as_str()),
                "the fixture tests {name}, which the rules do not define"
            );
            match case["exp_alerts"].as_sequence() {
                Some(exp) if !exp.is_empty() => fires.insert(name),
                _ => silent.insert(name),
            };
        }
    }
    for name in &names {
        assert!(
            fires.contains(*name),
            "no test case makes {name} fire ({})",
            fixture.display()
        );
        assert!(
            silent.contains(*name),
            "no test case checks that {name} stays silent"
        );
    }
}

/// The anchor GitHub gives a Markdown heading.
fn github_anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn every_alert_has_a_severity_a_summary_and_a_runbook() {
    let rules = rules();
    let alerts = alerts(&rules);
    assert!(!alerts.is_empty());
    let mut seen = BTreeSet::new();
    for rule in alerts {
        let name = alert_name(rule);
        assert!(seen.insert(name), "{name} is defined twice");
        let severity = rule["labels"]["severity"].as_str().unwrap_or_default();
        assert!(
            ["critical", "warning"].contains(&severity),
            "{name}: severity {severity:?}"
        );
        for key in ["summary", "description"] {
            let text = rule["annotations"][key].as_str().unwrap_or_default();
            assert!(!text.trim().is_empty(), "{name} has no {key}");
        }
        assert_eq!(
            rule["annotations"]["runbook"].as_str(),
            Some(format!("{RUNBOOKS}#alert-{}", name.to_lowercase()).as_str()),
            "{name}: the runbook annotation names its section of {RUNBOOKS}"
        );
    }
}

#[test]
fn every_alert_has_its_runbook_section_in_the_runbooks_page() {
    let runbooks = std::fs::read_to_string(repo().join(RUNBOOKS)).unwrap();
    let anchors: BTreeSet<String> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|h| github_anchor(h.trim_start_matches('#')))
        .collect();
    let rules = rules();
    let missing: Vec<&str> = alerts(&rules)
        .into_iter()
        .map(alert_name)
        .filter(|name| !anchors.contains(&format!("alert-{}", name.to_lowercase())))
        .collect();
    assert!(
        missing.is_empty(),
        "{RUNBOOKS} has no heading \"Alert: <name>\" (anchor #alert-<name>) for {missing:?}"
    );
}

#[test]
fn dashboard_is_a_grafana_dashboard_with_a_query_in_every_panel() {
    let text = std::fs::read_to_string(dashboard_file()).unwrap();
    // The chart embeds the file four spaces deep in a ConfigMap, and the
    // rendered chart goes through yamllint (lines up to 250).
    for (i, line) in text.lines().enumerate() {
        assert!(line.len() <= 240, "line {} is {} long", i + 1, line.len());
    }
    let d = dashboard();
    let schema = d["schemaVersion"].as_u64().unwrap_or(0);
    assert!((36..=41).contains(&schema), "schemaVersion {schema}");
    assert!(d["uid"].as_str().is_some_and(|u| !u.is_empty()));
    assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));

    let vars = d["templating"]["list"].as_array().unwrap();
    let datasource = vars
        .iter()
        .find(|v| v["name"] == "datasource")
        .expect("a `datasource` template variable");
    assert_eq!(datasource["type"], "datasource");
    assert_eq!(datasource["query"], "prometheus");
    let prometheus = json!({"type": "prometheus", "uid": "${datasource}"});
    for v in vars.iter().filter(|v| v["type"] == "query") {
        assert_eq!(v["datasource"], prometheus, "variable {}", v["name"]);
    }

    let panels = panels(&d);
    assert!(panels.len() >= 10, "{} panels", panels.len());
    let mut ids = BTreeSet::new();
    let mut cells = BTreeSet::new();
    for p in panels {
        let title = p["title"].as_str().unwrap_or_default();
        assert!(!title.is_empty(), "a panel without a title: {p}");
        assert!(ids.insert(p["id"].as_u64().unwrap()), "{title}: id reused");
        assert!(
            ["timeseries", "stat"].contains(&p["type"].as_str().unwrap_or_default()),
            "{title}: type {}",
            p["type"]
        );
        assert_eq!(p["datasource"], prometheus, "{title}: datasource");
        let targets = p["targets"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        assert!(!targets.is_empty(), "{title}: no target");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert_eq!(t["datasource"], prometheus, "{title}: target datasource");
            assert!(
                refs.insert(t["refId"].as_str().unwrap()),
                "{title}: refId reused"
            );
            assert!(
                t["expr"].as_str().is_some_and(|e| !e.trim().is_empty()),
                "{title}: empty expr"
            );
        }
        // Panels on the 24-column grid, none on top of another.
        let g = &p["gridPos"];
        let (x, y, w, h) = (
            g["x"].as_u64().unwrap(),
            g["y"].as_u64().unwrap(),
            g["w"].as_u64().unwrap(),
            g["h"].as_u64().unwrap(),
        );
        assert!(w > 0 && h > 0 && x + w <= 24, "{title}: gridPos {g}");
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(cells.insert((cx, cy)), "{title} overlaps another panel");
            }
        }
    }

    // Every query parses as PromQL once Grafana has put in its variables:
    // promtool parses them as recording rules.
    let records: Vec<serde_yaml_ng::Value> = dashboard_exprs(&d)
        .iter()
        .enumerate()
        .map(|(i, (_, expr))| {
            let mut rule = serde_yaml_ng::Mapping::new();
            rule.insert("record".into(), format!("dashboard:query_{i}").into());
            rule.insert("expr".into(), as_prometheus_sees_it(expr).into());
            serde_yaml_ng::Value::Mapping(rule)
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard-queries.yaml");
    let mut doc = serde_yaml_ng::Mapping::new();
    let mut group = serde_yaml_ng::Mapping::new();
    group.insert("name".into(), "dashboard".into());
    group.insert("rules".into(), serde_yaml_ng::Value::Sequence(records));
    doc.insert(
        "groups".into(),
        serde_yaml_ng::Value::Sequence(vec![serde_yaml_ng::Value::Mapping(group)]),
    );
    std::fs::write(&file, serde_yaml_ng::to_string(&doc).unwrap()).unwrap();
    let (ok, out) = promtool(&["check", "rules", file.to_str().unwrap()]);
    assert!(ok, "a dashboard query does not parse:\n{out}");
}

// ---------------------------------------------------------------------------
// What tally and Litestream really export.

/// Metric families read off a `/metrics` exposition.
#[derive(Default)]
struct Exported {
    /// Family name -> `counter`, `gauge`, `histogram`, ...
    types: BTreeMap<String, String>,
    /// Sample name (`x_bucket` and the like included) -> its label names.
    samples: BTreeMap<String, BTreeSet<String>>,
}

impl Exported {
    fn add(&mut self, text: &str) {
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                    self.types.insert(name.to_owned(), kind.to_owned());
                }
                continue;
            }
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            let name = &line[..end];
            let labels = self.samples.entry(name.to_owned()).or_default();
            if line[end..].starts_with('{') {
                labels.extend(label_names_of_sample(&line[end + 1..]));
            }
        }
    }

    /// The type of the family a sample name belongs to.
    fn type_of(&self, sample: &str) -> Option<&str> {
        if let Some(t) = self.types.get(sample) {
            return Some(t);
        }
        ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let base = sample.strip_suffix(suffix)?;
            self.types
                .get(base)
                .filter(|t| *t == "histogram" || *t == "summary")
                .map(String::as_str)
        })
    }
}

/// Label names of `a="x",b="y"} 1` (values may hold `,`, `}` and escapes).
fn label_names_of_sample(s: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let name: String =
            std::iter::from_fn(|| chars.next_if(|c| *c != '=' && *c != '}')).collect();
        if chars.next() != Some('=') {
            return names;
        }
        names.push(name.trim().to_owned());
        assert_eq!(chars.next(), Some('"'), "label value of {s}");
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => break,
                _ => {}
            }
        }
    }
}

/// A metric the rules or the dashboard may name although the live
/// expositions cannot show it: it is created at its first event, and that
/// event cannot be caused in a process that can still be scraped. Its
/// `evidence` vouches for it instead.
struct Lazy {
    name: &'static str,
    kind: &'static str,
    labels: &'static [&'static str],
    evidence: Evidence,
}

const LAZY: &[Lazy] = &[
    // The writer's death: tally exits at once. tally now exports this
    // counter at 0 from the start (as every counter with known label sets,
    // e.g. the storage_full and storage_lost results), so the live
    // exposition already shows it; the entry keeps the source check of it.
    Lazy {
        name: "tally_write_outcome_unknown_total",
        kind: "counter",
        labels: &[],
        evidence: Evidence::TallySource,
    },
    // A failed WAL checkpoint, which a healthy SQLite does not produce.
    Lazy {
        name: "litestream_checkpoint_error_count",
        kind: "counter",
        labels: &["db", "mode"],
        evidence: Evidence::LitestreamBinary,
    },
];

#[derive(Clone, Copy, Debug)]
enum Evidence {
    /// Described (with its type) in `src/prometheus.rs` and emitted in `src/`.
    TallySource,
    /// Its name is in the Litestream binary the tests run.
    LitestreamBinary,
}

/// Labels every series gets from its scrape target (PodMonitor,
/// ServiceMonitor or the usual pod-annotation scrape configuration), never
/// from the exporter.
const TARGET_LABELS: &[&str] = &[
    "namespace",
    "pod",
    "job",
    "instance",
    "container",
    "endpoint",
    "service",
];

fn check_lazy() -> Vec<String> {
    let mut problems = Vec::new();
    fn rust_sources(dir: &Path, into: &mut String) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let p = entry.path();
            if p.is_dir() {
                rust_sources(&p, into);
            } else if p.extension().is_some_and(|x| x == "rs") {
                into.push_str(&std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    let mut src = String::new();
    rust_sources(&repo().join("src"), &mut src);
    let observe = std::fs::read_to_string(repo().join("src/prometheus.rs")).unwrap();
    let litestream = std::fs::read(tool("litestream")).unwrap();
    for Lazy {
        name,
        kind,
        evidence,
        ..
    } in LAZY
    {
        let quoted = format!("\"{name}\"");
        let ok = match evidence {
            Evidence::TallySource => {
                let described = observe
                    .split(&format!("describe_{}!(", kind))
                    .skip(1)
                    .any(|rest| rest.trim_start().starts_with(&quoted));
                let emitted = src
                    .split(&format!("{kind}!("))
                    .skip(1)
                    .any(|rest| rest.trim_start().starts_with(&quoted));
                described && emitted
            }
            Evidence::LitestreamBinary => {
                litestream.windows(name.len()).any(|w| w == name.as_bytes())
            }
        };
        if !ok {
            problems.push(format!("{name} is not what {evidence:?} says it is"));
        }
    }
    problems
}

/// tally as Litestream's child, as the image runs it, with S3 on loopback.
/// Both run in a process group of their own, ended on drop.
struct Stack {
    group: Child,
    dir: tempfile::TempDir,
    http: String,
    tally_metrics: String,
    litestream_metrics: String,
    s3: S3,
}

const ADMIN_TOKEN: &str = "monitoring-admin";

impl Stack {
    async fn start() -> Self {
        let s3 = S3::start().await;
        let bucket = "tally-monitoring";
        s3.create_bucket(bucket).await;
        let dir = tempfile::tempdir().unwrap();
        let (http, metrics, litestream) = (free_port(), free_port(), free_port());
        let tally = env!("CARGO_BIN_EXE_tally");
        // -exec splits its argument on white space.
        assert!(!tally.contains(char::is_whitespace), "{tally}");
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let group = Command::new(tool("litestream"))
            .args(["replicate", "-config"])
            .arg(repo().join("litestream.yml"))
            .args(["-exec", tally])
            // This machine's CA bundle breaks Litestream's S3 client.
            .env_remove("AWS_CA_BUNDLE")
            .env("TALLY_DATABASE", dir.path().join("tally.db"))
            .env(
                "TALLY_LITESTREAM_SOCKET",
                dir.path().join("litestream.sock"),
            )
            .env("LITESTREAM_BUCKET", bucket)
            .env("LITESTREAM_PATH", "monitoring")
            .env("LITESTREAM_ENDPOINT", &s3.endpoint)
            .env("LITESTREAM_REGION", "us-east-1")
            .env("LITESTREAM_FORCE_PATH_STYLE", "true")
            .env("LITESTREAM_ACCESS_KEY_ID", "test")
            .env("LITESTREAM_SECRET_ACCESS_KEY", "test")
            .env("LITESTREAM_METRICS_ADDR", format!("127.0.0.1:{litestream}"))
            .env("TALLY_LISTEN", format!("127.0.0.1:{http}"))
            .env("TALLY_METRICS_LISTEN", format!("127.0.0.1:{metrics}"))
            .env("TALLY_ADMIN_TOKEN", ADMIN_TOKEN)
            // As the chart sets it with persistence.sizeLimit: the storage
            // gauges the alert and the dashboard read are exported.
            .env("TALLY_STORAGE_LIMIT", "1Gi")
            .env("TALLY_REPLICA_WAIT_TIMEOUT", "30")
            .env("TALLY_LITESTREAM", tool("litestream"))
            .env("TALLY_LOG_FORMAT", "json")
            // A tiny queue and a slow writer, so that 429s and callers who
            // gave up happen on demand.
            .env("TALLY_QUEUE_CAPACITY", "2")
            .env("TALLY_MAX_BATCH", "1")
            .env("TALLY_TEST_WRITER_DELAY_MS", "40")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("litestream starts");
        let mut stack = Stack {
            group,
            dir,
            http: format!("http://127.0.0.1:{http}"),
            tally_metrics: format!("http://127.0.0.1:{metrics}/metrics"),
            litestream_metrics: format!("http://127.0.0.1:{litestream}/metrics"),
            s3,
        };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = stack.group.try_wait().unwrap() {
                panic!("litestream exited ({status}):\n{}", stack.log());
            }
            let ready = client
                .get(format!("{}/ready", stack.http))
                .timeout(Duration::from_secs(2))
                .send()
                .await;
            if ready.is_ok_and(|r| r.status() == 200) {
                return stack;
            }
            assert!(
                Instant::now() < deadline,
                "tally was not ready within 60 s:\n{}",
                stack.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.http)
    }

    /// Scrapes Litestream's metrics until `done` holds for the text, or
    /// panics after `limit` naming `what` was awaited, with the last scrape
    /// and the end of the stack's log (Litestream's side of a failure).
    async fn litestream_until(
        &self,
        what: &str,
        limit: Duration,
        done: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let text = scrape(&self.litestream_metrics).await;
            if done(&text) {
                return text;
            }
            if Instant::now() >= deadline {
                let log = self.log();
                let tail: Vec<&str> = log.lines().rev().take(80).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                panic!(
                    "{what}: not within {limit:?}\nnow:\n{text}\nlog (last 80 lines):\n{}",
                    tail.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        use nix::sys::signal::{Signal, killpg};
        let group = nix::unistd::Pid::from_raw(self.group.id() as i32);
        // SIGTERM lets Litestream stop tally and sync; SIGKILL if that
        // takes too long, so nothing outlives the test.
        let _ = killpg(group, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if matches!(self.group.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = killpg(group, Signal::SIGKILL);
        let _ = self.group.wait();
    }
}

async fn scrape(url: &str) -> String {
    let r = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert_eq!(r.status(), 200, "GET {url}");
    r.text().await.unwrap()
}

fn has_sample(text: &str, name: &str) -> bool {
    text.lines()
        .any(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
}

/// Whether a series of `name` has counted anything.
fn counted(text: &str, name: &str) -> bool {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .any(|v| v > 0.0)
}

/// Traffic that makes tally's series appear: writes, a budget and its
/// checks (both reasons, a retention prune), 429s from a full queue, and
/// writes whose callers gave up before the slow writer answered.
async fn drive(stack: &Stack) {
    let client = reqwest::Client::new();
    let ok = |r: reqwest::Response| {
        assert!(r.status().is_success(), "{} {}", r.url(), r.status());
    };
    ok(client
        .put(stack.url("/budgets/monitoring"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"visitor_limit": 1, "global_limit": 100, "retention_days": 1}))
        .send()
        .await
        .unwrap());
    // A check may name only a day its budget keeps (today in UTC, its zone,
    // and the day before): a prune runs on each day's first call.
    let today = jiff::Timestamp::now().in_tz("UTC").unwrap().date();
    let (today, yesterday) = (today.to_string(), today.yesterday().unwrap().to_string());
    for (visitor, day) in [("a", &yesterday), ("a", &yesterday), ("a", &today)] {
        ok(client
            .post(stack.url("/budgets/monitoring/check"))
            .json(&json!({"visitor": visitor, "day": day}))
            .send()
            .await
            .unwrap());
    }
    ok(client.post(stack.url("/counter")).send().await.unwrap());

    let deadline = Instant::now() + Duration::from_secs(20);
    let mut refused = 0;
    while refused == 0 {
        assert!(Instant::now() < deadline, "no write was ever refused");
        let burst: Vec<_> = (0..24)
            .map(|_| {
                let (c, u) = (client.clone(), stack.url("/counters/burst"));
                tokio::spawn(async move { c.post(u).send().await.map(|r| r.status()) })
            })
            .collect();
        for t in burst {
            if t.await.unwrap().is_ok_and(|s| s == 429) {
                refused += 1;
            }
        }
    }

    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(10))
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = scrape(&stack.tally_metrics).await;
        // Exported at 0 from the start: a caller gone shows as a count.
        if counted(&text, "tally_write_committed_caller_gone_total") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no caller ever gave up in time:\n{text}"
        );
        let _ = impatient.post(stack.url("/counters/late")).send().await;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

/// A metric reference in a PromQL expression.
#[derive(Debug)]
struct Selector {
    name: String,
    /// Label names in its `{...}` matchers.
    labels: Vec<String>,
    /// The function it is the direct argument of (`rate`, ...).
    function: Option<String>,
}

#[derive(Debug, PartialEq)]
enum Token {
    Ident(String),
    Punct(char),
    Other,
}

/// PromQL (with Grafana's `$variables`) cut into names and punctuation;
/// strings, numbers, ranges and variables become `Other`.
fn tokens(expr: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\'' | '`' => {
                while let Some(d) = chars.next() {
                    if d == '\\' && c != '`' {
                        chars.next();
                    } else if d == c {
                        break;
                    }
                }
                out.push(Token::Other);
            }
            // Ranges and subqueries: durations, Grafana's $__rate_interval.
            '[' => {
                for d in chars.by_ref() {
                    if d == ']' {
                        break;
                    }
                }
                out.push(Token::Other);
            }
            '$' => {
                while chars
                    .next_if(|d| d.is_alphanumeric() || *d == '_')
                    .is_some()
                {}
                out.push(Token::Other);
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let mut ident = c.to_string();
                while let Some(d) =
                    chars.next_if(|d| d.is_ascii_alphanumeric() || *d == '_' || *d == ':')
                {
                    ident.push(d);
                }
                out.push(Token::Ident(ident));
            }
            c if c.is_ascii_digit() || c == '.' => {
                while chars
                    .next_if(|d| d.is_ascii_alphanumeric() || *d == '.')
                    .is_some()
                {}
                out.push(Token::Other);
            }
            c if c.is_whitespace() => {}
            c => out.push(Token::Punct(c)),
        }
    }
    out
}

/// Keywords followed by a list of label names.
const GROUPING: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
/// Operators and aggregations that read like names but select nothing
/// (`sum by (...) (...)`, `a and b`).
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
];

/// The metrics an expression selects, and the labels it groups or matches
/// on. Any other bare name is reported as an unknown metric.
fn parse_promql(expr: &str) -> (Vec<Selector>, Vec<String>) {
    let toks = tokens(expr);
    let (mut selectors, mut grouping) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < toks.len() {
        let Token::Ident(ident) = &toks[i] else {
            i += 1;
            continue;
        };
        let next = toks.get(i + 1);
        if GROUPING.contains(&ident.as_str()) {
            if next == Some(&Token::Punct('(')) {
                i += 2;
                while let Some(t) = toks.get(i) {
                    match t {
                        Token::Ident(l) => grouping.push(l.clone()),
                        Token::Punct(',') => {}
                        _ => break,
                    }
                    i += 1;
                }
            }
            i += 1;
            continue;
        }
        if next == Some(&Token::Punct('(')) || KEYWORDS.contains(&ident.as_str()) {
            i += 1;
            continue;
        }
        let function = match (
            i.checked_sub(2).map(|j| &toks[j]),
            i.checked_sub(1).map(|j| &toks[j]),
        ) {
            (Some(Token::Ident(f)), Some(Token::Punct('('))) => Some(f.clone()),
            _ => None,
        };
        let mut labels = Vec::new();
        i += 1;
        if toks.get(i) == Some(&Token::Punct('{')) {
            i += 1;
            while i < toks.len() && toks[i] != Token::Punct('}') {
                if let Token::Ident(l) = &toks[i] {
                    labels.push(l.clone());
                }
                i += 1;
            }
        }
        selectors.push(Selector {
            name: ident.clone(),
            labels,
            function,
        });
    }
    (selectors, grouping)
}

/// What is wrong with the metrics an expression names, if anything.
fn check_expr(what: &str, expr: &str, exported: &Exported) -> Vec<String> {
    let (selectors, grouping) = parse_promql(expr);
    let mut problems = Vec::new();
    let mut known_labels: BTreeSet<String> = TARGET_LABELS.iter().map(|l| l.to_string()).collect();
    if selectors.is_empty() {
        problems.push(format!("{what}: names no metric: {expr}"));
    }
    for s in &selectors {
        let name = s.name.as_str();
        if name == "up" {
            continue;
        }
        if !(name.starts_with("tally_") || name.starts_with("litestream_")) {
            problems.push(format!(
                "{what}: {name} is neither tally's nor Litestream's"
            ));
            continue;
        }
        let lazy = LAZY.iter().find(|l| l.name == name);
        let (kind, labels) = match (exported.samples.get(name), lazy) {
            (Some(labels), _) => (exported.type_of(name).unwrap_or("untyped"), labels.clone()),
            (None, Some(lazy)) => (
                lazy.kind,
                lazy.labels.iter().map(|l| l.to_string()).collect(),
            ),
            (None, None) => {
                problems.push(format!("{what}: {name} is not exported"));
                continue;
            }
        };
        for l in &s.labels {
            if !labels.contains(l) && !TARGET_LABELS.contains(&l.as_str()) {
                problems.push(format!("{what}: {name} has no label {l}"));
            }
        }
        known_labels.extend(labels);
        let is_histogram_part = ["_bucket", "_sum", "_count"]
            .iter()
            .any(|x| name.ends_with(x))
            && kind == "histogram";
        // Counters are read through rate() and the like, gauges through
        // deriv() and the like; not the other way round.
        let wants = match s.function.as_deref() {
            Some("rate" | "irate" | "increase" | "resets") if !is_histogram_part => Some("counter"),
            Some("deriv" | "delta" | "idelta" | "predict_linear") => Some("gauge"),
            _ => None,
        };
        if let Some(wanted) = wants.filter(|w| *w != kind) {
            let f = s.function.as_deref().unwrap_or_default();
            problems.push(format!("{what}: {f} of {name}, a {kind}, not a {wanted}"));
        }
        if name.ends_with("_bucket") && !is_histogram_part {
            problems.push(format!("{what}: {name} is not a histogram's buckets"));
        }
    }
    for l in grouping {
        if !known_labels.contains(&l) && l != "le" {
            problems.push(format!(
                "{what}: groups by {l}, a label none of its metrics has"
            ));
        }
    }
    problems
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alerts_name_only_metrics_tally_and_litestream_export() {
    tokio::time::timeout(Duration::from_secs(150), async {
        let stack = Stack::start().await;
        drive(&stack).await;
        let tally = scrape(&stack.tally_metrics).await;
        // The startup gate's gauges and Litestream's upload counter exist
        // once the first replica sync is through, which /ready implies.
        let litestream = stack
            .litestream_until("an upload counted", Duration::from_secs(20), |t| {
                has_sample(t, "litestream_replica_operation_total")
            })
            .await;
        let mut exported = Exported::default();
        exported.add(&tally);
        exported.add(&litestream);

        let mut problems = check_lazy();
        let d = dashboard();
        for (what, expr) in dashboard_exprs(&d) {
            problems.extend(check_expr(&what, &expr, &exported));
        }
        for v in d["templating"]["list"].as_array().unwrap() {
            let Some(query) = v["query"]["query"].as_str() else {
                continue;
            };
            // label_values(<selector>, <label>)
            let inner = query
                .strip_prefix("label_values(")
                .and_then(|q| q.strip_suffix(')'))
                .unwrap_or_else(|| panic!("variable {}: {query}", v["name"]));
            let (selector, label) = inner.rsplit_once(',').unwrap();
            let what = format!("variable {}", v["name"]);
            problems.extend(check_expr(&what, selector, &exported));
            let label = label.trim();
            let (selectors, _) = parse_promql(selector);
            let has_label = TARGET_LABELS.contains(&label)
                || selectors.iter().any(|s| {
                    exported
                        .samples
                        .get(&s.name)
                        .is_some_and(|l| l.contains(label))
                });
            if !has_label {
                problems.push(format!("{what}: no label {label}"));
            }
        }
        let rules = rules();
        for rule in rules["groups"]
            .as_sequence()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_sequence().unwrap())
        {
            let name = rule
                .get("alert")
                .or_else(|| rule.get("record"))
                .and_then(|n| n.as_str())
                .unwrap();
            problems.extend(check_expr(
                &format!("rule {name}"),
                rule["expr"].as_str().unwrap(),
                &exported,
            ));
        }
        assert!(
            problems.is_empty(),
            "{}\n\ntally's /metrics:\n{tally}\nLitestream's /metrics:\n{litestream}",
            problems.join("\n")
        );
    })
    .await
    .expect("the test ran for more than 150 s");
}

/// The sum of a metric's samples whose labels contain `with`.
fn value(text: &str, name: &str, with: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| l.contains(with))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// What LitestreamReplicaStalled and LitestreamNoSyncs rest on, with the
/// real Litestream: while the object store hangs (no error, no answer), no
/// PUT is counted, and either the transaction id still moves (the replica
/// falls behind: ReplicaStalled) or the syncs stop too (when Litestream was
/// caught mid-upload: NoSyncs). Which one depends on the moment the store
/// stops answering. Once it answers again, uploads resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_object_store_is_seen_by_the_replica_alerts() {
    tokio::time::timeout(Duration::from_secs(150), async {
        let stack = Stack::start().await;
        let client = reqwest::Client::new();
        let write = || async {
            let r = client
                .post(stack.url("/counters/stall"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        };
        let puts = |t: &str| value(t, "litestream_replica_operation_total", "operation=\"PUT\"");
        let txid = |t: &str| value(t, "litestream_txid", "");
        let syncs = |t: &str| value(t, "litestream_sync_count", "");
        let before = scrape(&stack.litestream_metrics).await;
        write().await;
        stack
            .litestream_until("the write uploaded", Duration::from_secs(15), |t| {
                txid(t) > txid(&before) && puts(t) > puts(&before)
            })
            .await;

        stack.s3.pause();
        // An answer the store wrote just before it stopped is still
        // counted after (seen once in about forty runs on a loaded
        // machine): the count before the hang is the one that has held
        // still for longer than a sync interval (1 s).
        let mut paused = scrape(&stack.litestream_metrics).await;
        loop {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let now = scrape(&stack.litestream_metrics).await;
            if puts(&now) == puts(&paused) {
                break;
            }
            paused = now;
        }
        write().await;
        // Several sync intervals (1 s) later.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let later = scrape(&stack.litestream_metrics).await;
        assert_eq!(puts(&later), puts(&paused), "uploads went on: {later}");
        let txid_moved = txid(&later) > txid(&paused);
        // One sync may have been under way when the store stopped.
        let syncs_stopped = syncs(&later) <= syncs(&paused) + 1.0;
        assert!(
            txid_moved || syncs_stopped,
            "neither alert would see this hang:\n{paused}\n{later}"
        );

        stack.s3.resume();
        // One run in about forty, on a loaded machine, saw no upload
        // within 60 s of the resume: the failure shows Litestream's log.
        stack
            .litestream_until(
                &format!("an upload after the store's resume (paused:\n{paused})"),
                Duration::from_secs(60),
                |t| puts(t) > puts(&paused),
            )
            .await;
    })
    .await
    .expect("the test ran for more than 150 s");
}

#[test]
fn the_promql_reader_finds_metrics_labels_and_functions() {
    let (s, g) = parse_promql(
        r#"histogram_quantile(0.99, sum by (le, route) (rate(tally_http_request_duration_seconds_bucket{namespace=~"$namespace", route!~"/a|{b}"}[$__rate_interval])))
        / on (namespace) group_left max(up{job="x"}) and tally_build_info unless foo"#,
    );
    let names: Vec<_> = s.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "tally_http_request_duration_seconds_bucket",
            "up",
            "tally_build_info",
            "foo"
        ]
    );
    assert_eq!(s[0].labels, ["namespace", "route"]);
    assert_eq!(s[0].function.as_deref(), Some("rate"));
    assert_eq!(s[1].function.as_deref(), Some("max"));
    assert_eq!(g, ["le", "route", "namespace"]);
    let mut e = Exported::default();
    e.add(
        "# TYPE x_total counter\nx_total{a=\"1,}\\\"\",b=\"\"} 3\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\n",
    );
    assert_eq!(e.samples["x_total"], ["a", "b"].map(String::from).into());
    assert_eq!(e.type_of("h_bucket"), Some("histogram"));
    assert!(
        check_expr("t", "rate(x_total[5m])", &e)
            .iter()
            .any(|p| p.contains("neither"))
    );
}
