//! The README's demo ("The demo": `LOCK_WAIT_MS=0 cargo run --example inventory` and its curl
//! commands), run against the real `inventory` example, compared with the README's transcript
//! line for line, so that the two cannot drift apart. Only the `date` headers, the port and the
//! fencing token (the clock when the lock was taken) differ from run to run.

use crate::instances;

use std::time::{Duration, Instant};

use instances::Instance;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// The fenced `console` blocks of the README's "The demo" section.
fn readme_demo_blocks() -> Vec<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("read README.md");
    let section = readme
        .split("\n## The demo\n")
        .nth(1)
        .expect("README.md has a \"## The demo\" section");
    let section = section.split("\n## ").next().unwrap_or(section);
    section
        .split("```console\n")
        .skip(1)
        .map(|block| {
            block
                .split("```")
                .next()
                .expect("a closed code block")
                .to_owned()
        })
        .collect()
}

/// One request as curl sends it; the raw answer: its head (status line and headers, as sent)
/// and its body.
async fn exchange(port: u16, method: &str, path: &str, json: Option<&str>) -> (String, String) {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost:3000\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\n"
    );
    if let Some(json) = json {
        request += &format!(
            "content-type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
            json.len()
        );
    } else {
        request += "\r\n";
    }
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let (head, body_start) = loop {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "connection closed mid-answer: {raw:?}");
        raw.extend_from_slice(&buf[..n]);
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break (String::from_utf8(raw[..end + 4].to_vec()).unwrap(), end + 4);
        }
    };
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .expect("a content-length")
        .trim()
        .parse()
        .unwrap();
    while raw.len() < body_start + len {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "connection closed mid-body");
        raw.extend_from_slice(&buf[..n]);
    }
    let body = String::from_utf8(raw[body_start..body_start + len].to_vec()).unwrap();
    (head, body)
}

/// What `curl -s -w '\n'` prints: the body and a newline; with `-i`, the head first (a
/// terminal shows its CRLFs as line ends).
fn curl_output((head, body): &(String, String), include_head: bool) -> String {
    let head = if include_head {
        head.replace("\r\n", "\n")
    } else {
        String::new()
    };
    format!("{head}{body}\n")
}

/// Replaces every `date` header's value and every fencing token (the clock in µs when the lock
/// was taken): the parts of the transcript that change.
fn without_dates(text: &str) -> String {
    let token = "\"fencing_token\":";
    text.lines()
        .map(|line| match line.strip_prefix("date: ") {
            Some(_) => "date: <date>".to_owned(),
            None => match line.find(token) {
                Some(at) => {
                    let start = at + token.len();
                    let digits = line[start..].bytes().take_while(u8::is_ascii_digit).count();
                    format!("{}<token>{}", &line[..start], &line[start + digits..])
                }
                None => line.to_owned(),
            },
        })
        .map(|line| line + "\n")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_demo_is_what_the_program_prints() {
    let blocks = readme_demo_blocks();
    assert_eq!(blocks.len(), 2, "the demo has a server and a client block");
    let (server, client) = (&blocks[0], &blocks[1]);

    // An empty REDIS_URL is no REDIS_URL: the in-memory store, as in the README.
    let instance = Instance::start("", &[("LOCK_WAIT_MS", "0")]);
    let port = instance.port;

    let put = "/items/apple";
    let purchase = "/items/apple/purchase?work_ms=300";
    let stocked = exchange(port, "PUT", put, Some(r#"{"stock": 5}"#)).await;
    // The first purchase in the background; the second 100 ms later, while the first holds
    // the lock; each printed when it is answered.
    let first = tokio::spawn(async move {
        let answer = exchange(port, "POST", purchase, None).await;
        (answer, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = exchange(port, "POST", purchase, None).await;
    let second_at = Instant::now();
    let (first, first_at) = first.await.unwrap();
    let mut purchases = [
        (second_at, curl_output(&second, true)),
        (first_at, curl_output(&first, false)),
    ];
    purchases.sort_by_key(|(at, _)| *at);
    let after = exchange(port, "GET", put, None).await;

    let transcript = [
        "$ curl -s -w '\\n' -X PUT localhost:3000/items/apple -H 'content-type: application/json' -d '{\"stock\": 5}'\n".to_owned(),
        curl_output(&stocked, false),
        "$ curl -s -w '\\n' -X POST 'localhost:3000/items/apple/purchase?work_ms=300' & sleep 0.1\n".to_owned(),
        "$ curl -s -i -w '\\n' -X POST 'localhost:3000/items/apple/purchase?work_ms=300'; wait\n".to_owned(),
        purchases[0].1.clone(),
        purchases[1].1.clone(),
        "$ curl -s -w '\\n' localhost:3000/items/apple\n".to_owned(),
        curl_output(&after, false),
    ]
    .concat();
    assert_eq!(
        without_dates(client),
        without_dates(&transcript),
        "the README's demo transcript (left) is not what the program printed (right)"
    );

    // The server's own lines, as the README shows them (on the port it ran on here).
    let printed = instance.output();
    let mut lines = server.lines();
    assert_eq!(
        lines.next(),
        Some("$ LOCK_WAIT_MS=0 cargo run --example inventory")
    );
    for line in lines {
        let line = line.replace(":3000", &format!(":{port}"));
        assert!(
            printed.lines().any(|l| l == line),
            "the README shows `{line}`; the program printed:\n{printed}"
        );
    }
    instance.assert_no_panic();
}
