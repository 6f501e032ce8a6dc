# syntax=docker/dockerfile:1
# (BuildKit's Dockerfile syntax: the RUN --mount cache mounts below need it.)

# tally and Litestream in one image. Litestream is PID 1: it replicates the
# database to S3, runs tally as its child, forwards SIGTERM to it and makes
# a final sync once tally has drained. `tally` alone (embedded, no replica)
# runs when the command is overridden. Build: `docker build -t tally .`
# (BuildKit, for the cache mounts) or `podman build -t tally .`.

# Builder and runtime are both Debian bookworm, so tally links against the
# glibc it runs on.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src/ src/
COPY migrations/ migrations/
# The crate registry and the target directory live in build caches, not in
# layers: a changed source file recompiles tally alone, a new dependency
# compiles only itself. This step runs only when an input above changed;
# the touch makes cargo rebuild tally then even if a file came in with an
# older mtime than the cached build (or only migrations/ changed, which
# cargo does not track). The binary is copied out of the cache, which is
# not part of the stage.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    touch src/main.rs src/lib.rs \
 && cargo build --release --locked --bin tally \
 && install -D -m 0755 target/release/tally /out/tally

# Debian's public CA bundle, from Debian's package, for the runtime. Not
# the builder's: a build machine may trust private CAs (a company proxy's)
# that the image must not inherit.
FROM debian:bookworm-slim AS certs
# Not pinned to a version: Debian removes a package's old version from the
# archive when a point release replaces it, and a pinned build then fails.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*

FROM debian:bookworm-slim
LABEL org.opencontainers.image.title="tally" \
      org.opencontainers.image.description="Atomic counters and daily budgets over HTTP on one SQLite file, replicated to S3 by Litestream" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="debian:bookworm-slim"
# /data is the only writable place under a read-only root filesystem: the
# database, its WAL, Litestream's socket and, through TMPDIR, any temporary
# file SQLite or Litestream makes (/tmp is read-only too).
ENV TALLY_DATABASE=/data/tally.db \
    TALLY_LISTEN=0.0.0.0:3000 \
    TALLY_METRICS_LISTEN=0.0.0.0:9100 \
    TMPDIR=/data
RUN install -d -o 65532 -g 65532 -m 0750 /data
# Litestream verifies S3's TLS certificate against this bundle; copied
# rather than installed, so the runtime stage keeps no apt state.
COPY --from=certs /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=litestream/litestream:0.5.17 /usr/local/bin/litestream /usr/local/bin/litestream
COPY litestream.yml /etc/litestream.yml
COPY --from=build /out/tally /usr/local/bin/tally
USER 65532:65532
WORKDIR /data
EXPOSE 3000 9100
# Exec form: Litestream, not a shell, is PID 1 and receives SIGTERM. env
# execs it with the control socket in /data (its default path is not
# writable); tally finds the socket through the same variable and waits for
# the replica before it serves.
CMD ["env", "TALLY_LITESTREAM_SOCKET=/data/litestream.sock", "litestream", "replicate", "-config", "/etc/litestream.yml", "-exec", "tally"]
