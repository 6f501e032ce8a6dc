//! The Helm chart with `storage: postgres`, rendered with the pinned `helm
//! template` and read back as data: a Deployment of stateless pods running
//! tally directly (no Litestream, no restore, no data volume), the database
//! URL only through a Secret, the PodDisruptionBudget, the optional
//! autoscaler, the grace arithmetic without a final sync, the monitoring
//! objects without Litestream, and the values the mode refuses. That
//! `storage: sqlite` renders what it always did is `chart.rs`'s business;
//! here only that it gets none of this mode's objects.

use serde_json::Value;

use crate::chart::{
    base64, chart_dir, env, env_entry, helm_template, of_kind, one, refused, render, strings,
    u64_at, values_yaml,
};

const POSTGRES: (&str, &str) = ("storage", "postgres");

/// A URL every test can look for: no other value renders this text.
const URL: &str = "postgres://tally:pw-distinctive-3141@db.example:5432/tally";

/// Renders `storage: postgres` with `sets`, release `tally` in namespace
/// `tally`, and no database URL unless `sets` gives one.
fn postgres(sets: &[(&str, &str)]) -> Vec<Value> {
    let mut all = vec![POSTGRES];
    all.extend_from_slice(sets);
    render("tally", "tally", &all)
}

/// Renders `storage: postgres` with [`URL`] in `postgres.url` and `sets`.
fn with_url(sets: &[(&str, &str)]) -> Vec<Value> {
    let mut all = vec![("postgres.url", URL)];
    all.extend_from_slice(sets);
    postgres(&all)
}

fn deployment(docs: &[Value]) -> &Value {
    one(docs, "Deployment")
}

fn pod_spec(docs: &[Value]) -> &Value {
    &deployment(docs)["spec"]["template"]["spec"]
}

fn tally(docs: &[Value]) -> &Value {
    match pod_spec(docs)["containers"].as_array().map(Vec::as_slice) {
        Some([c]) => {
            assert_eq!(c["name"], "tally");
            c
        }
        other => panic!("expected the tally container alone, found {other:?}"),
    }
}

fn env_names(container: &Value) -> Vec<&str> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect()
}

/// Whether every label of `selector` is on `labels` with the same value.
fn selects(selector: &Value, labels: &Value) -> bool {
    let selector = selector.as_object().expect("a label map");
    !selector.is_empty() && selector.iter().all(|(k, v)| labels[k] == *v)
}

fn pod_labels(docs: &[Value]) -> &Value {
    &deployment(docs)["spec"]["template"]["metadata"]["labels"]
}

#[test]
fn a_deployment_of_two_replicas_by_default_and_the_value_is_honoured() {
    let docs = with_url(&[]);
    let spec = &deployment(&docs)["spec"];
    assert_eq!(u64_at(&values_yaml()["deployment"]["replicas"]), 2);
    assert_eq!(spec["replicas"], 2);
    for kind in ["StatefulSet", "DaemonSet", "ReplicaSet"] {
        assert!(of_kind(&docs, kind).is_empty(), "no {kind}");
    }
    // A rollout keeps every ready pod until its replacement is ready.
    assert_eq!(spec["strategy"]["type"], "RollingUpdate");
    assert_eq!(spec["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    assert_eq!(spec["strategy"]["rollingUpdate"]["maxSurge"], 1);
    assert!(selects(&spec["selector"]["matchLabels"], pod_labels(&docs)));

    for n in [1u64, 5] {
        let docs = with_url(&[("deployment.replicas", &n.to_string())]);
        assert_eq!(deployment(&docs)["spec"]["replicas"], n);
    }
    let e = refused(&[
        POSTGRES,
        ("postgres.url", URL),
        ("deployment.replicas", "0"),
    ]);
    assert!(e.contains("deployment.replicas"), "{e}");
}

#[test]
fn tally_runs_alone_without_litestream_restore_or_data_volume() {
    // Every option that adds something Litestream's with SQLite is on.
    let docs = with_url(&[
        ("metrics.litestream.enabled", "true"),
        ("metrics.podMonitor.enabled", "true"),
        ("metrics.serviceMonitor.enabled", "true"),
        ("metrics.prometheusRule.enabled", "true"),
        ("networkPolicy.enabled", "true"),
        (
            "networkPolicy.metricsFrom[0].podSelector.matchLabels.app",
            "prometheus",
        ),
        ("persistence.sizeLimit", "2Gi"),
    ]);
    assert!(of_kind(&docs, "StatefulSet").is_empty());
    let spec = pod_spec(&docs);
    assert!(spec.get("initContainers").is_none(), "no restore: {spec}");
    let c = tally(&docs);
    assert_eq!(strings(&c["command"]), ["tally"]);
    assert!(c.get("args").is_none());
    for name in env_names(c) {
        assert!(
            !name.starts_with("LITESTREAM_")
                && !name.starts_with("TALLY_LITESTREAM_")
                && !name.starts_with("TALLY_REPLICA_"),
            "{name} is Litestream's"
        );
    }
    let ports: Vec<_> = c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(ports, ["http", "metrics"]);

    // Only a small scratch directory for the read-only root filesystem.
    let volumes = spec["volumes"].as_array().unwrap();
    assert_eq!(volumes.len(), 1, "{volumes:?}");
    assert_eq!(volumes[0]["name"], "tmp");
    assert!(volumes[0]["emptyDir"].is_object());
    let mounts = c["volumeMounts"].as_array().unwrap();
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert_eq!(mounts[0]["name"], "tmp");
    assert_eq!(mounts[0]["mountPath"], "/tmp");
    assert_eq!(env(c, "TMPDIR"), "/tmp");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);

    // Nothing rendered names Litestream. Aside: the dashboard, one for both
    // storages, and the alerts, whose descriptions list causes of either
    // storage (their expressions: `alerts_leave_out_litestream...`).
    for d in &docs {
        if d["metadata"]["labels"]["grafana_dashboard"] == "1" || d["kind"] == "PrometheusRule" {
            continue;
        }
        assert!(
            !d.to_string().to_lowercase().contains("litestream"),
            "{} {} mentions Litestream",
            d["kind"],
            d["metadata"]["name"]
        );
    }
}

#[test]
fn the_database_url_reaches_tally_only_from_the_charts_secret() {
    let docs = with_url(&[("adminToken.value", "t")]);
    let secret = one(&docs, "Secret");
    let name = secret["metadata"]["name"].as_str().unwrap();
    assert_eq!(secret["data"]["database-url"], base64(URL));

    let database = env_entry(tally(&docs), "TALLY_DATABASE").expect("TALLY_DATABASE");
    assert!(database.get("value").is_none(), "never a literal value");
    let reference = &database["valueFrom"]["secretKeyRef"];
    assert_eq!(reference["name"], name);
    assert_eq!(reference["key"], "database-url");

    // Nowhere else: no ConfigMap, no literal env, no annotation.
    for d in docs.iter().filter(|d| d["kind"] != "Secret") {
        let text = d.to_string();
        for form in [URL.to_owned(), base64(URL)] {
            assert!(
                !text.contains(&form),
                "{} {} carries the database URL",
                d["kind"],
                d["metadata"]["name"]
            );
        }
    }
    assert!(
        of_kind(&docs, "ConfigMap").is_empty(),
        "no Litestream configuration"
    );
}

#[test]
fn the_database_url_may_come_from_an_existing_secret() {
    let docs = postgres(&[
        ("postgres.existingSecret", "tally-db"),
        ("postgres.existingSecretKey", "uri"),
    ]);
    assert!(
        of_kind(&docs, "Secret").is_empty(),
        "the chart creates none"
    );
    let reference =
        &env_entry(tally(&docs), "TALLY_DATABASE").unwrap()["valueFrom"]["secretKeyRef"];
    assert_eq!(reference["name"], "tally-db");
    assert_eq!(reference["key"], "uri");

    // The key's default.
    let docs = postgres(&[("postgres.existingSecret", "tally-db")]);
    assert_eq!(
        env_entry(tally(&docs), "TALLY_DATABASE").unwrap()["valueFrom"]["secretKeyRef"]["key"],
        values_yaml()["postgres"]["existingSecretKey"]
    );

    // With the admin token the chart's Secret holds the token alone.
    let docs = postgres(&[
        ("postgres.existingSecret", "tally-db"),
        ("adminToken.value", "t"),
    ]);
    let keys: Vec<_> = one(&docs, "Secret")["data"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert_eq!(keys, ["admin-token"]);
}

/// A restore to an instant is Litestream's, of the SQLite database: on
/// PostgreSQL the value would roll the pods and restore nothing, an undo
/// that silently did not happen.
#[test]
fn a_restore_to_an_instant_is_refused_on_postgres() {
    let e = refused(&[
        POSTGRES,
        ("postgres.url", URL),
        ("restore.timestamp", "2026-05-01T10:04:00Z"),
    ]);
    assert!(
        e.contains("restore.timestamp") && e.contains("storage is postgres"),
        "{e}"
    );
}

#[test]
fn without_a_database_url_the_chart_says_what_to_set() {
    for sets in [
        vec![POSTGRES],
        vec![POSTGRES, ("postgres.url", "")],
        vec![POSTGRES, ("postgres.existingSecretKey", "uri")],
    ] {
        let e = refused(&sets);
        assert!(
            e.contains("storage=postgres needs the database URL")
                && e.contains("postgres.existingSecret")
                && e.contains("postgres.url"),
            "{sets:?}: {e}"
        );
    }
    let e = refused(&[
        POSTGRES,
        ("postgres.url", URL),
        ("postgres.existingSecret", "tally-db"),
    ]);
    assert!(e.contains("not both"), "{e}");
    // tally would take anything else for a SQLite file path.
    for bad in [
        "mysql://db/tally",
        "/data/tally.db",
        "postgres:/db",
        "postgres://db tally",
    ] {
        let e = refused(&[POSTGRES, ("postgres.url", bad)]);
        assert!(e.contains("postgres.url"), "{bad}: {e}");
    }
    for good in [
        "postgresql://u@db/tally",
        "postgres://u:p@db:5432/t?sslmode=require",
    ] {
        let docs = postgres(&[("postgres.url", good)]);
        assert_eq!(one(&docs, "Secret")["data"]["database-url"], base64(good));
    }
}

#[test]
fn no_replica_value_is_required_or_used() {
    // No bucket, no credentials: `postgres` does not add any.
    let docs = with_url(&[]);
    one(&docs, "Deployment");
    // Replica values that are set anyway reach nothing.
    let docs = with_url(&[
        ("replica.bucket", "bucket-distinctive-2718"),
        ("replica.credentials.accessKeyId", "AKIDdistinctive1234"),
        (
            "replica.credentials.secretAccessKey",
            "secret-distinctive-5678",
        ),
    ]);
    for d in &docs {
        let text = d.to_string();
        for s in [
            "bucket-distinctive-2718",
            "AKIDdistinctive1234",
            "secret-distinctive-5678",
        ] {
            assert!(!text.contains(s), "{} carries {s}", d["kind"]);
            assert!(!text.contains(&base64(s)), "{} carries {s}", d["kind"]);
        }
    }
}

#[test]
fn storage_is_sqlite_or_postgres() {
    assert_eq!(values_yaml()["storage"], "sqlite");
    for bad in ["mysql", "Postgres", "postgresql", ""] {
        let e = refused(&[("storage", bad), ("postgres.url", URL)]);
        assert!(e.contains("storage"), "{bad}: {e}");
        assert!(e.contains("sqlite") && e.contains("postgres"), "{bad}: {e}");
    }
}

#[test]
fn the_pod_disruption_budget_selects_the_pods_and_never_blocks_a_drain() {
    for replicas in ["1", "2", "7"] {
        let docs = with_url(&[("deployment.replicas", replicas)]);
        let pdb = one(&docs, "PodDisruptionBudget");
        assert_eq!(pdb["apiVersion"], "policy/v1");
        // A maxUnavailable of at least 1, never a minAvailable: a drain may
        // evict even the only pod.
        assert_eq!(pdb["spec"]["maxUnavailable"], 1, "{replicas}");
        assert!(pdb["spec"].get("minAvailable").is_none());
        let selector = &pdb["spec"]["selector"]["matchLabels"];
        assert!(selects(selector, pod_labels(&docs)));
        assert_eq!(
            *selector,
            deployment(&docs)["spec"]["selector"]["matchLabels"]
        );
        // Not the helm test pod.
        assert!(!selects(selector, &one(&docs, "Pod")["metadata"]["labels"]));
    }
    let docs = with_url(&[("deployment.podDisruptionBudget.maxUnavailable", "50%")]);
    assert_eq!(
        one(&docs, "PodDisruptionBudget")["spec"]["maxUnavailable"],
        "50%"
    );
    for bad in ["0", "0%", "-1", "half"] {
        let e = refused(&[
            POSTGRES,
            ("postgres.url", URL),
            ("deployment.podDisruptionBudget.maxUnavailable", bad),
        ]);
        assert!(e.contains("maxUnavailable"), "{bad}: {e}");
    }
    let docs = with_url(&[("deployment.podDisruptionBudget.enabled", "false")]);
    assert!(of_kind(&docs, "PodDisruptionBudget").is_empty());
}

#[test]
fn the_autoscaler_only_when_enabled_and_then_the_deployment_has_no_replicas() {
    let docs = with_url(&[]);
    assert!(
        of_kind(&docs, "HorizontalPodAutoscaler").is_empty(),
        "off by default"
    );
    assert_eq!(values_yaml()["deployment"]["autoscaling"]["enabled"], false);

    let docs = with_url(&[
        ("deployment.autoscaling.enabled", "true"),
        ("deployment.autoscaling.minReplicas", "3"),
        ("deployment.autoscaling.maxReplicas", "9"),
        (
            "deployment.autoscaling.targetCPUUtilizationPercentage",
            "65",
        ),
        ("deployment.replicas", "4"),
    ]);
    let hpa = one(&docs, "HorizontalPodAutoscaler");
    assert_eq!(hpa["apiVersion"], "autoscaling/v2");
    let target = &hpa["spec"]["scaleTargetRef"];
    assert_eq!(target["apiVersion"], "apps/v1");
    assert_eq!(target["kind"], "Deployment");
    assert_eq!(target["name"], deployment(&docs)["metadata"]["name"]);
    assert_eq!(hpa["spec"]["minReplicas"], 3);
    assert_eq!(hpa["spec"]["maxReplicas"], 9);
    let metric = &hpa["spec"]["metrics"][0];
    assert_eq!(metric["type"], "Resource");
    assert_eq!(metric["resource"]["name"], "cpu");
    assert_eq!(metric["resource"]["target"]["type"], "Utilization");
    assert_eq!(metric["resource"]["target"]["averageUtilization"], 65);
    assert!(
        deployment(&docs)["spec"].get("replicas").is_none(),
        "the autoscaler owns the count"
    );
    // The budget follows whatever count the autoscaler picks.
    assert_eq!(
        one(&docs, "PodDisruptionBudget")["spec"]["maxUnavailable"],
        1
    );

    let on = [
        POSTGRES,
        ("postgres.url", URL),
        ("deployment.autoscaling.enabled", "true"),
    ];
    let mut sets = on.to_vec();
    sets.extend([
        ("deployment.autoscaling.minReplicas", "6"),
        ("deployment.autoscaling.maxReplicas", "3"),
    ]);
    let e = refused(&sets);
    assert!(
        e.contains("minReplicas (6) is above maxReplicas (3)"),
        "{e}"
    );
    // A CPU target is a share of the request.
    let mut sets = on.to_vec();
    sets.push(("resources.requests.cpu", "null"));
    let e = refused(&sets);
    assert!(e.contains("resources.requests.cpu"), "{e}");
}

#[test]
fn grace_covers_the_delay_the_drain_and_the_writer_only() {
    let shutdown = &values_yaml()["shutdown"];
    let [delay, drain, writer, margin] = [
        "endpointDelaySeconds",
        "drainTimeoutSeconds",
        "writerDrainSeconds",
        "marginSeconds",
    ]
    .map(|k| u64_at(&shutdown[k]));
    let docs = with_url(&[]);
    assert_eq!(
        u64_at(&pod_spec(&docs)["terminationGracePeriodSeconds"]),
        delay + drain + writer + margin
    );
    assert_eq!(
        u64_at(&pod_spec(&docs)["terminationGracePeriodSeconds"]),
        30
    );
    assert_eq!(env(tally(&docs), "TALLY_SHUTDOWN_DELAY"), delay.to_string());
    assert_eq!(env(tally(&docs), "TALLY_DRAIN_TIMEOUT"), drain.to_string());
    assert_eq!(
        env(tally(&docs), "TALLY_WRITER_DRAIN_TIMEOUT"),
        writer.to_string()
    );

    // Litestream's sync timeout plays no part.
    let docs = with_url(&[
        ("shutdown.endpointDelaySeconds", "2"),
        ("shutdown.drainTimeoutSeconds", "17"),
        ("shutdown.writerDrainSeconds", "3"),
        ("shutdown.syncTimeoutSeconds", "41"),
        ("shutdown.marginSeconds", "7"),
    ]);
    assert_eq!(
        u64_at(&pod_spec(&docs)["terminationGracePeriodSeconds"]),
        29
    );
    assert_eq!(env(tally(&docs), "TALLY_SHUTDOWN_DELAY"), "2");
    assert_eq!(env(tally(&docs), "TALLY_DRAIN_TIMEOUT"), "17");
    assert_eq!(env(tally(&docs), "TALLY_WRITER_DRAIN_TIMEOUT"), "3");
}

#[test]
fn probes_and_settings_are_those_of_sqlite_without_the_replica_wait() {
    let docs = with_url(&[("config.readers", "6"), ("ports.http", "4321")]);
    let c = tally(&docs);
    assert_eq!(env(c, "TALLY_LISTEN"), "0.0.0.0:4321");
    assert_eq!(env(c, "TALLY_METRICS_LISTEN"), "0.0.0.0:9100");
    assert_eq!(env(c, "TALLY_READERS"), "6");
    for name in [
        "TALLY_REPLICA_WAIT_TIMEOUT",
        "TALLY_LITESTREAM_SOCKET",
        "TALLY_SYNCHRONOUS",
    ] {
        assert!(env_entry(c, name).is_none(), "{name} is SQLite's");
    }
    for (probe, path) in [
        ("readinessProbe", "/ready"),
        ("livenessProbe", "/livez"),
        ("startupProbe", "/livez"),
    ] {
        assert_eq!(c[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(c[probe]["httpGet"]["port"], "http", "{probe}");
    }
    // No replica wait: the startup budget is the margin alone, rounded up,
    // and never below one probe.
    for (margin, period, threshold) in [("30", "2", 15u64), ("31", "10", 4), ("0", "5", 1)] {
        let docs = with_url(&[
            ("probes.startup.marginSeconds", margin),
            ("probes.startup.periodSeconds", period),
            ("config.replicaWaitTimeoutSeconds", "600"),
        ]);
        let probe = &tally(&docs)["startupProbe"];
        assert_eq!(
            u64_at(&probe["failureThreshold"]),
            threshold,
            "{margin}/{period}"
        );
    }
}

#[test]
fn service_and_monitoring_pick_the_deployments_pods() {
    let docs = with_url(&[
        ("metrics.podMonitor.enabled", "true"),
        ("metrics.serviceMonitor.enabled", "true"),
        ("networkPolicy.enabled", "true"),
        (
            "networkPolicy.metricsFrom[0].podSelector.matchLabels.app",
            "prometheus",
        ),
    ]);
    let labels = pod_labels(&docs);
    let svc = one(&docs, "Service");
    assert!(selects(&svc["spec"]["selector"], labels));
    let ports: Vec<_> = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["targetPort"].as_str().unwrap())
        .collect();
    assert_eq!(ports, ["http", "metrics"]);

    let pm = one(&docs, "PodMonitor");
    assert!(selects(&pm["spec"]["selector"]["matchLabels"], labels));
    let endpoints: Vec<_> = pm["spec"]["podMetricsEndpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["port"].as_str().unwrap())
        .collect();
    assert_eq!(endpoints, ["metrics"], "no Litestream to scrape");
    let sm = one(&docs, "ServiceMonitor");
    assert!(selects(
        &sm["spec"]["selector"]["matchLabels"],
        &svc["metadata"]["labels"]
    ));

    let np = one(&docs, "NetworkPolicy");
    assert!(selects(&np["spec"]["podSelector"]["matchLabels"], labels));
    let opened: Vec<_> = np["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["ports"].as_array().unwrap().iter())
        .map(|p| p["port"].as_str().unwrap())
        .collect();
    assert_eq!(opened, ["http", "metrics"]);

    let annotations = &deployment(&docs)["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], "9100");

    // The ServiceAccount the pods run as, without a token.
    let sa = one(&docs, "ServiceAccount");
    assert_eq!(
        pod_spec(&docs)["serviceAccountName"],
        sa["metadata"]["name"]
    );
    assert_eq!(pod_spec(&docs)["automountServiceAccountToken"], false);
}

/// The alert names of a PrometheusRule, and whether any expression reads a
/// series only Litestream's presence produces.
fn alerts(rule: &Value) -> (Vec<String>, bool) {
    let mut names = vec![];
    let mut replica_series = false;
    for group in rule["spec"]["groups"].as_array().unwrap() {
        for r in group["rules"].as_array().unwrap() {
            names.push(r["alert"].as_str().unwrap().to_owned());
            let expr = r["expr"].as_str().unwrap();
            replica_series |= expr.contains("litestream_") || expr.contains("tally_replica_");
        }
    }
    (names, replica_series)
}

#[test]
fn alerts_leave_out_litestream_and_the_single_pod_assumptions() {
    let on = ("metrics.prometheusRule.enabled", "true");
    let docs = with_url(&[on]);
    let rule = one(&docs, "PrometheusRule");
    let groups: Vec<_> = rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    assert_eq!(groups, ["tally"]);
    let (names, replica_series) = alerts(rule);
    assert!(!replica_series, "{names:?}");
    // A rollout replaces every pod of a Deployment, and there is no restore.
    for gone in ["TallyMetricsAbsent", "TallyStartedEmpty"] {
        assert!(!names.iter().any(|n| n == gone), "{gone} in {names:?}");
    }
    for kept in [
        "TallyTargetDown",
        "TallyWriteQueueSaturated",
        "TallyHigh5xxRatio",
    ] {
        assert!(names.iter().any(|n| n == kept), "{kept} in {names:?}");
    }

    // SQLite keeps all of them.
    let docs = render("tally", "tally", &[("replica.bucket", "tally-test"), on]);
    let (all, replica_series) = alerts(one(&docs, "PrometheusRule"));
    assert!(replica_series);
    assert!(all.iter().any(|n| n == "TallyMetricsAbsent"));
    let dropped: Vec<_> = all.iter().filter(|n| !names.contains(n)).collect();
    assert!(
        dropped.iter().all(|n| {
            n.starts_with("Litestream")
                || n.starts_with("TallyReplica")
                || ["TallyMetricsAbsent", "TallyStartedEmpty"].contains(&n.as_str())
        }),
        "{dropped:?}"
    );
}

#[test]
fn extra_env_may_not_bring_litestream_back_or_replace_the_database() {
    for name in [
        "TALLY_LITESTREAM_SOCKET",
        "TALLY_REPLICA_WAIT_TIMEOUT",
        "LITESTREAM_BUCKET",
    ] {
        let e = refused(&[
            POSTGRES,
            ("postgres.url", URL),
            ("extraEnv[0].name", name),
            ("extraEnv[0].value", "x"),
        ]);
        assert!(
            e.contains(&format!("extraEnv[0]: {name} belongs to storage=sqlite")),
            "{e}"
        );
    }
    let docs = with_url(&[("adminToken.value", "t")]);
    for name in env_names(tally(&docs)) {
        let e = refused(&[
            POSTGRES,
            ("postgres.url", URL),
            ("adminToken.value", "t"),
            ("extraEnv[0].name", name),
            ("extraEnv[0].value", "x"),
        ]);
        assert!(
            e.contains(&format!("extraEnv[0]: {name} is set by the chart")),
            "{e}"
        );
    }
    let docs = with_url(&[
        ("extraEnv[0].name", "TALLY_EXTRA"),
        ("extraEnv[0].value", "yes"),
    ]);
    assert_eq!(env(tally(&docs), "TALLY_EXTRA"), "yes");
}

#[test]
fn every_postgres_container_runs_restricted() {
    let docs = with_url(&[]);
    let mut pods: Vec<&Value> = vec![pod_spec(&docs)];
    pods.extend(of_kind(&docs, "Pod").into_iter().map(|p| &p["spec"]));
    assert_eq!(pods.len(), 2, "the Deployment's pod and the test pod");
    for spec in pods {
        assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
        assert_eq!(spec["automountServiceAccountToken"], false);
        for c in spec["containers"].as_array().unwrap() {
            let sc = &c["securityContext"];
            assert_eq!(sc["runAsNonRoot"], true, "{}", c["name"]);
            assert_eq!(sc["readOnlyRootFilesystem"], true, "{}", c["name"]);
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{}", c["name"]);
            assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"]);
        }
    }
}

#[test]
fn sqlite_gets_none_of_the_postgres_objects() {
    let bucket = ("replica.bucket", "tally-test");
    let default = render("tally", "tally", &[bucket]);
    // Naming the default changes nothing, and the Deployment's values
    // left at their defaults add nothing.
    assert_eq!(
        render("tally", "tally", &[bucket, ("storage", "sqlite")]),
        default
    );
    let docs = render(
        "tally",
        "tally",
        &[
            bucket,
            ("deployment.replicas", "5"),
            ("deployment.podDisruptionBudget.enabled", "true"),
        ],
    );
    assert_eq!(docs, default);
    one(&docs, "StatefulSet");
    for kind in [
        "Deployment",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    ] {
        assert!(of_kind(&docs, kind).is_empty(), "no {kind} with sqlite");
    }
    // Values that only make sense with postgres say so instead of being
    // ignored.
    for set in [
        ("postgres.url", URL),
        ("postgres.existingSecret", "tally-db"),
        ("deployment.autoscaling.enabled", "true"),
    ] {
        let e = refused(&[bucket, set]);
        assert!(e.contains("set storage=postgres"), "{set:?}: {e}");
    }
}

/// `ci/postgres-values.yaml`, which `scripts/check-chart` lints, validates
/// and runs checkov on, renders this mode without any replica value.
#[test]
fn the_ci_values_for_postgres_render_this_mode_without_a_replica() {
    let file = chart_dir().join("ci/postgres-values.yaml");
    let values: Value = serde_yaml_ng::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(values["storage"], "postgres");
    assert!(values.get("replica").is_none(), "{values}");
    let docs = helm_template(
        "tally",
        "tally",
        &["--values".to_owned(), file.display().to_string()],
    )
    .unwrap();
    assert!(of_kind(&docs, "StatefulSet").is_empty());
    one(&docs, "Deployment");
    one(&docs, "PodDisruptionBudget");
    one(&docs, "HorizontalPodAutoscaler");
}
