//! The bridge's reading of its server's answers (head, then the body by its
//! framing, chunked with trailers): never a panic, and what it reads does not depend
//! on how the bytes were split into reads.
#![no_main]

use bytes::BytesMut;
use dpumesh_bridge::h1::decode::{BodyDecoder, Event, parse_head};
use libfuzzer_sys::fuzz_target;

/// The head's status and framing, then every body event or the error, reading
/// `stream` in pieces cut at `cuts`.
fn read(stream: &[u8], cuts: &[u8], head_request: bool) -> String {
    let mut pieces = Vec::new();
    let mut rest = stream;
    for &cut in cuts {
        let n = (cut as usize).min(rest.len());
        pieces.push(&rest[..n]);
        rest = &rest[n..];
    }
    pieces.push(rest);
    let mut pieces = pieces.into_iter();
    let mut buf = BytesMut::new();
    let mut out = String::new();
    let head = loop {
        match parse_head(&buf, head_request) {
            Ok(Some((head, n))) => {
                let _ = buf.split_to(n);
                break head;
            }
            Ok(None) => match pieces.next() {
                Some(p) => buf.extend_from_slice(p),
                None => return "cut head".into(),
            },
            Err(e) => return format!("head error {e}"),
        }
    };
    out += &format!("{} {:?} {}\n", head.status, head.framing, head.keep_alive);
    let mut body = BodyDecoder::new(head.framing);
    let mut data = Vec::new();
    loop {
        match body.decode(&mut buf) {
            Ok(Some(Event::Data(d))) => data.extend_from_slice(&d),
            Ok(Some(Event::Trailers(t))) => out += &format!("trailers {t:?}\n"),
            Ok(Some(Event::End)) => break,
            Ok(None) => match pieces.next() {
                Some(p) => buf.extend_from_slice(p),
                None => {
                    if let Err(e) = body.eof() {
                        out += &format!("eof error {e}\n");
                    }
                    break;
                }
            },
            Err(e) => {
                out += &format!("body error {e}\n");
                break;
            }
        }
    }
    out + &format!("data {data:?}")
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let (cuts, stream) = rest.split_at((n as usize % 16).min(rest.len()));
    let head_request = n & 0x80 != 0;
    assert_eq!(
        read(stream, &[], head_request),
        read(stream, cuts, head_request),
        "split at {cuts:?}"
    );
});
