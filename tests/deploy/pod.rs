//! The chart's pod, run for real. The StatefulSet's pod template from
//! `helm template` is played with `podman kube play` as a `kind: Pod`, with
//! the image built from the Dockerfile and S3 on loopback, and driven
//! through a pod's life: restore (init container) -> replica gate -> ready
//! -> writes -> graceful stop -> a new pod on an empty volume -> restore ->
//! every acknowledged write present.
//!
//! What is changed from the rendered spec, and why (podman is not a
//! kubelet; `../shared` tooling notes list what it honours):
//! - `hostNetwork: true`, and listen addresses moved from all interfaces to
//!   loopback: the test talks to loopback only.
//! - no `ports` on the containers: podman 4.3 turns them into port
//!   mappings, which it refuses on the host network (they only document
//!   the ports there).
//! - `restartPolicy: Never`: with `Always` podman restarts the init
//!   container forever.
//! - the `emptyDir` gets a name unique to the run: podman turns it into a
//!   named volume, which must not outlive the test or meet another run's.
//! - annotation values are cut to 63 characters: podman 4.3 holds them to
//!   the limit of label values (a kubelet takes the 64-character
//!   `checksum/config` as it is).
//! - the pod is stopped with `podman pod stop -t <the rendered
//!   terminationGracePeriodSeconds>`, since podman ignores that field.
//!
//! Everything else (commands, env, the Secret and ConfigMap references,
//! security context, mounts) is played as rendered: the Secret as a podman
//! secret holding the rendered data, the ConfigMap in the same YAML.

use std::{
    path::PathBuf,
    process::{Command, Output},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use crate::{
    loopback::{S3, free_port},
    replica,
};

/// `podman` with runc and the ulimits this machine needs, which
/// `kube play` takes only from a containers.conf.
struct Podman {
    dir: tempfile::TempDir,
}

impl Podman {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("containers.conf"),
            "[engine]\nruntime = \"runc\"\n\n[containers]\n\
             default_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n",
        )
        .unwrap();
        Podman { dir }
    }

    fn cmd(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", self.dir.path().join("containers.conf"));
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().expect("podman runs")
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "podman {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// A played pod and what it created, removed on drop even when the test
/// fails.
struct PlayedPod<'a> {
    podman: &'a Podman,
    name: String,
    /// The emptyDir's volume, then one per ConfigMap (podman keeps both).
    volumes: Vec<String>,
    secrets: Vec<String>,
    yaml: PathBuf,
    http: u16,
}

impl PlayedPod<'_> {
    fn play(&self) {
        self.podman
            .ok(&["kube", "play", &self.yaml.to_string_lossy()]);
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http)
    }

    /// The main container's output: Litestream's and tally's logs.
    fn logs(&self) -> String {
        let out = self.podman.run(&["logs", &format!("{}-tally", self.name)]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    async fn wait_ready(&self, limit: Duration) {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(r) = client.get(self.url("/ready")).send().await
                && r.status() == 200
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("the pod was not ready within {limit:?}:\n{}", self.logs());
    }

    fn exit_code(&self, container: &str) -> i64 {
        let out = self.podman.ok(&[
            "inspect",
            "--format",
            "{{.State.ExitCode}}",
            &format!("{}-{container}", self.name),
        ]);
        out.trim().parse().unwrap()
    }

    /// Removes the pod and its volume: the next play starts on an empty
    /// `emptyDir`, as a new pod on another node would.
    fn remove(&self) {
        self.podman.ok(&["pod", "rm", "-f", &self.name]);
        for v in &self.volumes {
            let _ = self.podman.run(&["volume", "rm", "-f", v]);
        }
    }
}

impl Drop for PlayedPod<'_> {
    fn drop(&mut self) {
        let _ = self.podman.run(&["pod", "rm", "-f", "-t", "0", &self.name]);
        for v in &self.volumes {
            let _ = self.podman.run(&["volume", "rm", "-f", v]);
        }
        for s in &self.secrets {
            let _ = self.podman.run(&["secret", "rm", s]);
        }
    }
}

/// Turns the rendered chart into a pod podman can play: the StatefulSet's
/// pod template as a `kind: Pod`, with the changes listed in the module
/// doc, and the ConfigMaps beside it.
fn pod_yaml(docs: &[Value], name: &str, volume: &str) -> (String, u64) {
    let sts = docs
        .iter()
        .find(|d| d["kind"] == "StatefulSet")
        .expect("the chart renders a StatefulSet");
    let template = &sts["spec"]["template"];
    let mut spec = template["spec"].clone();
    let grace = spec["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("terminationGracePeriodSeconds is rendered");
    spec["hostNetwork"] = json!(true);
    spec["restartPolicy"] = json!("Never");

    let empty_dirs: Vec<String> = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v.get("emptyDir").is_some())
        .map(|v| v["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(empty_dirs.len(), 1, "one emptyDir: {empty_dirs:?}");
    let data = &empty_dirs[0];
    for v in spec["volumes"].as_array_mut().unwrap() {
        if v["name"] == *data {
            v["name"] = json!(volume);
        }
    }
    for kind in ["initContainers", "containers"] {
        for c in spec[kind].as_array_mut().into_iter().flatten() {
            if let Some(c) = c.as_object_mut() {
                c.remove("ports");
            }
            for m in c["volumeMounts"].as_array_mut().into_iter().flatten() {
                if m["name"] == *data {
                    m["name"] = json!(volume);
                }
            }
            for e in c["env"].as_array_mut().into_iter().flatten() {
                if let Some(v) = e["value"].as_str() {
                    let loopback = if let Some(port) = v.strip_prefix("0.0.0.0:") {
                        Some(format!("127.0.0.1:{port}"))
                    } else {
                        v.strip_prefix(':')
                            .filter(|p| p.parse::<u16>().is_ok())
                            .map(|port| format!("127.0.0.1:{port}"))
                    };
                    if let Some(l) = loopback {
                        e["value"] = json!(l);
                    }
                }
            }
        }
    }

    let mut annotations = template["metadata"]["annotations"].clone();
    for v in annotations
        .as_object_mut()
        .into_iter()
        .flat_map(|a| a.values_mut())
    {
        if let Some(s) = v.as_str().filter(|s| s.len() > 63) {
            *v = json!(s[..63]);
        }
    }
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": template["metadata"]["labels"],
            "annotations": annotations,
        },
        "spec": spec,
    });
    let mut yaml = String::new();
    for d in docs
        .iter()
        .filter(|d| d["kind"] == "ConfigMap")
        .chain([&pod])
    {
        yaml.push_str("---\n");
        yaml.push_str(&serde_yaml_ng::to_string(d).unwrap());
    }
    (yaml, grace)
}

/// Each rendered Secret as a podman secret of the same name, holding the
/// flat JSON map of its base64 `data` that `kube play` reads
/// `secretKeyRef`s from.
fn create_secrets(podman: &Podman, docs: &[Value]) -> Vec<String> {
    let mut names = Vec::new();
    for s in docs.iter().filter(|d| d["kind"] == "Secret") {
        let name = s["metadata"]["name"].as_str().unwrap().to_owned();
        // `data` is base64 already, which is what podman reads.
        let data = &s["data"];
        assert!(data.is_object(), "Secret {name} renders `data`: {s}");
        let file = podman.file(&format!("secret-{name}.json"));
        std::fs::write(&file, serde_json::to_vec(data).unwrap()).unwrap();
        let _ = podman.run(&["secret", "rm", &name]);
        podman.ok(&["secret", "create", &name, &file.to_string_lossy()]);
        names.push(name);
    }
    names
}

async fn write_counters(pod: &PlayedPod<'_>, n: u32) -> Vec<(String, i64)> {
    let client = reqwest::Client::new();
    let mut acked = Vec::new();
    for i in 0..n {
        let name = format!("pod-{}", i % 7);
        let r = client
            .post(pod.url(&format!("/counters/{name}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "write {i}");
        let v: Value = r.json().await.unwrap();
        acked.push((name, v["value"].as_i64().unwrap()));
    }
    acked
}

/// A pod test's chart values: the image under test, `bucket` on the
/// loopback S3 server, and free ports; the HTTP port comes back beside them.
fn pod_values(s3: &S3, bucket: &str) -> (Vec<(&'static str, String)>, u16) {
    let image = crate::image::built();
    let (repository, tag) = image.rsplit_once(':').unwrap();
    let http = free_port();
    let values = vec![
        ("image.repository", repository.to_owned()),
        ("image.tag", tag.to_owned()),
        ("image.pullPolicy", "Never".to_owned()),
        ("replica.bucket", bucket.to_owned()),
        ("replica.endpoint", s3.endpoint.clone()),
        ("replica.region", "us-east-1".to_owned()),
        ("replica.forcePathStyle", "true".to_owned()),
        ("replica.credentials.accessKeyId", "test-key".to_owned()),
        (
            "replica.credentials.secretAccessKey",
            "test-secret".to_owned(),
        ),
        ("ports.http", http.to_string()),
        ("ports.metrics", free_port().to_string()),
        ("ports.litestream", free_port().to_string()),
    ];
    (values, http)
}

/// `values` as `helm --set` pairs.
fn as_sets<'a>(values: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    values.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_rendered_pod_restores_serves_drains_and_restores_again() {
    let s3 = S3::start().await;
    s3.create_bucket("tally-pod").await;
    let (values, http) = pod_values(&s3, "tally-pod");
    let sets = as_sets(&values);
    let docs = crate::chart::render("podtest", "tally-test", &sets);

    let podman = Podman::new();
    let unique = format!("tally-pod-{}-{}", std::process::id(), fastrand::u32(..));
    let (yaml, grace) = pod_yaml(&docs, &unique, &format!("{unique}-data"));
    let yaml_path = podman.file("pod.yaml");
    std::fs::write(&yaml_path, &yaml).unwrap();
    let pod = PlayedPod {
        secrets: create_secrets(&podman, &docs),
        podman: &podman,
        name: unique.clone(),
        volumes: std::iter::once(format!("{unique}-data"))
            .chain(
                docs.iter()
                    .filter(|d| d["kind"] == "ConfigMap")
                    .map(|d| d["metadata"]["name"].as_str().unwrap().to_owned()),
            )
            .collect(),
        yaml: yaml_path,
        http,
    };

    // First pod: an empty replica, so the restore finds nothing and tally
    // starts fresh once Litestream has confirmed its first sync.
    pod.play();
    // podman starts the main container only after the init container
    // exited 0, and then removes the init container.
    pod.wait_ready(Duration::from_secs(120)).await;
    let acked = write_counters(&pod, 40).await;

    let started = Instant::now();
    pod.podman
        .ok(&["pod", "stop", "-t", &grace.to_string(), &pod.name]);
    let took = started.elapsed();
    assert_eq!(
        pod.exit_code("tally"),
        0,
        "Litestream must exit 0 after its final sync:\n{}",
        pod.logs()
    );
    assert!(
        took < Duration::from_secs(grace),
        "a clean stop must finish inside the grace period ({took:?} of {grace} s)"
    );

    // Second pod, on a new empty volume: everything comes back from S3.
    pod.remove();
    pod.play();
    pod.wait_ready(Duration::from_secs(120)).await;
    let client = reqwest::Client::new();
    let mut want = std::collections::BTreeMap::new();
    for (name, value) in &acked {
        let e = want.entry(name.clone()).or_insert(0);
        *e = (*e).max(*value);
    }
    for (name, value) in want {
        let v: Value = client
            .get(pod.url(&format!("/counters/{name}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["value"], value, "{name} after restore:\n{}", pod.logs());
    }
    pod.podman
        .ok(&["pod", "stop", "-t", &grace.to_string(), &pod.name]);
    assert_eq!(pod.exit_code("tally"), 0, "{}", pod.logs());
}

/// Plays the chart rendered with `sets` as pod `name` (its data volume
/// `volume`), as release `pitrtest`: a release of its own, so that its
/// Secret and ConfigMap (podman secrets and volumes named after them) are
/// not another test's.
fn played<'a>(
    podman: &'a Podman,
    sets: &[(&str, &str)],
    name: &str,
    volume: &str,
    http: u16,
) -> (PlayedPod<'a>, u64) {
    let docs = crate::chart::render("pitrtest", "tally-test", sets);
    let (yaml, grace) = pod_yaml(&docs, name, volume);
    let yaml_path = podman.file(&format!("{name}.yaml"));
    std::fs::write(&yaml_path, &yaml).unwrap();
    let pod = PlayedPod {
        secrets: create_secrets(podman, &docs),
        podman,
        name: name.to_owned(),
        volumes: std::iter::once(volume.to_owned())
            .chain(
                docs.iter()
                    .filter(|d| d["kind"] == "ConfigMap")
                    .map(|d| d["metadata"]["name"].as_str().unwrap().to_owned()),
            )
            .collect(),
        yaml: yaml_path,
        http,
    };
    (pod, grace)
}

async fn counter(pod: &PlayedPod<'_>, name: &str) -> Value {
    let v: Value = reqwest::get(pod.url(&format!("/counters/{name}")))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["value"].clone()
}

async fn bump(pod: &PlayedPod<'_>, name: &str, by: u32) {
    let r = reqwest::Client::new()
        .post(pod.url(&format!("/counters/{name}")))
        .json(&json!({ "by": by }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_with_restore_timestamp_comes_back_as_it_was_then_and_only_once() {
    let s3 = S3::start().await;
    s3.create_bucket("tally-pitr").await;
    let (values, http) = pod_values(&s3, "tally-pitr");
    let base = as_sets(&values);
    let podman = Podman::new();
    let unique = format!("tally-pitr-{}-{}", std::process::id(), fastrand::u32(..));
    let volume = format!("{unique}-data");

    // State A, then the mistake.
    let (pod, grace) = played(&podman, &base, &unique, &volume, http);
    pod.play();
    pod.wait_ready(Duration::from_secs(120)).await;
    let metrics: u16 = values
        .iter()
        .find(|(k, _)| *k == "ports.metrics")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap();
    let metrics = format!("http://127.0.0.1:{metrics}/metrics");
    let before = replica::caught_up(&metrics, 0.0).await;
    bump(&pod, "orders", 40).await;
    bump(&pod, "signups", 7).await;
    // The instant once the replica has both.
    replica::holds_all_since(&metrics, before).await;
    let at = jiff::Timestamp::now().to_string();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    bump(&pod, "orders", 5000).await;
    bump(&pod, "garbage", 1).await;
    pod.podman
        .ok(&["pod", "stop", "-t", &grace.to_string(), &pod.name]);
    assert_eq!(pod.exit_code("tally"), 0, "{}", pod.logs());
    pod.remove();
    drop(pod);

    // helm upgrade --set restore.timestamp=AT, and a new pod: state A.
    let mut sets = base.to_vec();
    sets.push(("restore.timestamp", at.as_str()));
    let (pod, grace) = played(&podman, &sets, &unique, &volume, http);
    pod.play();
    pod.wait_ready(Duration::from_secs(120)).await;
    assert_eq!(counter(&pod, "orders").await, 40, "{}", pod.logs());
    assert_eq!(counter(&pod, "signups").await, 7);
    assert_eq!(counter(&pod, "garbage").await, 0);
    let logs = pod.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("the database comes from a restore to a point in time"))
        .unwrap_or_else(|| panic!("tally says where its database comes from:\n{logs}"));
    assert!(line.contains(&at) && line.contains("txid"), "{line}");
    bump(&pod, "after", 3).await;
    pod.podman
        .ok(&["pod", "stop", "-t", &grace.to_string(), &pod.name]);
    assert_eq!(pod.exit_code("tally"), 0, "{}", pod.logs());
    pod.remove();

    // The value left set: the next pod does not go back again.
    pod.play();
    pod.wait_ready(Duration::from_secs(120)).await;
    assert_eq!(counter(&pod, "orders").await, 40, "{}", pod.logs());
    assert_eq!(counter(&pod, "after").await, 3, "{}", pod.logs());
    assert!(
        !pod.logs()
            .contains("the database comes from a restore to a point in time"),
        "{}",
        pod.logs()
    );
    pod.podman
        .ok(&["pod", "stop", "-t", &grace.to_string(), &pod.name]);
}
