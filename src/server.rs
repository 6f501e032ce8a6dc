//! The HTTP/1.1 serve loop, bounded against slow, idle and greedy clients.
//!
//! `axum::serve` takes every connection the kernel hands it and keeps it
//! for as long as the client likes: silent connections pile up until the
//! open-files limit turns every `accept` into `EMFILE`, headers of ~400 KiB
//! each are buffered for ever, and one half-sent header holds SIGTERM for
//! the whole drain timeout. This loop serves the same router through
//! hyper's HTTP/1 connection builder, with:
//!
//! - a **header timeout**: a connection must deliver a complete request
//!   header within [`Limits::header_timeout`] of opening, and again of each
//!   answer (hyper restarts the timer when a keep-alive connection goes idle,
//!   so this one timer bounds idle keep-alive connections too); past it the
//!   connection is closed without an answer;
//! - a **bounded head**: hyper buffers at most [`HARD_HEAD_BYTES`] of
//!   request head per connection; `http::limits` answers smaller, still
//!   too large heads (and long URIs) with problem+json, from the API's
//!   request frame or from the listener's [`Screen`];
//! - a **cap on open connections** ([`Limits::max_connections`]): past it a
//!   new connection gets a small static `503` problem and is closed at once,
//!   so its descriptor is released and the process never reaches `EMFILE`;
//! - a **shutdown** that stops accepting, closes every connection that has
//!   no request in flight at once, and gives requests in flight the drain
//!   timeout.
//!
//! HTTP/1 only, as before: the router never enabled HTTP/2 (axum's `http2`
//! feature is off), and an h2c connection would need its own limits
//! (streams, frame sizes, header lists) to be as bounded as this one.

use std::{
    future::Future,
    io::{self, Read, Write},
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{Router, body::Body, response::Response};
use bytes::Bytes;
use hyper::{
    body::{Body as _, Frame, Incoming, SizeHint},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpSocket, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

/// What hyper buffers of a request head before it gives up with a bare
/// `431` (no body: it answers before tally sees the request). Well above
/// `http::limits::MAX_HEAD_BYTES`, so that a too large head a client
/// actually finishes sending gets tally's problem instead, and small enough that a
/// connection's buffer stays bounded: this times the connection cap is the
/// most memory partial heads can hold.
pub const HARD_HEAD_BYTES: usize = 64 * 1024;
/// hyper's own limit on header fields (its default), past which it answers
/// a bare `431`.
pub const HARD_HEADER_FIELDS: usize = 100;

/// Connections on the separate metrics listener: scrapers, a handful.
pub const METRICS_MAX_CONNECTIONS: usize = 16;
/// Connections one address may hold on the metrics listener: a client
/// that holds connections open (half-sent heads, reopened as each times
/// out) takes at most these, and the scraper still finds a place.
pub const METRICS_PER_PEER: usize = 4;

/// Connections past the cap answered at a client's pace, each for at most
/// [`REFUSAL_WAIT`] twice; past this many at once, the refusal is written
/// and the connection closed without waiting for anything.
pub const LINGERING_REFUSALS: usize = 32;
/// How long a refusal waits for the client's request before answering, and
/// then for the client to close after the answer.
const REFUSAL_WAIT: Duration = Duration::from_millis(250);

/// Answers a request before the router sees it, or lets it through
/// (`None`): the HTTP layer's rules on what a request head may be.
pub type Screen = fn(&hyper::Request<Incoming>) -> Option<Response>;

/// How one listener is served.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The `listener` label of this listener's metrics (`api`, `metrics`).
    pub name: &'static str,
    /// Asked first about every request head (`crate::http::limits`), when
    /// the router does not ask itself: the API's request frame does, so
    /// that its refusals carry request ids and are counted by route.
    pub screen: Option<Screen>,
    pub header_timeout: Duration,
    /// How long a request's body may take to arrive after its head (else
    /// `408`): the header timeout, or less when requests must be answered
    /// sooner (see [`body_timeout`]).
    pub body_timeout: Duration,
    pub max_connections: usize,
    /// At most this many connections from one IP address (`None`: no cap
    /// but the listener's); past it a connection is refused as past the
    /// cap.
    pub per_peer: Option<usize>,
    /// How long requests in flight may take to finish once stopping.
    pub drain_timeout: Duration,
    /// Once cancelled (a stop asked for, before `stop`), every answer
    /// carries `Connection: close`, so that keep-alive clients reconnect
    /// (through a load balancer, to another process) while this one still
    /// serves.
    pub closing: CancellationToken,
}

/// The body's time limit for requests that must be answered within
/// `request_timeout`: the header timeout, but at most half the request's
/// own limit, so that a body that never arrives is answered `408` (nothing
/// was done) well before the request's limit answers `503` (which, for a
/// write, cannot say whether it committed).
pub fn body_timeout(header_timeout: Duration, request_timeout: Duration) -> Duration {
    header_timeout.min(request_timeout / 2)
}

/// How serving ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Drained {
    /// Every connection closed within the drain timeout.
    Clean,
    /// These connections still had a request in flight at the drain timeout
    /// and were dropped.
    TimedOut { dropped: usize },
}

/// Connections the kernel completes and queues before tally accepts them
/// (capped by `net.core.somaxconn`). The usual 128 overflows in a burst,
/// and the kernel then silently drops handshakes: clients that think they
/// are connected and wait, and real clients that retry after a second.
const LISTEN_BACKLOG: u32 = 4096;

/// Binds a listener at `addr` with a backlog sized for bursts.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    bound(addr)?.listen(LISTEN_BACKLOG)
}

/// Whether [`bind`] at `addr` would succeed now (a port in use, or one the
/// process may not bind, fails), without listening: a client that connects
/// meanwhile is refused as before, never accepted and then dropped.
pub fn try_bind(addr: SocketAddr) -> io::Result<()> {
    bound(addr).map(drop)
}

fn bound(addr: SocketAddr) -> io::Result<TcpSocket> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restarted tally can listen again at
    // once, without waiting for the old connections' TIME_WAIT. Another
    // socket listening at `addr` still makes the bind fail.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

/// Serves `router` on `listener` until `stop` is cancelled, then drains:
/// stops accepting, closes at once every connection without a request in
/// flight, lets the others finish within the drain timeout and drops what
/// is left. The listener's series are exported before this returns, not
/// when the future first runs: a scrape served by another task may come
/// first.
pub fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stop: CancellationToken,
) -> impl Future<Output = Drained> {
    export_listener(&limits);
    serve_exported(listener, router, limits, stop)
}

async fn serve_exported(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stop: CancellationToken,
) -> Drained {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(HARD_HEAD_BYTES)
        .max_header_size(HARD_HEAD_BYTES);
    // Not `.max_headers(HARD_HEADER_FIELDS)`: it is hyper's default, and
    // setting it, even to the default, makes hyper allocate and zero a
    // 100-slot header array on the heap for every request (2% of a no-op
    // answer) instead of using one on the stack.
    const _: () = assert!(HARD_HEADER_FIELDS == 100);
    let http = Arc::new(http);
    let listener_label = limits.name;
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // Sent only where there is such a cap.
    let peer_refusal: Arc<[u8]> = refusal(&format!(
        "your address already has its maximum of {} connections open here",
        limits.per_peer.unwrap_or_default()
    ))
    .into();
    let refusal: Arc<[u8]> = refusal(&format!(
        "tally already has its maximum of {} connections open",
        limits.max_connections
    ))
    .into();
    let peers = limits.per_peer.map(Peers::new);
    let lingering = Arc::new(Semaphore::new(LINGERING_REFUSALS));
    // Cancelled when the drain timeout passes: drops what is left.
    let force = CancellationToken::new();
    let mut last_accept_error = None;

    loop {
        let stream = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(&e, &mut last_accept_error).await;
                    continue;
                }
            },
        };
        let (stream, peer) = stream;
        // A place among its address's (where they are counted), then one
        // under the cap; or the refusal that says which it lacked.
        let placed = match peers.as_ref().map(|peers| peers.take(peer.ip())) {
            Some(None) => Err(&peer_refusal),
            held => Arc::clone(&slots)
                .try_acquire_owned()
                .map(|permit| (permit, held.flatten()))
                .map_err(|_| &refusal),
        };
        match placed {
            Ok((permit, held)) => {
                let slot = Slot::new(permit, listener_label, held);
                tokio::spawn(connection(
                    stream,
                    router.clone(),
                    Arc::clone(&http),
                    (limits.screen, limits.body_timeout, limits.header_timeout),
                    slot,
                    (limits.closing.clone(), stop.clone()),
                    force.clone(),
                ));
            }
            Err(refusal) => {
                metrics::counter!("tally_http_connections_refused_total", "listener" => listener_label)
                    .increment(1);
                match Arc::clone(&lingering).try_acquire_owned() {
                    Ok(permit) => {
                        tokio::spawn(refuse(stream, Arc::clone(refusal), permit));
                    }
                    Err(_) => refuse_at_once(stream, refusal),
                }
            }
        }
    }
    // New connections are refused by the kernel from here on.
    drop(listener);
    drain(&slots, &limits, &force).await
}

/// The listener's series, from the start, so that the first refusal is an
/// increase alerts see.
fn export_listener(limits: &Limits) {
    let listener = limits.name;
    metrics::gauge!("tally_http_connections_max", "listener" => listener)
        .set(limits.max_connections as f64);
    metrics::gauge!("tally_http_connections_open", "listener" => listener).increment(0.0);
    metrics::counter!("tally_http_connections_refused_total", "listener" => listener).increment(0);
    metrics::counter!("tally_http_header_timeouts_total", "listener" => listener).increment(0);
    for kind in CONNECTION_ERROR_KINDS {
        metrics::counter!("tally_http_connection_errors_total", "listener" => listener, "kind" => kind)
            .increment(0);
    }
}

/// Waits for every connection to close, for at most the drain timeout;
/// then has the rest dropped.
async fn drain(slots: &Semaphore, limits: &Limits, force: &CancellationToken) -> Drained {
    // Every connection holds a slot until its task ends: all slots free
    // means all connections closed.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(limits.drain_timeout, slots.acquire_many(all))
        .await
        .is_ok()
    {
        return Drained::Clean;
    }
    let dropped = limits
        .max_connections
        .saturating_sub(slots.available_permits());
    force.cancel();
    // Tasks drop their connection as soon as they see `force`; this wait
    // only lets them run that far.
    let _ = tokio::time::timeout(Duration::from_secs(1), slots.acquire_many(all)).await;
    Drained::TimedOut { dropped }
}

/// One accepted connection, served until it closes or the drain ends it.
async fn connection(
    stream: TcpStream,
    router: Router,
    http: Arc<http1::Builder>,
    (screen, body_timeout, write_timeout): (Option<Screen>, Duration, Duration),
    slot: Slot,
    (closing, stop): (CancellationToken, CancellationToken),
    force: CancellationToken,
) {
    // Set when hyper hands a complete request head to the router. Until
    // then the connection has nothing in flight and shutdown may close it:
    // hyper's own graceful shutdown closes idle keep-alive connections but
    // waits for a first header that is still arriving.
    let asked = Arc::new(AtomicBool::new(false));
    let service = {
        let asked = Arc::clone(&asked);
        service_fn(move |req: hyper::Request<Incoming>| {
            asked.store(true, Ordering::Relaxed);
            // A body must arrive in full within the header timeout of its
            // head, or a client could hold its connection slot with a body
            // it never finishes. No body, no timer.
            // An oversized head is refused before anything else looks at it.
            let refused = screen.and_then(|screen| screen(&req));
            let req = match req.body().is_end_stream() {
                true => req.map(Body::new),
                false => req.map(|b| Body::new(DeadlineBody::new(b, body_timeout))),
            };
            let router = router.clone();
            let close = closing.is_cancelled();
            async move {
                let Ok(mut answer) = match refused {
                    Some(answer) => Ok::<_, std::convert::Infallible>(answer),
                    None => router.oneshot(req).await,
                };
                if close {
                    answer.headers_mut().insert(
                        hyper::header::CONNECTION,
                        hyper::header::HeaderValue::from_static("close"),
                    );
                }
                Ok::<_, std::convert::Infallible>(answer)
            }
        })
    };
    // An answer the client does not take (it sends requests and never
    // reads, its receive window closed) would hold the connection's slot
    // for ever: hyper times the head it reads, not what it writes. A write
    // that makes no progress for the header timeout ends the connection.
    let mut stream = tokio_io_timeout::TimeoutStream::new(stream);
    stream.set_write_timeout(Some(write_timeout));
    let conn = http.serve_connection(TokioIo::new(Box::pin(stream)), service);
    tokio::pin!(conn);
    let ended = tokio::select! {
        ended = conn.as_mut() => ended,
        () = stop.cancelled() => {
            if !asked.load(Ordering::Relaxed) {
                return;
            }
            // Idle between requests: closes now. A request in flight: hyper
            // answers it with `Connection: close`, then closes.
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                ended = conn.as_mut() => ended,
                () = force.cancelled() => return,
            }
        }
    };
    if let Err(e) = ended {
        if e.is_timeout() {
            metrics::counter!("tally_http_header_timeouts_total", "listener" => slot.listener)
                .increment(1);
        } else {
            let kind = connection_error_kind(&e);
            metrics::counter!("tally_http_connection_errors_total",
                "listener" => slot.listener, "kind" => kind)
            .increment(1);
            // A client can end every connection so: one line every 10 s.
            static ENDED: crate::telemetry::Throttle =
                crate::telemetry::Throttle::new(Duration::from_secs(10));
            if tracing::enabled!(tracing::Level::DEBUG)
                && let Some(held_back) = ENDED.admit()
            {
                tracing::debug!(error = %e, kind, held_back, "connection ended with an error");
            }
        }
    }
}

/// The `kind` label of `tally_http_connection_errors_total`: how a
/// connection ended that hyper, not tally, answered or dropped. Such
/// requests never reach the router, so they are in no request metric.
const CONNECTION_ERROR_KINDS: [&str; 5] =
    ["malformed", "too_large", "incomplete", "stalled", "other"];

fn connection_error_kind(e: &hyper::Error) -> &'static str {
    if e.is_parse_too_large() {
        // A head over `HARD_HEAD_BYTES`, or too many fields: a bare `431`.
        "too_large"
    } else if e.is_parse() || e.is_parse_status() {
        // Not HTTP/1.1 as hyper reads it (a bad request line, a control
        // character in a header, TLS on a plain port): a bare `400`.
        "malformed"
    } else if e.is_incomplete_message() {
        // The client closed in the middle of a request.
        "incomplete"
    } else if std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    {
        // An answer the client took nothing of for the header timeout.
        "stalled"
    } else {
        "other"
    }
}

/// A connection's place under the cap, with the open-connections gauge
/// (and its place among its address's, where they are counted).
struct Slot {
    _permit: OwnedSemaphorePermit,
    _peer: Option<PeerHeld>,
    listener: &'static str,
}

impl Slot {
    fn new(permit: OwnedSemaphorePermit, listener: &'static str, peer: Option<PeerHeld>) -> Self {
        metrics::gauge!("tally_http_connections_open", "listener" => listener).increment(1.0);
        Self {
            _permit: permit,
            _peer: peer,
            listener,
        }
    }
}

/// Open connections by client address.
type OpenByAddress = Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>;

/// Open connections by client address, each at most `cap`.
struct Peers {
    cap: usize,
    open: OpenByAddress,
}

impl Peers {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            open: Arc::default(),
        }
    }

    /// A place for one more connection from `ip`, or `None` if it holds
    /// its cap already.
    fn take(&self, ip: std::net::IpAddr) -> Option<PeerHeld> {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = open.entry(ip).or_default();
        if *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(PeerHeld {
            open: Arc::clone(&self.open),
            ip,
        })
    }
}

/// One connection's place among its address's; given back when dropped.
struct PeerHeld {
    open: OpenByAddress,
    ip: std::net::IpAddr,
}

impl Drop for PeerHeld {
    fn drop(&mut self) {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        metrics::gauge!("tally_http_connections_open", "listener" => self.listener).decrement(1.0);
    }
}

/// The whole answer to a connection past the cap, built once. It is written
/// before (or without) reading the request, so it may be a budget check's
/// answer: it says `"allowed": false`, as every check's refusal does.
fn refusal(why: &str) -> Vec<u8> {
    let body = serde_json::json!({
        "type": "/problems/too-many-connections",
        "title": "Too many connections",
        "status": 503,
        "allowed": false,
        "detail": format!("{why}; nothing was done, retry shortly"),
    })
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\n\
         content-type: application/problem+json\r\n\
         retry-after: 1\r\n\
         connection: close\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Answers `refusal` once the client has sent its request, and closes once
/// the client has read it; each wait bounded by [`REFUSAL_WAIT`].
///
/// An answer that arrives before the request makes clients (hyper's, so
/// reqwest's, among them) report an unexpected message instead of a `503`,
/// and closing on unread input makes the kernel send RST, which can destroy
/// the answer before the client reads it.
async fn refuse(mut stream: TcpStream, refusal: Arc<[u8]>, _lingering: OwnedSemaphorePermit) {
    let mut sink = [0u8; 4096];
    // The request, or whatever part of it comes in time; a client that sends
    // nothing gets the answer all the same.
    let _ = tokio::time::timeout(REFUSAL_WAIT, async {
        loop {
            // `readable` may wake without data: only bytes count.
            let _ = stream.readable().await;
            match stream.try_read(&mut sink) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                _ => break,
            }
        }
    })
    .await;
    for _ in 0..16 {
        if !matches!(stream.try_read(&mut sink), Ok(n) if n > 0) {
            break;
        }
    }
    let _ = tokio::time::timeout(REFUSAL_WAIT, async {
        stream.write_all(&refusal).await?;
        stream.shutdown().await?;
        while stream.read(&mut sink).await? > 0 {}
        io::Result::Ok(())
    })
    .await;
}

/// Answers `refusal` and closes, without waiting for anything: when many
/// refusals are already lingering, giving the descriptor back comes first.
fn refuse_at_once(stream: TcpStream, refusal: &[u8]) {
    // Deregistered from the runtime, still non-blocking: every call below
    // returns at once.
    let Ok(stream) = stream.into_std() else {
        return;
    };
    // A new socket's send buffer is empty, so the few hundred bytes go out
    // whole; should they not, the client sees a plain close.
    let _ = (&stream).write(refusal);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    // Closing with unread input makes the kernel send RST, which can destroy
    // the answer before the client reads it: read what has already arrived.
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match (&stream).read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
}

/// What to do when `accept` fails.
async fn accept_failed(e: &io::Error, last_logged: &mut Option<Instant>) {
    // The client gave up while queued: nothing to do.
    if matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
    ) {
        return;
    }
    // Out of descriptors (something besides connections is holding them,
    // since the cap stays below the limit) or memory: the connection waits
    // in the kernel's queue, so retry soon, logging once a second at most.
    if last_logged.is_none_or(|t: Instant| t.elapsed() >= Duration::from_secs(1)) {
        tracing::error!(error = %e, "cannot accept connections");
        *last_logged = Some(Instant::now());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Why a request body was cut off: it did not arrive in full within the
/// header timeout of its head. `crate::http` answers it `408`.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
pub struct BodyTimedOut;

/// A request body that fails with [`BodyTimedOut`] once its deadline has
/// passed and it is still waiting for data.
struct DeadlineBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl DeadlineBody {
    fn new(inner: Incoming, within: Duration) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(within)),
        }
    }
}

impl hyper::body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|f| f.map_err(Into::into))),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(BodyTimedOut.into()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_a_complete_problem_answer() {
        let r = String::from_utf8(refusal(
            "tally already has its maximum of 7 connections open",
        ))
        .unwrap();
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "));
        assert!(head.contains("content-type: application/problem+json"));
        assert!(head.contains("retry-after: 1"));
        assert!(head.contains("connection: close"));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["status"], 503);
        assert_eq!(v["type"], "/problems/too-many-connections");
        assert_eq!(v["allowed"], false, "it may be a check's answer");
    }

    /// The start's trial of its address finds a port in use, and is never
    /// seen by a client: while it holds the address, a connection is
    /// refused (the replica gate's promise: nothing listens before it).
    #[tokio::test]
    async fn a_trial_bind_finds_a_port_in_use_and_accepts_nothing() {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let taken = bind(addr).unwrap();
        let busy = taken.local_addr().unwrap();
        let e = try_bind(busy).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        drop(taken);

        try_bind(busy).unwrap();
        let held = bound(busy).unwrap();
        let e = tokio::net::TcpStream::connect(busy).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
        drop(held);
        // And the real bind follows it at once.
        bind(busy).unwrap();
    }
}
