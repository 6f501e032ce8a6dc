//! The Helm chart in `helm/tally`, rendered with the pinned `helm template`
//! and read back as data: the one-replica StatefulSet on an `emptyDir`, the
//! restore and replicate commands, the probes, the grace arithmetic, the
//! replica path, the values schema, and where credentials may appear. The
//! static checks (lint, kubernetes-validate, yamllint, checkov) are
//! `scripts/check-chart`, run here too.
//!
//! [`render`] is shared: the pod test plays the StatefulSet's pod template
//! it returns.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use serde::Deserialize;
use serde_json::Value;

use crate::loopback::tool_in;

/// The bucket every render needs (the chart refuses to render without one).
const BUCKET: (&str, &str) = ("replica.bucket", "tally-test");

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn chart_dir() -> PathBuf {
    repo().join("helm/tally")
}

/// Renders the chart as `helm template RELEASE helm/tally --namespace
/// NAMESPACE --set KEY=VALUE...` and returns its manifests as JSON, in
/// Helm's order (the `helm test` pod included). `sets` use Helm's `--set`
/// syntax, so numbers and booleans arrive typed and a value must not contain
/// a comma; `replica.bucket` is required. Panics with Helm's message when the
/// chart refuses the values.
pub fn render(release: &str, namespace: &str, sets: &[(&str, &str)]) -> Vec<Value> {
    helm_template(release, namespace, &set_args(sets))
        .unwrap_or_else(|e| panic!("helm template failed for {sets:?}:\n{e}"))
}

fn set_args(sets: &[(&str, &str)]) -> Vec<String> {
    sets.iter()
        .flat_map(|(k, v)| ["--set".to_owned(), format!("{k}={v}")])
        .collect()
}

/// `helm template` with any extra arguments: the manifests, or Helm's
/// stderr when it exits non-zero.
fn helm_template(release: &str, namespace: &str, args: &[String]) -> Result<Vec<Value>, String> {
    let out = Command::new(tool_in("bin", "helm"))
        .arg("template")
        .arg(release)
        .arg(chart_dir())
        .args(["--namespace", namespace])
        .args(args)
        .output()
        .expect("helm runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(parse_documents(&String::from_utf8(out.stdout).unwrap()))
}

/// Every non-empty document of a multi-document YAML stream.
fn parse_documents(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("helm prints valid YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

/// Renders with the bucket and `sets`, release `tally` in namespace `tally`.
fn rendered(sets: &[(&str, &str)]) -> Vec<Value> {
    let mut all = vec![BUCKET];
    all.extend_from_slice(sets);
    render("tally", "tally", &all)
}

/// Helm's error for values the chart must refuse.
fn refused(sets: &[(&str, &str)]) -> String {
    match helm_template("tally", "tally", &set_args(sets)) {
        Ok(_) => panic!("the chart accepted {sets:?}"),
        Err(e) => e,
    }
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// The one document of `kind`.
fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    match of_kind(docs, kind)[..] {
        [d] => d,
        ref found => panic!("expected one {kind}, found {}", found.len()),
    }
}

fn pod_spec(docs: &[Value]) -> &Value {
    &one(docs, "StatefulSet")["spec"]["template"]["spec"]
}

fn container<'a>(docs: &'a [Value], list: &str, name: &str) -> &'a Value {
    pod_spec(docs)[list]
        .as_array()
        .unwrap_or_else(|| panic!("no {list}"))
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {list} entry named {name}"))
}

fn tally(docs: &[Value]) -> &Value {
    container(docs, "containers", "tally")
}

fn restore(docs: &[Value]) -> &Value {
    container(docs, "initContainers", "restore")
}

/// A literal env value of a container.
fn env<'a>(container: &'a Value, name: &str) -> &'a str {
    env_entry(container, name)
        .and_then(|e| e["value"].as_str())
        .unwrap_or_else(|| panic!("{} has no literal {name}", container["name"]))
}

fn env_entry<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect()
}

fn u64_at(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Litestream's configuration as the chart's ConfigMap carries it.
fn litestream_config(docs: &[Value]) -> Value {
    let cm = of_kind(docs, "ConfigMap")
        .into_iter()
        .find(|c| c["data"]["litestream.yml"].is_string())
        .expect("a ConfigMap with litestream.yml");
    serde_yaml_ng::from_str(cm["data"]["litestream.yml"].as_str().unwrap()).unwrap()
}

/// Seconds from a Litestream duration such as `20s`.
fn seconds(duration: &Value) -> u64 {
    let s = duration.as_str().unwrap_or_else(|| panic!("{duration}"));
    s.strip_suffix('s')
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not whole seconds: {s}"))
}

fn values_yaml() -> Value {
    serde_yaml_ng::from_str(&std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap())
        .unwrap()
}

#[test]
fn one_statefulset_with_exactly_one_replica_and_no_replicas_value() {
    let docs = rendered(&[]);
    let sts = one(&docs, "StatefulSet");
    assert_eq!(sts["spec"]["replicas"], 1);
    for kind in ["Deployment", "DaemonSet", "ReplicaSet"] {
        assert!(of_kind(&docs, kind).is_empty(), "no {kind}");
    }
    // The replica count is not a value under any of the usual names.
    for key in ["replicas", "replicaCount", "statefulset.replicas"] {
        let e = refused(&[BUCKET, (key, "2")]);
        assert!(e.contains("Additional property"), "{key}: {e}");
    }
}

#[test]
fn database_on_an_empty_dir_without_volume_claims() {
    let docs = rendered(&[]);
    for kind in ["PersistentVolumeClaim", "PersistentVolume"] {
        assert!(of_kind(&docs, kind).is_empty(), "no {kind}");
    }
    let sts = one(&docs, "StatefulSet");
    assert!(sts["spec"].get("volumeClaimTemplates").is_none());
    let volumes = pod_spec(&docs)["volumes"].as_array().unwrap();
    let data = volumes.iter().find(|v| v["name"] == "data").unwrap();
    assert_eq!(data["emptyDir"], serde_json::json!({}), "{data}");
    for v in volumes {
        assert!(
            v.get("emptyDir").is_some() || v.get("configMap").is_some(),
            "only an emptyDir and the config: {v}"
        );
    }
    for c in [restore(&docs), tally(&docs)] {
        let mounts = c["volumeMounts"].as_array().unwrap();
        assert!(
            mounts
                .iter()
                .any(|m| m["name"] == "data" && m["mountPath"] == "/data"),
            "{mounts:?}"
        );
        assert_eq!(env(c, "TALLY_DATABASE"), "/data/tally.db");
        assert_eq!(env(c, "TALLY_LITESTREAM_SOCKET"), "/data/litestream.sock");
    }

    let docs = rendered(&[("persistence.sizeLimit", "2Gi")]);
    let volumes = pod_spec(&docs)["volumes"].as_array().unwrap();
    let data = volumes.iter().find(|v| v["name"] == "data").unwrap();
    assert_eq!(data["emptyDir"]["sizeLimit"], "2Gi");
}

#[test]
fn init_container_restores_and_litestream_runs_tally() {
    let docs = rendered(&[]);
    assert_eq!(
        strings(&restore(&docs)["command"]),
        [
            "litestream",
            "restore",
            "-config",
            "/etc/litestream/litestream.yml",
            "-if-db-not-exists",
            "-if-replica-exists",
            "/data/tally.db"
        ]
    );
    assert_eq!(
        strings(&tally(&docs)["command"]),
        [
            "litestream",
            "replicate",
            "-config",
            "/etc/litestream/litestream.yml",
            "-exec",
            "tally"
        ]
    );
    // Both read the chart's configuration, mounted as a directory.
    for c in [restore(&docs), tally(&docs)] {
        let mount = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"] == "/etc/litestream")
            .unwrap_or_else(|| panic!("{} mounts the config", c["name"]));
        assert!(mount.get("subPath").is_none());
        assert_eq!(mount["readOnly"], true);
    }
}

#[test]
fn require_replica_drops_if_replica_exists() {
    let docs = rendered(&[("restore.requireReplica", "true")]);
    assert_eq!(
        strings(&restore(&docs)["command"]),
        [
            "litestream",
            "restore",
            "-config",
            "/etc/litestream/litestream.yml",
            "-if-db-not-exists",
            "/data/tally.db"
        ]
    );
}

#[test]
fn probes_ask_tally_on_its_http_port() {
    for port in [None, Some("4321")] {
        let sets: Vec<(&str, &str)> = port.map(|p| ("ports.http", p)).into_iter().collect();
        let docs = rendered(&sets);
        let c = tally(&docs);
        let http = c["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "http")
            .unwrap();
        let number = u64_at(&http["containerPort"]);
        assert_eq!(number, port.map_or(3000, |p| p.parse().unwrap()));
        assert_eq!(env(c, "TALLY_LISTEN"), format!("0.0.0.0:{number}"));
        for (probe, path) in [
            ("readinessProbe", "/ready"),
            ("livenessProbe", "/livez"),
            ("startupProbe", "/livez"),
        ] {
            let get = &c[probe]["httpGet"];
            assert_eq!(get["path"], path, "{probe}");
            assert_eq!(get["port"], "http", "{probe} names the HTTP port");
        }
    }
}

/// `terminationGracePeriodSeconds` against the values it is made of, and
/// those values where tally and Litestream read them.
fn assert_grace(docs: &[Value], drain: u64, writer: u64, sync: u64, margin: u64) {
    assert_eq!(
        u64_at(&pod_spec(docs)["terminationGracePeriodSeconds"]),
        drain + writer + sync + margin
    );
    assert_eq!(env(tally(docs), "TALLY_DRAIN_TIMEOUT"), drain.to_string());
    assert_eq!(
        seconds(&litestream_config(docs)["shutdown-sync-timeout"]),
        sync
    );
}

#[test]
fn grace_period_is_the_sum_of_its_parts() {
    let values = values_yaml();
    let shutdown = &values["shutdown"];
    let defaults = [
        "drainTimeoutSeconds",
        "writerDrainSeconds",
        "syncTimeoutSeconds",
        "marginSeconds",
    ]
    .map(|k| u64_at(&shutdown[k]));
    let docs = rendered(&[]);
    assert_grace(&docs, defaults[0], defaults[1], defaults[2], defaults[3]);
    // The README's numbers: 10 s drain, 20 s final sync, 45 s grace.
    assert_eq!(
        u64_at(&pod_spec(&docs)["terminationGracePeriodSeconds"]),
        45
    );

    let docs = rendered(&[
        ("shutdown.drainTimeoutSeconds", "17"),
        ("shutdown.writerDrainSeconds", "3"),
        ("shutdown.syncTimeoutSeconds", "41"),
        ("shutdown.marginSeconds", "7"),
    ]);
    assert_grace(&docs, 17, 3, 41, 7);
}

#[test]
fn startup_probe_outlasts_the_replica_wait() {
    for sets in [
        vec![],
        vec![
            ("config.replicaWaitTimeoutSeconds", "301"),
            ("probes.startup.periodSeconds", "7"),
            ("probes.startup.marginSeconds", "0"),
        ],
        vec![
            ("config.replicaWaitTimeoutSeconds", "5"),
            ("probes.startup.periodSeconds", "10"),
            ("probes.startup.marginSeconds", "3"),
        ],
    ] {
        let docs = rendered(&sets);
        let c = tally(&docs);
        let wait: u64 = env(c, "TALLY_REPLICA_WAIT_TIMEOUT").parse().unwrap();
        let probe = &c["startupProbe"];
        let budget = u64_at(&probe["failureThreshold"]) * u64_at(&probe["periodSeconds"]);
        let margin = sets
            .iter()
            .find(|(k, _)| *k == "probes.startup.marginSeconds")
            .map_or_else(
                || u64_at(&values_yaml()["probes"]["startup"]["marginSeconds"]),
                |(_, v)| v.parse().unwrap(),
            );
        assert!(
            budget >= wait + margin,
            "startup budget {budget} s must cover the replica wait {wait} s + {margin} s ({sets:?})"
        );
        assert!(
            budget < wait + margin + u64_at(&probe["periodSeconds"]),
            "rounded up by less than one period ({sets:?})"
        );
    }
}

#[test]
fn replica_path_is_unique_per_release() {
    let path = |release: &str, namespace: &str| {
        let docs = render(release, namespace, &[BUCKET]);
        let p = env(tally(&docs), "LITESTREAM_PATH").to_owned();
        assert_eq!(env(restore(&docs), "LITESTREAM_PATH"), p);
        p
    };
    let paths = [path("a", "one"), path("b", "one"), path("a", "two")];
    assert_ne!(paths[0], paths[1]);
    assert_ne!(paths[0], paths[2]);
    assert_ne!(paths[1], paths[2]);

    let docs = rendered(&[("replica.path", "shared/tally")]);
    assert_eq!(env(tally(&docs), "LITESTREAM_PATH"), "shared/tally");
    assert_eq!(env(tally(&docs), "LITESTREAM_BUCKET"), BUCKET.1);
}

#[test]
fn schema_rejects_unknown_keys_and_wrong_types() {
    for unknown in [
        "bucket",
        "replica.buckt",
        "replica.credentials.existingSecret.nam",
        "metrics.podMonitor.intervall",
        "shutdown.gracePeriodSeconds",
    ] {
        let e = refused(&[BUCKET, (unknown, "x")]);
        assert!(e.contains("Additional property"), "{unknown}: {e}");
    }
    for (key, value) in [
        ("ports.http", "http"),
        ("shutdown.drainTimeoutSeconds", "ten"),
        ("metrics.podAnnotations", "maybe"),
        ("config.synchronous", "off"),
        ("replica.forcePathStyle", "1"),
    ] {
        let e = refused(&[BUCKET, (key, value)]);
        assert!(e.contains("schema"), "{key}={value}: {e}");
    }
    // A number where a string belongs, and a map where a number belongs.
    let e = helm_template(
        "tally",
        "tally",
        &set_args(&[BUCKET])
            .into_iter()
            .chain(["--set-json".into(), "ports={\"http\":{\"port\":1}}".into()])
            .collect::<Vec<_>>(),
    )
    .unwrap_err();
    assert!(e.contains("ports.http"), "{e}");
}

/// Every object in the schema says what else it accepts: nothing (a fixed
/// set of keys) or values of one type (a map such as annotations).
#[test]
fn schema_closes_every_object() {
    fn walk(path: &str, schema: &Value) {
        if schema["type"] == "object" && path != "/properties/global" {
            assert!(
                schema["additionalProperties"] == false
                    || schema["additionalProperties"]["type"].is_string(),
                "{path} leaves additionalProperties open"
            );
        }
        match schema {
            Value::Object(m) => m.iter().for_each(|(k, v)| walk(&format!("{path}/{k}"), v)),
            Value::Array(a) => a
                .iter()
                .enumerate()
                .for_each(|(i, v)| walk(&format!("{path}/{i}"), v)),
            _ => {}
        }
    }
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("values.schema.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(schema["additionalProperties"], false);
    walk("", &schema);
}

#[test]
fn credentials_live_only_in_a_secret() {
    let secrets = [
        "AKIDdistinctive1234",
        "secret/distinctive+5678",
        "admin-token-distinctive-9012",
    ];
    let docs = rendered(&[
        ("replica.credentials.accessKeyId", secrets[0]),
        ("replica.credentials.secretAccessKey", secrets[1]),
        ("adminToken.value", secrets[2]),
    ]);
    let secret = one(&docs, "Secret");
    let name = secret["metadata"]["name"].as_str().unwrap();
    for s in secrets {
        let forms = [s.to_owned(), base64(s)];
        for d in docs.iter().filter(|d| d["kind"] != "Secret") {
            let text = d.to_string();
            for f in &forms {
                assert!(
                    !text.contains(f.as_str()),
                    "{} {} carries a credential",
                    d["kind"],
                    d["metadata"]["name"]
                );
            }
        }
        assert!(
            secret["data"]
                .as_object()
                .unwrap()
                .values()
                .any(|v| v == &Value::String(base64(s))),
            "the Secret holds {s}"
        );
    }
    for c in [restore(&docs), tally(&docs)] {
        for var in ["LITESTREAM_ACCESS_KEY_ID", "LITESTREAM_SECRET_ACCESS_KEY"] {
            let e = env_entry(c, var).unwrap_or_else(|| panic!("{var}"));
            assert!(e.get("value").is_none(), "{var} is never literal");
            assert_eq!(e["valueFrom"]["secretKeyRef"]["name"], name);
        }
    }
    let admin = env_entry(tally(&docs), "TALLY_ADMIN_TOKEN").unwrap();
    assert_eq!(admin["valueFrom"]["secretKeyRef"]["name"], name);
    assert!(env_entry(restore(&docs), "TALLY_ADMIN_TOKEN").is_none());
}

#[test]
fn existing_secrets_are_referenced_and_none_is_created() {
    let docs = rendered(&[
        ("replica.credentials.existingSecret.name", "s3-creds"),
        (
            "replica.credentials.existingSecret.accessKeyIdKey",
            "AWS_KEY",
        ),
        (
            "replica.credentials.existingSecret.secretAccessKeyKey",
            "AWS_SECRET",
        ),
        ("adminToken.existingSecret.name", "tally-admin"),
        ("adminToken.existingSecret.key", "token"),
    ]);
    assert!(of_kind(&docs, "Secret").is_empty());
    let c = tally(&docs);
    for (var, secret, key) in [
        ("LITESTREAM_ACCESS_KEY_ID", "s3-creds", "AWS_KEY"),
        ("LITESTREAM_SECRET_ACCESS_KEY", "s3-creds", "AWS_SECRET"),
        ("TALLY_ADMIN_TOKEN", "tally-admin", "token"),
    ] {
        let r = &env_entry(c, var).unwrap()["valueFrom"]["secretKeyRef"];
        assert_eq!(
            (r["name"].as_str(), r["key"].as_str()),
            (Some(secret), Some(key))
        );
    }

    // Neither: the pod's own identity (IRSA, workload identity).
    let docs = rendered(&[(
        "serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn",
        "arn:aws:iam::123456789012:role/tally",
    )]);
    assert!(of_kind(&docs, "Secret").is_empty());
    assert!(env_entry(tally(&docs), "LITESTREAM_ACCESS_KEY_ID").is_none());
    assert!(env_entry(tally(&docs), "TALLY_ADMIN_TOKEN").is_none());
    let sa = one(&docs, "ServiceAccount");
    assert_eq!(
        sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"],
        "arn:aws:iam::123456789012:role/tally"
    );
    assert_eq!(sa["automountServiceAccountToken"], false);
    assert_eq!(pod_spec(&docs)["automountServiceAccountToken"], false);

    let e = refused(&[
        BUCKET,
        ("replica.credentials.accessKeyId", "a"),
        ("replica.credentials.existingSecret.name", "s3-creds"),
    ]);
    assert!(e.contains("not both"), "{e}");
    let e = refused(&[BUCKET, ("replica.credentials.accessKeyId", "a")]);
    assert!(e.contains("go together"), "{e}");
}

#[test]
fn a_missing_bucket_fails_with_a_clear_message() {
    let e = refused(&[]);
    assert!(e.contains("replica.bucket is required"), "{e}");
    let e = refused(&[("replica.bucket", "")]);
    assert!(e.contains("replica.bucket is required"), "{e}");
}

#[test]
fn app_version_is_the_crate_version() {
    let chart: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(chart_dir().join("Chart.yaml")).unwrap())
            .unwrap();
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
    let docs = rendered(&[]);
    assert_eq!(
        tally(&docs)["image"],
        format!("tally:{}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn service_never_exposes_litestreams_port() {
    for port in [9090u64, 9191] {
        let docs = rendered(&[("ports.litestream", &port.to_string())]);
        let svc = one(&docs, "Service");
        let ports = svc["spec"]["ports"].as_array().unwrap();
        for p in ports {
            assert_ne!(p["targetPort"], "litestream", "{p}");
            assert_ne!(p["targetPort"], port, "{p}");
            assert_ne!(p["port"], port, "{p}");
        }
        let names: Vec<_> = ports.iter().map(|p| p["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["http", "metrics"]);
        // The pod still listens there, for the PodMonitor.
        let c = tally(&docs);
        assert_eq!(env(c, "LITESTREAM_METRICS_ADDR"), format!(":{port}"));
        assert!(
            c["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "litestream" && p["containerPort"] == port)
        );
    }
}

#[test]
fn litestream_config_is_the_repositorys() {
    let repo_config: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(repo().join("litestream.yml")).unwrap())
            .unwrap();
    assert_eq!(litestream_config(&rendered(&[])), repo_config);
}

#[test]
fn a_changed_config_rolls_the_pod() {
    let checksum = |sets: &[(&str, &str)]| {
        let docs = rendered(sets);
        one(&docs, "StatefulSet")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let base = checksum(&[]);
    assert_eq!(base.len(), 64);
    assert_eq!(checksum(&[]), base);
    assert_ne!(checksum(&[("shutdown.syncTimeoutSeconds", "25")]), base);
    assert_ne!(checksum(&[("replica.syncInterval", "5s")]), base);
}

#[test]
fn every_container_runs_restricted() {
    let docs = rendered(&[
        ("replica.credentials.accessKeyId", "a"),
        ("replica.credentials.secretAccessKey", "b"),
    ]);
    let mut pods: Vec<&Value> = vec![pod_spec(&docs)];
    pods.extend(of_kind(&docs, "Pod").into_iter().map(|p| &p["spec"]));
    assert_eq!(pods.len(), 2, "the StatefulSet's pod and the test pod");
    for spec in pods {
        let pod = &spec["securityContext"];
        assert_eq!(pod["runAsNonRoot"], true);
        assert_eq!(pod["runAsUser"], 65532);
        assert_eq!(pod["seccompProfile"]["type"], "RuntimeDefault");
        assert_eq!(spec["automountServiceAccountToken"], false);
        let containers = ["initContainers", "containers"]
            .into_iter()
            .flat_map(|k| spec[k].as_array().cloned().unwrap_or_default());
        for c in containers {
            let sc = &c["securityContext"];
            assert_eq!(sc["runAsNonRoot"], true, "{}", c["name"]);
            assert_eq!(sc["readOnlyRootFilesystem"], true, "{}", c["name"]);
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{}", c["name"]);
            assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"]);
            assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
            assert!(c["resources"]["requests"]["memory"].is_string());
            assert!(c["resources"]["limits"]["memory"].is_string());
        }
    }
}

#[test]
fn metrics_are_scraped_from_both_listeners() {
    let docs = rendered(&[]);
    let annotations = &one(&docs, "StatefulSet")["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], "9100");
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    assert_eq!(env(tally(&docs), "TALLY_METRICS_LISTEN"), "0.0.0.0:9100");
    assert_eq!(env(tally(&docs), "LITESTREAM_METRICS_ADDR"), ":9090");
    for kind in ["PodMonitor", "ServiceMonitor", "NetworkPolicy"] {
        assert!(of_kind(&docs, kind).is_empty(), "{kind} is optional");
    }

    let docs = rendered(&[
        ("metrics.podMonitor.enabled", "true"),
        ("metrics.serviceMonitor.enabled", "true"),
    ]);
    let pm = one(&docs, "PodMonitor");
    let ports: Vec<_> = pm["spec"]["podMetricsEndpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["port"].as_str().unwrap())
        .collect();
    assert_eq!(ports, ["metrics", "litestream"]);
    let sm = one(&docs, "ServiceMonitor");
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(sm["spec"]["endpoints"].as_array().unwrap().len(), 1);
}

#[test]
fn network_policy_opens_metrics_only_to_the_given_peers() {
    let docs = helm_template(
        "tally",
        "tally",
        &set_args(&[BUCKET, ("networkPolicy.enabled", "true")])
            .into_iter()
            .chain([
                "--set-json".to_owned(),
                r#"networkPolicy.metricsFrom=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]"#.to_owned(),
            ])
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let np = one(&docs, "NetworkPolicy");
    let rules = np["spec"]["ingress"].as_array().unwrap();
    assert_eq!(rules.len(), 2);
    assert_eq!(rules[0]["ports"][0]["port"], "http");
    assert_eq!(rules[0]["from"], serde_json::json!([{"podSelector": {}}]));
    let metric_ports: Vec<_> = rules[1]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["port"].as_str().unwrap())
        .collect();
    assert_eq!(metric_ports, ["metrics", "litestream"]);
    assert_eq!(
        rules[1]["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "monitoring"
    );

    // No peers given: the metrics ports take no traffic at all.
    let docs = rendered(&[("networkPolicy.enabled", "true")]);
    assert_eq!(
        one(&docs, "NetworkPolicy")["spec"]["ingress"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn extra_env_reaches_tally() {
    let docs = rendered(&[
        ("extraEnv[0].name", "TALLY_EXTRA"),
        ("extraEnv[0].value", "yes"),
    ]);
    assert_eq!(env(tally(&docs), "TALLY_EXTRA"), "yes");
}

#[test]
fn helm_test_pod_writes_through_the_service() {
    let docs = rendered(&[]);
    let pod = one(&docs, "Pod");
    assert_eq!(pod["metadata"]["annotations"]["helm.sh/hook"], "test");
    let svc = one(&docs, "Service");
    let c = &pod["spec"]["containers"][0];
    assert_eq!(
        env(c, "TALLY_URL"),
        format!(
            "http://{}:{}",
            svc["metadata"]["name"].as_str().unwrap(),
            svc["spec"]["ports"][0]["port"]
        )
    );
    // The Service must never send traffic to the test pod.
    let selector = svc["spec"]["selector"].as_object().unwrap();
    assert!(
        selector
            .iter()
            .any(|(k, v)| pod["metadata"]["labels"][k] != *v),
        "the Service's selector picks the test pod"
    );
}

/// Lint, kubernetes-validate, yamllint and checkov, as `scripts/check-chart`
/// runs them.
#[test]
fn check_chart_script_passes() {
    let out = Command::new("bash")
        .arg(repo().join("scripts/check-chart"))
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "scripts/check-chart failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Standard base64 with padding, as a Secret's `data` holds it.
fn base64(s: &str) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in s.as_bytes().chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
