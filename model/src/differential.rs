//! The model Redis against a real `redis-server`: every distinct script run the checker made
//! (its script, keys, arguments, keyspace and subscribed channels) is run again on the server,
//! from the same keyspace, with the same channels subscribed, and must answer the same, leave
//! the same keyspace and publish the same messages.
//!
//! Two differences are made harmless on the way: times are scaled from ticks to seconds (an
//! expiry of `e` ticks is `e * 1000` ms on the server, and read back rounded up), so that the
//! milliseconds that pass between setting up and reading back cannot change an outcome; and the
//! fencing counter is offset by `BASE`, larger than the server clock in µs, so that the server
//! clock term of a fencing token (which the model leaves out) never wins. A sorted set's scores
//! (the holders' expiries on a key with a capacity) are times on the server's clock, which the
//! model reads as 0: they are set up as the server's time read just before plus the score in
//! seconds, and read back relative to that time, rounded to the nearest tick.

use std::time::Duration;

use futures_util::StreamExt;
use redis::{
    AsyncCommands, Value,
    aio::{MultiplexedConnection, PubSubSink, PubSubStream},
};

use super::{
    Model,
    redis::{Db, FAR, Reply, Val},
};

/// Added to every fencing counter on the server: above any server time in µs until 2223, and
/// exact in Lua's doubles.
const BASE: i64 = 8_000_000_000_000_000;

/// Milliseconds per tick on the server.
const SCALE: i64 = 1000;

/// What a script run left behind, comparable between the model and the server.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    reply: String,
    keys: Vec<(String, String, Option<i64>)>,
    messages: Vec<(String, String)>,
}

struct Subscriber {
    channel: Vec<u8>,
    sink: PubSubSink,
    stream: PubSubStream,
    subscribed: bool,
}

/// Replays up to `limit` of `model`'s script runs (evenly spread over them) on the server at
/// `url`; returns how many it compared. Panics at the first difference.
pub async fn replay(model: &Model, url: &str, limit: usize) -> usize {
    let client = redis::Client::open(url).expect("redis url");
    // No response timeout: on a loaded machine a reply may take longer than the client's
    // default 500 ms, which is no difference between the model and the server.
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("cannot connect to the test redis-server");
    let mut subscribers = Vec::new();
    for &channel in &model.keys.channels {
        let (sink, stream) = client
            .get_async_pubsub()
            .await
            .expect("pub/sub connection")
            .split();
        subscribers.push(Subscriber {
            channel: model.interner.borrow().get(channel).to_vec(),
            sink,
            stream,
            subscribed: false,
        });
    }
    let mut runs: Vec<_> = model.redis.runs().collect();
    // A fixed order, so that a failure is reproducible.
    runs.sort_by_key(|(key, _)| format!("{key:?}"));
    let stride = runs.len().div_ceil(limit.max(1)).max(1);
    if let Some(counts) = &model.config.counts {
        // Times are told from other arguments by their value (below).
        let times = [model.config.timing.ttl, model.config.timing.claim].map(i64::from);
        for n in counts.weights.iter().chain([&counts.capacity]) {
            assert!(
                !times.contains(&i64::from(*n)),
                "a weight or capacity equal to the TTL or claim window would be scaled"
            );
        }
    }
    let mut compared = 0;
    for (key, outcome) in runs.iter().step_by(stride) {
        let (script, keys, args, db, subscribed) = key;
        let name = model.redis.script_name(*script);
        let text = |v: &Val| model.interner.borrow().get(*v).to_vec();
        let keys: Vec<Vec<u8>> = keys.iter().map(text).collect();
        let ttl = model.config.timing.ttl.to_string().into_bytes();
        let claim = model.config.timing.claim.to_string().into_bytes();
        let args: Vec<Vec<u8>> = args
            .iter()
            .map(|v| {
                let a = text(v);
                if a == ttl || a == claim {
                    scaled(&a)
                } else {
                    a
                }
            })
            .collect();
        let zero = set_up(model, &mut conn, db).await;
        for s in &mut subscribers {
            let want = subscribed
                .iter()
                .any(|c| model.interner.borrow().get(*c) == s.channel.as_slice());
            if want != s.subscribed {
                if want {
                    s.sink.subscribe(&s.channel).await.expect("subscribe");
                } else {
                    s.sink.unsubscribe(&s.channel).await.expect("unsubscribe");
                }
                s.subscribed = want;
            }
        }
        let mut eval = redis::cmd("EVAL");
        eval.arg(model.redis.script_source(*script)).arg(keys.len());
        for k in &keys {
            eval.arg(k);
        }
        for a in &args {
            eval.arg(a);
        }
        let reply: Value = eval
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{name} failed on the server: {e}"));
        let mut messages = Vec::new();
        for &(channel, _) in &outcome.published {
            let channel = text(&channel);
            if let Some(s) = subscribers
                .iter_mut()
                .find(|s| s.channel == channel && s.subscribed)
            {
                let msg = tokio::time::timeout(Duration::from_secs(2), s.stream.next())
                    .await
                    .unwrap_or_else(|_| panic!("{name}: a message on {channel:?} never came"))
                    .expect("pub/sub stream");
                messages.push((
                    String::from_utf8_lossy(&channel).into_owned(),
                    unscale_message(msg.get_payload_bytes()),
                ));
            }
        }
        let server = Seen {
            reply: server_reply(name, &args, &reply),
            keys: read_back(model, &mut conn, zero).await,
            messages,
        };
        let expected = Seen {
            reply: model_reply(&outcome.reply),
            keys: model_keys(model, &outcome.db),
            messages: outcome
                .published
                .iter()
                .filter(|(c, _)| subscribed.contains(c))
                .map(|(c, p)| {
                    let payload = String::from_utf8_lossy(&text(p)).into_owned();
                    (String::from_utf8_lossy(&text(c)).into_owned(), payload)
                })
                .collect(),
        };
        assert_eq!(
            server,
            expected,
            "{name} with keys {keys:?}, arguments {args:?} from {} answers differently on \
             redis-server (left) and in the model (right)",
            model.show_db(db),
        );
        compared += 1;
    }
    // Nothing published that the model did not expect.
    for s in &mut subscribers {
        let extra = tokio::time::timeout(Duration::from_millis(100), s.stream.next()).await;
        assert!(extra.is_err(), "an unexpected message: {extra:?}");
    }
    compared
}

fn scaled(ticks: &[u8]) -> Vec<u8> {
    let n: i64 = std::str::from_utf8(ticks).unwrap().parse().unwrap();
    (n * SCALE).to_string().into_bytes()
}

/// A time read back from the server, in ticks.
fn ticks(ms: i64) -> i64 {
    if ms < 0 { ms } else { (ms + SCALE - 1) / SCALE }
}

/// The server's clock, in ms.
async fn server_ms(conn: &mut MultiplexedConnection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(conn).await.expect("TIME");
    s * 1000 + us / 1000
}

/// The model's keyspace on the server (after `FLUSHALL`); returns the server time its scores
/// count from.
async fn set_up(model: &Model, conn: &mut MultiplexedConnection, db: &Db) -> i64 {
    let text = |v: Val| model.interner.borrow().get(v).to_vec();
    let zero = server_ms(conn).await;
    let mut pipe = redis::pipe();
    pipe.cmd("FLUSHALL").ignore();
    if db.string(model.keys.fence).is_none() {
        // No counter in the model is a counter at 0: the next token is 1 in both.
        pipe.cmd("SET")
            .arg(text(model.keys.fence))
            .arg(BASE)
            .ignore();
    }
    for &(k, v, e) in db.strings.iter() {
        let mut value = text(v);
        if k == model.keys.fence {
            let n: i64 = String::from_utf8(value).unwrap().parse().unwrap();
            value = (BASE + n).to_string().into_bytes();
        }
        let set = pipe.cmd("SET").arg(text(k)).arg(value);
        if let Some(e) = e {
            set.arg("PX").arg(i64::from(e) * SCALE);
        }
        set.ignore();
    }
    for (k, list, e) in db.lists.iter() {
        let push = pipe.cmd("RPUSH").arg(text(*k));
        for v in list {
            push.arg(text(*v));
        }
        push.ignore();
        if let Some(e) = e {
            pipe.cmd("PEXPIRE")
                .arg(text(*k))
                .arg(i64::from(*e) * SCALE)
                .ignore();
        }
    }
    for (k, members, e) in db.zsets.iter() {
        let add = pipe.cmd("ZADD").arg(text(*k));
        for (score, m) in members {
            add.arg(zero + i64::from(*score) * SCALE).arg(text(*m));
        }
        add.ignore();
        if let Some(e) = e {
            pipe.cmd("PEXPIRE")
                .arg(text(*k))
                .arg(i64::from(*e) * SCALE)
                .ignore();
        }
    }
    let () = pipe
        .query_async(conn)
        .await
        .expect("setting up the keyspace");
    zero
}

/// A sorted set's members as text, `member@score`, in order of score then member.
fn members_text(mut members: Vec<(String, i64)>) -> String {
    members.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    members
        .iter()
        .map(|(m, s)| format!("{m}@{s}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The model's four keys as they are on the server: (key, value, expiry in ticks); scores
/// counted from `zero`.
async fn read_back(
    model: &Model,
    conn: &mut MultiplexedConnection,
    zero: i64,
) -> Vec<(String, String, Option<i64>)> {
    let k = &model.keys;
    let mut out = Vec::new();
    for key in [
        k.locks[0],
        k.locks[1],
        k.fence,
        k.queues[0],
        k.queues[1],
        k.record,
    ] {
        let name = model.interner.borrow().get(key).to_vec();
        let kind: String = redis::cmd("TYPE")
            .arg(&name)
            .query_async(conn)
            .await
            .unwrap();
        let value = match kind.as_str() {
            "none" => continue,
            "string" => {
                let v: Vec<u8> = conn.get(&name).await.unwrap();
                let v = String::from_utf8_lossy(&v).into_owned();
                if key == k.fence {
                    let n = v.parse::<i64>().unwrap() - BASE;
                    if n == 0 {
                        continue;
                    }
                    n.to_string()
                } else {
                    v
                }
            }
            "list" => {
                let v: Vec<Vec<u8>> = conn.lrange(&name, 0, -1).await.unwrap();
                v.iter()
                    .map(|e| String::from_utf8_lossy(e).into_owned())
                    .collect::<Vec<_>>()
                    .join(",")
            }
            "zset" => {
                let v: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
                    .arg(&name)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query_async(conn)
                    .await
                    .unwrap();
                let ticks =
                    |score: f64| ((score as i64 - zero) as f64 / SCALE as f64).round() as i64;
                members_text(
                    v.iter()
                        .map(|(m, s)| (String::from_utf8_lossy(m).into_owned(), ticks(*s)))
                        .collect(),
                )
            }
            other => panic!("a {other} key"),
        };
        let pttl: i64 = conn.pttl(&name).await.unwrap();
        // The counter's and record's retention (24 h) is beyond the model's horizon.
        let expiry = (0..FAR).contains(&pttl).then(|| ticks(pttl));
        out.push((String::from_utf8_lossy(&name).into_owned(), value, expiry));
    }
    out
}

fn model_keys(model: &Model, db: &Db) -> Vec<(String, String, Option<i64>)> {
    let k = &model.keys;
    let text = |v: Val| String::from_utf8_lossy(model.interner.borrow().get(v)).into_owned();
    let mut out = Vec::new();
    for key in [
        k.locks[0],
        k.locks[1],
        k.fence,
        k.queues[0],
        k.queues[1],
        k.record,
    ] {
        if let Some((v, e)) = db.string(key) {
            out.push((text(key), text(v), e.map(i64::from)));
        } else if let Some(list) = db.list(key) {
            let e = db
                .lists
                .iter()
                .find(|(lk, ..)| *lk == key)
                .and_then(|l| l.2);
            let items: Vec<String> = list.iter().map(|v| text(*v)).collect();
            out.push((text(key), items.join(","), e.map(i64::from)));
        } else if let Some(members) = db.zset(key) {
            let e = db
                .zsets
                .iter()
                .find(|(zk, ..)| *zk == key)
                .and_then(|z| z.2);
            let members = members
                .iter()
                .map(|(s, m)| (text(*m), i64::from(*s)))
                .collect();
            out.push((text(key), members_text(members), e.map(i64::from)));
        }
    }
    out
}

fn model_reply(reply: &Reply) -> String {
    match reply {
        Reply::Int(n) => n.to_string(),
        Reply::Array(items) => items.iter().map(model_reply).collect::<Vec<_>>().join(","),
        other => format!("{other:?}"),
    }
}

/// The server's answer, in the model's terms. The batch script: two numbers per operation,
/// where an acquire's `{1, fence}` loses the counter's offset and its `{0 or 2, PTTL}` is in
/// ticks. A set: `{1, fence, fence}` less the offsets, and `{0, 2 or 3, PTTL, key}` in ticks; a
/// set's release, a count.
fn server_reply(script: &str, args: &[Vec<u8>], reply: &Value) -> String {
    let int = |v: &Value| match v {
        Value::Int(n) => *n,
        other => panic!("{script} answered {other:?}"),
    };
    match reply {
        Value::Int(n) => return n.to_string(),
        Value::Array(items) if script == "acquire_set.lua" => {
            let code = int(&items[0]);
            let rest: Vec<String> = match code {
                1 => items[1..]
                    .iter()
                    .map(|v| (int(v) - BASE).to_string())
                    .collect(),
                _ => vec![
                    ticks(int(&items[1])).to_string(),
                    int(&items[2]).to_string(),
                ],
            };
            return format!("{code},{}", rest.join(","));
        }
        _ => {}
    }
    let Value::Array(items) = reply else {
        panic!("{script} answered {reply:?}")
    };
    // The kinds of the batch's operations, in order, read as the script reads its arguments.
    let mut kinds = Vec::new();
    let mut a = 3;
    while a < args.len() {
        let kind = args[a].clone();
        a += match kind.as_slice() {
            b"a" => 6,
            b"r" => 2,
            b"n" => 3,
            b"c" => 4,
            b"A" => 8,
            b"R" | b"N" => 4,
            other => panic!("{script}: unknown operation {other:?}"),
        };
        kinds.push(kind);
    }
    assert_eq!(items.len(), 2 * kinds.len(), "{script} answered {reply:?}");
    let mut out = Vec::new();
    for (pair, kind) in items.chunks(2).zip(&kinds) {
        let (code, n) = (int(&pair[0]), int(&pair[1]));
        let n = match (kind.as_slice(), code) {
            (b"a" | b"A", 1) => n - BASE,
            (b"a" | b"A", _) => ticks(n),
            _ => n,
        };
        out.push(format!("{code},{n}"));
    }
    out.join(",")
}

/// A hand-off message from the server, in the model's terms: `g<id><claim>:<fence>` or
/// `n<id><claim>` (the id is the token and stamp, 48 bytes).
fn unscale_message(payload: &[u8]) -> String {
    let text = String::from_utf8_lossy(payload).into_owned();
    let (head, tail) = text.split_at(1 + 48);
    let tail = match tail.split_once(':') {
        Some((claim, fence)) => format!(
            "{}:{}",
            claim.parse::<i64>().unwrap() / SCALE,
            fence.parse::<i64>().unwrap() - BASE
        ),
        None => (tail.parse::<i64>().unwrap() / SCALE).to_string(),
    };
    format!("{head}{tail}")
}
