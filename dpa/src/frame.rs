//! Frames: what the ingress and the DPU proxies say to each other over the
//! fabric. A request names where its body waits (the receiving proxy RDMA-READs it
//! into the destination pod's RX body pool once policy allowed it, so a denied body
//! never crosses the network) and where the response body goes (the answering proxy
//! RDMA-WRITEs it there before it SENDs the response head, which RC ordering makes
//! visible only after the body). Heads travel inline: they are small and the proxy
//! needs them anyway.
//!
//! A streamed response (the body in parts, each forwarded as it comes, of any total
//! size) answers `Stream`; its parts follow as `Chunk`s, each written first into one
//! *window* of the reply buffer ([`StreamWindows`]: the buffer cut into windows of up
//! to [`STREAM_WINDOW`] bytes). The receiver hands windows back with `Window` once it
//! passed their bytes on, so the sender never has more in flight than the buffer
//! holds: back-pressure from the slowest reader to the writer, with no memory growing
//! on the way. `Cancel` says the receiver gave the stream up (its client left).
//!
//! A streamed request (`stream` in its flags: an upload, a gRPC client stream) works
//! the same way the other way round: `body` is then the requester's whole request
//! buffer, cut into windows by the same rule; the requester writes a part into a free
//! window and announces it with `UpChunk`; the responder RDMA-READs it and hands the
//! window back with `UpWindow` once the read is done; `UpCancel` says the responder
//! wants no more of the body (the service answered, left or was never reached), and
//! after it nothing of the requester's buffer is read. Every stream frame names the
//! requester's exchange id, whichever side sends it.
//!
//! ```text
//! frame:    magic "DM" | version u8 | kind u8 | credits u16 | fields
//! Request:  xid u32 | flags u8 | deadline_ms u32 | body? RemoteBuf | reply RemoteBuf |
//!           head (u32 length + bytes)
//! Response: xid u32 | body: 0 none, 1 written (u32 len), 2 inline (u32 len + bytes),
//!           3 stream | head (u32 length + bytes)
//! Chunk:    xid u32 | window u8 | len u32 | end: 0 more, 1 last, 2 abort |
//!           tail (u32 length + bytes: the trailers' head when last, why when abort)
//! Window:   xid u32 | count u8
//! Cancel:   xid u32
//! UpChunk, UpWindow, UpCancel: as Chunk, Window and Cancel (the request's body)
//! Credit:   (nothing: the frame's credits field is the message)
//! RemoteBuf: addr u64 | rkey u32 | len u32
//! ```

use crate::fabric::RemoteAddr;

/// Frame magic.
pub const MAGIC: [u8; 2] = *b"DM";
/// The protocol version written and read (2: streamed responses; 3: streamed
/// requests).
pub const FRAME_VERSION: u8 = 3;
/// The largest frame (a head of up to 64 KiB plus the fixed fields).
pub const MAX_FRAME: usize = (64 << 10) + 256;

const REQUEST: u8 = 1;
const RESPONSE: u8 = 2;
const CREDIT: u8 = 3;
const CHUNK: u8 = 4;
const WINDOW: u8 = 5;
const CANCEL: u8 = 6;
const UP_CHUNK: u8 = 7;
const UP_WINDOW: u8 = 8;
const UP_CANCEL: u8 = 9;

/// The largest window of a stream's reply buffer: a part larger than this crosses
/// in several windows.
pub const STREAM_WINDOW: u32 = 256 << 10;
/// The most windows a stream has in flight (so at most 2 MiB per stream).
pub const MAX_STREAM_WINDOWS: u32 = 8;

/// How a reply buffer of `capacity` bytes is cut into windows for a stream: both
/// sides compute it from the request's `reply` length alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamWindows {
    /// Windows (0 when the buffer is empty: such a request cannot be streamed to).
    pub count: u8,
    /// Bytes each.
    pub size: u32,
}

impl StreamWindows {
    /// The windows of a reply buffer of `capacity` bytes.
    pub fn of(capacity: u32) -> Self {
        let size = capacity.min(STREAM_WINDOW);
        let count = capacity
            .checked_div(size)
            .map_or(0, |n| n.min(MAX_STREAM_WINDOWS)) as u8;
        Self { count, size }
    }

    /// Where window `i` starts in the buffer.
    pub fn offset(&self, i: u8) -> u64 {
        u64::from(i) * u64::from(self.size)
    }
}

/// A buffer in the peer's registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteBuf {
    /// Address and key.
    pub at: RemoteAddr,
    /// Bytes (the body's length, or a reply buffer's capacity).
    pub len: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestFlags {
    /// The sending proxy already ran the route's filter chain (a pod's egress call
    /// crossing to another node): the receiver routes without running it again.
    pub policed: bool,
    /// A call made inside the mesh by a node (a filter's HTTP call to a mesh
    /// service), naming its service as the host: it meets that service's own chain.
    /// Without it, a request from a link is one from outside, which only routes let
    /// in. Believed from nodes only.
    pub call: bool,
    /// The body follows in parts (`UpChunk`s) through the windows of `body`, which
    /// is the requester's whole request buffer rather than a body of that length.
    pub stream: bool,
}

/// A request for a service on the receiver's node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The sender's exchange id, echoed in the response.
    pub xid: u32,
    pub flags: RequestFlags,
    /// Milliseconds the sender will wait for the response (0: no deadline).
    pub deadline_ms: u32,
    /// Where the body waits, if there is one.
    pub body: Option<RemoteBuf>,
    /// Where the response body may be written, and how much fits.
    pub reply: RemoteBuf,
    /// The request head (in the head wire form of `dpumesh-head`).
    pub head: Vec<u8>,
}

/// Where a response's body is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResponseBody {
    /// No body.
    None,
    /// Written into the request's reply buffer before this message (this many bytes).
    Written(u32),
    /// Carried in the message (local replies: a few hundred bytes of text).
    Inline(Vec<u8>),
    /// Streamed: [`Chunk`]s follow, through the reply buffer's windows.
    Stream,
}

/// How a stream's part ends it, or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkEnd {
    /// More follows.
    More,
    /// The last part; the trailers' head (wire form, a response head's fields), empty
    /// when there are none.
    Last(Vec<u8>),
    /// The sender gave up (its service failed or left mid-stream): the body is
    /// incomplete, and the receiver must say so to its client, not end it cleanly.
    Abort(String),
}

/// A part of a streamed body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The stream (the request's exchange id).
    pub xid: u32,
    /// The window its bytes were written into (meaningless when `len` is 0).
    pub window: u8,
    /// Bytes in the window.
    pub len: u32,
    pub end: ChunkEnd,
}

/// The answer to a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The request's exchange id.
    pub xid: u32,
    pub body: ResponseBody,
    /// The response head (status and headers, in the head wire form).
    pub head: Vec<u8>,
}

/// One message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Request(Request),
    Response(Response),
    /// Only returns credits.
    Credit,
    /// A part of a streamed response.
    Chunk(Chunk),
    /// The receiver of stream `xid` passed `count` windows on: they may be written
    /// again.
    Window {
        xid: u32,
        count: u8,
    },
    /// The receiver of stream `xid` gave it up.
    Cancel {
        xid: u32,
    },
    /// A part of a streamed request body (`xid` is the requester's).
    UpChunk(Chunk),
    /// The responder read `count` windows of request `xid`'s body: they may be
    /// written again.
    UpWindow {
        xid: u32,
        count: u8,
    },
    /// The responder wants no more of request `xid`'s body; nothing more of the
    /// requester's buffer is read.
    UpCancel {
        xid: u32,
    },
}

/// A frame: a message and the receive credits it returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Receives the sender posted again since its last frame.
    pub credits: u16,
    pub message: Message,
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Ends inside a field.
    #[error("mesh frame truncated in {0}")]
    Truncated(&'static str),
    /// Wrong magic.
    #[error("not a mesh frame (magic {0:02x?})")]
    Magic([u8; 2]),
    /// Another protocol version.
    #[error("mesh protocol version {found} is not supported (this build speaks {FRAME_VERSION})")]
    Version {
        /// The version found.
        found: u8,
    },
    /// Unknown message kind or tag.
    #[error("unknown {what} {tag}")]
    Tag {
        /// The field.
        what: &'static str,
        /// The value found.
        tag: u8,
    },
    /// Bytes after the message.
    #[error("{0} bytes after the end of the frame")]
    Trailing(usize),
    /// Larger than [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
}

fn put_buf(out: &mut Vec<u8>, b: &RemoteBuf) {
    out.extend_from_slice(&b.at.addr.to_le_bytes());
    out.extend_from_slice(&b.at.rkey.to_le_bytes());
    out.extend_from_slice(&b.len.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

impl Frame {
    /// Writes the frame into `out` (cleared first).
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), FrameError> {
        out.clear();
        out.extend_from_slice(&MAGIC);
        out.push(FRAME_VERSION);
        out.push(match self.message {
            Message::Request(_) => REQUEST,
            Message::Response(_) => RESPONSE,
            Message::Credit => CREDIT,
            Message::Chunk(_) => CHUNK,
            Message::Window { .. } => WINDOW,
            Message::Cancel { .. } => CANCEL,
            Message::UpChunk(_) => UP_CHUNK,
            Message::UpWindow { .. } => UP_WINDOW,
            Message::UpCancel { .. } => UP_CANCEL,
        });
        out.extend_from_slice(&self.credits.to_le_bytes());
        match &self.message {
            Message::Request(r) => {
                out.extend_from_slice(&r.xid.to_le_bytes());
                out.push(
                    u8::from(r.flags.policed)
                        | u8::from(r.flags.call) << 1
                        | u8::from(r.flags.stream) << 2,
                );
                out.extend_from_slice(&r.deadline_ms.to_le_bytes());
                match &r.body {
                    None => out.push(0),
                    Some(b) => {
                        out.push(1);
                        put_buf(out, b);
                    }
                }
                put_buf(out, &r.reply);
                put_bytes(out, &r.head);
            }
            Message::Response(r) => {
                out.extend_from_slice(&r.xid.to_le_bytes());
                match &r.body {
                    ResponseBody::None => out.push(0),
                    ResponseBody::Written(n) => {
                        out.push(1);
                        out.extend_from_slice(&n.to_le_bytes());
                    }
                    ResponseBody::Inline(b) => {
                        out.push(2);
                        put_bytes(out, b);
                    }
                    ResponseBody::Stream => out.push(3),
                }
                put_bytes(out, &r.head);
            }
            Message::Credit => {}
            Message::Chunk(c) | Message::UpChunk(c) => {
                out.extend_from_slice(&c.xid.to_le_bytes());
                out.push(c.window);
                out.extend_from_slice(&c.len.to_le_bytes());
                match &c.end {
                    ChunkEnd::More => {
                        out.push(0);
                        put_bytes(out, &[]);
                    }
                    ChunkEnd::Last(trailers) => {
                        out.push(1);
                        put_bytes(out, trailers);
                    }
                    ChunkEnd::Abort(why) => {
                        out.push(2);
                        put_bytes(out, why.as_bytes());
                    }
                }
            }
            Message::Window { xid, count } | Message::UpWindow { xid, count } => {
                out.extend_from_slice(&xid.to_le_bytes());
                out.push(*count);
            }
            Message::Cancel { xid } | Message::UpCancel { xid } => {
                out.extend_from_slice(&xid.to_le_bytes())
            }
        }
        if out.len() > MAX_FRAME {
            return Err(FrameError::TooLarge(out.len()));
        }
        Ok(())
    }

    /// Reads a frame.
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() > MAX_FRAME {
            return Err(FrameError::TooLarge(b.len()));
        }
        let mut r = Reader { b, at: 0 };
        let magic = [r.u8("magic")?, r.u8("magic")?];
        if magic != MAGIC {
            return Err(FrameError::Magic(magic));
        }
        let version = r.u8("version")?;
        if version != FRAME_VERSION {
            return Err(FrameError::Version { found: version });
        }
        let kind = r.u8("kind")?;
        let credits = r.u16("credits")?;
        let message = match kind {
            REQUEST => {
                let xid = r.u32("xid")?;
                let flags = match r.u8("flags")? {
                    bits @ 0..=7 => RequestFlags {
                        policed: bits & 1 != 0,
                        call: bits & 2 != 0,
                        stream: bits & 4 != 0,
                    },
                    tag => return Err(FrameError::Tag { what: "flags", tag }),
                };
                let deadline_ms = r.u32("deadline")?;
                let body = match r.u8("body tag")? {
                    0 => None,
                    1 => Some(r.buf("body")?),
                    tag => {
                        return Err(FrameError::Tag {
                            what: "body tag",
                            tag,
                        });
                    }
                };
                let reply = r.buf("reply")?;
                let head = r.bytes("head")?.to_vec();
                Message::Request(Request {
                    xid,
                    flags,
                    deadline_ms,
                    body,
                    reply,
                    head,
                })
            }
            RESPONSE => {
                let xid = r.u32("xid")?;
                let body = match r.u8("body tag")? {
                    0 => ResponseBody::None,
                    1 => ResponseBody::Written(r.u32("body length")?),
                    2 => ResponseBody::Inline(r.bytes("body")?.to_vec()),
                    3 => ResponseBody::Stream,
                    tag => {
                        return Err(FrameError::Tag {
                            what: "body tag",
                            tag,
                        });
                    }
                };
                let head = r.bytes("head")?.to_vec();
                Message::Response(Response { xid, body, head })
            }
            CREDIT => Message::Credit,
            CHUNK | UP_CHUNK => {
                let xid = r.u32("xid")?;
                let window = r.u8("window")?;
                let len = r.u32("chunk length")?;
                let tag = r.u8("chunk end")?;
                let tail = r.bytes("chunk tail")?;
                let end = match tag {
                    0 if tail.is_empty() => ChunkEnd::More,
                    0 => {
                        return Err(FrameError::Tag {
                            what: "tail of a chunk that does not end",
                            tag,
                        });
                    }
                    1 => ChunkEnd::Last(tail.to_vec()),
                    2 => ChunkEnd::Abort(String::from_utf8_lossy(tail).into_owned()),
                    tag => {
                        return Err(FrameError::Tag {
                            what: "chunk end",
                            tag,
                        });
                    }
                };
                let chunk = Chunk {
                    xid,
                    window,
                    len,
                    end,
                };
                if kind == CHUNK {
                    Message::Chunk(chunk)
                } else {
                    Message::UpChunk(chunk)
                }
            }
            WINDOW => Message::Window {
                xid: r.u32("xid")?,
                count: r.u8("window count")?,
            },
            CANCEL => Message::Cancel { xid: r.u32("xid")? },
            UP_WINDOW => Message::UpWindow {
                xid: r.u32("xid")?,
                count: r.u8("window count")?,
            },
            UP_CANCEL => Message::UpCancel { xid: r.u32("xid")? },
            tag => {
                return Err(FrameError::Tag {
                    what: "message kind",
                    tag,
                });
            }
        };
        match b.len() - r.at {
            0 => Ok(Frame { credits, message }),
            n => Err(FrameError::Trailing(n)),
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, what: &'static str, n: usize) -> Result<&'a [u8], FrameError> {
        let end = self.at.checked_add(n).ok_or(FrameError::Truncated(what))?;
        let s = self
            .b
            .get(self.at..end)
            .ok_or(FrameError::Truncated(what))?;
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, FrameError> {
        Ok(self.take(what, 1)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(
            self.take(what, 2)?.try_into().expect("2"),
        ))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(
            self.take(what, 4)?.try_into().expect("4"),
        ))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(
            self.take(what, 8)?.try_into().expect("8"),
        ))
    }
    fn buf(&mut self, what: &'static str) -> Result<RemoteBuf, FrameError> {
        Ok(RemoteBuf {
            at: RemoteAddr {
                addr: self.u64(what)?,
                rkey: self.u32(what)?,
            },
            len: self.u32(what)?,
        })
    }
    fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], FrameError> {
        let n = self.u32(what)? as usize;
        self.take(what, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames() -> Vec<Frame> {
        let buf = |addr, len| RemoteBuf {
            at: RemoteAddr { addr, rkey: 77 },
            len,
        };
        vec![
            Frame {
                credits: 3,
                message: Message::Request(Request {
                    xid: 9,
                    flags: RequestFlags {
                        policed: true,
                        call: false,
                        stream: false,
                    },
                    deadline_ms: 1500,
                    body: Some(buf(0x1000, 8 << 20)),
                    reply: buf(0x9000, 1 << 20),
                    head: b"head bytes".to_vec(),
                }),
            },
            Frame {
                credits: 0,
                message: Message::Request(Request {
                    xid: u32::MAX,
                    flags: RequestFlags::default(),
                    deadline_ms: 0,
                    body: None,
                    reply: buf(1, 2),
                    head: Vec::new(),
                }),
            },
            Frame {
                credits: 1,
                message: Message::Response(Response {
                    xid: 4,
                    body: ResponseBody::Written(1024),
                    head: b"r".to_vec(),
                }),
            },
            Frame {
                credits: 2,
                message: Message::Response(Response {
                    xid: 5,
                    body: ResponseBody::Inline(b"denied\n".to_vec()),
                    head: Vec::new(),
                }),
            },
            Frame {
                credits: 0,
                message: Message::Response(Response {
                    xid: 6,
                    body: ResponseBody::None,
                    head: b"h".to_vec(),
                }),
            },
            Frame {
                credits: 64,
                message: Message::Credit,
            },
            Frame {
                credits: 0,
                message: Message::Response(Response {
                    xid: 7,
                    body: ResponseBody::Stream,
                    head: b"h".to_vec(),
                }),
            },
            Frame {
                credits: 1,
                message: Message::Chunk(Chunk {
                    xid: 7,
                    window: 3,
                    len: STREAM_WINDOW,
                    end: ChunkEnd::More,
                }),
            },
            Frame {
                credits: 0,
                message: Message::Chunk(Chunk {
                    xid: 7,
                    window: 0,
                    len: 0,
                    end: ChunkEnd::Last(b"trailers".to_vec()),
                }),
            },
            Frame {
                credits: 0,
                message: Message::Chunk(Chunk {
                    xid: 7,
                    window: 1,
                    len: 10,
                    end: ChunkEnd::Abort("the service left".into()),
                }),
            },
            Frame {
                credits: 2,
                message: Message::Window { xid: 7, count: 2 },
            },
            Frame {
                credits: 0,
                message: Message::Cancel { xid: 7 },
            },
            Frame {
                credits: 0,
                message: Message::Request(Request {
                    xid: 8,
                    flags: RequestFlags {
                        policed: false,
                        call: false,
                        stream: true,
                    },
                    deadline_ms: 0,
                    body: Some(buf(0x1000, 8 << 20)),
                    reply: buf(0x9000, 8 << 20),
                    head: b"h".to_vec(),
                }),
            },
            Frame {
                credits: 0,
                message: Message::UpChunk(Chunk {
                    xid: 8,
                    window: 2,
                    len: 100,
                    end: ChunkEnd::More,
                }),
            },
            Frame {
                credits: 0,
                message: Message::UpChunk(Chunk {
                    xid: 8,
                    window: 0,
                    len: 0,
                    end: ChunkEnd::Last(Vec::new()),
                }),
            },
            Frame {
                credits: 0,
                message: Message::UpWindow { xid: 8, count: 1 },
            },
            Frame {
                credits: 0,
                message: Message::UpCancel { xid: 8 },
            },
        ]
    }

    #[test]
    fn every_message_comes_back() {
        let mut out = Vec::new();
        for f in frames() {
            f.encode_into(&mut out).unwrap();
            assert_eq!(Frame::decode(&out).unwrap(), f);
        }
    }

    #[test]
    fn damaged_frames_name_what_is_wrong() {
        let mut out = Vec::new();
        for f in frames() {
            f.encode_into(&mut out).unwrap();
            for cut in 0..out.len() {
                assert!(
                    matches!(Frame::decode(&out[..cut]), Err(FrameError::Truncated(_))),
                    "{f:?} cut at {cut}"
                );
            }
            let mut longer = out.clone();
            longer.push(1);
            assert_eq!(Frame::decode(&longer), Err(FrameError::Trailing(1)));
        }
        frames()[0].encode_into(&mut out).unwrap();
        let mut v = out.clone();
        v[2] = 1;
        assert_eq!(Frame::decode(&v), Err(FrameError::Version { found: 1 }));
        let mut m = out.clone();
        m[0] = b'X';
        assert!(matches!(Frame::decode(&m), Err(FrameError::Magic(_))));
        let mut k = out.clone();
        k[3] = 99;
        assert!(matches!(Frame::decode(&k), Err(FrameError::Tag { .. })));
        // A head length far beyond the frame is a truncation, not an allocation.
        let mut h = vec![b'D', b'M', FRAME_VERSION, RESPONSE, 0, 0, 1, 0, 0, 0, 0];
        h.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(Frame::decode(&h), Err(FrameError::Truncated(_))));
        let big = Frame {
            credits: 0,
            message: Message::Response(Response {
                xid: 1,
                body: ResponseBody::Inline(vec![0; MAX_FRAME]),
                head: Vec::new(),
            }),
        };
        assert!(matches!(
            big.encode_into(&mut out),
            Err(FrameError::TooLarge(_))
        ));
        // A part that does not end carries no tail.
        let mut c = vec![b'D', b'M', FRAME_VERSION, CHUNK, 0, 0];
        c.extend_from_slice(&1u32.to_le_bytes());
        c.push(0);
        c.extend_from_slice(&0u32.to_le_bytes());
        c.push(0);
        c.extend_from_slice(&1u32.to_le_bytes());
        c.push(b'x');
        assert!(matches!(Frame::decode(&c), Err(FrameError::Tag { .. })));
    }

    #[test]
    fn a_reply_buffer_is_cut_into_windows_both_sides_agree_on() {
        assert_eq!(
            StreamWindows::of(8 << 20),
            StreamWindows {
                count: 8,
                size: STREAM_WINDOW
            }
        );
        assert_eq!(
            StreamWindows::of(1 << 20),
            StreamWindows {
                count: 4,
                size: STREAM_WINDOW
            }
        );
        // A small buffer is one window of its own size.
        assert_eq!(
            StreamWindows::of(4096),
            StreamWindows {
                count: 1,
                size: 4096
            }
        );
        assert_eq!(StreamWindows::of(0).count, 0);
        assert_eq!(
            StreamWindows::of(8 << 20).offset(3),
            3 * u64::from(STREAM_WINDOW)
        );
    }
}
