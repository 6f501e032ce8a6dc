//! What the loopback forwarders standing between tally (or Litestream) and
//! a server share: a listener whose every connection gets a task of its
//! own.

use std::net::SocketAddr;

use tokio::{
    net::{TcpListener, TcpStream},
    task::{JoinHandle, JoinSet},
};

/// Listens on a free loopback port and hands every connection accepted to
/// `each`, in a task of its own. The handle owns the accept loop, which
/// owns every connection's task: aborting it ends them all.
pub(crate) async fn accept_each<F, Fut>(each: F) -> (SocketAddr, JoinHandle<()>)
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            let Ok((inbound, _)) = listener.accept().await else {
                continue;
            };
            connections.spawn(each(inbound));
            while connections.try_join_next().is_some() {}
        }
    });
    (addr, task)
}
