//! The Helm chart in `helm/tally`, rendered with the pinned `helm template`
//! and read back as data: the one-replica StatefulSet on an `emptyDir`, the
//! restore and replicate commands, the probes, the grace arithmetic, the
//! replica path, the values schema, and where credentials may appear. The
//! static checks (lint, kubernetes-validate, yamllint, checkov) are
//! `scripts/check-chart`, run here too.
//!
//! [`render`] is shared: the pod test plays the StatefulSet's pod template
//! it returns, and the tests of `storage: postgres` (`postgres_chart.rs`)
//! use it and the helpers below.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use serde::Deserialize;
use serde_json::Value;

use crate::loopback::tool_in;

/// The bucket every render needs (the chart refuses to render without one).
const BUCKET: (&str, &str) = ("replica.bucket", "tally-test");

/// The image every render gets unless a test sets its own: the chart
/// refuses to render without one (there is no public tally image).
const IMAGE: (&str, &str) = ("image.repository", "registry.test/tally");

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

pub(crate) fn chart_dir() -> PathBuf {
    repo().join("helm/tally")
}

/// Renders the chart as `helm template RELEASE helm/tally --namespace
/// NAMESPACE --set KEY=VALUE...` and returns its manifests as JSON, in
/// Helm's order (the `helm test` pod included). `sets` use Helm's `--set`
/// syntax, so numbers and booleans arrive typed and a value must not contain
/// a comma; `replica.bucket` is required. `image.repository` is set to
/// [`IMAGE`] first, so a set of it replaces that. Panics with Helm's message
/// when the chart refuses the values.
pub fn render(release: &str, namespace: &str, sets: &[(&str, &str)]) -> Vec<Value> {
    helm_template(release, namespace, &set_args(sets))
        .unwrap_or_else(|e| panic!("helm template failed for {sets:?}:\n{e}"))
}

pub(crate) fn set_args(sets: &[(&str, &str)]) -> Vec<String> {
    sets.iter()
        .flat_map(|(k, v)| ["--set".to_owned(), format!("{k}={v}")])
        .collect()
}

/// `helm template` with [`IMAGE`] and then any extra arguments: the
/// manifests, or Helm's stderr when it exits non-zero.
pub(crate) fn helm_template(
    release: &str,
    namespace: &str,
    args: &[String],
) -> Result<Vec<Value>, String> {
    let out = Command::new(tool_in("bin", "helm"))
        .arg("template")
        .arg(release)
        .arg(chart_dir())
        .args(["--namespace", namespace])
        .args(set_args(&[IMAGE]))
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
pub(crate) fn refused(sets: &[(&str, &str)]) -> String {
    match helm_template("tally", "tally", &set_args(sets)) {
        Ok(_) => panic!("the chart accepted {sets:?}"),
        Err(e) => e,
    }
}

pub(crate) fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// The one document of `kind`.
pub(crate) fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
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
pub(crate) fn env<'a>(container: &'a Value, name: &str) -> &'a str {
    env_entry(container, name)
        .and_then(|e| e["value"].as_str())
        .unwrap_or_else(|| panic!("{} has no literal {name}", container["name"]))
}

pub(crate) fn env_entry<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
}

pub(crate) fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect()
}

pub(crate) fn u64_at(v: &Value) -> u64 {
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

pub(crate) fn values_yaml() -> Value {
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
    assert_eq!(data_volume(&docs)["emptyDir"]["sizeLimit"], "2Gi");
}

/// With a size limit, tally's soft limit is a third of it in bytes (the
/// next pod holds the database three times over), and the binary takes
/// the value; without one there is no soft limit.
#[test]
fn the_storage_limit_is_a_third_of_the_size_limit() {
    assert!(env_entry(tally(&rendered(&[])), "TALLY_STORAGE_LIMIT").is_none());
    for (size, bytes) in [
        ("2Gi", 2u64 * 1024 * 1024 * 1024 / 3),
        ("64Mi", 64 * 1024 * 1024 / 3),
        ("1.5T", 500_000_000_000),
        ("600M", 200_000_000),
    ] {
        let docs = rendered(&[("persistence.sizeLimit", size)]);
        assert_eq!(data_volume(&docs)["emptyDir"]["sizeLimit"], size);
        let limit = env(tally(&docs), "TALLY_STORAGE_LIMIT");
        assert_eq!(limit, bytes.to_string(), "{size}");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
            .args(["--storage-limit", limit, "--help"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{size}: tally refuses {limit}");
    }
}

/// The keys' lifetime is a value, rendered as tally reads it; a value tally
/// would refuse is refused by the schema.
#[test]
fn the_idempotency_key_lifetime_is_a_value() {
    assert_eq!(
        env(tally(&rendered(&[])), "TALLY_IDEMPOTENCY_KEY_TTL"),
        "24h"
    );
    let docs = rendered(&[("config.idempotencyKeyTTL", "90m")]);
    assert_eq!(env(tally(&docs), "TALLY_IDEMPOTENCY_KEY_TTL"), "90m");
    for bad in ["1w", "24 h", "-1h"] {
        let e = refused(&[BUCKET, ("config.idempotencyKeyTTL", bad)]);
        assert!(e.contains("idempotencyKeyTTL"), "{bad}: {e}");
    }
}

fn data_volume(docs: &[Value]) -> &Value {
    pod_spec(docs)["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "data")
        .expect("a data volume")
}

/// A size limit is a quantity with a unit of bytes, as a string, of at
/// least 64Mi. A bare number would be bytes (and a values file's 20 digits
/// overflow to a negative number), a lower-case `m` is milli (`512m` is
/// 0.512 bytes): both are refused with a message saying so.
#[test]
fn size_limit_is_a_quantity_of_at_least_64mi() {
    for good in [
        "64Mi",
        "2Gi",
        "1.5Gi",
        "1Ti",
        "67108864k",
        "512M",
        "3G",
        "1T",
    ] {
        let docs = rendered(&[("persistence.sizeLimit", good)]);
        assert_eq!(data_volume(&docs)["emptyDir"]["sizeLimit"], good, "{good}");
    }

    let with_file = |yaml: &str| {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            file.path(),
            format!("replica:\n  bucket: tally-test\n{yaml}"),
        )
        .unwrap();
        helm_template(
            "tally",
            "tally",
            &["--values".to_owned(), file.path().display().to_string()],
        )
    };
    // From a values file a quoted quantity is as good as from --set.
    let docs = with_file("persistence:\n  sizeLimit: \"2Gi\"\n").unwrap();
    assert_eq!(data_volume(&docs)["emptyDir"]["sizeLimit"], "2Gi");

    // Bare numbers: an integer from --set, a float from a values file (20
    // digits rendered as -9223372036854775808), digits as a string.
    let mut bare = vec![
        refused(&[BUCKET, ("persistence.sizeLimit", "2147483648")]),
        refused(&[BUCKET, ("persistence.sizeLimit", "512")]),
        with_file("persistence:\n  sizeLimit: 3221225472\n").unwrap_err(),
        with_file("persistence:\n  sizeLimit: 12345678901234567890\n").unwrap_err(),
    ];
    bare.push(
        helm_template(
            "tally",
            "tally",
            &set_args(&[BUCKET])
                .into_iter()
                .chain([
                    "--set-string".to_owned(),
                    "persistence.sizeLimit=2147483648".to_owned(),
                ])
                .collect::<Vec<_>>(),
        )
        .unwrap_err(),
    );
    for e in &bare {
        assert!(
            e.contains("persistence.sizeLimit") && e.contains("bare number") && e.contains("2Gi"),
            "{e}"
        );
    }

    // A lower-case m is milli.
    let e = refused(&[BUCKET, ("persistence.sizeLimit", "512m")]);
    assert!(
        e.contains("persistence.sizeLimit") && e.contains("milli") && e.contains("512Mi"),
        "{e}"
    );

    // Below the floor.
    for small in ["63Mi", "1Ki", "67M", "0.05Gi", "0Gi"] {
        let e = refused(&[BUCKET, ("persistence.sizeLimit", small)]);
        assert!(
            e.contains("persistence.sizeLimit") && e.contains("64Mi"),
            "{small}: {e}"
        );
    }

    for bad in ["2 Gi", "lots", "-1", "2gi", "2Pi", "1e9", "2GB", "Gi"] {
        let e = refused(&[BUCKET, ("persistence.sizeLimit", bad)]);
        assert!(e.contains("persistence.sizeLimit"), "{bad}: {e}");
    }
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
        env(tally(docs), "TALLY_WRITER_DRAIN_TIMEOUT"),
        writer.to_string()
    );
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
    // docs/kubernetes.md's numbers: 10 s drain, 20 s final sync, 45 s grace.
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
    // The writer's drain is a setting of tally's now, which takes no 0:
    // refused by the chart, not a crash loop at every start.
    let e = refused(&[BUCKET, ("shutdown.writerDrainSeconds", "0")]);
    assert!(e.contains("writerDrainSeconds"), "{e}");
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
        // Read as a target by RUST_LOG's syntax, it would log nothing.
        ("config.log", "warning"),
        ("config.log", "warn;tally=debug"),
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
            // A Kubernetes object handed over as is (affinity, security
            // contexts) may take any key, and says so.
            let passthrough = schema["additionalProperties"] == true
                && schema["description"]
                    .as_str()
                    .is_some_and(|d| d.contains("passed through to Kubernetes as is"));
            assert!(
                schema["additionalProperties"] == false
                    || schema["additionalProperties"]["type"].is_string()
                    || passthrough,
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
        format!("{}:{}", IMAGE.1, env!("CARGO_PKG_VERSION"))
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

#[test]
fn the_default_replica_wait_leaves_room_for_a_snapshot_upload() {
    // Every new pod uploads a full copy of the database inside the wait.
    assert_eq!(
        u64_at(&values_yaml()["config"]["replicaWaitTimeoutSeconds"]),
        300
    );
    let docs = rendered(&[]);
    let c = tally(&docs);
    assert_eq!(env(c, "TALLY_REPLICA_WAIT_TIMEOUT"), "300");
    let probe = &c["startupProbe"];
    assert!(u64_at(&probe["failureThreshold"]) * u64_at(&probe["periodSeconds"]) >= 300);
}

/// The controller labels the pod `controller-revision-hash=<StatefulSet
/// name>-<hash of up to 10 characters>`, a label value of at most 63
/// characters; the pod is named `<StatefulSet name>-0`.
fn assert_pod_names_fit(docs: &[Value]) {
    let sts = one(docs, "StatefulSet")["metadata"]["name"]
        .as_str()
        .unwrap();
    assert!(
        sts.len() + 1 + 10 <= 63,
        "StatefulSet name {sts} ({} characters) makes a revision label over 63",
        sts.len()
    );
    assert!(!sts.ends_with('-'), "{sts}");
    // The Service the StatefulSet names exists under that name.
    let svc = one(docs, "Service");
    assert_eq!(
        one(docs, "StatefulSet")["spec"]["serviceName"],
        svc["metadata"]["name"]
    );
}

#[test]
fn long_names_give_a_statefulset_whose_pod_kubernetes_accepts() {
    // Helm's own limit for a release name is 53 characters...
    let longest = "r".repeat(53);
    let docs = render(&longest, "tally", &[BUCKET]);
    assert_pod_names_fit(&docs);
    // ...so a 60-character one never reaches the chart.
    let e = helm_template(&"r".repeat(60), "tally", &set_args(&[BUCKET])).unwrap_err();
    assert!(e.contains("53"), "{e}");
    // A long override is cut too, and the pod's labels stay valid.
    let override60 = format!("tally-{}", "o".repeat(54));
    let docs = rendered(&[("fullnameOverride", &override60)]);
    assert_pod_names_fit(&docs);
    assert!(
        override60.starts_with(
            one(&docs, "StatefulSet")["metadata"]["name"]
                .as_str()
                .unwrap()
        )
    );
    let docs = rendered(&[("nameOverride", &"n".repeat(60))]);
    assert_pod_names_fit(&docs);
}

#[test]
fn pod_management_is_parallel_so_an_upgrade_replaces_a_crash_looping_pod() {
    let docs = rendered(&[]);
    let spec = &one(&docs, "StatefulSet")["spec"];
    assert_eq!(spec["podManagementPolicy"], "Parallel");
    assert_eq!(spec["replicas"], 1);
    assert_eq!(spec["updateStrategy"]["type"], "RollingUpdate");
}

#[test]
fn dashboards_of_releases_in_several_namespaces_do_not_collide() {
    let dashboard = |namespace: &str| {
        let docs = render(
            "tally",
            namespace,
            &[
                BUCKET,
                ("grafanaDashboard.enabled", "true"),
                ("grafanaDashboard.namespace", "monitoring"),
            ],
        );
        let cm = of_kind(&docs, "ConfigMap")
            .into_iter()
            .find(|c| c["metadata"]["labels"]["grafana_dashboard"] == "1")
            .expect("the dashboard ConfigMap")
            .clone();
        assert_eq!(cm["metadata"]["namespace"], "monitoring");
        let keys: Vec<String> = cm["data"].as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys.len(), 1, "{keys:?}");
        let json: Value = serde_json::from_str(cm["data"][&keys[0]].as_str().unwrap()).unwrap();
        (
            cm["metadata"]["name"].as_str().unwrap().to_owned(),
            keys[0].clone(),
            json["uid"].clone(),
        )
    };
    // Release a in namespace b-c and release a-tally-b in namespace c: a
    // "-" between full name and namespace gave both a-tally-b-c-dashboard
    // in the shared namespace. (Two releases of one namespace with one full
    // name, such as a and a-tally, collide on every resource and cannot
    // both be installed.)
    let dashboard_of = |release: &str, namespace: &str| {
        let docs = render(
            release,
            namespace,
            &[
                BUCKET,
                ("grafanaDashboard.enabled", "true"),
                ("grafanaDashboard.namespace", "monitoring"),
            ],
        );
        let cm = of_kind(&docs, "ConfigMap")
            .into_iter()
            .find(|c| c["metadata"]["labels"]["grafana_dashboard"] == "1")
            .expect("the dashboard ConfigMap")
            .clone();
        let name = cm["metadata"]["name"].as_str().unwrap().to_owned();
        let key = cm["data"]
            .as_object()
            .unwrap()
            .keys()
            .next()
            .unwrap()
            .clone();
        (name, key)
    };
    let pairs = [
        ("a", "b-c"),
        ("a-tally-b", "c"),
        ("a-tally-b-c", "x"),
        ("b-c-a", "tally"),
        ("c-a", "tally-b"),
    ];
    let found: Vec<_> = pairs.iter().map(|(r, n)| dashboard_of(r, n)).collect();
    for (i, x) in found.iter().enumerate() {
        assert!(x.0.len() <= 253, "{}", x.0);
        for y in &found[i + 1..] {
            assert_ne!(x.0, y.0, "ConfigMap names of {pairs:?}");
            assert_ne!(x.1, y.1, "file names of {pairs:?}");
        }
    }
    // The longest release name and namespace: nothing cut, still valid.
    let release = "r".repeat(53);
    let namespace = "n".repeat(63);
    let (name, _) = dashboard_of(&release, &namespace);
    assert!(
        name.len() <= 253 && name.ends_with(&format!(".{namespace}-dashboard")),
        "{name}"
    );

    let (a, b) = (dashboard("team-a"), dashboard("team-b"));
    // Neither the ConfigMap nor the sidecar's file replaces the other's.
    assert_ne!(a.0, b.0);
    assert_ne!(a.1, b.1);
    assert!(a.1.ends_with(".json"), "{}", a.1);
    // One dashboard in Grafana, its namespace variable picks the release.
    assert_eq!(a.2, b.2);
}

#[test]
fn a_parent_chart_may_set_enabled() {
    for on in ["true", "false"] {
        one(&rendered(&[("enabled", on)]), "StatefulSet");
    }
    let e = refused(&[BUCKET, ("enabled", "yes")]);
    assert!(e.contains("enabled"), "{e}");
}

#[test]
fn affinity_spread_and_security_contexts_can_be_set() {
    let docs = helm_template(
        "tally",
        "tally",
        &set_args(&[BUCKET])
            .into_iter()
            .chain([
                "--set-json".to_owned(),
                r#"affinity={"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"pool","operator":"In","values":["counters"]}]}]}}}"#.to_owned(),
                "--set-json".to_owned(),
                r#"topologySpreadConstraints=[{"maxSkew":1,"topologyKey":"topology.kubernetes.io/zone","whenUnsatisfiable":"ScheduleAnyway"}]"#.to_owned(),
            ])
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let spec = pod_spec(&docs);
    assert_eq!(
        spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["values"][0],
        "counters"
    );
    let spread = &spec["topologySpreadConstraints"][0];
    assert_eq!(spread["topologyKey"], "topology.kubernetes.io/zone");
    // Without a labelSelector a constraint counts no pods: the chart
    // gives it the pod's selector.
    assert_eq!(
        spread["labelSelector"]["matchLabels"],
        one(&docs, "StatefulSet")["spec"]["selector"]["matchLabels"]
    );
    let e = refused(&[BUCKET, ("affinity.nodeAfinity.x", "1")]);
    assert!(e.contains("Additional property"), "{e}");

    // OpenShift's restricted-v2 assigns the ids: null removes them, the
    // rest of the restricted defaults stays, in every container the chart
    // runs (the helm test pod's too).
    let docs = rendered(&[
        ("podSecurityContext.runAsUser", "null"),
        ("podSecurityContext.runAsGroup", "null"),
        ("podSecurityContext.fsGroup", "null"),
        ("containerSecurityContext.runAsUser", "null"),
        ("containerSecurityContext.runAsGroup", "null"),
    ]);
    let mut pods: Vec<&Value> = vec![pod_spec(&docs)];
    pods.extend(of_kind(&docs, "Pod").into_iter().map(|p| &p["spec"]));
    for spec in pods {
        let pod = &spec["securityContext"];
        for id in ["runAsUser", "runAsGroup", "fsGroup"] {
            assert!(pod.get(id).is_none(), "pod {id}: {pod}");
        }
        assert_eq!(pod["runAsNonRoot"], true);
        assert_eq!(pod["seccompProfile"]["type"], "RuntimeDefault");
        let containers = ["initContainers", "containers"]
            .into_iter()
            .flat_map(|k| spec[k].as_array().cloned().unwrap_or_default());
        for c in containers {
            let sc = &c["securityContext"];
            assert!(sc.get("runAsUser").is_none(), "{sc}");
            assert!(sc.get("runAsGroup").is_none(), "{sc}");
            assert_eq!(sc["runAsNonRoot"], true);
            assert_eq!(sc["readOnlyRootFilesystem"], true);
            assert_eq!(sc["allowPrivilegeEscalation"], false);
            assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"]);
            assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
        }
    }
    // A uid of the namespace's range instead, merged into the defaults.
    let docs = rendered(&[("containerSecurityContext.runAsUser", "1000680000")]);
    let sc = &tally(&docs)["securityContext"];
    assert_eq!(sc["runAsUser"], 1000680000);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    let e = refused(&[BUCKET, ("podSecurityContext.runAsUser", "root")]);
    assert!(e.contains("runAsUser"), "{e}");
}

#[test]
fn the_image_repository_is_required() {
    // No default: a bare "tally" would be someone else's image.
    assert_eq!(values_yaml()["image"]["repository"], "");
    let e = refused(&[BUCKET, ("image.repository", "")]);
    assert!(e.contains("image.repository is required"), "{e}");
    assert!(e.contains("Dockerfile"), "{e}");
}

#[test]
fn litestreams_metrics_listener_can_be_turned_off() {
    let sets = [
        ("metrics.litestream.enabled", "false"),
        ("metrics.podMonitor.enabled", "true"),
        ("networkPolicy.enabled", "true"),
        (
            "networkPolicy.metricsFrom[0].podSelector.matchLabels.app",
            "prometheus",
        ),
    ];
    let docs = rendered(&sets);
    for c in [restore(&docs), tally(&docs)] {
        assert_eq!(env(c, "LITESTREAM_METRICS_ADDR"), "", "empty: no listener");
    }
    let ports = tally(&docs)["ports"].as_array().unwrap();
    assert!(ports.iter().all(|p| p["name"] != "litestream"), "{ports:?}");
    let endpoints = one(&docs, "PodMonitor")["spec"]["podMetricsEndpoints"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(endpoints.len(), 1);
    assert_eq!(endpoints[0]["port"], "metrics");
    let rules = one(&docs, "NetworkPolicy")["spec"]["ingress"]
        .as_array()
        .unwrap()
        .clone();
    let opened: Vec<_> = rules
        .iter()
        .flat_map(|r| r["ports"].as_array().unwrap().iter())
        .map(|p| p["port"].as_str().unwrap())
        .collect();
    assert_eq!(opened, ["http", "metrics"]);
    // On by default: the Litestream alerts need it.
    assert_eq!(values_yaml()["metrics"]["litestream"]["enabled"], true);
}

/// The API's connection cap is the chart's, sized to the memory limit: one
/// client sending slow requests on the binary's own default of 4096
/// connections took 486 MiB of the 512 MiB limit.
#[test]
fn the_connection_cap_fits_the_memory_limit() {
    let docs = rendered(&[("adminToken.value", "t")]);
    assert_eq!(env(tally(&docs), "TALLY_MAX_CONNECTIONS"), "1024");
    let docs = rendered(&[("adminToken.value", "t"), ("config.maxConnections", "300")]);
    assert_eq!(env(tally(&docs), "TALLY_MAX_CONNECTIONS"), "300");
    let e = refused(&[
        BUCKET,
        ("adminToken.value", "t"),
        ("config.maxConnections", "0"),
    ]);
    assert!(e.contains("maxConnections"), "{e}");
}

#[test]
fn extra_env_may_not_replace_what_the_chart_sets() {
    let docs = rendered(&[("adminToken.value", "t")]);
    let names: Vec<String> = tally(&docs)["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_owned())
        .collect();
    for must in [
        "TALLY_DRAIN_TIMEOUT",
        "TALLY_WRITER_DRAIN_TIMEOUT",
        "TALLY_REPLICA_WAIT_TIMEOUT",
        "LITESTREAM_PATH",
        "TALLY_DATABASE",
    ] {
        assert!(names.iter().any(|n| n == must), "{must} in {names:?}");
    }
    for name in &names {
        let e = refused(&[
            BUCKET,
            ("adminToken.value", "t"),
            ("extraEnv[0].name", name),
            ("extraEnv[0].value", "x"),
        ]);
        assert!(
            e.contains(&format!("extraEnv[0]: {name} is set by the chart")),
            "{name}: {e}"
        );
    }
    // The same name in the restore container's environment only.
    let e = refused(&[
        BUCKET,
        ("extraEnv[0].name", "TALLY_SYNCHRONOUS"),
        ("extraEnv[1].name", "LITESTREAM_BUCKET"),
    ]);
    assert!(e.contains("TALLY_SYNCHRONOUS"), "{e}");
}

/// Litestream expands `${LITESTREAM_PATH}` and the others into its YAML
/// before parsing it: a value with whitespace or `#` would be cut short
/// there, silently ("prod/tally #2" would become "prod/tally").
#[test]
fn replica_values_that_litestreams_yaml_would_cut_are_refused() {
    for (key, bad) in [
        ("replica.path", "prod/tally #2"),
        ("replica.path", "prod/tally#2"),
        ("replica.path", "prod tally"),
        ("replica.path", "'quoted'"),
        ("replica.path", "*alias"),
        ("replica.bucket", "My_Bucket"),
        ("replica.bucket", "ab"),
        ("replica.bucket", "bucket #1"),
        ("replica.bucket", "-bucket"),
        ("replica.region", "us east 1"),
        ("replica.region", "us-east-1 #x"),
        ("replica.endpoint", "minio.storage:9000"),
        ("replica.endpoint", "http://minio:9000 #x"),
        ("replica.endpoint", "http://minio:9000/'x'"),
    ] {
        let e = refused(&[BUCKET, (key, bad)]);
        assert!(
            e.contains(key.trim_start_matches("replica.")) && e.contains("pattern"),
            "{key}={bad:?}: {e}"
        );
    }
    // YAML's null would leave Litestream an empty path: the bucket's root.
    // (`--set` would make it Helm's null, which restores the default.)
    let e = helm_template(
        "tally",
        "tally",
        &set_args(&[BUCKET])
            .into_iter()
            .chain(["--set-string".to_owned(), "replica.path=null".to_owned()])
            .collect::<Vec<_>>(),
    )
    .unwrap_err();
    assert!(e.contains("replica.path"), "{e}");

    let docs = rendered(&[
        ("replica.bucket", "my.bucket-1"),
        ("replica.path", "prod/tally-2/a=b_c.d"),
        ("replica.region", "eu-west-1"),
        ("replica.endpoint", "https://s3.example.com:9000/prefix"),
    ]);
    let c = tally(&docs);
    assert_eq!(env(c, "LITESTREAM_BUCKET"), "my.bucket-1");
    assert_eq!(env(c, "LITESTREAM_PATH"), "prod/tally-2/a=b_c.d");
    assert_eq!(env(c, "LITESTREAM_REGION"), "eu-west-1");
    assert_eq!(
        env(c, "LITESTREAM_ENDPOINT"),
        "https://s3.example.com:9000/prefix"
    );
}

/// User information in the endpoint's URL would put the replica's
/// credentials in clear into both containers' environment, the install
/// notes and Litestream's log: refused, pointing at replica.credentials.
#[test]
fn credentials_in_the_replica_endpoint_are_refused() {
    for bad in [
        "https://KEY:SECRET@minio.example:9000",
        "http://KEY@minio.example:9000",
        "https://KEY:SECRET@minio.example:9000/path",
        "https://:SECRET@minio.example",
    ] {
        let e = refused(&[BUCKET, ("replica.endpoint", bad)]);
        assert!(
            e.contains("replica.endpoint") && e.contains("replica.credentials"),
            "{bad}: {e}"
        );
        assert!(!e.contains("SECRET"), "the message repeats the secret: {e}");
    }
    // An @ in the path is not user information.
    let docs = rendered(&[("replica.endpoint", "https://minio.example:9000/a@b")]);
    assert_eq!(
        env(tally(&docs), "LITESTREAM_ENDPOINT"),
        "https://minio.example:9000/a@b"
    );
}

/// Two listeners of the pod on one port (tally exits at start), or a
/// Service with one port twice (the API server refuses it): refused at
/// render time, naming both values.
#[test]
fn colliding_ports_are_refused() {
    for (sets, first, second) in [
        (vec![("ports.http", "9100")], "ports.http", "ports.metrics"),
        (
            vec![("ports.http", "9090")],
            "ports.http",
            "ports.litestream",
        ),
        (
            vec![("ports.metrics", "9090")],
            "ports.metrics",
            "ports.litestream",
        ),
        (
            vec![("ports.http", "4000"), ("ports.metrics", "4000")],
            "ports.http",
            "ports.metrics",
        ),
        (
            vec![("service.port", "9100")],
            "service.port",
            "ports.metrics",
        ),
        (
            vec![("ports.metrics", "80")],
            "service.port",
            "ports.metrics",
        ),
    ] {
        let mut all = vec![BUCKET];
        all.extend(sets.iter().copied());
        let e = refused(&all);
        assert!(
            e.contains(&format!("{first} and {second} are both")),
            "{sets:?}: {e}"
        );
    }
    // Litestream's port counts only where its listener runs.
    let docs = rendered(&[
        ("ports.http", "9090"),
        ("metrics.litestream.enabled", "false"),
    ]);
    let ports = tally(&docs)["ports"].as_array().unwrap();
    assert_eq!(ports.len(), 2, "{ports:?}");
    // The Service's HTTP port may be the container's.
    let docs = rendered(&[("service.port", "3000")]);
    let svc = one(&docs, "Service");
    let ports: Vec<_> = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["port"].as_u64().unwrap())
        .collect();
    assert_eq!(ports, [3000, 9100]);
}

#[test]
fn labels_of_the_chart_cannot_be_overridden() {
    for key in [
        "podLabels.app\\.kubernetes\\.io/name",
        "podLabels.app\\.kubernetes\\.io/instance",
        "commonLabels.app\\.kubernetes\\.io/component",
        "commonLabels.helm\\.sh/chart",
    ] {
        let e = refused(&[BUCKET, (key, "other")]);
        assert!(e.contains("abels"), "{key}: {e}");
    }
    // Other labels are fine; podLabels wins over commonLabels on the pod.
    let docs = rendered(&[
        ("commonLabels.team", "counters"),
        ("commonLabels.tier", "common"),
        ("podLabels.tier", "pod"),
        ("podLabels.example\\.com/app\\.kubernetes\\.io", "x"),
    ]);
    let sts = one(&docs, "StatefulSet");
    let labels = &sts["spec"]["template"]["metadata"]["labels"];
    assert_eq!(labels["tier"], "pod");
    assert_eq!(labels["team"], "counters");
    assert_eq!(labels["example.com/app.kubernetes.io"], "x");
    assert_eq!(sts["metadata"]["labels"]["tier"], "common");
    for (k, v) in sts["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "the pod keeps selector label {k}");
    }
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
pub(crate) fn base64(s: &str) -> String {
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

#[test]
fn a_restore_timestamp_makes_the_init_container_restore_to_that_instant_once() {
    for at in ["2026-05-01T10:04:00Z", "2026-05-01T12:04:00.250+02:00"] {
        let docs = rendered(&[("restore.timestamp", at)]);
        let init = restore(&docs);
        assert_eq!(
            strings(&init["command"]),
            [
                "tally",
                "restore-to",
                "--timestamp",
                at,
                "--litestream-config",
                "/etc/litestream/litestream.yml",
                "--at-every-start"
            ]
        );
        // The same database path as tally's, from the same variables.
        assert_eq!(env(init, "TALLY_DATABASE"), "/data/tally.db");
        assert_eq!(env(tally(&docs), "TALLY_DATABASE"), "/data/tally.db");
        // tally itself runs as always.
        assert_eq!(
            strings(&tally(&docs)["command"])[..2],
            ["litestream", "replicate"]
        );
    }
    // Empty is the latest state, as before.
    let docs = rendered(&[("restore.timestamp", "")]);
    assert_eq!(
        strings(&restore(&docs)["command"])[..2],
        ["litestream", "restore"]
    );
}

#[test]
fn a_restore_timestamp_that_is_not_rfc_3339_is_refused_by_the_schema() {
    for bad in [
        "2026-05-01 10:04",
        "2026-05-01T10:04:00",
        "2026-13-01T10:04:00Z",
        "yesterday",
        "1714557840Z",
    ] {
        let e = refused(&[BUCKET, ("restore.timestamp", bad)]);
        assert!(e.contains("restore.timestamp"), "{bad}: {e}");
        assert!(e.contains("date-time"), "{bad}: {e}");
    }
    // A bare number (epoch seconds) is not a string at all.
    let e = refused(&[BUCKET, ("restore.timestamp", "1714557840")]);
    assert!(e.contains("restore.timestamp"), "{e}");
}

#[test]
fn history_is_litestreams_snapshot_interval_and_retention() {
    let config = litestream_config(&rendered(&[]));
    assert_eq!(config["snapshot"]["interval"], "24h");
    assert_eq!(config["snapshot"]["retention"], "48h");
    let config = litestream_config(&rendered(&[
        ("history.snapshotInterval", "6h"),
        ("history.retention", "30h"),
    ]));
    assert_eq!(config["snapshot"]["interval"], "6h");
    assert_eq!(config["snapshot"]["retention"], "30h");
    // A changed history rolls the pod, as any configuration does.
    let checksum = |sets: &[(&str, &str)]| {
        one(&rendered(sets), "StatefulSet")["spec"]["template"]["metadata"]["annotations"]
            ["checksum/config"]
            .clone()
    };
    assert_ne!(checksum(&[("history.retention", "72h")]), checksum(&[]));
}

#[test]
fn history_that_would_keep_nothing_is_refused() {
    let e = refused(&[BUCKET, ("history.retention", "24h")]);
    assert!(
        e.contains("must be longer than history.snapshotInterval"),
        "{e}"
    );
    let e = refused(&[
        BUCKET,
        ("history.snapshotInterval", "2h"),
        ("history.retention", "90m"),
    ]);
    assert!(
        e.contains("must be longer than history.snapshotInterval"),
        "{e}"
    );
    let e = refused(&[BUCKET, ("history.snapshotInterval", "30s")]);
    assert!(e.contains("at least 1m"), "{e}");
    for bad in ["1d", "24", "0h", "1h30m", "-1h"] {
        let e = refused(&[BUCKET, ("history.retention", bad)]);
        assert!(e.contains("history.retention"), "{bad}: {e}");
    }
}
