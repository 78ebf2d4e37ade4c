//! Fenced writes in a SQL database (SQLite, through rusqlite), the pattern `tower_lock::fence`
//! describes for data that does not live in Redis: the row keeps the fencing token that last
//! touched it, and every statement that reads or writes it under a lease checks and raises it
//! in the same statement.
//!
//! ```sql
//! -- A fenced read: raises the row's fence, refused (no row) for an older token.
//! UPDATE items SET fence = :token WHERE sku = :sku AND fence <= :token RETURNING stock;
//! -- A fenced write: 1 row applied; 0 rows refused (a newer holder was there).
//! UPDATE items SET stock = :stock, fence = :token WHERE sku = :sku AND fence <= :token;
//! -- Insert-once data needs no fence: the unique constraint refuses a second row.
//! CREATE TABLE payments (account TEXT, idempotency_key TEXT, ..., UNIQUE (account, idempotency_key));
//! ```
//!
//! It plays the interleaving fencing exists for, with two holders in two threads (each its own
//! Tokio runtime, as two processes would have) and one database file: A takes a SKU's lock and
//! reads its stock; A's runtime then stops (its thread blocks, as in a long pause) past its
//! lease's 300 ms TTL; B takes the lock once A's lease has run out, reads and sells one; A
//! resumes and writes the stock it computed before the pause. With the fence, A's write touches
//! no row: it is refused, and the books add up. With `FENCING=off` the statements check no
//! token: A's write lands on top of B's, and B's sale is lost. Then a payment is inserted twice
//! under one idempotency key: the unique constraint refuses the second.
//!
//! ```sh
//! cargo run -p tower-lock-suite --example sql               # fenced: A's stale write is refused
//! FENCING=off cargo run -p tower-lock-suite --example sql   # unfenced: an update is lost
//! ```
//!
//! The locks are in memory (`MemoryStore`, shared by the two threads), or in Redis at
//! `REDIS_URL`. The database is a temporary file, removed at the end. It exits with status 1
//! if, fenced, the books do not add up.
//!
//! SQLite, through rusqlite with its `bundled` feature, because it is a real SQL database that
//! needs no server and no system library (the C library is built from source), so the example
//! runs anywhere `cargo` does; rusqlite is the maintained, most used SQLite binding for Rust.
//! It is a dev-dependency only: the crate itself talks to no SQL database. The statements are
//! the same in PostgreSQL or MySQL (`RETURNING` is PostgreSQL's and SQLite's; MySQL reads the
//! row with `SELECT ... FOR UPDATE` in the transaction instead).

use std::{env, error::Error, path::PathBuf, process::ExitCode, sync::mpsc, time::Duration};

use rusqlite::{Connection, OptionalExtension, params};
use tower_lock::{Locker, MemoryStore, RedisStore, Wait, store::StoreError};

/// The lease's TTL: A's pause lasts well past it.
const TTL: Duration = Duration::from_millis(300);

const SKU: &str = "apple";
const STOCK: i64 = 5;

type BoxError = Box<dyn Error + Send + Sync>;

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Whether the books add up (always, unfenced: that run shows the loss).
fn run() -> Result<bool, BoxError> {
    let fencing = match env::var("FENCING").as_deref() {
        Err(_) | Ok("on") => true,
        Ok("off") => false,
        Ok(other) => return Err(format!("FENCING={other:?} is invalid: use `on` or `off`").into()),
    };
    let locks = match env::var("REDIS_URL").ok().filter(|u| !u.is_empty()) {
        Some(url) => Locks::Redis(url),
        None => Locks::Memory(MemoryStore::new()),
    };
    let db = Database::create()?;
    println!(
        "{SKU}: stock {STOCK}; fencing {}",
        if fencing { "on" } else { "off (FENCING=off)" }
    );

    // A, in a thread and runtime of its own: takes the lock, reads, and is paused.
    let (read_tx, read_rx) = mpsc::channel::<()>();
    let (resume_tx, resume_rx) = mpsc::channel::<()>();
    let a = {
        let (locks, path) = (locks.clone(), db.path.clone());
        std::thread::spawn(move || -> Result<Written, BoxError> {
            runtime().block_on(async move {
                let locker = locks.locker().await?;
                let conn = open(&path)?;
                // Renewals stop at half the TTL, as a pause would stop them (they run on the
                // crate's own thread, which blocking this runtime does not stop).
                let lease = locker
                    .acquire(locker.key("sku", SKU)?)
                    .ttl(TTL)?
                    .max_hold(TTL / 2)?
                    .await?;
                let token = lease.fencing_token();
                let stock = read(&conn, token, fencing)?.ok_or("A's read was refused")?;
                println!("A: took {SKU} (fencing token {token}), read stock {stock}; paused");
                read_tx.send(())?;
                // The pause: A stops until B sold; its lease runs out meanwhile.
                resume_rx.recv()?;
                let written = write(&conn, token, stock - 1, fencing)?;
                match written {
                    Written::Applied => println!("A: resumed; wrote stock {}", stock - 1),
                    Written::Refused { fence } => println!(
                        "A: resumed; its write of stock {} was refused: a newer holder \
                         (fencing token {fence}) touched the row since",
                        stock - 1
                    ),
                }
                drop(lease);
                Ok(written)
            })
        })
    };

    // B, on this thread: takes the lock once A's lease has run out, reads and sells one.
    read_rx.recv()?;
    let b = runtime().block_on(async {
        let locker = locks.locker().await?;
        let conn = db.open()?;
        let lease = locker
            .acquire(locker.key("sku", SKU)?)
            .wait(Wait::constant(Duration::from_millis(20))?.deadline(TTL * 20))
            .await?;
        let token = lease.fencing_token();
        let stock = read(&conn, token, fencing)?.ok_or("B's read was refused")?;
        let written = write(&conn, token, stock - 1, fencing)?;
        println!(
            "B: took {SKU} (fencing token {token}) after A's lease ran out, read stock {stock}, \
             sold one: stock {}",
            stock - 1
        );
        lease.release().await?;
        Ok::<_, BoxError>(written)
    })?;
    resume_tx.send(())?;
    let a = a.join().map_err(|_| "A panicked")??;

    let sold = [a, b].iter().filter(|w| **w == Written::Applied).count() as i64;
    let left: i64 =
        db.open()?
            .query_row("SELECT stock FROM items WHERE sku = ?1", [SKU], |row| {
                row.get(0)
            })?;
    let books = STOCK - left == sold;
    if books {
        println!("stock {left} after {sold} accepted sale(s): no update lost");
    } else {
        println!(
            "stock {left} after {sold} accepted sales: {} update(s) lost",
            sold - (STOCK - left)
        );
    }

    pay_twice(&db.open()?)?;
    Ok(books || !fencing)
}

/// Where the holders take their locks: made on each holder's own runtime.
#[derive(Clone)]
enum Locks {
    Memory(MemoryStore),
    Redis(String),
}

impl Locks {
    async fn locker(&self) -> Result<Locker, StoreError> {
        Ok(match self {
            Self::Memory(store) => Locker::new(store.clone()),
            Self::Redis(url) => Locker::new(RedisStore::connect(url.as_str()).await?),
        })
    }
}

/// A single-threaded runtime: its thread is "the process".
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a Tokio runtime")
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    Applied,
    /// A newer token touched the row: `fence`.
    Refused {
        fence: i64,
    },
}

fn sql_token(token: u64) -> Result<i64, BoxError> {
    Ok(i64::try_from(token)?)
}

/// The stock, read under `token`: fenced, it raises the row's fence, and finds nothing if a
/// newer token touched the row (a stale holder).
fn read(conn: &Connection, token: u64, fencing: bool) -> Result<Option<i64>, BoxError> {
    let stock = if fencing {
        conn.query_row(
            "UPDATE items SET fence = ?2 WHERE sku = ?1 AND fence <= ?2 RETURNING stock",
            params![SKU, sql_token(token)?],
            |row| row.get(0),
        )
    } else {
        conn.query_row("SELECT stock FROM items WHERE sku = ?1", [SKU], |row| {
            row.get(0)
        })
    };
    Ok(stock.optional()?)
}

/// Writes the stock under `token`: fenced, only if no newer token touched the row.
fn write(conn: &Connection, token: u64, stock: i64, fencing: bool) -> Result<Written, BoxError> {
    if !fencing {
        conn.execute(
            "UPDATE items SET stock = ?2 WHERE sku = ?1",
            params![SKU, stock],
        )?;
        return Ok(Written::Applied);
    }
    let rows = conn.execute(
        "UPDATE items SET stock = ?2, fence = ?3 WHERE sku = ?1 AND fence <= ?3",
        params![SKU, stock, sql_token(token)?],
    )?;
    if rows == 1 {
        return Ok(Written::Applied);
    }
    let fence = conn.query_row("SELECT fence FROM items WHERE sku = ?1", [SKU], |row| {
        row.get(0)
    })?;
    Ok(Written::Refused { fence })
}

/// Insert-once data: the second payment under one idempotency key is refused by the unique
/// constraint, fence or not.
fn pay_twice(conn: &Connection) -> Result<(), BoxError> {
    let insert = "INSERT INTO payments (account, idempotency_key, amount) VALUES (?1, ?2, ?3)";
    conn.execute(insert, params!["acct_demo", "pay-0001", 1250])?;
    match conn.execute(insert, params!["acct_demo", "pay-0001", 1250]) {
        Err(rusqlite::Error::SqliteFailure(e, _))
            if e.code == rusqlite::ErrorCode::ConstraintViolation =>
        {
            println!("payments: a second payment under key pay-0001 was refused (UNIQUE)");
            Ok(())
        }
        Ok(_) => Err("the unique constraint let a second payment in".into()),
        Err(error) => Err(error.into()),
    }
}

/// The example's database: a temporary file, removed on drop.
struct Database {
    path: PathBuf,
}

impl Database {
    fn create() -> Result<Self, BoxError> {
        let path = env::temp_dir().join(format!(
            "tower-lock-sql-example-{}-{:016x}.db",
            std::process::id(),
            fastrand::u64(..)
        ));
        let db = Self { path };
        db.open()?.execute_batch(&format!(
            "CREATE TABLE items (
                 sku   TEXT PRIMARY KEY,
                 stock INTEGER NOT NULL,
                 fence INTEGER NOT NULL DEFAULT 0  -- the highest fencing token that touched it
             );
             CREATE TABLE payments (
                 account         TEXT NOT NULL,
                 idempotency_key TEXT NOT NULL,
                 amount          INTEGER NOT NULL,
                 UNIQUE (account, idempotency_key)
             );
             INSERT INTO items (sku, stock) VALUES ('{SKU}', {STOCK});"
        ))?;
        Ok(db)
    }

    /// A connection of its own (each holder has one, as each process would).
    fn open(&self) -> rusqlite::Result<Connection> {
        open(&self.path)
    }
}

fn open(path: &std::path::Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    Ok(conn)
}

impl Drop for Database {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
