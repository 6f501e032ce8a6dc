# syntax=docker/dockerfile:1
# (BuildKit's Dockerfile syntax: the RUN --mount cache mounts below need it.)

# tally and Litestream in one image. Litestream is PID 1: it replicates the
# database to S3, runs tally as its child, forwards SIGTERM to it and makes
# a final sync once tally has drained. `tally` alone (embedded, no replica)
# runs when the command is overridden. Build: `docker build -t tally .`
# (BuildKit, for the cache mounts) or `podman build -t tally .`.

# Builder and runtime libraries are both Debian bookworm's, so tally links
# against the glibc it runs on.
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

# The runtime's whole root filesystem, taken from Debian bookworm (the
# glibc tally was built against): the shared libraries tally and env link
# to, found by ldd, so a new one cannot be forgotten; env itself (the
# default command's, and the only program besides tally and Litestream:
# no shell); Debian's public CA bundle, from Debian's package rather than
# the builder, which may trust private CAs (a company proxy's) the image
# must not inherit; the dpkg records and copyright files of the packages
# these files come from, so that image scanners see their versions; a
# passwd naming uid 65532; /data, the one directory its user may write.
FROM debian:bookworm-slim AS rootfs
# Not pinned to a version: Debian removes a package's old version from the
# archive when a point release replaces it, and a pinned build then fails.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/tally /out/tally
# POSIX sh (an OCI image build ignores SHELL): no pipes, so that a failing
# step fails the build; set -e stops inside the loops too.
RUN set -eu; \
    mkdir -p /rootfs/etc/ssl/certs /rootfs/usr/bin /rootfs/var/lib/dpkg/status.d; \
    install -d -m 1777 /rootfs/tmp; \
    install -d -o 65532 -g 65532 -m 0750 /rootfs/data; \
    cp /etc/ssl/certs/ca-certificates.crt /rootfs/etc/ssl/certs/; \
    cp /usr/bin/env /rootfs/usr/bin/env; \
    cp -L /etc/os-release /rootfs/etc/os-release; \
    ldd /out/tally /usr/bin/env > /tmp/ldd; \
    awk '($2 == "=>") { print $3 } ($1 ~ /^\// && $2 ~ /^\(/) { print $1 }' /tmp/ldd > /tmp/libs; \
    test -s /tmp/libs; \
    echo ca-certificates: > /tmp/owners; \
    dpkg -S /usr/bin/env >> /tmp/owners; \
    while read -r lib; do \
      cp -L --parents "$lib" /rootfs/; \
      dpkg -S "$lib" >> /tmp/owners; \
    done < /tmp/libs; \
    awk -F: '!seen[$1]++ { print $1 }' /tmp/owners > /tmp/packages; \
    while read -r pkg; do \
      dpkg-query -s "$pkg" > "/rootfs/var/lib/dpkg/status.d/$pkg"; \
      install -D -m 0644 "/usr/share/doc/$pkg/copyright" "/rootfs/usr/share/doc/$pkg/copyright"; \
    done < /tmp/packages; \
    printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' \
      'nonroot:x:65532:65532:nonroot:/nonexistent:/sbin/nologin' > /rootfs/etc/passwd; \
    printf '%s\n' 'root:x:0:' 'nonroot:x:65532:' > /rootfs/etc/group; \
    printf '%s\n' 'passwd: files' 'group: files' 'hosts: files dns' > /rootfs/etc/nsswitch.conf

# Nothing but the files above, Litestream, its configuration and tally.
FROM scratch
LABEL org.opencontainers.image.title="tally" \
      org.opencontainers.image.description="Atomic counters and daily budgets over HTTP on one SQLite file, replicated to S3 by Litestream" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
# /data is the only writable place under a read-only root filesystem: the
# database, its WAL, Litestream's socket and, through TMPDIR, any temporary
# file SQLite or Litestream makes (/tmp is read-only too).
ENV PATH=/usr/local/bin:/usr/bin \
    TALLY_DATABASE=/data/tally.db \
    TALLY_LISTEN=0.0.0.0:3000 \
    TALLY_METRICS_LISTEN=0.0.0.0:9100 \
    TMPDIR=/data
COPY --from=rootfs /rootfs/ /
COPY --from=litestream/litestream:0.5.17 /usr/local/bin/litestream /usr/local/bin/litestream
COPY litestream.yml /etc/litestream.yml
COPY --from=build /out/tally /usr/local/bin/tally
USER 65532:65532
WORKDIR /data
EXPOSE 3000 9100
# Exec form: Litestream, not a shell, is PID 1 and receives SIGTERM. env
# execs it with the control socket in /data (its default path is not
# writable); tally finds the socket through the same variable and waits for
# the replica before it serves. Not an ENV: `tally` alone, as the command
# or in the chart's PostgreSQL Deployment, must run without it.
CMD ["env", "TALLY_LITESTREAM_SOCKET=/data/litestream.sock", "litestream", "replicate", "-config", "/etc/litestream.yml", "-exec", "tally"]
