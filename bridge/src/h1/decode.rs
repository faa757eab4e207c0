//! An HTTP/1.1 response as the bridge reads it from its server, without I/O: the head
//! ([`parse_head`]), then the body by its framing ([`BodyDecoder`], RFC 9112 §6.3),
//! chunked bodies with their trailers. Fed whatever the socket gave; the result does
//! not depend on how the bytes were split into reads (the fuzz target checks it).

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

/// The most header fields a head (or a chunked body's trailer section) may have.
pub const MAX_HEADERS: usize = 128;

/// The longest head (and trailer section) read, in bytes.
pub const MAX_HEAD: usize = 64 << 10;

/// The longest chunk-size line (size and extensions).
const MAX_SIZE_LINE: usize = 1024;

/// Why a response cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("malformed response head: {0}")]
    Head(String),
    #[error("response head exceeds {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("bad content-length {0:?}")]
    ContentLength(String),
    #[error("malformed chunked body: {0}")]
    Chunked(&'static str),
    #[error("the server closed the connection {0}")]
    Closed(&'static str),
}

/// How the response's body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body (a `HEAD`'s answer, 1xx, 204, 304).
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunks, then trailers.
    Chunked,
    /// Until the server closes.
    Close,
}

/// A response head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub framing: Framing,
    /// Whether the connection may carry another request after this response.
    pub keep_alive: bool,
}

/// The head at the start of `buf` and its length in bytes, or `None` if it is not all
/// there yet. `head_request`: the request was a `HEAD` (its answer has no body).
pub fn parse_head(buf: &[u8], head_request: bool) -> Result<Option<(Head, usize)>, DecodeError> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut fields);
    let len = match response.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
            return Err(DecodeError::HeadTooLarge);
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(DecodeError::Head(e.to_string())),
    };
    if len > MAX_HEAD {
        return Err(DecodeError::HeadTooLarge);
    }
    let code = response.code.unwrap_or(0);
    let status = StatusCode::from_u16(code)
        .map_err(|_| DecodeError::Head(format!("status {code} out of range")))?;
    let headers = header_map(response.headers)?;
    let http10 = response.version == Some(0);
    let mut close = false;
    let mut keep_alive_token = false;
    for v in headers.get_all(http::header::CONNECTION) {
        for token in v.to_str().unwrap_or("").split(',') {
            let token = token.trim();
            close |= token.eq_ignore_ascii_case("close");
            keep_alive_token |= token.eq_ignore_ascii_case("keep-alive");
        }
    }
    let framing = framing(status, &headers, head_request)?;
    // Both framings: the length is ignored, and the connection is not trusted with
    // another request (RFC 9112 §6.3, 3).
    let ambiguous = headers.contains_key(http::header::TRANSFER_ENCODING)
        && headers.contains_key(http::header::CONTENT_LENGTH);
    let keep_alive =
        !close && (!http10 || keep_alive_token) && framing != Framing::Close && !ambiguous;
    Ok(Some((
        Head {
            status,
            headers,
            framing,
            keep_alive,
        },
        len,
    )))
}

fn header_map(fields: &[httparse::Header<'_>]) -> Result<HeaderMap, DecodeError> {
    let mut headers = HeaderMap::with_capacity(fields.len());
    for f in fields {
        let name = HeaderName::from_bytes(f.name.as_bytes())
            .map_err(|_| DecodeError::Head(format!("bad field name {:?}", f.name)))?;
        let value = HeaderValue::from_bytes(f.value)
            .map_err(|_| DecodeError::Head(format!("bad value of {:?}", f.name)))?;
        headers.append(name, value);
    }
    Ok(headers)
}

fn framing(status: StatusCode, h: &HeaderMap, head_request: bool) -> Result<Framing, DecodeError> {
    if head_request
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Empty);
    }
    if h.contains_key(http::header::TRANSFER_ENCODING) {
        // Chunked only when it is the final coding; any other is read to the close.
        let last = h
            .get_all(http::header::TRANSFER_ENCODING)
            .iter()
            .flat_map(|v| v.to_str().unwrap_or("?").split(','))
            .map(str::trim)
            .rfind(|t| !t.is_empty());
        return Ok(match last {
            Some(t) if t.eq_ignore_ascii_case("chunked") => Framing::Chunked,
            _ => Framing::Close,
        });
    }
    let mut length = None;
    for v in h.get_all(http::header::CONTENT_LENGTH) {
        let text = v.to_str().unwrap_or("?");
        for part in text.split(',') {
            let part = part.trim();
            let n = (!part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
                .then(|| part.parse::<u64>().ok())
                .flatten()
                .ok_or_else(|| DecodeError::ContentLength(text.to_owned()))?;
            if length.is_some_and(|l| l != n) {
                return Err(DecodeError::ContentLength(text.to_owned()));
            }
            length = Some(n);
        }
    }
    Ok(length.map_or(Framing::Close, Framing::Length))
}

/// What the body gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    Data(Bytes),
    Trailers(HeaderMap),
    End,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Length(u64),
    Close,
    /// At a chunk-size line.
    Size,
    /// Inside a chunk: this many bytes left.
    Chunk(u64),
    /// After a chunk's data: its CRLF.
    ChunkEnd,
    /// After the last chunk: trailer fields up to an empty line.
    Trailers,
    Done,
}

/// Decodes one response body.
#[derive(Debug)]
pub struct BodyDecoder {
    state: State,
}

impl BodyDecoder {
    pub fn new(framing: Framing) -> Self {
        let state = match framing {
            Framing::Empty | Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Size,
            Framing::Close => State::Close,
        };
        Self { state }
    }

    /// Whether the body has ended (and [`Event::End`] was or will be given).
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// The next event from what `buf` holds, taking what it uses from `buf`; `None`:
    /// more bytes are needed.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Event>, DecodeError> {
        loop {
            match self.state {
                State::Done => return Ok(Some(Event::End)),
                State::Length(left) => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    let n = (buf.len() as u64).min(left) as usize;
                    self.state = match left - n as u64 {
                        0 => State::Done,
                        rest => State::Length(rest),
                    };
                    return Ok(Some(Event::Data(buf.split_to(n).freeze())));
                }
                State::Close => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    return Ok(Some(Event::Data(buf.split().freeze())));
                }
                State::Size => {
                    let Some(line) = line_end(buf) else {
                        if buf.len() > MAX_SIZE_LINE {
                            return Err(DecodeError::Chunked("chunk-size line too long"));
                        }
                        return Ok(None);
                    };
                    let size = chunk_size(&buf[..line])?;
                    buf.advance(line + 2);
                    self.state = if size == 0 {
                        State::Trailers
                    } else {
                        State::Chunk(size)
                    };
                }
                State::Chunk(left) => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    let n = (buf.len() as u64).min(left) as usize;
                    self.state = match left - n as u64 {
                        0 => State::ChunkEnd,
                        rest => State::Chunk(rest),
                    };
                    return Ok(Some(Event::Data(buf.split_to(n).freeze())));
                }
                State::ChunkEnd => {
                    if buf.len() < 2 {
                        return Ok(None);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(DecodeError::Chunked("chunk data not followed by CRLF"));
                    }
                    buf.advance(2);
                    self.state = State::Size;
                }
                State::Trailers => {
                    if buf.starts_with(b"\r\n") {
                        buf.advance(2);
                        self.state = State::Done;
                        continue;
                    }
                    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
                    match httparse::parse_headers(buf, &mut fields) {
                        Ok(httparse::Status::Complete((n, fields))) => {
                            let trailers = header_map(fields)
                                .map_err(|_| DecodeError::Chunked("bad trailer field"))?;
                            buf.advance(n);
                            self.state = State::Done;
                            return Ok(Some(Event::Trailers(trailers)));
                        }
                        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
                            return Err(DecodeError::Chunked("trailer section too large"));
                        }
                        Ok(httparse::Status::Partial) => return Ok(None),
                        Err(_) => return Err(DecodeError::Chunked("bad trailer section")),
                    }
                }
            }
        }
    }

    /// The server closed the connection: the end of a body read to the close, an
    /// error for any other that is not done.
    pub fn eof(&mut self) -> Result<Event, DecodeError> {
        match self.state {
            State::Close | State::Done => {
                self.state = State::Done;
                Ok(Event::End)
            }
            _ => Err(DecodeError::Closed("in the middle of the body")),
        }
    }
}

/// Where the CRLF ending the line at the start of `buf` is.
fn line_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2)
        .take(MAX_SIZE_LINE)
        .position(|w| w == b"\r\n")
}

/// The size of a chunk-size line (hex, then optional `;extensions`, which are ignored).
fn chunk_size(line: &[u8]) -> Result<u64, DecodeError> {
    let hex = line
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii_end();
    if hex.is_empty() || hex.len() > 16 {
        return Err(DecodeError::Chunked("bad chunk size"));
    }
    let mut n: u64 = 0;
    for &b in hex {
        let d = (b as char)
            .to_digit(16)
            .ok_or(DecodeError::Chunked("bad chunk size"))?;
        n = n << 4 | u64::from(d);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every event of `body` (after its head) fed in `cut`-byte reads.
    fn events(framing: Framing, body: &[u8], cut: usize) -> Result<Vec<Event>, DecodeError> {
        let mut d = BodyDecoder::new(framing);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut chunks = body.chunks(cut.max(1));
        loop {
            match d.decode(&mut buf)? {
                Some(Event::End) => {
                    out.push(Event::End);
                    return Ok(out);
                }
                Some(e) => out.push(e),
                None => match chunks.next() {
                    Some(c) => buf.extend_from_slice(c),
                    None => {
                        out.push(d.eof()?);
                        return Ok(out);
                    }
                },
            }
        }
    }

    /// The data of `events` joined, and their trailers.
    fn joined(events: &[Event]) -> (Vec<u8>, Option<HeaderMap>) {
        let mut data = Vec::new();
        let mut trailers = None;
        for e in events {
            match e {
                Event::Data(d) => data.extend_from_slice(d),
                Event::Trailers(t) => trailers = Some(t.clone()),
                Event::End => {}
            }
        }
        (data, trailers)
    }

    fn head(text: &str) -> Result<Option<(Head, usize)>, DecodeError> {
        parse_head(text.as_bytes(), false)
    }

    #[test]
    fn a_head_says_how_its_body_ends_and_whether_the_connection_stays() {
        let (h, n) = head("HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: 1\r\n\r\nhello")
            .unwrap()
            .unwrap();
        assert_eq!(
            (h.status, h.framing, h.keep_alive, n),
            (StatusCode::OK, Framing::Length(5), true, 46)
        );
        assert_eq!(h.headers["x-a"], "1");
        let (h, _) = head("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(h.framing, Framing::Chunked);
        // Read to the close: never reused.
        let (h, _) = head("HTTP/1.1 200 OK\r\n\r\n").unwrap().unwrap();
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
        let (h, _) = head("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
        let (h, _) = head("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!h.keep_alive);
        // HTTP/1.0 keeps the connection only when it says so.
        let (h, _) = head("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!h.keep_alive);
        let (h, _) = head("HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(h.keep_alive);
        // Both framings: chunked wins and the connection is not reused.
        let (h, _) =
            head("HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n")
                .unwrap()
                .unwrap();
        assert_eq!((h.framing, h.keep_alive), (Framing::Chunked, false));
        // No body: 204, 304, 1xx, and a HEAD's answer whatever its length says.
        for status in ["204 No Content", "304 Not Modified", "100 Continue"] {
            let text = format!("HTTP/1.1 {status}\r\ncontent-length: 9\r\n\r\n");
            assert_eq!(
                head(&text).unwrap().unwrap().0.framing,
                Framing::Empty,
                "{status}"
            );
        }
        let (h, _) = parse_head(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n", true)
            .unwrap()
            .unwrap();
        assert_eq!(h.framing, Framing::Empty);
        // Not all there yet.
        assert!(head("HTTP/1.1 200 OK\r\ncontent-le").unwrap().is_none());
    }

    #[test]
    fn a_bad_head_is_a_precise_error() {
        for (text, want) in [
            ("HTTX/1.1 200 OK\r\n\r\n", "malformed response head"),
            ("HTTP/1.1 2000 OK\r\n\r\n", "malformed response head"),
            (
                "HTTP/1.1 200 OK\r\nbad name: 1\r\n\r\n",
                "malformed response head",
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
                "bad content-length",
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 1, 2\r\n\r\n",
                "bad content-length",
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
                "bad content-length",
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999999\r\n\r\n",
                "bad content-length",
            ),
        ] {
            let e = head(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        // Agreeing lengths are one length.
        let (h, _) = head("HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(h.framing, Framing::Length(2));
        let big = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD));
        assert_eq!(head(&big).unwrap_err(), DecodeError::HeadTooLarge);
        let many: String = (0..MAX_HEADERS + 1)
            .map(|i| format!("x{i}: 1\r\n"))
            .collect();
        let e = head(&format!("HTTP/1.1 200 OK\r\n{many}\r\n")).unwrap_err();
        assert!(matches!(e, DecodeError::Head(_)), "{e}");
    }

    #[test]
    fn bodies_decode_the_same_however_they_arrive() {
        let chunked = b"5;ext=1\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n0\r\ngrpc-status: 0\r\nx-b: 2\r\n\r\n";
        for cut in [1, 2, 3, 7, 64] {
            let e = events(Framing::Chunked, chunked, cut).unwrap();
            let (data, trailers) = joined(&e);
            assert_eq!(data, b"hello 0123456789", "cut {cut}");
            let trailers = trailers.expect("trailers");
            assert_eq!(
                (&trailers["grpc-status"], &trailers["x-b"]),
                (
                    &"0".parse::<HeaderValue>().unwrap(),
                    &"2".parse::<HeaderValue>().unwrap()
                )
            );
            // A length ends at the length; what follows is the next response's.
            let e = events(Framing::Length(5), b"hello", cut).unwrap();
            assert_eq!(joined(&e).0, b"hello");
            let e = events(Framing::Close, b"all of it", cut).unwrap();
            assert_eq!(joined(&e).0, b"all of it");
        }
        // No trailers: the last chunk and an empty line.
        let e = events(Framing::Chunked, b"2\r\nhi\r\n0\r\n\r\n", 1).unwrap();
        assert_eq!(joined(&e), (b"hi".to_vec(), None));
        assert_eq!(events(Framing::Empty, b"", 1).unwrap(), [Event::End]);
    }

    #[test]
    fn a_length_leaves_the_next_responses_bytes() {
        let mut d = BodyDecoder::new(Framing::Length(2));
        let mut buf = BytesMut::from(&b"hiHTTP/1.1"[..]);
        assert_eq!(
            d.decode(&mut buf).unwrap(),
            Some(Event::Data(Bytes::from_static(b"hi")))
        );
        assert_eq!(d.decode(&mut buf).unwrap(), Some(Event::End));
        assert_eq!(&buf[..], b"HTTP/1.1");
    }

    #[test]
    fn a_bad_or_cut_body_is_a_precise_error() {
        for (body, want) in [
            (&b"x\r\n"[..], "bad chunk size"),
            (b"\r\n", "bad chunk size"),
            (b"11111111111111111\r\n", "bad chunk size"),
            (b"2\r\nhiXX", "not followed by CRLF"),
            (b"0\r\nbad field\r\n\r\n", "bad trailer"),
        ] {
            let e = events(Framing::Chunked, body, 3).unwrap_err().to_string();
            assert!(e.contains(want), "{body:?}: {e}");
        }
        let long = vec![b'1'; MAX_SIZE_LINE + 10];
        assert!(events(Framing::Chunked, &long, 64).is_err());
        // Closed early.
        for (framing, body) in [
            (Framing::Length(10), &b"short"[..]),
            (Framing::Chunked, b"5\r\nhel"),
            (Framing::Chunked, b"0\r\nx: 1\r\n"),
        ] {
            let e = events(framing, body, 2).unwrap_err();
            assert!(matches!(e, DecodeError::Closed(_)), "{framing:?}: {e}");
        }
    }
}
