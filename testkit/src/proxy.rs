//! A fault-injecting TCP proxy on 127.0.0.1, for putting network faults between a service and
//! its `redis-server`.
//!
//! The proxy runs on its own one-thread Tokio runtime, so it keeps forwarding (or misbehaving)
//! whatever the test's runtime is doing, and can be switched from sync or async code while
//! traffic flows:
//!
//! | call | new connections | open connections |
//! |---|---|---|
//! | [`Proxy::heal`] (the start state) | accepted, forwarded | forwarded |
//! | [`Proxy::latency`] | accepted, forwarded late | every chunk, each way, held `d` before it is sent on |
//! | [`Proxy::stall`] | accepted, never answered | bytes held (sent on after `heal`) |
//! | [`Proxy::refuse`] | refused (`ECONNREFUSED`: nothing listens) | unchanged |
//! | [`Proxy::drop_all`] | unchanged | closed, both sides, at once |
//! | [`Proxy::drop_reply_to`] | unchanged | the next request containing `needle` is sent on; its connection is closed when the reply comes back, before the client sees it (once) |
//! | [`Proxy::hold_replies_after`] | unchanged | the next request containing `needle` is sent on; the replies on its connection are held from then on until [`Proxy::release_replies`] (once) |
//! | [`Proxy::redirect`] | forwarded to another server | unchanged |
//!
//! Latency delays each chunk from the moment the proxy read it, without capping throughput:
//! pipelined commands all arrive `d` late, they do not queue behind each other's delays. A round
//! trip through the proxy is therefore `2 * d` longer.
//!
//! It only ever connects to the upstream port it was given (a server the test started).

use std::{
    collections::VecDeque,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream, tcp::OwnedReadHalf, tcp::OwnedWriteHalf},
    runtime::Runtime,
    sync::{Notify, mpsc, watch},
    time::Instant,
};

/// What the proxy does to traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Everything forwarded at once.
    Pass,
    /// Every chunk held this long, each way.
    Latency(Duration),
    /// Nothing sent on, either way.
    Stall,
    /// New connections refused.
    Refuse,
}

#[derive(Debug)]
struct Shared {
    mode: watch::Sender<Mode>,
    /// Bumped by `drop_all`; every connection task ends when it changes.
    epoch: watch::Sender<u64>,
    open: AtomicUsize,
    accepted: AtomicUsize,
    /// Set by `drop_reply_to`: the bytes a request must contain to have its reply dropped.
    drop_reply: Mutex<Option<Vec<u8>>>,
    /// Replies dropped so far.
    replies_dropped: AtomicUsize,
    /// Set by `hold_replies_after`: the bytes a request must contain to have its connection's
    /// replies held.
    hold_replies: Mutex<Option<Vec<u8>>>,
    /// Whether replies on a connection armed by `hold_replies_after` are held now.
    holding: watch::Sender<bool>,
    /// Where new connections go.
    upstream: Mutex<SocketAddr>,
}

/// A proxy from `127.0.0.1:<port>` to `127.0.0.1:<upstream>`; stopped on drop.
#[derive(Debug)]
pub struct Proxy {
    port: u16,
    shared: Arc<Shared>,
    runtime: Option<Runtime>,
}

impl Proxy {
    /// Starts forwarding to `127.0.0.1:upstream` on a free loopback port.
    pub fn start(upstream: u16) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .expect("cannot build the proxy's runtime");
        // Bound here, registered with the proxy's runtime there: this may run inside another
        // runtime, where `block_on` is not allowed.
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
            .expect("cannot bind the proxy on 127.0.0.1");
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            mode: watch::channel(Mode::Pass).0,
            epoch: watch::channel(0).0,
            open: AtomicUsize::new(0),
            accepted: AtomicUsize::new(0),
            drop_reply: Mutex::new(None),
            replies_dropped: AtomicUsize::new(0),
            hold_replies: Mutex::new(None),
            holding: watch::channel(false).0,
            upstream: Mutex::new(([127, 0, 0, 1], upstream).into()),
        });
        let accept_shared = Arc::clone(&shared);
        runtime.spawn(async move {
            let listener = TcpListener::from_std(listener).expect("register the proxy listener");
            accept_loop(listener, port, accept_shared).await
        });
        Self {
            port,
            shared,
            runtime: Some(runtime),
        }
    }

    /// The port it listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The Redis URL that goes through the proxy.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// What it does to traffic now.
    pub fn mode(&self) -> Mode {
        *self.shared.mode.borrow()
    }

    /// Forwards everything at once again; stalled bytes flow, new connections are accepted.
    pub fn heal(&self) {
        self.shared.mode.send_replace(Mode::Pass);
    }

    /// Holds every chunk, each way, for `one_way` before sending it on.
    pub fn latency(&self, one_way: Duration) {
        self.shared.mode.send_replace(Mode::Latency(one_way));
    }

    /// Accepts connections and reads from them, but sends nothing on, either way.
    pub fn stall(&self) {
        self.shared.mode.send_replace(Mode::Stall);
    }

    /// Stops listening: new connections are refused. Open ones are left alone.
    pub fn refuse(&self) {
        self.shared.mode.send_replace(Mode::Refuse);
    }

    /// Closes every open connection, both sides.
    pub fn drop_all(&self) {
        self.shared.epoch.send_modify(|e| *e += 1);
    }

    /// Once: the next chunk a client sends that contains `needle` is sent on to the server, and
    /// when the server's reply comes back the proxy closes that connection, both sides, without
    /// passing the reply on: the request ran, its caller only sees the connection drop.
    pub fn drop_reply_to(&self, needle: &[u8]) {
        *self.shared.drop_reply.lock().unwrap() = Some(needle.to_vec());
    }

    /// Once: the next chunk a client sends that contains `needle` is sent on to the server, and
    /// from then on the replies on that connection are held in the proxy (the server has
    /// answered, its caller has not heard) until [`release_replies`](Self::release_replies).
    /// Other connections, and requests, flow as the mode says.
    pub fn hold_replies_after(&self, needle: &[u8]) {
        *self.shared.hold_replies.lock().unwrap() = Some(needle.to_vec());
    }

    /// Whether a connection's replies are held now (a request matched
    /// [`hold_replies_after`](Self::hold_replies_after)'s needle).
    pub fn holding_replies(&self) -> bool {
        *self.shared.holding.borrow()
    }

    /// Sends the replies held by [`hold_replies_after`](Self::hold_replies_after) on, in order,
    /// and lets that connection's replies flow again.
    pub fn release_replies(&self) {
        self.shared.holding.send_replace(false);
    }

    /// Replies dropped by [`drop_reply_to`](Self::drop_reply_to) so far.
    pub fn replies_dropped(&self) -> usize {
        self.shared.replies_dropped.load(Ordering::SeqCst)
    }

    /// Sends new connections to `127.0.0.1:upstream` (an address moving to another server, as
    /// a virtual IP or a DNS name does after a failover). Open ones stay where they are.
    pub fn redirect(&self, upstream: u16) {
        *self.shared.upstream.lock().unwrap() = ([127, 0, 0, 1], upstream).into();
    }

    /// Connections open through the proxy now.
    pub fn open_connections(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }

    /// Connections accepted since the start.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Safe in async contexts too; drops every task, closing every socket.
            runtime.shutdown_background();
        }
    }
}

async fn accept_loop(mut listener: TcpListener, port: u16, shared: Arc<Shared>) {
    let mut mode = shared.mode.subscribe();
    loop {
        if *mode.borrow_and_update() == Mode::Refuse {
            // Nothing listens while refusing: connecting gets ECONNREFUSED.
            drop(listener);
            while *mode.borrow_and_update() == Mode::Refuse {
                if mode.changed().await.is_err() {
                    return;
                }
            }
            listener = rebind(port).await;
            continue;
        }
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                let upstream = *shared.upstream.lock().unwrap();
                tokio::spawn(connection(client, upstream, Arc::clone(&shared)));
            }
            changed = mode.changed() => if changed.is_err() { return },
        }
    }
}

async fn rebind(port: u16) -> TcpListener {
    // The port was ours a moment ago; SO_REUSEADDR (set by tokio on Unix) lets us take it back.
    for _ in 0..100 {
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)).await {
            return listener;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the proxy could not listen on 127.0.0.1:{port} again");
}

/// Counts an open connection for as long as it lives.
struct Open(Arc<Shared>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn connection(client: TcpStream, upstream: SocketAddr, shared: Arc<Shared>) {
    shared.open.fetch_add(1, Ordering::SeqCst);
    let _open = Open(Arc::clone(&shared));
    let mut epoch = shared.epoch.subscribe();
    epoch.borrow_and_update();
    let _ = client.set_nodelay(true);
    // A stalled proxy still connects upstream, so that healing lets the held bytes through.
    let server = tokio::select! {
        server = TcpStream::connect(upstream) => match server {
            Ok(server) => server,
            // Upstream down: close the client's side, as a dead server would.
            Err(_) => return,
        },
        _ = epoch.changed() => return,
    };
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let cut = Cut::default();
    tokio::select! {
        _ = pump(client_read, server_write, &shared, &cut, Way::Request) => {}
        _ = pump(server_read, client_write, &shared, &cut, Way::Reply) => {}
        _ = epoch.changed() => {}
        () = cut.now.notified() => {}
    }
    // Both halves of both sockets drop here: each side sees the connection close.
}

/// One connection's part in `drop_reply_to` and `hold_replies_after`.
#[derive(Default)]
struct Cut {
    /// A request whose reply is to be dropped was sent on.
    armed: AtomicBool,
    /// A request after which replies are held was sent on.
    hold: AtomicBool,
    /// Closes the connection.
    now: Notify,
}

/// Which way a pump copies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Client to server: a request may arm the connection's `Cut`.
    Request,
    /// Server to client: an armed `Cut` drops the reply and closes the connection.
    Reply,
}

/// Copies one direction, applying the mode to every chunk when it is sent on, and `drop_reply_to`.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    cut: &Cut,
    way: Way,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    };
    let writer = async move {
        let mut mode = shared.mode.subscribe();
        let mut pending: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
        loop {
            let Some(chunk) = (match pending.pop_front() {
                Some(chunk) => Some(chunk),
                None => rx.recv().await,
            }) else {
                // The reader saw EOF and everything read was sent on: pass the EOF on.
                let _ = to.shutdown().await;
                return;
            };
            let (read_at, bytes) = chunk;
            // Wait for as long as the mode (which may change meanwhile) says to hold the chunk.
            loop {
                let current = *mode.borrow_and_update();
                let send_at = match current {
                    Mode::Pass | Mode::Refuse => break,
                    Mode::Latency(d) => read_at + d,
                    Mode::Stall => {
                        // Keep reading meanwhile, so the sender is not pushed back.
                        tokio::select! {
                            more = rx.recv() => match more {
                                Some(more) => pending.push_back(more),
                                None => std::future::pending::<()>().await,
                            },
                            changed = mode.changed() => if changed.is_err() { return },
                        }
                        continue;
                    }
                };
                if Instant::now() >= send_at {
                    break;
                }
                tokio::select! {
                    () = tokio::time::sleep_until(send_at) => break,
                    changed = mode.changed() => if changed.is_err() { return },
                }
            }
            match way {
                Way::Request => {
                    let mut needle = shared.drop_reply.lock().unwrap();
                    let hit = needle
                        .as_deref()
                        .is_some_and(|n| bytes.windows(n.len()).any(|w| w == n));
                    if hit {
                        *needle = None;
                        cut.armed.store(true, Ordering::SeqCst);
                    }
                    drop(needle);
                    let mut needle = shared.hold_replies.lock().unwrap();
                    let hit = needle
                        .as_deref()
                        .is_some_and(|n| bytes.windows(n.len()).any(|w| w == n));
                    if hit {
                        *needle = None;
                        shared.holding.send_replace(true);
                        cut.hold.store(true, Ordering::SeqCst);
                    }
                }
                Way::Reply if cut.armed.load(Ordering::SeqCst) => {
                    shared.replies_dropped.fetch_add(1, Ordering::SeqCst);
                    cut.now.notify_one();
                    return;
                }
                Way::Reply if cut.hold.load(Ordering::SeqCst) => {
                    let mut holding = shared.holding.subscribe();
                    if holding.wait_for(|held| !held).await.is_err() {
                        return;
                    }
                    cut.hold.store(false, Ordering::SeqCst);
                }
                Way::Reply => {}
            }
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(reader, writer);
}
