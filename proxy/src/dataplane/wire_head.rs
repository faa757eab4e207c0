//! A response head in its wire form, decoded at most once: the response path reads it
//! for the cache, for a dependency's failure and for plugins' edits, and most
//! responses need none of them (nothing is decoded then).

use dpumesh_head::wire::{self, ResponseHead};

pub(super) struct WireHead<'a> {
    bytes: &'a [u8],
    /// `None` until first read; then the decoded head, or `None` if it does not decode.
    decoded: Option<Option<ResponseHead>>,
}

impl<'a> WireHead<'a> {
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            decoded: None,
        }
    }

    /// The wire form.
    pub(super) fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The decoded head (decoded now if this is the first read); `None` when the
    /// bytes are not a head.
    pub(super) fn get(&mut self) -> Option<&ResponseHead> {
        let bytes = self.bytes;
        self.decoded
            .get_or_insert_with(|| wire::decode_response(bytes).ok())
            .as_ref()
    }

    /// How many times the bytes were decoded (0 or 1), for tests.
    #[cfg(test)]
    fn decodes(&self) -> usize {
        usize::from(self.decoded.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_is_decoded_once_however_often_it_is_read_and_never_if_unread() {
        let bytes = wire::encode_response(&ResponseHead {
            status: 503,
            ..Default::default()
        })
        .unwrap();
        let unread = WireHead::new(&bytes);
        assert_eq!(unread.decodes(), 0);
        let mut head = WireHead::new(&bytes);
        assert_eq!(head.get().map(|h| h.status), Some(503));
        assert_eq!(head.get().map(|h| h.status), Some(503));
        assert_eq!(head.decodes(), 1);
        let mut bad = WireHead::new(b"not a head");
        assert!(bad.get().is_none());
        assert!(bad.get().is_none());
        assert_eq!(bad.bytes(), b"not a head");
    }
}
