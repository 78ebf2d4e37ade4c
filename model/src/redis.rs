//! The model Redis: string, list, sorted-set and hash keys with expiry, `PUBLISH` and `PUBSUB NUMSUB` answered
//! from the model's processes, and the crate's own Lua scripts run against it, unchanged, in an
//! embedded Lua 5.1 (the version Redis embeds), one script call being one atomic model step.
//!
//! Time is relative: an expiry is the number of ticks from now, and the model shifts every
//! expiry by one at each tick (see `system.rs`). Values are interned (`Val`), so that a state
//! is small plain data that clones and hashes cheaply.

use std::{cell::RefCell, collections::HashMap, fmt::Write as _, rc::Rc};

use mlua::{Function, Lua, MultiValue, Value};

use super::seq::Seq;

/// An interned byte string (Redis keys and values, Lua arguments, channel payloads).
pub type Val = u32;

/// A `PX` or `PEXPIRE` of at least this many ticks never runs out within the model's horizon
/// (the fencing counter's 24 h retention, the idempotency record's).
pub const FAR: i64 = 1_000_000;

/// The interned strings, shared by the model and the Lua callbacks.
#[derive(Default)]
pub struct Interner {
    ids: HashMap<Vec<u8>, Val>,
    strings: Vec<Vec<u8>>,
}

impl Interner {
    pub fn id(&mut self, s: &[u8]) -> Val {
        if let Some(&id) = self.ids.get(s) {
            return id;
        }
        let id = Val::try_from(self.strings.len()).expect("too many strings");
        self.strings.push(s.to_vec());
        self.ids.insert(s.to_vec(), id);
        id
    }

    pub fn get(&self, id: Val) -> &[u8] {
        &self.strings[id as usize]
    }

    pub fn text(&self, id: Val) -> String {
        String::from_utf8_lossy(self.get(id)).into_owned()
    }
}

/// A list's elements (a hand-off queue: at most one entry per token).
pub type Entries = Seq<Val, 8>;

/// A sorted set's members (the holders of a key with a capacity): (score, member), kept in
/// order of score, then of member id. A score is a time, relative like every time here: ticks
/// from now, down to 0 (a time in the past, which every script treats as "now or before").
pub type Members = Seq<(i32, Val), 8>;

/// A hash's fields (a counted key's running sum and capacity): (field, value), by field id.
pub type Fields = Seq<(Val, Val), 2>;

/// The keyspace. Keys are kept sorted, so that equal keyspaces compare equal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Db {
    /// (key, value, ticks until it expires: `None` for never within the model).
    pub strings: Seq<(Val, Val, Option<i32>), 4>,
    /// (key, elements, expiry); an empty list does not exist, as in Redis.
    pub lists: Seq<(Val, Entries, Option<i32>), 2>,
    /// (key, members, expiry); an empty sorted set does not exist, as in Redis.
    pub zsets: Seq<(Val, Members, Option<i32>), 1>,
    /// (key, fields, expiry); an empty hash does not exist, as in Redis.
    pub hashes: Seq<(Val, Fields, Option<i32>), 1>,
}

impl Db {
    pub fn string(&self, key: Val) -> Option<(Val, Option<i32>)> {
        self.strings
            .iter()
            .find(|(k, _, _)| *k == key)
            .map(|&(_, v, e)| (v, e))
    }

    pub fn list(&self, key: Val) -> Option<&[Val]> {
        self.lists
            .iter()
            .find(|(k, _, _)| *k == key)
            .map(|(_, l, _)| l.as_slice())
    }

    pub fn list_mut(&mut self, key: Val) -> Option<&mut Entries> {
        self.lists
            .iter_mut()
            .find(|(k, _, _)| *k == key)
            .map(|(_, l, _)| l)
    }

    pub fn zset(&self, key: Val) -> Option<&[(i32, Val)]> {
        self.zsets
            .iter()
            .find(|(k, _, _)| *k == key)
            .map(|(_, m, _)| m.as_slice())
    }

    pub fn zset_mut(&mut self, key: Val) -> Option<&mut Members> {
        self.zsets
            .iter_mut()
            .find(|(k, _, _)| *k == key)
            .map(|(_, m, _)| m)
    }

    pub fn hash(&self, key: Val) -> Option<&[(Val, Val)]> {
        self.hashes
            .iter()
            .find(|(k, _, _)| *k == key)
            .map(|(_, f, _)| f.as_slice())
    }

    /// The hash at `key`, made empty (without expiry) if there is none.
    fn hash_mut(&mut self, key: Val) -> &mut Fields {
        if self.hash(key).is_none() {
            let at = self.hashes.as_slice().partition_point(|(k, ..)| *k < key);
            self.hashes.insert(at, (key, Fields::default(), None));
        }
        self.hashes
            .iter_mut()
            .find(|(k, _, _)| *k == key)
            .map(|(_, f, _)| f)
            .expect("hash")
    }

    /// A member's score, if it is in the sorted set at `key`.
    pub fn score(&self, key: Val, member: Val) -> Option<i32> {
        self.zset(key)?
            .iter()
            .find(|(_, m)| *m == member)
            .map(|(s, _)| *s)
    }

    fn exists(&self, key: Val) -> bool {
        self.string(key).is_some()
            || self.list(key).is_some()
            || self.zset(key).is_some()
            || self.hash(key).is_some()
    }

    fn expiry(&self, key: Val) -> Option<Option<i32>> {
        self.string(key)
            .map(|(_, e)| e)
            .or_else(|| self.lists.iter().find(|(k, ..)| *k == key).map(|l| l.2))
            .or_else(|| self.zsets.iter().find(|(k, ..)| *k == key).map(|z| z.2))
            .or_else(|| self.hashes.iter().find(|(k, ..)| *k == key).map(|h| h.2))
    }

    fn set_expiry(&mut self, key: Val, expiry: Option<i32>) {
        for (k, _, e) in self.strings.iter_mut() {
            if *k == key {
                *e = expiry;
            }
        }
        for (k, _, e) in self.lists.iter_mut() {
            if *k == key {
                *e = expiry;
            }
        }
        for (k, _, e) in self.zsets.iter_mut() {
            if *k == key {
                *e = expiry;
            }
        }
        for (k, _, e) in self.hashes.iter_mut() {
            if *k == key {
                *e = expiry;
            }
        }
    }

    fn del(&mut self, key: Val) -> bool {
        let count =
            |db: &Self| db.strings.len() + db.lists.len() + db.zsets.len() + db.hashes.len();
        let before = count(self);
        self.strings.retain(|(k, ..)| *k != key);
        self.lists.retain(|(k, ..)| *k != key);
        self.zsets.retain(|(k, ..)| *k != key);
        self.hashes.retain(|(k, ..)| *k != key);
        before != count(self)
    }

    fn set_string(&mut self, key: Val, value: Val, expiry: Option<i32>) {
        self.del(key);
        let at = self.strings.as_slice().partition_point(|(k, ..)| *k < key);
        self.strings.insert(at, (key, value, expiry));
    }

    /// Drops a list or sorted set left empty, as Redis does.
    fn tidy(&mut self) {
        self.lists.retain(|(_, l, _)| !l.is_empty());
        self.zsets.retain(|(_, m, _)| !m.is_empty());
        self.hashes.retain(|(_, f, _)| !f.is_empty());
    }

    /// One tick passes: every expiry comes one closer; keys that reach it are gone. Scores are
    /// times too: they come one closer, down to 0 (in the past, where no script tells them
    /// apart), and stay until a script removes them, as in Redis.
    pub fn tick(&mut self) {
        for (_, _, e) in self.strings.iter_mut() {
            if let Some(e) = e {
                *e -= 1;
            }
        }
        for (_, _, e) in self.lists.iter_mut() {
            if let Some(e) = e {
                *e -= 1;
            }
        }
        for (_, members, e) in self.zsets.iter_mut() {
            if let Some(e) = e {
                *e -= 1;
            }
            for (score, _) in members.iter_mut() {
                *score = (*score - 1).max(0);
            }
            sort_members(members);
        }
        for (_, _, e) in self.hashes.iter_mut() {
            if let Some(e) = e {
                *e -= 1;
            }
        }
        self.hashes.retain(|(_, _, e)| e.is_none_or(|e| e > 0));
        self.strings.retain(|(_, _, e)| e.is_none_or(|e| e > 0));
        self.lists.retain(|(_, _, e)| e.is_none_or(|e| e > 0));
        self.zsets.retain(|(_, _, e)| e.is_none_or(|e| e > 0));
    }
}

/// Members in their stored order: by score, then by member id (so that equal sets compare
/// equal; `ZRANGE` answers in Redis's order, by score then bytes).
pub fn sort_members(members: &mut Members) {
    members.as_mut_slice().sort_unstable();
}

/// A Redis reply.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Reply {
    Nil,
    Int(i64),
    Bulk(Vec<u8>),
    Status(String),
    Array(Vec<Reply>),
}

impl Reply {
    pub fn int(&self) -> Option<i64> {
        match self {
            Self::Int(n) => Some(*n),
            _ => None,
        }
    }
}

/// What one script call did: its reply, the keyspace after it, and what it published.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub reply: Reply,
    pub db: Db,
    /// (channel, payload), in the order published.
    pub published: Vec<(Val, Val)>,
    /// The commands the script sent, for traces.
    pub log: Rc<str>,
}

/// The state a running script's `redis.call` works on.
struct Call {
    db: Db,
    /// Channels with a subscriber.
    subscribed: Vec<Val>,
    published: Vec<(Val, Val)>,
    log: String,
}

/// A script run's inputs: (script, keys, arguments, keyspace, channels with a subscriber).
pub type MemoKey = (usize, Vec<Val>, Vec<Val>, Db, Vec<Val>);

/// Runs scripts against a [`Db`].
pub struct Redis {
    lua: Lua,
    interner: Rc<RefCell<Interner>>,
    call: Rc<RefCell<Option<Call>>>,
    scripts: Vec<(String, String, Function)>,
    /// A script call is a function of its inputs: each distinct one runs once.
    memo: HashMap<MemoKey, Outcome>,
    pub runs: u64,
}

impl Redis {
    pub fn new(interner: Rc<RefCell<Interner>>) -> Self {
        let lua = Lua::new();
        let call: Rc<RefCell<Option<Call>>> = Rc::default();
        let redis = lua.create_table().expect("lua table");
        // `redis.call` raises a command's error; `redis.pcall` answers it as `{err = ..}`.
        for (name, raises) in [("call", true), ("pcall", false)] {
            let (c, i) = (Rc::clone(&call), Rc::clone(&interner));
            let f = lua
                .create_function(move |lua, args: MultiValue| {
                    let args = args
                        .iter()
                        .map(argument)
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(mlua::Error::RuntimeError)?;
                    let mut call = c.borrow_mut();
                    let call = call.as_mut().expect("redis.call outside a script");
                    match command(call, &mut i.borrow_mut(), &args) {
                        Ok(reply) => to_lua(lua, &reply),
                        Err(error) if raises => Err(mlua::Error::RuntimeError(error)),
                        Err(error) => {
                            let t = lua.create_table()?;
                            t.raw_set("err", error)?;
                            Ok(Value::Table(t))
                        }
                    }
                })
                .expect("redis.call");
            redis.set(name, f).expect("redis.call");
        }
        lua.globals().set("redis", redis).expect("redis global");
        Self {
            lua,
            interner,
            call,
            scripts: Vec::new(),
            memo: HashMap::new(),
            runs: 0,
        }
    }

    /// Compiles `source` (panics on a syntax error) and returns its handle.
    pub fn load(&mut self, name: &str, source: &str) -> usize {
        let f = self
            .lua
            .load(source)
            .set_name(name)
            .into_function()
            .unwrap_or_else(|e| panic!("script {name} does not compile: {e}"));
        self.scripts.push((name.to_owned(), source.to_owned(), f));
        self.scripts.len() - 1
    }

    pub fn script_name(&self, script: usize) -> &str {
        &self.scripts[script].0
    }

    pub fn script_source(&self, script: usize) -> &str {
        &self.scripts[script].1
    }

    /// Every distinct script run so far: its inputs and what it did.
    pub fn runs(&self) -> impl Iterator<Item = (&MemoKey, &Outcome)> {
        self.memo.iter()
    }

    /// Runs `script` with `keys` and `args` on `db`, with `subscribed` channels listening: one
    /// `EVALSHA`. A script error is a model failure (panics), as it would be a failed request.
    pub fn run(
        &mut self,
        script: usize,
        keys: &[Val],
        args: &[Val],
        db: &Db,
        subscribed: &[Val],
    ) -> Outcome {
        let memo_key: MemoKey = (
            script,
            keys.to_vec(),
            args.to_vec(),
            *db,
            subscribed.to_vec(),
        );
        if let Some(outcome) = self.memo.get(&memo_key) {
            return outcome.clone();
        }
        self.runs += 1;
        *self.call.borrow_mut() = Some(Call {
            db: *db,
            subscribed: subscribed.to_vec(),
            published: Vec::new(),
            log: String::new(),
        });
        let table = |vals: &[Val]| {
            let t = self.lua.create_table().expect("lua table");
            let interner = self.interner.borrow();
            for (n, v) in vals.iter().enumerate() {
                let s = self
                    .lua
                    .create_string(interner.get(*v))
                    .expect("lua string");
                t.raw_set(n + 1, s).expect("lua table");
            }
            t
        };
        let (k, a) = (table(keys), table(args));
        let globals = self.lua.globals();
        globals.set("KEYS", k).expect("KEYS");
        globals.set("ARGV", a).expect("ARGV");
        let (name, _, f) = &self.scripts[script];
        let result = f.call::<Value>(());
        let call = self.call.borrow_mut().take().expect("script state");
        let value = result.unwrap_or_else(|e| panic!("script {name} failed: {e}"));
        let reply = from_lua(&value).unwrap_or_else(|e| panic!("script {name}: {e}"));
        let mut db = call.db;
        db.tidy();
        let outcome = Outcome {
            reply,
            db,
            published: call.published,
            log: Rc::from(call.log),
        };
        self.memo.insert(memo_key, outcome.clone());
        outcome
    }
}

/// A `redis.call` argument, converted as Redis converts it: strings as they are, numbers in
/// their shortest decimal form; anything else is an error.
fn argument(v: &Value) -> Result<Vec<u8>, String> {
    match v {
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Integer(n) => Ok(n.to_string().into_bytes()),
        Value::Number(n) if n.fract() == 0.0 && n.abs() < 1e15 => {
            Ok(format!("{}", *n as i64).into_bytes())
        }
        Value::Number(n) => Ok(format!("{n}").into_bytes()),
        other => Err(format!(
            "Lua redis lib command arguments must be strings or integers, got {}",
            other.type_name()
        )),
    }
}

fn to_lua(lua: &Lua, reply: &Reply) -> mlua::Result<Value> {
    Ok(match reply {
        // A nil bulk reply is `false` in Redis's Lua.
        Reply::Nil => Value::Boolean(false),
        Reply::Int(n) => Value::Number(*n as f64),
        Reply::Bulk(b) => Value::String(lua.create_string(b)?),
        Reply::Status(s) => {
            let t = lua.create_table()?;
            t.raw_set("ok", s.as_str())?;
            Value::Table(t)
        }
        Reply::Array(items) => {
            let t = lua.create_table()?;
            for (n, item) in items.iter().enumerate() {
                t.raw_set(n + 1, to_lua(lua, item)?)?;
            }
            Value::Table(t)
        }
    })
}

/// A script's return value, converted as Redis converts it.
fn from_lua(v: &Value) -> Result<Reply, String> {
    Ok(match v {
        Value::Nil | Value::Boolean(false) => Reply::Nil,
        Value::Boolean(true) => Reply::Int(1),
        Value::Integer(n) => Reply::Int(*n),
        // Redis truncates Lua numbers to integers.
        Value::Number(n) => Reply::Int(n.trunc() as i64),
        Value::String(s) => Reply::Bulk(s.as_bytes().to_vec()),
        Value::Table(t) => {
            if let Ok(Value::String(s)) = t.raw_get::<Value>("ok") {
                return Ok(Reply::Status(s.to_string_lossy()));
            }
            if let Ok(Value::String(s)) = t.raw_get::<Value>("err") {
                return Err(format!("error reply {}", s.to_string_lossy()));
            }
            let mut items = Vec::new();
            for n in 1.. {
                let item: Value = t.raw_get(n).map_err(|e| e.to_string())?;
                if item.is_nil() {
                    break;
                }
                items.push(from_lua(&item)?);
            }
            Reply::Array(items)
        }
        other => return Err(format!("unexpected script result {}", other.type_name())),
    })
}

fn int(arg: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(arg)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| "ERR value is not an integer or out of range".to_owned())
}

/// Ticks from now for a `PX`/`PEXPIRE` of `ms`: `None` when beyond the model's horizon.
fn expiry(ms: i64) -> Option<i32> {
    (ms < FAR).then(|| i32::try_from(ms).expect("expiry"))
}

/// One command, on the running script's keyspace.
fn command(call: &mut Call, interner: &mut Interner, args: &[Vec<u8>]) -> Result<Reply, String> {
    let name = args
        .first()
        .map(|n| String::from_utf8_lossy(n).to_ascii_uppercase())
        .ok_or("ERR wrong number of arguments")?;
    let arity = |n: usize| {
        if args.len() < n {
            Err(format!("ERR wrong number of arguments for '{name}'"))
        } else {
            Ok(())
        }
    };
    let db = &mut call.db;
    let reply = match name.as_str() {
        "GET" => {
            arity(2)?;
            let key = interner.id(&args[1]);
            if db.list(key).is_some() || db.zset(key).is_some() || db.hash(key).is_some() {
                return Err("WRONGTYPE".into());
            }
            db.string(key)
                .map_or(Reply::Nil, |(v, _)| Reply::Bulk(interner.get(v).to_vec()))
        }
        "SET" => {
            arity(3)?;
            let (key, value) = (interner.id(&args[1]), interner.id(&args[2]));
            let (mut nx, mut px) = (false, None);
            let mut rest = args[3..].iter();
            while let Some(opt) = rest.next() {
                match String::from_utf8_lossy(opt).to_ascii_uppercase().as_str() {
                    "NX" => nx = true,
                    "PX" => {
                        let ms = int(rest.next().ok_or("ERR syntax error")?)?;
                        if ms <= 0 {
                            return Err("ERR invalid expire time in 'set' command".into());
                        }
                        px = Some(ms);
                    }
                    other => return Err(format!("model Redis: SET option {other} not modelled")),
                }
            }
            if nx && db.exists(key) {
                Reply::Nil
            } else {
                db.set_string(key, value, px.and_then(expiry));
                Reply::Status("OK".into())
            }
        }
        "DEL" => {
            arity(2)?;
            let n = args[1..].iter().filter(|k| db.del(interner.id(k))).count();
            Reply::Int(n as i64)
        }
        "INCRBY" | "DECRBY" => {
            arity(3)?;
            let key = interner.id(&args[1]);
            if db.list(key).is_some() || db.zset(key).is_some() || db.hash(key).is_some() {
                return Err("WRONGTYPE".into());
            }
            let by = int(&args[2])?;
            let (before, expires) = match db.string(key) {
                Some((v, e)) => (
                    int(interner.get(v)).map_err(|_| "ERR value is not an integer")?,
                    e,
                ),
                None => (0, None),
            };
            let after = if name == "INCRBY" {
                before + by
            } else {
                before - by
            };
            let value = interner.id(after.to_string().as_bytes());
            db.set_string(key, value, expires);
            Reply::Int(after)
        }
        "PEXPIRE" => {
            arity(3)?;
            let (key, ms) = (interner.id(&args[1]), int(&args[2])?);
            if !db.exists(key) {
                Reply::Int(0)
            } else if ms <= 0 {
                db.del(key);
                Reply::Int(1)
            } else {
                db.set_expiry(key, expiry(ms));
                Reply::Int(1)
            }
        }
        "PTTL" => {
            arity(2)?;
            match db.expiry(interner.id(&args[1])) {
                None => Reply::Int(-2),
                Some(None) => Reply::Int(-1),
                Some(Some(e)) => Reply::Int(i64::from(e)),
            }
        }
        "LLEN" => {
            arity(2)?;
            Reply::Int(db.list(interner.id(&args[1])).map_or(0, |l| l.len() as i64))
        }
        "LINDEX" => {
            arity(3)?;
            let (key, at) = (interner.id(&args[1]), int(&args[2])?);
            let list = db.list(key).unwrap_or(&[]);
            let at = if at < 0 { list.len() as i64 + at } else { at };
            usize::try_from(at)
                .ok()
                .and_then(|at| list.get(at))
                .map_or(Reply::Nil, |v| Reply::Bulk(interner.get(*v).to_vec()))
        }
        "LPOP" => {
            arity(2)?;
            let key = interner.id(&args[1]);
            let head = db
                .list_mut(key)
                .filter(|l| !l.is_empty())
                .map(|l| l.remove(0));
            db.tidy();
            head.map_or(Reply::Nil, |v| Reply::Bulk(interner.get(v).to_vec()))
        }
        "RPUSH" => {
            arity(3)?;
            let key = interner.id(&args[1]);
            if db.string(key).is_some() || db.zset(key).is_some() {
                return Err("WRONGTYPE".into());
            }
            let values: Vec<Val> = args[2..].iter().map(|v| interner.id(v)).collect();
            if db.list(key).is_none() {
                let at = db.lists.as_slice().partition_point(|(k, ..)| *k < key);
                db.lists.insert(at, (key, Entries::default(), None));
            }
            let list = db.list_mut(key).expect("list");
            for v in values {
                list.push(v);
            }
            Reply::Int(list.len() as i64)
        }
        "LRANGE" => {
            arity(4)?;
            let key = interner.id(&args[1]);
            let list = db.list(key).unwrap_or(&[]);
            let len = list.len() as i64;
            let norm = |i: i64| if i < 0 { (len + i).max(0) } else { i };
            let (start, stop) = (norm(int(&args[2])?), norm(int(&args[3])?).min(len - 1));
            let items = if start > stop || start >= len {
                Vec::new()
            } else {
                list[start as usize..=stop as usize]
                    .iter()
                    .map(|v| Reply::Bulk(interner.get(*v).to_vec()))
                    .collect()
            };
            Reply::Array(items)
        }
        "LREM" => {
            arity(4)?;
            let (key, count, value) =
                (interner.id(&args[1]), int(&args[2])?, interner.id(&args[3]));
            if count != 0 {
                return Err("model Redis: LREM with a count is not modelled".into());
            }
            let removed = db.list_mut(key).map_or(0, |l| {
                let before = l.len();
                l.retain(|v| *v != value);
                before - l.len()
            });
            db.tidy();
            Reply::Int(removed as i64)
        }
        "TYPE" => {
            arity(2)?;
            let key = interner.id(&args[1]);
            let kind = if db.string(key).is_some() {
                "string"
            } else if db.list(key).is_some() {
                "list"
            } else if db.zset(key).is_some() {
                "zset"
            } else if db.hash(key).is_some() {
                "hash"
            } else {
                "none"
            };
            Reply::Status(kind.into())
        }
        "HGET" | "HMGET" => {
            arity(3)?;
            let key = interner.id(&args[1]);
            hash_of(db, key)?;
            let fields = db.hash(key).unwrap_or(&[]);
            let mut values = args[2..].iter().map(|f| {
                let f = interner.id(f);
                fields
                    .iter()
                    .find(|(k, _)| *k == f)
                    .map_or(Reply::Nil, |(_, v)| Reply::Bulk(interner.get(*v).to_vec()))
            });
            if name == "HGET" {
                if args.len() != 3 {
                    return Err(format!("ERR wrong number of arguments for '{name}'"));
                }
                values.next().expect("one field")
            } else {
                Reply::Array(values.collect())
            }
        }
        "HSET" => {
            if args.len() < 4 || !args.len().is_multiple_of(2) {
                return Err(format!("ERR wrong number of arguments for '{name}'"));
            }
            let key = interner.id(&args[1]);
            hash_of(db, key)?;
            let pairs: Vec<(Val, Val)> = args[2..]
                .chunks(2)
                .map(|p| (interner.id(&p[0]), interner.id(&p[1])))
                .collect();
            let fields = db.hash_mut(key);
            let mut added = 0;
            for (f, v) in pairs {
                match fields.iter_mut().find(|(k, _)| *k == f) {
                    Some(entry) => entry.1 = v,
                    None => {
                        fields.push((f, v));
                        added += 1;
                    }
                }
            }
            fields.as_mut_slice().sort_unstable();
            Reply::Int(added)
        }
        "HINCRBY" => {
            arity(4)?;
            let (key, field) = (interner.id(&args[1]), interner.id(&args[2]));
            hash_of(db, key)?;
            let by = int(&args[3])?;
            let before = match db
                .hash(key)
                .and_then(|f| f.iter().find(|(k, _)| *k == field))
            {
                Some((_, v)) => {
                    int(interner.get(*v)).map_err(|_| "ERR hash value is not an integer")?
                }
                None => 0,
            };
            let after = before + by;
            let value = interner.id(after.to_string().as_bytes());
            let fields = db.hash_mut(key);
            match fields.iter_mut().find(|(k, _)| *k == field) {
                Some(entry) => entry.1 = value,
                None => fields.push((field, value)),
            }
            fields.as_mut_slice().sort_unstable();
            Reply::Int(after)
        }
        "ZADD" => {
            if args.len() != 4 {
                return Err("model Redis: only ZADD key score member is modelled".into());
            }
            let key = interner.id(&args[1]);
            if db.string(key).is_some() || db.list(key).is_some() || db.hash(key).is_some() {
                return Err("WRONGTYPE".into());
            }
            let score = i32::try_from(int(&args[2])?)
                .map_err(|_| "model Redis: a score beyond the horizon")?;
            if score < 0 {
                return Err("model Redis: a score before the model's past".into());
            }
            let member = interner.id(&args[3]);
            if db.zset(key).is_none() {
                let at = db.zsets.as_slice().partition_point(|(k, ..)| *k < key);
                db.zsets.insert(at, (key, Members::default(), None));
            }
            let members = db.zset_mut(key).expect("zset");
            let added = match members.iter_mut().find(|(_, m)| *m == member) {
                Some(entry) => {
                    entry.0 = score;
                    0
                }
                None => {
                    members.push((score, member));
                    1
                }
            };
            sort_members(members);
            Reply::Int(added)
        }
        "ZSCORE" => {
            arity(3)?;
            let (key, member) = (interner.id(&args[1]), interner.id(&args[2]));
            zset_of(db, key)?;
            db.score(key, member)
                .map_or(Reply::Nil, |s| Reply::Bulk(s.to_string().into_bytes()))
        }
        "ZREM" => {
            arity(3)?;
            let key = interner.id(&args[1]);
            zset_of(db, key)?;
            let gone: Vec<Val> = args[2..].iter().map(|m| interner.id(m)).collect();
            let removed = db.zset_mut(key).map_or(0, |members| {
                let before = members.len();
                members.retain(|(_, m)| !gone.contains(m));
                before - members.len()
            });
            db.tidy();
            Reply::Int(removed as i64)
        }
        "ZREMRANGEBYSCORE" => {
            arity(4)?;
            let key = interner.id(&args[1]);
            zset_of(db, key)?;
            let bound = |arg: &[u8]| match arg {
                b"-inf" => Ok(i64::MIN),
                b"+inf" | b"inf" => Ok(i64::MAX),
                other => int(other),
            };
            let (min, max) = (bound(&args[2])?, bound(&args[3])?);
            let removed = db.zset_mut(key).map_or(0, |members| {
                let before = members.len();
                members.retain(|(s, _)| !(min..=max).contains(&i64::from(*s)));
                before - members.len()
            });
            db.tidy();
            Reply::Int(removed as i64)
        }
        "ZCARD" => {
            arity(2)?;
            Reply::Int(zset_of(db, interner.id(&args[1]))?.len() as i64)
        }
        "ZRANGEBYSCORE" => {
            if args.len() != 4 {
                return Err("model Redis: only ZRANGEBYSCORE key min max is modelled".into());
            }
            let key = interner.id(&args[1]);
            let bound = |arg: &[u8]| match arg {
                b"-inf" => Ok(i64::MIN),
                b"+inf" | b"inf" => Ok(i64::MAX),
                other => int(other),
            };
            let (min, max) = (bound(&args[2])?, bound(&args[3])?);
            let mut ordered: Vec<(i32, Vec<u8>)> = zset_of(db, key)?
                .iter()
                .filter(|(s, _)| (min..=max).contains(&i64::from(*s)))
                .map(|(s, m)| (*s, interner.get(*m).to_vec()))
                .collect();
            ordered.sort();
            Reply::Array(ordered.into_iter().map(|(_, m)| Reply::Bulk(m)).collect())
        }
        "ZRANGE" => {
            let with_scores = match args.len() {
                4 => false,
                5 if args[4].eq_ignore_ascii_case(b"WITHSCORES") => true,
                _ => {
                    return Err(
                        "model Redis: only ZRANGE key start stop [WITHSCORES] is modelled".into(),
                    );
                }
            };
            let key = interner.id(&args[1]);
            let members = zset_of(db, key)?;
            // Redis's order: by score, then by the members' bytes.
            let mut ordered: Vec<(i32, Vec<u8>)> = members
                .iter()
                .map(|(s, m)| (*s, interner.get(*m).to_vec()))
                .collect();
            ordered.sort();
            let len = ordered.len() as i64;
            let norm = |i: i64| if i < 0 { (len + i).max(0) } else { i };
            let (start, stop) = (norm(int(&args[2])?), norm(int(&args[3])?).min(len - 1));
            let mut items = Vec::new();
            if start <= stop && start < len {
                for (score, member) in &ordered[start as usize..=stop as usize] {
                    items.push(Reply::Bulk(member.clone()));
                    if with_scores {
                        items.push(Reply::Bulk(score.to_string().into_bytes()));
                    }
                }
            }
            Reply::Array(items)
        }
        "PUBLISH" => {
            arity(3)?;
            let (channel, payload) = (interner.id(&args[1]), interner.id(&args[2]));
            call.published.push((channel, payload));
            Reply::Int(i64::from(call.subscribed.contains(&channel)))
        }
        "PUBSUB" => {
            arity(2)?;
            if !args[1].eq_ignore_ascii_case(b"NUMSUB") {
                return Err("model Redis: only PUBSUB NUMSUB is modelled".into());
            }
            let mut items = Vec::new();
            for channel in &args[2..] {
                let id = interner.id(channel);
                items.push(Reply::Bulk(channel.clone()));
                items.push(Reply::Int(i64::from(call.subscribed.contains(&id))));
            }
            Reply::Array(items)
        }
        // The model's clock is relative (states that differ only by when they happen are one
        // state), so the server clock term of a fencing token is left out: the counter alone
        // orders tokens, as it does whenever it has not expired (24 h after its last use).
        "TIME" => Reply::Array(vec![Reply::Bulk(b"0".to_vec()), Reply::Bulk(b"0".to_vec())]),
        other => return Err(format!("model Redis: command {other} is not modelled")),
    };
    let shown: Vec<String> = args
        .iter()
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let _ = writeln!(call.log, "      {} -> {}", shown.join(" "), show(&reply));
    Ok(reply)
}

/// The members at `key`: none if there is no key, an error if it is not a sorted set.
/// `Ok` when `key` holds a hash or nothing, as a hash command finds it.
fn hash_of(db: &Db, key: Val) -> Result<(), String> {
    if db.string(key).is_some() || db.list(key).is_some() || db.zset(key).is_some() {
        return Err("WRONGTYPE".into());
    }
    Ok(())
}

fn zset_of(db: &Db, key: Val) -> Result<Vec<(i32, Val)>, String> {
    if db.string(key).is_some() || db.list(key).is_some() || db.hash(key).is_some() {
        return Err("WRONGTYPE".into());
    }
    Ok(db.zset(key).map(<[_]>::to_vec).unwrap_or_default())
}

pub fn show(reply: &Reply) -> String {
    match reply {
        Reply::Nil => "nil".into(),
        Reply::Int(n) => n.to_string(),
        Reply::Bulk(b) => format!("{:?}", String::from_utf8_lossy(b)),
        Reply::Status(s) => s.clone(),
        Reply::Array(items) => format!(
            "[{}]",
            items.iter().map(show).collect::<Vec<_>>().join(", ")
        ),
    }
}
