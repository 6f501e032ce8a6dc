//! Tests of what users install: the container image built from the
//! repository's `Dockerfile` with podman, and the Helm chart in
//! `helm/tally`, rendered and checked with either storage, and its SQLite
//! pod run for real with `podman kube play`. S3 is moto on loopback; every
//! container uses the host's network and talks to loopback only.

mod chart;
mod image;
#[path = "../common/loopback.rs"]
mod loopback;
mod monitoring;
mod pod;
mod postgres_chart;
