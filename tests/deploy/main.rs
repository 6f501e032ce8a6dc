//! Tests of what users install: the container image built from the
//! repository's `Dockerfile` with podman, and the Helm chart in
//! `helm/tally`, rendered and checked with either storage, and its SQLite
//! pod run for real with `podman kube play`, and the image on PostgreSQL. S3
//! is moto on loopback, PostgreSQL the test command's server; every
//! container uses the host's network and talks to loopback only.

mod chart;
mod image;
#[path = "../common/loopback.rs"]
mod loopback;
mod monitoring;
mod pod;
#[allow(dead_code)] // the servers a test stops itself are the API suite's
#[path = "../common/postgres.rs"]
mod postgres;
mod postgres_chart;
#[path = "../common/replica.rs"]
mod replica;
