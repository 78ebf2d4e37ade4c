//! A small HTTP/1.1 client for a service a test started on loopback (see
//! [`Process`](crate::process::Process)): keep-alive, `Content-Length` bodies, no TLS, no
//! chunked encoding; enough to drive a service and read its JSON answers.

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader as AsyncBufReader},
    net::TcpStream,
};

/// One HTTP/1.1 answer.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// Every header, names in lower case, in order.
    pub headers: Vec<(String, String)>,
    /// The body, as long as `Content-Length` said.
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as JSON, or `Null` if it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The first header named `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A keep-alive HTTP/1.1 connection to `127.0.0.1:<port>`, opened at the first request and
/// again after an I/O error.
#[derive(Debug)]
pub struct Http {
    port: u16,
    conn: Option<AsyncBufReader<TcpStream>>,
}

impl Http {
    /// A client for `127.0.0.1:port` (connects at the first request).
    pub fn new(port: u16) -> Self {
        Self { port, conn: None }
    }

    /// Sends one request and reads its answer; an I/O error closes the connection.
    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> std::io::Result<Reply> {
        self.request_with(method, path, body, &[]).await
    }

    /// [`request`](Self::request) with more headers (`name: value`, each as given).
    pub async fn request_with(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> std::io::Result<Reply> {
        let result = self.try_request(method, path, body, headers).await;
        if result.is_err() {
            self.conn = None;
        }
        result
    }

    async fn try_request(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> std::io::Result<Reply> {
        if self.conn.is_none() {
            let stream = TcpStream::connect(("127.0.0.1", self.port)).await?;
            stream.set_nodelay(true)?;
            self.conn = Some(AsyncBufReader::new(stream));
        }
        let conn = self.conn.as_mut().unwrap();
        let body = body.unwrap_or("");
        let extra: String = headers
            .iter()
            .map(|(name, value)| format!("{name}: {value}\r\n"))
            .collect();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
             {extra}content-length: {}\r\n\r\n{body}",
            body.len()
        );
        conn.get_mut().write_all(head.as_bytes()).await?;
        read_reply(conn).await
    }
}

fn bad(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_owned())
}

/// Reads a status line, headers and a `Content-Length` body.
async fn read_reply(conn: &mut AsyncBufReader<TcpStream>) -> std::io::Result<Reply> {
    let mut line = String::new();
    if conn.read_line(&mut line).await? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    let status = line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if conn.read_line(&mut line).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let trimmed = line.trim_end();
        if trimmed.is_empty() {
            break;
        }
        let (name, value) = trimmed.split_once(':').ok_or_else(|| bad("bad header"))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let len: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    conn.read_exact(&mut body).await?;
    Ok(Reply {
        status,
        headers,
        body,
    })
}
