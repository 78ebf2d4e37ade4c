//! Redis Cluster on loopback: [`RedisCluster`] starts its nodes (`redis-server
//! --cluster-enabled yes`) and joins them with `redis-cli --cluster create`; a one-node cluster
//! owns every slot. Each node is a [`RedisServer`] of its own, killed when the cluster drops.

use std::time::{Duration, Instant};

use crate::server::{RedisServer, ServerOptions};

/// A Redis Cluster node started alone, owning every slot (`CLUSTER ADDSLOTSRANGE 0 16383`): a
/// "cluster mode, one shard" server, as managed services offer, to reach through a plain
/// connection. Refuses a script whose keys hash to several slots (`CROSSSLOT`).
pub fn one_node_cluster() -> RedisServer {
    RedisCluster::one_node(&[])
        .nodes
        .pop()
        .expect("a one-node cluster has its node")
}

/// The hash slot of `key`, by the Redis Cluster specification's rule (CRC16/XMODEM of the part
/// between the first `{` and the next `}`, if not empty, else of the whole key, modulo 16384),
/// written independently of tower-lock's own.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    let crc = hashed.iter().fold(0u16, |mut crc, &b| {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
        crc
    });
    crc % 16384
}

/// A Redis Cluster on loopback: `masters` masters, each with `replicas` replicas.
#[derive(Debug)]
pub struct RedisCluster {
    /// Every node, masters and replicas, in the order they were started.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters * (1 + replicas)` nodes (node timeout 1 s), creates the cluster and waits
    /// until every node reports `cluster_state:ok`.
    pub fn start(masters: usize, replicas: usize) -> Self {
        Self::start_with(RedisServer::options(), masters, replicas)
    }

    /// Like [`start`](Self::start), every node started with `options` (their TLS, with
    /// `--tls-cluster yes`, and password).
    pub fn start_with(options: ServerOptions, masters: usize, replicas: usize) -> Self {
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| {
                options
                    .clone()
                    .args(&[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "1000",
                    ])
                    .start()
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let replicas = replicas.to_string();
        let mut args = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", &replicas, "--cluster-yes"]);
        nodes[0].cli(&args);
        let cluster = Self { nodes };
        cluster.wait_until_ok();
        cluster
    }

    /// A cluster of one master that owns every slot (`CLUSTER ADDSLOTSRANGE`), with extra
    /// `redis-server` arguments.
    pub fn one_node(extra_args: &[&str]) -> Self {
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        ];
        args.extend_from_slice(extra_args);
        let node = RedisServer::start_with(&args);
        node.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
        let cluster = Self { nodes: vec![node] };
        cluster.wait_until_ok();
        cluster
    }

    /// Waits until every running node reports `cluster_state:ok`, for at most 20 s.
    pub fn wait_until_ok(&self) {
        let start = Instant::now();
        loop {
            let ok = self
                .nodes
                .iter()
                .filter(|n| n.is_running())
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            if ok {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the cluster never reached cluster_state:ok"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every node's URL.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The node serving `slot` as master, from a running node's `CLUSTER NODES`.
    pub fn master_of(&self, slot: u16) -> &RedisServer {
        self.try_master_of(slot)
            .unwrap_or_else(|| panic!("no healthy master serves slot {slot}"))
    }

    /// The healthy node serving `slot` as master, if any (none mid-failover).
    pub fn try_master_of(&self, slot: u16) -> Option<&RedisServer> {
        let nodes = self.asker().cli(&["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let serves = fields[8..].iter().any(|range| {
                let mut ends = range.split('-').map(|p| p.parse::<u16>());
                match (ends.next(), ends.next()) {
                    (Some(Ok(a)), Some(Ok(b))) => (a..=b).contains(&slot),
                    (Some(Ok(a)), None) => a == slot,
                    _ => false,
                }
            });
            if serves {
                let port: u16 = fields[1].split(['@', ':']).nth(1).unwrap().parse().unwrap();
                return self.nodes.iter().find(|n| n.port() == port);
            }
        }
        None
    }

    /// The running masters.
    pub fn masters(&self) -> Vec<&RedisServer> {
        self.nodes
            .iter()
            .filter(|n| n.is_running() && n.cli(&["ROLE"]).starts_with("master"))
            .collect()
    }

    /// The key's hash slot, as the cluster computes it (`CLUSTER KEYSLOT`).
    pub fn slot(&self, key: &[u8]) -> u16 {
        self.asker()
            .cli(&["CLUSTER", "KEYSLOT", std::str::from_utf8(key).unwrap()])
            .trim()
            .parse()
            .unwrap()
    }

    /// A running node to ask about the cluster.
    fn asker(&self) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.is_running())
            .expect("no node of the cluster runs")
    }
}
