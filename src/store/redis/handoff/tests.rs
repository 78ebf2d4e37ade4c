//! Tests of the parent module.

use super::*;

/// A hand-off can reach the process before the attempt's answer does: the waiter registers
/// after, and still hears it.
#[tokio::test]
async fn a_message_before_registration_is_kept_for_the_waiter() {
    let handoff = Handoff::new(Client::open("redis://127.0.0.1:1/").unwrap());
    let token = Token::generate().unwrap();
    let id: [u8; TOKEN_LEN] = token.as_bytes().try_into().unwrap();
    let now = Instant::now();
    let granted = Signal::Granted {
        fencing_token: 7,
        valid_until: now + Duration::from_secs(1),
    };
    {
        let mut registry = handoff.waiters.lock().unwrap();
        registry.deliver(id, granted, now);
        // A later "next" does not replace the grant.
        registry.deliver(
            id,
            Signal::Next {
                within: Duration::from_secs(1),
            },
            now,
        );
    }
    assert!(!handoff.is_registered(&token));
    let mut watch = handoff.register(&token, handoff.epoch(), false).unwrap();
    assert!(handoff.is_registered(&token));
    assert_eq!(watch.signal().await, granted);
    drop(watch);
    assert!(!handoff.is_registered(&token));
    assert!(handoff.waiters.lock().unwrap().pending.is_empty());
}

/// A waiter whose attempt was on its way while every registered waiter was told to check
/// again (its answer, "queued", arrived after the subscription broke and came back) is told
/// to check again when it registers: the release in between may have dropped its entry. One
/// whose attempt was sent after that is not.
#[tokio::test]
async fn a_waiter_registered_after_a_resubscription_checks_again() {
    let handoff = Handoff::new(Client::open("redis://127.0.0.1:1/").unwrap());
    let (late, settled) = (Token::generate().unwrap(), Token::generate().unwrap());
    let since = handoff.epoch();
    // The subscription breaks, then comes back: two rounds of "check again".
    handoff.waiters.lock().unwrap().retry_all();
    handoff.waiters.lock().unwrap().retry_all();
    let mut watch = handoff.register(&late, since, false).unwrap();
    assert_eq!(watch.signal().await, Signal::Retry);
    let mut watch = handoff.register(&settled, handoff.epoch(), false).unwrap();
    let quiet = tokio::time::timeout(Duration::from_millis(20), watch.signal()).await;
    assert!(quiet.is_err(), "told to check again for nothing: {quiet:?}");
}

/// A subscription up for a target the store has since left (a failover, a moved address)
/// does not count, even if it reports itself up late: waiters do not queue until the
/// subscription is up on the new one. Resubscriptions are at most one a second.
#[test]
fn a_subscription_to_a_server_the_store_left_does_not_count() {
    let handoff = Handoff::new(Client::open("redis://127.0.0.1:1/").unwrap());
    assert!(!handoff.is_live());
    handoff.bump(None);
    let first = handoff.state.generation.load(Ordering::Acquire);
    handoff.state.live.store(first, Ordering::Release);
    assert!(handoff.is_live());
    handoff.bump(Some(Client::open("redis://127.0.0.1:2/").unwrap()));
    assert!(!handoff.is_live());
    handoff.state.live.store(first, Ordering::Release);
    assert!(!handoff.is_live());
    assert!(handoff.resubscribe());
    assert!(!handoff.resubscribe(), "resubscribed twice within a second");
}

/// The subscriber does not run on the runtime that started it: started from a
/// current-thread runtime whose `block_on` then returned (nothing drives its tasks any
/// more), it still tries to subscribe, again and again, on its own thread.
#[test]
fn the_subscriber_runs_whatever_becomes_of_the_runtime_that_started_it() {
    // Nothing listens on port 1: each subscription attempt fails at once, and settles.
    let handoff = Handoff::new(Client::open("redis://127.0.0.1:1/").unwrap());
    let idle = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    idle.block_on(async { handoff.ensure_running() });
    let generation = handoff.state.generation.load(Ordering::Acquire);
    assert!(generation > 0);
    let started = std::time::Instant::now();
    while *handoff.settled.borrow() < generation {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the subscriber never tried: it waits for the idle runtime"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(handoff.state.running.load(Ordering::Acquire));
    drop(idle);
    assert!(handoff.state.running.load(Ordering::Acquire));
}

#[test]
fn stamps_are_16_hex_digits_and_increase() {
    let a = stamp();
    std::thread::sleep(Duration::from_millis(2));
    let b = stamp();
    assert!(a.iter().all(u8::is_ascii_hexdigit));
    assert!(b > a);
}

#[test]
fn parses_hand_off_messages() {
    let now = Instant::now();
    let token = "0123456789abcdef0123456789abcdef";
    let g = format!("g{token}{:016x}1000:1234567", 5_000_000u64);
    let (id, signal) = parse(g.as_bytes(), now).unwrap();
    assert_eq!(&id, token.as_bytes());
    let Signal::Granted {
        fencing_token,
        valid_until,
    } = signal
    else {
        panic!("{signal:?}")
    };
    assert_eq!(fencing_token, 1_234_567);
    assert_eq!(
        valid_until,
        base() + Duration::from_millis(5000 + 1000 - 10 - 2)
    );
    let n = format!("n{token}{:016x}250", 7u64);
    assert_eq!(
        parse(n.as_bytes(), now).unwrap().1,
        Signal::Next {
            within: Duration::from_millis(250)
        }
    );
    for bad in [
        "",
        "g",
        "x0123",
        &format!("g{token}zz"),
        &format!("n{token}{:016x}x", 1),
    ] {
        assert!(parse(bad.as_bytes(), now).is_none(), "{bad:?}");
    }
}
